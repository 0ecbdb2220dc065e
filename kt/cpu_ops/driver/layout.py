"""The MoE job's descriptor (``MOE_JOB``), its control words and the per-call writer.

The layout names every array and word the job reads; ``CPUMoE`` writes a layer's template by name
(``runtime.job.JobDescriptor``) and each call's slots and words with ``put_call`` /
``put_call_at``. The constants below are the layout's indices, for the jitted driver.
"""
from __future__ import annotations

import numpy as np
from numba import carray, njit, types

from .. import cache as _cache
from ..runtime.job import JobLayout, put_array, put_array_at, put_words
from ..runtime.native import native_address, ptr
from ..runtime.worker import CTRL_STRIDE, JOB_FREE

_cache.install()

SCHEME_INT8, SCHEME_INT4, SCHEME_BF16 = 0, 1, 2

# Per-call words, written by put_call in this order (PER_CALL, then the tuning words).
PER_CALL = (
    "T", "chunk", "nchunks", "incremental", "x_bf16", "o_bf16",
    "km2",      # the down GEMM's large-M kernel of this call (its non-temporal form for a large y)
    "levels",   # activation rows per (token, slot): 1, or 2 for two-level int8 ("int8x2")
    "tail",     # whole-expert chunks: this many of the smallest experts are split into part tasks
    "prof",     # address of an int64 [nth, PROF_WORDS] profile, 0 = off (see PROF_WORDS)
    "gate", "done",  # stream-gated job: int32 "start" / "done" flag addresses (0 = none)
    "result",   # a gated job's own int64 [RESULT_WORDS] result (R_*), its handle's to read
)
TUNING = (
    "gemv_max",     # rows per expert up to which the small-M kernel runs
    "bpt13", "bpt2",  # 16-row blocks per gate+up / down task, 0 = the driver's heuristic
    "pipe",         # 1: pipelined decode allowed (driver/__init__.py)
    "tailp",        # the split experts' gate+up into about this many tasks, their down half as many
    "watch",        # time-stamp-counter ticks a participant waits for another's work, 0 = forever
)

MOE_JOB = JobLayout("moe_job", arrays=(
    "x", "out", "ids", "tw", "mask",
    "w13.data", "w13.scale", "w13.wsum", "w2.data", "w2.scale", "w2.wsum",
    "pos", "offs", "order", "t13", "t2",
    "xg", "xs", "gu", "hq", "hs", "y", "acc",
    "dep",      # int64 [E * DEP_STRIDE]: per expert, gate+up tasks left and "activations ready"
    "rslot",    # int32 [rows]: gathered row -> its slot (t - t0) * K + k
    # per-participant scratch, int8 [nth, bytes each]: gathered activation rows and their scales,
    # gate+up outputs of a whole-expert task (kept in that core's cache)
    "xgs", "xss", "gus",
    # INT4 ratio tables of w13 / w2 ([E, 1, rows, 16] fp32, packing.int4_ratio_table), given to
    # the small-M kernel in place of the group scales when the layer has them (address 0: none),
    # and to the large-M kernel too if "tab_m"
    "w13.tab", "w2.tab",
), words=(
    "K", "E", "H", "I", "up_offset", "gs13", "gs2",
    "kv13", "km13", "kv2",  # kernel entry points (kernel_address); km2 is a per-call word
    "scheme",
    "gch",      # rows per gate+up kernel call (the xgs rows of a participant)
    "gus_rows",  # rows of a participant's gus (0: whole-expert tasks write the shared gu rows)
    "tab_m",    # 1: the large-M INT4 kernel reads the ratio tables as well
    "pubwait",  # tests: ticks a gated job's publisher waits between claiming the publication and
                # writing the result (widens that window; 0 in use)
) + PER_CALL + TUNING)

_S, _W = MOE_JOB.slot, MOE_JOB.word
A_X, A_OUT, A_IDS, A_TW, A_MASK = (_S(n) for n in ("x", "out", "ids", "tw", "mask"))
A_W13D, A_W13S, A_W13W = (_S(n) for n in ("w13.data", "w13.scale", "w13.wsum"))
A_W2D, A_W2S, A_W2W = (_S(n) for n in ("w2.data", "w2.scale", "w2.wsum"))
A_POS, A_OFFS, A_ORDER, A_T13, A_T2 = (_S(n) for n in ("pos", "offs", "order", "t13", "t2"))
A_XG, A_XS, A_GU, A_HQ, A_HS, A_Y, A_ACC = (_S(n) for n in ("xg", "xs", "gu", "hq", "hs", "y", "acc"))
A_DEP, A_RSLOT, A_XGS, A_XSS, A_GUS = (_S(n) for n in ("dep", "rslot", "xgs", "xss", "gus"))
A_W13R, A_W2R = _S("w13.tab"), _S("w2.tab")
S_K, S_E, S_H, S_I, S_UPOFF, S_GS13, S_GS2 = (_W(n) for n in ("K", "E", "H", "I", "up_offset", "gs13", "gs2"))
D_KV13, D_KM13, D_KV2, D_KM2 = (_W(n) for n in ("kv13", "km13", "kv2", "km2"))
S_SCHEME, S_GCH, S_GUS, S_TABM, S_PUBWAIT = (_W(n) for n in ("scheme", "gch", "gus_rows", "tab_m", "pubwait"))
S_T, S_CHUNK, S_NCHUNK, S_INCR, S_XBF16, S_OBF16 = (
    _W(n) for n in ("T", "chunk", "nchunks", "incremental", "x_bf16", "o_bf16"))
S_LEVELS, S_TAIL, S_PROF, S_GATE, S_DONE, S_RESULT = (
    _W(n) for n in ("levels", "tail", "prof", "gate", "done", "result"))
S_GEMV_MAX, S_BPT13, S_BPT2, S_PIPE, S_TAILP, S_WATCH = (_W(n) for n in TUNING)
CALL_WORDS = MOE_JOB.run(PER_CALL + TUNING)  # the first per-call word (put_call writes the run)
DESC_WORDS = MOE_JOB.size

R_OPENED, R_FINISHED, R_BAD_IDS, R_OPEN_CYCLES, R_END_CYCLES = 0, 1, 2, 3, 4
RESULT_WORDS = 5

PHASES = 6
PHASE_NAMES = ("plan", "quantise", "gate_up", "act", "down", "combine")
# words per participant in a profile: [PHASES, 2] (busy, waiting ticks) at the start of its own
# 16 words (128 bytes: no two participants share a line)
PROF_WORDS = 16
PHASE_WORDS = 3 * CTRL_STRIDE  # claim, done, ntasks: one line each
TOKEN_BLOCK = 8   # tokens per quantise / combine task
ROW_BLOCK = 8     # gathered rows per activation task
TASKS_PER_THREAD = 4
DEP_STRIDE = 8    # one cache line of "dep" per expert: [0] gate+up tasks left, [1] ready
PIPE_ACT_MAX = 8192  # pipelined decode only if every expert's activations (rows x I) are this small

# words after the phases of the last chunk (a gated job's): gate open, finishers, ids outside
# [-1, E) skipped. What the job's handle reads goes to the job's own result array ("result"), not
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


# ----------------------------------------------------------------------------- kernels

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


# ----------------------------------------------------------------------------- per-call writer

@njit(cache=True)
def put_call(desc, x, out, ids, tw, mask, words):
    """Write the per-call words of ``desc``: the array slots (x, out, ids, tw, mask) and the run
    of call words (``words``: PER_CALL + TUNING values, in that order), in one jitted call."""
    put_array(desc, A_X, x)
    put_array(desc, A_OUT, out)
    put_array(desc, A_IDS, ids)
    put_array(desc, A_TW, tw)
    put_array(desc, A_MASK, mask)
    put_words(desc, CALL_WORDS, words)


@njit(cache=True)
def put_call_at(desc, x, out, ids, tw, mask, H, K, E, words):
    """put_call for arrays given by their addresses (x, out [T, H], ids, tw [T, K], mask [E]: a
    caller's torch tensors, with no numpy views made for them); returns id_range of the ids (the
    caller checks it before it publishes the job)."""
    T = words[0]
    put_array_at(desc, A_X, x, T, H)
    put_array_at(desc, A_OUT, out, T, H)
    put_array_at(desc, A_IDS, ids, T, K)
    put_array_at(desc, A_TW, tw, T, K)
    put_array_at(desc, A_MASK, mask, E, 0)
    put_words(desc, CALL_WORDS, words)
    return id_range(carray(ptr(ids, np.int64), (T, K)))


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
