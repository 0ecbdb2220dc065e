"""kt.weights.load_cpu_moe / numa_split: kt weight-format layers as CPUMoE and NumaMoE layers.

The machines here have one NUMA node: the split is tested on a stand-in two-node map ({0: [cpu a],
1: [cpu b]}); where each slice's pages land is Linux's first-touch policy (not observable here).
"""
import os

import numpy as np
import pytest

from kt import reference as ref
from kt.cpu_ops import CPUMoE, MoETuning, NumaMoE
from kt.cpu_ops.runtime.pool import CpuPool
from kt.testing.checkpoints import small_checkpoint
from kt.weights import convert, load_cpu_moe, load_experts, numa_split

CPUS = sorted(os.sched_getaffinity(0))
TWO = {0: [CPUS[0]], 1: [CPUS[-1]]} if len(CPUS) >= 2 else None
E, H, I, K = 8, 256, 256, 3


_REFS = {}  # the checkpoint's fp32 weights {layer: (w13, w2)}, once kt_dir has made it


@pytest.fixture(scope="module")
def kt_dir(tmp_path_factory):
    """A two-layer INT8 kt weight directory converted from a small bf16 checkpoint."""
    tmp = tmp_path_factory.mktemp("cpu_moe")
    src, refs = small_checkpoint(tmp, n_layers=2, n_e=E, hidden=H, inter=I)
    out = tmp / "kt"
    convert(src, out, "int8", 64, progress=False, threads=2)
    _REFS.update(refs)
    return out


def _inputs(T, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
    return x, ids, rng.random((T, K), dtype=np.float32)


def test_a_layer_as_a_cpu_moe(kt_dir):
    """The loader's packed stacks, unchanged and unsharded, on the given pool with the given
    options; a physical-to-logical map permutes the experts."""
    with CpuPool(2) as pool:
        tun = MoETuning(chunk_tokens=4)
        m = load_cpu_moe(kt_dir, 1, pool=pool, tuning=tun, max_tokens=32)
        assert isinstance(m, CPUMoE) and m.pool is pool and m.tuning is tun and m.max_tokens == 32
        lw = load_experts(kt_dir, 1)
        assert np.array_equal(m.w13.data, lw.w13.data) and np.array_equal(m.w2.scale, lw.w2.scale)
        x, ids, w = _inputs(9, seed=1)
        assert np.array_equal(m(x, ids, w), CPUMoE(lw.w13, lw.w2, pool=pool)(x, ids, w))
        perm = np.roll(np.arange(E), 3)
        p = load_cpu_moe(kt_dir, 1, pool=pool, physical_to_logical_map=perm)
        assert np.array_equal(p.w13.data[0], m.w13.data[perm[0]])
        # physical slot s holds logical expert perm[s]: route to the slots that hold the same experts
        slot_of = np.argsort(perm)
        assert np.array_equal(p(x, slot_of[ids], w), m(x, ids, w))


@pytest.mark.skipif(TWO is None, reason="needs two CPUs for a stand-in two-node topology")
def test_a_layer_split_across_nodes(kt_dir):
    """numa=True / nodes=: the loader builds the node shards (pinned first touch); the layer
    equals the same directory's unsharded layer split by numa_split, and sums its slices."""
    a = load_cpu_moe(kt_dir, 0, nodes=TWO, tuning=MoETuning(chunk_tokens=8))
    b = numa_split(load_cpu_moe(kt_dir, 0), nodes=TWO)
    try:
        assert isinstance(a, NumaMoE) and a.slices == b.slices == [(0, 128), (128, 256)]
        assert all(s.tuning.chunk_tokens == 8 for s in a.shards)
        x, ids, w = _inputs(9, seed=3)
        assert np.array_equal(a(x, ids, w), b(x, ids, w))
        # per-node activation scales: at least as accurate as the unsharded layer's INT8 bound
        w13, w2 = _REFS[0]
        exact = ref.moe_forward(x, ids, w, w13, w2)
        assert ref.relative_error(a(x, ids, w), exact) < 0.03
        assert ref.relative_error(load_cpu_moe(kt_dir, 0)(x, ids, w), exact) < 0.03
    finally:
        a.shutdown()
        b.shutdown()


def test_bad_requests(kt_dir):
    with CpuPool(1) as pool:
        with pytest.raises(ValueError, match="pools of its own"):
            load_cpu_moe(kt_dir, 0, pool=pool, numa=True)
    with pytest.raises(ValueError, match="nodes must be"):
        load_cpu_moe(kt_dir, 0, nodes={})
    with pytest.raises(ValueError, match="affinity"):
        load_cpu_moe(kt_dir, 0, nodes={0: [max(CPUS) + 1000]})
    with pytest.raises(ValueError, match="threads_per_node"):
        load_cpu_moe(kt_dir, 0, numa=True, threads_per_node=0)
    with pytest.raises(TypeError, match="moe must be a CPUMoE"):
        numa_split("layer")
    from kt.weights import WeightFormatError

    with pytest.raises(WeightFormatError, match="layer 7"):
        load_cpu_moe(kt_dir, 7)
