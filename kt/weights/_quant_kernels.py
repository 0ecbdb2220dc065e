"""Quantise-and-pack in one pass (INT8, INT4, BF16), portable scalar Numba code, no ISA intrinsics.

Each kernel reads one expert matrix src [N, D] (bf16 bit patterns as uint16, or float32), and writes
rows ``row0 .. row0+N`` of one expert's packed arrays in the layout of ``kt/cpu_ops/packing.py``
(16-row blocks, VNNI order), including the zero (INT4: nibble 8) padding along D. The arithmetic is
the one of ``kt.reference.quantize`` (fp32 scale = amax / qmax, for INT4 then rounded to s_row * r_g
as ``reference.int4_ratio_scales``; fp32 inverse, rint half-to-even, clip), so the output is
bit-identical to ``packing.pack_quantized(reference.quantize(w))``.
Each kernel returns the number of non-finite source values it met (the caller raises).

The kernels are ``nogil``: the converter runs one expert per Python thread.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..cpu_ops.cache import prefer_512_bit_vectors

prefer_512_bit_vectors()  # before Numba's first compile (kt.cpu_ops.cache explains)

_F32_MAX = np.float32(3.4028234663852886e38)
_RATIO_MAX = 18  # reference.INT4_RATIO_MAX


def _load_row(src, r, buf, bits):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_load_row, jit_options={"nogil": True})
def _load_row_impl(src, r, buf, bits):
    """Row r of src as fp32 into buf (bits is buf viewed as uint32)."""
    if isinstance(src.dtype, types.Integer) and src.dtype.bitwidth == 16:
        def impl(src, r, buf, bits):  # bf16 bit patterns: widen to the fp32 bit pattern
            for k in range(src.shape[1]):
                bits[k] = np.uint32(src[r, k]) << np.uint32(16)
        return impl

    def impl(src, r, buf, bits):
        for k in range(src.shape[1]):
            buf[k] = np.float32(src[r, k])
    return impl


@njit(nogil=True, cache=True, inline="always")
def _amax_bits(bits, k0, k1):
    """max |x| over bits[k0:k1] as an fp32 bit pattern (integer order = float order for |x|)."""
    m = np.uint32(0)
    for k in range(k0, k1):
        v = bits[k] & np.uint32(0x7FFFFFFF)
        if v > m:
            m = v
    return m


@njit(nogil=True, cache=True)
def quant_pack_int8(src, row0, data32, scale, wsum):
    """src [N, D] -> data int8 [NB, d_pad/4, 16, 4] seen as data32 uint32 [NB, d_pad/4, 16],
    scale fp32 [n_pad], wsum int32 [n_pad]."""
    n, d = src.shape
    d_pad = data32.shape[1] * 4
    buf = np.zeros(d_pad, np.float32)
    bits = buf.view(np.uint32)
    qrow = np.zeros(d_pad, np.int8)
    q32 = qrow.view(np.uint32)
    amaxf = np.zeros(1, np.float32)
    amaxb = amaxf.view(np.uint32)
    bad = 0
    for r in range(n):
        _load_row(src, r, buf, bits)
        amaxb[0] = _amax_bits(bits, 0, d)
        if amaxb[0] >= np.uint32(0x7F800000):
            bad += 1
            continue
        s = np.float32(amaxf[0] / np.float32(127.0))
        inv = np.float32(np.float32(1.0) / s) if s > 0 else np.float32(0.0)
        acc = 0
        for k in range(d):
            q = min(max(np.rint(np.float32(buf[k] * inv)), np.float32(-127.0)), np.float32(127.0))
            qi = np.int32(q)
            qrow[k] = np.int8(qi)
            acc += qi
        row = row0 + r
        b = row >> 4
        rr = row & 15
        for j in range(d_pad >> 2):
            data32[b, j, rr] = q32[j]
        scale[row] = s
        wsum[row] = acc
    return bad


@njit(nogil=True, cache=True, inline="always")
def _amax_bits32(bits, k0):
    """max |x| bits over the 32 values bits[k0:k0+32] (a literal trip count LLVM unrolls)."""
    m = np.uint32(0)
    for i in range(32):
        v = bits[k0 + i] & np.uint32(0x7FFFFFFF)
        m = v if v > m else m
    return m


@njit(nogil=True, cache=True, inline="always")
def _quant_nib32(buf, k0, inv, nib):
    for i in range(32):
        q = min(max(np.rint(np.float32(buf[k0 + i] * inv)), np.float32(-7.0)), np.float32(7.0))
        nib[k0 + i] = np.uint8(np.int32(q) + 8)


@njit(nogil=True, cache=True)
def quant_pack_int4(src, row0, group_size, data32, scale):
    """src [N, D] -> data uint8 [NB, d_pad/8, 16, 4] (nibble = q + 8; seen as data32 uint32
    [NB, d_pad/8, 16]), scale fp32 [NB, d_pad/G, 16]. G is a multiple of 32: the inner loops
    run over chunks of 32 with a literal trip count (2x faster than loops of G)."""
    n, d = src.shape
    d_pad = data32.shape[1] * 8
    ng_pad = scale.shape[1]
    ng = (d + group_size - 1) // group_size
    nc = group_size // 32
    buf = np.zeros(d_pad, np.float32)  # padding stays 0 -> q = 0 -> nibble 8
    bits = buf.view(np.uint32)
    nib = np.full(d_pad, 8, np.uint8)
    n32 = nib.view(np.uint32)
    cmax = np.zeros(d_pad // 32, np.uint32)
    invs = np.zeros(ng_pad, np.float32)
    s0 = np.zeros(ng_pad, np.float32)
    bad = 0
    for r in range(n):
        _load_row(src, r, buf, bits)
        row = row0 + r
        b = row >> 4
        rr = row & 15
        for c in range(d_pad // 32):
            cmax[c] = _amax_bits32(bits, c * 32)
        smax = np.float32(0.0)
        for g in range(ng_pad):
            s = np.float32(0.0)
            if g < ng:
                m = cmax[g * nc]
                for c in range(g * nc + 1, (g + 1) * nc):
                    m = max(m, cmax[c])
                if m >= np.uint32(0x7F800000):
                    bad += 1
                s = np.float32(np.uint32(m).view(np.float32) / np.float32(7.0))
            s0[g] = s
            smax = s if s > smax else smax
        # reference.int4_ratio_scales: s_row * r_g, r_g = rint(s0 / s_row) in [1, 18]
        srow = np.uint32(np.float32(smax / np.float32(_RATIO_MAX)).view(np.uint32)
                         & np.uint32(0xFFFFFFE0)).view(np.float32)
        for g in range(ng_pad):
            s = s0[g]
            if srow > 0 and s > 0:
                rg = min(max(np.rint(np.float32(s / srow)), np.float32(1.0)), np.float32(_RATIO_MAX))
                s = np.float32(srow * rg)
            scale[b, g, rr] = s
            invs[g] = np.float32(np.float32(1.0) / s) if s > 0 else np.float32(0.0)
        for c in range(d_pad // 32):
            _quant_nib32(buf, c * 32, invs[c // nc], nib)
        for jj in range(d_pad >> 3):
            data32[b, jj, rr] = n32[2 * jj] | (n32[2 * jj + 1] << np.uint32(4))
    return bad


def _bf16_row(src, r, buf, bits, h):  # pragma: no cover - replaced by the overload below
    raise NotImplementedError


@overload(_bf16_row, jit_options={"nogil": True})
def _bf16_row_impl(src, r, buf, bits, h):
    """Row r of src as bf16 bits into h[:D]; returns 1 if it holds NaN/Inf. A bf16 source is
    copied as is (rounding a bf16 value to bf16 is the identity)."""
    if isinstance(src.dtype, types.Integer) and src.dtype.bitwidth == 16:
        def impl(src, r, buf, bits, h):
            m = np.uint16(0)
            for k in range(src.shape[1]):
                v = np.uint16(src[r, k])
                h[k] = v
                e = v & np.uint16(0x7F80)
                m = e if e > m else m
            return 1 if m == np.uint16(0x7F80) else 0
        return impl

    def impl(src, r, buf, bits, h):
        _load_row(src, r, buf, bits)
        if _amax_bits(bits, 0, src.shape[1]) >= np.uint32(0x7F800000):
            return 1
        for k in range(src.shape[1]):
            u = bits[k]
            h[k] = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))
                             >> np.uint32(16))
        return 0
    return impl


@njit(nogil=True, cache=True)
def quant_pack_bf16(src, row0, data32):
    """src [N, D] -> data uint16 [NB, d_pad/2, 16, 2] (bf16 bits, round to nearest even; seen as
    data32 uint32 [NB, d_pad/2, 16])."""
    n, d = src.shape
    d_pad = data32.shape[1] * 2
    buf = np.zeros(d_pad, np.float32)
    bits = buf.view(np.uint32)
    h = np.zeros(d_pad, np.uint16)
    h32 = h.view(np.uint32)
    bad = 0
    for r in range(n):
        if _bf16_row(src, r, buf, bits, h):
            bad += 1
            continue
        row = row0 + r
        b = row >> 4
        rr = row & 15
        for j in range(d_pad >> 1):
            data32[b, j, rr] = h32[j]
    return bad


@njit(nogil=True, cache=True)
def fp8_e4m3_block_dequant(w, scale_inv, block_n, block_d, out):
    """out [N, D] fp32 = e4m3(w [N, D] uint8) * scale_inv [ceil(N/bn), ceil(D/bd)] (block scales)."""
    n, d = w.shape
    lut = np.empty(256, np.float32)
    for v in range(256):
        e = (v >> 3) & 15
        m = v & 7
        if e == 15 and m == 7:
            x = np.nan
        elif e == 0:
            x = m / 8.0 * 2.0 ** -6
        else:
            x = (1.0 + m / 8.0) * 2.0 ** (e - 7)
        lut[v] = np.float32(-x if v & 128 else x)
    for i in range(n):
        for k in range(d):
            out[i, k] = lut[w[i, k]] * np.float32(scale_inv[i // block_n, k // block_d])
