"""64-byte alignment of everything the kernels read in 64-byte rows (kt/cpu_ops/_align.py)."""
import numpy as np
import pytest
from numba import njit

from kt.cpu_ops import _align
from kt.cpu_ops.kernels._simd import empty_line, line_elems
from kt.cpu_ops.moe import CPUMoE
from kt.cpu_ops.packing import PackedWeight, aligned_packed, pack, pack_experts
from kt.cpu_ops.runtime.pool import CpuPool


def _off(a):
    return a.ctypes.data % 64


def _misaligned(a, off=32):
    """A copy of ``a`` that starts ``off`` bytes past a line (what numpy often hands out)."""
    buf = np.empty(a.nbytes + 128, np.uint8)
    o = -buf.ctypes.data % 64 + off
    b = buf[o:o + a.nbytes].view(a.dtype).reshape(a.shape)
    b[...] = a
    return b


@pytest.mark.parametrize("shape", [1, 7, (3, 5), (2, 16, 16, 4), 0])
@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.float32, np.int64])
def test_empty_and_zeros(shape, dtype):
    for f in (_align.empty, _align.zeros):
        a = f(shape, dtype)
        assert a.dtype == dtype and a.shape == ((shape,) if np.ndim(shape) == 0 else shape)
        assert a.flags.c_contiguous and (a.size == 0 or _off(a) == 0)
    assert not _align.zeros(shape, dtype).any()


def test_aligned_copies_only_when_needed():
    a = _align.zeros((4, 64), np.int8)
    assert _align.aligned(a) is a
    b = _misaligned(np.arange(256, dtype=np.int8).reshape(4, 64))
    c = _align.aligned(b)
    assert c is not b and _off(c) == 0 and np.array_equal(b, c)
    t = np.arange(12, dtype=np.float32).reshape(3, 4).T  # not C-contiguous
    u = _align.aligned(t)
    assert u.flags.c_contiguous and _off(u) == 0 and np.array_equal(t, u)


def test_empty_line_in_jitted_code():
    @njit
    def offsets(n):
        a = empty_line(n, np.int32)
        b = empty_line(n, np.int8)
        return a.ctypes.data % 64, b.ctypes.data % 64, a.shape[0], b.shape[0]

    for n in (1, 16, 1000, 1 << 18):
        assert offsets(n) == (0, 0, n, n)


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.float32, np.int64])
def test_line_elems_is_elements_per_line(dtype):
    """line_elems: 64 // itemsize, in Python and in compiled code (where it is a constant)."""
    @njit
    def jitted(a):
        return line_elems(a), line_elems(a[:1])

    a = np.zeros((3, 5), dtype)
    want = 64 // np.dtype(dtype).itemsize
    assert line_elems(a) == want
    assert jitted(a) == (want, want)


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_packed_weights_are_aligned(scheme):
    rng = np.random.default_rng(0)
    for p in (pack(rng.standard_normal((40, 200), dtype=np.float32), scheme),
              pack_experts(rng.standard_normal((3, 40, 200), dtype=np.float32), scheme)):
        for a in (p.data, p.scale, p.wsum):
            assert a.size == 0 or _off(a) == 0


def test_layer_copies_misaligned_weights_once():
    rng = np.random.default_rng(1)
    E, H, I = 4, 64, 32
    w13 = pack_experts(rng.standard_normal((E, 2 * I, H), dtype=np.float32), "int8")
    w2 = pack_experts(rng.standard_normal((E, H, I), dtype=np.float32), "int8")
    bad = PackedWeight(w13.scheme, w13.n, w13.d, w13.n_pad, w13.d_pad, w13.group_size,
                       _misaligned(w13.data), _misaligned(w13.scale, 16), w13.wsum)
    fixed = aligned_packed(bad)
    assert fixed is not bad and _off(fixed.data) == 0 and _off(fixed.scale) == 0
    assert fixed.wsum is w13.wsum and np.array_equal(fixed.data, w13.data)
    assert aligned_packed(w13) is w13
    pool = CpuPool(1)
    try:
        x = rng.standard_normal((5, H), dtype=np.float32)
        ids = rng.integers(0, E, (5, 2))
        tw = rng.random((5, 2), dtype=np.float32)
        a = CPUMoE(bad, w2, pool=pool)
        assert _off(a.w13.data) == 0 and a.w2 is not None
        np.testing.assert_array_equal(a(x, ids, tw), CPUMoE(w13, w2, pool=pool)(x, ids, tw))
    finally:
        pool.shutdown()
