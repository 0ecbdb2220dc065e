"""HybridMoE on a machine without a GPU: placement split logic, deferral arithmetic, fallbacks.

The GPU paths (stream-ordered CPU part, CUDA graphs, layer-wise prefill) run on the device machine
through benchmarks/bench_hybrid.py; here every placement is all-CPU.
"""
import numpy as np
import pytest
import torch

from kt import reference as ref
from kt.layer import DeferredChain, HybridMoE, PrefillCostModel, split_deferred
from kt.testing import random_expert_weights

E, K, H, I = 8, 3, 64, 48


@pytest.fixture(scope="module")
def weights():
    return random_expert_weights(E, H, I, seed=11)


def _w13(gate, up):
    return np.concatenate([gate, up], axis=1)


def _qmoe(layer, x, ids, w):
    """The layer's exact kernel math (kt.reference on its own quantised weights)."""
    from kt.cpu_ops.packing import unpack

    cpu = layer.cpu
    q13 = [unpack(cpu.w13.expert(e)) for e in range(cpu.num_experts)]
    q2 = [unpack(cpu.w2.expert(e)) for e in range(cpu.num_experts)]
    return ref.moe_forward_quantized(x, ids, w, q13, q2)


def test_split_deferred_picks_lowest_weight_cpu_experts():
    ids = torch.tensor([[0, 1, 2, 3], [4, -1, 5, 6], [7, 0, 1, 2]])
    w = torch.tensor([[0.4, 0.1, 0.3, 0.2], [0.5, 0.9, 0.2, 0.3], [0.25, 0.25, 0.25, 0.25]])
    cpu = torch.tensor([True, True, False, True, True, True, True, True])  # expert 2 on GPU
    now, later = split_deferred(ids, w, cpu, 2)
    # token 0: CPU experts 0 (.4), 1 (.1), 3 (.2) -> defer 1 and 3
    assert now[0].tolist() == [0, -1, 2, -1] and later[0].tolist() == [-1, 1, -1, 3]
    # token 1: the -1 slot is never deferred; lowest CPU weights .2 (5) and .3 (6)
    assert now[1].tolist() == [4, -1, -1, -1] and later[1].tolist() == [-1, -1, 5, 6]
    # token 2: ties break by position; expert 2 (GPU) is never deferred
    assert now[2].tolist() == [-1, -1, 1, 2] and later[2].tolist() == [7, 0, -1, -1]
    n0, l0 = split_deferred(ids, w, cpu, 0)
    assert torch.equal(n0, ids) and (l0 == -1).all()


def test_all_cpu_layer_matches_reference(weights):
    gate, up, down = weights
    layer = HybridMoE.from_tensors(gate, up, down, None, scheme="bf16")
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((9, H)).astype(np.float32))
    ids = torch.from_numpy(rng.integers(-1, E, (9, K)))
    w = torch.from_numpy(rng.random((9, K), dtype=np.float32))
    out = layer(x, ids, w)
    # the kernels' own math: fp32 accumulation-order differences only
    assert ref.relative_error(out, _qmoe(layer, x, ids, w)) < 1e-4
    # against fp32 weights: bf16 rounding of weights and activations (2^-8 each, a few per path)
    assert ref.relative_error(out, ref.moe_forward(x, ids, w, _w13(gate, up), down)) < 1.5e-2
    assert layer.stats.last_path == "cpu_only"


def test_deferral_matches_an_explicit_two_layer_reference(weights):
    """h1 = h0 + moe0_now(h0); h2 = h1 + moe1(h1) + moe0_later(h0): the exact deferred math."""
    gate, up, down = weights
    gate2, up2, down2 = random_expert_weights(E, H, I, seed=12)
    chain = DeferredChain()
    l0 = HybridMoE.from_tensors(gate, up, down, scheme="bf16", max_deferred_experts_per_token=1,
                                chain=chain)
    l1 = HybridMoE.from_tensors(gate2, up2, down2, scheme="bf16", max_deferred_experts_per_token=1,
                                chain=chain, is_last_layer=True)
    rng = np.random.default_rng(1)
    T = 7
    h0 = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32))
    ids0 = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)]))
    ids1 = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)]))
    w0 = torch.from_numpy(rng.random((T, K), dtype=np.float32))
    w1 = torch.from_numpy(rng.random((T, K), dtype=np.float32))
    h1 = h0 + l0(h0, ids0, w0)
    h2 = h1 + l1(h1, ids1, w1)

    now0, later0 = split_deferred(ids0, w0, torch.ones(E, dtype=torch.bool), 1)
    assert (later0 >= 0).sum(dim=1).tolist() == [1] * T
    # the reference applies the same split with each layer's exact kernel math
    r_h1 = h0.numpy() + _qmoe(l0, h0, now0, w0)
    r_h2 = r_h1 + _qmoe(l1, h1, ids1, w1) + _qmoe(l0, h0, later0, w0)
    assert ref.relative_error(h1, r_h1) < 1e-4
    assert ref.relative_error(h2, r_h2) < 1e-4
    assert chain.take() is None  # the last layer deferred nothing
    # without deferral the result differs (the math really changed)
    full = h0.numpy() + ref.moe_forward(h0, ids0, w0, _w13(gate, up), down)
    assert ref.relative_error(h1, full) > 1e-2


def test_gpu_placement_without_gpu_is_a_clear_error(weights):
    gate, up, down = weights
    row = np.full(E, -1)
    row[[1, 4]] = [0, 1]
    with pytest.raises(ValueError, match="no CUDA device"):
        HybridMoE.from_tensors(gate, up, down, row, scheme="int8")


def test_bad_placements_and_inputs(weights):
    gate, up, down = weights
    layer = HybridMoE.from_tensors(gate, up, down, None, scheme="int8")
    with pytest.raises(ValueError, match=r"\[E=8\]"):
        layer.update_placement(np.full(5, -1))
    with pytest.raises(ValueError, match="distinct slots"):
        layer.update_placement(np.array([0, 0, -1, -1, -1, -1, -1, -1]))
    with pytest.raises(ValueError, match="distinct slots"):
        layer.update_placement(np.array([3, -1, -1, -1, -1, -1, -1, -1]))
    x = torch.zeros(2, H)
    with pytest.raises(ValueError, match=r"\[T, H=64\]"):
        layer(torch.zeros(2, H + 1), torch.zeros(2, K, dtype=torch.long), torch.zeros(2, K))
    with pytest.raises(ValueError, match="topk_ids"):
        layer(x, torch.zeros(3, K, dtype=torch.long), torch.zeros(3, K))
    with pytest.raises(TypeError):
        layer(x.numpy(), torch.zeros(2, K, dtype=torch.long), torch.zeros(2, K))
    with pytest.raises(ValueError, match="CUDA"):
        HybridMoE.from_tensors(gate, up, down, None, scheme="int8", gpu_prefill_token_threshold=64)
    with pytest.raises(ValueError, match="device"):
        HybridMoE.from_tensors(gate, up, down, None, scheme="int8", device="cpu")
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match="graph_max_tokens"):
            HybridMoE(layer.cpu, None, graph_max_tokens=bad)


def test_prefill_cost_model_threshold_is_monotone_in_pcie_bandwidth():
    m = PrefillCostModel(h2d_bytes_per_s=25e9, cpu_bytes_per_s=50e9, cpu_flops=2e12, gpu_flops=3e14)
    args = (8, 128, 2048, 768, 3 * 2048 * 768)
    slow = m.threshold(*args)
    m.h2d_bytes_per_s = 100e9
    fast = m.threshold(*args)
    assert fast <= slow
    # at the threshold the GPU path is faster, one power of two below it is not
    assert m.gpu_seconds(fast, *args) < m.cpu_seconds(fast, *args)
    if fast > 1:
        assert m.gpu_seconds(fast // 2, *args) >= m.cpu_seconds(fast // 2, *args)
    m.observe_cpu(512, 8, 2048, 768, 0.05)
    assert m.observations == 1 and m.cpu_flops == pytest.approx(6 * 2048 * 768 * 512 * 8 / 0.05)


class _FakeLayer:
    def __init__(self, idx):
        self.layer_idx, self.rows = idx, []
        self.observer = self.after_forward = None

    def update_placement(self, row):
        self.rows.append(np.asarray(row).copy())


def test_dynamic_replacement_follows_the_routing():
    from kt.layer import DynamicReplacement
    from kt.placement import DynamicPlacer, Placement

    L, E_ = 2, 8
    start = Placement.from_mask(np.array([[True, True] + [False] * 6] * L))
    placer = DynamicPlacer((L, E_), initial=start, every_n_tokens=32, drift_threshold=0.05)
    layers = [_FakeLayer(0), _FakeLayer(1)]
    dyn = DynamicReplacement(layers, placer, background=False)
    assert layers[0].observer is placer and layers[1].after_forward == dyn.step
    hot = np.array([[6, 7]] * 64)  # all traffic goes to experts 6 and 7
    for _ in range(2):
        for layer in layers:
            layer.observer.observe(layer.layer_idx, hot)
        layers[-1].after_forward()
    dyn.wait()
    assert dyn.updates == 1
    for layer in layers:
        row = layer.rows[-1]
        assert set(np.nonzero(row >= 0)[0]) == {6, 7}
    dyn.detach()
    assert layers[0].observer is None


def _spread_row(frac):
    """An [E] placement row with round(frac * E) experts spread over the ids, slots in id order."""
    row = np.full(E, -1, np.int64)
    n = int(round(frac * E))
    row[np.arange(0, E, max(1, E // max(n, 1)))[:n]] = np.arange(n)
    return row


def _cuda_routing(rng, t):
    """Fresh bf16 x, ids (a few -1 slots) and weights on the GPU."""
    x = torch.from_numpy(rng.standard_normal((t, H)).astype(np.float32)).to(torch.bfloat16)
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(t)]))
    ids[rng.random((t, K)) < 0.15] = -1
    w = torch.from_numpy(rng.random((t, K), dtype=np.float32))
    return x.cuda(), ids.cuda(), w.cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (HybridMoE's GPU experts)")
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_cuda_placements_match_the_cpu_layer(weights, frac):
    """On a GPU: all-CPU, half and all-GPU placements (the last one runs the Triton experts alone)
    agree with the same layer computed on the CPU within the GPU kernels' bf16 rounding."""
    gate, up, down = weights
    row = _spread_row(frac)
    # two-level activations: the CPU side's activation rounding is negligible, so what is left
    # between the two is the GPU's bf16 arithmetic on the same dequantised INT8 weights
    cpu_only = HybridMoE.from_tensors(gate, up, down, None, scheme="int8", activations="int8x2")
    layer = HybridMoE(cpu_only.cpu, row, device="cuda")
    rng = np.random.default_rng(3)
    for t in (1, 9):
        x = torch.from_numpy(rng.standard_normal((t, H)).astype(np.float32)).to(torch.bfloat16)
        ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(t)]))
        w = torch.from_numpy(rng.random((t, K), dtype=np.float32))
        want = cpu_only(x.float(), ids, w)
        got = layer(x.cuda(), ids.cuda(), w.cuda()).float().cpu()
        # bf16 outputs and the GPU's bf16 SiLU*up intermediate: ~3e-3 relative
        assert ref.relative_error(got, want) < 1e-2, (frac, t, ref.relative_error(got, want))
        assert layer.stats.last_path == "hybrid"


def test_pinned_span_is_the_pages_inside_an_array():
    """Page-locking covers only the whole pages inside an array (``_gpu_weights.pinned_span``), so
    arrays that share a page never lock each other's memory: two neighbours in one buffer get
    disjoint spans, neither holding the page between them; small insides are not locked."""
    from kt.layer._gpu_weights import PIN_MIN_BYTES, pinned_span

    page = 4096
    buf = np.empty(6 << 20, np.uint8)
    base = -(-buf.ctypes.data // page) * page - buf.ctypes.data  # the buffer's first page start
    cut = base + (3 << 20) + 100                                   # inside a page
    a, b = buf[base + 40:cut], buf[cut:base + (6 << 20) - page]
    (a0, a1), (b0, b1) = pinned_span(a), pinned_span(b)
    assert a0 == page - 40 and (a.ctypes.data + a1) % page == 0 and a1 <= a.nbytes
    assert b0 == page - 100 and b1 == b.nbytes
    assert a.ctypes.data + a1 < b.ctypes.data + b0           # the shared page is in neither
    assert a.ctypes.data + a1 + page == b.ctypes.data + b0
    assert pinned_span(buf[base + 40:base + 40 + PIN_MIN_BYTES]) == (0, 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (page-locked copies)")
def test_cuda_copies_from_neighbouring_pinned_arrays():
    """Two arrays that share a page, both page-locked, copy to the GPU intact (layer-wise prefill
    of heap-allocated neighbours failed with "invalid argument" when a lock reached into the
    next array)."""
    from kt.layer._gpu_weights import copy_host_to_device, pin_host_array

    page = 4096
    buf = np.random.default_rng(3).integers(0, 256, size=8 << 20, dtype=np.uint8)
    base = -(-buf.ctypes.data // page) * page - buf.ctypes.data
    cut = base + (3 << 20) + 100
    parts = [buf[base + 40:cut], buf[cut:]]
    assert all(pin_host_array(p) for p in parts)
    for p in parts:
        dst = torch.empty(p.nbytes + 64, dtype=torch.uint8, device="cuda")
        copy_host_to_device(dst, p)
        torch.cuda.synchronize()
        assert np.array_equal(dst[: p.nbytes].cpu().numpy(), p)
    # a locked array that is freed is unlocked (the driver would keep its pages otherwise)
    from kt.layer import _gpu_weights as gw

    own = np.ones(3 << 20, np.uint8)
    assert pin_host_array(own)
    n = len(gw._PINNED)
    del own
    import gc

    gc.collect()
    assert len(gw._PINNED) == n - 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (layer-wise prefill)")
@pytest.mark.parametrize("scheme", ["int8", "bf16"])
def test_cuda_layerwise_prefill_with_prefetch_matches_the_cpu_path(scheme):
    """Three layers of different weights run layer-wise twice in a row: the second pass copies
    each next layer's experts ahead into the other staging buffer (LayerStaging's learned order);
    every output matches the same layer on its CPU path within the GPU's bf16 rounding, so no
    layer ever reads another layer's (or a half-copied) buffer."""
    from kt.layer._gpu_weights import LayerStaging

    layers, cpus = [], []
    for i in range(3):
        gate, up, down = random_expert_weights(E, H, I, seed=40 + i)
        cpu = HybridMoE.from_tensors(gate, up, down, None, scheme=scheme, activations="int8x2"
                                     if scheme == "int8" else "int8")
        cpus.append(cpu)
        layers.append(HybridMoE(cpu.cpu, None, device="cuda", gpu_prefill_token_threshold=16))
    stage = LayerStaging.for_device(torch.device("cuda"))
    rng = np.random.default_rng(5)
    t = 40
    for rep in range(2):
        hits = stage.prefetch_hits
        for layer, cpu in zip(layers, cpus):
            x = torch.from_numpy(rng.standard_normal((t, H)).astype(np.float32)).to(torch.bfloat16)
            ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(t)]))
            w = torch.from_numpy(rng.random((t, K), dtype=np.float32))
            got = layer(x.cuda(), ids.cuda(), w.cuda()).float().cpu()
            assert layer.stats.last_path == "gpu_prefill"
            want = cpu(x.float(), ids, w)
            assert ref.relative_error(got, want) < 1e-2, (rep, scheme, ref.relative_error(got, want))
        # the first pass learns the order; in the second, layers 1 and 2 were copied ahead
        assert stage.prefetch_hits - hits == (0 if rep == 0 else 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_decode_graphs_are_bit_identical_to_eager(weights, frac):
    """Eager calls of up to graph_max_tokens tokens replay graphs the layer captured itself (at a
    shape's second call). Every output equals the always-eager layer's bit for bit: on fresh
    inputs, across shapes, after a larger call reallocated the bridge's pinned buffers, and after
    a placement change (which drops the graphs and captures again)."""
    gate, up, down = weights
    cpu = HybridMoE.from_tensors(gate, up, down, None, scheme="int8").cpu
    row = _spread_row(frac)
    g = HybridMoE(cpu, row, device="cuda")  # graph_max_tokens=8, the default
    e = HybridMoE(cpu, row, device="cuda", graph_max_tokens=0)
    rng = np.random.default_rng(7)

    def calls(*ts):
        for t in ts:
            x, ids, w = _cuda_routing(rng, t)
            a, b = g(x, ids, w), e(x, ids, w)
            assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), (frac, t)

    calls(1, 3, 8, 1, 3, 8, 1, 9, 9)
    assert (g.graphs.captures, g.graphs.replays, e.graphs.replays) == (3, 4, 0)
    calls(40, 1, 1, 1)  # 40 rows > the pinned buffers' 16: reallocated, the graphs dropped
    assert g.graphs.replays >= 5
    new = np.roll(row, 3)
    g.update_placement(new)
    e.update_placement(new)
    before = g.graphs.replays
    calls(1, 1, 1)
    # all-CPU to all-CPU changes nothing a graph read, so T=1's stays; otherwise the first call
    # after the change is eager again and the second is captured and replayed
    assert g.graphs.replays == before + (3 if frac == 0.0 else 2) and g.graphs.disabled is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_decode_graphs_stay_out_of_a_callers_capture_and_of_deferral(weights):
    """Inside a GraphRunner capture the layer runs its eager path (the caller's graph holds its
    kernels) and the runner's replay matches eager; layers with deferral never capture."""
    from kt.layer._stream_bridge import GraphRunner

    gate, up, down = weights
    cpu = HybridMoE.from_tensors(gate, up, down, None, scheme="int8").cpu
    row = _spread_row(0.5)
    g = HybridMoE(cpu, row, device="cuda")
    e = HybridMoE(cpu, row, device="cuda", graph_max_tokens=0)
    rng = np.random.default_rng(8)
    x, ids, w = _cuda_routing(rng, 2)
    g(x, ids, w)
    g(x, ids, w)
    assert (g.graphs.captures, g.graphs.replays) == (1, 1)
    runner = GraphRunner()
    with runner.capture():
        y = g(x, ids, w)
    assert (g.graphs.captures, g.graphs.replays) == (1, 1)
    for _ in range(3):
        x2, ids2, w2 = _cuda_routing(rng, 2)
        for static, new in ((x, x2), (ids, ids2), (w, w2)):
            static.copy_(new)
        runner.replay()
        assert torch.equal(y, e(x2, ids2, w2))
    chain = DeferredChain()
    d0 = HybridMoE(cpu, row, device="cuda", max_deferred_experts_per_token=1, chain=chain)
    d1 = HybridMoE(cpu, row, device="cuda", chain=chain, is_last_layer=True)
    for _ in range(3):
        d1(d0(x, ids, w), ids, w)
    torch.cuda.synchronize()
    assert d0.graphs.captures == d1.graphs.captures == 0
