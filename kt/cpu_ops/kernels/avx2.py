"""AVX2 kernels (ymm only, no AVX-512): INT8 / INT4 with vpmaddubsw + vpmaddwd, BF16 with FMA.

Same contract as avx512.py (kt/cpu_ops/README.md) and the same packed layout: each 64-byte
line is read as two 32-byte halves, rows 0-7 and rows 8-15 of the block.

INT8: vpmaddubsw multiplies unsigned by signed bytes and adds pairs into int16 with saturation.
With u = |w| and v = sign(x, w) (vpsignb: x negated where w < 0, zeroed where w == 0), u * v = w * x
for every byte. Weights are in [-127, 127] (reference.quantize clips there) and activations in
[-127, 127] (quantize_act clips there), so u <= 127 fits the unsigned operand, v never needs
-(-128), and a pair sum is at most 2 * 127 * 127 = 32258 < 32767: the int16 never saturates and the
result is exact. vpmaddwd with ones then widens pairs to int32 lanes (4 products per lane).
INT4: the nibble (q + 8) in [0, 15] is the unsigned operand, x the signed one; lo and hi nibble pair
sums (<= 2 * 15 * 127 each, 7620 together) are added in int16 before vpmaddwd. As with VNNI,
8 * sum(x over the group) is subtracted per token and group.
BF16: bf16 -> fp32 is a 16-bit shift (even k, low half of each 32-bit pair) or a mask (odd k),
then fp32 FMA.

gemv: one block (one sequential stream) at a time, tokens inside, K split over two accumulator
sets; gemm: 4 tokens x 1 block (INT4: 2 x 1) per step, M in chunks of tiling.gemm_m_chunk.
Token tails repeat the last token (the same values are stored twice).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .. import cache
from ._simd import (
    as_f32x8, as_i8x32, bcast4_i32x8, cvt_i32_f32, load_f32x8, load_i8x32, load_i32x8, pf_next,
    pmaddubsw256, pmaddwd256, prefetch, splat_f32x8, splat_i16x16, splat_i32x8, store, vabs_i8,
    vadd, vand, vfma, vmul, vsign_i8, vsll, vsrl, vsub)
from .actquant import group_sums
from ..tiling import gemm_m_chunk

cache.install()

_NIB = np.int32(0x0F0F0F0F)
_HI16 = np.int32(-65536)  # 0xFFFF0000


# ----------------------------------------------------------------------------- INT8

@njit(nogil=True, cache=True, inline="always")
def _i8_dot(acc, u, w, x, ones):
    # u = |w| (shared by all tokens), x = the token's broadcast k4 bytes.
    return vadd(acc, pmaddwd256(pmaddubsw256(u, vsign_i8(as_i8x32(x), w)), ones))


@njit(nogil=True, cache=True, inline="always")
def _i8_store(acc, scale, xsm, out, r, n0):
    f = vmul(cvt_i32_f32(acc), vmul(load_f32x8(scale, n0), splat_f32x8(xsm)))
    store(out, r + n0, f)


@njit(nogil=True, cache=True)
def gemv_int8(xq, xs, data, scale, wsum, out, nb0, nb1):
    """INT8 small-M GEMM (AVX2). Arguments as avx512.gemv_int8 (wsum unused)."""
    m_count = xq.shape[0]
    lines = data.shape[1]
    blk = lines * 64
    xrow = xq.strides[0]
    orow = out.strides[0] // 4
    ones = splat_i16x16(1)
    for b in range(nb0, nb1):
        p = b * blk
        for m in range(m_count):
            a0 = splat_i32x8(0)
            a1 = a0
            a2 = a0
            a3 = a0
            xo = m * xrow
            for j in range(0, lines, 2):  # lines is a multiple of 16
                o = p + 64 * j
                x = bcast4_i32x8(xq, xo + 4 * j)
                w = load_i8x32(data, o)
                a0 = _i8_dot(a0, vabs_i8(w), w, x, ones)
                w = load_i8x32(data, o + 32)
                a1 = _i8_dot(a1, vabs_i8(w), w, x, ones)
                x = bcast4_i32x8(xq, xo + 4 * j + 4)
                w = load_i8x32(data, o + 64)
                a2 = _i8_dot(a2, vabs_i8(w), w, x, ones)
                w = load_i8x32(data, o + 96)
                a3 = _i8_dot(a3, vabs_i8(w), w, x, ones)
            r = m * orow
            _i8_store(vadd(a0, a2), scale, xs[m], out, r, 16 * b)
            _i8_store(vadd(a1, a3), scale, xs[m], out, r, 16 * b + 8)


@njit(nogil=True, cache=True)
def gemm_int8(xq, xs, data, scale, wsum, out, nb0, nb1):
    """INT8 large-M GEMM (AVX2), 4 tokens x 1 block per step. Arguments as gemv_int8."""
    _gemm_int8(xq, xs, data, scale, out, nb0, nb1, True)


@njit(nogil=True, cache=True)
def _gemm_int8(xq, xs, data, scale, out, nb0, nb1, pf):
    # pf: the first token tile of a block prefetches the next block into L2 (_simd.pf_next)
    m_count = xq.shape[0]
    mc = gemm_m_chunk(m_count, xq.shape[1])
    for c0 in range(0, m_count, mc):
        _gemm_int8_rows(xq, xs, data, scale, out, nb0, nb1, c0, min(c0 + mc, m_count), pf)


@njit(nogil=True, cache=True)
def _gemm_int8_rows(xq, xs, data, scale, out, nb0, nb1, m_lo, m_hi, pf):
    lines = data.shape[1]
    blk = lines * 64
    xrow = xq.strides[0]
    orow = out.strides[0] // 4
    ones = splat_i16x16(1)
    last = m_hi - 1
    ppl = 1 if pf else 0
    for b in range(nb0, nb1):
        p = b * blk
        nend = min(b + 2, nb1) * blk
        for m0 in range(m_lo, m_hi, 4):
            m1 = min(m0 + 1, last)
            m2 = min(m0 + 2, last)
            m3 = min(m0 + 3, last)
            x0, x1, x2, x3 = m0 * xrow, m1 * xrow, m2 * xrow, m3 * xrow
            nxt = (b + 1) * blk if m0 == m_lo else nend
            c0l = splat_i32x8(0)
            c0h = c0l
            c1l = c0l
            c1h = c0l
            c2l = c0l
            c2h = c0l
            c3l = c0l
            c3h = c0l
            for j in range(lines):
                pf_next(data, nxt, j, ppl, nend, 64)
                o = p + 64 * j
                wl = load_i8x32(data, o)
                wh = load_i8x32(data, o + 32)
                ul = vabs_i8(wl)
                uh = vabs_i8(wh)
                k = 4 * j
                x = bcast4_i32x8(xq, x0 + k)
                c0l = _i8_dot(c0l, ul, wl, x, ones)
                c0h = _i8_dot(c0h, uh, wh, x, ones)
                x = bcast4_i32x8(xq, x1 + k)
                c1l = _i8_dot(c1l, ul, wl, x, ones)
                c1h = _i8_dot(c1h, uh, wh, x, ones)
                x = bcast4_i32x8(xq, x2 + k)
                c2l = _i8_dot(c2l, ul, wl, x, ones)
                c2h = _i8_dot(c2h, uh, wh, x, ones)
                x = bcast4_i32x8(xq, x3 + k)
                c3l = _i8_dot(c3l, ul, wl, x, ones)
                c3h = _i8_dot(c3h, uh, wh, x, ones)
            n = 16 * b
            _i8_store(c0l, scale, xs[m0], out, m0 * orow, n)
            _i8_store(c0h, scale, xs[m0], out, m0 * orow, n + 8)
            _i8_store(c1l, scale, xs[m1], out, m1 * orow, n)
            _i8_store(c1h, scale, xs[m1], out, m1 * orow, n + 8)
            _i8_store(c2l, scale, xs[m2], out, m2 * orow, n)
            _i8_store(c2h, scale, xs[m2], out, m2 * orow, n + 8)
            _i8_store(c3l, scale, xs[m3], out, m3 * orow, n)
            _i8_store(c3h, scale, xs[m3], out, m3 * orow, n + 8)


# ----------------------------------------------------------------------------- INT4

@njit(nogil=True, cache=True, inline="always")
def _i4_dot(acc, lo, hi, xlo, xhi, ones):
    t = vadd(pmaddubsw256(lo, xlo), pmaddubsw256(hi, xhi))  # <= 7620 per int16 lane
    return vadd(acc, pmaddwd256(t, ones))


@njit(nogil=True, cache=True, inline="always")
def _i4_group(f, acc, corr, scale, si):
    return vfma(cvt_i32_f32(vsub(acc, corr)), load_f32x8(scale, si), f)


INT4_PF_AHEAD = 4096  # bytes of packed lines gemv_int4 prefetches ahead (every line)


@njit(nogil=True, cache=True)
def gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1):
    """INT4 small-M GEMM (AVX2). Arguments as avx512.gemv_int4.

    Prefetches every packed line 4 KB ahead (as avx512.gemv_int4_pfl): one thread on the
    Zen 4 dev machine, 1536 x 2048 cold, 30.1 vs 24.9 GB/s without."""
    m_count = xq.shape[0]
    lines = data.shape[1]
    d_pad = lines * 8
    blk = lines * 64
    ng = d_pad // group_size
    gl = group_size // 8  # 4, 8 or 16 lines per group
    sblk = ng * 16
    xrow = xq.strides[0]
    orow = out.strides[0] // 4
    nib = splat_i32x8(_NIB)
    ones = splat_i16x16(1)
    xsum = group_sums(xq, group_size, d_pad)
    last = data.size - 1
    for b in range(nb0, nb1):
        p = b * blk
        for m in range(m_count):
            fl = splat_f32x8(0.0)
            fh = fl
            xo = m * xrow
            for g in range(ng):
                a0 = splat_i32x8(0)
                a1 = a0
                a2 = a0
                a3 = a0
                for j in range(g * gl, (g + 1) * gl, 2):
                    o = p + 64 * j
                    k = xo + 8 * j
                    prefetch(data, min(o + INT4_PF_AHEAD, last))
                    prefetch(data, min(o + 64 + INT4_PF_AHEAD, last))
                    xlo = bcast4_i32x8(xq, k)
                    xhi = bcast4_i32x8(xq, k + 4)
                    w = load_i32x8(data, o)
                    a0 = _i4_dot(a0, vand(w, nib), vand(vsrl(w, 4), nib), xlo, xhi, ones)
                    w = load_i32x8(data, o + 32)
                    a1 = _i4_dot(a1, vand(w, nib), vand(vsrl(w, 4), nib), xlo, xhi, ones)
                    xlo = bcast4_i32x8(xq, k + 8)
                    xhi = bcast4_i32x8(xq, k + 12)
                    w = load_i32x8(data, o + 64)
                    a2 = _i4_dot(a2, vand(w, nib), vand(vsrl(w, 4), nib), xlo, xhi, ones)
                    w = load_i32x8(data, o + 96)
                    a3 = _i4_dot(a3, vand(w, nib), vand(vsrl(w, 4), nib), xlo, xhi, ones)
                corr = splat_i32x8(xsum[m, g])
                si = b * sblk + g * 16
                fl = _i4_group(fl, vadd(a0, a2), corr, scale, si)
                fh = _i4_group(fh, vadd(a1, a3), corr, scale, si + 8)
            sv = splat_f32x8(xs[m])
            store(out, m * orow + 16 * b, vmul(fl, sv))
            store(out, m * orow + 16 * b + 8, vmul(fh, sv))


@njit(nogil=True, cache=True)
def gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1):
    """INT4 large-M GEMM (AVX2), 2 tokens x 1 block per step. Arguments as gemv_int4."""
    _gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1, True)


@njit(nogil=True, cache=True)
def _gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1, pf):
    # pf: as _gemm_int8
    m_count = xq.shape[0]
    xsum = group_sums(xq, group_size, xq.shape[1])
    mc = gemm_m_chunk(m_count, xq.shape[1])
    for c0 in range(0, m_count, mc):
        _gemm_int4_rows(xq, xs, xsum, data, scale, group_size, out, nb0, nb1, c0,
                        min(c0 + mc, m_count), pf)


@njit(nogil=True, cache=True)
def _gemm_int4_rows(xq, xs, xsum, data, scale, group_size, out, nb0, nb1, m_lo, m_hi, pf):
    lines = data.shape[1]
    d_pad = lines * 8
    blk = lines * 64
    ng = d_pad // group_size
    gl = group_size // 8
    sblk = ng * 16
    xrow = xq.strides[0]
    orow = out.strides[0] // 4
    nib = splat_i32x8(_NIB)
    ones = splat_i16x16(1)
    last = m_hi - 1
    ppl = 1 if pf else 0
    for b in range(nb0, nb1):
        p = b * blk
        nend = min(b + 2, nb1) * blk
        for m0 in range(m_lo, m_hi, 2):
            m1 = min(m0 + 1, last)
            x0, x1 = m0 * xrow, m1 * xrow
            nxt = (b + 1) * blk if m0 == m_lo else nend
            f0l = splat_f32x8(0.0)
            f0h = f0l
            f1l = f0l
            f1h = f0l
            for g in range(ng):
                c0l = splat_i32x8(0)
                c0h = c0l
                c1l = c0l
                c1h = c0l
                for j in range(g * gl, (g + 1) * gl):
                    pf_next(data, nxt, j, ppl, nend, 64)
                    o = p + 64 * j
                    w = load_i32x8(data, o)
                    lol = vand(w, nib)
                    hil = vand(vsrl(w, 4), nib)
                    w = load_i32x8(data, o + 32)
                    loh = vand(w, nib)
                    hih = vand(vsrl(w, 4), nib)
                    k = 8 * j
                    xlo = bcast4_i32x8(xq, x0 + k)
                    xhi = bcast4_i32x8(xq, x0 + k + 4)
                    c0l = _i4_dot(c0l, lol, hil, xlo, xhi, ones)
                    c0h = _i4_dot(c0h, loh, hih, xlo, xhi, ones)
                    xlo = bcast4_i32x8(xq, x1 + k)
                    xhi = bcast4_i32x8(xq, x1 + k + 4)
                    c1l = _i4_dot(c1l, lol, hil, xlo, xhi, ones)
                    c1h = _i4_dot(c1h, loh, hih, xlo, xhi, ones)
                si = b * sblk + g * 16
                corr = splat_i32x8(xsum[m0, g])
                f0l = _i4_group(f0l, c0l, corr, scale, si)
                f0h = _i4_group(f0h, c0h, corr, scale, si + 8)
                corr = splat_i32x8(xsum[m1, g])
                f1l = _i4_group(f1l, c1l, corr, scale, si)
                f1h = _i4_group(f1h, c1h, corr, scale, si + 8)
            n = 16 * b
            sv = splat_f32x8(xs[m0])
            store(out, m0 * orow + n, vmul(f0l, sv))
            store(out, m0 * orow + n + 8, vmul(f0h, sv))
            sv = splat_f32x8(xs[m1])
            store(out, m1 * orow + n, vmul(f1l, sv))
            store(out, m1 * orow + n + 8, vmul(f1h, sv))


# ----------------------------------------------------------------------------- BF16

@njit(nogil=True, cache=True, inline="always")
def _bf16_pair(acc_e, acc_o, w, xe, xo, hi):
    # w: 8 rows x (k even, k odd) bf16 pairs; even k in the low 16 bits, odd k in the high.
    acc_e = vfma(as_f32x8(vsll(w, 16)), xe, acc_e)
    acc_o = vfma(as_f32x8(vand(w, hi)), xo, acc_o)
    return acc_e, acc_o


@njit(nogil=True, cache=True)
def gemv_bf16(xb, data, out, nb0, nb1):
    """BF16 small-M GEMM (AVX2 FMA). Arguments as avx512.gemv_bf16."""
    m_count = xb.shape[0]
    lines = data.shape[1]
    blk = lines * 32
    xrow = xb.strides[0] // 2
    orow = out.strides[0] // 4
    hi = splat_i32x8(_HI16)
    for b in range(nb0, nb1):
        p = b * blk
        for m in range(m_count):
            e0 = splat_f32x8(0.0)
            o0 = e0
            e1 = e0
            o1 = e0
            e2 = e0
            o2 = e0
            e3 = e0
            o3 = e0
            xo = m * xrow
            for j in range(0, lines, 2):  # lines is a multiple of 32
                o = p + 32 * j
                x = bcast4_i32x8(xb, xo + 2 * j)
                xe = as_f32x8(vsll(x, 16))
                xd = as_f32x8(vand(x, hi))
                e0, o0 = _bf16_pair(e0, o0, load_i32x8(data, o), xe, xd, hi)
                e1, o1 = _bf16_pair(e1, o1, load_i32x8(data, o + 16), xe, xd, hi)
                x = bcast4_i32x8(xb, xo + 2 * j + 2)
                xe = as_f32x8(vsll(x, 16))
                xd = as_f32x8(vand(x, hi))
                e2, o2 = _bf16_pair(e2, o2, load_i32x8(data, o + 32), xe, xd, hi)
                e3, o3 = _bf16_pair(e3, o3, load_i32x8(data, o + 48), xe, xd, hi)
            r = m * orow
            store(out, r + 16 * b, vadd(vadd(e0, o0), vadd(e2, o2)))
            store(out, r + 16 * b + 8, vadd(vadd(e1, o1), vadd(e3, o3)))


@njit(nogil=True, cache=True)
def gemm_bf16(xb, data, out, nb0, nb1):
    """BF16 large-M GEMM (AVX2 FMA), 4 tokens x 1 block per step. Arguments as gemv_bf16."""
    _gemm_bf16(xb, data, out, nb0, nb1, True)


@njit(nogil=True, cache=True)
def _gemm_bf16(xb, data, out, nb0, nb1, pf):
    # pf: as _gemm_int8
    m_count = xb.shape[0]
    mc = gemm_m_chunk(m_count, 2 * xb.shape[1])
    for c0 in range(0, m_count, mc):
        _gemm_bf16_rows(xb, data, out, nb0, nb1, c0, min(c0 + mc, m_count), pf)


@njit(nogil=True, cache=True)
def _gemm_bf16_rows(xb, data, out, nb0, nb1, m_lo, m_hi, pf):
    lines = data.shape[1]
    blk = lines * 32
    xrow = xb.strides[0] // 2
    orow = out.strides[0] // 4
    hi = splat_i32x8(_HI16)
    last = m_hi - 1
    ppl = 1 if pf else 0
    for b in range(nb0, nb1):
        p = b * blk
        nend = min(b + 2, nb1) * blk
        for m0 in range(m_lo, m_hi, 4):
            m1 = min(m0 + 1, last)
            m2 = min(m0 + 2, last)
            m3 = min(m0 + 3, last)
            x0, x1, x2, x3 = m0 * xrow, m1 * xrow, m2 * xrow, m3 * xrow
            nxt = (b + 1) * blk if m0 == m_lo else nend
            c0l = splat_f32x8(0.0)
            c0h = c0l
            c1l = c0l
            c1h = c0l
            c2l = c0l
            c2h = c0l
            c3l = c0l
            c3h = c0l
            for j in range(lines):
                pf_next(data, nxt, j, ppl, nend, 32)
                o = p + 32 * j
                w = load_i32x8(data, o)
                wel = as_f32x8(vsll(w, 16))
                wol = as_f32x8(vand(w, hi))
                w = load_i32x8(data, o + 16)
                weh = as_f32x8(vsll(w, 16))
                woh = as_f32x8(vand(w, hi))
                k = 2 * j
                x = bcast4_i32x8(xb, x0 + k)
                xe = as_f32x8(vsll(x, 16))
                xd = as_f32x8(vand(x, hi))
                c0l = vfma(wol, xd, vfma(wel, xe, c0l))
                c0h = vfma(woh, xd, vfma(weh, xe, c0h))
                x = bcast4_i32x8(xb, x1 + k)
                xe = as_f32x8(vsll(x, 16))
                xd = as_f32x8(vand(x, hi))
                c1l = vfma(wol, xd, vfma(wel, xe, c1l))
                c1h = vfma(woh, xd, vfma(weh, xe, c1h))
                x = bcast4_i32x8(xb, x2 + k)
                xe = as_f32x8(vsll(x, 16))
                xd = as_f32x8(vand(x, hi))
                c2l = vfma(wol, xd, vfma(wel, xe, c2l))
                c2h = vfma(woh, xd, vfma(weh, xe, c2h))
                x = bcast4_i32x8(xb, x3 + k)
                xe = as_f32x8(vsll(x, 16))
                xd = as_f32x8(vand(x, hi))
                c3l = vfma(wol, xd, vfma(wel, xe, c3l))
                c3h = vfma(woh, xd, vfma(weh, xe, c3h))
            n = 16 * b
            store(out, m0 * orow + n, c0l)
            store(out, m0 * orow + n + 8, c0h)
            store(out, m1 * orow + n, c1l)
            store(out, m1 * orow + n + 8, c1h)
            store(out, m2 * orow + n, c2l)
            store(out, m2 * orow + n + 8, c2h)
            store(out, m3 * orow + n, c3l)
            store(out, m3 * orow + n + 8, c3h)
