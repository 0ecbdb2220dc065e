#!/usr/bin/env python3
"""Do this machine's CPUs share physical cores? An ALU-bound vector loop (zmm FMAs on registers:
no memory traffic) pinned to CPU 0 runs alone, then beside the same loop pinned to each other CPU
in turn, then on 1, 2, 4, ... threads at once unpinned. A CPU whose company slows CPU 0's loop
~2x is its SMT sibling; a slowdown that grows with the thread count alone is the clock (turbo,
AVX-512 licence). ``lscpu`` may say one thread per core inside a VM whose vCPUs are hyperthreads.

    PYTHONPATH=. python3 benchmarks/core_sharing_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from numba import njit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_json  # noqa: E402
from amx_probe import run_threads  # noqa: E402


@njit(nogil=True, fastmath={"contract"})
def alu(n, seed):
    """16 independent fp32 FMA chains of 16 lanes, n steps: register-bound."""
    acc = np.empty((16, 16), np.float32)
    for i in range(16):
        for j in range(16):
            acc[i, j] = seed[j] + np.float32(i)
    a = np.float32(0.999)
    b = np.float32(0.001)
    for _ in range(n):
        for i in range(16):
            for j in range(16):
                acc[i, j] = acc[i, j] * a + b
    return acc.sum()


def timed(cpus, n, seed):
    """Wall seconds of each thread's loop, thread i pinned to cpus[i] (None: not pinned)."""
    return run_threads(cpus, lambda i: (lambda: alu(n, seed)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2_000_000)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    seed = np.arange(16, dtype=np.float32) * np.float32(0.01)
    alu(10, seed)
    alone = min(timed([cpus[0]], a.steps, seed)[0] for _ in range(3))
    print(f"CPU {cpus[0]} alone: {alone * 1e3:.1f} ms", flush=True)
    res = dict(cpus=cpus, alone_s=alone, pairs={}, scaling={})
    for c in cpus[1:]:
        t = min(timed([cpus[0], c], a.steps, seed)[0] for _ in range(2))
        res["pairs"][c] = round(t / alone, 3)
        print(f"  beside CPU {c:3d}: {t / alone:5.2f}x", flush=True)
    n = 1
    while n <= len(cpus):
        ts = timed([None] * n, a.steps, seed)
        res["scaling"][n] = round(max(ts) / alone, 3)
        print(f"  {n:3d} threads unpinned: slowest {max(ts) / alone:5.2f}x, fastest {min(ts) / alone:5.2f}x",
              flush=True)
        n = n * 2 if n * 2 <= len(cpus) or n == len(cpus) else len(cpus)
        if n in res["scaling"]:
            break
    if a.out:
        write_json(a.out, "core_sharing_probe.json", res)


if __name__ == "__main__":
    main()
