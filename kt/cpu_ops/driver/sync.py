"""The driver's waits (jitted): a phase's closing barrier, a pipelined down task's wait for
its expert, and a gated job's wait for its start flag; each ends early when the job is aborted.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .. import cache as _cache
from ..runtime.atomics import atomic_add, atomic_load, atomic_store, cycles, flag_load, spin_relax
from ..runtime.worker import CTRL_STRIDE, JOB_ABORT, JOB_WATCHDOG
from .layout import G_OPEN, R_OPEN_CYCLES, R_OPENED

_cache.install()


@njit(nogil=True, cache=True)
def _wait_at_least(jctrl, words, idx, n, limit):
    """Spin until words[idx] >= n; False if the job was aborted (meanwhile or at the end). After
    ``limit`` time-stamp-counter ticks (> 0; checked every 4096 spins) it gives up: it marks the
    job JOB_WATCHDOG and aborts it, so a task that never completes (a planning bug) ends the call
    with an error at wait() instead of hanging every participant."""
    i = 0
    t0 = np.int64(0)
    while atomic_load(words, idx) < n:
        if atomic_load(jctrl, JOB_ABORT) != 0:
            return False
        i += 1
        if limit > 0 and (i & 4095) == 0:
            now = cycles()
            if t0 == 0:
                t0 = now
            elif now - t0 > limit:
                atomic_store(jctrl, JOB_WATCHDOG, 1)
                atomic_store(jctrl, JOB_ABORT, 1)
                return False
        spin_relax(i, 1024)
    return atomic_load(jctrl, JOB_ABORT) == 0


@njit(nogil=True, cache=True)
def _wait_phase(jctrl, base, n, limit):
    """Spin until the phase at ``base`` has n tasks done; False if the job was aborted."""
    return _wait_at_least(jctrl, jctrl, base + CTRL_STRIDE, n, limit)


@njit(nogil=True, cache=True)
def _open_gate(jctrl, gate, gb, res):
    """Wait until the int32 flag at address ``gate`` is set (a CUDA stream reached the job's
    start point) or another participant saw it; False if the job was aborted meanwhile. The
    participant that sees the flag first notes it in the job's result ``res``."""
    i = 0
    while atomic_load(jctrl, gb + G_OPEN) == 0:
        if flag_load(gate) != 0:
            if atomic_add(jctrl, gb + G_OPEN, 1) == 0:
                res[R_OPEN_CYCLES] = cycles()
                res[R_OPENED] = 1
            break
        if atomic_load(jctrl, JOB_ABORT) != 0:
            return False
        i += 1
        spin_relax(i, 1024)
    return True
