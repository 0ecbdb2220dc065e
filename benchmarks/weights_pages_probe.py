#!/usr/bin/env python3
"""Whether a CPU MoE layer runs slower on weights mapped from files (what ``kt.weights.load_experts``
gives: read-only views of the page cache, in 4 KiB pages) than on weights in anonymous memory
(what ``CPUMoE.from_tensors`` and the benchmarks use: NumPy asks for transparent huge pages on
arrays of 4 MiB and more).

Session 17 saw the one-core AMX INT8 GEMM (M=512, N=1536, K=2048) 1.4x faster, and steady from
one allocation to the next, with its weights and output in 2 MiB pages than in 4 KiB pages. This
probe asks the same of the whole layer: qwen3-30b-a3b, layer copies of about --pool-gb each way
(cold weights), the same packed bytes in both; "anon" copies as the benchmarks make them, "file"
copies written to files under --dir and mapped read-only (np.memmap, as the loader maps its
safetensors files). Calls alternate between the two (profile_moe.interleaved), fresh routing per
call; min and median ms per T.

Device:  PYTHONPATH=. python3 benchmarks/weights_pages_probe.py --threads 16 --out $OUT
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import write_json  # noqa: E402
from bench_moe import SHAPES, _copy, build_layer  # noqa: E402
from profile_moe import interleaved  # noqa: E402
from kt.config import QuantScheme  # noqa: E402
from kt.cpu_ops.moe import CPUMoE  # noqa: E402
from kt.cpu_ops.packing import PackedWeight  # noqa: E402
from kt.cpu_ops.pool import CpuPool  # noqa: E402


def _mapped(p: PackedWeight, stem: Path) -> PackedWeight:
    arrs = []
    for name in ("data", "scale", "wsum"):
        a = getattr(p, name)
        if a.size == 0:  # (an empty array: nothing to map)
            arrs.append(a)
            continue
        path = stem.with_name(f"{stem.name}.{name}")
        np.ascontiguousarray(a).tofile(path)
        m = np.memmap(path, dtype=a.dtype, mode="r", shape=a.shape)
        m.view(np.uint8).sum(dtype=np.int64)  # read once: the file's pages into the page cache
        arrs.append(m)
    return PackedWeight(p.scheme, p.n, p.d, p.n_pad, p.d_pad, p.group_size, *arrs)


def _huge_kib() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--pool-gb", type=float, default=2.4)
    ap.add_argument("--schemes", default="int8,int4")
    ap.add_argument("--T", default="1,512,2048")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--dir", default="/tmp/kt_pages_probe")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    res = {"thp": thp.read_text().strip() if thp.exists() else None, "rows": []}
    print(f"THP: {res['thp']}", flush=True)
    pool = CpuPool(a.threads)
    rng = np.random.default_rng(0)
    E, K, H, I = SHAPES["qwen3-30b-a3b"]
    d = Path(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    try:
        for sname in a.schemes.split(","):
            scheme = QuantScheme.parse(sname)
            t0 = time.time()
            w13, w2 = build_layer(E, H, I, scheme)
            n = max(2, -(-int(a.pool_gb * 2**30) // (w13.nbytes + w2.nbytes)))
            before = _huge_kib()
            anon = [CPUMoE(_copy(w13), _copy(w2), pool=pool) for _ in range(n)]
            mid = _huge_kib()
            file = [CPUMoE(_mapped(L.w13, d / f"{sname}{i}_w13"), _mapped(L.w2, d / f"{sname}{i}_w2"), pool=pool)
                    for i, L in enumerate(anon)]
            assert all(isinstance(L.w13.data, np.memmap) for L in file), "the loader's mapping was copied"
            print(f"{sname}: {n} copies each way in {time.time() - t0:.0f} s; anonymous huge pages "
                  f"{(mid - before) / 2**20:.2f} GiB for the anon copies", flush=True)
            for T in map(int, a.T.split(",")):
                reps = a.reps if T >= 512 else 10 * a.reps
                r = interleaved({"anon": anon, "file": file}, T, reps, rng, "qwen3-30b-a3b")
                res["rows"].append(dict(scheme=sname, T=T, copies=n, huge_gib_anon=(mid - before) / 2**20, **r))
                print(f"  T={T:5d}: anon min {r['anon']['min_ms']:.3f} med {r['anon']['median_ms']:.3f} ms | "
                      f"file min {r['file']['min_ms']:.3f} med {r['file']['median_ms']:.3f} ms | file / anon "
                      f"{r['file']['min_ms'] / r['anon']['min_ms']:.3f}", flush=True)
            del anon, file
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"wrote {write_json(a.out, 'weights_pages_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
