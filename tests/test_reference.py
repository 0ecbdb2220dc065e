"""The reference is the spec; these pin its conventions (rounding, zero rows, groups)."""
import numpy as np
import pytest

from kt import QuantScheme, reference as ref


def test_bf16_rounding_is_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, np.inf, np.nan], np.float32)
    r = ref.bf16_round(x)
    assert r[0] == 1.0 and r[1] == 1.0 and r[2] == 1.0 + 4 * 2**-8 and r[3] == -2.5
    assert np.isinf(r[4]) and np.isnan(r[5])


@pytest.mark.parametrize("scheme,g,bound", [("int8", 64, 0.5 / 127), ("int4", 32, 0.5 / 7),
                                            ("int4", 128, 0.5 / 7), ("bf16", 64, 2**-8)])
def test_quantize_error_bound(scheme, g, bound):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((37, 200)).astype(np.float32)
    qw = ref.quantize(w, scheme, g)
    err = np.abs(ref.dequantize(qw) - w)
    if scheme == "bf16":
        assert (err <= bound * np.abs(w) + 1e-30).all()
    elif scheme == "int8":
        assert (err <= bound * np.abs(w).max(axis=1, keepdims=True) * 1.0001).all()
    else:
        # INT4 scales are s_row * r (int4_ratio_scales): half a step, or what clipping at 7 steps
        # leaves of the group's largest value when r was rounded down
        ng = -(-200 // g)
        wp = np.zeros((37, ng * g), np.float32)
        wp[:, :200] = w
        amax = np.abs(wp.reshape(37, ng, g)).max(axis=2)
        lim = np.maximum(0.5 * qw.scale, amax - 7 * qw.scale)
        assert (err <= np.repeat(lim, g, axis=1)[:, :200] * 1.0001).all()
        assert (lim <= bound * amax * 1.9).all()  # never far from the plain amax / 7 rule's
        assert qw.scale.shape == (37, ng)


def test_int4_scales_are_integer_ratios_of_a_row_scale():
    """INT4 group scales are s_row * r_g with r_g an integer in [1, 18] and s_row = max scale / 18
    exactly (what lets the AMX prefill kernel skip the per-group flush), at a weight error within
    1 % of the plain amax / 7 scales on Gaussian weights."""
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((300, 2048)) / 45).astype(np.float32)
    w[7] = 0.0
    w[9, :64] = 0.0
    qw = ref.quantize(w, "int4", 64)
    srow = (qw.scale.max(axis=1) / np.float32(ref.INT4_RATIO_MAX)).astype(np.float32)
    r = qw.scale / np.where(srow > 0, srow, 1)[:, None]
    assert (r == np.rint(r)).all() and r.max() == ref.INT4_RATIO_MAX
    assert (r[qw.scale > 0] >= 1).all() and (qw.scale[7] == 0).all() and qw.scale[9, 0] == 0
    assert (srow[:, None] * r.astype(np.float32) == qw.scale).all()
    plain = np.abs(w.reshape(300, 32, 64)).max(axis=2) / np.float32(7)
    qp = np.clip(np.rint(w.reshape(300, 32, 64) / np.where(plain > 0, plain, 1)[:, :, None]), -7, 7)
    e_plain = np.linalg.norm(qp * plain[:, :, None] - w.reshape(300, 32, 64))
    e_ratio = np.linalg.norm(ref.dequantize(qw) - w)
    assert e_ratio <= 1.01 * e_plain, (e_ratio, e_plain)


def test_zero_rows_and_ranges():
    w = np.zeros((3, 64), np.float32)
    w[1] = 1.0
    for s in ("int8", "int4"):
        qw = ref.quantize(w, s)
        assert (qw.q[0] == 0).all() and (ref.dequantize(qw)[0] == 0).all()
        assert np.allclose(ref.dequantize(qw)[1], 1.0)
    assert ref.quantize(np.full((1, 8), -3.0), "int8").q.min() == -127
    assert ref.quantize(np.full((1, 64), -3.0), "int4").q.min() == -7
    with pytest.raises(ValueError, match="NaN"):
        ref.quantize(np.full((2, 4), np.nan), "int8")
    with pytest.raises(ValueError, match="group_size"):
        ref.quantize(w, "int4", 48)


def test_quantize_act_matches_definition():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 33)).astype(np.float32)
    x[3] = 0
    xq, xs = ref.quantize_act(x)
    assert xs[3] == 0 and (xq[3] == 0).all()
    inv = np.float32(127) / np.abs(x[0]).max()
    assert np.array_equal(xq[0], np.rint(x[0] * inv).astype(np.int8))
    assert np.abs(xq).max() == 127


def test_moe_forward_matches_a_direct_loop():
    rng = np.random.default_rng(3)
    T, E, K, H, I = 6, 4, 2, 16, 8
    x = rng.standard_normal((T, H)).astype(np.float32)
    w13 = rng.standard_normal((E, 2 * I, H)).astype(np.float32) / 4
    w2 = rng.standard_normal((E, H, I)).astype(np.float32) / 3
    ids = rng.integers(-1, E, (T, K))
    tw = rng.random((T, K)).astype(np.float32)
    out = ref.moe_forward(x, ids, tw, w13, w2)
    exp = np.zeros((T, H))
    for t in range(T):
        for k in range(K):
            e = ids[t, k]
            if e < 0:
                continue
            g, u = w13[e, :I] @ x[t], w13[e, I:] @ x[t]
            exp[t] += tw[t, k] * (w2[e] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(out, exp, rtol=1e-5, atol=1e-6)
    mask = np.array([True, False, False, True])
    out_m = ref.moe_forward(x, ids, tw, w13, w2, skip_mask=mask)
    q13 = [ref.quantize(w13[e], "bf16") for e in range(E)]
    q2 = [ref.quantize(w2[e], "bf16") for e in range(E)]
    assert ref.relative_error(ref.moe_forward_quantized(x, ids, tw, q13, q2, mask), out_m) < 0.01
    with pytest.raises(ValueError, match="expert ids"):
        ref.moe_forward(x, np.full((T, K), E), tw, w13, w2)


def test_scheme_parse():
    assert QuantScheme.parse("INT4") is QuantScheme.INT4
    with pytest.raises(ValueError, match="unknown quantisation scheme"):
        QuantScheme.parse("fp7")


def test_scheme_names_and_activation_modes():
    from kt.config import QuantScheme, check_activations, parse_scheme_name

    assert parse_scheme_name("int8") == (QuantScheme.INT8, "int8")
    assert parse_scheme_name("int4x2") == (QuantScheme.INT4, "int8x2")
    assert parse_scheme_name("bf16") == (QuantScheme.BF16, "int8")
    with pytest.raises(ValueError, match="int8 and int4 schemes"):
        parse_scheme_name("bf16x2")
    with pytest.raises(ValueError, match="unknown quantisation scheme"):
        parse_scheme_name("fp4")
    with pytest.raises(ValueError, match="must be one of"):
        check_activations("int16", QuantScheme.INT8)
