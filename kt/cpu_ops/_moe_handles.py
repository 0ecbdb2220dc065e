"""The handles of CPUMoE's calls: ``MoEHandle`` (``submit``) and ``GatedHandle`` / ``GateResult``
(``submit_gated``, a job a CUDA stream starts)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._moe_io import _finish_out
from .driver.layout import R_BAD_IDS, R_END_CYCLES, R_FINISHED, R_OPEN_CYCLES, R_OPENED
from .runtime.atomics import tsc_hz
from .runtime.pool import CpuPool


class MoEHandle:
    """An in-flight ``CPUMoE.submit``; ``wait()`` returns the [T, H] output."""

    def __init__(self, first, rest, finish):
        self._first = first
        self._rest = rest
        self._finish = finish  # the arguments of _finish_out
        self._result = None
        self._done = False

    def done(self) -> bool:
        return self._done or (self._first is not None and self._first.done() and not self._rest)

    def wait(self):
        if not self._done:
            try:
                if self._first is not None:
                    self._first.wait()
                for launch in self._rest:
                    launch().wait()
            finally:
                self._done = True
                self._rest = ()
            self._result = _finish_out(*self._finish)
        return self._result


@dataclass(frozen=True)
class GateResult:
    """How a stream-gated job ended (``GatedHandle.wait``).

    opened: its start flag was seen; finished: it published its result ("start" cleared, "done"
    set); bad_ids: routing ids outside [-1, E) that it skipped; seconds: from the start flag to
    the result (time-stamp counter); error: a participant's exception (then not finished)."""
    opened: bool
    finished: bool
    bad_ids: int
    seconds: float
    error: BaseException | None = None


class GatedHandle:
    """A job published by ``CPUMoE.submit_gated``: ``wait()`` joins it (the caller takes part
    from the start flag on) and returns a ``GateResult``; ``abort()`` releases the participants
    of a job whose start flag will never come."""

    def __init__(self, pool: CpuPool, handle, words: np.ndarray):
        self._pool = pool
        self._handle = handle
        self._words = words  # the job's own result words (driver.layout.R_*)
        self._result: GateResult | None = None

    def abort(self) -> None:
        self._pool.abort(self._handle)

    def wait(self) -> GateResult:
        if self._result is None:
            err = None
            try:
                self._handle.wait()
            except RuntimeError as exc:  # a participant raised: re-raised by PoolHandle.wait
                err = exc.__cause__ or exc
            r = self._words
            finished = bool(r[R_FINISHED]) and err is None
            cyc = int(r[R_END_CYCLES] - r[R_OPEN_CYCLES]) if finished else 0
            self._result = GateResult(bool(r[R_OPENED]), finished, int(r[R_BAD_IDS]),
                                      max(cyc, 0) / tsc_hz(), err)
        return self._result
