"""The pool's nogil side: the job-control words, how a participant enters and leaves a job, and
the worker loop that joins every published native job without taking the GIL.

A native job is a jitted ``job(nthreads, jctrl, desc)`` (``JOB_SIGNATURE``): ``desc`` the int64
descriptor its submitter wrote (``job.JobLayout``), ``jctrl`` control words zeroed per job; it
claims its participant id from ``jctrl[JOB_JOIN]`` and sets ``jctrl[JOB_COMPLETE]`` when its last
task is done. Idle workers spin on the pool's sequence number (``load atomic acquire`` +
``pause``) before they block (``pool.CpuPool``).
"""
from __future__ import annotations

from numba import njit, types

from .. import cache as _cache
from .atomics import atomic_add, atomic_load, atomic_store, spin_relax
from .native import icall3

_cache.install()

# One control word per 128 bytes so that counters written by different threads never share a line.
CTRL_STRIDE = 16

# per-job control words (jctrl); a job's own words start at JOB_FREE
JOB_ABORT = 0
JOB_COMPLETE = CTRL_STRIDE
JOB_JOIN = 2 * CTRL_STRIDE
_JOB_PYDONE = 3 * CTRL_STRIDE
JOB_WATCHDOG = 4 * CTRL_STRIDE  # set by a native job that gave up a wait and aborted itself
JOB_FREE = 5 * CTRL_STRIDE
JCTRL_SIZE = 8192  # int64 words

# pool control words (ctrl)
_SEQ = 0
_STOP = CTRL_STRIDE
_KIND = 2 * CTRL_STRIDE
_ACTIVE = 3 * CTRL_STRIDE

# return codes of a native worker loop
_TIMEOUT, _STOPPED, _OTHER_KIND = 0, 1, 2

DESC_SIZE = 1024  # int64 words of the job descriptor a native job reads

_I64_1D = types.Array(types.int64, 1, "C")
JOB_SIGNATURE = (types.int64, _I64_1D, _I64_1D)


@njit(nogil=True, cache=True, inline="always")
def _enter(ctrl, seq):
    """Count this participant in _ACTIVE if the job ``seq`` is still open (it then leaves with
    ``_ACTIVE -= 1``); returns whether it entered. How every participant joins a job: the
    submitter closes the job (``begin()``) and then waits for _ACTIVE to reach 0."""
    atomic_add(ctrl, _ACTIVE, 1)
    if atomic_load(ctrl, _SEQ) != seq:
        atomic_add(ctrl, _ACTIVE, -1)
        return False
    return True


@njit(cache=True)
def _enter_gil(ctrl, seq):
    return _enter(ctrl, seq)


@njit(nogil=True, cache=True)
def _spin_for_job(ctrl, last, max_spins):
    """Spin until SEQ holds a published job other than ``last`` (SEQ > 0) or STOP is set."""
    for i in range(max_spins):
        v = atomic_load(ctrl, _SEQ)
        if (v > 0 and v != last) or atomic_load(ctrl, _STOP) != 0:
            return v
        spin_relax(i, 1024)
    return last


@njit(nogil=True, cache=True)
def _spin_done(jctrl, max_spins):
    """Spin until the job is complete or aborted; returns True if it is."""
    for i in range(max_spins):
        if atomic_load(jctrl, JOB_COMPLETE) != 0 or atomic_load(jctrl, JOB_ABORT) != 0:
            return True
        spin_relax(i, 256)
    return atomic_load(jctrl, JOB_COMPLETE) != 0 or atomic_load(jctrl, JOB_ABORT) != 0


@njit(nogil=True, cache=True)
def _spin_idle(ctrl, max_spins):
    """Spin until no participant is inside a job; returns True if so."""
    for i in range(max_spins):
        if atomic_load(ctrl, _ACTIVE) == 0:
            return True
        spin_relax(i, 256)
    return atomic_load(ctrl, _ACTIVE) == 0


@njit(nogil=True, cache=True)
def _join_native(ctrl, seq, addr, nth, jctrl, desc):
    """Enter the native job ``seq`` (entry point ``addr``) if it is still open, run it, leave."""
    if not _enter(ctrl, seq):
        return
    icall3(addr, nth, jctrl, desc)
    atomic_add(ctrl, _ACTIVE, -1)


@njit(nogil=True, cache=True)
def _worker_loop(ctrl, jctrl, desc, nth, last, spin_iters):
    """Join every published native job (ctrl[KIND] = the job's address) without the GIL."""
    while True:
        seq = _spin_for_job(ctrl, last, spin_iters)
        if atomic_load(ctrl, _STOP) != 0:
            return seq, _STOPPED
        if seq == last:
            return last, _TIMEOUT
        addr = atomic_load(ctrl, _KIND)
        if addr == 0:
            return last, _OTHER_KIND
        if not _enter(ctrl, seq):  # the submitter closed it meanwhile
            continue
        icall3(addr, nth, jctrl, desc)
        atomic_add(ctrl, _ACTIVE, -1)
        last = seq


@njit(nogil=True, cache=True)
def _native_noop(nth, jctrl, desc):
    # every participant that joins counts itself; the last of nth completes the job, so the
    # measurement includes waking every worker
    if atomic_add(jctrl, JOB_JOIN, 1) == nth - 1:
        atomic_store(jctrl, JOB_COMPLETE, 1)
