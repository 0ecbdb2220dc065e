"""kernels/actquant.py: the kernels' activation operands equal kt.reference bit for bit (zero padding included)."""
import numpy as np
import pytest

from kt import reference as ref
from kt.cpu_ops.kernels.actquant import bf16_rows, group_sums, quantize_rows


def _rows(seed, m, d):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d), dtype=np.float32) * rng.uniform(0.01, 100, (m, 1)).astype(np.float32)
    if m >= 4:
        x[1] = 0.0                       # all-zero row: xs = 0, xq = 0
        x[2, : d // 2] = 0.5             # ties at 127 * 0.5 / amax exercise round-half-even
        x[3, 0] = -np.abs(x[3]).max() * 2  # the amax element is negative
    return x


@pytest.mark.parametrize("m,d,d_pad", [(1, 64, 64), (5, 200, 256), (9, 2048, 2048), (4, 1, 64)])
def test_quantize_rows_matches_reference(m, d, d_pad):
    x = _rows(m * 1000 + d, m, d)
    xq = np.full((m, d_pad), 77, np.int8)   # garbage: padding must be overwritten with zeros
    xs = np.full(m, -1.0, np.float32)
    quantize_rows(x, xq, xs)
    rq, rs = ref.quantize_act(x)
    np.testing.assert_array_equal(xq[:, :d], rq)
    np.testing.assert_array_equal(xq[:, d:], 0)
    np.testing.assert_array_equal(xs, rs)


def test_quantize_rows_half_even_ties_and_nonfinite():
    # amax = 127 makes inv = 1 exactly, so x = k + 0.5 is a tie: rint rounds to even.
    x = np.array([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0],
                  [1.0, np.nan, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                  [np.inf, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    xq = np.zeros((3, 64), np.int8)
    xs = np.zeros(3, np.float32)
    quantize_rows(x, xq, xs)
    with np.errstate(invalid="ignore"):
        rq, rs = ref.quantize_act(x)
    np.testing.assert_array_equal(xq[0, :8], [127, 0, 2, 2, 0, -2, -2, 3])
    np.testing.assert_array_equal(xq[:, :8], rq)
    np.testing.assert_array_equal(xs, rs)  # NaN row: NaN scale, as the reference


@pytest.mark.parametrize("m,d,d_pad", [(1, 64, 64), (6, 200, 256), (3, 2048, 2048)])
def test_bf16_rows_matches_reference(m, d, d_pad):
    x = _rows(m + d, m, d)
    x[0, :4] = [np.nan, np.inf, -np.inf, 1.0 + 2.0 ** -8]  # NaN, Inf, an exact tie
    xb = np.full((m, d_pad), 0xABCD, np.uint16)
    bf16_rows(x, xb)
    np.testing.assert_array_equal(xb[:, :d], ref.f32_to_bf16_bits(x))
    np.testing.assert_array_equal(xb[:, d:], 0)


@pytest.mark.parametrize("m,d_pad,g", [(1, 64, 64), (7, 256, 32), (33, 2048, 64), (5, 384, 128)])
def test_group_sums_exact(m, d_pad, g):
    """8 * the int sum of each group of G activations (the INT4 kernels' nibble-offset term):
    exact against numpy, extreme rows included, on a row-strided view as the driver passes."""
    rng = np.random.default_rng(m + d_pad + g)
    wide = rng.integers(-127, 128, (m, d_pad + 64)).astype(np.int8)
    wide[0, :d_pad] = -127
    if m > 1:
        wide[1, :d_pad] = 127
    xq = wide[:, :d_pad]
    want = 8 * xq.astype(np.int64).reshape(m, d_pad // g, g).sum(axis=2)
    got = group_sums(xq, g, d_pad)
    assert got.dtype == np.int32 and np.array_equal(got, want)
