"""AMX INT8 (tdpbssd): the small-M and large-M kernels of the README contract, and the
MoE layer's forms of the large-M one (output lines requested for writing; non-temporal stores).

Shared tile code: ``_tiles``. The contract entry points pass their tuning as literal arguments to
the parameterised bodies (``gemv_int8_pf``, ``gemm_int8_staged``); the values come from device
sweeps on one Emerald Rapids core (N=1536, D=2048): the GEMV B prefetch 4 k-steps ahead made cold
M=1 decode 185 -> 126 us (warm and M=8 within +-8 %); the staged GEMM reached 2.15 TOPS at
M=512, 41 % of the 5.2 TOPS tile-resident peak (``roofline.peak_int8``).
"""
from numba import njit

from ... import cache
from ._tiles import AMX_MODE, _gemm_staged, _gemv_pf, _out_on_lines, _streams_out, default_mc

cache.install()

__all__ = ["gemv_int8", "gemm_int8", "gemm_int8_shared_out", "gemm_int8_stream_out", "gemv_int8_pf",
           "gemm_int8_staged", "AMX_MODE"]


@njit(nogil=True, cache=True)
def gemv_int8_pf(xq, xs, data, scale, out, nb0, nb1, pf):
    """``gemv_int8`` with an explicit B prefetch distance of pf k-steps (0: none)."""
    _gemv_pf(xq, data, out, nb0, nb1, pf, False, xs, scale, False)


@njit(nogil=True, cache=True)
def gemv_int8(xq, xs, data, scale, wsum, out, nb0, nb1):
    """Small-M INT8: out[m, n] = xs[m] * scale[n] * sum_k xq[m, k] q[n, k] for n in blocks [nb0, nb1).

    xq int8 [M, d_pad]; xs fp32 [M]; data int8 [NB, d_pad/4, 16, 4]; scale fp32 [n_pad];
    wsum unused (signed x signed needs no compensation); out fp32 [M, >= 16 nb1].
    """
    gemv_int8_pf(xq, xs, data, scale, out, nb0, nb1, 4)


@njit(nogil=True, cache=True)
def gemm_int8_staged(xq, xs, data, scale, out, nb0, nb1, mc, kcs, l2, pfw, nta, nt=False):
    """Large-M INT8, staged (``_staged_pair``): K slices of at most kcs k-steps (16: a block pair's
    32 KiB slice of B fits L1), mc rows per M chunk, A streamed with the non-temporal hint (nta;
    False: plain loads), each panel's epilogue overlapped with the next panel's products; l2:
    prefetch the block pair l2 pairs ahead into L2 while this one is computed (0: none); pfw:
    prefetch the output lines for writing. nt: store the output with non-temporal stores (a ValueError unless out's
    rows start on 64-byte lines: the stores would fault). Same result as ``gemv_int8``."""
    if nt and not _out_on_lines(out):
        raise ValueError("gemm_int8_staged: nt=True needs an output whose address and row stride "
                         "are multiples of 64 bytes")
    _gemm_staged(xq, data, out, nb0, nb1, mc, kcs, l2, pfw, nta, False, xs, scale, nt)


@njit(nogil=True, cache=True)
def _gemm_int8(xq, xs, data, scale, out, nb0, nb1, pfw, stream):
    """``gemm_int8`` / ``gemm_int8_shared_out`` / ``gemm_int8_stream_out``: the staged kernel
    with K sliced as follows. K is not sliced (32 k-steps: all of qwen3's gate+up) when the rows
    fit one M chunk, as a layer's experts do up to T=2048: in the layer, T=2048 was 0-8 % faster
    that way (three dev runs; 4 % in one device run, the other within its noise) and T=512 level
    or faster, though one core alone at M=128 on warm weights was 6 % slower. Above one chunk
    (one core at M=512: 10 % faster) 16. Rows whose A fits 1 MiB make one M chunk (M=512 at K=2048, which
    ``default_mc`` cuts in two): the weights stream once instead of twice. stream: 0 never
    non-temporal stores, 1 for an output over 1 MiB on lines (``_streams_out``), 2 for any output
    on lines; otherwise the output lines are requested for writing where pfw."""
    m = xq.shape[0]
    mc = default_mc(xq.shape[1])
    kcs = 32 if m <= mc else 16
    if m * xq.shape[1] <= 1 << 20:
        mc = max(mc, (m + 31) // 32 * 32)
    # two calls with literal flags, so that each compiles a loop with only its own store form
    if (stream == 2 and _out_on_lines(out)) or (stream == 1 and _streams_out(out, m, nb1 - nb0)):
        _gemm_staged(xq, data, out, nb0, nb1, mc, kcs, 2, False, True, False, xs, scale, True)
    else:
        _gemm_staged(xq, data, out, nb0, nb1, mc, kcs, 2, pfw, True, False, xs, scale, False)


@njit(nogil=True, cache=True)
def gemm_int8(xq, xs, data, scale, wsum, out, nb0, nb1):
    """Large-M INT8 (same contract as ``gemv_int8``): the staged kernel (``gemm_int8_staged``: K
    slices of 16 k-steps, the block pair two ahead prefetched into L2). One core, M=512 (dev
    machine and device): 1.26-1.29x a whole-K software-pipelined panel at N=1536 K=2048, 1.5x at
    N=2048 K=768; the 16-thread layer the same within the noise.
    The output is not prefetched for writing: a caller's own output gains nothing from it (one
    core, M=512: 4-9 % faster without). An output over 1 MiB whose rows start on 64-byte lines is
    written with non-temporal stores (``_streams_out``; one core, M=512: 8-12 % faster), so it is
    not in the caches afterwards. The MoE layer, whose output rows
    were last written by other cores and are read next, takes ``gemm_int8_shared_out`` instead."""
    _gemm_int8(xq, xs, data, scale, out, nb0, nb1, False, 1)


@njit(nogil=True, cache=True)
def gemm_int8_shared_out(xq, xs, data, scale, wsum, out, nb0, nb1):
    """``gemm_int8`` with each panel's output lines requested for writing during its last K slice
    (``prefetch_w``): for outputs whose lines other cores wrote last, as the MoE layer's shared
    gate+up and down rows are (such an output made the down GEMM 2x slower). The qwen3 layer was
    15-18 % slower at T=2048 without it on 2 dev threads and 6-9 % on the device's 16
    (``benchmarks/bench_moe.py``), and T=512 1-5 % slower."""
    _gemm_int8(xq, xs, data, scale, out, nb0, nb1, True, 0)


@njit(nogil=True, cache=True)
def gemm_int8_stream_out(xq, xs, data, scale, wsum, out, nb0, nb1):
    """``gemm_int8`` with non-temporal stores whenever the output rows start on 64-byte lines
    (else as ``gemm_int8_shared_out``): for the MoE layer's down outputs of a large chunk, which
    leave the core's caches before the combine reads them, so reading each line before writing
    it is traffic for nothing."""
    _gemm_int8(xq, xs, data, scale, out, nb0, nb1, True, 2)
