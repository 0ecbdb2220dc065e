"""AMX BF16 (tdpbf16ps): the small-M and large-M kernels of the README contract, and the MoE
layer's large-chunk down form with non-temporal stores.

Shared tile code: ``_tiles``. Device sweeps (one Emerald Rapids core, N=1536, D=2048): the GEMV
B prefetch 4 k-steps ahead made cold M=1 decode 385 -> 247 us; the staged GEMM reached 0.99
TFLOPS at M=512, 37 % of the 2.6 TFLOPS tile-resident peak (``roofline.peak_bf16``).
"""
from numba import njit

from ... import cache
from ._tiles import AMX_MODE, _NO_XS, _gemm_staged, _gemv_pf, _out_on_lines, default_mc

cache.install()

__all__ = ["gemv_bf16", "gemm_bf16", "gemm_bf16_stream_out", "gemv_bf16_pf", "gemm_bf16_staged",
           "AMX_MODE"]


@njit(nogil=True, cache=True)
def gemv_bf16_pf(xb, data, out, nb0, nb1, pf):
    """``gemv_bf16`` with an explicit B prefetch distance of pf k-steps (0: none)."""
    _gemv_pf(xb, data, out, nb0, nb1, pf, True, _NO_XS, _NO_XS, False)


@njit(nogil=True, cache=True)
def gemv_bf16(xb, data, out, nb0, nb1):
    """Small-M BF16: out[m, n] = sum_k bf16(x[m, k]) bf16(w[n, k]) with fp32 accumulation.

    xb uint16 [M, d_pad] (bf16 bits); data uint16 [NB, d_pad/2, 16, 2]; out fp32 [M, >= 16 nb1].
    """
    gemv_bf16_pf(xb, data, out, nb0, nb1, 4)


@njit(nogil=True, cache=True)
def gemm_bf16_staged(xb, data, out, nb0, nb1, mc, kcs, l2, pfw, nta):
    """Large-M BF16 with the staged kernel of ``gemm_int8_staged`` (tdpbf16ps, 32 k per step;
    partial sums in fp32 between K slices, so the summation order over K is that of
    ``gemm_bf16``'s panels)."""
    _gemm_staged(xb, data, out, nb0, nb1, mc, kcs, l2, pfw, nta, True, _NO_XS, _NO_XS, False)


@njit(nogil=True, cache=True)
def gemm_bf16(xb, data, out, nb0, nb1):
    """Large-M BF16 (same contract as ``gemv_bf16``): the staged kernel, K slices of 16 k-steps
    (32 k each), the L2 prefetch one block pair ahead (at T=2048 one ahead was 3-5 % faster than
    two in three device runs of four). One core, M=512 (dev machine): 1.1x / 1.2x a whole-K
    software-pipelined panel (gate+up / down); the 16-thread layer the same within 3 %."""
    gemm_bf16_staged(xb, data, out, nb0, nb1, default_mc(2 * xb.shape[1]), 16, 1, True, True)


@njit(nogil=True, cache=True)
def gemm_bf16_stream_out(xb, data, out, nb0, nb1):
    """``gemm_bf16`` with non-temporal stores and no output prefetch for writing whenever the
    output rows start on 64-byte lines (else as ``gemm_bf16``), as ``gemm_int8_stream_out``: for
    the MoE layer's down outputs of a large chunk. Same result as ``gemm_bf16``."""
    if _out_on_lines(out):
        _gemm_staged(xb, data, out, nb0, nb1, default_mc(2 * xb.shape[1]), 16, 1, False, True, True,
                     _NO_XS, _NO_XS, True)
    else:
        gemm_bf16(xb, data, out, nb0, nb1)
