"""AMX kernels (kt/cpu_ops/kernels/amx/) against kt.reference, on real tiles.

- a compile-only check that always runs: a subprocess compiles every AMX kernel for an explicit
  Sapphire Rapids target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, temporary KT_CACHE_DIR) and reads
  its assembly without executing anything (executing would SIGILL on a host without AMX);
- correctness sweeps that run only where kt.cpu_ops.isa finds AMX runnable (the device machine:
  benchmarks/device_amx.py runs this file there). The same kernels run on the tile unit model
  everywhere in test_amx_emulated.py. Tolerances: _amx_checks.py.
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

from _amx_checks import (M_LIST, ND_LIST, U, check_int4_fallback, check_int4_partial_fallback,
                         check_slices, check_stream_out, check_streams, check_within, inputs,
                         int_ref, pad_cols, run_kernel)
from _amx_model import AMX_SKIP, amx_runnable

_COMPILE_ONLY = r"""
import json, sys
import numpy as np
from numba import typeof, types
from kt.cpu_ops.kernels.amx import _intrinsics
_intrinsics.allow_compile_only()
from kt.cpu_ops.kernels.amx import bf16, int4, int8
i64 = types.int64
t = lambda shape, dt: typeof(np.zeros(shape, dt))
xq, xs, out = t((2, 64), np.int8), t(2, np.float32), t((2, 16), np.float32)
d8, sc, ws = t((1, 16, 16, 4), np.int8), t(16, np.float32), t(16, np.int32)
d4, sc4 = t((1, 8, 16, 4), np.uint8), t((1, 1, 16), np.float32)
xb, db = t((2, 64), np.uint16), t((1, 32, 16, 2), np.uint16)
sigs = {"gemv_int8": (int8, (xq, xs, d8, sc, ws, out, i64, i64)),
        "gemm_int8": (int8, (xq, xs, d8, sc, ws, out, i64, i64)),
        "gemm_int8_shared_out": (int8, (xq, xs, d8, sc, ws, out, i64, i64)),
        "gemm_int8_stream_out": (int8, (xq, xs, d8, sc, ws, out, i64, i64)),
        "gemm_int4_tab_stream_out": (int4, (xq, xs, d4, sc4, i64, out, i64, i64)),
        "gemm_int4_flush": (int4, (xq, xs, d4, sc4, i64, out, i64, i64)),
        "gemm_bf16_stream_out": (bf16, (xb, db, out, i64, i64)),
        "gemv_int4": (int4, (xq, xs, d4, sc4, i64, out, i64, i64)),
        "gemm_int4": (int4, (xq, xs, d4, sc4, i64, out, i64, i64)),
        "gemv_bf16": (bf16, (xb, db, out, i64, i64)),
        "gemm_bf16": (bf16, (xb, db, out, i64, i64))}
res = {"mode": int8.AMX_MODE}
for name, (mod, sig) in sigs.items():
    f = getattr(mod, name)
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
                 "gemm_int8_stream_out", "gemm_int4_tab_stream_out", "gemm_int4_flush"):
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
        # the staged large-M kernels stream A with the non-temporal tile load (the per-group
        # INT4 kernel is not staged)
        assert (c["tileloaddt1"] > 0) == (name.startswith("gemm") and name != "gemm_int4_flush"), (name, c)


def test_import_refused_without_amx():
    if amx_runnable():
        pytest.skip("host runs AMX: the refusal path is tested on hosts without it")
    import importlib

    for name in ("int8", "int4", "bf16", "roofline", "_tiles"):
        with pytest.raises(isa.UnsupportedVariantError, match="AMX kernels cannot run"):
            importlib.import_module(f"kt.cpu_ops.kernels.amx.{name}")


# ----------------------------------------------------------------------------- correctness

needs_amx = pytest.mark.skipif(not amx_runnable(), reason=AMX_SKIP)


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("n,d", ND_LIST)
@pytest.mark.parametrize("m", M_LIST)
def test_int8(K, op, m, n, d):
    x, w = inputs(m, n, d, seed=m * 7 + n + d)
    p = pack(w, QuantScheme.INT8)
    out = run_kernel(K, QuantScheme.INT8, op, x, p)
    want, bound = int_ref(x, ref.quantize(w, "int8"), 0)
    check_within(want, out[:, :n], bound, f"amx {op} int8 M={m} N={n} D={d}")
    assert_exact(np.zeros((m, p.n_pad - n), np.float32), out[:, n:], what="padding rows")


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("n,d", ND_LIST)
@pytest.mark.parametrize("m", M_LIST)
def test_int4(K, op, m, n, d, g):
    x, w = inputs(m, n, d, seed=m * 11 + n + d + g)
    p = pack(w, QuantScheme.INT4, g)
    out = run_kernel(K, QuantScheme.INT4, op, x, p)
    want, bound = int_ref(x, ref.quantize(w, "int4", g), p.d_pad // g)
    check_within(want, out[:, :n], bound, f"amx {op} int4 G={g} M={m} N={n} D={d}")
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
    from kt.cpu_ops.kernels import avx512 as V
    from kt.cpu_ops.packing import int4_ratio_table, pack_experts

    x, w = inputs(m, n, d, seed=m * 17 + n + d + g)
    p = pack_experts(w[None], QuantScheme.INT4, g)
    nb, ng = p.scale.shape[1:3]
    tab = int4_ratio_table(p.scale)
    srow, rx = np.empty(nb * 16, np.float32), np.empty(nb * ng * 16, np.int8)
    assert K._int4_ratios(p.scale[0], 0, nb, srow, rx)
    flat = tab.reshape(-1)
    assert np.array_equal(flat[:nb * 16].view(np.uint32), srow.view(np.uint32))
    assert np.array_equal(flat[nb * 16:].view(np.int8)[:nb * ng * 16], rx)
    xq, xs = ref.quantize_act(x)
    xq = pad_cols(xq, p.d_pad)
    want, bound = int_ref(x, ref.quantize(w, "int4", g), p.d_pad // g)
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
            check_within(want[:, 16 * nb0:], out[:, 16 * nb0:n], bound[:, 16 * nb0:], what)


@needs_amx
@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("n,d", ND_LIST)
@pytest.mark.parametrize("m", M_LIST)
def test_bf16(K, op, m, n, d):
    x, w = inputs(m, n, d, seed=m * 13 + n + d)
    p = pack(w, QuantScheme.BF16)
    out = run_kernel(K, QuantScheme.BF16, op, x, p)
    xr = ref.bf16_round(x)
    wr = ref.dequantize(ref.quantize(w, "bf16"))
    want = ref.linear(xr, wr)
    bound = d * U * (np.abs(xr).astype(np.float64) @ np.abs(wr).astype(np.float64).T)
    check_within(want, out[:, :n], bound, f"amx {op} bf16 M={m} N={n} D={d}")
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
    xqp = pad_cols(xq, p.d_pad)
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
    x, w = inputs(m, n, d, seed=5)
    p = pack(w, scheme, 64)
    full = run_kernel(K, scheme, op, x, p)
    sentinel = np.float32(-12345.0)
    part = run_kernel(K, scheme, op, x, p, nb0=3, nb1=8, fill=sentinel)
    assert_exact(full[:, 48:128], part[:, 48:128], what="computed columns")
    assert (part[:, :48] == sentinel).all() and (part[:, 128:] == sentinel).all(), \
        "kernel wrote outside out[:, 16 nb0 : 16 nb1]"


@needs_amx
def test_gemv_and_gemm_agree_across_m_tails(K):
    """Both paths on the same int8 input, at M around the 16- and 32-row tile edges."""
    for m in (15, 17, 31, 32, 47, 65):
        x, w = inputs(m, 96, 192, seed=m)
        p = pack(w, QuantScheme.INT8)
        a = run_kernel(K, QuantScheme.INT8, "gemv", x, p)
        b = run_kernel(K, QuantScheme.INT8, "gemm", x, p)
        assert_exact(a, b, what=f"gemv vs gemm int8 M={m}")


@needs_amx
def test_peak_loops_count_ops(K):
    for zero in (False, True):
        assert K.peak_int8(10, zero) == 10 * 4 * 2 * 16 * 16 * 64
        assert K.peak_bf16(10, zero) == 10 * 4 * 2 * 16 * 16 * 32


@needs_amx
def test_int4_fallback(K):
    check_int4_fallback(K)
    check_int4_partial_fallback(K)


@needs_amx
@pytest.mark.parametrize("pf", [0, 1, 3])
@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_blocked_gemm_slices_and_prefetch(K, scheme, pf):
    check_slices(K, scheme, pf)


@needs_amx
def test_layer_takes_the_shared_output_int8_gemm():
    """An INT8 layer on AMX calls ``gemm_int8_shared_out`` (output lines requested for writing:
    its rows were last written by other cores) where the registry's ``gemm_int8`` does not."""
    import kt
    from kt.cpu_ops.driver import layout as drv
    from _amx_model import amx_kernels

    K = amx_kernels()

    rng = np.random.default_rng(5)
    g, u = (rng.standard_normal((2, 32, 64)).astype(np.float32) for _ in range(2))
    d = rng.standard_normal((2, 64, 32)).astype(np.float32)
    moe = kt.CPUMoE.from_tensors(g, u, d, scheme="int8", variant="amx")
    assert moe._kaddr[1] == drv.kernel_address(K.gemm_int8_shared_out, drv.SCHEME_INT8)
    assert moe._kaddr[1] != drv.kernel_address(K.gemm_int8, drv.SCHEME_INT8)


def test_down_stream_out_kernels_on_amx(K):
    check_stream_out(K, lambda: None)


def test_gemm_int8_streamed_output_is_exact_on_amx(K):
    """The same three outputs on the tile unit: streamed or not, the bits of the plain stores; and
    the staged kernel refuses to stream into rows off a line (vmovntps would fault)."""
    check_streams(K, lambda: None)
    x, w = inputs(32, 64, 64, seed=2)
    p = pack(w, "int8", 64)
    xq, xs = ref.quantize_act(x)
    from kt.cpu_ops import _align

    off = _align.zeros(32 * 64 + 16, np.float32)[4:4 + 32 * 64].reshape(32, 64)   # 16 bytes past
    wide = _align.zeros((32, 68), np.float32)[:, :64]                            # 272-byte rows
    for out in (off, wide):
        with pytest.raises(ValueError, match="64 bytes"):
            K.gemm_int8_staged(xq, xs, p.data, p.scale, out, 0, p.num_blocks, 32, 16, 2, False, True, True)
