"""The ISA-agnostic MoE expert driver (jitted code only; the Python API is in moe.py).

One job computes, for tokens [0, T) of x [T, H]:
    out[t] (+)= sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)),  e = ids[t,k] on the CPU.
It runs on every participant of a CpuPool job, in chunks of at most C tokens, each chunk in six
phases separated by task-counting barriers (a phase ends when all its tasks are done, whoever ran
them, so threads may join late):
    0 plan      (1 task)       bucket the chunk's (token, slot) pairs by expert -> rows of the
                               gathered buffers; list the (expert, row-block range) tasks
    1 quantise  (token blocks) x -> int8 + per-token scale (or bf16), once per token with a
                               CPU slot (R rows: two-level activations have two)
    2 gate+up   (dynamic)      gu[rows of e] = xq[tokens of e's rows] @ w13[e]^T   [T_e, 2I] fp32,
                               the rows' activations gathered into the participant's scratch
                               per kernel call (at most S_GCH rows)
    3 act       (row blocks)   h = silu(gate) * up, requantised per row (or bf16-rounded)
    4 down      (dynamic)      y[rows of e] = hq[rows of e] @ w2[e]^T     [T_e, H] fp32
    5 combine   (token blocks) out[t] = (out[t] if incremental) + sum_k w[t,k] * y[row(t,k)]
A stream-gated job (desc[S_GATE] != 0: the decode path of a hybrid layer) is published before its
inputs exist: its participants spin at entry until a CUDA stream sets the int32 "start" flag (after
copying the inputs into pinned memory), and the first participant to finish clears "start" and sets
"done", so no Python runs between the stream reaching the CPU part and the stream going on.
Tasks of phases 2 and 4 are (expert, row-block range) pairs, biggest experts first; their size is
a pure function of the work and the thread count (``_blocks_per_task``): in decode each expert's
rows are split over the threads, in prefill whole experts are handed out dynamically. When every
task is a whole expert ("fused", prefill), a phase-2 task runs the expert's gate+up, activations
and down back to back (its rows stay in that core's caches: the gate+up outputs go to the
participant's own scratch when S_GUS rows hold them, so they never reach memory) and phases 3 and
4 have no tasks; a chunk of at most TOKEN_BLOCK tokens is quantised by the plan task (one barrier
less in decode).
Pipelined decode (desc[S_PIPE] != 0, tasks split within experts and every expert's activations small,
<= PIPE_ACT_MAX elements): phase 2 lists the gate+up tasks and then the down tasks, and phases 3 and
4 have none; the participant finishing an expert's last gate+up task computes its activations and
marks it ready (per-expert words in A_DEP), and a down task waits only for its own expert. Two
all-thread barriers (and the waits of threads idle behind the slowest gate+up and act tasks) go,
and down tasks stream weights while other experts' gate+up tasks are still running.
A fused chunk runs its last S_TAIL experts (the smallest, taken last) in the same pipelined order:
split into gate+up and down part tasks (about S_TAILP and S_TAILP / 2 of them) listed after the
whole experts, so the threads run out of work closer together than one whole expert apart.

The GEMM micro-kernels (kt/cpu_ops/README.md contract) reach this code as addresses of their
compiled entry points in the descriptor (``icall8``/``icall5``: an indirect call, so their IR is
never linked and code-generated again here), and arrays as raw addresses and shapes, so the job is
compiled once per scheme and x/out dtype (and cached on disk), and the pool's worker loop never
needs the GIL.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic, overload

from . import cache as _cache
from .kernels.actquant import (_u32_as_f32, absmax_bits, bf16_bits_to_f32, bf16_row, f32_to_bf16_bits, quant_row_i8,
                       quant_row_i8_max)
from .pool import (CTRL_STRIDE, JOB_ABORT, JOB_COMPLETE, JOB_FREE, JOB_JOIN, JOB_WATCHDOG, atomic_add,
                   atomic_load, atomic_store, flag_load, flag_store, icall_codegen,
                   native_address, spin_relax)

_cache.install()

SCHEME_INT8, SCHEME_INT4, SCHEME_BF16 = 0, 1, 2

# ----------------------------------------------------------------------------- descriptor layout

SLOT = 8  # words per array slot: address, then up to 5 dims
A_X, A_OUT, A_IDS, A_TW, A_MASK = 0, 1, 2, 3, 4
A_W13D, A_W13S, A_W13W, A_W2D, A_W2S, A_W2W = 5, 6, 7, 8, 9, 10
A_POS, A_OFFS, A_ORDER, A_T13, A_T2 = 11, 12, 13, 14, 15
A_XG, A_XS, A_GU, A_HQ, A_HS, A_Y, A_ACC = 16, 17, 18, 19, 20, 21, 22
A_DEP = 23  # int64 [E * DEP_STRIDE]: per expert, gate+up tasks left and "activations ready"
A_RSLOT = 24  # int32 [rows]: gathered row -> its slot (t - t0) * K + k
# per-participant scratch, int8 [nth, bytes each]: gathered activation rows and their scales,
# gate+up outputs of a whole-expert task (kept in that core's cache)
A_XGS, A_XSS, A_GUS = 25, 26, 27
# INT4 ratio tables of w13 / w2 ([E, 1, rows, 16] fp32, packing.int4_ratio_table), given to the
# small-M kernel in place of the group scales when the layer has them (address 0: none), and to
# the large-M kernel too if S_TABM
A_W13R, A_W2R = 28, 29
N_SLOTS = 30
S_T, S_K, S_E, S_H, S_I, S_UPOFF, S_CHUNK, S_INCR = 256, 257, 258, 259, 260, 261, 262, 263
S_GEMV_MAX, S_GS13, S_GS2, S_NCHUNK, S_BPT13, S_BPT2 = 264, 265, 266, 267, 268, 269
D_KV13, D_KM13, D_KV2, D_KM2 = 270, 271, 272, 273  # kernel entry points (kernel_address)
S_SCHEME, S_XBF16, S_OBF16 = 274, 275, 276
S_PROF = 277  # address of an int64 [nth, PROF_WORDS] profile: per participant [PHASES, 2] (busy,
              # waiting cycles) at the start of its own PROF_WORDS words; 0 = off
S_LEVELS = 278  # activation rows per (token, slot): 1, or 2 for two-level int8 ("int8x2")
S_GATE, S_DONE = 279, 280  # stream-gated job: int32 "start" / "done" flag addresses (0 = none)
S_RESULT = 281  # a gated job's own int64 [RESULT_WORDS] result (see R_*), its handle's to read
S_PIPE = 282  # 1: pipelined decode allowed (see the module docstring)
S_GCH = 283   # rows per gate+up kernel call (the A_XGS rows of a participant)
S_GUS = 284   # rows of a participant's A_GUS (0: whole-expert tasks write the shared gu rows)
S_TAIL = 285  # whole-expert chunks: this many of the smallest experts are split into part tasks
S_TAILP = 286  # ... their gate+up into about this many tasks, their down into half as many
S_WATCH = 287  # time-stamp-counter ticks a participant waits for another's work before it aborts
               # the job (JOB_WATCHDOG), 0 = forever (CPUMoE.watchdog_s)
S_TABM = 288  # 1: the large-M INT4 kernel reads the ratio tables (A_W13R / A_W2R) as well
S_PUBWAIT = 289  # tests: time-stamp-counter ticks a gated job's publisher waits between claiming
                 # the publication and writing the result (widens that window; 0 in use)
DESC_WORDS = 290  # the words above (a layer's template covers them all)
R_OPENED, R_FINISHED, R_BAD_IDS, R_OPEN_CYCLES, R_END_CYCLES = 0, 1, 2, 3, 4
RESULT_WORDS = 5

PHASES = 6
PROF_WORDS = 16  # words per participant in a profile (128 bytes: no two participants share a line)
PHASE_WORDS = 3 * CTRL_STRIDE  # claim, done, ntasks: one line each
TOKEN_BLOCK = 8   # tokens per quantise / combine task
ROW_BLOCK = 8     # gathered rows per activation task
TASKS_PER_THREAD = 4
DEP_STRIDE = 8    # one cache line of A_DEP per expert: [0] gate+up tasks left, [1] ready
PIPE_ACT_MAX = 8192  # pipelined decode only if every expert's activations (rows x I) are this small


# words after the phases of the last chunk (a gated job's): gate open, finishers, ids outside
# [-1, E) skipped. What the job's handle reads goes to the job's own result array (S_RESULT), not
# here: the pool's control words are zeroed by the next job, which another thread may begin first.
G_OPEN, G_FIN, G_BAD = 0, CTRL_STRIDE, 2 * CTRL_STRIDE
GATE_WORDS = 3 * CTRL_STRIDE


def jctrl_words(nchunks: int) -> int:
    """Control words a job over ``nchunks`` chunks needs."""
    return JOB_FREE + nchunks * PHASES * PHASE_WORDS + GATE_WORDS


@njit(nogil=True, cache=True)
def gate_base(nchunks):
    """Index in jctrl of a gated job's own words (G_OPEN ...)."""
    return JOB_FREE + nchunks * PHASES * PHASE_WORDS


# ----------------------------------------------------------------------------- scalar helpers

@intrinsic
def _ptr(typingctx, addr, dt):
    """int address -> CPointer(dtype) (dt: a numpy scalar class such as np.float32)."""
    if not isinstance(addr, types.Integer) or not isinstance(dt, types.NumberClass):
        return None
    pty = types.CPointer(dt.instance_type)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(pty))

    return pty(addr, dt), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's time-stamp counter (``llvm.readcyclecounter``: rdtsc on x86), for profiles."""

    def codegen(context, builder, sig, args):
        from llvmlite import ir
        from numba.core import cgutils

        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen


@njit(cache=True)
def read_cycles():
    return cycles()


def _to_f32(v):  # pragma: no cover - replaced by the overload in jitted code
    raise NotImplementedError


@overload(_to_f32, inline="always")
def _to_f32_impl(v):
    if v == types.float32:
        return lambda v: v
    if v == types.uint16:
        return lambda v: bf16_bits_to_f32(v)
    return None


def _from_f32(v, like):  # pragma: no cover
    raise NotImplementedError


@overload(_from_f32, inline="always")
def _from_f32_impl(v, like):
    if like == types.float32:
        return lambda v, like: v
    if like == types.uint16:
        return lambda v, like: f32_to_bf16_bits(v)
    return None


@njit(nogil=True, cache=True)
def _arr1(desc, slot, dt):
    o = slot * SLOT
    return carray(_ptr(desc[o], dt), (desc[o + 1],))


@njit(nogil=True, cache=True)
def _arr2(desc, slot, dt):
    o = slot * SLOT
    return carray(_ptr(desc[o], dt), (desc[o + 1], desc[o + 2]))


@njit(nogil=True, cache=True)
def _arr4(desc, slot, dt):
    o = slot * SLOT
    return carray(_ptr(desc[o], dt), (desc[o + 1], desc[o + 2], desc[o + 3], desc[o + 4]))


@njit(nogil=True, cache=True)
def _arr5(desc, slot, dt):
    o = slot * SLOT
    return carray(_ptr(desc[o], dt),
                  (desc[o + 1], desc[o + 2], desc[o + 3], desc[o + 4], desc[o + 5]))


@njit(nogil=True, cache=True, inline="always")
def _rows(a, r0, r1, dt):
    """a[r0:r1] of a C-contiguous 2-D array, typed C-contiguous (kernels get 'C' layouts)."""
    return carray(_ptr(a.ctypes.data + r0 * a.shape[1] * a.itemsize, dt), (r1 - r0, a.shape[1]))


@njit(nogil=True, cache=True, inline="always")
def _seg(a, r0, r1, dt):
    """a[r0:r1] of a 1-D array, typed C-contiguous."""
    return carray(_ptr(a.ctypes.data + r0 * a.itemsize, dt), (r1 - r0,))


@njit(nogil=True, cache=True, inline="always")
def _part(desc, slot, me, rows, cols, dt):
    """Participant me's [rows, cols] of a per-participant scratch slot (int8 [nth, bytes each])."""
    o = slot * SLOT
    return carray(_ptr(desc[o] + me * desc[o + 2], dt), (rows, cols))


@intrinsic
def icall8(typingctx, addr, a0, a1, a2, a3, a4, a5, a6, a7):
    """Call the compiled kernel at ``addr`` (its native entry point, see ``kernel_address``).

    A direct call would link the kernel's LLVM IR into the caller and generate its machine code
    again (minutes for the big unrolled SIMD kernels); this is an indirect call to code compiled
    (or loaded from the cache) once. The kernel must have been compiled for exactly these types.
    """
    if not isinstance(addr, types.Integer):
        return None
    return types.void(addr, a0, a1, a2, a3, a4, a5, a6, a7), icall_codegen


@intrinsic
def icall5(typingctx, addr, a0, a1, a2, a3, a4):
    """``icall8`` for the five-argument (BF16) kernel signature."""
    if not isinstance(addr, types.Integer):
        return None
    return types.void(addr, a0, a1, a2, a3, a4), icall_codegen


def kernel_signature(scheme: int) -> tuple:
    """The numba argument types the driver passes to a kernel of ``scheme``."""
    from numba.np.numpy_support import from_dtype

    def arr(dt, nd):
        return types.Array(from_dtype(np.dtype(dt)), nd, "C")

    i64 = types.int64
    if scheme == SCHEME_INT8:
        return (arr(np.int8, 2), arr(np.float32, 1), arr(np.int8, 4), arr(np.float32, 1),
                arr(np.int32, 1), arr(np.float32, 2), i64, i64)
    if scheme == SCHEME_INT4:
        return (arr(np.int8, 2), arr(np.float32, 1), arr(np.uint8, 4), arr(np.float32, 3), i64,
                arr(np.float32, 2), i64, i64)
    return (arr(np.uint16, 2), arr(np.uint16, 4), arr(np.float32, 2), i64, i64)


def kernel_address(kernel, scheme: int) -> int:
    """Compile ``kernel`` (a jitted function of the README contract) for the driver's argument
    types and return the address of its native entry point, for ``icall8`` / ``icall5``."""
    return native_address(kernel, kernel_signature(scheme))


@njit(cache=True, inline="always")
def _put_slot(desc, slot, a):
    """Array slot ``slot`` of desc: the data address, then the shape."""
    desc[slot * SLOT] = a.ctypes.data
    for i in range(a.ndim):
        desc[slot * SLOT + 1 + i] = a.shape[i]


@njit(cache=True)
def _put_at(desc, slot, addr, n0, n1):
    """Array slot ``slot`` of desc from an address and up to two dims (n1 unused for 1-D)."""
    o = slot * SLOT
    desc[o] = addr
    desc[o + 1] = n0
    desc[o + 2] = n1


@njit(cache=True)
def _put_words(desc, T, C, nch, incr, x_bf16, o_bf16, gemv_max, bpt13, bpt2, levels, prof, gate,
               done, result, pipe, tail, tailp, watch):
    desc[S_T] = T
    desc[S_CHUNK] = C
    desc[S_NCHUNK] = nch
    desc[S_INCR] = incr
    desc[S_XBF16] = x_bf16
    desc[S_OBF16] = o_bf16
    desc[S_GEMV_MAX] = gemv_max
    desc[S_BPT13] = bpt13
    desc[S_BPT2] = bpt2
    desc[S_LEVELS] = levels
    desc[S_PROF] = prof
    desc[S_GATE] = gate
    desc[S_DONE] = done
    desc[S_RESULT] = result
    desc[S_PIPE] = pipe
    desc[S_TAIL] = tail
    desc[S_TAILP] = tailp
    desc[S_WATCH] = watch


@njit(cache=True)
def put_call(desc, x, out, ids, tw, mask, T, C, nch, incr, x_bf16, o_bf16, gemv_max, bpt13,
             bpt2, levels, prof, gate, done, result, pipe, tail, tailp, watch):
    """Write the per-call words of ``desc``: the array slots (x, out, ids, tw, mask) and the call's
    scalars (one jitted call instead of five numpy ``.ctypes`` look-ups and ~15 item stores)."""
    _put_slot(desc, A_X, x)
    _put_slot(desc, A_OUT, out)
    _put_slot(desc, A_IDS, ids)
    _put_slot(desc, A_TW, tw)
    _put_slot(desc, A_MASK, mask)
    _put_words(desc, T, C, nch, incr, x_bf16, o_bf16, gemv_max, bpt13, bpt2, levels, prof, gate,
               done, result, pipe, tail, tailp, watch)


@njit(cache=True)
def put_call_at(desc, x, out, ids, tw, mask, H, K, E, T, C, nch, incr, x_bf16, o_bf16, gemv_max,
                bpt13, bpt2, levels, prof, gate, done, result, pipe, tail, tailp, watch):
    """put_call for arrays given by their addresses (x, out [T, H], ids, tw [T, K], mask [E]: a
    caller's torch tensors, with no numpy views made for them); returns id_range of the ids (the
    caller checks it before it publishes the job)."""
    _put_at(desc, A_X, x, T, H)
    _put_at(desc, A_OUT, out, T, H)
    _put_at(desc, A_IDS, ids, T, K)
    _put_at(desc, A_TW, tw, T, K)
    _put_at(desc, A_MASK, mask, E, 0)
    _put_words(desc, T, C, nch, incr, x_bf16, o_bf16, gemv_max, bpt13, bpt2, levels, prof, gate,
               done, result, pipe, tail, tailp, watch)
    return id_range(carray(_ptr(ids, np.int64), (T, K)))


@njit(cache=True)
def id_range(ids):
    """(min, max) of an int64 [T, K] array (T*K > 0)."""
    lo = ids[0, 0]
    hi = lo
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            v = ids[t, k]
            if v < lo:
                lo = v
            if v > hi:
                hi = v
    return lo, hi


# ----------------------------------------------------------------------------- activations

@njit(nogil=True, cache=True, inline="always")
def exp_f32(x):
    """exp(x) in fp32 without a libm call (vectorisable): x = n ln2 + r, |r| <= ln2/2, degree-6
    Taylor polynomial for e^r (error < 2e-7 relative, ~1-2 ulp), times 2^n built in the exponent
    bits. Inputs are clamped to [-87, 88]: e^x saturates at ~1.6e38 instead of inf and flushes
    to ~1.6e-38 instead of denormals (SiLU is unaffected at that scale). NaN gives NaN."""
    xc = x if x < np.float32(88.0) else np.float32(88.0)
    xc = xc if xc > np.float32(-87.0) else np.float32(-87.0)
    n = np.rint(xc * np.float32(1.4426950408889634))
    r = xc - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    scale = _u32_as_f32((np.int32(n) + np.int32(127)) << np.int32(23))
    res = p * scale
    return res if x == x else x


# ----------------------------------------------------------------------------- planning

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


# ----------------------------------------------------------------------------- phase barrier

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
def _arm_pipeline(dep, tasks13, n13):
    """Per-expert words of a pipelined chunk: gate+up tasks left = the expert's task count, not ready."""
    for j in range(n13):
        e = tasks13[j, 0]
        dep[e * DEP_STRIDE] = 0
        dep[e * DEP_STRIDE + 1] = 0
    for j in range(n13):
        dep[tasks13[j, 0] * DEP_STRIDE] += 1


# ----------------------------------------------------------------------------- stream gate

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


# ----------------------------------------------------------------------------- the job


@njit(nogil=True, cache=True)
def load_w_int8(desc, sd, ss, sw, e):
    return (_arr5(desc, sd, np.int8)[e], _arr2(desc, ss, np.float32)[e],
            _arr2(desc, sw, np.int32)[e])


@njit(nogil=True, cache=True)
def load_w_int4(desc, sd, ss, sw, e):
    return (_arr5(desc, sd, np.uint8)[e], _arr4(desc, ss, np.float32)[e],
            _arr2(desc, sw, np.int32)[e])


@njit(nogil=True, cache=True)
def load_w_bf16(desc, sd, ss, sw, e):
    return (_arr5(desc, sd, np.uint16)[e], _arr2(desc, ss, np.float32)[e],
            _arr2(desc, sw, np.int32)[e])


@njit(nogil=True, cache=True)
def quant_row_i8x2(src, d1, d2, n):
    """Two-level int8 of src[:n] (reference.quantize_act2): d1 <- q1, d2 <- q2 of the fp32
    residual src - s1 * q1 (computed in place in src); returns (s1, s2)."""
    s1 = quant_row_i8(src, d1, n)
    for j in range(n):
        src[j] = src[j] - np.float32(d1[j]) * s1
    return s1, quant_row_i8(src, d2, n)


@njit(nogil=True, cache=True)
def _quant_rows(acc, xg, xs, r, n, bf16, R):
    """acc[:n] (fp32, clobbered) -> activation row(s) r (.. r + R - 1) of xg / xs."""
    if bf16:
        xs[r] = bf16_row(acc, xg[r].view(np.uint16), n)
    elif R == 2:
        xs[r], xs[r + 1] = quant_row_i8x2(acc, xg[r], xg[r + 1], n)
    else:
        xs[r] = quant_row_i8(acc, xg[r], n)


@njit(nogil=True, cache=True)
def _quantise_tokens(x, t0, ta, tb, pos, H, xg, xs, acc, bf16, R):
    """Phase 1 for tokens [ta, tb): each token with a CPU slot -> its R activation rows
    (t - t0) * R.. of xg / xs, once (the gate+up tasks gather them per expert)."""
    K = pos.shape[1]
    for t in range(ta, tb):
        hit = False
        for k in range(K):
            hit = hit or pos[t - t0, k] >= 0
        if hit:
            for j in range(H):
                acc[j] = _to_f32(x[t, j])
            _quant_rows(acc, xg, xs, (t - t0) * R, H, bf16, R)


@njit(nogil=True, cache=True)
def _gather_rows(xg, xs, rslot, K, R, r0, r1, ga, gs):
    """Gathered rows [r0, r1) <- their tokens' activation rows: ga[r - r0] and gs[r - r0] (the
    levels of two-level activations are rows r % R of the token's R rows)."""
    n = xg.shape[1]
    for r in range(r0, r1):
        q = (rslot[r] // K) * R + r % R
        src = xg[q]
        dst = ga[r - r0]
        for j in range(n):
            dst[j] = src[j]
        gs[r - r0] = xs[q]


@njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def _act_rows(gu, ra, rb, I, up_off, hq, hs, h, bf16, R, hoff):
    """Phase 3 for rows [ra, rb) of gu (whole slots: R rows each, their gate/up outputs
    summed): h = silu(gate) * up into the participant's row ``h``, then requantised into rows
    r + hoff of hq / hs (gu may be a participant's scratch, hoff its first gathered row).

    Written so that LLVM vectorises every loop: separate exp and SiLU loops (the fused one was
    not), the up half as a slice (an index ``up_off + j`` may be negative to Numba, and its
    wraparound branch blocked vectorising), NumPy's error model (Python's raises on a zero
    divisor, a branch per element) and fused multiply-adds in the exp polynomial. Together 3x
    faster than the plain loops. One-level int8 takes the row's absolute maximum in the SiLU
    loop (dev, one core, I=768 from L1: 0.73 vs 0.86 ns per element)."""
    for r in range(ra, rb, R):
        g = gu[r, :I]
        u = gu[r, up_off:up_off + I]
        if R == 2:
            g2 = gu[r + 1, :I]
            u2 = gu[r + 1, up_off:up_off + I]
            for j in range(I):
                h[j] = exp_f32(-(g[j] + g2[j]))
            for j in range(I):
                h[j] = (g[j] + g2[j]) / (np.float32(1.0) + h[j]) * (u[j] + u2[j])
        else:
            for j in range(I):
                h[j] = exp_f32(-g[j])
            # the row's absolute maximum taken in the SiLU pass (one int8 pass less)
            mb = np.uint32(0)
            for j in range(I):
                v = g[j] / (np.float32(1.0) + h[j]) * u[j]
                h[j] = v
                mb = absmax_bits(v, mb)
            if not bf16:
                hs[r + hoff] = quant_row_i8_max(h, hq[r + hoff], I, mb)
                continue
        _quant_rows(h, hq, hs, r + hoff, I, bf16, R)


@njit(nogil=True, cache=True)
def _combine_tokens(out, t0, ta, tb, pos, tw, y, H, acc, incremental, R):
    """Phase 5 for tokens [ta, tb): out[t] = (out[t] if incremental) + sum_k w[t,k] y[row]."""
    K = pos.shape[1]
    for t in range(ta, tb):
        if incremental:
            for j in range(H):
                acc[j] = _to_f32(out[t, j])
        else:
            for j in range(H):
                acc[j] = np.float32(0.0)
        for k in range(K):
            r = pos[t - t0, k]
            if r < 0:
                continue
            wk = tw[t, k]
            for lv in range(R):
                yr = y[r + lv]
                for j in range(H):
                    acc[j] += wk * yr[j]
        for j in range(H):
            out[t, j] = _from_f32(acc[j], out[t, j])


@njit(nogil=True, cache=True)
def _gemm_call(desc, scheme, which, e, xa, xs, out, nb0, nb1, small):
    """Expert e's gate+up (which=0: w13) or down (which=1: w2) kernel on activation rows xa
    (int8 [M, D] bytes; bf16 rows as byte pairs) with scales xs [M] into out [M, N] fp32,
    blocks [nb0, nb1); small: the small-M kernel."""
    if which == 0:
        sd, sc, sw, gs = A_W13D, A_W13S, A_W13W, desc[S_GS13]
        av, am = desc[D_KV13], desc[D_KM13]
    else:
        sd, sc, sw, gs = A_W2D, A_W2S, A_W2W, desc[S_GS2]
        av, am = desc[D_KV2], desc[D_KM2]
    addr = av if small else am
    if scheme == SCHEME_INT8:
        d, s, w = load_w_int8(desc, sd, sc, sw, e)
        icall8(addr, xa, xs, d, s, w, out, nb0, nb1)
    elif scheme == SCHEME_INT4:
        st = A_W13R if which == 0 else A_W2R
        if desc[st * SLOT] != 0 and (small or desc[S_TABM] != 0):
            sc = st
        d, s, w = load_w_int4(desc, sd, sc, sw, e)
        icall8(addr, xa, xs, d, s, gs, out, nb0, nb1)
    else:
        d, s, w = load_w_bf16(desc, sd, sc, sw, e)
        icall5(addr, xa.view(np.uint16), d, out, nb0, nb1)


@njit(nogil=True, cache=True)
def _gate_up(desc, scheme, me, e, r0, r1, nb0, nb1, small, whole, xg, xs, rslot, K, R, gu,
             hq, hs, h, bf16, prof_on):
    """Phase 2 for expert e's gathered rows [r0, r1), blocks [nb0, nb1): in calls of at most
    S_GCH rows, each on its rows' activations gathered into the participant's A_XGS / A_XSS.
    whole (a task of all blocks): each call's activations follow at once, from the
    participant's A_GUS rows when it has them (the gate+up outputs never leave this core's
    cache), else from the shared gu rows. Returns the cycles spent on activations (prof_on)."""
    gch = desc[S_GCH]
    gus_rows = desc[S_GUS]
    xbytes = xg.shape[1]
    n13 = gu.shape[1]
    I = desc[S_I]
    up_off = desc[S_UPOFF]
    xga = _part(desc, A_XGS, me, gch, xbytes, np.int8)
    xsa = _part(desc, A_XSS, me, 1, gch, np.float32)[0]
    act_cycles = np.int64(0)
    for a0 in range(r0, r1, gch):
        a1 = min(r1, a0 + gch)
        m = a1 - a0
        _gather_rows(xg, xs, rslot, K, R, a0, a1, xga, xsa)
        own = whole and m <= gus_rows
        out = (_rows(_part(desc, A_GUS, me, gus_rows, n13, np.float32), 0, m, np.float32) if own
               else _rows(gu, a0, a1, np.float32))
        _gemm_call(desc, scheme, 0, e, _rows(xga, 0, m, np.int8), _seg(xsa, 0, m, np.float32),
                   out, nb0, nb1, small)
        if whole:
            c = cycles() if prof_on else 0
            _act_rows(out, 0, m, I, up_off, hq, hs, h, bf16, R, a0)
            if prof_on:
                act_cycles += cycles() - c
    return act_cycles


@njit(nogil=True, cache=True)
def _down_rows(desc, scheme, e, r0, r1, nb0, nb1, small, hq, hs, y):
    """Expert e's down GEMM of gathered rows [r0, r1), blocks [nb0, nb1), into y's rows."""
    _gemm_call(desc, scheme, 1, e, _rows(hq, r0, r1, np.int8), _seg(hs, r0, r1, np.float32),
               _rows(y, r0, r1, np.float32), nb0, nb1, small)


@njit(nogil=True, cache=True)
def moe_job(nth, jctrl, desc):
    """The MoE job (see the module docstring): every participant runs this; it returns when the
    job is complete (or aborted). Scheme, x and out dtypes come from desc (S_SCHEME, S_XBF16,
    S_OBF16), so one compiled (and disk-cached) function serves every layer."""
    me = atomic_add(jctrl, JOB_JOIN, 1)
    if me >= nth:
        return
    gate = desc[S_GATE]
    gb = gate_base(desc[S_NCHUNK])
    ra = desc[S_RESULT]
    res = carray(_ptr(ra if gate != 0 else np.int64(desc.ctypes.data), np.int64), (RESULT_WORDS,))
    if gate != 0 and not _open_gate(jctrl, gate, gb, res):
        return
    scheme = desc[S_SCHEME]
    bf16 = scheme == SCHEME_BF16
    x_bf16 = desc[S_XBF16] != 0
    o_bf16 = desc[S_OBF16] != 0
    T = desc[S_T]
    H = desc[S_H]
    I = desc[S_I]
    up_off = desc[S_UPOFF]
    C = desc[S_CHUNK]
    incremental = desc[S_INCR] != 0
    gemv_max = desc[S_GEMV_MAX]
    nch = desc[S_NCHUNK]
    x32 = _arr2(desc, A_X, np.float32)
    x16 = _arr2(desc, A_X, np.uint16)
    o32 = _arr2(desc, A_OUT, np.float32)
    o16 = _arr2(desc, A_OUT, np.uint16)
    ids = _arr2(desc, A_IDS, np.int64)
    tw = _arr2(desc, A_TW, np.float32)
    mask = _arr1(desc, A_MASK, np.uint8)
    pos = _arr2(desc, A_POS, np.int32)
    offs = _arr1(desc, A_OFFS, np.int32)
    order = _arr1(desc, A_ORDER, np.int32)
    tasks13 = _arr2(desc, A_T13, np.int32)
    tasks2 = _arr2(desc, A_T2, np.int32)
    xg = _arr2(desc, A_XG, np.int8)  # activation rows as bytes (bf16 rows are viewed as uint16)
    xs = _arr1(desc, A_XS, np.float32)
    gu = _arr2(desc, A_GU, np.float32)
    hq = _arr2(desc, A_HQ, np.int8)
    hs = _arr1(desc, A_HS, np.float32)
    y = _arr2(desc, A_Y, np.float32)
    acc = _arr2(desc, A_ACC, np.float32)[me]
    dep = _arr1(desc, A_DEP, np.int64)
    rslot = _arr1(desc, A_RSLOT, np.int32)
    K = pos.shape[1]
    nb13 = desc[A_W13D * SLOT + 2]
    nb2 = desc[A_W2D * SLOT + 2]
    R = desc[S_LEVELS]
    pa = desc[S_PROF]  # profile of this participant (never touched when 0)
    prof = carray(_ptr(pa + me * PROF_WORDS * 8 if pa != 0 else np.int64(desc.ctypes.data), np.int64),
                  (PHASES, 2))
    for c in range(nch):
        t0 = c * C
        t1 = min(T, t0 + C)
        pbase = JOB_FREE + c * PHASES * PHASE_WORDS
        for ph in range(PHASES):
            base = pbase + ph * PHASE_WORDS
            n = 1 if ph == 0 else atomic_load(jctrl, base + 2 * CTRL_STRIDE)
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
                tc = cycles() if pa != 0 else 0
                if ph == 0:
                    rows, n13, n2, fused, bad = _plan(t0, t1, ids, mask, pos, rslot, offs, order,
                                                      tasks13, tasks2, nb13, nb2, nth,
                                                      desc[S_BPT13], desc[S_BPT2], R,
                                                      desc[S_TAIL], desc[S_TAILP])
                    jctrl[gb + G_BAD] += bad
                    nt = t1 - t0
                    # the plan phase's own ntasks word carries the chunk's row count
                    jctrl[base + 2 * CTRL_STRIDE] = rows
                    # a chunk of one token block is quantised here, saving a barrier (decode)
                    nq = (nt + TOKEN_BLOCK - 1) // TOKEN_BLOCK
                    if nq == 1:
                        if x_bf16:
                            _quantise_tokens(x16, t0, t0, t1, pos, H, xg, xs, acc, bf16, R)
                        else:
                            _quantise_tokens(x32, t0, t0, t1, pos, H, xg, xs, acc, bf16, R)
                        nq = 0
                    jctrl[base + PHASE_WORDS + 2 * CTRL_STRIDE] = nq
                    # a fused chunk with split experts (n2 > 0) runs its parts in the same order
                    pipe = (fused and n2 > 0) or (
                        desc[S_PIPE] != 0 and not fused and rows > 0
                        and (offs[order[0] + 1] - offs[order[0]]) * I <= PIPE_ACT_MAX)
                    if pipe:
                        _arm_pipeline(dep, tasks13, n13)
                    # pipelined: phase 2 runs the down tasks too, after the gate+up tasks
                    jctrl[base + 2 * PHASE_WORDS + 2 * CTRL_STRIDE] = n13 + n2 if pipe else n13
                    jctrl[base + 2 * PHASE_WORDS + 2 * CTRL_STRIDE + 1] = n13  # beside ntasks
                    # fused: each gate+up task is a whole expert and also runs its activations
                    # and its down GEMM (hq stays in the task's cache)
                    jctrl[base + 4 * PHASE_WORDS + 2 * CTRL_STRIDE] = 0 if fused or pipe else n2
                    # fused: the gate+up tasks compute the activations; else one task per row
                    # block (single rows when there are few, so decode's rows spread over threads)
                    rb = (ROW_BLOCK if rows >= ROW_BLOCK * R * nth else 1) * R
                    jctrl[base + 3 * PHASE_WORDS + 2 * CTRL_STRIDE + 1] = rb  # beside ntasks
                    jctrl[base + 3 * PHASE_WORDS + 2 * CTRL_STRIDE] = 0 if fused or pipe else (rows + rb - 1) // rb
                    jctrl[base + 5 * PHASE_WORDS + 2 * CTRL_STRIDE] = (nt + TOKEN_BLOCK - 1) // TOKEN_BLOCK
                elif ph == 1:
                    ta = t0 + i * TOKEN_BLOCK
                    tb = min(t1, ta + TOKEN_BLOCK)
                    if x_bf16:
                        _quantise_tokens(x16, t0, ta, tb, pos, H, xg, xs, acc, bf16, R)
                    else:
                        _quantise_tokens(x32, t0, ta, tb, pos, H, xg, xs, acc, bf16, R)
                elif ph == 2 or ph == 4:
                    which = 0 if ph == 2 else 1
                    j = i
                    n13c = jctrl[base + 2 * CTRL_STRIDE + 1]
                    if ph == 2 and i >= n13c:  # pipelined decode: a down task
                        which = 1
                        j = i - n13c
                    tasks = tasks13 if which == 0 else tasks2
                    e = tasks[j, 0]
                    r0 = offs[e]
                    r1 = offs[e + 1]
                    nb0 = np.int64(tasks[j, 1])
                    nb1 = np.int64(tasks[j, 2])
                    small = r1 - r0 <= gemv_max * R
                    whole = ph == 2 and which == 0 and nb0 == 0 and nb1 == nb13
                    if ph == 2 and which == 1:
                        if pa != 0:
                            c_w = cycles()
                            prof[2, 0] += c_w - tc
                        ok = _wait_at_least(jctrl, dep, e * DEP_STRIDE + 1, 1, desc[S_WATCH])  # e's act
                        if pa != 0:
                            tc = cycles()
                            prof[4, 1] += tc - c_w
                        if not ok:
                            return
                    if which == 0:
                        # a whole expert (the plan's "fused"): its activations too, and then its
                        # down GEMM, while its rows are in this core's cache. A profile books
                        # them under phases 3 and 4 (which have no tasks of their own then).
                        c_act = _gate_up(desc, scheme, me, e, r0, r1, nb0, nb1, small, whole, xg,
                                         xs, rslot, K, R, gu, hq, hs, acc, bf16, pa != 0)
                        if pa != 0:
                            prof[3, 0] += c_act
                            tc += c_act
                    else:
                        _down_rows(desc, scheme, e, r0, r1, nb0, nb1, small, hq, hs, y)
                    if ph == 2 and which == 1:
                        if pa != 0:  # book the down task under phase 4
                            c_end = cycles()
                            prof[4, 0] += c_end - tc
                            tc = c_end
                    elif ph == 2 and n > n13c and not whole and atomic_add(dep, e * DEP_STRIDE, -1) == 1:
                        # pipelined (decode, or a fused chunk's split experts): the expert's last
                        # gate+up task computes its activations and releases its down tasks
                        if pa != 0:
                            c_act = cycles()
                            prof[2, 0] += c_act - tc
                        _act_rows(gu, r0, r1, I, up_off, hq, hs, acc, bf16, R, 0)
                        atomic_store(dep, e * DEP_STRIDE + 1, 1)
                        if pa != 0:
                            tc = cycles()
                            prof[3, 0] += tc - c_act
                    if whole:
                        if pa != 0:
                            c_down = cycles()
                            prof[2, 0] += c_down - tc
                        _down_rows(desc, scheme, e, r0, r1, np.int64(0), nb2, small, hq, hs, y)
                        if pa != 0:
                            tc = cycles()
                            prof[4, 0] += tc - c_down
                elif ph == 3:
                    rows = jctrl[pbase + 2 * CTRL_STRIDE]
                    rb = jctrl[base + 2 * CTRL_STRIDE + 1]
                    ra = i * rb
                    _act_rows(gu, ra, min(rows, ra + rb), I, up_off, hq, hs, acc, bf16, R, 0)
                else:
                    ta = t0 + i * TOKEN_BLOCK
                    tb = min(t1, ta + TOKEN_BLOCK)
                    if o_bf16:
                        _combine_tokens(o16, t0, ta, tb, pos, tw, y, H, acc, incremental, R)
                    else:
                        _combine_tokens(o32, t0, ta, tb, pos, tw, y, H, acc, incremental, R)
                if pa != 0:
                    prof[ph, 0] += cycles() - tc
                atomic_add(jctrl, base + CTRL_STRIDE, 1)
            tw0 = cycles() if pa != 0 else 0
            ok = _wait_phase(jctrl, base, n, desc[S_WATCH])
            if pa != 0:
                prof[ph, 1] += cycles() - tw0
            if not ok:
                return
    if gate != 0:
        if atomic_add(jctrl, gb + G_FIN, 1) == 0:
            # the first participant out publishes the result to the stream: "start" is consumed
            # (the stream writes it again only after it saw "done"), then "done"
            if desc[S_PUBWAIT] > 0:
                t_pub = cycles()
                while cycles() - t_pub < desc[S_PUBWAIT]:
                    spin_relax(0, 1)
            res[R_BAD_IDS] = jctrl[gb + G_BAD]
            res[R_END_CYCLES] = cycles()
            res[R_FINISHED] = 1
            flag_store(gate, 0)
            flag_store(desc[S_DONE], 1)
            # and it alone marks the job complete, after its result words: another participant
            # doing so could let the waiting thread read R_FINISHED before it is written (the
            # handle then reports the job aborted: seen on the H200 with 17 threads on 16 cores,
            # the writer preempted between its G_FIN claim and its stores)
            atomic_store(jctrl, JOB_COMPLETE, 1)
        return
    atomic_store(jctrl, JOB_COMPLETE, 1)
