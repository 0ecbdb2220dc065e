"""AMX roofline loops: the tile unit's product rate with no memory traffic (the "peak" that
benchmark reports and kernel docstrings quote fractions of).
"""
import numpy as np
from numba import njit

from ... import cache
from .._simd import empty_line
from ._intrinsics import tdpbf16ps, tdpbssd, tilerelease, tileloadd64, tilestored64, tilezero
from ._tiles import AMX_MODE, _config

cache.install()

__all__ = ["peak_int8", "peak_bf16", "AMX_MODE"]


@njit(nogil=True, cache=True)
def _peak(iters, bf, zero):
    """The tile-resident product loop of ``peak_int8`` / ``peak_bf16``: four accumulators, four
    input tiles zeroed (``zero``) or loaded once from pseudo-random data (bf16: values of
    magnitude [1, 2), random signs and mantissas).

    Measured on the device (``benchmarks/amx_diag.py``): the
    random-tile loop runs at 0.6x the zero-tile one on one core and 0.7x on all 16, and slower
    than GEMM panels that multiply random data between tile loads, so back-to-back products on
    random data are power-limited. The zero-tile rate is the highest measured, so it is the
    default "peak": fractions of it are conservative."""
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, 64)
    buf = empty_line(4096, np.uint8)
    v = np.uint32(12345)
    for i in range(4096):
        v = v * np.uint32(1664525) + np.uint32(1013904223)
        buf[i] = np.uint8(v >> np.uint32(24))
    if bf:
        b16 = buf.view(np.uint16)
        for i in range(2048):
            r = b16[i]
            b16[i] = np.uint16(0x3F80 | (r & 0x7F) | (r & 0x8000))
    tilezero(0)
    tilezero(1)
    tilezero(2)
    tilezero(3)
    if zero:
        tilezero(4)
        tilezero(5)
        tilezero(6)
        tilezero(7)
    else:
        tileloadd64(4, buf, 0, 64)
        tileloadd64(5, buf, 1024, 64)
        tileloadd64(6, buf, 2048, 64)
        tileloadd64(7, buf, 3072, 64)
    for _ in range(iters):
        if bf:
            tdpbf16ps(0, 4, 6)
            tdpbf16ps(1, 4, 7)
            tdpbf16ps(2, 5, 6)
            tdpbf16ps(3, 5, 7)
        else:
            tdpbssd(0, 4, 6)
            tdpbssd(1, 4, 7)
            tdpbssd(2, 5, 6)
            tdpbssd(3, 5, 7)
    sink = np.empty(256, np.int32)
    tilestored64(0, sink, 0, 64)  # the products are used: nothing above is dead
    tilerelease()
    return iters * 4 * 2 * 16 * 16 * (32 if bf else 64)


@njit(nogil=True, cache=True)
def peak_int8(iters, zero=True):
    """Tile-resident tdpbssd loop (no memory traffic) on zeroed tiles (``zero=False``: random
    int8 tiles, see ``_peak``); returns the integer ops done (2 per MAC)."""
    return _peak(iters, False, zero)


@njit(nogil=True, cache=True)
def peak_bf16(iters, zero=True):
    """Tile-resident tdpbf16ps loop on zeroed tiles (``zero=False``: random bf16 tiles); returns
    the flops done (2 per MAC)."""
    return _peak(iters, True, zero)
