"""NUMA sharding at load: the split arithmetic, and shards that equal the packed sub-matrices.

This machine has one NUMA node, so the multi-node path runs on an injected fake topology
(node k = CPU k); pinning is checked by recording the affinity calls of the building threads.
"""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from kt.testing.checkpoints import small_checkpoint

from kt import reference as ref
from kt.cpu_ops.packing import pack_quantized, unpack
from kt.weights import NumaTopology, convert, load_experts, shard_ranges
from kt.weights import _loader


def test_shard_ranges():
    assert shard_ranges(768, [8, 8], 64) == [(0, 384), (384, 768)]
    assert shard_ranges(768, [1, 1, 1, 1], 64) == [(0, 192), (192, 384), (384, 576), (576, 768)]
    assert shard_ranges(768, [3, 1], 64) == [(0, 576), (576, 768)]
    assert shard_ranges(100, [1, 1], 64) == [(0, 64), (64, 100)]
    assert shard_ranges(32, [1, 1], 64) == [(0, 0), (0, 32)]
    assert shard_ranges(2048, [1, 1, 1], 128) == [(0, 640), (640, 1408), (1408, 2048)]
    for inter, w, a in [(1408, [5, 7, 3], 64), (136, [1, 1], 64), (2048, [1] * 8, 128)]:
        r = shard_ranges(inter, w, a)
        assert r[0][0] == 0 and r[-1][1] == inter
        assert all(x[1] == y[0] for x, y in zip(r, r[1:]))
        assert all(b % a == 0 for b, _ in r[1:] if b < inter)
    with pytest.raises(ValueError, match="positive weights"):
        shard_ranges(64, [1, 0], 64)


def test_detect_topology_is_sane():
    topo = NumaTopology.detect()
    cpus = [c for node in topo.nodes for c in node]
    assert topo.nodes and len(cpus) == len(set(cpus))
    assert set(cpus) <= set(os.sched_getaffinity(0))


@pytest.fixture(scope="module", params=[128, 136])
def src(request, tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp(f"numa{request.param}"), 1, 2, 64, request.param)


@pytest.mark.parametrize("scheme,g", [("int8", 64), ("int4", 64), ("bf16", 64)])
def test_two_node_shards(src, tmp_path, monkeypatch, scheme, g):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"needs 2 usable CPUs to pin two fake nodes, have {cpus}")
    out = tmp_path / "o"
    convert(src[0], out, scheme, g, progress=False)
    calls = []
    real = os.sched_setaffinity

    def record(pid, mask):
        calls.append((threading.get_ident(), tuple(mask)))
        return real(pid, mask)

    monkeypatch.setattr(_loader.os, "sched_setaffinity", record)
    class FakePool:  # kt.cpu_ops.CpuPool exposes {node id: CPUs} as .nodes
        nodes = {3: [cpus[0]], 5: [cpus[1]]}

    le = load_experts(out, 0, pool=FakePool())
    assert [s.node for s in le.shards] == [3, 5]
    single = load_experts(out, 0, topology=NumaTopology((tuple(cpus),)))
    assert single.shards == () and isinstance(single.w13.data.base, np.memmap)
    I = le.I
    assert [(s.i0, s.i1) for s in le.shards] == shard_ranges(I, [1, 1], 64)
    assert sorted(c[1] for c in calls) == [(cpus[0],), (cpus[1],)]
    assert calls[0][0] != threading.get_ident(), "shards must be built by the pinned threads"
    for s in le.shards:
        assert not isinstance(s.w13.data.base, np.memmap) and s.w13.data.flags.c_contiguous
        for e in range(le.E):
            full13 = unpack(le.w13.expert(e))
            rows = np.r_[s.i0:s.i1, I + s.i0:I + s.i1]
            sc13 = None if full13.scale is None else full13.scale[rows]
            want13 = pack_quantized(ref.QuantizedWeight(full13.scheme, full13.q[rows], sc13,
                                                        full13.group_size), g)
            full2 = unpack(le.w2.expert(e))
            if full2.scheme.value == "int4":
                sc2 = full2.scale[:, s.i0 // g: -(-s.i1 // g)]
            else:
                sc2 = full2.scale
            want2 = pack_quantized(ref.QuantizedWeight(full2.scheme, full2.q[:, s.i0:s.i1], sc2,
                                                       full2.group_size), g)
            for got, want in ((s.w13.expert(e), want13), (s.w2.expert(e), want2)):
                assert (got.n, got.d, got.n_pad, got.d_pad) == (want.n, want.d, want.n_pad, want.d_pad)
                for k in ("data", "scale", "wsum"):
                    np.testing.assert_array_equal(getattr(got, k), getattr(want, k), err_msg=k)
