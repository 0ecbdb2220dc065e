"""AMX (tile) instructions in Numba: one @intrinsic per instruction, plus the permission guard.

The intrinsics address the eight *physical* tile registers, so a tile number must be a literal in
the kernel source (``tdpbssd(0, 4, 6)``); a non-literal is a typing error. The tile shapes come from
a 64-byte palette-1 configuration loaded with ``ldtilecfg`` (``set_tilecfg`` fills one), once per
kernel call (and again only when the shapes change, e.g. for a tail of rows); ``tilerelease`` at
exit returns the tile state to INIT so context switches stay cheap.

Memory operands take ``(array, index)``: ``index`` counts elements of the array's own dtype from the
array's data pointer (a flat index into a C-contiguous array); ``stride`` is in **bytes**, as the
instruction wants. The address is a GEP from the array's data pointer, so LLVM keeps track of what
the tile instruction may read or write.

Executing any of these without the Linux tile-data permission kills the process with SIGILL, and
compiling them for a target without AMX aborts it inside LLVM. ``require_amx`` is the one guard:
every AMX kernel file calls it at import (through ``_tiles``), so no AMX kernel can be compiled or run in a process where
``kt.cpu_ops.isa`` has not found AMX runnable (``isa.detect`` makes the ``arch_prctl`` request).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic, register_jitable

__all__ = [
    "require_amx", "allow_compile_only", "set_tilecfg", "ldtilecfg", "tilerelease", "sfence", "tilezero",
    "tileloadd64", "tileloaddt164", "tilestored64", "tdpbssd", "tdpbsud",
    "tdpbf16ps",
    "row16_scale_store", "row16_scale_stream", "row16_scale_bits", "row16_fma", "row16_mul_store", "row16_max", "ratio_row16", "copy64", "copy64_stream",
    "unpack_int4_line", "unpack_int4_line_mul", "unpack_int4_group_mul", "prefetch_l1", "prefetch_l2",
    "prefetch_w",
]

_I8 = ir.IntType(8)
_I64 = ir.IntType(64)
_PTR = ir.IntType(8).as_pointer()
_VOID = ir.VoidType()

_compile_only = False


def allow_compile_only() -> None:
    """Let the AMX kernel files be imported where AMX cannot run, to inspect its assembly only.

    For tests that compile for an explicit AMX target (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``
    with ``+amx-tile,+amx-int8,+amx-bf16``) in a subprocess; calling a kernel there would SIGILL.
    """
    global _compile_only
    _compile_only = True


def _numba_target_has_amx() -> bool:
    from numba.core import config

    feats = (config.CPU_FEATURES or "").split(",")
    return all(f"+{f}" in feats for f in ("amx-tile", "amx-int8", "amx-bf16"))


def require_amx() -> str:
    """Raise ``isa.UnsupportedVariantError`` unless this process may use AMX kernels.

    Returns ``"run"`` where ``isa`` found AMX runnable (hardware + arch_prctl permission granted),
    or ``"compile-only"`` after ``allow_compile_only()`` when Numba's target was set explicitly to
    one with AMX (assembly inspection on a host without AMX).
    """
    from ... import isa

    host = isa.detect().host
    if host.can_run("amx"):
        return "run"
    if _compile_only and _numba_target_has_amx():
        return "compile-only"
    why = (f"the CPU lacks {host.missing('amx')}" if host.missing("amx")
           else f"Linux refused the AMX tile permission ({host.amx_error})")
    raise isa.UnsupportedVariantError(
        f"AMX kernels cannot run in this process: {why} "
        f"(CPU {host.model_name or host.cpu_name}); use a lower variant from kt.cpu_ops.registry")


# ----------------------------------------------------------------------------- helpers

def _tile(t, what: str) -> int:
    if not isinstance(t, types.IntegerLiteral):
        raise TypingError(f"AMX {what}: tile numbers must be integer literals, got {t}")
    v = t.literal_value
    if not 0 <= v <= 7:
        raise TypingError(f"AMX {what}: tile number must be in 0..7, got {v}")
    return v


def _address(context, builder, aryty, ary, index):
    """i8* to element ``index`` of array ``ary``."""
    a = context.make_array(aryty)(context, builder, ary)
    p = builder.gep(a.data, [index])
    return builder.bitcast(p, _PTR)


def _call(builder, name: str, argtys, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VOID, argtys), name)
    builder.call(fn, args)


def _check_mem(ary, index, what: str):
    if not isinstance(ary, types.Array):
        raise TypingError(f"AMX {what}: expected an array, got {ary}")
    if not isinstance(index, types.Integer):
        raise TypingError(f"AMX {what}: element index must be an integer, got {index}")


# ----------------------------------------------------------------------------- configuration

@register_jitable
def set_tilecfg(cfg, tile, rows, colsb):
    """Write one tile's shape into a 64-byte palette-1 config (uint8 [64]).

    Byte 0 palette (1), byte 1 start_row (0), bytes 16+2t colsb of tile t (uint16 LE), byte 48+t
    rows of tile t. Unused tiles stay 0 (unconfigured).
    """
    cfg[0] = 1
    cfg[1] = 0
    cfg[16 + 2 * tile] = colsb & 0xFF
    cfg[17 + 2 * tile] = (colsb >> 8) & 0xFF
    cfg[48 + tile] = rows


@intrinsic
def ldtilecfg(typingctx, cfg):
    """Load the tile configuration from ``cfg`` (uint8 [64], palette 1)."""
    _check_mem(cfg, types.intp, "ldtilecfg")

    def codegen(context, builder, sig, args):
        p = _address(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))
        _call(builder, "llvm.x86.ldtilecfg", [_PTR], [p])
        return context.get_dummy_value()

    return types.none(cfg), codegen


@intrinsic
def sfence(typingctx):
    """Order the non-temporal stores before it ahead of every later store (``row16_scale_stream``'s
    callers fence before they return, so the threads that read their output see it)."""

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.sse.sfence", [], [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def tilerelease(typingctx):
    """Return the tile state to INIT (all tiles unconfigured)."""

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease", [], [])
        return context.get_dummy_value()

    return types.none(), codegen


# ----------------------------------------------------------------------------- tiles

@intrinsic(prefer_literal=True)
def tilezero(typingctx, tile):
    t = _tile(tile, "tilezero")

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilezero", [_I8], [ir.Constant(_I8, t)])
        return context.get_dummy_value()

    return types.none(tile), codegen


def _tile_load(name: str):
    """A tile-load intrinsic: ``name(tile, ary, index, stride)`` loads tile ``tile`` from ``ary``
    at element ``index``, rows ``stride`` bytes apart (``llvm.x86.<name>``)."""

    def typer(typingctx, tile, ary, index, stride):
        t = _tile(tile, name)
        _check_mem(ary, index, name)

        def codegen(context, builder, sig, args):
            idx = context.cast(builder, args[2], sig.args[2], types.int64)
            st = context.cast(builder, args[3], sig.args[3], types.int64)
            p = _address(context, builder, sig.args[1], args[1], idx)
            _call(builder, f"llvm.x86.{name}", [_I8, _PTR, _I64], [ir.Constant(_I8, t), p, st])
            return context.get_dummy_value()

        return types.none(tile, ary, index, stride), codegen

    typer.__name__ = name
    return intrinsic(prefer_literal=True)(typer)


# tileloadd64: a plain tile load. tileloaddt164: the same with the non-temporal hint (TILELOADDT1:
# the lines need not stay in L1), for an operand that streams past while the other is reused from
# L1 (the A tiles of the staged GEMM, so the block pair's B slice stays in L1)
tileloadd64 = _tile_load("tileloadd64")
tileloaddt164 = _tile_load("tileloaddt164")


@intrinsic(prefer_literal=True)
def tilestored64(typingctx, tile, ary, index, stride):
    """Store tile ``tile`` to ``ary`` at element ``index``; rows are ``stride`` bytes apart."""
    t = _tile(tile, "tilestored64")
    _check_mem(ary, index, "tilestored64")

    def codegen(context, builder, sig, args):
        idx = context.cast(builder, args[2], sig.args[2], types.int64)
        st = context.cast(builder, args[3], sig.args[3], types.int64)
        p = _address(context, builder, sig.args[1], args[1], idx)
        _call(builder, "llvm.x86.tilestored64", [_I8, _PTR, _I64], [ir.Constant(_I8, t), p, st])
        return context.get_dummy_value()

    return types.none(tile, ary, index, stride), codegen


def _dot_codegen(name: str, d: int, x: int, y: int):
    def codegen(context, builder, sig, args):
        _call(builder, f"llvm.x86.{name}", [_I8, _I8, _I8],
              [ir.Constant(_I8, d), ir.Constant(_I8, x), ir.Constant(_I8, y)])
        return context.get_dummy_value()

    return codegen


@intrinsic(prefer_literal=True)
def tdpbssd(typingctx, dst, a, b):
    """C[dst] (int32 [rows, 16]) += A[a] (int8) . B[b] (int8): 4-way dot products."""
    g = _dot_codegen("tdpbssd", _tile(dst, "tdpbssd"), _tile(a, "tdpbssd"), _tile(b, "tdpbssd"))
    return types.none(dst, a, b), g


@intrinsic(prefer_literal=True)
def tdpbsud(typingctx, dst, a, b):
    """C[dst] (int32 [rows, 16]) += A[a] (int8) . B[b] (uint8): 4-way dot products."""
    g = _dot_codegen("tdpbsud", _tile(dst, "tdpbsud"), _tile(a, "tdpbsud"), _tile(b, "tdpbsud"))
    return types.none(dst, a, b), g


@intrinsic(prefer_literal=True)
def tdpbf16ps(typingctx, dst, a, b):
    """C[dst] (fp32 [rows, 16]) += A[a] (bf16) . B[b] (bf16): pair dot products."""
    g = _dot_codegen("tdpbf16ps", _tile(dst, "tdpbf16ps"), _tile(a, "tdpbf16ps"),
                     _tile(b, "tdpbf16ps"))
    return types.none(dst, a, b), g


# ----------------------------------------------------------------------------- 64-byte row helpers
# The epilogues work on 16 fp32 / int32 values (one C tile row) or 64 bytes at a time. LLVM does
# not vectorise those short fixed-length Numba loops (it unrolls them to scalar code, as it cannot
# rule out aliasing), so these emit the <16 x ...> operations directly. AVX-512 is present on every
# AMX CPU. Operands are (array, element index) like the tile intrinsics; nothing is bounds-checked.

_F32X16 = ir.VectorType(ir.FloatType(), 16)
_I32X16 = ir.VectorType(ir.IntType(32), 16)
_I8X64 = ir.VectorType(_I8, 64)
_I8X16 = ir.VectorType(_I8, 16)


def _vptr(context, builder, sig, args, k, vecty):
    """Pointer to element args[k + 1] of array args[k], as a pointer to ``vecty``."""
    idx = context.cast(builder, args[k + 1], sig.args[k + 1], types.int64)
    return builder.bitcast(_address(context, builder, sig.args[k], args[k], idx), vecty.as_pointer())


def _splat(builder, value, vecty):
    v = builder.insert_element(ir.Constant(vecty, ir.Undefined), value, ir.Constant(ir.IntType(32), 0))
    mask = ir.Constant(ir.VectorType(ir.IntType(32), vecty.count), [0] * vecty.count)
    return builder.shuffle_vector(v, ir.Constant(vecty, ir.Undefined), mask)


def _dtype_is(ary, dtype, what):
    if not (isinstance(ary, types.Array) and ary.dtype == dtype):
        raise TypingError(f"{what}: expected a {dtype} array, got {ary}")


def _scaled16(context, builder, sig, args, cv, k):
    """(fp32(cv) * xm) * s for the int32 x16 vector cv, with s at args[k], args[k + 1] and xm at
    args[k + 2]: the one scaling order of the row16_scale_* intrinsics."""
    sv = builder.load(_vptr(context, builder, sig, args, k, _F32X16), align=4)
    x = context.cast(builder, args[k + 2], sig.args[k + 2], types.float32)
    return builder.fmul(builder.fmul(builder.sitofp(cv, _F32X16), _splat(builder, x, _F32X16)), sv)


def _store64(builder, v, ptr, stream: bool, align: int):
    """Store the 64-byte vector v at ptr: plainly (alignment ``align``), or where stream with
    a non-temporal store (ptr must then be on a 64-byte line)."""
    st = builder.store(v, ptr, align=64 if stream else align)
    if stream:
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))


def _row16_scale_store(name: str, stream: bool):
    """The typer of ``row16_scale_store`` (stream False) / ``row16_scale_stream`` (True)."""

    def typer(typingctx, out, oi, c, ci, s, si, xm):
        _dtype_is(out, types.float32, f"{name} out")
        _dtype_is(c, types.int32, f"{name} c")
        _dtype_is(s, types.float32, f"{name} s")

        def codegen(context, builder, sig, args):
            o = _vptr(context, builder, sig, args, 0, _F32X16)
            cv = builder.load(_vptr(context, builder, sig, args, 2, _I32X16), align=4)
            _store64(builder, _scaled16(context, builder, sig, args, cv, 4), o, stream, 4)
            return context.get_dummy_value()

        return types.none(out, oi, c, ci, s, si, xm), codegen

    typer.__name__ = name
    return typer


row16_scale_store = intrinsic(_row16_scale_store("row16_scale_store", False))
row16_scale_store.__doc__ = """out[oi : oi+16] = (fp32(c[ci : ci+16]) * xm) * s[si : si+16]   (c int32; out, s fp32)."""

row16_scale_stream = intrinsic(_row16_scale_store("row16_scale_stream", True))
row16_scale_stream.__doc__ = """``row16_scale_store`` with a non-temporal store (vmovntps: the line goes to memory
without being read first, and leaves the caches). out[oi:] must start on a 64-byte boundary (the
instruction faults otherwise): callers check the output's address and row stride."""


@intrinsic
def row16_scale_bits(typingctx, out, oi, s, si, xm):
    """In place: out[oi : oi+16] holds int32 sums (a tile stored into the fp32 array) and
    becomes (fp32(sums) * xm) * s[si : si+16], as ``row16_scale_store`` computes it."""
    _dtype_is(out, types.float32, "row16_scale_bits out")
    _dtype_is(s, types.float32, "row16_scale_bits s")

    def codegen(context, builder, sig, args):
        o = _vptr(context, builder, sig, args, 0, _F32X16)
        cv = builder.load(builder.bitcast(o, _I32X16.as_pointer()), align=4)
        builder.store(_scaled16(context, builder, sig, args, cv, 2), o, align=4)
        return context.get_dummy_value()

    return types.none(out, oi, s, si, xm), codegen


@intrinsic
def row16_fma(typingctx, acc, ai, c, ci, s, si):
    """acc[ai : ai+16] = fma(s[si : si+16], fp32(c[ci : ci+16]), acc[ai : ai+16])  (c int32)."""
    _dtype_is(acc, types.float32, "row16_fma acc")
    _dtype_is(c, types.int32, "row16_fma c")
    _dtype_is(s, types.float32, "row16_fma s")

    def codegen(context, builder, sig, args):
        a = _vptr(context, builder, sig, args, 0, _F32X16)
        av = builder.load(a, align=4)
        cv = builder.load(_vptr(context, builder, sig, args, 2, _I32X16), align=4)
        sv = builder.load(_vptr(context, builder, sig, args, 4, _F32X16), align=4)
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32X16, [_F32X16] * 3), "llvm.fma.v16f32")
        builder.store(builder.call(fma, [sv, builder.sitofp(cv, _F32X16), av]), a, align=4)
        return context.get_dummy_value()

    return types.none(acc, ai, c, ci, s, si), codegen


@intrinsic
def row16_mul_store(typingctx, out, oi, a, ai, xm):
    """out[oi : oi+16] = a[ai : ai+16] * xm   (fp32)."""
    _dtype_is(out, types.float32, "row16_mul_store out")
    _dtype_is(a, types.float32, "row16_mul_store a")

    def codegen(context, builder, sig, args):
        o = _vptr(context, builder, sig, args, 0, _F32X16)
        av = builder.load(_vptr(context, builder, sig, args, 2, _F32X16), align=4)
        x = context.cast(builder, args[4], sig.args[4], types.float32)
        builder.store(builder.fmul(av, _splat(builder, x, _F32X16)), o, align=4)
        return context.get_dummy_value()

    return types.none(out, oi, a, ai, xm), codegen


def _copy64(name: str, stream: bool):
    """The typer of ``copy64`` (stream False) / ``copy64_stream`` (True)."""

    def typer(typingctx, dst, di, src, si):
        _check_mem(dst, di, name)
        _check_mem(src, si, name)

        def codegen(context, builder, sig, args):
            v = builder.load(_vptr(context, builder, sig, args, 2, _I8X64), align=1)
            _store64(builder, v, _vptr(context, builder, sig, args, 0, _I8X64), stream, 1)
            return context.get_dummy_value()

        return types.none(dst, di, src, si), codegen

    typer.__name__ = name
    return typer


copy64 = intrinsic(_copy64("copy64", False))
copy64.__doc__ = """Copy 64 bytes from src (element si) to dst (element di); any dtypes."""

copy64_stream = intrinsic(_copy64("copy64_stream", True))
copy64_stream.__doc__ = """``copy64`` with a non-temporal store (the line goes to memory without being read
first). dst[di:] must start on a 64-byte boundary (the store faults otherwise): callers check."""


@intrinsic
def unpack_int4_line(typingctx, src, si, dst, di):
    """One packed INT4 line (64 bytes of nibbles q + 8) -> two signed int8 k4 rows:
    dst[di : di+64] = (src & 15) - 8 (low nibbles), dst[di+64 : di+128] = (src >> 4) - 8."""
    _dtype_is(src, types.uint8, "unpack_int4_line src")
    _dtype_is(dst, types.int8, "unpack_int4_line dst")

    def codegen(context, builder, sig, args):
        v = builder.load(_vptr(context, builder, sig, args, 0, _I8X64), align=1)
        k15 = ir.Constant(_I8X64, [15] * 64)
        k8 = ir.Constant(_I8X64, [8] * 64)
        k4 = ir.Constant(_I8X64, [4] * 64)
        lo = builder.sub(builder.and_(v, k15), k8)
        hi = builder.sub(builder.lshr(v, k4), k8)
        d0 = _vptr(context, builder, sig, args, 2, _I8X64)
        builder.store(lo, d0, align=1)
        builder.store(hi, builder.gep(d0, [ir.Constant(_I64, 1)]), align=1)
        return context.get_dummy_value()

    return types.none(src, si, dst, di), codegen


@intrinsic
def row16_max(typingctx, acc, ai, src, si):
    """acc[ai : ai+16] = max(acc[ai : ai+16], src[si : si+16])   (fp32, no NaNs expected)."""
    _dtype_is(acc, types.float32, "row16_max acc")
    _dtype_is(src, types.float32, "row16_max src")

    def codegen(context, builder, sig, args):
        a = _vptr(context, builder, sig, args, 0, _F32X16)
        av = builder.load(a, align=4)
        sv = builder.load(_vptr(context, builder, sig, args, 2, _F32X16), align=4)
        builder.store(builder.select(builder.fcmp_ordered(">", sv, av), sv, av), a, align=4)
        return context.get_dummy_value()

    return types.none(acc, ai, src, si), codegen


@intrinsic
def ratio_row16(typingctx, scale, si, inv, ii, sr, sri, rx, rxi, rmax):
    """The INT4 group ratios of 16 columns: r = rint(scale[si : si+16] * inv[ii : ii+16]); stores
    them as int8 at rx[rxi : rxi+16] (0 where a column fails) and returns whether every column's
    scale is exactly fp32(r) * sr[sri : sri+16] with 0 <= r <= rmax (``reference.int4_ratio_scales``;
    rmax must be at most 127)."""
    _dtype_is(scale, types.float32, "ratio_row16 scale")
    _dtype_is(inv, types.float32, "ratio_row16 inv")
    _dtype_is(sr, types.float32, "ratio_row16 sr")
    _dtype_is(rx, types.int8, "ratio_row16 rx")

    def codegen(context, builder, sig, args):
        sv = builder.load(_vptr(context, builder, sig, args, 0, _F32X16), align=4)
        iv = builder.load(_vptr(context, builder, sig, args, 2, _F32X16), align=4)
        srv = builder.load(_vptr(context, builder, sig, args, 4, _F32X16), align=4)
        rint = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_F32X16, [_F32X16]), "llvm.rint.v16f32")
        rf = builder.call(rint, [builder.fmul(sv, iv)])
        rm = context.cast(builder, args[8], sig.args[8], types.float32)
        # checked as floats (ordered compares: NaN fails) before any conversion to int, so an
        # Inf or NaN scale never reaches fptosi
        exact = builder.fcmp_ordered("==", builder.fmul(rf, srv), sv)
        lo = builder.fcmp_ordered(">=", rf, ir.Constant(_F32X16, [0.0] * 16))
        hi = builder.fcmp_ordered("<=", rf, _splat(builder, rm, _F32X16))
        ok = builder.and_(exact, builder.and_(lo, hi))
        ri = builder.fptosi(builder.select(ok, rf, ir.Constant(_F32X16, [0.0] * 16)), _I32X16)
        i1x16 = ir.VectorType(ir.IntType(1), 16)
        red = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.IntType(1), [i1x16]), "llvm.vector.reduce.and.v16i1")
        builder.store(builder.trunc(ri, _I8X16), _vptr(context, builder, sig, args, 6, _I8X16), align=1)
        return builder.call(red, [ok])

    return types.boolean(scale, si, inv, ii, sr, sri, rx, rxi, rmax), codegen


@intrinsic
def unpack_int4_line_mul(typingctx, src, si, dst, di, r, ri):
    """``unpack_int4_line`` with each signed value multiplied by its column's INT4 group ratio
    r_g, from r[ri : ri+16] (int8, one per column of the line's 16; a line holds 4 k of each
    column, so each ratio is spread over 4 byte positions in a register): the products must fit
    in int8 (|q| <= 7, r <= 18), they are formed in 8-bit lanes."""
    _dtype_is(src, types.uint8, "unpack_int4_line_mul src")
    _dtype_is(dst, types.int8, "unpack_int4_line_mul dst")
    _dtype_is(r, types.int8, "unpack_int4_line_mul r")

    def codegen(context, builder, sig, args):
        v = builder.load(_vptr(context, builder, sig, args, 0, _I8X64), align=1)
        r16 = builder.load(_vptr(context, builder, sig, args, 4, _I8X16), align=1)
        spread = ir.Constant(ir.VectorType(ir.IntType(32), 64), [i // 4 for i in range(64)])
        rv = builder.shuffle_vector(r16, ir.Constant(_I8X16, ir.Undefined), spread)
        k15 = ir.Constant(_I8X64, [15] * 64)
        k8 = ir.Constant(_I8X64, [8] * 64)
        k4 = ir.Constant(_I8X64, [4] * 64)
        lo = builder.mul(builder.sub(builder.and_(v, k15), k8), rv)
        hi = builder.mul(builder.sub(builder.lshr(v, k4), k8), rv)
        d0 = _vptr(context, builder, sig, args, 2, _I8X64)
        builder.store(lo, d0, align=1)
        builder.store(hi, builder.gep(d0, [ir.Constant(_I64, 1)]), align=1)
        return context.get_dummy_value()

    return types.none(src, si, dst, di, r, ri), codegen


_I16X32 = ir.VectorType(ir.IntType(16), 32)


@intrinsic(prefer_literal=True)
def unpack_int4_group_mul(typingctx, src, si, dst, di, r, ri, nlines):
    """``unpack_int4_line_mul`` of ``nlines`` consecutive packed lines (a literal, 1-16) that share
    one group's ratios r[ri : ri+16], at dst[di : di + 128 nlines]; the same bytes wherever both
    products of a 16-bit lane fit in int8 (every weight without q = -8, as the ratio kernels
    require: ``packing.int4_has_minus8``).

    The products are formed in 16-bit lanes, where AVX-512 has a one-instruction multiply (8-bit
    lanes have none: ``unpack_int4_line_mul`` pays a ``vpmullw``, a ``vpmaddubsw`` and a merge per
    64 bytes). A 16-bit lane holds two bytes of the same column (a line's 4 bytes per column), so
    one ratio multiplies both: with c = 15 - nibble, r c fills its byte without a carry into the
    next (r c <= 255 unless r = 18 and q = -8, a product outside int8 whose carry spoils the other
    byte too), and r q = 7 r - r c per byte. Per line: a shift, two ``vpandn``, two
    ``vpmullw`` and two ``vpsubb`` (the ratio vectors are made once for the lines): 1.6x faster
    than ``unpack_int4_line_mul`` on one dev core (1.76 vs 2.84 ns per line, L1-resident)."""
    _dtype_is(src, types.uint8, "unpack_int4_group_mul src")
    _dtype_is(dst, types.int8, "unpack_int4_group_mul dst")
    _dtype_is(r, types.int8, "unpack_int4_group_mul r")
    if not isinstance(nlines, types.IntegerLiteral) or not 1 <= nlines.literal_value <= 16:
        raise TypingError(f"unpack_int4_group_mul: nlines must be an integer literal in 1..16, got {nlines}")
    n = nlines.literal_value

    def codegen(context, builder, sig, args):
        r16 = builder.load(_vptr(context, builder, sig, args, 4, _I8X16), align=1)
        i32x64 = ir.VectorType(ir.IntType(32), 64)
        # column j >> 2 of byte j: its ratio zero-extended into each 16-bit lane, and 7 r in both
        # bytes of the lane (r * 0x0707: 7 r <= 126, no carry)
        rw = builder.bitcast(builder.shuffle_vector(
            r16, ir.Constant(_I8X16, [0] * 16),
            ir.Constant(i32x64, [j >> 2 if j % 2 == 0 else 16 for j in range(64)])), _I16X32)
        r7 = builder.bitcast(builder.mul(rw, ir.Constant(_I16X32, [0x0707] * 32)), _I8X64)
        low = ir.Constant(_I16X32, [0x0F0F] * 32)
        ones = ir.Constant(_I16X32, [-1] * 32)
        k4 = ir.Constant(_I16X32, [4] * 32)
        s0 = builder.bitcast(_vptr(context, builder, sig, args, 0, _I8X64), _I16X32.as_pointer())
        d0 = _vptr(context, builder, sig, args, 2, _I8X64)
        for line in range(n):
            w = builder.load(builder.gep(s0, [ir.Constant(_I64, line)]), align=1)
            for h, x in enumerate((w, builder.lshr(w, k4))):
                c = builder.and_(builder.xor(x, ones), low)  # 15 - nibble, per byte
                rc = builder.bitcast(builder.mul(c, rw), _I8X64)
                builder.store(builder.sub(r7, rc), builder.gep(d0, [ir.Constant(_I64, 2 * line + h)]),
                              align=1)
        return context.get_dummy_value()

    return types.none(src, si, dst, di, r, ri, nlines), codegen


def _prefetch(what: str, locality: int, rw: int = 0):
    """An intrinsic for a software prefetch (``llvm.prefetch``: a read (rw 0) or write (rw 1)
    hint of ``locality``)."""

    def typer(typingctx, ary, index):
        _check_mem(ary, index, what)

        def codegen(context, builder, sig, args):
            p = builder.bitcast(_vptr(context, builder, sig, args, 0, _I8X64), _PTR)
            i32 = ir.IntType(32)
            _call(builder, "llvm.prefetch.p0", [_PTR, i32, i32, i32],
                  [p, ir.Constant(i32, rw), ir.Constant(i32, locality), ir.Constant(i32, 1)])
            return context.get_dummy_value()

        return types.none(ary, index), codegen

    typer.__name__ = what
    return intrinsic(typer)


# prefetch_l1(ary, index) / prefetch_l2(ary, index): the cache line holding ary[index] into L1
# (prefetcht0) / L2 (prefetcht1); prefetch_w: into L1 with intent to write (prefetchw: the line's
# ownership is requested now, so a later store does not wait for it)
prefetch_l1 = _prefetch("prefetch_l1", 3)
prefetch_l2 = _prefetch("prefetch_l2", 2)
prefetch_w = _prefetch("prefetch_w", 3, rw=1)
