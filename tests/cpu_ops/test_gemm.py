"""GEMM kernels (every scheme x every variant this host runs x gemv/gemm) against kt.reference.

Reference: ``reference.linear(act_roundtrip(x), dequantize(quantize(w)))`` in fp64.

Tolerances (elementwise |out - ref| <= atol + rtol * |ref|, with S = |x_rt| @ |w_dq|^T, the sum
of absolute products of each output, and u = 2^-24 the fp32 unit roundoff):
- INT8: the kernel's int32 sum is exact; it then rounds float(sum) * scale * xs (3 roundings:
  rtol = 1e-5 covers them with a wide margin). The reference itself rounds each dequantised
  operand xq*xs and q*scale to fp32 before its fp64 sum, an error of up to 2u per product, i.e.
  up to 2u*S in total: atol = 4u * S.
- INT4: as INT8, plus the kernel adds the per-group fp32 terms in fp32 (ng = D/G additions):
  atol = (ng + 4) * u * S.
- BF16: fp32 accumulation of D products in some order: |error| <= D * u * S (the classic
  gamma_D bound), atol = D * u * S, rtol = 1e-5.
Exactness of the integer sums is tested separately with all scales = 1 (out == int64 sum).
"""
import numpy as np
import pytest

from kt import reference as ref
from kt.config import QuantScheme
from kt.cpu_ops import gemm, isa, packing
from kt.testing import assert_close, assert_exact

U = 2.0 ** -24
VARIANTS = isa.runnable_variants()
OPS = ("gemv", "gemm")

# (M, N, D, G): every required value of M, N and D appears; M=512 only for small N x D. G cycles
# through 32/64/128 for INT4 (D=200 with G=128 pads to 256).
SHAPES = [
    (1, 1408, 2048, 64),
    (2, 100, 200, 128),
    (7, 48, 256, 32),
    (16, 768, 64, 64),
    (33, 1408, 200, 32),
    (512, 100, 256, 128),
    (512, 16, 64, 32),
]


def _data(m, n, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d), dtype=np.float32)
    w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
    return x, w


def _reference(x, w, scheme, g):
    xr = ref.act_roundtrip(x, scheme)
    wd = ref.dequantize(ref.quantize(w, scheme, g))
    s = np.abs(xr).astype(np.float64) @ np.abs(wd).astype(np.float64).T
    return ref.linear(xr, wd), s


def _atol(scheme, s, d, g):
    if scheme is QuantScheme.INT8:
        return 4 * U * s
    if scheme is QuantScheme.INT4:
        return (-(-d // g) + 4) * U * s
    return d * U * s


def _run(op, scheme, variant, x, p, nb0=0, nb1=None, out=None):
    k = gemm.kernel_for(op, scheme, variant)
    bufs = gemm.activation_buffers(x.shape[0], p)
    gemm.prepare_activations(x, p, bufs)
    if out is None:
        out = np.full((x.shape[0], p.n_pad), np.nan, np.float32)
    gemm.launch(k, p, bufs, out, nb0, nb1)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_kernels_match_reference(variant, scheme):
    for i, (m, n, d, g) in enumerate(SHAPES):
        x, w = _data(m, n, d, seed=i)
        p = packing.pack(w, scheme, g)
        r, s = _reference(x, w, scheme, g)
        for op in OPS:
            out = _run(op, scheme, variant, x, p)
            assert not np.isnan(out).any(), f"{op} left part of out unwritten"
            assert_close(r, out[:, :n], rtol=1e-5, atol=_atol(scheme, s, d, g),
                         what=f"{op} {scheme.value} {variant} M={m} N={n} D={d} G={g}")


def _exact_int8(rng, n, d):
    q = rng.integers(-127, 128, (n, d)).astype(np.int8)
    q[0] = 127          # extreme rows: no int16 saturation in the AVX2 pair sums
    q[1] = -127
    return ref.QuantizedWeight(QuantScheme.INT8, q, np.ones(n, np.float32))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op", OPS)
def test_int8_sums_exact(variant, op):
    """All scales 1: out must equal the int64 sum of xq * q (|sum| < 2^24, so fp32 holds it)."""
    rng = np.random.default_rng(7)
    m, n, d = 9, 40, 320
    qw = _exact_int8(rng, n, d)
    p = packing.pack_quantized(qw)
    xq = np.zeros((m, p.d_pad), np.int8)
    xq[:, :d] = rng.integers(-127, 128, (m, d))
    xq[0, :d] = 127
    xq[1, :d] = -127
    xs = np.ones(m, np.float32)
    out = np.full((m, p.n_pad), np.nan, np.float32)
    gemm.launch(gemm.kernel_for(op, "int8", variant), p, (xq, xs), out)
    want = xq[:, :d].astype(np.int64) @ qw.q.astype(np.int64).T
    assert np.abs(want).max() < 2 ** 24
    assert_exact(want.astype(np.float32), out[:, :n], what=f"int8 {op} {variant}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("g", [32, 128])
def test_int4_sums_exact(variant, op, g):
    """All group scales 1: out must equal the int64 sum (the 8*sum(x) nibble correction exact)."""
    rng = np.random.default_rng(8)
    m, n, d = 6, 36, 2 * g + 40
    q = rng.integers(-7, 8, (n, d)).astype(np.int8)
    q[0] = 7
    q[1] = -7
    ng = -(-d // g)
    p = packing.pack_quantized(ref.QuantizedWeight(QuantScheme.INT4, q, np.ones((n, ng), np.float32), g), g)
    xq = np.zeros((m, p.d_pad), np.int8)
    xq[:, :d] = rng.integers(-127, 128, (m, d))
    xq[0, :d] = -127
    out = np.full((m, p.n_pad), np.nan, np.float32)
    gemm.launch(gemm.kernel_for(op, "int4", variant), p, (xq, np.ones(m, np.float32)), out)
    want = xq[:, :d].astype(np.int64) @ q.astype(np.int64).T
    assert_exact(want.astype(np.float32), out[:, :n], what=f"int4 G={g} {op} {variant}")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("op", OPS)
def test_bf16_small_integers_exact(variant, op):
    """Small integers are exact in bf16 and their fp32 sums are exact in any order."""
    rng = np.random.default_rng(9)
    m, n, d = 5, 20, 130
    x = rng.integers(-8, 9, (m, d)).astype(np.float32)
    w = rng.integers(-8, 9, (n, d)).astype(np.float32)
    out = _run(op, QuantScheme.BF16, variant, x, packing.pack(w, "bf16"))
    assert_exact(x.astype(np.float64) @ w.astype(np.float64).T, out[:, :n], what=f"bf16 {op} {variant}")


@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_block_range_touches_only_its_columns(scheme):
    """A kernel on [nb0, nb1) writes out[:, 16*nb0 : 16*nb1] and nothing else; splits agree."""
    m, n, d = 11, 150, 128
    x, w = _data(m, n, d, seed=3)
    p = packing.pack(w, scheme, 64)
    for op in OPS:
        whole = _run(op, scheme, None, x, p)
        out = _run(op, scheme, None, x, p, nb0=2, nb1=7)
        assert np.isnan(out[:, :32]).all() and np.isnan(out[:, 112:]).all()
        assert_exact(whole[:, 32:112], out[:, 32:112], what=f"{op} {scheme.value} [2, 7)")
        out2 = np.full_like(whole, np.nan)
        for a, b in ((0, 3), (3, 4), (4, p.num_blocks)):
            _run(op, scheme, None, x, p, nb0=a, nb1=b, out=out2)
        assert_exact(whole, out2, what=f"{op} {scheme.value} split")


def test_row_strided_operands():
    """xq rows and out rows may be strided (views of wider buffers)."""
    m, n, d = 6, 64, 192
    x, w = _data(m, n, d, seed=4)
    p = packing.pack(w, "int8")
    bufs = gemm.activation_buffers(m, p)
    gemm.prepare_activations(x, p, bufs)
    wide = np.zeros((m, p.d_pad + 64), np.int8)
    wide[:, : p.d_pad] = bufs[0]
    for op in OPS:
        big = np.full((m, p.n_pad + 32), np.nan, np.float32)
        gemm.launch(gemm.kernel_for(op, "int8"), p, (wide[:, : p.d_pad], bufs[1]), big[:, : p.n_pad])
        want = _run(op, QuantScheme.INT8, None, x, p)
        assert_exact(want, big[:, : p.n_pad], what=f"{op} strided")
        assert np.isnan(big[:, p.n_pad:]).all()


@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_linear_wrapper(scheme):
    x, w = _data(5, 100, 200, seed=5)
    p = packing.pack(w, scheme, 64)
    r, s = _reference(x, w, scheme, 64)
    for op in (None, "gemv", "gemm"):
        y = gemm.linear(x, p, op=op)
        assert y.shape == (5, 100) and y.dtype == np.float32
        assert_close(r, y, rtol=1e-5, atol=_atol(scheme, s, 200, 64), what=f"linear {op}")
    assert gemm.linear(x[:0], p).shape == (0, 100)


def test_int4_minus8_exact_on_every_variant():
    """An INT4 weight holding -8 (a nibble of 0; kt's quantiser writes [-7, 7]) meets the
    reference through ``linear`` on every variant and op: on AMX the GEMM then runs the AVX-512
    VNNI kernel (the AMX one forms r_g * q in int8, where -8 * 17 does not fit)."""
    rng = np.random.default_rng(9)
    x, w = _data(40, 64, 256, seed=9)
    q = ref.quantize(w, "int4", 64)
    qq = q.q.copy()
    qq[rng.random(qq.shape) < 0.2] = -8
    q8 = ref.QuantizedWeight(q.scheme, qq, q.scale, q.group_size)
    p = packing.pack_quantized(q8, 64)
    assert packing.int4_has_minus8(p) and not packing.int4_has_minus8(packing.pack_quantized(q, 64))
    want = ref.linear(ref.act_roundtrip(x, QuantScheme.INT4, "int8"), ref.dequantize(q8))
    for variant in isa.runnable_variants():
        for op in ("gemv", "gemm"):
            got = gemm.linear(x, p, variant=variant, op=op)
            assert ref.relative_error(got, want) < 1e-6, (variant, op)


def test_linear_rejects_bad_input():
    x, w = _data(3, 32, 64, seed=6)
    p = packing.pack(w, "int8")
    with pytest.raises(ValueError, match="D=64"):
        gemm.linear(x[:, :32], p)
    with pytest.raises(ValueError, match=r"\[M, D"):
        gemm.linear(x[0], p)
    with pytest.raises(TypeError, match="floating"):
        gemm.linear(x.astype(np.int32), p)
    with pytest.raises(TypeError, match="PackedWeight"):
        gemm.linear(x, w)
    with pytest.raises(ValueError, match="variant"):
        gemm.linear(x, p, variant="sse2")
    with pytest.raises(ValueError, match="op"):
        gemm.linear(x, p, op="conv")
    stacked = packing.pack_experts(np.stack([w, w]), "int8")
    with pytest.raises(ValueError, match="single matrix"):
        gemm.linear(x, stacked)
    if "amx" not in VARIANTS:
        with pytest.raises(isa.UnsupportedVariantError, match="amx"):
            gemm.linear(x, p, variant="amx")


def test_tiling_choice():
    """gemv up to the kernel set's gemv_max (AMX sets: 4; AVX-512 and AVX2: 1), gemm above;
    described sets of variants this host cannot run need no kernel loaded."""
    from kt.cpu_ops import registry, tiling

    ks = registry.kernel_set
    assert tiling.choose(1, 1536, 2048, ks("int8", "avx512_vnni")).op == "gemv"
    assert tiling.choose(512, 1536, 2048, ks("int8", "avx512_vnni")).op == "gemm"
    assert tiling.choose(1, 768, 2048, ks("int8", "avx2")).op == "gemv"
    assert tiling.choose(2, 768, 2048, ks("int8", "avx2")).op == "gemm"
    assert tiling.choose(4, 768, 2048, ks("int8", "amx")).op == "gemv"
    assert tiling.choose(5, 768, 2048, ks("bf16", "amx")).op == "gemm"
    assert tiling.choose(2, 768, 2048, ks("int8", "avx512_vnni")).op == "gemm"
    assert tiling.choose(512, 768, 2048, ks("bf16", "avx2"), op="gemv").op == "gemv"  # override
    t = tiling.choose(7, 1408, 2048, ks("int8", "avx512_bf16"), threads=2)
    assert t.n_blocks_per_task % 4 == 0 and t.n_blocks_per_task * 8 >= 1408 // 16
    assert tiling.gemm_m_chunk(1000, 2048) % 4 == 0 and tiling.gemm_m_chunk(3, 2048) == 3
    with pytest.raises(ValueError, match="op"):
        tiling.choose(1, 16, 64, ks("int8", "avx2"), op="gemx")
    with pytest.raises(ValueError, match="positive"):
        tiling.choose(0, 16, 64, ks("int8", "avx2"))


@pytest.mark.skipif("avx512_vnni" not in isa.runnable_variants(), reason="host cannot run AVX-512 VNNI")
@pytest.mark.parametrize("g", [32, 64, 128])
def test_int4_prefetching_gemv_is_exact(g):
    """The prefetching INT4 gemv (the decode kernel registered for AMX and AVX-512 hosts): the
    int64 sums exactly (all scales 1) and, on real scales, bit-identical to gemv_int4 (the
    prefetch changes no arithmetic)."""
    from kt.cpu_ops.kernels import avx512 as KV

    kern = KV.gemv_int4_pfl
    rng = np.random.default_rng(18 + g)
    m, n, d = 2, 52, 5 * g + 24
    q = rng.integers(-7, 8, (n, d)).astype(np.int8)
    ng = -(-d // g)
    p = packing.pack_quantized(ref.QuantizedWeight(QuantScheme.INT4, q, np.ones((n, ng), np.float32), g), g)
    xq = np.zeros((m, p.d_pad), np.int8)
    xq[:, :d] = rng.integers(-127, 128, (m, d))
    out = np.full((m, p.n_pad), np.nan, np.float32)
    gemm.launch(kern, p, (xq, np.ones(m, np.float32)), out)
    want = xq[:, :d].astype(np.int64) @ q.astype(np.int64).T
    assert_exact(want.astype(np.float32), out[:, :n], what=f"int4 pf G={g}")
    pr = packing.pack(rng.standard_normal((n, d), dtype=np.float32), QuantScheme.INT4, g)
    xs = rng.random(m, dtype=np.float32) + 0.5
    a = np.full((m, pr.n_pad), np.nan, np.float32)
    b = a.copy()
    gemm.launch(kern, pr, (xq, xs), a)
    gemm.launch(KV.gemv_int4, pr, (xq, xs), b)
    assert np.array_equal(a, b)
