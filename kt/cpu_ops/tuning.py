"""MoETuning: every tuning knob of a CPUMoE call, in one frozen config.

A layer takes one at construction (``CPUMoE(..., tuning=MoETuning(...))``) and any call may
override it (``moe(x, ids, w, tuning=...)``, ``moe.submit(..., tuning=...)``; derive one with
``moe.tuning.replace(...)``). Only ``chunk_tokens`` and ``gemv_max`` can change the numbers (they
decide which tokens share a kernel call and which kernel it is, so rounding may differ within the
kernels' accuracy); the others only reorder the same arithmetic (bit-identical results) or bound
a wait.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

__all__ = ["MoETuning", "DEFAULT_WATCHDOG_S"]

DEFAULT_WATCHDOG_S = 600.0


def _count(name: str, n, positive: bool = False) -> int:
    """n as a non-negative (or positive) int; a bool or a float is refused."""
    if (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0
            or (positive and n == 0)):
        kind = "positive" if positive else "non-negative"
        raise ValueError(f"MoETuning.{name} must be a {kind} int, got {n!r}")
    return int(n)


@dataclass(frozen=True)
class MoETuning:
    """Tuning of a CPUMoE call (see the module doc).

    chunk_tokens: tokens per internal chunk (bounds scratch memory: about chunk_tokens * K *
        (2I + H) * 4 bytes plus activations, allocated only as large as the calls need). Each chunk
        reads every hit expert's weights once, so larger chunks read less: 2048 was 5 % faster than
        1024 at T=2048 on the 2-core dev machine (212 vs 225 ms). A stream-gated job takes at most
        24 chunks (``CPUMoE.max_gated_tokens``).
    blocks_per_task: (gate+up, down) 16-row blocks per (expert, rows) task; 0 = the driver's
        heuristic (about 4 tasks per thread, in multiples of 4 blocks).
    pipelined_decode: decode's down tasks wait per expert instead of behind all-thread barriers.
    tail_experts: prefill with whole-expert tasks: the last ``tail_experts`` experts of a chunk
        (the smallest; None: as many as the pool has threads, 0: none) are split into about
        ``tail_parts`` gate+up tasks and half as many down tasks, so the threads run out of work
        together. tail_parts 0 or 1: no split.
    watchdog_s: seconds a pool thread waits inside a call for another thread's work before it
        gives up: the call then ends with a RuntimeError (caused by a TimeoutError) at ``wait()``
        instead of hanging, and the pool stays usable. Legitimate waits inside one call last at
        most one expert's GEMM; the default (600 s) only catches a task that never completes (a
        bug). None or 0: wait forever. Waiting for a CUDA stream's start flag is not covered.
    y_stream_bytes: a chunk whose down outputs (y) take at least this many bytes runs its down
        GEMM with non-temporal stores where the layer's kernel set has that form (a y that large
        leaves the caches before the combine reads it).
    gemv_max: rows per expert up to which the small-M (decode) kernel runs; None = the kernel
        set's (``registry.KernelSet.gemv_max``).
    """

    chunk_tokens: int = 2048
    blocks_per_task: tuple[int, int] = (0, 0)
    pipelined_decode: bool = True
    tail_experts: int | None = None
    tail_parts: int = 4
    watchdog_s: float | None = DEFAULT_WATCHDOG_S
    y_stream_bytes: int = 64 << 20
    gemv_max: int | None = None

    def __post_init__(self):
        put = object.__setattr__
        put(self, "chunk_tokens", _count("chunk_tokens", self.chunk_tokens, positive=True))
        bpt = self.blocks_per_task
        if not isinstance(bpt, (tuple, list)) or len(bpt) != 2:
            raise ValueError(f"MoETuning.blocks_per_task must be a (gate+up, down) pair of "
                             f"non-negative ints, got {bpt!r}")
        put(self, "blocks_per_task", tuple(_count("blocks_per_task", b) for b in bpt))
        if not isinstance(self.pipelined_decode, (bool, np.bool_)):
            raise ValueError(f"MoETuning.pipelined_decode must be a bool, got {self.pipelined_decode!r}")
        put(self, "pipelined_decode", bool(self.pipelined_decode))
        if self.tail_experts is not None:
            put(self, "tail_experts", _count("tail_experts", self.tail_experts))
        put(self, "tail_parts", _count("tail_parts", self.tail_parts))
        s = self.watchdog_s
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float, np.integer, np.floating))
                              or not math.isfinite(s) or s < 0):
            raise ValueError(f"MoETuning.watchdog_s must be a non-negative number of seconds or "
                             f"None, got {s!r}")
        put(self, "watchdog_s", float(s) if s else None)
        put(self, "y_stream_bytes", _count("y_stream_bytes", self.y_stream_bytes))
        if self.gemv_max is not None:
            put(self, "gemv_max", _count("gemv_max", self.gemv_max))

    def replace(self, **changes) -> "MoETuning":
        """A copy with ``changes`` (field=value) applied and checked."""
        return dataclasses.replace(self, **changes)
