"""The CPU pool a layer runs on when its caller gave none."""
from __future__ import annotations

import os

__all__ = ["layer_pool"]


def layer_pool(gpu: bool):
    """The process's pool for layers that drive a GPU (``gpu``) or not.

    A layer with a GPU leaves two of the process's CPUs free: one for the thread that launches GPU
    work and one for the stream service thread, which joins the pool's jobs as a worker. On the
    H200 machine's 16 cores a T=1 hybrid layer took 4.8 ms with 15 pool threads (threads
    preempting each other) and 0.57 ms with 14 (``benchmarks/bench_hybrid.py``). KT_NUM_THREADS
    overrides the count. Without a GPU the pool takes every CPU.
    """
    from ..config import get_config
    from ..cpu_ops import default_pool

    n = get_config().num_threads
    if n is None and gpu:
        n = max(1, len(os.sched_getaffinity(0)) - 2)
    return default_pool(n)
