"""Decode-sized MoE calls on an AMX host: AMX kernels vs the AVX-512 ones, side by side.

Which kernel family should small-M (decode) calls use where both run? Each scheme's layer is built
once (several copies, so weights are cold), then CPUMoE calls with variant="amx" and
variant="avx512_bf16" alternate on the same pool and the same fresh routing.

    PYTHONPATH=. python3 benchmarks/decode_variants.py --threads 14 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_moe import _copy, build_layer, routing  # noqa: E402
from kt.config import QuantScheme  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.moe import CPUMoE  # noqa: E402
from kt.cpu_ops.pool import CpuPool  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=14)
    ap.add_argument("--T", default="1,4,32")
    ap.add_argument("--schemes", default="int8,int4,bf16")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--budget-s", type=float, default=120)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    t_start = time.time()
    E, K, H, I = 128, 8, 2048, 768
    variants = [v for v in ("amx", "avx512_bf16") if v in isa.runnable_variants()]
    pool = CpuPool(a.threads)
    rng = np.random.default_rng(0)
    res = {"threads": a.threads, "variants": variants, "rows": []}
    for sname in a.schemes.split(","):
        if time.time() - t_start > a.budget_s:
            res.setdefault("skipped", []).append(sname)
            continue
        scheme = QuantScheme.parse(sname)
        w13, w2 = build_layer(E, H, I, scheme)
        copies = [(w13, w2)] + [(_copy(w13), _copy(w2)) for _ in range(a.copies - 1)]
        layers = {v: [CPUMoE(p, q, pool=pool, variant=v) for p, q in copies] for v in variants}
        for T in (int(t) for t in a.T.split(",")):
            x = rng.standard_normal((T, H), dtype=np.float32)
            times = {v: [] for v in variants}
            for r in range(a.reps + 2):
                ids, w = routing(rng, T, E, K)
                for v in variants:
                    layer = layers[v][r % a.copies]
                    t0 = time.perf_counter()
                    layer(x, ids, w)
                    if r >= 2:
                        times[v].append(time.perf_counter() - t0)
            row = {"scheme": sname, "T": T}
            for v in variants:
                row[f"{v}_min_ms"] = min(times[v]) * 1e3
                row[f"{v}_med_ms"] = statistics.median(times[v]) * 1e3
            row["kernel_variants"] = {v: layers[v][0].variant for v in variants}
            res["rows"].append(row)
            print(row, flush=True)
            Path(a.out, "decode_variants.json").write_text(json.dumps(res, indent=1))
    Path(a.out, "decode_variants.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
