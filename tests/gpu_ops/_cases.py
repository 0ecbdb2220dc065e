"""Kernel cases for test_fused_moe.py: each runs fused_moe on `device` and asserts against kt.reference.

They run in the Triton-interpreter worker process on the CPU (see conftest.py), so they take plain,
picklable arguments and raise AssertionError on failure.

Tolerances (norm-wise relative error ||out - ref|| / ||ref||, plus an elementwise bound at 4x that
relative to max|ref|):
- fp32 x and weights: 1e-5 (fp32 accumulation in another order; the interpreter's fp32 dot is full
  fp32). On a GPU the fp32 dot is tf32 (operands keep 10 mantissa bits, truncated on Hopper: up to
  2^-10 relative each), through two chained GEMMs and SiLU*up: measured 2.3-2.9e-3 on the H200
  (benchmarks/bench_gpu.py), bound 4e-3 (GPU_F32_TOL).
- bf16 x and weights: the reference gets the same bf16 values in fp32; the kernel rounds the SiLU*up
  intermediate and the output to bf16 (2^-9 relative each with round-to-nearest, up to 2^-8 with the
  interpreter's truncation), so the norm-wise error is ~5e-3: bound 1.2e-2.
- int8 weight-only: compared with the reference on the dequantised weights (q * row scale), so only
  the bf16 rounding of activations/intermediate/output remains, as for bf16: bound 1.2e-2.
"""
import numpy as np
import torch

from kt import reference as R
from kt.testing import assert_close, random_expert_weights

GPU_F32_TOL = 4e-3  # fp32 inputs on a GPU: tf32 dots (see the module docstring)


def routing(gen, t, e, k, skip_frac=0.0):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else \
        torch.zeros((0, k), dtype=torch.int64)
    if skip_frac and t:
        ids[torch.rand(t, k, generator=gen) < skip_frac] = -1
    w = torch.rand(t, k, generator=gen) + 0.05
    return ids, w


def weights(s, h, i, seed):
    g, u, d = random_expert_weights(s, h, i, seed=seed)
    return torch.from_numpy(np.concatenate([g, u], axis=1)), torch.from_numpy(d)


def full_weights(e2s, w13s, w2s):
    """Scatter slot weights back to full-E stacks for the reference; skip_mask marks non-GPU experts."""
    e = e2s.numel()
    full13 = np.zeros((e, *w13s.shape[1:]), np.float32)
    full2 = np.zeros((e, *w2s.shape[1:]), np.float32)
    for ex in range(e):
        if e2s[ex] >= 0:
            full13[ex] = w13s[int(e2s[ex])]
            full2[ex] = w2s[int(e2s[ex])]
    return full13, full2, (e2s < 0).numpy()


def quant_int8(w):
    """Per-output-row int8 of a [S, N, D] stack -> (q int8 [S, N, D], scale fp32 [S, N], dequantised)."""
    qs = [R.quantize(w[s], "int8") for s in range(w.shape[0])]
    if not qs:
        return torch.zeros(w.shape, dtype=torch.int8), torch.zeros(w.shape[:2]), np.zeros(w.shape, np.float32)
    q = torch.from_numpy(np.stack([x.q for x in qs]))
    sc = torch.from_numpy(np.stack([x.scale for x in qs]))
    return q, sc, np.stack([R.dequantize(x) for x in qs])


def fused_case(device, t, e, k, h, i, e2s_list, dtype, seed, skip_frac=0.1, config=None, align=None):
    """fused_moe vs the fp32 reference; align forces an alignment path (moe._forced_align)."""
    import contextlib

    from kt.gpu_ops import moe

    with moe._forced_align(align) if align else contextlib.nullcontext():
        return _fused_check(device, t, e, k, h, i, e2s_list, dtype, seed, skip_frac, config)


def _fused_check(device, t, e, k, h, i, e2s_list, dtype, seed, skip_frac, config):
    from kt.gpu_ops import fused_moe
    from kt.gpu_ops.configs import config_from_dict

    gen = torch.Generator().manual_seed(seed)
    e2s = torch.tensor(e2s_list, dtype=torch.int32)
    s = int(e2s.max()) + 1 if (e2s >= 0).any() else 0
    ids, w = routing(gen, t, e, k, skip_frac)
    x = torch.randn(t, h, generator=gen)
    w13, w2 = weights(max(s, 1), h, i, seed)
    w13, w2 = w13[:s], w2[:s]
    kw = {}
    if dtype == "int8":
        xd = x.to(torch.bfloat16)
        w13d, s13, ref_w13 = quant_int8(w13)
        w2d, s2, ref_w2 = quant_int8(w2)
        kw = dict(w13_scale=s13.to(device), w2_scale=s2.to(device))
        tol = 1.2e-2
    else:
        tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
        xd, w13d, w2d = x.to(tdt), w13.to(tdt), w2.to(tdt)
        ref_w13, ref_w2 = R.to_numpy_f32(w13d), R.to_numpy_f32(w2d)
        tol = 1.2e-2 if dtype == "bf16" else (1e-5 if device == "cpu" else GPU_F32_TOL)
    if config is not None:
        kw["config"] = config_from_dict(config)
    full13, full2, skip = full_weights(e2s, ref_w13, ref_w2)
    ref = R.moe_forward(xd, ids, w, full13, full2, skip_mask=skip)
    out = fused_moe(xd.to(device), ids.to(device), w.to(device), e2s.to(device), w13d.to(device),
                    w2d.to(device), **kw)
    assert out.shape == (t, h) and out.dtype == xd.dtype, (out.shape, out.dtype)
    if t == 0:
        return 0.0
    err = R.relative_error(out, ref)
    assert err <= tol, f"T={t} {dtype}: relative error {err:.3g} > {tol}"
    scale = float(np.abs(ref).max()) or 1.0
    assert_close(ref, out, rtol=4 * tol, atol=4 * tol * scale, what=f"T={t} {dtype}")
    return err


def routed_case(device, ids_list, e2s_list, h, i, seed):
    """Fixed routing (ids may be -1); fp32, so the bound is tight. Returns the output."""
    from kt.gpu_ops import fused_moe

    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor(ids_list, dtype=torch.int64)
    t, k = ids.shape
    e2s = torch.tensor(e2s_list, dtype=torch.int32)
    s = int(e2s.max()) + 1 if (e2s >= 0).any() else 0
    w = torch.rand(t, k, generator=gen)
    x = torch.randn(t, h, generator=gen)
    w13, w2 = weights(max(s, 1), h, i, seed)
    w13, w2 = w13[:s], w2[:s]
    full13, full2, skip = full_weights(e2s, w13.numpy(), w2.numpy())
    ref = R.moe_forward(x, ids, w, full13, full2, skip_mask=skip)
    out = fused_moe(x.to(device), ids.to(device), w.to(device), e2s.to(device), w13.to(device), w2.to(device))
    tol = 1e-5 if device == "cpu" else GPU_F32_TOL
    assert_close(ref, out, rtol=tol, atol=tol * (float(np.abs(ref).max()) or 1.0), what="routed case")
    return out.cpu()


def align_case(device, t, k, e2s_list, block_m, seed, path, chunk=None):
    """align_by_slot on the given path (moe._forced_align): every GPU token-slot exactly once, in a
    block of its own slot; padding (inside the rows in use) = sentinel; on the two-launch and
    per-slot paths each slot's rows are also in token order. chunk: the ids the per-slot path's
    programs map per step (moe._ALIGN_PER_SLOT_CHUNK)."""
    import contextlib

    from kt.gpu_ops import moe

    steps = moe._overriding(_ALIGN_PER_SLOT_CHUNK=chunk) if chunk else contextlib.nullcontext()
    with moe._forced_align(path), steps:
        _align_check(device, t, k, e2s_list, block_m, seed, moe.align_by_slot,
                     ordered=path in ("two_launch", "per_slot"))


def _align_check(device, t, k, e2s_list, block_m, seed, align_by_slot, ordered=False):
    gen = torch.Generator().manual_seed(seed)
    e2s = torch.tensor(e2s_list, dtype=torch.int32)
    e = e2s.numel()
    s = int(e2s.max()) + 1 if (e2s >= 0).any() else 0
    ids = torch.randint(-1, e + 2, (t, k), generator=gen)  # includes -1 and out-of-range ids
    slot, sorted_ids, block_slot, num_padded = [v.cpu() for v in align_by_slot(ids.to(device), e2s.to(device), s, block_m)]
    n = t * k
    flat = ids.reshape(n)
    want_slot = torch.tensor([int(e2s[i]) if 0 <= i < e else -1 for i in flat.tolist()], dtype=torch.int32)
    assert torch.equal(slot, want_slot), (slot, want_slot)
    p = sorted_ids.numel()
    assert p % block_m == 0 and p >= n + s * (block_m - 1) and block_slot.numel() == p // block_m
    used = int(num_padded[0])
    counts = [int((slot == j).sum()) for j in range(s)]
    assert used == sum(-(-c // block_m) * block_m for c in counts), (used, counts)
    rows_used = sorted_ids[:used]
    assert torch.all((rows_used >= 0) & (rows_used <= n)), "a row in use is neither a token-slot nor the sentinel"
    seen = []
    for b in range(used // block_m):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        real = rows[rows < n]
        assert torch.all(slot[real.long()] == block_slot[b]), f"block {b}: a row of another slot"
        seen += real.tolist()
    want = torch.nonzero(slot >= 0).flatten().tolist()
    assert sorted(seen) == sorted(want), "GPU token-slots not each once"
    if ordered:  # slots one after another, each in token order
        assert seen == sorted(want, key=lambda i: (int(slot[i]), i)), "not in (slot, token) order"


def act_quant2_case(device, t, h, seed, dtype="fp32"):
    """moe.act_quant2 vs kt.reference.quantize_act2 on rows of very different sizes (one all-zero
    row, one with a NaN). Level-1 scales: the same fp32 formula (rtol 1e-6, a GPU's division may
    differ by an ulp); level-2 scales within 0.5 % (the residual, see below); level-1 codes equal
    under the interpreter; on a GPU, whose fp32 division may differ by an ulp and which fuses the
    residual's multiply and subtract, codes at most one apart and few of them; reconstruction:
    within half a level-2 step of x (the two-level bound), up to fp32 rounding of the sum. Level-2
    codes differ more often: a GPU forms the residual x - q1 * s1 with one fused multiply-add (the
    reference rounds the product first), which moves the residual by up to 2^-24 * 127 * s1, about
    0.2 % of a level-2 step, so codes within that of a rounding boundary may flip."""
    from kt.gpu_ops import moe

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen) * torch.logspace(-3, 3, t)[:, None]
    x = x.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    x[0] = 0
    x[t - 1, h // 2] = float("nan")
    q, s = moe.act_quant2(x.to(device))
    q, s = q.cpu(), s.cpu()
    xf = R.to_numpy_f32(x[: t - 1])
    q1, s1, q2, s2 = R.quantize_act2(xf)
    assert np.allclose(s[: t - 1, 0].numpy(), s1, rtol=1e-6, atol=0), (s[:, 0], s1)
    assert np.allclose(s[: t - 1, 1].numpy(), s2, rtol=5e-3, atol=0), (s[:, 1], s2)  # the fused residual
    if str(device) == "cpu":  # the interpreter: the same fp32 operations, rounded to nearest even
        assert np.array_equal(q[0, : t - 1].numpy(), q1.astype(np.int8)), "level-1 codes differ"
    for lvl, ref, frac in ((0, q1, 2e-3), (1, q2, 2e-2)):
        d = np.abs(q[lvl, : t - 1].numpy().astype(np.int32) - ref.astype(np.int32))
        assert d.max() <= 1 and (d > 0).sum() <= max(2, frac * d.size), (lvl, d.max(), (d > 0).sum(), d.size)
    sk = s.numpy()
    recon = sk[: t - 1, 0:1] * q[0, : t - 1].numpy() + sk[: t - 1, 1:2] * q[1, : t - 1].numpy()
    bound = 0.5 * sk[: t - 1, 1:2] + 1e-6 * np.abs(xf).max(axis=1, keepdims=True)
    assert np.all(np.abs(xf - recon) <= bound), float(np.max(np.abs(xf - recon) - bound))
    assert torch.equal(q[:, 0], torch.zeros(2, h, dtype=torch.int8)) and torch.equal(s[0], torch.zeros(2))
    assert torch.isnan(s[t - 1, 0]), s[t - 1]  # the NaN row: its outputs become NaN


def combine_case(device, t, k, h, block_h, ydtype, seed):
    """moe.combine against a float64 sum (fp32 accumulation of K values: within 1e-6): every token,
    one with no GPU slot (zeros), rows of CPU token-slots never read (NaN there), a partial last
    column block."""
    from kt.gpu_ops import moe

    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(t * k, h, generator=gen).to({"fp32": torch.float32, "bf16": torch.bfloat16}[ydtype])
    slot = torch.randint(-1, 3, (t * k,), generator=gen, dtype=torch.int32)
    slot[:k] = -1  # token 0: no GPU expert
    y[slot < 0] = float("nan")  # rows of CPU token-slots are never read
    out = torch.empty(t, h, dtype=torch.float32)
    moe.combine(y.to(device), slot.to(device), out := out.to(device), block_h=block_h)
    want = torch.where((slot >= 0)[:, None], y.double(), 0.0).reshape(t, k, h).sum(1)
    assert_close(want.numpy(), out.cpu().double().numpy(), rtol=1e-6, atol=1e-6, what="combine")


def direct_down_case(device, t, k, h, i, int8w, config, seed):
    """moe.direct_down against a float64 sum: h rows of token-slots off the GPU (which fused_moe
    leaves unwritten) are NaN here and must not reach the output, a token with no GPU expert gets
    zeros, int8 weights' row scales applied; fp32 sums of exact products: within 1e-5 relative."""
    from kt.gpu_ops import DirectConfig, moe

    gen = torch.Generator().manual_seed(seed)
    e, s = 8, 3
    e2s = torch.tensor([0, -1, 1, -1, 2, -1, -1, -1], dtype=torch.int32)
    ids, w = routing(gen, t, e, k, 0.1)
    ids[0] = torch.tensor([1, 3, 5, 6][:k])  # token 0: no GPU expert
    slot = torch.where(ids >= 0, e2s[ids.clamp(min=0)], -1).reshape(-1)
    hb = torch.randn(t * k, i, generator=gen).to(torch.bfloat16)
    hb[slot < 0] = float("nan")
    w2 = torch.randn(s, h, i, generator=gen) / i ** 0.5
    if int8w:
        w2, s2, _ = quant_int8(w2)
        w2f = w2.double() * s2.double()[..., None]
    else:
        w2, s2 = w2.to(torch.bfloat16), None
        w2f = w2.double()
    out = torch.full((t, h), float("nan"), dtype=torch.float32)
    cfg = DirectConfig(gate_up="pairs", **config)
    out = moe.direct_down(hb.to(device), w2.to(device), None if s2 is None else s2.to(device), w.to(device),
                          ids.to(device), e2s.to(device), out.to(device), cfg).cpu()
    want = torch.zeros(t, h, dtype=torch.float64)
    for n in range(t * k):
        if slot[n] >= 0:
            want[n // k] += w.reshape(-1)[n].double() * (w2f[slot[n]] @ hb[n].double())
    assert torch.isfinite(out).all()
    assert_close(want.numpy(), out.double().numpy(), rtol=1e-5, atol=1e-5, what="direct_down")


def nan_row_case(device, a8, seed):
    """A NaN in one token's activations makes that token's output row NaN (every element, since every
    element sums over all of the token's activations), and no other row: with int8 weights, through
    the a8 quantiser (the row's level-1 scale is NaN) or the bf16 activations path."""
    from kt.gpu_ops import MoEConfig, fused_moe

    gen = torch.Generator().manual_seed(seed)
    t, e, k, h, i = 6, 8, 2, 64, 32
    e2s = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)  # every expert on the GPU
    ids, w = routing(gen, t, e, k)
    w13, w2 = weights(e, h, i, seed)
    q13, s13, _ = quant_int8(w13)
    q2, s2, _ = quant_int8(w2)
    x = torch.randn(t, h, generator=gen)
    x[2, 5] = float("nan")
    cfg = MoEConfig(block_m=16, block_n=16, block_k=64, a8=a8)
    out = fused_moe(x.to(device), ids.to(device), w.to(device), e2s.to(device), q13.to(device), q2.to(device),
                    w13_scale=s13.to(device), w2_scale=s2.to(device), config=cfg).cpu()
    assert torch.isnan(out[2]).all(), out[2]
    assert torch.isfinite(out[[0, 1, 3, 4, 5]]).all()


def sorted_h_case(device, t, e, k, h, i, e2s_list, dtype, seed, config):
    """h between the GEMMs in sorted order (rows read as whole blocks, by TMA where the down's
    weights are) against h by token-slot: the same sums in the same order, so y and fused_moe's
    output are bit-identical; h's padding rows, set to NaN here, never reach a stored row."""
    from kt.gpu_ops import fused_moe, moe
    from kt.gpu_ops.configs import config_from_dict

    cfg = config_from_dict(config)
    gen = torch.Generator().manual_seed(seed)
    e2s = torch.tensor(e2s_list, dtype=torch.int32)
    s = int(e2s.max()) + 1
    ids, w = routing(gen, t, e, k, 0.1)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    w13, w2 = weights(s, h, i, seed)
    kw = {}
    if dtype == "int8":
        w13, s13, _ = quant_int8(w13)
        w2, s2, _ = quant_int8(w2)
        kw = dict(w13_scale=s13.to(device), w2_scale=s2.to(device))
    else:
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    x, ids, w, e2s, w13, w2 = (v.to(device) for v in (x, ids, w, e2s, w13, w2))
    outs = {}
    for on in (False, True):
        with moe._forced_sorted_h(on):
            outs[on] = fused_moe(x, ids, w, e2s, w13, w2, config=cfg, **kw)
    assert torch.equal(outs[False], outs[True]), "fused_moe: sorted h differs from h by token-slot"
    align = cfg.align_m
    slot32, sid, bsl, npad = moe.align_by_slot(ids, e2s, s, align)
    n = ids.numel()
    progs = moe._INTERPRETER_PROGRAMS if device == "cpu" else 4 * moe._num_sms(0)
    ys = {}
    for on in (False, True):
        hb = moe.gate_up(x, w13, kw.get("w13_scale"), sid, bsl, npad, k, cfg, torch.bfloat16, progs, align, on)
        if on:
            assert hb.shape[0] == sid.numel()
            used = int(npad.cpu()[0])
            pad = (sid[:used] >= n).nonzero().flatten()
            hb[pad] = float("nan")
            hb[used:] = float("nan")
        ys[on] = moe.down(hb, w2, kw.get("w2_scale"), w, sid, bsl, npad, cfg.for_down(), progs, torch.bfloat16,
                          align, on)
    rows = (slot32 >= 0).nonzero().flatten()
    assert torch.isfinite(ys[True][rows]).all(), "a padding row of h reached y"
    assert torch.equal(ys[False][rows], ys[True][rows]), "down: sorted h differs from h by token-slot"
