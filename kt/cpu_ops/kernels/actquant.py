"""Activation preparation for the GEMM kernels (plain Numba, any x86-64): int8 per token and bf16.

Both write into caller-owned buffers padded to the packed depth d_pad, zeros beyond D, so a kernel
can run over whole 64-byte lines. Results are bit-identical to ``kt.reference.quantize_act`` and
``kt.reference.f32_to_bf16_bits``.
"""
from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from .. import cache

cache.install()


@intrinsic
def _u32_as_f32(typingctx, v):
    """The low 32 bits of an integer, reinterpreted as fp32."""
    if not isinstance(v, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        from llvmlite import ir

        a = args[0]
        if a.type.width > 32:
            a = builder.trunc(a, ir.IntType(32))
        elif a.type.width < 32:
            a = builder.zext(a, ir.IntType(32))
        return builder.bitcast(a, context.get_value_type(types.float32))

    return types.float32(v), codegen


@intrinsic
def _f32_as_u32(typingctx, v):
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))

    return types.uint32(v), codegen


@njit(nogil=True, cache=True, inline="always")
def absmax_bits(v, mb):
    """max(mb, |v|'s fp32 bit pattern) (uint32): the running absolute maximum of ``quant_row_i8``,
    as an integer max (it vectorises; an fp32 max with NaN semantics does not: 7x slower). Every
    NaN pattern is above +inf's."""
    b = _f32_as_u32(v) & np.uint32(0x7FFFFFFF)
    return b if b > mb else mb


@njit(nogil=True, cache=True)
def quant_row_i8(src, dst, n):
    """Per-row symmetric int8 of src[:n] (fp32) into dst (int8, zero beyond n); returns the scale.

    Exactly reference.quantize_act: xs = amax / 127, q = clip(rint(x * (127 / amax))); a NaN in
    the row makes the scale NaN (so the row's outputs are NaN), an all-zero row has scale 0.
    Branch-free loops, so that LLVM vectorises them.
    """
    mb = np.uint32(0)
    for j in range(n):
        mb = absmax_bits(src[j], mb)
    return quant_row_i8_max(src, dst, n, mb)


@njit(nogil=True, cache=True)
def quant_row_i8_max(src, dst, n, mb):
    """``quant_row_i8`` with the row's absolute maximum already taken (mb: ``absmax_bits`` over
    src[:n]), for a caller whose own loop over the row found it."""
    amax = _u32_as_f32(mb)
    if mb > np.uint32(0x7F800000):
        amax = np.float32(np.nan)
    inv = np.float32(127.0) / amax if amax > np.float32(0.0) else np.float32(0.0)
    for j in range(n):
        q = np.rint(src[j] * inv)
        q = q if q == q else np.float32(0.0)  # NaN (a NaN or Inf times inv = 0) -> 0 first
        q = q if q < np.float32(127.0) else np.float32(127.0)
        q = q if q > np.float32(-127.0) else np.float32(-127.0)
        dst[j] = np.int8(q)
    for j in range(n, dst.shape[0]):
        dst[j] = 0
    return amax / np.float32(127.0)


@njit(nogil=True, cache=True)
def quantize_rows(x, xq, xs):
    """x fp32 [M, D] -> xq int8 [M, d_pad] (zero beyond D), xs fp32 [M] (per-token scale).

    Exactly reference.quantize_act, row by row through ``quant_row_i8``.
    """
    for m in range(x.shape[0]):
        xs[m] = quant_row_i8(x[m], xq[m], x.shape[1])


@njit(nogil=True, cache=True, inline="always")
def bf16_bits_to_f32(b):
    return _u32_as_f32(np.uint32(b) << np.uint32(16))


@njit(nogil=True, cache=True, inline="always")
def f32_to_bf16_bits(v):
    """Round to nearest even, NaN -> 0x7FC0 (exactly reference.f32_to_bf16_bits)."""
    u = _f32_as_u32(v)
    b = np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    return b if v == v else np.uint16(0x7FC0)


@njit(nogil=True, cache=True)
def bf16_row(src, dst, n):
    """src[:n] (fp32) -> dst bf16 bits (uint16, zero beyond n); returns 1.0 (the scale slot of
    the integer rows' quantiser, so the MoE driver treats both alike)."""
    for j in range(n):
        dst[j] = f32_to_bf16_bits(src[j])
    for j in range(n, dst.shape[0]):
        dst[j] = 0
    return np.float32(1.0)


@njit(nogil=True, cache=True)
def bf16_rows(x, xb):
    """x fp32 [M, D] -> xb uint16 [M, d_pad] bf16 bits (round to nearest even, NaN -> 0x7FC0),
    row by row through ``bf16_row``."""
    for m in range(x.shape[0]):
        bf16_row(x[m], xb[m], x.shape[1])


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
