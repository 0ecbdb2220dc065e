"""Layout round trips, apart from any arithmetic: unpack(pack(w)) == quantize(w)."""
import numpy as np
import pytest

from kt import reference as ref
from kt.cpu_ops.packing import pack, pack_experts, padded_dims, unpack


@pytest.mark.parametrize("scheme,g", [("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128),
                                      ("bf16", 64)])
@pytest.mark.parametrize("n,d", [(16, 64), (37, 200), (100, 768), (48, 2048)])
def test_roundtrip(scheme, g, n, d):
    rng = np.random.default_rng(n * d)
    w = rng.standard_normal((n, d)).astype(np.float32)
    q = ref.quantize(w, scheme, g)
    p = pack(w, scheme, g)
    u = unpack(p)
    assert np.array_equal(u.q, q.q)
    if q.scale is not None:
        assert np.array_equal(u.scale, q.scale)
    assert p.n_pad % 16 == 0 and p.d_pad % 64 == 0 and p.data.flags.c_contiguous


def test_layout_positions():
    # data[b, j, r, i] = q[16b + r, 4j + i] for int8
    w = np.arange(32 * 64, dtype=np.float32).reshape(32, 64) - 1000
    q = ref.quantize(w, "int8")
    p = pack(w, "int8")
    assert p.data[1, 3, 5, 2] == q.q[16 + 5, 4 * 3 + 2]
    assert p.wsum[7] == q.q[7].astype(np.int32).sum()
    # int4: low nibble k4-row 2j, high nibble k4-row 2j+1
    p4 = pack(w, "int4", 32)
    q4 = ref.quantize(w, "int4", 32)
    byte = int(p4.data[1, 2, 5, 3])
    assert (byte & 15) - 8 == q4.q[21, 8 * 2 + 3] and (byte >> 4) - 8 == q4.q[21, 8 * 2 + 4 + 3]
    assert p4.scale[1, 1, 5] == q4.scale[21, 1]


def test_padding_holds_zero():
    p = pack(np.ones((17, 70), np.float32), "int4", 64)
    lo, hi = p.data & 15, p.data >> 4
    assert p.n_pad == 32 and p.d_pad == 128
    assert (lo[1, :, 1:] == 8).all() and (hi[1, :, 1:] == 8).all()  # rows 17..31 are q = 0


def test_pack_experts_and_errors():
    w = np.random.default_rng(0).standard_normal((3, 20, 64)).astype(np.float32)
    p = pack_experts(w, "int8")
    assert p.data.shape[0] == 3
    assert np.array_equal(unpack(p.expert(2)).q, ref.quantize(w[2], "int8").q)
    with pytest.raises(ValueError, match="group_size"):
        padded_dims(16, 64, ref.QuantScheme.INT4, 48)
    with pytest.raises(ValueError, match=r"\[E, N, D\]"):
        pack_experts(w[0], "int8")
