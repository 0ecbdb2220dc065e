"""AMX kernels (kt/cpu_ops/kernels_amx.py) against kt.reference.

Two parts:
- a compile-only check that always runs: a subprocess compiles every AMX kernel for an explicit
  Sapphire Rapids target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, temporary KT_CACHE_DIR) and reads
  its assembly without executing anything (executing would SIGILL on a host without AMX);
- correctness sweeps that run only where kt.cpu_ops.isa finds AMX runnable (the device machine:
  benchmarks/device_amx.py runs this file there).

Tolerances: integer schemes accumulate exactly in int32, so INT8 differs from the exact value
only by the fp32 epilogue (three roundings: rtol 1e-5 is ~80x that). The reference itself rounds
each dequantised operand to fp32 (xq * xs, q * scale) before its fp64 sum, which moves it by up to
2 * 2^-24 * (|x| @ |w|^T) elementwise (visible where terms cancel), so that is added as an
absolute part. INT4 adds one fp32 sum over the D/G group terms: (D/G) * 2^-24 * (|x| @ |w|^T)
more. With unit scales the outputs must equal the integer product exactly. BF16 products are exact in fp32, so the only
error is fp32 summation of D terms: |out - ref| <= D * 2^-24 * (|x| @ |w|^T) elementwise.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kt import reference as ref
from kt.config import QuantScheme
from kt.cpu_ops import isa
from kt.cpu_ops.packing import pack, pack_quantized
from kt.testing import assert_exact

SKIP_REASON = "host has no AMX (runs on the device machine: benchmarks/device_amx.py)"
U = 2.0 ** -24

_COMPILE_ONLY = r"""
import json, sys
import numpy as np
from numba import typeof, types
from kt.cpu_ops import _amx
_amx.allow_compile_only()
from kt.cpu_ops import kernels_amx as K
i64 = types.int64
t = lambda shape, dt: typeof(np.zeros(shape, dt))
xq, xs, out = t((2, 64), np.int8), t(2, np.float32), t((2, 16), np.float32)
d8, sc, ws = t((1, 16, 16, 4), np.int8), t(16, np.float32), t(16, np.int32)
d4, sc4 = t((1, 8, 16, 4), np.uint8), t((1, 1, 16), np.float32)
xb, db = t((2, 64), np.uint16), t((1, 32, 16, 2), np.uint16)
sigs = {"gemv_int8": (xq, xs, d8, sc, ws, out, i64, i64),
        "gemm_int8": (xq, xs, d8, sc, ws, out, i64, i64),
        "gemm_int8_shared_out": (xq, xs, d8, sc, ws, out, i64, i64),
        "gemm_int8_stream_out": (xq, xs, d8, sc, ws, out, i64, i64),
        "gemm_int4_tab_stream_out": (xq, xs, d4, sc4, i64, out, i64, i64),
        "gemm_bf16_stream_out": (xb, db, out, i64, i64),
        "gemv_int4": (xq, xs, d4, sc4, i64, out, i64, i64),
        "gemm_int4": (xq, xs, d4, sc4, i64, out, i64, i64),
        "gemv_bf16": (xb, db, out, i64, i64),
        "gemm_bf16": (xb, db, out, i64, i64)}
res = {"mode": K.AMX_MODE}
for name, sig in sigs.items():
    f = getattr(K, name)
    f.compile(sig)
    asm = f.inspect_asm(sig)
    res[name] = {m: asm.count(m) for m in
                 ("tdpbssd", "tdpbf16ps", "tileloadd", "tileloaddt1", "tilestored", "ldtilecfg",
                  "tilerelease", "vmovntps", "vmovntdq")}
print("RESULT" + json.dumps(res))
"""

AMX_TARGET_FEATURES = ("+amx-tile,+amx-int8,+amx-bf16,+avx512f,+avx512bw,+avx512vl,+avx512dq,"
                       "+avx512vnni,+avx512bf16,+avx2,+fma,+f16c")


def test_amx_kernels_compile_to_tile_instructions(tmp_path):
    env = dict(os.environ)
    env.pop("KT_CPU_VARIANT", None)
    env.pop("KT_KERNEL_CPU_VARIANT", None)
    env.update(NUMBA_CPU_NAME="sapphirerapids", NUMBA_CPU_FEATURES=AMX_TARGET_FEATURES,
               KT_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_ONLY], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"compile-only subprocess failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")][-1]
    res = json.loads(line[len("RESULT"):])
    for name in ("gemv_int8", "gemm_int8", "gemm_int8_shared_out", "gemv_int4", "gemm_int4",
                 "gemm_int8_stream_out", "gemm_int4_tab_stream_out"):
        c = res[name]
        assert c["tdpbssd"] > 0 and c["tdpbf16ps"] == 0, (name, c)
    # the layer's down GEMMs of large chunks store with vmovntps; the shared-output form never
    for name in ("gemm_int8_stream_out", "gemm_int4_tab_stream_out"):
        assert res[name]["vmovntps"] > 0, (name, res[name])
    # the BF16 form copies its fp32 sums with a non-temporal store of 64 bytes (vmovntdq / vmovntps)
    c = res["gemm_bf16_stream_out"]
    assert c["tdpbf16ps"] > 0 and c["vmovntdq"] + c["vmovntps"] > 0, c
    assert res["gemm_bf16"]["vmovntdq"] + res["gemm_bf16"]["vmovntps"] == 0, res["gemm_bf16"]
    assert res["gemm_int8_shared_out"]["vmovntps"] == 0, res["gemm_int8_shared_out"]
    for name in ("gemv_bf16", "gemm_bf16"):
        c = res[name]
        assert c["tdpbf16ps"] > 0 and c["tdpbssd"] == 0, (name, c)
    for name, c in res.items():
        if name == "mode":
            continue
        for m in ("tileloadd", "tilestored", "ldtilecfg", "tilerelease"):
            assert c[m] > 0, f"{name}: no {m} in the assembly ({c})"
        # the staged large-M kernels stream A with the non-temporal tile load
        assert (c["tileloaddt1"] > 0) == name.startswith("gemm"), (name, c)


def _amx_runnable() -> bool:
    return "amx" in isa.runnable_variants()


def test_import_refused_without_amx():
    if _amx_runnable():
        pytest.skip("host runs AMX: the refusal path is tested on hosts without it")
    import importlib

    with pytest.raises(isa.UnsupportedVariantError, match="AMX kernels cannot run"):
        importlib.import_module("kt.cpu_ops.kernels_amx")


# ----------------------------------------------------------------------------- correctness

needs_amx = pytest.mark.skipif(not _amx_runnable(), reason=SKIP_REASON)

M_LIST = (1, 2, 7, 16, 33, 512)
# (N, D): N=100 pads to 112 (7 blocks, odd: exercises the 1-block tails), D=200 pads to 256.
ND_LIST = ((16, 64), (100, 200), (48, 256), (72, 2048))


@pytest.fixture(scope="module")
def K():
    if not _amx_runnable():
        pytest.skip(SKIP_REASON)
    from kt.cpu_ops import kernels_amx

    return kernels_amx


def _inputs(m, n, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d), dtype=np.float32)
    w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
    return x, w


def _pad_cols(a, d_pad):
    out = np.zeros((a.shape[0], d_pad), a.dtype)
    out[:, : a.shape[1]] = a
    return out


def _run(K, scheme, op, x, p, nb0=None, nb1=None, fill=np.nan):
    """Call the AMX kernel on blocks [nb0, nb1) (default all); returns out [M, n_pad]."""
    nb0 = 0 if nb0 is None else nb0
    nb1 = p.num_blocks if nb1 is None else nb1
    m = x.shape[0]
    out = np.full((m, p.n_pad), fill, np.float32)
    if scheme is QuantScheme.BF16:
        xb = _pad_cols(ref.f32_to_bf16_bits(x), p.d_pad)
        getattr(K, f"{op}_bf16")(xb, p.data, out, nb0, nb1)
    else:
        xq, xs = ref.quantize_act(x)
        xq = _pad_cols(xq, p.d_pad)
        if scheme is QuantScheme.INT8:
            getattr(K, f"{op}_int8")(xq, xs, p.data, p.scale, p.wsum, out, nb0, nb1)
        else:
            getattr(K, f"{op}_int4")(xq, xs, p.data, p.scale, p.group_size, out, nb0, nb1)
    return out


def _int_ref(x, qw, groups):
    """Reference for an integer scheme and its elementwise tolerance (see the module docstring)."""
    xd = ref.act_roundtrip(x, "int8")
    wd = ref.dequantize(qw)
    want = ref.linear(xd, wd)
    terms = np.abs(xd).astype(np.float64) @ np.abs(wd).astype(np.float64).T
    return want, 1e-5 * np.abs(want) + (2 + groups) * U * terms


def _check_within(refv, out, bound, what):
    err = np.abs(out.astype(np.float64) - refv.astype(np.float64))
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.size} elements beyond the bound; "
                             f"worst at {tuple(int(v) for v in i)}: ref={refv[i]:.8g} "
                             f"out={out[i]:.8g} err={err[i]:.3g} bound={bound[i]:.3g}")


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("n,d", ND_LIST)
@pytest.mark.parametrize("m", M_LIST)
def test_int8(K, op, m, n, d):
    x, w = _inputs(m, n, d, seed=m * 7 + n + d)
    p = pack(w, QuantScheme.INT8)
    out = _run(K, QuantScheme.INT8, op, x, p)
    want, bound = _int_ref(x, ref.quantize(w, "int8"), 0)
    _check_within(want, out[:, :n], bound, f"amx {op} int8 M={m} N={n} D={d}")
    assert_exact(np.zeros((m, p.n_pad - n), np.float32), out[:, n:], what="padding rows")


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,d", ND_LIST)
@pytest.mark.parametrize("m", M_LIST)
def test_int4(K, op, m, n, d, g):
    x, w = _inputs(m, n, d, seed=m * 11 + n + d + g)
    p = pack(w, QuantScheme.INT4, g)
    out = _run(K, QuantScheme.INT4, op, x, p)
    want, bound = _int_ref(x, ref.quantize(w, "int4", g), p.d_pad // g)
    _check_within(want, out[:, :n], bound, f"amx {op} int4 G={g} M={m} N={n} D={d}")
    assert_exact(np.zeros((m, p.n_pad - n), np.float32), out[:, n:], what="padding rows")


@needs_amx
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,d", ND_LIST[1:])
@pytest.mark.parametrize("m", (1, 7, 33, 150))
def test_int4_tables(K, m, n, d, g):
    """The INT4 kernels on ratio tables (``packing.int4_ratio_table``, as ``CPUMoE`` makes them
    at load): the table holds what the AMX kernels' own ratio maker makes (``_int4_ratios``),
    ``gemm_int4_tab`` equals ``gemm_int4`` exactly (the same products on the same ratios) at
    every M, inline and staged; ``gemv_int4_tab`` (AVX-512, int32 sums of r_g times each group's
    sum) meets the reference within the GEMV's bound; both over a block range."""
    from kt.cpu_ops import kernels_avx512 as V
    from kt.cpu_ops.packing import int4_ratio_table, pack_experts

    x, w = _inputs(m, n, d, seed=m * 17 + n + d + g)
    p = pack_experts(w[None], QuantScheme.INT4, g)
    nb, ng = p.scale.shape[1:3]
    tab = int4_ratio_table(p.scale)
    srow, rx = np.empty(nb * 16, np.float32), np.empty(nb * ng * 16, np.int8)
    assert K._int4_ratios(p.scale[0], 0, nb, srow, rx)
    flat = tab.reshape(-1)
    assert np.array_equal(flat[:nb * 16].view(np.uint32), srow.view(np.uint32))
    assert np.array_equal(flat[nb * 16:].view(np.int8)[:nb * ng * 16], rx)
    xq, xs = ref.quantize_act(x)
    xq = _pad_cols(xq, p.d_pad)
    want, bound = _int_ref(x, ref.quantize(w, "int4", g), p.d_pad // g)
    for nb0 in (0, 1):
        plain = np.full((m, p.n_pad), np.nan, np.float32)
        K.gemm_int4(xq, xs, p.data[0], p.scale[0], g, plain, nb0, nb)
        for kern in (K.gemm_int4_tab, V.gemv_int4_tab):
            out = np.full((m, p.n_pad), np.nan, np.float32)
            kern(xq, xs, p.data[0], tab[0], g, out, nb0, nb)
            what = f"{kern.__name__} G={g} M={m} N={n} D={d} from block {nb0}"
            assert np.isnan(out[:, :16 * nb0]).all(), what
            if kern is K.gemm_int4_tab:
                assert_exact(plain[:, 16 * nb0:], out[:, 16 * nb0:], what=what)
            _check_within(want[:, 16 * nb0:], out[:, 16 * nb0:n], bound[:, 16 * nb0:], what)


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("n,d", ND_LIST)
@pytest.mark.parametrize("m", M_LIST)
def test_bf16(K, op, m, n, d):
    x, w = _inputs(m, n, d, seed=m * 13 + n + d)
    p = pack(w, QuantScheme.BF16)
    out = _run(K, QuantScheme.BF16, op, x, p)
    xr = ref.bf16_round(x)
    wr = ref.dequantize(ref.quantize(w, "bf16"))
    want = ref.linear(xr, wr)
    bound = d * U * (np.abs(xr).astype(np.float64) @ np.abs(wr).astype(np.float64).T)
    _check_within(want, out[:, :n], bound, f"amx {op} bf16 M={m} N={n} D={d}")
    assert_exact(np.zeros((m, p.n_pad - n), np.float32), out[:, n:], what="padding rows")


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("scheme,g", [("int8", 0), ("int4", 32), ("int4", 128)])
@pytest.mark.parametrize("m,n,d", [(3, 100, 2048), (40, 80, 512)])
def test_integer_accumulation_exact(K, op, scheme, g, m, n, d):
    """Unit scales: out must be the exact integer product xq @ q^T (|values| < 2^24)."""
    rng = np.random.default_rng(m + n + d + g)
    scheme = QuantScheme.parse(scheme)
    qmax = 127 if scheme is QuantScheme.INT8 else 7
    q = rng.integers(-qmax, qmax + 1, (n, d)).astype(np.int8)
    xq = rng.integers(-127, 128, (m, d)).astype(np.int8)
    if scheme is QuantScheme.INT8:
        qw = ref.QuantizedWeight(scheme, q, np.ones(n, np.float32))
    else:
        qw = ref.QuantizedWeight(scheme, q, np.ones((n, -(-d // g)), np.float32), g)
    p = pack_quantized(qw, g or 64)
    want = xq.astype(np.int64) @ q.astype(np.int64).T
    assert np.abs(want).max() < 2 ** 24  # so fp32 holds every partial and total exactly
    out = np.full((m, p.n_pad), np.nan, np.float32)
    xs = np.ones(m, np.float32)
    xqp = _pad_cols(xq, p.d_pad)
    if scheme is QuantScheme.INT8:
        getattr(K, f"{op}_int8")(xqp, xs, p.data, p.scale, p.wsum, out, 0, p.num_blocks)
    else:
        getattr(K, f"{op}_int4")(xqp, xs, p.data, p.scale, g, out, 0, p.num_blocks)
    assert_exact(want.astype(np.float32), out[:, :n], what=f"amx {op} {scheme.value} exact int32")


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_block_range_touches_only_its_columns(K, op, scheme):
    """A kernel on blocks [nb0, nb1) writes exactly out[:, 16 nb0 : 16 nb1]."""
    scheme = QuantScheme.parse(scheme)
    m, n, d = 37, 160, 320
    x, w = _inputs(m, n, d, seed=5)
    p = pack(w, scheme, 64)
    full = _run(K, scheme, op, x, p)
    sentinel = np.float32(-12345.0)
    part = _run(K, scheme, op, x, p, nb0=3, nb1=8, fill=sentinel)
    assert_exact(full[:, 48:128], part[:, 48:128], what="computed columns")
    assert (part[:, :48] == sentinel).all() and (part[:, 128:] == sentinel).all(), \
        "kernel wrote outside out[:, 16 nb0 : 16 nb1]"


@needs_amx
def test_gemv_and_gemm_agree_across_m_tails(K):
    """Both paths on the same int8 input, at M around the 16- and 32-row tile edges."""
    for m in (15, 17, 31, 32, 47, 65):
        x, w = _inputs(m, 96, 192, seed=m)
        p = pack(w, QuantScheme.INT8)
        a = _run(K, QuantScheme.INT8, "gemv", x, p)
        b = _run(K, QuantScheme.INT8, "gemm", x, p)
        assert_exact(a, b, what=f"gemv vs gemm int8 M={m}")


@needs_amx
def test_peak_loops_count_ops(K):
    for zero in (False, True):
        assert K.peak_int8(10, zero) == 10 * 4 * 2 * 16 * 16 * 64
        assert K.peak_bf16(10, zero) == 10 * 4 * 2 * 16 * 16 * 32


def test_emulated_peak_loops_use_random_tiles(EK):
    """The peak loops multiply random (not zero) tiles, as a GEMM does; bf16 inputs are finite."""
    from kt import reference as ref
    for bf in (False, True):
        with np.errstate(over="ignore"):  # the generator's uint32 wrap-around, as in Numba
            EK._peak(3, bf, False)
        ins = EK.unit.reg[4:8]
        assert (ins != 0).mean() > 0.9
        if bf:
            vals = ref.bf16_bits_to_f32(ins.view(np.uint16))
            assert np.isfinite(vals).all() and ((np.abs(vals) >= 1) & (np.abs(vals) < 2)).all()
        with np.errstate(over="ignore"):
            EK._peak(3, bf, True)
        assert not EK.unit.reg[4:8].any()


# ----------------------------------------------------------------------------- emulated tile unit
# The kernels' Python bodies run everywhere against a numpy model of the tile unit (shapes from the
# loaded config, every load/store bounds-checked, products per the instruction definitions). This
# checks the kernels' indexing and tails on hosts without AMX; the device runs the real thing.

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


def emulated_kernels(monkeypatch):
    """kernels_amx with plain-Python bodies and the tile unit model in place of the intrinsics.

    ``monkeypatch`` (a pytest MonkeyPatch) undoes the patched numba.njit / _amx guard afterwards.
    """
    import importlib.util
    import numba

    from kt.cpu_ops import _amx

    # kernels_amx's other jitted imports loaded before njit is patched: a module first imported
    # under the patch would keep plain-Python functions where the real kernels expect jitted ones
    for name in ("_simd", "cache"):
        importlib.import_module(f"kt.cpu_ops.{name}")

    monkeypatch.setattr(numba, "njit", lambda *a, **k: (lambda f: f))
    monkeypatch.setattr(_amx, "require_amx", lambda: "emulated")
    path = importlib.util.find_spec("kt.cpu_ops.kernels_amx").origin
    spec = importlib.util.spec_from_file_location("kt.cpu_ops._kernels_amx_emulated", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    unit = TileUnit()
    for name in ("ldtilecfg", "tilerelease", "tilezero", "tileloadd64", "tileloaddt164", "tilestored64",
                 "tdpbssd", "tdpbf16ps", "row16_scale_store", "row16_scale_stream", "sfence",
                 "row16_scale_bits", "row16_fma",
                 "row16_mul_store",
                 "copy64", "copy64_stream", "unpack_int4_line", "unpack_int4_line_mul", "unpack_int4_group_mul", "row16_max",
                 "ratio_row16",
                 "prefetch_l1", "prefetch_l2", "prefetch_w"):
        setattr(mod, name, getattr(unit, name))
    mod.unit = unit
    monkeypatch.undo()
    return mod


@pytest.fixture
def EK(monkeypatch):
    return emulated_kernels(monkeypatch)


EMU_CASES = [(1, 16, 64), (2, 48, 2048), (7, 100, 200), (16, 112, 128), (33, 48, 256),
             (35, 100, 200)]


@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("scheme,g", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128),
                                      ("bf16", 0)])
@pytest.mark.parametrize("m,n,d", EMU_CASES)
def test_emulated_kernels_match_reference(EK, op, scheme, g, m, n, d):
    scheme = QuantScheme.parse(scheme)
    x, w = _inputs(m, n, d, seed=m + n + d + g)
    p = pack(w, scheme, g or 64)
    out = _run(EK, scheme, op, x, p)
    assert not EK.unit.configured, "kernel returned without tilerelease"
    what = f"emulated {op} {scheme.value} G={g} M={m} N={n} D={d}"
    if scheme is not QuantScheme.BF16:
        groups = p.d_pad // g if g else 0
        want, bound = _int_ref(x, ref.quantize(w, scheme, g or 64), groups)
        _check_within(want, out[:, :n], bound, what)
    else:
        xr, wr = ref.bf16_round(x), ref.dequantize(ref.quantize(w, "bf16"))
        want = ref.linear(xr, wr)
        bound = d * U * (np.abs(xr).astype(np.float64) @ np.abs(wr).astype(np.float64).T)
        _check_within(want, out[:, :n], bound, what)
    assert_exact(np.zeros((m, p.n_pad - n), np.float32), out[:, n:], what="padding rows")


def _check_staged(mod, run, whole, p, what):
    """The staged kernel ``run(out, nb0, mc, kcs, l2, pfw, nta)`` gives ``whole`` exactly for K
    slices of 1, 3 and all k-steps, M chunks of 32 and 64 rows, with and without its prefetches
    and the non-temporal A loads; a block range leaves the other columns untouched; (emulated)
    pfw asks for exactly the output lines the drain writes."""
    m = whole.shape[0]
    nb = p.num_blocks
    for mc, kcs, l2, pfw, nta in ((32, 1, 2, True, True), (64, 3, 0, False, False),
                                  (64, 1000, 1, True, True)):
        o = np.full(whole.shape, np.nan, np.float32)
        if hasattr(mod, "unit"):
            mod.unit.prefetched_w.clear()
        run(o, 0, mc, kcs, l2, pfw, nta)
        assert_exact(whole, o, what=f"{what} staged mc={mc} kcs={kcs} vs gemm")
        if hasattr(mod, "unit"):
            want = {r * p.n_pad + 16 * b for r in range(m) for b in range(nb)} if pfw else set()
            assert mod.unit.prefetched_w == want, what
    part = np.full(whole.shape, np.nan, np.float32)
    run(part, 1, 64, 2, 2, True, True)
    assert np.isnan(part[:, :16]).all()
    assert_exact(whole[:, 16:], part[:, 16:], what=f"{what} staged block range")


def _check_blocked(mod, scheme, pf):
    """Small M chunks and K slices (partial sums cross slices and chunks) and prefetching give the
    unsliced result exactly (integer schemes) or within the fp32 summation bound (BF16)."""
    scheme = QuantScheme.parse(scheme)
    m, n, d = 70, 80, 256
    x, w = _inputs(m, n, d, seed=3)
    p = pack(w, scheme, 64)
    nb = p.num_blocks
    whole = _run(mod, scheme, "gemm", x, p)
    out = np.full((m, p.n_pad), np.nan, np.float32)
    if scheme is QuantScheme.BF16:
        xb = _pad_cols(ref.f32_to_bf16_bits(x), p.d_pad)
        mod.gemm_bf16_blocked(xb, p.data, out, 0, nb, 32, 1, pf)
        # the pipelined variant sums each panel over K in the order gemm_bf16 does: identical
        for mc, l2, pfw in ((32, 2, True), (64, 0, False), (64, 1, False), (64, 3, True)):
            pipe = np.full((m, p.n_pad), np.nan, np.float32)
            mod.gemm_bf16_pipe(xb, p.data, pipe, 0, nb, mc, pf, l2, pfw)
            assert_exact(whole, pipe, what=f"bf16 pipelined pf={pf} mc={mc} vs gemm")
        part = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemm_bf16_pipe(xb, p.data, part, 1, nb, 64, pf, 2, True)
        assert np.isnan(part[:, :16]).all()
        assert_exact(whole[:, 16:], part[:, 16:], what="bf16 pipelined block range")
        # the staged kernel: K slices carry the fp32 partial sums bit for bit, so any slicing
        # sums in gemm_bf16's order
        _check_staged(mod, lambda o, nb0, mc, kcs, l2, pfw, nta: mod.gemm_bf16_staged(
            xb, p.data, o, nb0, nb, mc, kcs, l2, pfw, nta), whole, p, "bf16")
        xr, wr = ref.bf16_round(x), ref.dequantize(ref.quantize(w, "bf16"))
        bound = d * U * (np.abs(xr).astype(np.float64) @ np.abs(wr).astype(np.float64).T)
        _check_within(ref.linear(xr, wr), out[:, :n], bound, "bf16 sliced")
        gv = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemv_bf16_pf(xb, p.data, gv, 0, nb, pf)
        _check_within(ref.linear(xr, wr), gv[:, :n], bound, f"bf16 gemv pf={pf}")
        return
    xq, xs = ref.quantize_act(x)
    xq = _pad_cols(xq, p.d_pad)
    if scheme is QuantScheme.INT8:
        mod.gemm_int8_blocked(xq, xs, p.data, p.scale, out, 0, nb, 32, 1, pf)
        # the software-pipelined variant (odd block count: the last pair is half), and a block
        # range inside the matrix leaves the other columns untouched
        for mc, l2, pfw in ((32, 2, True), (64, 0, False), (64, 1, False), (64, 3, True)):
            pipe = np.full((m, p.n_pad), np.nan, np.float32)
            mod.gemm_int8_pipe(xq, xs, p.data, p.scale, pipe, 0, nb, mc, pf, l2, pfw)
            assert_exact(whole, pipe, what=f"int8 pipelined pf={pf} mc={mc} vs gemm")
        if hasattr(mod, "unit"):  # emulated: pfw requested exactly the lines the epilogue wrote
            mod.unit.prefetched_w.clear()
            mod.gemm_int8_pipe(xq, xs, p.data, p.scale, pipe, 0, nb, 32, pf, 2, True)
            assert mod.unit.prefetched_w == {r * p.n_pad + 16 * b for r in range(m)
                                             for b in range(nb)}
            # the L2 prefetch l2 pairs ahead: inside the weights, every block after the first
            # pair once per M chunk (all of them at the first pair when l2 reaches the end)
            blk = p.data.size // nb
            for l2 in (0, 1, 2, 3):
                mod.unit.prefetched_l2.clear()
                mod.gemm_int8_pipe(xq, xs, p.data, p.scale, pipe, 0, nb, 1024, pf, l2, False)
                idx = [i for size, i in mod.unit.prefetched_l2 if size == p.data.size]
                assert all(0 <= i < p.data.size for i in idx), l2
                assert sorted(idx) == sorted(set(idx)), f"l2={l2}: a line prefetched twice"
                assert {i // blk for i in idx} == (set(range(2, nb)) if l2 else set()), l2
        part = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemm_int8_pipe(xq, xs, p.data, p.scale, part, 1, nb, 64, pf, 2, True)
        assert np.isnan(part[:, :16]).all()
        assert_exact(whole[:, 16:], part[:, 16:], what="int8 pipelined block range")
        _check_staged(mod, lambda o, nb0, mc, kcs, l2, pfw, nta: mod.gemm_int8_staged(
            xq, xs, p.data, p.scale, o, nb0, nb, mc, kcs, l2, pfw, nta), whole, p, "int8")
        # the layer's form (output lines requested for writing) against the contract kernel
        shared = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemm_int8_shared_out(xq, xs, p.data, p.scale, p.wsum, shared, 0, nb)
        assert_exact(whole, shared, what="int8 gemm_int8_shared_out vs gemm_int8")
        gv = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemv_int8_pf(xq, xs, p.data, p.scale, gv, 0, nb, pf)
        assert_exact(whole, gv, what=f"int8 gemv pf={pf} vs gemm")
    else:
        # gemm_int4 takes the flush-free ratio kernel on the quantiser's scales: the flush kernel
        # unsliced is the comparison for its slices, and the ratio kernel's own M chunks and
        # block ranges give its whole result exactly
        whole_flush = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemm_int4_blocked(xq, xs, p.data, p.scale, 64, whole_flush, 0, nb, 128, p.d_pad, False, False)
        srow = np.empty(nb * 16, np.float32)
        rx = np.empty(nb * p.scale.shape[1] * 16, np.int8)
        assert mod._int4_ratios(p.scale, 0, nb, srow, rx)
        for mc, pfw in ((32, True), (64, False)):
            r_out = np.full((m, p.n_pad), np.nan, np.float32)
            if hasattr(mod, "unit"):
                mod.unit.prefetched_w.clear()
            mod.gemm_int4_ratio(xq, xs, p.data, 64, srow, rx, r_out, 0, nb, mc, pfw)
            assert_exact(whole, r_out, what=f"int4 ratio mc={mc} vs gemm")
            if hasattr(mod, "unit") and pfw:
                assert mod.unit.prefetched_w == {r * p.n_pad + 16 * b for r in range(m)
                                                 for b in range(nb)}
        part = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemm_int4_ratio(xq, xs, p.data, 64, srow[16:], rx[p.scale.shape[1] * 16:], part, 1, nb, 64, True)
        assert np.isnan(part[:, :16]).all()
        assert_exact(whole[:, 16:], part[:, 16:], what="int4 ratio block range")
        ng = p.scale.shape[1]
        _check_staged(mod, lambda o, nb0, mc, kcs, l2, pfw, nta: mod.gemm_int4_staged(
            xq, xs, p.data, 64, srow[16 * nb0:], rx[16 * ng * nb0:], o, nb0, nb, mc, kcs, pfw, nta),
            whole, p, "int4")
        # the small-M kernel that unpacks as it multiplies (any M: each panel unpacks again; keep:
        # the later panels multiply the first panel's unpacked pair)
        for keep in (False, True):
            _check_staged(mod, lambda o, nb0, mc, kcs, l2, pfw, nta: mod.gemm_int4_inline(
                xq, xs, p.data, 64, srow[16 * nb0:], rx[16 * ng * nb0:], o, nb0, nb, l2, pfw, keep),
                whole, p, f"int4 inline keep={keep}")
        if hasattr(mod, "unit"):
            mod.unit.prefetched_w.clear()
        mod.gemm_int4_blocked(xq, xs, p.data, p.scale, 64, out, 0, nb, 32, 64, pf > 0, True)
        if hasattr(mod, "unit"):  # emulated: pfw requested exactly the lines the epilogue wrote
            assert mod.unit.prefetched_w == {r * p.n_pad + 16 * b for r in range(m)
                                             for b in range(nb)}
        whole = whole_flush
        gv = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemv_int4_pf(xq, xs, p.data, p.scale, 64, gv, 0, nb, pf)
        ref_gv = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemv_int4(xq, xs, p.data, p.scale, 64, ref_gv, 0, nb)
        assert_exact(ref_gv, gv, what=f"int4 gemv prefetch {pf} groups vs none")
    assert_exact(whole, out, what=f"{scheme.value} sliced vs whole")


def _check_int4_fallback(mod):
    """INT4 scales not of the quantiser's s_row * r_g form (weights quantised elsewhere): gemm_int4
    takes the per-group flush kernel, and its result is gemm_int4_blocked's exactly."""
    m, n, d = 40, 48, 256
    x, w = _inputs(m, n, d, seed=5)
    qw = ref.quantize(w, "int4", 64)
    rng = np.random.default_rng(5)
    scale = (qw.scale * rng.uniform(0.9, 1.1, qw.scale.shape)).astype(np.float32)
    p = pack_quantized(ref.QuantizedWeight(qw.scheme, qw.q, scale, 64), 64)
    nb = p.num_blocks
    assert not mod._int4_ratios(p.scale, 0, nb, np.empty(nb * 16, np.float32),
                                np.empty(nb * p.scale.shape[1] * 16, np.int8))
    out = _run(mod, QuantScheme.INT4, "gemm", x, p)
    xq, xs = ref.quantize_act(x)
    flush = np.full_like(out, np.nan)
    mod.gemm_int4_blocked(_pad_cols(xq, p.d_pad), xs, p.data, p.scale, 64, flush, 0, nb,
                          mod.default_mc(p.d_pad), 512, True, True)
    assert_exact(flush, out, what="int4 gemm on non-ratio scales vs the flush kernel")
    want, bound = _int_ref(x, ref.QuantizedWeight(qw.scheme, qw.q, scale, 64), d // 64)
    _check_within(want, out[:, :n], bound, "int4 gemm on non-ratio scales")


def _check_int4_partial_fallback(mod):
    """Scales of the ratio form in blocks 0-1 only (block 3's columns scaled off it): gemm_int4's
    inline kernel, which makes each pair's ratios as it reaches the pair, computes blocks 0-1 and
    stops at pair 2-3; the flush kernel computes blocks 2-4. Each part equals its kernel exactly."""
    m, n, d = 40, 80, 256
    x, w = _inputs(m, n, d, seed=6)
    qw = ref.quantize(w, "int4", 64)
    scale = qw.scale.copy()
    scale[48:64] *= np.float32(1.01)
    p = pack_quantized(ref.QuantizedWeight(qw.scheme, qw.q, scale, 64), 64)
    nb, ng = p.num_blocks, p.scale.shape[1]
    assert nb == 5
    out = _run(mod, QuantScheme.INT4, "gemm", x, p)
    xq, xs = ref.quantize_act(x)
    xq = _pad_cols(xq, p.d_pad)
    srow, rx = np.empty(2 * 16, np.float32), np.empty(2 * ng * 16, np.int8)
    assert mod._int4_ratios(p.scale, 0, 2, srow, rx)
    assert not mod._int4_ratios(p.scale, 2, 4, np.empty(2 * 16, np.float32), np.empty(2 * ng * 16, np.int8))
    head = np.full_like(out, np.nan)
    mod.gemm_int4_inline(xq, xs, p.data, 64, srow, rx, head, 0, 2, 1, True)
    assert_exact(head[:, :32], out[:, :32], what="int4 gemm, ratio blocks vs the inline kernel")
    tail = np.full_like(out, np.nan)
    mod.gemm_int4_blocked(xq, xs, p.data, p.scale, 64, tail, 2, nb, mod.default_mc(p.d_pad), 512, True, True)
    assert_exact(tail[:, 32:], out[:, 32:], what="int4 gemm, the other blocks vs the flush kernel")
    want, bound = _int_ref(x, ref.QuantizedWeight(qw.scheme, qw.q, scale, 64), d // 64)
    _check_within(want, out[:, :n], bound, "int4 gemm on partly ratio scales")


def test_emulated_int4_fallback(EK):
    _check_int4_fallback(EK)
    _check_int4_partial_fallback(EK)


@needs_amx
def test_int4_fallback(K):
    _check_int4_fallback(K)
    _check_int4_partial_fallback(K)


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_emulated_blocked_gemm_slices(EK, scheme):
    _check_blocked(EK, scheme, pf=2)


@needs_amx
@pytest.mark.parametrize("pf", [0, 1, 3])
@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_blocked_gemm_slices_and_prefetch(K, scheme, pf):
    _check_blocked(K, scheme, pf)


def test_ratio_row16_accepts_only_exact_integer_ratios():
    """The 16-lane ratio check (plain AVX-512 code, runs on any host): exact multiples r * s_row
    with r in [0, 18] pass and give r per column as int8; anything else (a scale off by an
    ulp, r > 18, negative, Inf, NaN) fails, without undefined float-to-int conversions."""
    from numba import njit

    from kt.cpu_ops._amx import ratio_row16

    @njit
    def check(scale, inv, sr, rx):
        return ratio_row16(scale, 0, inv, 0, sr, 0, rx, 0, 18)

    rng = np.random.default_rng(4)
    sr = rng.uniform(1e-3, 1e-2, 16).astype(np.float32)
    sr = (sr.view(np.uint32) & np.uint32(0xFFFFFFE0)).view(np.float32)
    r = rng.integers(0, 19, 16)
    scale = (sr * r.astype(np.float32)).astype(np.float32)
    inv = (np.float32(1.0) / sr).astype(np.float32)
    rx = np.zeros(16, np.int8)
    assert check(scale, inv, sr, rx) and np.array_equal(rx, r.astype(np.int8))
    for bad in (np.nextafter(scale[3], np.float32(1)), sr[3] * np.float32(19), -sr[3], np.inf, np.nan):
        s2 = scale.copy()
        s2[3] = bad
        assert not check(s2, inv, sr, rx), bad


@pytest.mark.parametrize("nlines", [4, 8])
def test_unpack_int4_group_mul_is_the_per_line_unpack(nlines):
    """The group unpack (16-bit products of 15 - nibble, plain AVX-512 code: runs on any host)
    against the per-line 8-bit one and numpy, over every ratio 0..18 in each column and every byte
    value in each group's lines: equal wherever both r q of a 16-bit lane fit in int8 (not for q = -8 with
    r >= 17, which the ratio kernels never see: its carry reaches the lane's other byte)."""
    from numba import njit

    from kt.cpu_ops._amx import unpack_int4_group_mul, unpack_int4_line_mul

    @njit
    def both(src, r, a, b):
        for g in range(src.size // (64 * nlines)):
            unpack_int4_group_mul(src, g * 64 * nlines, a, g * 128 * nlines, r, 16 * g, nlines)
            for line in range(nlines):
                unpack_int4_line_mul(src, (g * nlines + line) * 64, b, (g * nlines + line) * 128, r, 16 * g)

    rng = np.random.default_rng(11)
    groups = 19 * 16  # each ratio in each of the 16 columns; each group's lines hold every byte value
    src = np.empty((groups, nlines, 64), np.uint8)
    for g in range(groups):
        src[g] = rng.permutation(np.resize(np.arange(256, dtype=np.uint8), nlines * 64)).reshape(nlines, 64)
    r = np.array([[(g + c) % 19 for c in range(16)] for g in range(groups)], np.int8)
    a = np.zeros(groups * nlines * 128, np.int8)
    b = np.zeros_like(a)
    both(src.reshape(-1), r.reshape(-1), a, b)
    q = np.stack([(src & 15).astype(np.int32) - 8, (src >> 4).astype(np.int32) - 8], axis=2)  # g, l, h, 64
    want = q * np.repeat(r.astype(np.int32), 4, axis=1)[:, None, None, :]
    lane = np.abs(want).reshape(groups, nlines, 2, 32, 2).max(axis=-1) <= 127
    fits = np.repeat(lane, 2, axis=-1)
    got = a.reshape(groups, nlines, 2, 64).astype(np.int32)
    assert fits.mean() > 0.97
    assert np.array_equal(got[fits], want[fits])
    assert np.array_equal(a.reshape(got.shape)[fits], b.reshape(got.shape)[fits])


@needs_amx
def test_layer_takes_the_shared_output_int8_gemm():
    """An INT8 layer on AMX calls ``gemm_int8_shared_out`` (output lines requested for writing:
    its rows were last written by other cores) where the registry's ``gemm_int8`` does not."""
    import kt
    from kt.cpu_ops import _moe_driver as drv
    from kt.cpu_ops import kernels_amx as K

    rng = np.random.default_rng(5)
    g, u = (rng.standard_normal((2, 32, 64)).astype(np.float32) for _ in range(2))
    d = rng.standard_normal((2, 64, 32)).astype(np.float32)
    moe = kt.CPUMoE.from_tensors(g, u, d, scheme="int8", variant="amx")
    assert moe._kaddr[1] == drv.kernel_address(K.gemm_int8_shared_out, drv.SCHEME_INT8)
    assert moe._kaddr[1] != drv.kernel_address(K.gemm_int8, drv.SCHEME_INT8)


def _stream_cases():
    """(what, out, streams) for gemm_int8 at M=520, N=1040 (65 blocks: the last pair is half),
    D=64: an output on lines and over 1 MiB (streamed), the same 16 bytes off a line, and one
    under 1 MiB (not streamed)."""
    from kt.cpu_ops import _align

    big = _align.empty((520, 1040), np.float32)
    buf = _align.empty(520 * 1040 + 16, np.float32)
    off = buf[4:4 + 520 * 1040].reshape(520, 1040)         # 16 bytes past a line
    small = _align.empty((200, 1040), np.float32)
    return [("aligned > 1 MiB", big, True), ("off a line", off, False), ("< 1 MiB", small, False)]


def _check_streams(mod, count):
    m, n, d = 520, 1040, 64
    x, w = _inputs(m, n, d, seed=21)
    p = pack(w, "int8", 64)
    xq, xs = ref.quantize_act(x)
    for what, out, streams in _stream_cases():
        rows = out.shape[0]
        want = np.full(out.shape, np.nan, np.float32)
        mod.gemm_int8_shared_out(xq[:rows], xs[:rows], p.data, p.scale, p.wsum, want, 0, p.num_blocks)
        out[...] = np.nan
        before = count()
        mod.gemm_int8(xq[:rows], xs[:rows], p.data, p.scale, p.wsum, out, 0, p.num_blocks)
        assert_exact(want, out, what=f"gemm_int8 {what}")
        if before is not None:
            assert (count() > before) == streams, what


def test_gemm_int8_streams_only_large_outputs_on_lines(EK):
    """gemm_int8 stores its output with non-temporal stores exactly when it exceeds 1 MiB and its
    rows start on lines (the model asserts every streamed row is on a line), fences once, and
    gives the shared-output kernel's result bit for bit (which never streams)."""
    EK.unit.fences = 0
    _check_streams(EK, lambda: EK.unit.streamed)
    assert EK.unit.fences == 1


def _check_stream_out(mod, count):
    """gemm_int8_stream_out, gemm_int4_tab_stream_out and gemm_bf16_stream_out (the MoE layer's
    down GEMMs of large chunks) against their plain forms: the same bits into outputs of any size, inline (<= 128 rows)
    and staged INT4, streamed exactly when the rows start on lines (the model asserts each streamed
    row is on one), and one fence per streamed call."""
    from kt.cpu_ops import _align
    from kt.cpu_ops.packing import int4_ratio_table, pack_experts

    n, d, g = 80, 128, 64                  # 5 blocks: the last pair is half
    for m in (7, 150):
        x, w = _inputs(m, n, d, seed=m + 5)
        xq, xs = ref.quantize_act(x)
        p8 = pack(w, "int8", 64)
        p4 = pack_experts(w[None], QuantScheme.INT4, g)
        tab = int4_ratio_table(p4.scale)
        # BF16 over K = 1056: three K slices, whose fp32 partial sums wait in cpart (only the last
        # slice's sums are stored, streamed or not)
        xbf, wbf = _inputs(m, n, 1056, seed=m + 6)
        pb = pack(wbf, "bf16", 64)
        xb = _pad_cols(ref.f32_to_bf16_bits(xbf), pb.d_pad)
        runs = (("int8", lambda o: mod.gemm_int8_shared_out(xq, xs, p8.data, p8.scale, p8.wsum, o, 0, p8.num_blocks),
                 lambda o: mod.gemm_int8_stream_out(xq, xs, p8.data, p8.scale, p8.wsum, o, 0, p8.num_blocks)),
                ("int4", lambda o: mod.gemm_int4_tab(xq, xs, p4.data[0], tab[0], g, o, 0, p4.data.shape[1]),
                 lambda o: mod.gemm_int4_tab_stream_out(xq, xs, p4.data[0], tab[0], g, o, 0, p4.data.shape[1])),
                ("bf16", lambda o: mod.gemm_bf16(xb, pb.data, o, 0, pb.num_blocks),
                 lambda o: mod.gemm_bf16_stream_out(xb, pb.data, o, 0, pb.num_blocks)))
        for scheme, plain, streamed in runs:
            on = _align.empty((m, 80), np.float32)
            off = _align.empty(m * 80 + 16, np.float32)[4:4 + m * 80].reshape(m, 80)
            for what, out, streams in (("on lines", on, True), ("off a line", off, False)):
                want = np.full(out.shape, np.nan, np.float32)
                plain(want)
                out[...] = np.nan
                before = count()
                streamed(out)
                assert_exact(want, out, what=f"{scheme} stream_out M={m} {what}")
                if before is not None:
                    assert (count()[0] > before[0]) == streams, (scheme, m, what)
                    assert count()[1] - before[1] == (1 if streams else 0), (scheme, m, what)


def test_down_stream_out_kernels_emulated(EK):
    _check_stream_out(EK, lambda: (EK.unit.streamed, EK.unit.fences))


def test_down_stream_out_kernels_on_amx(K):
    _check_stream_out(K, lambda: None)


def test_gemm_int8_streamed_output_is_exact_on_amx(K):
    """The same three outputs on the tile unit: streamed or not, the bits of the plain stores; and
    the staged kernel refuses to stream into rows off a line (vmovntps would fault)."""
    _check_streams(K, lambda: None)
    x, w = _inputs(32, 64, 64, seed=2)
    p = pack(w, "int8", 64)
    xq, xs = ref.quantize_act(x)
    from kt.cpu_ops import _align

    off = _align.zeros(32 * 64 + 16, np.float32)[4:4 + 32 * 64].reshape(32, 64)   # 16 bytes past
    wide = _align.zeros((32, 68), np.float32)[:, :64]                            # 272-byte rows
    for out in (off, wide):
        with pytest.raises(ValueError, match="64 bytes"):
            K.gemm_int8_staged(xq, xs, p.data, p.scale, out, 0, p.num_blocks, 32, 16, 2, False, True, True)
