"""The driver's plan (jitted): bucket a chunk's (token, slot) pairs by expert and list the
(expert, row-block range) tasks of its gate+up and down phases (driver/__init__.py explains the
task shapes).
"""
from __future__ import annotations

from numba import njit

from .. import cache as _cache
from .layout import DEP_STRIDE, TASKS_PER_THREAD

_cache.install()


@njit(nogil=True, cache=True)
def _blocks_per_task(nblocks, n_active, nthreads, fixed):
    """Row blocks per (expert, rows) task: enough tasks for TASKS_PER_THREAD per thread, in
    multiples of 4 blocks (the kernels' block group)."""
    if fixed > 0:
        return min(fixed, nblocks)
    target = nthreads * TASKS_PER_THREAD
    total = nblocks * n_active
    b = (total + target - 1) // target
    b = (b + 3) // 4 * 4
    return max(1, min(b, nblocks))


@njit(nogil=True, cache=True)
def _part_blocks(nblocks, parts):
    """Row blocks per task for about ``parts`` tasks over nblocks, in multiples of 4 blocks."""
    b = ((nblocks + parts - 1) // parts + 3) // 4 * 4
    return max(1, min(b, nblocks))


@njit(nogil=True, cache=True)
def _plan(t0, t1, ids, mask, pos, rslot, offs, order, tasks13, tasks2, nb13, nb2, nth, bpt13, bpt2,
          R, tail, tailp):
    """Bucket (token, slot) pairs of tokens [t0, t1) by expert. Returns (rows, n13, n2, fused, bad):
    fused when every gate+up task covers a whole expert (then it also computes the expert's
    activations and down GEMM: phases 3 and 4 have no tasks). In a fused chunk the last ``tail``
    experts of the order (the smallest, taken last) are split instead, their gate+up into about
    ``tailp`` tasks and their down into half as many, listed after the whole experts: tasks13
    holds n13 gate+up tasks, whole or part, and tasks2 the n2 down tasks of the split experts only
    (the pipelined order, see moe_job). The last round of whole experts left threads idle for up
    to a task's length behind the slowest one; parts end closer together.

    mask[e] != 0: expert e is computed elsewhere (the GPU), skipped like -1.
    pos[t - t0, k]: first of the R gathered rows of slot (t, k), or -1; rslot[r]: the slot
    (t - t0) * K + k of gathered row r; offs[e]..offs[e+1]: rows of expert e (R per slot: the
    levels of two-level activations are consecutive rows). Ids
    outside [0, E) are skipped like -1 (a stream-gated job's ids were never checked in Python);
    bad counts those outside [-1, E).
    """
    E = offs.shape[0] - 1
    K = ids.shape[1]
    for e in range(E + 1):
        offs[e] = 0
    bad = 0
    for t in range(t0, t1):
        for k in range(K):
            e = ids[t, k]
            if e >= 0 and e < E:
                if mask[e] == 0:
                    offs[e + 1] += R
            elif e != -1:
                bad += 1
    n_act = 0
    for e in range(E):
        if offs[e + 1] > 0:
            # insertion by count, biggest first (E is small)
            c = offs[e + 1]
            j = n_act
            while j > 0 and offs[order[j - 1] + 1] < c:
                order[j] = order[j - 1]
                j -= 1
            order[j] = e
            n_act += 1
    # counts -> starts; fill rows using offs[e] as a cursor; then shift back to starts
    offs[0] = 0
    for e in range(E):
        offs[e + 1] += offs[e]
    run = offs[E]
    for t in range(t0, t1):
        for k in range(K):
            e = ids[t, k]
            if e >= 0 and e < E and mask[e] == 0:
                pos[t - t0, k] = offs[e]
                for lv in range(R):
                    rslot[offs[e] + lv] = (t - t0) * K + k
                offs[e] += R
            else:
                pos[t - t0, k] = -1
    for e in range(E, 0, -1):
        offs[e] = offs[e - 1]
    offs[0] = 0
    b13 = _blocks_per_task(nb13, n_act, nth, bpt13)
    b2 = _blocks_per_task(nb2, n_act, nth, bpt2)
    fused = b13 >= nb13
    split = 0
    # only when a part is smaller than the expert: a "part" covering all blocks would run as a
    # whole expert, which never releases down tasks (moe_job)
    if fused and tailp > 1 and _part_blocks(nb13, tailp) < nb13:
        # at most half the experts, and only as many part tasks as tasks13 has room for
        split = min(tail, n_act // 2, (tasks13.shape[0] - n_act) // (tailp - 1))
        b13 = _part_blocks(nb13, tailp)
        b2 = _part_blocks(nb2, max(1, tailp // 2))
    n13 = 0
    n2 = 0
    for a in range(n_act):
        e = order[a]
        whole = fused and a < n_act - split
        step13 = nb13 if whole else b13
        for b0 in range(0, nb13, step13):
            tasks13[n13, 0] = e
            tasks13[n13, 1] = b0
            tasks13[n13, 2] = min(b0 + step13, nb13)
            n13 += 1
        if not whole:
            for b0 in range(0, nb2, b2):
                tasks2[n2, 0] = e
                tasks2[n2, 1] = b0
                tasks2[n2, 2] = min(b0 + b2, nb2)
                n2 += 1
    return run, n13, n2, fused, bad


@njit(nogil=True, cache=True)
def _arm_pipeline(dep, tasks13, n13):
    """Per-expert words of a pipelined chunk: gate+up tasks left = the expert's task count, not ready."""
    for j in range(n13):
        e = tasks13[j, 0]
        dep[e * DEP_STRIDE] = 0
        dep[e * DEP_STRIDE + 1] = 0
    for j in range(n13):
        dep[tasks13[j, 0] * DEP_STRIDE] += 1
