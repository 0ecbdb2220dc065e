"""The MoE job (jitted): the loop every participant runs, and one function per phase.

``moe_job(nth, jctrl, desc)`` is the pool's native job (``runtime.worker``): for each chunk of at
most C tokens it runs the six phases of driver/__init__.py in order, each phase's tasks claimed
from its shared counter and closed by a task-counting barrier. The phase functions read their
arrays from the descriptor (``layout.MOE_JOB``); a profiled call books every interval through
``profile.book``.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit

from .. import cache as _cache
from ..runtime.atomics import atomic_add, atomic_load, atomic_store, cycles, flag_store, spin_relax
from ..runtime.job import SLOT, array1, array2
from ..runtime.native import ptr
from ..runtime.worker import CTRL_STRIDE, JOB_ABORT, JOB_COMPLETE, JOB_FREE, JOB_JOIN
from .gemm import _down_rows, _gate_up
from .layout import (A_ACC, A_DEP, A_GU, A_HQ, A_HS, A_IDS, A_MASK, A_OFFS, A_ORDER, A_OUT, A_POS,
                     A_RSLOT, A_T13, A_T2, A_TW, A_W13D, A_W2D, A_X, A_XG, A_XS, A_Y, DEP_STRIDE,
                     G_BAD, G_FIN, PHASE_WORDS, PHASES, PIPE_ACT_MAX, PROF_WORDS, R_BAD_IDS,
                     R_END_CYCLES, R_FINISHED, RESULT_WORDS, ROW_BLOCK, S_BPT13, S_BPT2, S_CHUNK,
                     S_DONE, S_GATE, S_GEMV_MAX, S_H, S_I, S_INCR, S_LEVELS, S_NCHUNK, S_OBF16,
                     S_PIPE, S_PROF, S_PUBWAIT, S_RESULT, S_SCHEME, S_T, S_TAIL, S_TAILP, S_UPOFF,
                     S_WATCH, S_XBF16, SCHEME_BF16, TOKEN_BLOCK, gate_base)
from .plan import _arm_pipeline, _plan
from .profile import BUSY, NO_PHASE, WAIT, book
from .rows import _act_rows, _combine_tokens, _quantise_tokens
from .sync import _open_gate, _wait_at_least, _wait_phase

_cache.install()

NTASKS = 2 * CTRL_STRIDE  # a phase's task count, after its claim and done words


@njit(nogil=True, cache=True)
def _quantise(desc, me, t0, ta, tb):
    """Tokens [ta, tb) of the chunk starting at t0 -> their activation rows (phase 1's work)."""
    acc = array2(desc, A_ACC, np.float32)[me]
    pos = array2(desc, A_POS, np.int32)
    xg = array2(desc, A_XG, np.int8)  # activation rows as bytes (bf16 rows are viewed as uint16)
    xs = array1(desc, A_XS, np.float32)
    bf16 = desc[S_SCHEME] == SCHEME_BF16
    if desc[S_XBF16] != 0:
        _quantise_tokens(array2(desc, A_X, np.uint16), t0, ta, tb, pos, desc[S_H], xg, xs, acc,
                         bf16, desc[S_LEVELS])
    else:
        _quantise_tokens(array2(desc, A_X, np.float32), t0, ta, tb, pos, desc[S_H], xg, xs, acc,
                         bf16, desc[S_LEVELS])


@njit(nogil=True, cache=True)
def _phase_plan(desc, jctrl, me, nth, base, gb, t0, t1):
    """Phase 0 (one task): bucket the chunk, then write the task counts of phases 1-5. A chunk
    of one token block is quantised here (a barrier less in decode); a chunk whose tasks are
    whole experts (fused) or split within experts with small activations (pipelined decode)
    runs its activations and down GEMMs inside phase 2."""
    offs = array1(desc, A_OFFS, np.int32)
    order = array1(desc, A_ORDER, np.int32)
    tasks13 = array2(desc, A_T13, np.int32)
    R = desc[S_LEVELS]
    rows, n13, n2, fused, bad = _plan(t0, t1, array2(desc, A_IDS, np.int64), array1(desc, A_MASK, np.uint8),
                                      array2(desc, A_POS, np.int32), array1(desc, A_RSLOT, np.int32),
                                      offs, order, tasks13, array2(desc, A_T2, np.int32),
                                      desc[A_W13D * SLOT + 2], desc[A_W2D * SLOT + 2], nth,
                                      desc[S_BPT13], desc[S_BPT2], R, desc[S_TAIL], desc[S_TAILP])
    jctrl[gb + G_BAD] += bad
    nt = t1 - t0
    # the plan phase's own ntasks word carries the chunk's row count
    jctrl[base + NTASKS] = rows
    nq = (nt + TOKEN_BLOCK - 1) // TOKEN_BLOCK
    if nq == 1:
        _quantise(desc, me, t0, t0, t1)
        nq = 0
    jctrl[base + PHASE_WORDS + NTASKS] = nq
    # a fused chunk with split experts (n2 > 0) runs its parts in the same order
    pipe = (fused and n2 > 0) or (
        desc[S_PIPE] != 0 and not fused and rows > 0
        and (offs[order[0] + 1] - offs[order[0]]) * desc[S_I] <= PIPE_ACT_MAX)
    if pipe:
        _arm_pipeline(array1(desc, A_DEP, np.int64), tasks13, n13)
    # pipelined: phase 2 runs the down tasks too, after the gate+up tasks
    jctrl[base + 2 * PHASE_WORDS + NTASKS] = n13 + n2 if pipe else n13
    jctrl[base + 2 * PHASE_WORDS + NTASKS + 1] = n13  # beside ntasks
    # fused: each gate+up task is a whole expert and also runs its activations and its down
    # GEMM (hq stays in the task's cache)
    jctrl[base + 4 * PHASE_WORDS + NTASKS] = 0 if fused or pipe else n2
    # fused: the gate+up tasks compute the activations; else one task per row block (single
    # rows when there are few, so decode's rows spread over threads)
    rb = (ROW_BLOCK if rows >= ROW_BLOCK * R * nth else 1) * R
    jctrl[base + 3 * PHASE_WORDS + NTASKS + 1] = rb  # beside ntasks
    jctrl[base + 3 * PHASE_WORDS + NTASKS] = 0 if fused or pipe else (rows + rb - 1) // rb
    jctrl[base + 5 * PHASE_WORDS + NTASKS] = (nt + TOKEN_BLOCK - 1) // TOKEN_BLOCK


@njit(nogil=True, cache=True)
def _phase_gate_up(desc, jctrl, me, base, n, i, prof, on, t):
    """Phase 2, task i of n: an (expert, row-block range) gate+up task; in a pipelined chunk the
    tasks from the gate+up count on are down tasks, each waiting for its own expert's
    activations, and the last gate+up task of an expert computes them. A whole expert (the
    plan's "fused") also runs its activations and down GEMM while its rows are in this core's
    cache; a profile books those under phases 3 and 4. Returns (False if the job was aborted
    while waiting, the profile clock)."""
    n13c = jctrl[base + NTASKS + 1]
    down = i >= n13c
    j = i - n13c if down else i
    tasks = array2(desc, A_T2 if down else A_T13, np.int32)
    offs = array1(desc, A_OFFS, np.int32)
    e = tasks[j, 0]
    r0 = offs[e]
    r1 = offs[e + 1]
    nb0 = np.int64(tasks[j, 1])
    nb1 = np.int64(tasks[j, 2])
    R = desc[S_LEVELS]
    small = r1 - r0 <= desc[S_GEMV_MAX] * R
    scheme = desc[S_SCHEME]
    bf16 = scheme == SCHEME_BF16
    hq = array2(desc, A_HQ, np.int8)
    hs = array1(desc, A_HS, np.float32)
    y = array2(desc, A_Y, np.float32)
    dep = array1(desc, A_DEP, np.int64)
    if down:  # pipelined: wait for the expert's activations, then its down rows
        t = book(prof, on, 2, BUSY, t)
        ok = _wait_at_least(jctrl, dep, e * DEP_STRIDE + 1, 1, desc[S_WATCH])
        t = book(prof, on, 4, WAIT, t)
        if not ok:
            return False, t
        _down_rows(desc, scheme, e, r0, r1, nb0, nb1, small, hq, hs, y)
        return True, book(prof, on, 4, BUSY, t)
    gu = array2(desc, A_GU, np.float32)
    acc = array2(desc, A_ACC, np.float32)[me]
    whole = nb0 == 0 and nb1 == desc[A_W13D * SLOT + 2]
    t = _gate_up(desc, scheme, me, e, r0, r1, nb0, nb1, small, whole, array2(desc, A_XG, np.int8),
                 array1(desc, A_XS, np.float32), array1(desc, A_RSLOT, np.int32),
                 array2(desc, A_POS, np.int32).shape[1], R, gu, hq, hs, acc, bf16, prof, on, t)
    if whole:
        t = book(prof, on, 2, BUSY, t)
        _down_rows(desc, scheme, e, r0, r1, np.int64(0), desc[A_W2D * SLOT + 2], small, hq, hs, y)
        t = book(prof, on, 4, BUSY, t)
    elif n > n13c and atomic_add(dep, e * DEP_STRIDE, -1) == 1:
        # pipelined (decode, or a fused chunk's split experts): the expert's last gate+up task
        # computes its activations and releases its down tasks
        t = book(prof, on, 2, BUSY, t)
        _act_rows(gu, r0, r1, desc[S_I], desc[S_UPOFF], hq, hs, acc, bf16, R, 0)
        atomic_store(dep, e * DEP_STRIDE + 1, 1)
        t = book(prof, on, 3, BUSY, t)
    return True, t


@njit(nogil=True, cache=True)
def _phase_act(desc, jctrl, me, pbase, base, i):
    """Phase 3, task i: SiLU(gate) * up of a block of the chunk's gathered rows, requantised."""
    nrows = jctrl[pbase + NTASKS]
    rb = jctrl[base + NTASKS + 1]
    ra = i * rb
    _act_rows(array2(desc, A_GU, np.float32), ra, min(nrows, ra + rb), desc[S_I], desc[S_UPOFF],
              array2(desc, A_HQ, np.int8), array1(desc, A_HS, np.float32),
              array2(desc, A_ACC, np.float32)[me], desc[S_SCHEME] == SCHEME_BF16, desc[S_LEVELS], 0)


@njit(nogil=True, cache=True)
def _phase_down(desc, i):
    """Phase 4, task i: an (expert, row-block range) down task."""
    tasks = array2(desc, A_T2, np.int32)
    offs = array1(desc, A_OFFS, np.int32)
    e = tasks[i, 0]
    r0 = offs[e]
    r1 = offs[e + 1]
    small = r1 - r0 <= desc[S_GEMV_MAX] * desc[S_LEVELS]
    _down_rows(desc, desc[S_SCHEME], e, r0, r1, np.int64(tasks[i, 1]), np.int64(tasks[i, 2]), small,
               array2(desc, A_HQ, np.int8), array1(desc, A_HS, np.float32), array2(desc, A_Y, np.float32))


@njit(nogil=True, cache=True)
def _phase_combine(desc, me, t0, ta, tb):
    """Phase 5 for tokens [ta, tb): out[t] = (out[t] if incremental) + sum_k w[t,k] y[row]."""
    pos = array2(desc, A_POS, np.int32)
    tw = array2(desc, A_TW, np.float32)
    y = array2(desc, A_Y, np.float32)
    acc = array2(desc, A_ACC, np.float32)[me]
    incremental = desc[S_INCR] != 0
    if desc[S_OBF16] != 0:
        _combine_tokens(array2(desc, A_OUT, np.uint16), t0, ta, tb, pos, tw, y, desc[S_H], acc,
                        incremental, desc[S_LEVELS])
    else:
        _combine_tokens(array2(desc, A_OUT, np.float32), t0, ta, tb, pos, tw, y, desc[S_H], acc,
                        incremental, desc[S_LEVELS])


@njit(nogil=True, cache=True)
def _publish(desc, jctrl, gb, gate, res):
    """The end of a stream-gated job: the first participant out publishes the result to the
    stream ("start" is consumed, then "done" set: the stream writes "start" again only after it
    saw "done") and alone marks the job complete, after its result words: another participant
    doing so could let the waiting thread read R_FINISHED before it is written (the handle then
    reports the job aborted: seen on the H200 with 17 threads on 16 cores, the writer preempted
    between its G_FIN claim and its stores)."""
    if atomic_add(jctrl, gb + G_FIN, 1) != 0:
        return
    if desc[S_PUBWAIT] > 0:
        t_pub = cycles()
        while cycles() - t_pub < desc[S_PUBWAIT]:
            spin_relax(0, 1)
    res[R_BAD_IDS] = jctrl[gb + G_BAD]
    res[R_END_CYCLES] = cycles()
    res[R_FINISHED] = 1
    flag_store(gate, 0)
    flag_store(desc[S_DONE], 1)
    atomic_store(jctrl, JOB_COMPLETE, 1)


@njit(nogil=True, cache=True)
def moe_job(nth, jctrl, desc):
    """The MoE job (driver/__init__.py): every participant runs this; it returns when the job is
    complete (or aborted). Scheme, x and out dtypes come from desc, so one compiled (and
    disk-cached) function serves every layer."""
    me = atomic_add(jctrl, JOB_JOIN, 1)
    if me >= nth:
        return
    gate = desc[S_GATE]
    gb = gate_base(desc[S_NCHUNK])
    ra = desc[S_RESULT]
    res = carray(ptr(ra if gate != 0 else np.int64(desc.ctypes.data), np.int64), (RESULT_WORDS,))
    if gate != 0 and not _open_gate(jctrl, gate, gb, res):
        return
    pa = desc[S_PROF]  # profile of this participant (never touched when 0)
    on = pa != 0
    prof = carray(ptr(pa + me * PROF_WORDS * 8 if on else np.int64(desc.ctypes.data), np.int64),
                  (PHASES, 2))
    T = desc[S_T]
    C = desc[S_CHUNK]
    for c in range(desc[S_NCHUNK]):
        t0 = c * C
        t1 = min(T, t0 + C)
        pbase = JOB_FREE + c * PHASES * PHASE_WORDS
        for ph in range(PHASES):
            base = pbase + ph * PHASE_WORDS
            n = 1 if ph == 0 else atomic_load(jctrl, base + NTASKS)
            if n == 0:
                # a phase without tasks (decode has three, a fused prefill chunk two): no claim
                # on its shared counter (an atomic add on one line by every participant) and no
                # barrier; whatever a later phase reads was finished before the last barrier
                continue
            while True:
                if atomic_load(jctrl, JOB_ABORT) != 0:
                    return
                i = atomic_add(jctrl, base, 1)
                if i >= n:
                    break
                t = book(prof, on, NO_PHASE, BUSY, 0)
                if ph == 0:
                    _phase_plan(desc, jctrl, me, nth, base, gb, t0, t1)
                elif ph == 1:
                    ta = t0 + i * TOKEN_BLOCK
                    _quantise(desc, me, t0, ta, min(t1, ta + TOKEN_BLOCK))
                elif ph == 2:
                    ok, t = _phase_gate_up(desc, jctrl, me, base, n, i, prof, on, t)
                    if not ok:
                        return
                elif ph == 3:
                    _phase_act(desc, jctrl, me, pbase, base, i)
                elif ph == 4:
                    _phase_down(desc, i)
                else:
                    ta = t0 + i * TOKEN_BLOCK
                    _phase_combine(desc, me, t0, ta, min(t1, ta + TOKEN_BLOCK))
                book(prof, on, ph, BUSY, t)
                atomic_add(jctrl, base + CTRL_STRIDE, 1)
            t = book(prof, on, NO_PHASE, WAIT, 0)
            ok = _wait_phase(jctrl, base, n, desc[S_WATCH])
            book(prof, on, ph, WAIT, t)
            if not ok:
                return
    if gate != 0:
        _publish(desc, jctrl, gb, gate, res)
        return
    atomic_store(jctrl, JOB_COMPLETE, 1)
