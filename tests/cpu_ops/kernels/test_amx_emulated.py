"""AMX kernels (kt/cpu_ops/kernels/amx/) on the numpy tile unit model (_amx_model.py): their
indexing, tails, prefetch aims and store forms, checked on every host; and the 16-lane helpers
of kernels/amx/_intrinsics.py that are plain AVX-512 code (they run on any host).
"""
from __future__ import annotations

import numpy as np
import pytest

from kt import reference as ref
from kt.config import QuantScheme
from kt.cpu_ops.packing import pack
from kt.testing import assert_exact

from _amx_checks import (U, check_int4_fallback, check_int4_partial_fallback, check_slices,
                         check_stream_out, check_streams, check_within, int_ref, inputs, run_kernel)

EMU_CASES = [(1, 16, 64), (2, 48, 2048), (7, 100, 200), (16, 112, 128), (33, 48, 256),
             (35, 100, 200)]


@pytest.mark.parametrize("op", ["gemv", "gemm"])
@pytest.mark.parametrize("scheme,g", [("int8", 0), ("int4", 32), ("int4", 64), ("int4", 128),
                                      ("bf16", 0)])
@pytest.mark.parametrize("m,n,d", EMU_CASES)
def test_emulated_kernels_match_reference(EK, op, scheme, g, m, n, d):
    scheme = QuantScheme.parse(scheme)
    x, w = inputs(m, n, d, seed=m + n + d + g)
    p = pack(w, scheme, g or 64)
    out = run_kernel(EK, scheme, op, x, p)
    assert not EK.unit.configured, "kernel returned without tilerelease"
    what = f"emulated {op} {scheme.value} G={g} M={m} N={n} D={d}"
    if scheme is not QuantScheme.BF16:
        groups = p.d_pad // g if g else 0
        want, bound = int_ref(x, ref.quantize(w, scheme, g or 64), groups)
        check_within(want, out[:, :n], bound, what)
    else:
        xr, wr = ref.bf16_round(x), ref.dequantize(ref.quantize(w, "bf16"))
        want = ref.linear(xr, wr)
        bound = d * U * (np.abs(xr).astype(np.float64) @ np.abs(wr).astype(np.float64).T)
        check_within(want, out[:, :n], bound, what)
    assert_exact(np.zeros((m, p.n_pad - n), np.float32), out[:, n:], what="padding rows")


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


def test_emulated_int4_fallback(EK):
    check_int4_fallback(EK)
    check_int4_partial_fallback(EK)


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_emulated_blocked_gemm_slices(EK, scheme):
    check_slices(EK, scheme, pf=2)


def test_gemm_int8_streams_only_large_outputs_on_lines(EK):
    """gemm_int8 stores its output with non-temporal stores exactly when it exceeds 1 MiB and its
    rows start on lines (the model asserts every streamed row is on a line), fences once, and
    gives the shared-output kernel's result bit for bit (which never streams)."""
    EK.unit.fences = 0
    check_streams(EK, lambda: EK.unit.streamed)
    assert EK.unit.fences == 1


def test_down_stream_out_kernels_emulated(EK):
    check_stream_out(EK, lambda: (EK.unit.streamed, EK.unit.fences))


def test_ratio_row16_accepts_only_exact_integer_ratios():
    """The 16-lane ratio check (plain AVX-512 code, runs on any host): exact multiples r * s_row
    with r in [0, 18] pass and give r per column as int8; anything else (a scale off by an
    ulp, r > 18, negative, Inf, NaN) fails, without undefined float-to-int conversions."""
    from numba import njit

    from kt.cpu_ops.kernels.amx._intrinsics import ratio_row16

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

    from kt.cpu_ops.kernels.amx._intrinsics import unpack_int4_group_mul, unpack_int4_line_mul

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
