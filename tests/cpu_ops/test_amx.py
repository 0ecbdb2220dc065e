"""AMX kernels (kt/cpu_ops/kernels_amx.py) against kt.reference.

Two parts:
- a compile-only check that always runs: a subprocess compiles every AMX kernel for an explicit
  Sapphire Rapids target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, temporary KT_CACHE_DIR) and reads
  its assembly without executing anything (executing would SIGILL on a host without AMX);
- correctness sweeps that run only where kt.cpu_ops.isa finds AMX runnable (the device machine:
  benchmarks/device_amx.py runs this file there).

Tolerances: integer schemes accumulate exactly in int32, so INT8 differs from the fp64 reference
only by the fp32 epilogue (three roundings: rtol 1e-5 is ~80x that); INT4 adds one fp32 sum over
the D/G group terms, bounded elementwise by (D/G + 3) * 2^-24 * sum_g |term_g|. With unit scales
the outputs must equal the integer product exactly. BF16 products are exact in fp32, so the only
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
from kt.cpu_ops.packing import pack
from kt.testing import assert_close, assert_exact

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
                 ("tdpbssd", "tdpbf16ps", "tileloadd", "tilestored", "ldtilecfg", "tilerelease")}
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
    for name in ("gemv_int8", "gemm_int8", "gemv_int4", "gemm_int4"):
        c = res[name]
        assert c["tdpbssd"] > 0 and c["tdpbf16ps"] == 0, (name, c)
    for name in ("gemv_bf16", "gemm_bf16"):
        c = res[name]
        assert c["tdpbf16ps"] > 0 and c["tdpbssd"] == 0, (name, c)
    for name, c in res.items():
        if name == "mode":
            continue
        for m in ("tileloadd", "tilestored", "ldtilecfg", "tilerelease"):
            assert c[m] > 0, f"{name}: no {m} in the assembly ({c})"


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
    want = ref.linear(ref.act_roundtrip(x, "int8"), ref.dequantize(ref.quantize(w, "int8")))
    assert_close(want, out[:, :n], rtol=1e-5, what=f"amx {op} int8 M={m} N={n} D={d}")
    assert_exact(np.zeros((m, p.n_pad - n), np.float32), out[:, n:], what="padding rows")


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,d", ND_LIST)
@pytest.mark.parametrize("m", M_LIST)
def test_int4(K, op, m, n, d, g):
    x, w = _inputs(m, n, d, seed=m * 11 + n + d + g)
    qw = ref.quantize(w, "int4", g)
    p = pack(w, QuantScheme.INT4, g)
    out = _run(K, QuantScheme.INT4, op, x, p)
    xq, xs = ref.quantize_act(x)
    want = ref.linear(ref.dequantize_act(xq, xs), ref.dequantize(qw))
    # Elementwise bound: three epilogue roundings plus the fp32 sum over the group terms.
    ng = p.d_pad // g
    xd = np.abs(ref.dequantize_act(xq, xs)).astype(np.float64)
    terms = xd @ np.abs(ref.dequantize(qw)).astype(np.float64).T
    bound = 1e-5 * np.abs(want) + (ng + 3) * U * terms
    _check_within(want, out[:, :n], bound, f"amx {op} int4 G={g} M={m} N={n} D={d}")
    assert_exact(np.zeros((m, p.n_pad - n), np.float32), out[:, n:], what="padding rows")


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
    from kt.cpu_ops.packing import pack_quantized

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
    assert K.peak_int8(10) == 10 * 4 * 2 * 16 * 16 * 64
    assert K.peak_bf16(10) == 10 * 4 * 2 * 16 * 16 * 32
