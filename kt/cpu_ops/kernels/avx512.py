"""AVX-512 kernels: INT8 / INT4 with VNNI (vpdpbusd), BF16 with AVX512_BF16 (vdpbf16ps).

Every kernel follows kt/cpu_ops/README.md: it reads one packed weight (packing.py), computes the
16-row blocks [nb0, nb1) for all M tokens and overwrites out[:, 16*nb0 : 16*nb1].

- gemv (decode, M = 1-2): one block (16 rows x D, one sequential stream) at a time with four
  accumulator chains split along K, the token loop inside the block so its lines come from memory
  once and from L1/L2 for the other tokens. One stream per call measured faster on cold weights
  than four interleaved block streams (32 vs 25 GB/s here). Software prefetch slowed INT8 and BF16
  here; INT4 prefetches every packed line (``gemv_int4_pfl``: faster on Zen 4 and on the AMX Xeon
  than prefetching every other line, which Intel's adjacent-line prefetcher completes).
- gemm (prefill): 4 tokens x 4 blocks per step (INT4: 4 x 2, its fp32 group sums need registers
  too), 16 accumulators; each weight line load feeds 4 tokens and each activation broadcast feeds
  4 blocks. M is swept in chunks of tiling.gemm_m_chunk tokens so the chunk's activations stay
  in L2 while each weight group (4 blocks x 16 rows x D) is swept; weights are then read from
  memory once per chunk. A group whose blocks run past nb1 repeats the last block
  (min(b, nb1 - 1)) and a token tile past M the last token: the same values are computed and
  stored twice, which is harmless and keeps one code path. While a group is swept, its token
  tiles prefetch the next group into L2 (``_simd.pf_next``): only the first tile of a group read its
  lines from memory, stalled on them, and at the layer's 8-32 rows per expert that was most of the
  time (Zen 4, one thread, cold: INT8 M=8 / 32 / 128 1.34-1.61x / 1.08-1.15x / 1.02x faster).

INT8: vpdpbusd multiplies unsigned by signed bytes, so activations are offset by +128 (xor 0x80)
and 128 * wsum[n] is subtracted from the exact int32 sum. The offset copy is made once per call
into a scratch [M, d_pad] (``_offset_rows``): xor-ing the broadcast in the inner loop instead
makes LLVM 22's code generation hang (llvmlite 0.50: the compile never finishes).
INT4: the stored nibble (q + 8) is the unsigned operand and the int8 activation the signed one;
8 * sum(x over the group) per token and group is subtracted before the group scale is applied.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .. import cache
from ._simd import (
    bcast4_i32x16, cvt_i32_f32, dpbf16ps512, empty_line, load_f32x16, load_i8_i32x16, load_i32x16,
    pf_next, prefetch, prefetch_l2, splat_f32x16, splat_i32x16, store, vadd, vand, vfma, vmul, vpdpbusd512, vsll, vsra, vsrl, vsub,
    vxor)
from .actquant import group_sums
from ..tiling import gemm_m_chunk

cache.install()

_FLIP = np.int32(-2139062144)  # 0x80808080: x ^ 0x80 == x + 128 as an unsigned byte
_NIB = np.int32(0x0F0F0F0F)
_NHI = np.int32(-252645136)  # 0xF0F0F0F0
# the ratio-table bytes of a _gemv_int4 call on group scales: none (a frozen constant, so the
# decode path allocates nothing for it)
_NO_RX = np.zeros(0, np.int8)


@njit(nogil=True, cache=True)
def _offset_rows(xq):
    """xq int8 [M, d_pad] -> uint8 [M, d_pad] = xq + 128 (d_pad a multiple of 64)."""
    m_count, d_pad = xq.shape
    xu = empty_line(m_count * d_pad, np.uint8).reshape((m_count, d_pad))
    flip = splat_i32x16(_FLIP)
    xrow = xq.strides[0]
    for m in range(m_count):
        for k in range(0, d_pad, 64):
            store(xu, m * d_pad + k, vxor(load_i32x16(xq, m * xrow + k), flip))
    return xu


@njit(nogil=True, cache=True, inline="always")
def _int8_epilogue(acc, wsum, scale, xsm, out, o):
    # acc = sum (x + 128) * q = sum x * q + 128 * wsum; the int32 result is exact.
    n0 = o[1]
    acc = vsub(acc, vsll(load_i32x16(wsum, n0), 7))
    f = vmul(cvt_i32_f32(acc), vmul(load_f32x16(scale, n0), splat_f32x16(xsm)))
    store(out, o[0] + n0, f)


@njit(nogil=True, cache=True)
def gemv_int8(xq, xs, data, scale, wsum, out, nb0, nb1):
    """INT8 small-M GEMM. xq int8 [M, d_pad], xs fp32 [M], data int8 [NB, d_pad/4, 16, 4],
    scale fp32 [n_pad], wsum int32 [n_pad], out fp32 [M, >= 16*nb1]."""
    m_count = xq.shape[0]
    lines = data.shape[1]
    blk = lines * 64
    xu = _offset_rows(xq)
    xrow = xu.strides[0]
    orow = out.strides[0] // 4
    for b in range(nb0, nb1):
        p = b * blk
        for m in range(m_count):
            a0 = splat_i32x16(0)
            a1 = a0
            a2 = a0
            a3 = a0
            xo = m * xrow
            for j in range(0, lines, 4):  # lines is a multiple of 16
                o = p + 64 * j
                k = xo + 4 * j
                a0 = vpdpbusd512(a0, bcast4_i32x16(xu, k), load_i32x16(data, o))
                a1 = vpdpbusd512(a1, bcast4_i32x16(xu, k + 4), load_i32x16(data, o + 64))
                a2 = vpdpbusd512(a2, bcast4_i32x16(xu, k + 8), load_i32x16(data, o + 128))
                a3 = vpdpbusd512(a3, bcast4_i32x16(xu, k + 12), load_i32x16(data, o + 192))
            _int8_epilogue(vadd(vadd(a0, a1), vadd(a2, a3)), wsum, scale, xs[m], out,
                           (m * orow, 16 * b))


@njit(nogil=True, cache=True)
def gemm_int8(xq, xs, data, scale, wsum, out, nb0, nb1):
    """INT8 large-M GEMM, 4 tokens x 4 blocks per step, M in chunks (tiling.gemm_m_chunk).
    Arguments as gemv_int8."""
    _gemm_int8(xq, xs, data, scale, wsum, out, nb0, nb1, True)


@njit(nogil=True, cache=True)
def _gemm_int8(xq, xs, data, scale, wsum, out, nb0, nb1, pf):
    # pf: prefetch the next block group into L2 (_simd.pf_next); False only for side-by-side timing
    m_count = xq.shape[0]
    xu = _offset_rows(xq)
    mc = gemm_m_chunk(m_count, xu.shape[1])
    for c0 in range(0, m_count, mc):
        _gemm_int8_rows(xu, xs, data, scale, wsum, out, nb0, nb1, c0, min(c0 + mc, m_count), pf)


@njit(nogil=True, cache=True)
def _gemm_int8_rows(xu, xs, data, scale, wsum, out, nb0, nb1, m_lo, m_hi, pf):
    lines = data.shape[1]
    blk = lines * 64
    xrow = xu.strides[0]
    orow = out.strides[0] // 4
    last = m_hi - 1
    ppl = -(-4 // ((m_hi - m_lo + 3) // 4)) if pf else 0
    for b0 in range(nb0, nb1, 4):
        b1 = min(b0 + 1, nb1 - 1)
        b2 = min(b0 + 2, nb1 - 1)
        b3 = min(b0 + 3, nb1 - 1)
        p0, p1, p2, p3 = b0 * blk, b1 * blk, b2 * blk, b3 * blk
        nend = min(b0 + 8, nb1) * blk
        for m0 in range(m_lo, m_hi, 4):
            m1 = min(m0 + 1, last)
            m2 = min(m0 + 2, last)
            m3 = min(m0 + 3, last)
            x0, x1, x2, x3 = m0 * xrow, m1 * xrow, m2 * xrow, m3 * xrow
            nxt = (b0 + 4) * blk + (m0 - m_lo) // 4 * ppl * blk
            c00 = splat_i32x16(0)
            c01 = c00
            c02 = c00
            c03 = c00
            c10 = c00
            c11 = c00
            c12 = c00
            c13 = c00
            c20 = c00
            c21 = c00
            c22 = c00
            c23 = c00
            c30 = c00
            c31 = c00
            c32 = c00
            c33 = c00
            for j in range(lines):
                pf_next(data, nxt, j, ppl, nend, 64)
                o = 64 * j
                w0 = load_i32x16(data, p0 + o)
                w1 = load_i32x16(data, p1 + o)
                w2 = load_i32x16(data, p2 + o)
                w3 = load_i32x16(data, p3 + o)
                k = 4 * j
                v = bcast4_i32x16(xu, x0 + k)
                c00 = vpdpbusd512(c00, v, w0)
                c01 = vpdpbusd512(c01, v, w1)
                c02 = vpdpbusd512(c02, v, w2)
                c03 = vpdpbusd512(c03, v, w3)
                v = bcast4_i32x16(xu, x1 + k)
                c10 = vpdpbusd512(c10, v, w0)
                c11 = vpdpbusd512(c11, v, w1)
                c12 = vpdpbusd512(c12, v, w2)
                c13 = vpdpbusd512(c13, v, w3)
                v = bcast4_i32x16(xu, x2 + k)
                c20 = vpdpbusd512(c20, v, w0)
                c21 = vpdpbusd512(c21, v, w1)
                c22 = vpdpbusd512(c22, v, w2)
                c23 = vpdpbusd512(c23, v, w3)
                v = bcast4_i32x16(xu, x3 + k)
                c30 = vpdpbusd512(c30, v, w0)
                c31 = vpdpbusd512(c31, v, w1)
                c32 = vpdpbusd512(c32, v, w2)
                c33 = vpdpbusd512(c33, v, w3)
            n0, n1, n2, n3 = 16 * b0, 16 * b1, 16 * b2, 16 * b3
            r, s = m0 * orow, xs[m0]
            _int8_epilogue(c00, wsum, scale, s, out, (r, n0))
            _int8_epilogue(c01, wsum, scale, s, out, (r, n1))
            _int8_epilogue(c02, wsum, scale, s, out, (r, n2))
            _int8_epilogue(c03, wsum, scale, s, out, (r, n3))
            r, s = m1 * orow, xs[m1]
            _int8_epilogue(c10, wsum, scale, s, out, (r, n0))
            _int8_epilogue(c11, wsum, scale, s, out, (r, n1))
            _int8_epilogue(c12, wsum, scale, s, out, (r, n2))
            _int8_epilogue(c13, wsum, scale, s, out, (r, n3))
            r, s = m2 * orow, xs[m2]
            _int8_epilogue(c20, wsum, scale, s, out, (r, n0))
            _int8_epilogue(c21, wsum, scale, s, out, (r, n1))
            _int8_epilogue(c22, wsum, scale, s, out, (r, n2))
            _int8_epilogue(c23, wsum, scale, s, out, (r, n3))
            r, s = m3 * orow, xs[m3]
            _int8_epilogue(c30, wsum, scale, s, out, (r, n0))
            _int8_epilogue(c31, wsum, scale, s, out, (r, n1))
            _int8_epilogue(c32, wsum, scale, s, out, (r, n2))
            _int8_epilogue(c33, wsum, scale, s, out, (r, n3))


# ----------------------------------------------------------------------------- INT4

@njit(nogil=True, cache=True, inline="always")
def _i4_step(acc, w, xlo, xhi, nib):
    # One 64-byte line: low nibbles are k4 group 2j, high nibbles group 2j + 1.
    acc = vpdpbusd512(acc, vand(w, nib), xlo)
    return vpdpbusd512(acc, vand(vsrl(w, 4), nib), xhi)


@njit(nogil=True, cache=True, inline="always")
def _i4_group(f, acc, corr, scale, si):
    return vfma(cvt_i32_f32(vsub(acc, corr)), load_f32x16(scale, si), f)


INT4_PFL_AHEAD = 4096  # bytes of packed lines gemv_int4_pfl prefetches ahead (every line)
INT4_TAB_AHEAD = 8192  # ... and gemv_int4_tab, into L2


@njit(nogil=True, cache=True)
def gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1):
    """INT4 small-M GEMM. xq int8 [M, d_pad], xs fp32 [M], data uint8 [NB, d_pad/8, 16, 4],
    scale fp32 [NB, d_pad/G, 16], out fp32 [M, >= 16*nb1]."""
    _gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1, 0, False, _NO_RX, False)


@njit(nogil=True, cache=True)
def gemv_int4_pfl(xq, xs, data, scale, group_size, out, nb0, nb1):
    """``gemv_int4`` with a software prefetch of every packed line INT4_PFL_AHEAD bytes ahead: the
    INT4 decode kernel on AVX-512 and AMX hosts. On the Zen 4 dev machine (one thread, cold
    weights, interleaved) it reads 29-31 GB/s where the plain kernel reads 26-27 and the
    every-other-line prefetch (2 KiB ahead) 22-24: Zen 4 does not fetch the pair's other line by
    itself. On the 16-core Emerald Rapids (qwen3 layer, 16 threads, interleaved, min ms;
    ``benchmarks/profile_moe.py``) it beat the every-other-line prefetch too: T=1 0.18 vs 0.20,
    T=4 0.55 vs 0.65 (and that one beat no prefetch: T=1 0.26 vs 0.28, T=4 0.79 vs 0.91)."""
    _gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1, INT4_PFL_AHEAD, True, _NO_RX, False)


@njit(nogil=True, cache=True)
def gemv_int4_tab(xq, xs, data, tab, group_size, out, nb0, nb1):
    """``gemv_int4_pfl`` on a matrix's INT4 ratio table (``packing.int4_ratio_table``: the
    group scales as s_row * r_g, tab [1, rows, 16] in place of the scales): each group's int32
    sum is multiplied by its integer ratio r_g and added in int32 (exact: |r_g q| <= 126 per
    weight), and one fp32 product by s_row * xs ends the row, instead of a fp32 multiply-add by
    each group's scale. It reads 16 bytes of ratios per (block, group) where the scales take
    64: 8 % fewer bytes for a decode that runs at the memory bandwidth (the qwen3 INT4 layer at
    T=1 / 4: 4-6 % faster on 2 dev threads and on the device's 16). It prefetches
    every line INT4_TAB_AHEAD bytes ahead into L2 (prefetcht1), not 4 KiB ahead into L1: the
    layers that have tables run on Intel hosts (AMX, AVX-512 VNNI), where that keeps more lines
    in flight per core. qwen3 layer, T=1, interleaved (``benchmarks/cpu_decode_floor.py``),
    min / median ms against L1 4 KiB: 2 dev threads 0.716 / 0.777 vs 0.785 / 0.834 and 0.832 /
    0.957 vs 0.870 / 0.981, 1 dev thread 1.383 / 1.474 vs 1.492 / 1.585; on the device's 16
    threads level (two runs: 0.200 / 0.219 vs 0.206 / 0.227, 0.211 / 0.261 vs 0.213 / 0.245; L2
    4 KiB 0.219 / 0.244 and 0.198 / 0.237). ``gemv_int4_pfl`` keeps L1, as
    tuned on Zen 4. Not a contract kernel: ``CPUMoE`` calls it with its tables."""
    _gemv_int4(xq, xs, data, tab, group_size, out, nb0, nb1, INT4_TAB_AHEAD, True,
               tab.reshape(-1).view(np.int8), True)


@njit(nogil=True, cache=True)
def _gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1, ahead, every_line, rxb, l2):
    """The INT4 GEMV body; rxb non-empty: ``scale`` is a ratio table and rxb its bytes
    (``gemv_int4_tab``); l2: the prefetches ``ahead`` bytes ahead go to L2 (prefetcht1), not L1."""
    m_count = xq.shape[0]
    lines = data.shape[1]
    d_pad = lines * 8
    blk = lines * 64
    ng = d_pad // group_size
    gl = group_size // 8  # 4, 8 or 16 lines per group
    sblk = ng * 16
    xrow = xq.strides[0]
    orow = out.strides[0] // 4
    nib = splat_i32x16(_NIB)
    nhi = splat_i32x16(_NHI)
    xsum = group_sums(xq, group_size, d_pad)
    last = data.size - 1
    tab = rxb.size > 0
    rx0 = data.shape[0] * 64  # tab: the ratios follow the s_row of every block (16 fp32 each)
    for b in range(nb0, nb1):
        p = b * blk
        for m in range(m_count):
            f = splat_f32x16(0.0)
            ia = splat_i32x16(0)
            xo = m * xrow
            for g in range(ng):
                a0 = splat_i32x16(0)
                a1 = a0
                a2 = a0
                a3 = a0
                for j in range(g * gl, (g + 1) * gl, 2):
                    # High nibbles stay in place (w & 0xF0 = 16 * nibble, still a valid u8
                    # operand): their sums come out x16 and one exact >> 4 per group replaces a
                    # shift per line (measured +3-15 % on cold decode).
                    o = p + 64 * j
                    k = xo + 8 * j
                    if ahead > 0 and l2:
                        prefetch_l2(data, min(o + ahead, last))
                        if every_line:
                            prefetch_l2(data, min(o + 64 + ahead, last))
                    elif ahead > 0:
                        prefetch(data, min(o + ahead, last))
                        if every_line:
                            prefetch(data, min(o + 64 + ahead, last))
                    w = load_i32x16(data, o)
                    a0 = vpdpbusd512(a0, vand(w, nib), bcast4_i32x16(xq, k))
                    a1 = vpdpbusd512(a1, vand(w, nhi), bcast4_i32x16(xq, k + 4))
                    w = load_i32x16(data, o + 64)
                    a2 = vpdpbusd512(a2, vand(w, nib), bcast4_i32x16(xq, k + 8))
                    a3 = vpdpbusd512(a3, vand(w, nhi), bcast4_i32x16(xq, k + 12))
                acc = vadd(vadd(a0, a2), vsra(vadd(a1, a3), 4))
                if tab:
                    ia = vadd(ia, vmul(vsub(acc, splat_i32x16(xsum[m, g])),
                                       load_i8_i32x16(rxb, rx0 + (b * ng + g) * 16)))
                else:
                    f = _i4_group(f, acc, splat_i32x16(xsum[m, g]), scale, b * sblk + g * 16)
            if tab:
                f = vmul(cvt_i32_f32(ia), load_f32x16(scale, b * 16))
            store(out, m * orow + 16 * b, vmul(f, splat_f32x16(xs[m])))


@njit(nogil=True, cache=True)
def gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1):
    """INT4 large-M GEMM, 4 tokens x 2 blocks per step (8 int32 + 8 fp32 accumulators), M in
    chunks (tiling.gemm_m_chunk). Arguments as gemv_int4."""
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
    nib = splat_i32x16(_NIB)
    last = m_hi - 1
    ppl = -(-2 // ((m_hi - m_lo + 3) // 4)) if pf else 0
    for b0 in range(nb0, nb1, 2):
        b1 = min(b0 + 1, nb1 - 1)
        p0, p1 = b0 * blk, b1 * blk
        nend = min(b0 + 4, nb1) * blk
        for m0 in range(m_lo, m_hi, 4):
            m1 = min(m0 + 1, last)
            m2 = min(m0 + 2, last)
            m3 = min(m0 + 3, last)
            x0, x1, x2, x3 = m0 * xrow, m1 * xrow, m2 * xrow, m3 * xrow
            nxt = (b0 + 2) * blk + (m0 - m_lo) // 4 * ppl * blk
            f00 = splat_f32x16(0.0)
            f01 = f00
            f10 = f00
            f11 = f00
            f20 = f00
            f21 = f00
            f30 = f00
            f31 = f00
            for g in range(ng):
                c00 = splat_i32x16(0)
                c01 = c00
                c10 = c00
                c11 = c00
                c20 = c00
                c21 = c00
                c30 = c00
                c31 = c00
                for j in range(g * gl, (g + 1) * gl):
                    pf_next(data, nxt, j, ppl, nend, 64)
                    o = 64 * j
                    w = load_i32x16(data, p0 + o)
                    l0 = vand(w, nib)
                    h0 = vand(vsrl(w, 4), nib)
                    w = load_i32x16(data, p1 + o)
                    l1 = vand(w, nib)
                    h1 = vand(vsrl(w, 4), nib)
                    k = 8 * j
                    v = bcast4_i32x16(xq, x0 + k)
                    c00 = vpdpbusd512(c00, l0, v)
                    c01 = vpdpbusd512(c01, l1, v)
                    v = bcast4_i32x16(xq, x0 + k + 4)
                    c00 = vpdpbusd512(c00, h0, v)
                    c01 = vpdpbusd512(c01, h1, v)
                    v = bcast4_i32x16(xq, x1 + k)
                    c10 = vpdpbusd512(c10, l0, v)
                    c11 = vpdpbusd512(c11, l1, v)
                    v = bcast4_i32x16(xq, x1 + k + 4)
                    c10 = vpdpbusd512(c10, h0, v)
                    c11 = vpdpbusd512(c11, h1, v)
                    v = bcast4_i32x16(xq, x2 + k)
                    c20 = vpdpbusd512(c20, l0, v)
                    c21 = vpdpbusd512(c21, l1, v)
                    v = bcast4_i32x16(xq, x2 + k + 4)
                    c20 = vpdpbusd512(c20, h0, v)
                    c21 = vpdpbusd512(c21, h1, v)
                    v = bcast4_i32x16(xq, x3 + k)
                    c30 = vpdpbusd512(c30, l0, v)
                    c31 = vpdpbusd512(c31, l1, v)
                    v = bcast4_i32x16(xq, x3 + k + 4)
                    c30 = vpdpbusd512(c30, h0, v)
                    c31 = vpdpbusd512(c31, h1, v)
                s0 = b0 * sblk + g * 16
                s1 = b1 * sblk + g * 16
                corr = splat_i32x16(xsum[m0, g])
                f00 = _i4_group(f00, c00, corr, scale, s0)
                f01 = _i4_group(f01, c01, corr, scale, s1)
                corr = splat_i32x16(xsum[m1, g])
                f10 = _i4_group(f10, c10, corr, scale, s0)
                f11 = _i4_group(f11, c11, corr, scale, s1)
                corr = splat_i32x16(xsum[m2, g])
                f20 = _i4_group(f20, c20, corr, scale, s0)
                f21 = _i4_group(f21, c21, corr, scale, s1)
                corr = splat_i32x16(xsum[m3, g])
                f30 = _i4_group(f30, c30, corr, scale, s0)
                f31 = _i4_group(f31, c31, corr, scale, s1)
            n0, n1 = 16 * b0, 16 * b1
            sv = splat_f32x16(xs[m0])
            store(out, m0 * orow + n0, vmul(f00, sv))
            store(out, m0 * orow + n1, vmul(f01, sv))
            sv = splat_f32x16(xs[m1])
            store(out, m1 * orow + n0, vmul(f10, sv))
            store(out, m1 * orow + n1, vmul(f11, sv))
            sv = splat_f32x16(xs[m2])
            store(out, m2 * orow + n0, vmul(f20, sv))
            store(out, m2 * orow + n1, vmul(f21, sv))
            sv = splat_f32x16(xs[m3])
            store(out, m3 * orow + n0, vmul(f30, sv))
            store(out, m3 * orow + n1, vmul(f31, sv))


# ----------------------------------------------------------------------------- BF16

@njit(nogil=True, cache=True)
def gemv_bf16(xb, data, out, nb0, nb1):
    """BF16 small-M GEMM. xb uint16 [M, d_pad] (bf16 bits), data uint16 [NB, d_pad/2, 16, 2],
    out fp32 [M, >= 16*nb1]; fp32 accumulation."""
    m_count = xb.shape[0]
    lines = data.shape[1]
    blk = lines * 32
    xrow = xb.strides[0] // 2
    orow = out.strides[0] // 4
    for b in range(nb0, nb1):
        p = b * blk
        for m in range(m_count):
            a0 = splat_f32x16(0.0)
            a1 = a0
            a2 = a0
            a3 = a0
            xo = m * xrow
            for j in range(0, lines, 4):  # lines is a multiple of 32
                o = p + 32 * j
                k = xo + 2 * j
                a0 = dpbf16ps512(a0, bcast4_i32x16(xb, k), load_i32x16(data, o))
                a1 = dpbf16ps512(a1, bcast4_i32x16(xb, k + 2), load_i32x16(data, o + 32))
                a2 = dpbf16ps512(a2, bcast4_i32x16(xb, k + 4), load_i32x16(data, o + 64))
                a3 = dpbf16ps512(a3, bcast4_i32x16(xb, k + 6), load_i32x16(data, o + 96))
            store(out, m * orow + 16 * b, vadd(vadd(a0, a1), vadd(a2, a3)))


@njit(nogil=True, cache=True)
def gemm_bf16(xb, data, out, nb0, nb1):
    """BF16 large-M GEMM, 4 tokens x 4 blocks per step, M in chunks (tiling.gemm_m_chunk).
    Arguments as gemv_bf16."""
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
    last = m_hi - 1
    ppl = -(-4 // ((m_hi - m_lo + 3) // 4)) if pf else 0
    for b0 in range(nb0, nb1, 4):
        b1 = min(b0 + 1, nb1 - 1)
        b2 = min(b0 + 2, nb1 - 1)
        b3 = min(b0 + 3, nb1 - 1)
        p0, p1, p2, p3 = b0 * blk, b1 * blk, b2 * blk, b3 * blk
        nend = min(b0 + 8, nb1) * blk
        for m0 in range(m_lo, m_hi, 4):
            m1 = min(m0 + 1, last)
            m2 = min(m0 + 2, last)
            m3 = min(m0 + 3, last)
            x0, x1, x2, x3 = m0 * xrow, m1 * xrow, m2 * xrow, m3 * xrow
            nxt = (b0 + 4) * blk + (m0 - m_lo) // 4 * ppl * blk
            c00 = splat_f32x16(0.0)
            c01 = c00
            c02 = c00
            c03 = c00
            c10 = c00
            c11 = c00
            c12 = c00
            c13 = c00
            c20 = c00
            c21 = c00
            c22 = c00
            c23 = c00
            c30 = c00
            c31 = c00
            c32 = c00
            c33 = c00
            for j in range(lines):
                pf_next(data, nxt, j, ppl, nend, 32)
                o = 32 * j
                w0 = load_i32x16(data, p0 + o)
                w1 = load_i32x16(data, p1 + o)
                w2 = load_i32x16(data, p2 + o)
                w3 = load_i32x16(data, p3 + o)
                k = 2 * j
                v = bcast4_i32x16(xb, x0 + k)
                c00 = dpbf16ps512(c00, v, w0)
                c01 = dpbf16ps512(c01, v, w1)
                c02 = dpbf16ps512(c02, v, w2)
                c03 = dpbf16ps512(c03, v, w3)
                v = bcast4_i32x16(xb, x1 + k)
                c10 = dpbf16ps512(c10, v, w0)
                c11 = dpbf16ps512(c11, v, w1)
                c12 = dpbf16ps512(c12, v, w2)
                c13 = dpbf16ps512(c13, v, w3)
                v = bcast4_i32x16(xb, x2 + k)
                c20 = dpbf16ps512(c20, v, w0)
                c21 = dpbf16ps512(c21, v, w1)
                c22 = dpbf16ps512(c22, v, w2)
                c23 = dpbf16ps512(c23, v, w3)
                v = bcast4_i32x16(xb, x3 + k)
                c30 = dpbf16ps512(c30, v, w0)
                c31 = dpbf16ps512(c31, v, w1)
                c32 = dpbf16ps512(c32, v, w2)
                c33 = dpbf16ps512(c33, v, w3)
            n0, n1, n2, n3 = 16 * b0, 16 * b1, 16 * b2, 16 * b3
            r = m0 * orow
            store(out, r + n0, c00)
            store(out, r + n1, c01)
            store(out, r + n2, c02)
            store(out, r + n3, c03)
            r = m1 * orow
            store(out, r + n0, c10)
            store(out, r + n1, c11)
            store(out, r + n2, c12)
            store(out, r + n3, c13)
            r = m2 * orow
            store(out, r + n0, c20)
            store(out, r + n1, c21)
            store(out, r + n2, c22)
            store(out, r + n3, c23)
            r = m3 * orow
            store(out, r + n0, c30)
            store(out, r + n1, c31)
            store(out, r + n2, c32)
            store(out, r + n3, c33)
