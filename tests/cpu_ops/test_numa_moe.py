"""NumaMoE: a layer split across NUMA nodes by intermediate rows, on a stand-in topology.

The machines here have one NUMA node, so the tests give ``nodes`` explicitly ({0: [cpu a],
1: [cpu b]}): the arithmetic, the weight split, the per-node pools and the API are what is
checked; where the memory of each slice lands is Linux's first-touch policy (not observable here).
The shards come from the weight loader's split (``kt.weights.numa_split``); a kt weight directory
loaded split is tested with the loader (tests/weights/test_cpu_moe.py).
"""
import os

import numpy as np
import pytest
import torch

from kt import reference as ref
from kt.cpu_ops.moe import CPUMoE
from kt.cpu_ops.numa import NumaMoE
from kt.cpu_ops.packing import unpack
from kt.cpu_ops.tuning import MoETuning
from kt.testing import random_expert_weights
from kt.weights import numa_split

CPUS = sorted(os.sched_getaffinity(0))
TWO = {0: [CPUS[0]], 1: [CPUS[-1]]} if len(CPUS) >= 2 else None
needs_two = pytest.mark.skipif(TWO is None, reason="needs two CPUs for a stand-in topology")
E, H, I, K = 8, 256, 200, 3


def _inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    ids[rng.random(ids.shape) < 0.1] = -1
    return x, ids, rng.random((T, K), dtype=np.float32)


@pytest.fixture(scope="module")
def weights():
    return random_expert_weights(E, H, I, seed=4)


@needs_two
@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
def test_sharded_layer_is_the_sum_of_its_slices(weights, scheme):
    """Each node's slice computed exactly as the reference computes that slice, summed; the
    slices hold exactly the unsharded quantised weights; BF16 equals the unsharded layer."""
    g, u, d = weights
    m = CPUMoE.from_tensors(g, u, d, scheme=scheme)
    nm = numa_split(m, nodes=TWO)
    try:
        assert [s.pool.num_threads for s in nm.shards] == [1, 1]
        for s, cpus in zip(nm.shards, TWO.values()):
            assert all(pl.cpus and set(pl.cpus) <= set(cpus) for pl in s.pool.placements)
        # the weights: the slices put back together are the unsharded layer's
        for e in range(E):
            full13, full2 = unpack(m.w13.expert(e)), unpack(m.w2.expert(e))
            parts13 = [unpack(s.w13.expert(e)) for s in nm.shards]
            parts2 = [unpack(s.w2.expert(e)) for s in nm.shards]
            gate = np.concatenate([p.q[: p.q.shape[0] // 2] for p in parts13])
            up = np.concatenate([p.q[p.q.shape[0] // 2:] for p in parts13])
            assert np.array_equal(np.concatenate([gate, up]), full13.q)
            assert np.array_equal(np.concatenate([p.q for p in parts2], axis=1), full2.q)
        for T in (1, 7, 40):
            x, ids, w = _inputs(T, seed=T)
            y = nm(x, ids, w)
            want = sum(ref.moe_forward_quantized(
                x, ids, w, [unpack(s.w13.expert(e)) for e in range(E)],
                [unpack(s.w2.expert(e)) for e in range(E)]).astype(np.float64) for s in nm.shards)
            assert ref.relative_error(y, want) < 1e-4, (scheme, T)
            if scheme == "bf16":  # no activation quantisation: the split changes nothing
                assert ref.relative_error(y, m(x, ids, w)) < 1e-5
    finally:
        nm.shutdown()


@needs_two
def test_sharded_accuracy_io_and_masks(weights):
    g, u, d = weights
    nm = numa_split(CPUMoE.from_tensors(g, u, d, scheme="int8"), nodes=TWO)
    try:
        x, ids, w = _inputs(64, seed=9)
        exact = ref.moe_forward(x, ids, w, np.concatenate([g, u], 1), d)
        # per-node activation scales: at least as accurate as the unsharded layer's bound
        assert ref.relative_error(nm(x, ids, w), exact) < 0.03
        # torch in -> torch out in x's dtype
        yt = nm(torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(ids), torch.from_numpy(w))
        assert yt.dtype == torch.bfloat16 and tuple(yt.shape) == (64, H)
        # a GPU mask, and incremental accumulation into out = the whole layer
        mask = np.zeros(E, bool)
        mask[[1, 5]] = True
        part = nm(x, ids, w, gpu_mask=mask)
        rest = nm(x, ids, w, gpu_mask=~mask)
        whole = nm(x, ids, w)
        acc = part.copy()
        assert nm(x, ids, w, gpu_mask=~mask, out=acc, incremental=True) is acc
        np.testing.assert_allclose(acc, whole, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(part + rest, whole, rtol=1e-5, atol=1e-6)
        h = nm.submit(x, ids, w)
        np.testing.assert_allclose(h.wait(), whole, rtol=0, atol=0)
        assert h.done()
    finally:
        nm.shutdown()


def test_one_node_is_the_plain_layer(weights):
    g, u, d = weights
    m = CPUMoE.from_tensors(g, u, d, scheme="int8")
    nm = numa_split(m, nodes={0: CPUS})
    try:
        x, ids, w = _inputs(16, seed=2)
        assert np.array_equal(nm(x, ids, w), m(x, ids, w))
    finally:
        nm.shutdown()


def test_bad_topologies(weights):
    g, u, d = weights
    m = CPUMoE.from_tensors(g, u, d, scheme="bf16")
    with pytest.raises(TypeError, match="CPUMoE"):
        numa_split("layer")
    with pytest.raises(ValueError, match="nodes must be"):
        numa_split(m, nodes={})
    with pytest.raises(ValueError, match="affinity"):
        numa_split(m, nodes={0: [max(CPUS) + 1000]})
    with pytest.raises(ValueError, match="threads_per_node"):
        numa_split(m, nodes={0: CPUS}, threads_per_node=0)
    # more nodes than 64-wide slices of I=200: the nodes whose share rounds to nothing get none
    nm = numa_split(m, nodes={i: [CPUS[0]] for i in range(5)})
    try:
        assert 1 < len(nm.shards) <= 4 and nm.slices[0][0] == 0 and nm.slices[-1][1] == I
        x, ids, w = _inputs(5, seed=1)
        assert ref.relative_error(nm(x, ids, w), m(x, ids, w)) < 1e-5
    finally:
        nm.shutdown()
    from kt.cpu_ops.runtime.pool import CpuPool

    with pytest.raises(ValueError, match="subset"):
        CpuPool(1, cpus=[max(CPUS) + 1000])


@needs_two
def test_shards_carry_the_layers_options_and_calls_take_a_tuning(weights):
    """The split layer's nodes get the layer's tuning, limits and activation mode; a call's
    tuning reaches every node (split tasks reorder the same arithmetic: the same bits)."""
    g, u, d = weights
    tun = MoETuning(chunk_tokens=8)
    m = CPUMoE.from_tensors(g, u, d, scheme="int8", tuning=tun, max_tokens=64, activations="int8x2")
    nm = numa_split(m, nodes=TWO)
    try:
        assert all(s.tuning is tun and s.max_tokens == 64 and s.activations == "int8x2"
                   for s in nm.shards)
        assert isinstance(nm, NumaMoE) and nm.slices == [(0, 128), (128, 200)]
        x, ids, w = _inputs(20, seed=5)
        want = nm(x, ids, w)
        assert np.array_equal(nm(x, ids, w, tuning=tun.replace(blocks_per_task=(4, 4))), want)
        with pytest.raises(TypeError, match="tuning must be a MoETuning"):
            nm(x, ids, w, tuning=4)
    finally:
        nm.shutdown()
