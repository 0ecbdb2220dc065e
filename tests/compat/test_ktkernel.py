"""kt.KTMoEWrapper: kt-kernel's constructor and methods, on CPU tensors."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kt import reference as ref  # noqa: E402
from kt.cpu_ops.packing import unpack  # noqa: E402
from kt.testing import random_expert_weights  # noqa: E402
from kt.compat import KTMoEWrapper  # noqa: E402

E, K, H, I = 8, 2, 128, 64


def _weights():
    g, u, d = random_expert_weights(E, H, I, seed=3)
    return tuple(torch.from_numpy(a).to(torch.bfloat16) for a in (g, u, d))


def _qref(w, x, ids, tw, skip=None):
    m = w.moe
    q13 = [unpack(m.w13.expert(e)) for e in range(E)]
    q2 = [unpack(m.w2.expert(e)) for e in range(E)]
    return ref.moe_forward_quantized(x.float(), ids, tw, q13, q2, skip_mask=skip)


def _inputs(T, seed=0):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((T, H), dtype=np.float32)).to(torch.bfloat16)
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)])).long()
    tw = torch.from_numpy(rng.random((T, K), dtype=np.float32))
    return x, ids, tw


@pytest.mark.parametrize("method", ["AMXINT8", "AMXINT4", "BF16", "MOE_INT8"])
def test_forward_matches_reference(method):
    g, u, d = _weights()
    # positional arguments exactly as kt-kernel's signature orders them
    w = KTMoEWrapper(0, E, K, H, I, None, 2, 1, None, 512, method=method)
    w.load_weights_from_tensors(g, u, d, torch.arange(E))
    x, ids, tw = _inputs(5)
    out = w.forward(x, ids, tw)
    assert out.dtype == torch.bfloat16 and tuple(out.shape) == (5, H) and out.device.type == "cpu"
    r = _qref(w, x, ids, tw)
    assert ref.relative_error(out.float(), r) < 5e-3  # bf16 output rounding
    w.submit_forward(x, ids, tw)
    out2 = w.sync_forward(x)
    assert torch.equal(out, out2)


def test_gpu_experts_are_skipped_and_map_permutes():
    g, u, d = _weights()
    x, ids, tw = _inputs(6, seed=1)
    mask = torch.zeros(E, dtype=torch.bool)
    mask[[1, 4]] = True
    w = KTMoEWrapper(layer_idx=3, num_experts=E, num_experts_per_tok=K, hidden_size=H,
                     moe_intermediate_size=I, gpu_experts_mask=mask, cpuinfer_threads=2,
                     threadpool_count=1, weight_path=None, chunked_prefill_size=4,
                     method="AMXINT8")
    w.load_weights_from_tensors(g, u, d, None)
    out = w.forward(x, ids, tw)
    r = _qref(w, x, ids, tw, skip=mask.numpy())
    assert ref.relative_error(out.float(), r) < 5e-3
    # num_gpu_experts=N: experts [0, N) on the GPU
    w2 = KTMoEWrapper(3, E, K, H, I, cpuinfer_threads=2, method="AMXINT8", num_gpu_experts=3)
    assert w2.gpu_experts_mask.tolist() == [True] * 3 + [False] * (E - 3)
    # physical slot p holds logical expert p2l[p]
    p2l = torch.tensor([3, 0, 1, 2, 7, 6, 5, 4])
    w3 = KTMoEWrapper(0, E, K, H, I, cpuinfer_threads=2, method="BF16")
    w3.load_weights_from_tensors(g, u, d, p2l)
    w4 = KTMoEWrapper(0, E, K, H, I, cpuinfer_threads=2, method="BF16")
    w4.load_weights_from_tensors(g[p2l], u[p2l], d[p2l], None)
    assert torch.equal(w3.forward(x, ids, tw), w4.forward(x, ids, tw))


def test_errors():
    with pytest.raises(ValueError, match="supported:.*AMXINT4.*AMXINT8.*BF16"):
        KTMoEWrapper(0, E, K, H, I, method="FOO")
    with pytest.raises(ValueError, match="not supported by kt"):
        KTMoEWrapper(0, E, K, H, I, method="LLAMAFILE")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        KTMoEWrapper(0, E, E + 1, H, I)
    with pytest.raises(ValueError, match="gpu_experts_mask"):
        KTMoEWrapper(0, E, K, H, I, gpu_experts_mask=torch.zeros(E + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_gpu_experts"):
        KTMoEWrapper(0, E, K, H, I, num_gpu_experts=E + 1)
    with pytest.raises(ValueError, match="max_deferred_experts_per_token"):
        KTMoEWrapper(0, E, K, H, I, max_deferred_experts_per_token=K)
    w = KTMoEWrapper(0, E, K, H, I, cpuinfer_threads=2, method="AMXINT8")
    x, ids, tw = _inputs(2)
    with pytest.raises(RuntimeError, match="weights not loaded"):
        w.forward(x, ids, tw)
    with pytest.raises(ValueError, match="weight_path"):
        w.load_weights()
    g, u, d = _weights()
    with pytest.raises(ValueError, match="down_proj must be"):
        w.load_weights_from_tensors(g, u, d.transpose(1, 2), None)
    with pytest.raises(ValueError, match="physical_to_logical_map"):
        w.load_weights_from_tensors(g, u, d, torch.arange(E) + 1)
    w.load_weights_from_tensors(g, u, d, None)
    with pytest.raises(RuntimeError, match="sync_forward without"):
        w.sync_forward(x)
    with pytest.raises(ValueError, match="topk_ids must be in"):
        w.forward(x, ids + E, tw)


def test_load_weights_from_kt_format(tmp_path):
    from kt.testing.checkpoints import small_checkpoint

    from kt.weights import convert, load_cpu_moe

    src, refs = small_checkpoint(tmp_path, n_layers=2, n_e=E, hidden=H, inter=I)
    out = tmp_path / "kt"
    convert(src, out, "int8", 64, progress=False, threads=2)
    w = KTMoEWrapper(1, E, K, H, I, None, 2, 1, str(out), 512, method="AMXINT8")
    w.load_weights(torch.arange(E))
    w13, w2 = refs[1]
    t = KTMoEWrapper(1, E, K, H, I, None, 2, 1, None, 512, method="AMXINT8")
    t.load_weights_from_tensors(torch.from_numpy(w13[:, :I]), torch.from_numpy(w13[:, I:]),
                                torch.from_numpy(w2), None)
    x, ids, tw = _inputs(4, seed=9)
    # the converter quantises exactly as reference.quantize: same packed weights, same output
    assert torch.equal(w.forward(x, ids, tw), t.forward(x, ids, tw))
    m = load_cpu_moe(out, 1, pool=w.pool)
    assert torch.equal(m(x, ids, tw.float()), w.forward(x, ids, tw))
    with pytest.raises(ValueError, match="is int8, but method='BF16'"):
        KTMoEWrapper(1, E, K, H, I, None, 2, 1, str(out), 512, method="BF16").load_weights()


def test_deferred_experts_land_in_the_next_layer():
    """kt-kernel's deferral: layer 0's lowest-weight CPU expert per token is computed after layer
    0 returns and added to layer 1's result (the last layer defers nothing)."""
    from kt.layer import split_deferred

    g, u, d = _weights()
    mask = torch.zeros(E, dtype=torch.bool)
    mask[3] = True  # a GPU expert: never computed here, never deferred
    layers = []
    for i, dd in ((0, 1), (1, 0)):
        w = KTMoEWrapper(i, E, K, H, I, gpu_experts_mask=mask, cpuinfer_threads=2, method="BF16",
                         max_deferred_experts_per_token=dd)
        w.load_weights_from_tensors(g, u, d)
        layers.append(w)
    x0, ids0, tw0 = _inputs(5, seed=1)
    x1, ids1, tw1 = _inputs(5, seed=2)
    y0 = layers[0].forward(x0, ids0, tw0)
    y1 = layers[1].forward(x1, ids1, tw1)
    now0, later0 = split_deferred(ids0, tw0, ~mask, 1)
    assert (later0 >= 0).any()
    skip = mask.numpy()
    r0 = _qref(layers[0], x0, now0, tw0, skip)
    r1 = _qref(layers[1], x1, ids1, tw1, skip) + _qref(layers[0], x0, later0, tw0, skip)
    # bf16 outputs (and one bf16 add for layer 1): 2^-8 relative per rounding
    assert ref.relative_error(y0, r0) < 8e-3
    assert ref.relative_error(y1, r1) < 8e-3
    from kt.compat import _deferred

    assert not _deferred._pending  # layer 1 took layer 0's part, and deferred nothing itself


def test_threadpool_count_splits_across_numa_nodes(monkeypatch):
    """kt-kernel's threadpool_count = one sub-pool per NUMA node: with two (stand-in) nodes the
    layer becomes a kt.NumaMoE; with one node it warns and keeps one pool."""
    import os

    from kt.cpu_ops.runtime import pool as pool_mod
    from kt.cpu_ops.numa import NumaMoE

    cpus = sorted(os.sched_getaffinity(0))
    inter = 256
    g, u, d = (torch.from_numpy(a).to(torch.bfloat16)
               for a in random_expert_weights(E, H, inter, seed=5))
    x, ids, tw = _inputs(6, seed=4)
    one = KTMoEWrapper(0, E, K, H, inter, None, 2, 1, None, 512, method="BF16")
    one.load_weights_from_tensors(g, u, d)
    with pytest.warns(UserWarning, match="NUMA node"):
        w1 = KTMoEWrapper(0, E, K, H, inter, None, 2, 2, None, 512, method="BF16")
        w1.load_weights_from_tensors(g, u, d)
    assert not isinstance(w1.moe, NumaMoE)
    if len(cpus) < 2:
        pytest.skip("needs two CPUs for a stand-in two-node topology")
    monkeypatch.setattr(pool_mod, "numa_nodes", lambda allowed=None: {0: [cpus[0]], 1: [cpus[-1]]})
    w2 = KTMoEWrapper(0, E, K, H, inter, None, 2, 2, None, 512, method="BF16", numa_nodes=[0, 1])
    w2.load_weights_from_tensors(g, u, d)
    try:
        assert isinstance(w2.moe, NumaMoE) and w2.moe.slices == [(0, 128), (128, 256)]
        out = w2.forward(x, ids, tw)
        assert out.dtype == torch.bfloat16
        assert ref.relative_error(out.float(), one.forward(x, ids, tw).float()) < 5e-3
        with pytest.raises(ValueError, match="not NUMA nodes"):
            bad = KTMoEWrapper(0, E, K, H, inter, None, 2, 2, None, 512, method="BF16",
                               numa_nodes=[7])
            bad.load_weights_from_tensors(g, u, d)
    finally:
        w2.moe.shutdown()


def test_numpy_inputs_and_list_weights():
    """numpy arrays are kt-kernel inputs too (numpy 2 arrays have a ``.device`` of "cpu", which
    once sent them down the CUDA path); lists are refused naming the argument."""
    g, u, d = _weights()
    w = KTMoEWrapper(0, E, K, H, I, None, 2, 1, None, 512, method="BF16")
    with pytest.raises(TypeError, match="gate_proj must be a torch.Tensor or numpy.ndarray"):
        w.load_weights_from_tensors(g.tolist(), u, d)
    w.load_weights_from_tensors(g.float().numpy(), u.float().numpy(), d.float().numpy())
    x, ids, tw = _inputs(3, seed=7)
    out_t = w.forward(x, ids, tw)
    out_n = w.forward(x.float().numpy(), ids.numpy(), tw.numpy())
    assert isinstance(out_n, torch.Tensor) and out_n.dtype == torch.bfloat16
    assert ref.relative_error(out_n.float(), out_t.float()) < 8e-3  # bf16 vs fp32 input rounding
    with pytest.raises(TypeError, match="hidden_states"):
        w.forward(x.tolist(), ids, tw)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_inputs_take_the_stream_ordered_path():
    """CUDA inputs: the CPU part is ordered on the given stream (no host synchronisation), the
    result lands on the input's device, equal to the CPU-tensor result."""
    g, u, d = _weights()
    w = KTMoEWrapper(0, E, K, H, I, None, 2, 1, None, 512, method="AMXINT8")
    w.load_weights_from_tensors(g, u, d)
    x, ids, tw = _inputs(4, seed=8)
    cpu_out = w.forward(x, ids, tw)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xd, idd, twd = x.cuda(), ids.cuda(), tw.cuda()
    w.submit_forward(xd, idd, twd, cuda_stream=s.cuda_stream)
    out = w.sync_forward(xd, cuda_stream=s.cuda_stream)
    s.synchronize()
    assert out.device.type == "cuda" and out.dtype == torch.bfloat16
    assert torch.equal(out.cpu(), cpu_out)
    assert w._layer(xd.device).stats.last_path == "hybrid"
