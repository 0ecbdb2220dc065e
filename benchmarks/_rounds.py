"""Interleaved timing rounds for the one-core kernel probes (amx_*_probe.py)."""
from __future__ import annotations

import time


def best_of(f, reps: int = 5) -> float:
    """The fastest of ``reps`` calls of f, in seconds."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def interleaved_rounds(cases: dict, rounds: int, between=None, reps: int = 5):
    """({key: [seconds, one per round]}, [between()'s results]): each case is called once first
    (compile, warm), then every round calls ``between`` (if given; e.g. the tile peak) and times
    every case in turn (best of ``reps`` calls), so a shared machine's drift falls on all."""
    for f in cases.values():
        f()
    times = {k: [] for k in cases}
    extra = []
    for _ in range(rounds):
        if between is not None:
            extra.append(between())
        for k, f in cases.items():
            times[k].append(best_of(f, reps))
    return times, extra


def amx_int8_peak(K, iters: int = 200000, bf16: bool = False, zero: bool = True) -> float:
    """The tile-resident int8 rate of this core now, TOPS (K: kt.cpu_ops.kernels_amx); bf16: the
    bf16 rate, TFLOPS. zero: on zeroed tiles (the highest rate); False: on random tiles, the data
    a GEMM multiplies (dev, session 26: 0.85-0.95x the zero-tile rate)."""
    t0 = time.perf_counter()
    ops = (K.peak_bf16 if bf16 else K.peak_int8)(iters, zero)
    return ops / (time.perf_counter() - t0) / 1e12
