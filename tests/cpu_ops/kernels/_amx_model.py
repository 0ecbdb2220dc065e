"""A numpy model of the AMX tile unit, and the AMX kernel files loaded against it or for real.

``emulated_kernels`` runs the kernels' Python bodies (numba.njit patched out) with ``TileUnit``'s
methods in place of the intrinsics: shapes from the loaded config, every load/store
bounds-checked, products per the instruction definitions. That checks the kernels' indexing and
tails on hosts without AMX; the device runs the real thing (``amx_kernels``).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import numpy as np

from kt import reference as ref

AMX_SKIP = "host has no AMX (runs on the device machine: benchmarks/device_amx.py)"
AMX_FILES = ("_tiles", "int8", "int4", "bf16", "roofline")
# the names every AMX kernel file takes from kernels/amx/_intrinsics.py that the model replaces
INTRINSICS = ("ldtilecfg", "tilerelease", "tilezero", "tileloadd64", "tileloaddt164", "tilestored64",
              "tdpbssd", "tdpbf16ps", "row16_scale_store", "row16_scale_stream", "sfence",
              "row16_scale_bits", "row16_fma", "row16_mul_store", "copy64", "copy64_stream",
              "unpack_int4_line", "unpack_int4_line_mul", "unpack_int4_group_mul", "row16_max",
              "ratio_row16", "prefetch_l1", "prefetch_l2", "prefetch_w")


def _namespace(mods) -> types.SimpleNamespace:
    """Every name of the AMX kernel files in one namespace (the tests call kernels and helpers
    of all of them)."""
    ns = types.SimpleNamespace()
    for mod in mods:
        for k, v in vars(mod).items():
            if not k.startswith("__"):
                setattr(ns, k, v)
    return ns


def amx_runnable() -> bool:
    from kt.cpu_ops import isa

    return "amx" in isa.runnable_variants()


def amx_kernels() -> types.SimpleNamespace:
    """The real AMX kernel files (importing them raises where AMX cannot run)."""
    return _namespace([importlib.import_module(f"kt.cpu_ops.kernels.amx.{n}") for n in AMX_FILES])


class TileUnit:
    """A numpy model of the 8 AMX tile registers (palette 1)."""

    def __init__(self):
        self.rows = [0] * 8
        self.colsb = [0] * 8
        self.reg = np.zeros((8, 16, 64), np.uint8)
        self.configured = False
        self.prefetched_w = set()
        self.prefetched_l2 = []
        self.streamed = 0
        self.fences = 0

    def ldtilecfg(self, cfg):
        assert cfg.dtype == np.uint8 and cfg.size == 64 and cfg[0] == 1 and cfg[1] == 0
        assert not cfg[2:16].any(), "reserved config bytes must be zero"
        for t in range(8):
            self.colsb[t] = int(cfg[16 + 2 * t]) | (int(cfg[17 + 2 * t]) << 8)
            self.rows[t] = int(cfg[48 + t])
            assert self.rows[t] <= 16 and self.colsb[t] <= 64 and self.colsb[t] % 4 == 0
        self.reg[:] = 0
        self.configured = True

    def tilerelease(self):
        self.configured = False

    def _check(self, *tiles):
        assert self.configured, "tile instruction without a loaded config"
        for t in tiles:
            assert self.rows[t] > 0 and self.colsb[t] > 0, f"tile {t} is not configured"

    def tilezero(self, t):
        self._check(t)
        self.reg[t] = 0

    @staticmethod
    def _bytes(ary):
        assert ary.flags.c_contiguous
        return ary.reshape(-1).view(np.uint8)

    def tileloadd64(self, t, ary, index, stride):
        self._check(t)
        b = self._bytes(ary)
        for r in range(self.rows[t]):
            s = index * ary.itemsize + r * stride
            assert 0 <= s and s + self.colsb[t] <= b.size, f"tileloadd tile {t} row {r} out of bounds"
            self.reg[t, r, : self.colsb[t]] = b[s : s + self.colsb[t]]

    tileloaddt164 = tileloadd64  # the non-temporal hint changes nothing the model sees

    def tilestored64(self, t, ary, index, stride):
        self._check(t)
        b = self._bytes(ary)
        for r in range(self.rows[t]):
            s = index * ary.itemsize + r * stride
            assert 0 <= s and s + self.colsb[t] <= b.size, f"tilestored tile {t} row {r} out of bounds"
            b[s : s + self.colsb[t]] = self.reg[t, r, : self.colsb[t]]

    # 64-byte row helpers (element indices from the array's start, as the intrinsics)
    @staticmethod
    def _flat(ary, i, n):
        f = ary.reshape(-1)
        assert ary.flags.c_contiguous and 0 <= i and i + n <= f.size, "row helper out of bounds"
        return f[i : i + n]

    def row16_scale_store(self, out, oi, c, ci, s, si, xm):
        r = (self._flat(c, ci, 16).astype(np.float32) * np.float32(xm)) * self._flat(s, si, 16)
        self._flat(out, oi, 16)[:] = r

    def row16_scale_stream(self, out, oi, c, ci, s, si, xm):
        # vmovntps faults unless its line is 64-byte aligned: the kernels must only stream there
        assert (out.ctypes.data + oi * out.itemsize) % 64 == 0, "non-temporal store off a line"
        self.streamed += 1
        self.row16_scale_store(out, oi, c, ci, s, si, xm)

    def sfence(self):
        self.fences += 1

    def row16_scale_bits(self, out, oi, s, si, xm):
        o = self._flat(out, oi, 16)
        assert o.dtype == np.float32
        o[:] = (o.view(np.int32).astype(np.float32) * np.float32(xm)) * self._flat(s, si, 16)

    def row16_fma(self, acc, ai, c, ci, s, si):
        a = self._flat(acc, ai, 16)
        prod = self._flat(s, si, 16).astype(np.float64) * self._flat(c, ci, 16).astype(np.float64)
        a[:] = (prod + a.astype(np.float64)).astype(np.float32)

    def row16_mul_store(self, out, oi, a, ai, xm):
        self._flat(out, oi, 16)[:] = self._flat(a, ai, 16) * np.float32(xm)

    def copy64(self, dst, di, src, si):
        n_dst, n_src = 64 // dst.itemsize, 64 // src.itemsize
        self._flat(dst, di, n_dst).view(np.uint8)[:] = self._flat(src, si, n_src).view(np.uint8)

    def copy64_stream(self, dst, di, src, si):
        assert (dst.ctypes.data + di * dst.itemsize) % 64 == 0, "non-temporal store off a line"
        self.streamed += 1
        self.copy64(dst, di, src, si)

    def unpack_int4_line(self, src, si, dst, di):
        v = self._flat(src, si, 64).astype(np.int16)
        d = self._flat(dst, di, 128)
        d[:64] = (v & 15) - 8
        d[64:] = (v >> 4) - 8

    def unpack_int4_line_mul(self, src, si, dst, di, r, ri):
        v = self._flat(src, si, 64).astype(np.int16)
        rv = np.repeat(self._flat(r, ri, 16).astype(np.int16), 4)
        lo, hi = ((v & 15) - 8) * rv, ((v >> 4) - 8) * rv
        assert np.abs(lo).max() <= 127 and np.abs(hi).max() <= 127, "r * q outside int8"
        d = self._flat(dst, di, 128)
        d[:64] = lo
        d[64:] = hi

    def unpack_int4_group_mul(self, src, si, dst, di, r, ri, nlines):
        for line in range(nlines):
            self.unpack_int4_line_mul(src, si + 64 * line, dst, di + 128 * line, r, ri)

    def row16_max(self, acc, ai, src, si):
        a = self._flat(acc, ai, 16)
        a[:] = np.maximum(a, self._flat(src, si, 16))

    def ratio_row16(self, scale, si, inv, ii, sr, sri, rx, rxi, rmax):
        s = self._flat(scale, si, 16)
        with np.errstate(invalid="ignore", over="ignore"):
            rf = np.rint(s * self._flat(inv, ii, 16))
            ok = (rf * self._flat(sr, sri, 16) == s) & (rf >= 0) & (rf <= rmax)
        self._flat(rx, rxi, 16)[:] = np.where(ok, rf, 0).astype(np.int8)
        return bool(np.all(ok))

    def prefetch_l1(self, ary, index):
        pass  # a hint; never faults

    def prefetch_l2(self, ary, index):
        self.prefetched_l2.append((ary.size, index))  # a hint; the tests check where it aims

    def prefetch_w(self, ary, index):
        # a hint too, but the kernels aim it at the output lines they write: check the aim
        assert 0 <= index < ary.size, f"prefetch_w outside the output ({index} of {ary.size})"
        self.prefetched_w.add(index)

    def _shapes(self, c, a, b):
        self._check(c, a, b)
        m, k = self.rows[a], self.colsb[a]
        assert self.rows[c] == m and self.rows[b] == k // 4 and self.colsb[c] == self.colsb[b] == 64
        return m, k

    def tdpbssd(self, c, a, b):
        m, k = self._shapes(c, a, b)
        av = self.reg[a, :m, :k].view(np.int8).astype(np.int64)
        bv = self.reg[b, : k // 4].view(np.int8).reshape(k // 4, 16, 4).transpose(0, 2, 1)
        cv = self.reg[c, :m].view(np.int32)
        cv[...] = (cv.astype(np.int64) + av @ bv.reshape(k, 16).astype(np.int64)).astype(np.int32)

    def tdpbf16ps(self, c, a, b):
        m, k = self._shapes(c, a, b)
        av = ref.bf16_bits_to_f32(self.reg[a, :m, :k].copy().view(np.uint16)).astype(np.float64)
        bb = self.reg[b, : k // 4].copy().view(np.uint16).reshape(k // 4, 16, 2).transpose(0, 2, 1)
        bv = ref.bf16_bits_to_f32(bb.reshape(k // 2, 16)).astype(np.float64)
        cv = self.reg[c, :m].view(np.float32)
        cv[...] = (cv.astype(np.float64) + av @ bv).astype(np.float32)


def emulated_kernels(monkeypatch) -> types.SimpleNamespace:
    """The AMX kernel files with plain-Python bodies and a ``TileUnit`` (``.unit``) in place of
    the intrinsics, loaded as a package of their own beside the real one (so their relative
    imports find each other, and the real modules stay untouched).

    ``monkeypatch`` (a pytest MonkeyPatch) undoes the patched numba.njit afterwards.
    """
    import numba

    # the jitted modules the kernel files import, loaded before njit is patched: a module first
    # imported under the patch would keep plain-Python functions where the others expect jitted
    for name in ("kt.cpu_ops.cache", "kt.cpu_ops.kernels._simd", "kt.cpu_ops.kernels.amx._intrinsics"):
        importlib.import_module(name)
    real = sys.modules["kt.cpu_ops.kernels.amx._intrinsics"]
    unit = TileUnit()
    pkg_name = "kt.cpu_ops.kernels._amx_emulated"
    pkg = types.ModuleType(pkg_name)
    pkg.__path__ = list(importlib.util.find_spec("kt.cpu_ops.kernels.amx").submodule_search_locations)
    intr = types.ModuleType(f"{pkg_name}._intrinsics")
    intr.__dict__.update({k: v for k, v in vars(real).items() if not k.startswith("__")})
    for name in INTRINSICS:
        setattr(intr, name, getattr(unit, name))
    intr.require_amx = lambda: "emulated"
    monkeypatch.setitem(sys.modules, pkg_name, pkg)
    monkeypatch.setitem(sys.modules, intr.__name__, intr)
    monkeypatch.setattr(numba, "njit", lambda *a, **k: (lambda f: f))
    try:
        mods = [importlib.import_module(f"{pkg_name}.{n}") for n in AMX_FILES]
    finally:
        monkeypatch.undo()
        for name in [n for n in sys.modules if n.startswith(pkg_name + ".")]:
            del sys.modules[name]
    ns = _namespace(mods)
    ns.unit = unit
    return ns
