"""MoETuning: one frozen config of a CPUMoE's tuning knobs, given at construction and per call."""
import dataclasses

import numpy as np
import pytest

from kt.cpu_ops.moe import CPUMoE
from kt.cpu_ops.tuning import DEFAULT_WATCHDOG_S, MoETuning

from _moe_cases import check_tight, layer, routing
from _moe_doubles import DOUBLES

KNOBS = ("chunk_tokens", "blocks_per_task", "pipelined_decode", "tail_experts", "tail_parts",
         "watchdog_s", "y_stream_bytes", "gemv_max")


def test_defaults_and_normalised_values():
    t = MoETuning()
    assert (t.chunk_tokens, t.blocks_per_task, t.pipelined_decode, t.tail_experts, t.tail_parts,
            t.watchdog_s, t.y_stream_bytes, t.gemv_max) == (2048, (0, 0), True, None, 4,
                                                            DEFAULT_WATCHDOG_S, 64 << 20, None)
    assert [f.name for f in dataclasses.fields(MoETuning)] == list(KNOBS)
    n = MoETuning(chunk_tokens=np.int64(16), blocks_per_task=[np.int32(4), 8], tail_experts=np.int64(3),
                  watchdog_s=np.float32(600), pipelined_decode=np.bool_(False))
    assert n.chunk_tokens == 16 and type(n.chunk_tokens) is int
    assert n.blocks_per_task == (4, 8) and all(type(b) is int for b in n.blocks_per_task)
    assert n.tail_experts == 3 and type(n.tail_experts) is int
    assert n.watchdog_s == 600.0 and type(n.watchdog_s) is float
    assert n.pipelined_decode is False
    assert MoETuning(watchdog_s=0).watchdog_s is None and MoETuning(watchdog_s=None).watchdog_s is None
    assert n == MoETuning(chunk_tokens=16, blocks_per_task=(4, 8), tail_experts=3,
                          pipelined_decode=False) and hash(n) == hash(n.replace())
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.chunk_tokens = 4


@pytest.mark.parametrize("field,bad", [
    ("chunk_tokens", 0), ("chunk_tokens", 2.0), ("chunk_tokens", True), ("chunk_tokens", None),
    ("blocks_per_task", (1,)), ("blocks_per_task", 4), ("blocks_per_task", (-1, 2)), ("blocks_per_task", (1.5, 2)),
    ("pipelined_decode", 1), ("pipelined_decode", "yes"),
    ("tail_experts", -1), ("tail_experts", 2.0), ("tail_parts", "4"), ("tail_parts", True), ("tail_parts", None),
    ("watchdog_s", -1), ("watchdog_s", "10"), ("watchdog_s", True), ("watchdog_s", float("nan")),
    ("watchdog_s", float("inf")),
    ("y_stream_bytes", -1), ("y_stream_bytes", 1.0), ("gemv_max", -2), ("gemv_max", 1.5),
])
def test_bad_values_name_the_knob(field, bad):
    with pytest.raises(ValueError, match=f"MoETuning.{field} must be"):
        MoETuning(**{field: bad})
    with pytest.raises(ValueError, match=f"MoETuning.{field} must be"):
        MoETuning().replace(**{field: bad})


def test_the_layer_holds_no_mutable_knobs(pool):
    m = layer("int8", "double", pool=pool)[0]
    assert m.tuning == MoETuning()
    for name in KNOBS:
        assert not hasattr(m, name), name
    with pytest.raises(AttributeError):
        m.tuning = MoETuning(chunk_tokens=4)
    t = MoETuning(chunk_tokens=4)
    assert CPUMoE(m.w13, m.w2, pool=pool, kernels=DOUBLES["int8"], tuning=t).tuning is t


def test_a_call_override_is_the_layer_built_with_it(pool):
    """A call's tuning gives the bits of a layer constructed with that tuning, and leaves the
    layer's own tuning (and its later calls) alone; knobs that only reorder the arithmetic give
    the default's bits too."""
    base = layer("int8", "double", pool=pool)[0]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, base.hidden), dtype=np.float32)
    ids, w = routing(rng, 40, base.num_experts, 3)
    want = base(x, ids, w)
    for tun in (MoETuning(chunk_tokens=3), MoETuning(blocks_per_task=(4, 4)),
                MoETuning(pipelined_decode=False, blocks_per_task=(2, 2)),
                MoETuning(tail_experts=2, tail_parts=2), MoETuning(gemv_max=0),
                MoETuning(watchdog_s=None, y_stream_bytes=0)):
        built = CPUMoE(base.w13, base.w2, pool=pool, kernels=DOUBLES["int8"], tuning=tun)
        got = base(x, ids, w, tuning=tun)
        assert np.array_equal(got, built(x, ids, w)), tun
        assert np.array_equal(got, base.submit(x, ids, w, tuning=tun).wait()), tun
        check_tight(base, x, ids, w, got, what=str(tun))
        if tun.chunk_tokens == MoETuning().chunk_tokens:  # (the doubles run one kernel for both ops)
            assert np.array_equal(got, want), tun
        assert base.tuning == MoETuning()
    assert np.array_equal(base(x, ids, w), want)


def test_chunk_tokens_bounds_a_gated_job(pool):
    m = layer("int8", "double", pool=pool, tuning=MoETuning(chunk_tokens=1))[0]
    assert m.max_gated_tokens == 24
    x = np.zeros((30, m.hidden), np.float32)
    ids = np.zeros((30, 2), np.int64)
    w = np.ones((30, 2), np.float32)
    flags = np.zeros(2, np.int32)
    with pytest.raises(ValueError, match=r"T=30 must be in \[1, 24\]"):
        m.submit_gated(x, ids, w, np.zeros_like(x), flags.ctypes.data, flags.ctypes.data + 4)
    h = m.submit_gated(x, ids, w, np.zeros_like(x), flags.ctypes.data, flags.ctypes.data + 4,
                       tuning=MoETuning(chunk_tokens=2))
    h.abort()  # (its start flag never comes)
    assert not h.wait().finished
