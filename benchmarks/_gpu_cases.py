"""Shapes, weights, routing, references and timing shared by bench_gpu.py, its tuner and gpu_decode_floor.py.

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, S GPU slots (hot experts).
Functions take the ``torch`` module as an argument: the scripts set TRITON_INTERPRET for dry runs
before anything imports torch or triton.
"""
from __future__ import annotations

import time

T_LIST = (1, 7, 64, 512, 4096)
SHAPES = {
    # name: E experts, K top-k, H hidden, I intermediate, S GPU slots (hot experts)
    "qwen3-30b-a3b": dict(E=128, K=8, H=2048, I=768, S=32),
    "mixtral-8x7b": dict(E=8, K=2, H=4096, I=14336, S=4),
}
DRY_SHAPES = {"tiny": dict(E=8, K=2, H=64, I=32, S=4)}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


def make_weights(torch, sh, dtype, dev, seed):
    """w13 [S, 2I, H], w2 [S, H, I] with std 1/sqrt(fan_in); int8: per-row q and scales (as
    kt.reference.quantize: scale = amax/127, q = rint(w * (1/scale)) clipped to +-127)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    S, H, I = sh["S"], sh["H"], sh["I"]
    w13 = (torch.randn(S, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(S, H, I, device=dev, generator=g) / I ** 0.5).to(torch.bfloat16)
    if dtype == "bf16":
        return dict(w13=w13, w2=w2), (w13.float(), w2.float())

    def q(w):
        wf = w.float()
        scale = (wf.abs().amax(dim=-1) / 127.0).float()
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        qq = torch.clamp(torch.round(wf * inv[..., None]), -127, 127).to(torch.int8)
        return qq, scale

    q13, s13 = q(w13)
    q2, s2 = q(w2)
    return (dict(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2),
            (q13.float() * s13[..., None], q2.float() * s2[..., None]))


def make_routing(torch, sh, t, e2s, dev, seed):
    g = torch.Generator(device=dev).manual_seed(seed)
    scores = torch.rand(t, sh["E"], device=dev, generator=g)
    top, ids = scores.topk(sh["K"], dim=1)
    w = torch.softmax(top * 4, dim=1).float()
    if t <= 7:  # make sure at least one GPU expert is routed, so there is something to measure
        gpu_experts = torch.nonzero(e2s >= 0).flatten()
        if not bool((e2s[ids] >= 0).any()):
            row = set(ids[0].tolist())
            pick = next(int(e) for e in gpu_experts.tolist() if int(e) not in row)
            ids[0, 0] = pick
    return ids.to(torch.int64), w


def make_e2s(torch, sh, dev, seed):
    g = torch.Generator().manual_seed(seed)
    experts = torch.randperm(sh["E"], generator=g)[:sh["S"]]
    e2s = torch.full((sh["E"],), -1, dtype=torch.int32)
    e2s[experts] = torch.randperm(sh["S"], generator=g).to(torch.int32)
    return e2s.to(dev)


def gpu_slots(torch, ids, e2s):
    """Each token-slot's GPU slot (-1 for an id of -1 or an expert off the GPU): [T, K]."""
    return torch.where(ids >= 0, e2s[ids.clamp(min=0)], -1)


def touched_slots(slots) -> list[int]:
    """The GPU slots a routing uses (``gpu_slots``' values >= 0), sorted, each once."""
    return sorted(set(int(s) for s in slots.flatten().tolist() if s >= 0))


def op_inputs(torch, sh, t, dev, x_seed, route_seed):
    """One whole-op case of shape sh at T=t: (e2s, x [T, H] bf16, ids, w, GPU GEMM flops), the
    slot map seeded 1 as the probes use it, x and the routing from the given seeds."""
    e2s = make_e2s(torch, sh, dev, 1)
    x = torch.randn(t, sh["H"], device=dev, generator=torch.Generator(device=dev).manual_seed(x_seed))
    ids, w = make_routing(torch, sh, t, e2s, dev, route_seed)
    slots = gpu_slots(torch, ids, e2s)
    return e2s, x.to(torch.bfloat16), ids, w, 2 * int((slots >= 0).sum()) * 3 * sh["H"] * sh["I"]


def decode_case(torch, shapes, made, name, dtype, t, dev, table):
    """One decode-sized case of the probes, with the seeds of gpu_decode_floor.py: (weights dict,
    e2s, x [T, H] bf16, ids, w, bytes of the touched slots' weights, the fp32 reference output,
    the table's sorted-path config for T). made: a {(shape, dtype): weights} cache, emptied when
    the case needs other weights (one set on the GPU at a time)."""
    from unittest import mock

    from kt.gpu_ops import MoEConfig, pick_config
    from kt.gpu_ops import configs as C

    sh = shapes[name]
    if (name, dtype) not in made:
        made.clear()
        if dev != "cpu":
            torch.cuda.empty_cache()
        made[(name, dtype)] = make_weights(torch, sh, dtype, dev, 2)
    wts, (w13f, w2f) = made[(name, dtype)]
    e2s = make_e2s(torch, sh, dev, 1)
    gx = torch.Generator(device=dev).manual_seed(3 + t)
    x = torch.randn(t, sh["H"], device=dev, generator=gx).to(torch.bfloat16)
    ids, w = make_routing(torch, sh, t, e2s, dev, 4 + t)
    per_slot = sum(wts[n].numel() * wts[n].element_size() for n in ("w13", "w2")) // sh["S"]
    nbytes = per_slot * len(touched_slots(gpu_slots(torch, ids, e2s)))
    ref = ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
    with mock.patch.multiple(C, DIRECT_MAX_T=0, DIRECT_MAX_N=0):  # the sorted path's table entry
        cfg = pick_config(t, sh["K"], sh["S"], sh["H"], sh["I"], dtype, table)
    assert isinstance(cfg, MoEConfig)
    return wts, e2s, x, ids, w, nbytes, ref, cfg


def ref_gpu(torch, x, ids, w, e2s, w13f, w2f):
    """The spec in fp32 on the GPU (TF32 off): sum over GPU experts of w * w2 @ (silu(gate x) * up x)."""
    t, h = x.shape
    inter = w13f.shape[1] // 2
    slots = gpu_slots(torch, ids, e2s)
    out = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for s in range(w13f.shape[0]):
        tok, kk = torch.nonzero(slots == s, as_tuple=True)
        if tok.numel() == 0:
            continue
        gu = x[tok].float() @ w13f[s].T
        hh = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (hh @ w2f[s].T) * w[tok, kk][:, None])
    return out


def ref_kt_subset(torch, R, x, ids, w, e2s, w13f, w2f, rows):
    """kt.reference.moe_forward on token rows `rows`, with only the GPU slots those rows touch."""
    xs, idss, ws = x[rows], ids[rows], w[rows]
    slots = gpu_slots(torch, idss, e2s)
    touched = touched_slots(slots)
    remap = {s: j for j, s in enumerate(touched)}
    cids = slots.cpu().apply_(lambda s: remap.get(s, -1)) if touched else slots.cpu()
    w13c = w13f[touched].cpu().numpy() if touched else w13f[:0].cpu().numpy()
    w2c = w2f[touched].cpu().numpy() if touched else w2f[:0].cpu().numpy()
    if not touched:
        return torch.zeros(len(rows), x.shape[1])
    return torch.from_numpy(R.moe_forward(xs.float().cpu(), cids, ws.cpu(), w13c, w2c))


def min_median_us(do_bench, fn, dry=False, rep=40):
    """(min, median) us of fn over do_bench's repetitions (the GPU probes' timing); (1, 1) after
    one call in a dry run (the interpreter: nothing to time)."""
    if dry:
        fn()
        return 1.0, 1.0
    try:
        ts = do_bench(fn, warmup=5, rep=rep, return_mode="all")
    except (TypeError, ValueError):  # an older triton: no "all"
        ts = [do_bench(fn, warmup=5, rep=rep, return_mode=m) for m in ("min", "median")]
    ts = sorted(float(v) * 1e3 for v in ts)
    return ts[0], ts[len(ts) // 2]


def ceilings_or_nan(res):
    """The measured ceilings, or NaN ones when the run skipped them (--skip ceilings): fractions of
    them then read NaN instead of stopping the run."""
    return res.data.get("ceilings") or dict(hbm_bytes_per_s=float("nan"), bf16_flops_per_s=float("nan"))


def interleaved_us(do_bench, fns, rounds, dry=False, rep=40):
    """{name: (min, median) us} of each fn in ``fns``, timed in ``rounds`` interleaved rounds (each
    round times every fn once, so a shared machine's drift falls on all of them): the minimum of
    the rounds' minima and the median of their medians."""
    per = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            per[k].append(min_median_us(do_bench, fn, dry, rep))
    return {k: (min(v[0] for v in vs), sorted(v[1] for v in vs)[len(vs) // 2]) for k, vs in per.items()}


def graph_of(torch, fn):
    """Warm up fn on a side stream, capture one call in a CUDA graph; returns (graph, its output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out
