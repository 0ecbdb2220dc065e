"""Activation preparation for the GEMM kernels (scalar Numba, any x86-64): int8 per token and bf16.

Both write into caller-owned buffers padded to the packed depth d_pad, zeros beyond D, so a kernel
can run over whole 64-byte lines. Results are bit-identical to ``kt.reference.quantize_act`` and
``kt.reference.f32_to_bf16_bits``.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from . import cache

cache.install()

_F127 = np.float32(127.0)
_F0 = np.float32(0.0)


@njit(nogil=True, cache=True)
def quantize_rows(x, xq, xs):
    """x fp32 [M, D] -> xq int8 [M, d_pad] (zero beyond D), xs fp32 [M] (per-token scale).

    Exactly reference.quantize_act: xs = amax / 127, xq = clip(rint(x * (127 / amax)), -127, 127)
    in fp32, round half to even; an all-zero row (or one holding Inf) gives inv = 0; NaN -> 0.
    """
    m_count, d = x.shape
    d_pad = xq.shape[1]
    for m in range(m_count):
        amax = _F0
        has_nan = False
        for k in range(d):
            a = abs(x[m, k])
            if a != a:
                has_nan = True
            elif a > amax:
                amax = a
        if has_nan:
            amax = np.float32(np.nan)
        xs[m] = amax / _F127
        inv = _F127 / amax if amax > _F0 else _F0
        for k in range(d):
            v = np.rint(x[m, k] * inv)
            if v != v:
                v = _F0
            elif v > _F127:
                v = _F127
            elif v < -_F127:
                v = -_F127
            xq[m, k] = np.int8(v)
        for k in range(d, d_pad):
            xq[m, k] = 0


@njit(nogil=True, cache=True)
def bf16_rows(x, xb):
    """x fp32 [M, D] -> xb uint16 [M, d_pad] bf16 bits (round to nearest even, NaN -> 0x7FC0)."""
    m_count, d = x.shape
    d_pad = xb.shape[1]
    for m in range(m_count):
        bits = x[m].view(np.uint32)
        for k in range(d):
            b = np.uint64(bits[k])
            if (b & np.uint64(0x7FFFFFFF)) > np.uint64(0x7F800000):
                xb[m, k] = np.uint16(0x7FC0)
            else:
                r = (b + np.uint64(0x7FFF) + ((b >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)
                xb[m, k] = np.uint16(r & np.uint64(0xFFFF))
        for k in range(d, d_pad):
            xb[m, k] = 0


@njit(nogil=True, cache=True)
def group_sums(xq, group_size, d_pad):
    """8 * sum of xq over each group of G along D: int32 [M, d_pad / G].

    The INT4 kernels multiply the stored nibble (q + 8) with the activations; subtracting this
    per-token, per-group term turns sum (q + 8) x into the wanted sum q x, exactly.
    """
    m_count = xq.shape[0]
    ng = d_pad // group_size
    xsum = np.empty((m_count, ng), np.int32)
    for m in range(m_count):
        for g in range(ng):
            s = 0
            for k in range(g * group_size, (g + 1) * group_size):
                s += np.int32(xq[m, k])
            xsum[m, g] = 8 * s
    return xsum
