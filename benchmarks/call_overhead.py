"""The fixed cost of a CPU MoE call, against the pool's thread count.

A T=1 call of a qwen3-30b-a3b-shaped layer with every expert masked runs the whole call path (Python
checks, descriptor, pool hand-off, the driver's plan and barriers, combine) and no GEMM; the pool's
empty native job is the hand-off alone. Inputs as numpy fp32 arrays and as torch bf16 tensors (what a
model passes; their conversion is part of the call). Prints and writes call_overhead.json under --out.

    PYTHONPATH=. python3 benchmarks/call_overhead.py --threads 1,4,8,16 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def main(argv=None):
    from kt.cpu_ops.moe import CPUMoE
    from kt.cpu_ops.pool import CpuPool
    from kt.testing import random_expert_weights

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--inputs", default="numpy,torch",
                    help="numpy fp32 arrays, and/or torch bf16 tensors as a model passes them")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    E, K, H, I = 16, 8, 2048, 768  # the call path does not depend on E beyond the mask
    g, u, d = random_expert_weights(E, H, I, seed=1)
    rows = []
    for nt in (int(t) for t in a.threads.split(",")):
        pool = CpuPool(nt)
        moe = CPUMoE.from_tensors(g, u, d, scheme="int8", pool=pool)
        x = np.random.default_rng(0).standard_normal((1, H), dtype=np.float32)
        ids = np.arange(K).reshape(1, K)
        w = np.full((1, K), 1.0 / K, np.float32)
        masked = np.ones(E, bool)
        for kind in a.inputs.split(","):
            if kind == "torch":
                import torch

                args = (torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(ids),
                        torch.from_numpy(w))
            elif kind == "numpy":
                args = (x, ids, w)
            else:
                raise SystemExit(f"--inputs: numpy or torch, got {kind!r}")
            for _ in range(200):
                moe(*args, gpu_mask=masked)
            ts = []
            for _ in range(a.calls):
                t0 = time.perf_counter()
                moe(*args, gpu_mask=masked)
                ts.append(time.perf_counter() - t0)
            ts.sort()
            hand = pool.handoff_overhead_us(repeats=a.calls // 4)
            r = {"threads": nt, "inputs": kind, "empty_call_min_us": round(ts[0] * 1e6, 2),
                 "empty_call_median_us": round(ts[len(ts) // 2] * 1e6, 2),
                 "empty_call_p90_us": round(ts[int(len(ts) * 0.9)] * 1e6, 2),
                 "handoff_min_us": round(hand["min"], 2), "handoff_median_us": round(hand["median"], 2)}
            rows.append(r)
            print(f"threads {nt:3d}, {kind:5s} inputs: empty call min {r['empty_call_min_us']:.1f} us, "
                  f"median {r['empty_call_median_us']:.1f}, p90 {r['empty_call_p90_us']:.1f}; pool "
                  f"hand-off min {r['handoff_min_us']:.1f}, median {r['handoff_median_us']:.1f}", flush=True)
        pool.shutdown()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "call_overhead.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
