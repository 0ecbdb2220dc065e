"""SIMD vector values in Numba (AVX2 / AVX-512): vector types and @intrinsic helpers.

LLVM never turns kt's plain loops into ``vpdpbusd`` / ``vdpbf16ps`` (and Numba widens int32 products
to int64), so kernels hold vectors in ordinary variables of the types below and call these helpers,
each of which emits one LLVM vector operation or one x86 intrinsic. 512-bit types (``I8x64``, ...)
are for the AVX-512 kernels, 256-bit ones (``I8x32``, ...) for the AVX2 kernels; a kernel only calls
what its variant allows (README.md).

Memory helpers take ``(array, index)``: ``index`` counts elements of the array's own dtype from the
array's data pointer, i.e. a flat index into a C-contiguous array (for a row-strided 2-D array use
``row * (strides[0] // itemsize) + col``). Loads and stores are unaligned (``align 1``): on the
CPUs kt targets an unaligned access to an aligned address costs nothing. NumPy and Numba do *not*
align arrays to 64 bytes (here they start 32 bytes past a line), and a 64-byte access that straddles
two lines costs two; so packed weights and workspaces come from ``_align`` and jitted scratch from
``empty_line``.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, models, overload, register_model

from .._align import LINE

__all__ = [
    "Vec", "I8x64", "I16x32", "I32x16", "F32x16", "I8x32", "I16x16", "I32x8", "F32x8",
    # memory
    "load_i8x64", "load_i16x32", "load_i32x16", "load_f32x16",
    "load_i8x32", "load_i16x16", "load_i32x8", "load_f32x8",
    "bcast4_i32x16", "bcast4_i32x8", "load_i8_i32x16", "store", "prefetch", "prefetch_l2", "pf_next",
    "empty_line", "line_elems",
    # constants / broadcast of scalars
    "splat_i32x16", "splat_f32x16", "splat_i32x8", "splat_f32x8", "splat_i16x16", "splat_i8x32",
    # bit casts
    "as_i8x64", "as_i16x32", "as_i32x16", "as_f32x16", "as_i8x32", "as_i16x16", "as_i32x8",
    "as_f32x8",
    # element-wise
    "vadd", "vsub", "vmul", "vand", "vor", "vxor", "vsrl", "vsll", "vsra", "vfma", "cvt_i32_f32",
    "vabs_i8", "vsign_i8",
    # dot products
    "vpdpbusd512", "dpbf16ps512", "pmaddubsw256", "pmaddwd256",
]



_LLVM_ELEM = {"i8": ir.IntType(8), "i16": ir.IntType(16), "i32": ir.IntType(32),
              "f32": ir.FloatType()}


class Vec(types.Type):
    """An LLVM vector of ``lanes`` elements of ``kind`` ('i8', 'i16', 'i32', 'f32')."""

    def __init__(self, kind: str, lanes: int):
        self.kind = kind
        self.lanes = lanes
        super().__init__(name=f"Vec_{kind}x{lanes}")

    @property
    def bits(self) -> int:
        return self.lanes * int(self.kind[1:])

    @property
    def is_float(self) -> bool:
        return self.kind == "f32"


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, ir.VectorType(_LLVM_ELEM[fe_type.kind], fe_type.lanes))


I8x64, I16x32, I32x16, F32x16 = Vec("i8", 64), Vec("i16", 32), Vec("i32", 16), Vec("f32", 16)
I8x32, I16x16, I32x8, F32x8 = Vec("i8", 32), Vec("i16", 16), Vec("i32", 8), Vec("f32", 8)

_I64 = ir.IntType(64)


def _ll(vt: Vec) -> ir.VectorType:
    return ir.VectorType(_LLVM_ELEM[vt.kind], vt.lanes)


def _elem_addr(context, builder, arrty, arr, idxty, idx, pointee=ir.IntType(8)):
    """Address of element ``idx`` (flat, in the array's dtype) as a ``pointee*``."""
    ary = context.make_array(arrty)(context, builder, value=arr)
    base = builder.ptrtoint(ary.data, _I64)
    i = context.cast(builder, idx, idxty, types.int64)
    off = builder.mul(i, ir.Constant(_I64, context.get_abi_sizeof(
        context.get_data_type(arrty.dtype))))
    return builder.inttoptr(builder.add(base, off), ir.PointerType(pointee))


def _is_index(t) -> bool:
    return isinstance(t, types.Integer)


# ----------------------------------------------------------------------------- memory

def _make_load_as(vt: Vec, elem, finish):
    """An intrinsic (arr, idx) -> vt: load one ``elem`` (an LLVM type) at element ``idx`` of arr
    and turn it into a vt value with ``finish(builder, value)``."""
    @intrinsic
    def load_as(typingctx, arr, idx):
        if not isinstance(arr, types.Array) or not _is_index(idx):
            return None

        def codegen(context, builder, sig, args):
            p = _elem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1], elem)
            return finish(builder, builder.load(p, align=1))
        return vt(arr, idx), codegen
    return load_as


def _make_load(vt: Vec):
    """An intrinsic (arr, idx) -> vt: the vector at element ``idx`` of arr (unaligned)."""
    return _make_load_as(vt, _ll(vt), lambda builder, v: v)


load_i8x64, load_i16x32 = _make_load(I8x64), _make_load(I16x32)
load_i32x16, load_f32x16 = _make_load(I32x16), _make_load(F32x16)
load_i8x32, load_i16x16 = _make_load(I8x32), _make_load(I16x16)
load_i32x8, load_f32x8 = _make_load(I32x8), _make_load(F32x8)


def _make_bcast4(vt: Vec):
    """Load the 4 bytes at element ``idx`` as one int32 and broadcast it to every int32 lane."""
    return _make_load_as(vt, ir.IntType(32), lambda builder, s: _splat(builder, s, _ll(vt)))


bcast4_i32x16, bcast4_i32x8 = _make_bcast4(I32x16), _make_bcast4(I32x8)

# the 16 bytes at element ``idx``, each sign-extended to an int32 lane (vpmovsxbd)
load_i8_i32x16 = _make_load_as(I32x16, ir.VectorType(ir.IntType(8), 16),
                               lambda builder, v: builder.sext(v, _ll(I32x16)))


@intrinsic
def store(typingctx, arr, idx, v):
    """arr[idx : idx + lanes] = v (flat element index, arr's dtype must match v's element size)."""
    if not isinstance(arr, types.Array) or not _is_index(idx) or not isinstance(v, Vec):
        return None

    def codegen(context, builder, sig, args):
        p = _elem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                       args[2].type)
        builder.store(args[2], p, align=1)
        return context.get_dummy_value()
    return types.void(arr, idx, v), codegen


def _make_prefetch(name: str, locality: int, doc: str):
    def typer(typingctx, arr, idx):
        if not isinstance(arr, types.Array) or not _is_index(idx):
            return None

        def codegen(context, builder, sig, args):
            p = _elem_addr(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [p.type, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, locality),
                              ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return types.void(arr, idx), codegen
    typer.__name__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


prefetch = _make_prefetch(
    "prefetch", 3, "Hint the line holding element ``idx`` into all cache levels (prefetcht0).")
prefetch_l2 = _make_prefetch(
    "prefetch_l2", 2, "Hint the line holding element ``idx`` into L2 and below (prefetcht1).")


# ----------------------------------------------------------------------------- splat / casts

def _splat(builder, scalar, llty: ir.VectorType):
    undef = ir.Constant(llty, ir.Undefined)
    v = builder.insert_element(undef, scalar, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), llty.count), [0] * llty.count)
    return builder.shuffle_vector(v, undef, mask)


def _make_splat(vt: Vec):
    @intrinsic
    def splat(typingctx, x):
        if not isinstance(x, (types.Integer, types.Float)):
            return None
        target = types.float32 if vt.is_float else types.int64

        def codegen(context, builder, sig, args):
            s = context.cast(builder, args[0], sig.args[0], target)
            if not vt.is_float:
                s = builder.trunc(s, _LLVM_ELEM[vt.kind])
            return _splat(builder, s, _ll(vt))
        return vt(x), codegen
    return splat


splat_i32x16, splat_f32x16 = _make_splat(I32x16), _make_splat(F32x16)
splat_i32x8, splat_f32x8 = _make_splat(I32x8), _make_splat(F32x8)
splat_i16x16, splat_i8x32 = _make_splat(I16x16), _make_splat(I8x32)


def _make_cast(vt: Vec):
    @intrinsic
    def cast(typingctx, v):
        if not isinstance(v, Vec) or v.bits != vt.bits:
            return None

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], _ll(vt))
        return vt(v), codegen
    return cast


as_i8x64, as_i16x32, as_i32x16, as_f32x16 = (_make_cast(I8x64), _make_cast(I16x32),
                                             _make_cast(I32x16), _make_cast(F32x16))
as_i8x32, as_i16x16, as_i32x8, as_f32x8 = (_make_cast(I8x32), _make_cast(I16x16),
                                           _make_cast(I32x8), _make_cast(F32x8))


# ----------------------------------------------------------------------------- element-wise

def _make_binop(int_op: str | None, float_op: str | None):
    @intrinsic
    def binop(typingctx, a, b):
        if not isinstance(a, Vec) or a != b:
            return None
        op = float_op if a.is_float else int_op
        if op is None:
            return None

        def codegen(context, builder, sig, args):
            return getattr(builder, op)(args[0], args[1])
        return a(a, b), codegen
    return binop


vadd = _make_binop("add", "fadd")
vsub = _make_binop("sub", "fsub")
vmul = _make_binop("mul", "fmul")
vand = _make_binop("and_", None)
vor = _make_binop("or_", None)
vxor = _make_binop("xor", None)


def _make_shift(op: str):
    @intrinsic
    def shift(typingctx, a, n):
        if not isinstance(a, Vec) or a.is_float or not isinstance(n, types.Integer):
            return None

        def codegen(context, builder, sig, args):
            s = context.cast(builder, args[1], sig.args[1], types.int64)
            s = builder.trunc(s, _LLVM_ELEM[a.kind])
            return getattr(builder, op)(args[0], _splat(builder, s, _ll(a)))
        return a(a, n), codegen
    return shift


vsrl = _make_shift("lshr")
vsll = _make_shift("shl")
vsra = _make_shift("ashr")


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    fn = cgutils.get_or_insert_function(builder.module, fnty, name)
    return builder.call(fn, args)


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c, fused (float vectors)."""
    if not isinstance(a, Vec) or not a.is_float or not (a == b == c):
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, f"llvm.fma.v{a.lanes}f32", _ll(a), list(args))
    return a(a, b, c), codegen


@intrinsic
def cvt_i32_f32(typingctx, a):
    """int32 lanes -> fp32 (round to nearest)."""
    if not isinstance(a, Vec) or a.kind != "i32":
        return None
    out = Vec("f32", a.lanes)

    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], _ll(out))
    return out(a), codegen


@intrinsic
def vabs_i8(typingctx, a):
    """|a| per int8 lane (vpabsb); -128 stays 0x80, read it as unsigned 128."""
    if not isinstance(a, Vec) or a.kind != "i8":
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, f"llvm.abs.v{a.lanes}i8", _ll(a),
                     [args[0], ir.Constant(ir.IntType(1), 0)])
    return a(a), codegen


@intrinsic
def vsign_i8(typingctx, a, b):
    """AVX2 vpsignb: a negated where b < 0, zero where b == 0, a where b > 0 (256-bit only)."""
    if not isinstance(a, Vec) or a != I8x32 or b != I8x32:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.x86.avx2.psign.b", _ll(I8x32), list(args))
    return I8x32(a, b), codegen


# ----------------------------------------------------------------------------- dot products

@intrinsic
def vpdpbusd512(typingctx, acc, a, b):
    """AVX-512 VNNI: acc[i] += sum_{j<4} u8(a[4i+j]) * s8(b[4i+j]) (no saturation)."""
    if acc != I32x16 or not isinstance(a, Vec) or a.bits != 512 or not isinstance(b, Vec) \
            or b.bits != 512:
        return None

    def codegen(context, builder, sig, args):
        x = builder.bitcast(args[1], _ll(I32x16))
        y = builder.bitcast(args[2], _ll(I32x16))
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", _ll(I32x16), [args[0], x, y])
    return I32x16(acc, a, b), codegen


@intrinsic
def dpbf16ps512(typingctx, acc, a, b):
    """AVX-512 BF16: acc[i] += a[2i]*b[2i] + a[2i+1]*b[2i+1] on bf16 pairs (fp32 accumulate)."""
    if acc != F32x16 or not isinstance(a, Vec) or a.bits != 512 or not isinstance(b, Vec) \
            or b.bits != 512:
        return None

    def codegen(context, builder, sig, args):
        x = builder.bitcast(args[1], _ll(I16x32))
        y = builder.bitcast(args[2], _ll(I16x32))
        return _call(builder, "llvm.x86.avx512bf16.dpbf16ps.512", _ll(F32x16), [args[0], x, y])
    return F32x16(acc, a, b), codegen


@intrinsic
def pmaddubsw256(typingctx, a, b):
    """AVX2 vpmaddubsw: int16 lane i = sat16(u8(a[2i])*s8(b[2i]) + u8(a[2i+1])*s8(b[2i+1]))."""
    if not isinstance(a, Vec) or a.bits != 256 or not isinstance(b, Vec) or b.bits != 256:
        return None

    def codegen(context, builder, sig, args):
        x = builder.bitcast(args[0], _ll(I8x32))
        y = builder.bitcast(args[1], _ll(I8x32))
        return _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _ll(I16x16), [x, y])
    return I16x16(a, b), codegen


@intrinsic
def pmaddwd256(typingctx, a, b):
    """AVX2 vpmaddwd: int32 lane i = a[2i]*b[2i] + a[2i+1]*b[2i+1] (int16 inputs)."""
    if a != I16x16 or b != I16x16:
        return None

    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.x86.avx2.pmadd.wd", _ll(I32x8), list(args))
    return I32x8(a, b), codegen


# ----------------------------------------------------------------------------- kernel helpers

@njit(nogil=True, inline="always")
def pf_next(data, base, j, ppl, end, le):
    """Prefetch into L2 the part of the next weight group that this m tile brings in: ppl lines
    (of le elements) per k step from ``base``, skipping what lies at or past ``end``.

    The gemm kernels sweep a group of 1-4 blocks once per token tile; only the first tile finds
    its lines in memory, the others in L2. Tile t of a group fetches the next group's lines
    [t * ppl * lines, (t + 1) * ppl * lines), so the next group is in L2 when its first tile starts
    (ppl = ceil(blocks per group / tiles), 1 from four tiles on)."""
    for q in range(ppl):
        a = base + (j * ppl + q) * le
        if a < end:
            prefetch_l2(data, a)


@njit(nogil=True, cache=True, inline="always")
def empty_line(n, dtype):
    """A 1-D np.empty(n, dtype) starting at a 64-byte boundary (reshape it as needed)."""
    buf = np.empty(n + LINE, dtype)
    o = (-buf.ctypes.data % LINE) // buf.itemsize
    return buf[o:o + n]


def line_elems(a):
    """64 // a.itemsize: an array's elements per 64-byte line; in compiled code a constant of the
    array's type (``_line_elems``). Numba reads ``a.itemsize`` from the array at run time, so
    offsets made from it cost multiplies and registers inside a kernel's loop (the staged AMX
    loop kept its state on the stack)."""
    return 64 // a.itemsize


@overload(line_elems)
def _line_elems(a):
    if not isinstance(a, types.Array) or not hasattr(a.dtype, "bitwidth"):
        return None
    n = 512 // a.dtype.bitwidth
    return lambda a: n
