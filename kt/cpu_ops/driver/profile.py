"""The driver's one timing helper, and the profile arrays it books into.

A profiled call (``CPUMoE.profile``) gives the job an int64 [nth, PROF_WORDS] array: each
participant books (busy, waiting) time-stamp-counter ticks per phase into its own [PHASES, 2]
words. ``book`` is the only code in the driver that reads the clock for that; with profiling off
it is one untaken branch, so the plain call path pays nothing measurable.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .. import _align
from .. import cache as _cache
from ..runtime.atomics import cycles
from .layout import PHASES, PROF_WORDS

_cache.install()

BUSY, WAIT = 0, 1  # the two columns of a phase's profile words
NO_PHASE = -1      # ``book`` only reads the clock (the start of an interval)


@njit(nogil=True, cache=True, inline="always")
def book(prof, on, ph, col, t):
    """Add the ticks since ``t`` to prof[ph, col] (nothing for ph = NO_PHASE) and return the
    clock, so the next interval starts where this one ended; 0 (and no clock read) when ``on``
    is False."""
    if not on:
        return np.int64(0)
    now = cycles()
    if ph >= 0:
        prof[ph, col] += now - t
    return now


def new_profile(nthreads: int) -> np.ndarray:
    """A zeroed per-participant phase profile for a profiled call (each participant's words on
    their own cache lines: a shared line would be written by every participant at every phase,
    and the profiled call then ran ~20 % slower at T=1 on 16 threads)."""
    return _align.zeros((nthreads, PROF_WORDS), np.int64)


def profile_cycles(prof: np.ndarray) -> np.ndarray:
    """[threads, PHASES, 2] (busy, waiting) time-stamp-counter ticks of a ``new_profile`` array."""
    return prof[:, : PHASES * 2].reshape(prof.shape[0], PHASES, 2)
