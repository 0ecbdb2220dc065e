#!/usr/bin/env python3
"""kt.gpu_ops on a GPU: correctness, speed against the roofline, tuned configs, stream/CPU sync cost.

Run on the device machine (H200):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_gpu.py --out $OUT 2>&1 | tee $OUT/gpu.log
Writes $OUT/gpu.json (all figures) and $OUT/h200.json (the tuned config table for kt/gpu_ops/configs/).
`--dry-run` runs the same flow with tiny shapes on the CPU under the Triton interpreter (no timings).

Parts, in order (gpu.json is rewritten after each, so a late failure loses nothing earlier):
1. ceilings: HBM bandwidth (device-to-device copy, bytes read + written) and the bf16 matmul rate
   (torch.matmul 8192^3 on random data, the faster of a reading before and one after the copy), both
   medians of triton.testing.do_bench.
2. correctness of fused_moe vs an fp32 GPU reference (TF32 off) for every T, shape and dtype, and vs
   kt.reference.moe_forward on a subset of tokens; no host sync (torch sync debug mode "error");
   CUDA-graph replay bit-identical to eager.
3. speed: each candidate config timed as a CUDA-graph replay (L2 flushed by do_bench between runs);
   T <= 64 as a fraction of HBM bandwidth over the hot-expert weight bytes touched, T >= 512 as a
   fraction of the bf16 matmul rate over the GEMM FLOPs; the best correct config per T goes to the table.
4. tune (`--tune`): the gate+up and the down kernel swept *separately* (each stage alone, graph
   replay, L2 flushed) for the direct path at decode T and the sorted path at prefill T (per block_m,
   since both sorted kernels share the alignment; each kernel's best tiles are tried again with TMA
   weight tiles and a flattened tile loop, one tma for both: ``pick_flags``); the best pair then timed
   as a whole op against the config the shipped table gives, interleaved, and written to the table if
   faster.
5. stream_sync: a step (D2H to pinned, "start", GPU op, "wait done", H2D, add) with a Numba nogil
   worker thread, eager and captured in a CUDA graph, replayed 220 times, memop vs host-function,
   against the same graph without the CPU part.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback

T_LIST = (1, 7, 64, 512, 4096)
SHAPES = {
    # name: E experts, K top-k, H hidden, I intermediate, S GPU slots (hot experts)
    "qwen3-30b-a3b": dict(E=128, K=8, H=2048, I=768, S=32),
    "mixtral-8x7b": dict(E=8, K=2, H=4096, I=14336, S=4),
}
DRY_SHAPES = {"tiny": dict(E=8, K=2, H=64, I=32, S=4)}

# (block_m, block_n, block_k, group_m, num_warps, num_stages)
SMALL = [(16, 32, 128, 1, 4, 4), (16, 64, 128, 1, 4, 4), (16, 16, 256, 1, 4, 4), (16, 32, 256, 1, 4, 3),
         (16, 64, 64, 1, 4, 5), (16, 128, 128, 1, 4, 3), (16, 32, 128, 1, 2, 4), (16, 16, 128, 1, 2, 5),
         (16, 64, 256, 1, 4, 3)]
MID = [(32, 64, 128, 4, 4, 4), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (32, 128, 64, 4, 4, 4),
       (64, 64, 128, 8, 4, 3), (16, 64, 128, 1, 4, 4), (32, 64, 64, 4, 4, 5), (64, 128, 64, 8, 8, 3)]
LARGE = [(64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3), (128, 64, 64, 8, 4, 4),
         (128, 64, 128, 8, 8, 3), (128, 128, 64, 8, 8, 4), (64, 64, 128, 8, 4, 3), (128, 128, 32, 8, 4, 4),
         (64, 128, 64, 8, 8, 3)]
CANDIDATES = {1: SMALL, 7: SMALL, 64: SMALL + [(32, 64, 128, 4, 4, 4)], 512: MID, 4096: LARGE}


def log(*a):
    print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)


class Results:
    def __init__(self, out_dir):
        self.path = os.path.join(out_dir, "gpu.json") if out_dir else None
        self.data = {"env": {}, "ceilings": {}, "correctness": [], "speed": [], "stream_sync": {}, "errors": []}

    def save(self):
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1, default=str)


# ----------------------------------------------------------------------------- data

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


# ----------------------------------------------------------------------------- parts

def part_ceilings(torch, do_bench, res):
    m = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    mats = [torch.randn(m, m, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)]

    def matmul_ms():
        return do_bench(lambda: torch.matmul(*mats), warmup=50, rep=300, return_mode="median")

    # The matmul rate is read before and after the long copy and the higher one kept: right after
    # the copy it read 679 TFLOP/s where a fresh process read 786-801 (session 7), so one reading
    # after the copy under-states the peak that fractions are taken of.
    ms_before = matmul_ms()
    n_bytes = 4 << 30
    bufs = [torch.empty(n_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()]
    bufs.append(torch.empty_like(bufs[0]))
    ms = do_bench(lambda: bufs[1].copy_(bufs[0]), warmup=20, rep=200, return_mode="median")
    bw = 2 * n_bytes / (ms * 1e-3)
    bufs.clear()
    ms_after = matmul_ms()
    ms2 = min(ms_before, ms_after)
    peak = 2 * m ** 3 / (ms2 * 1e-3)
    mats.clear()
    torch.cuda.empty_cache()
    res.data["ceilings"] = dict(hbm_bytes_per_s=bw, copy_ms=ms, copy_bytes=2 * n_bytes,
                                bf16_flops_per_s=peak, matmul_ms=ms2, matmul_ms_before_copy=ms_before,
                                matmul_ms_after_copy=ms_after, matmul_shape=[m, m, m])
    log(f"ceilings: HBM {bw / 1e12:.2f} TB/s, bf16 matmul {peak / 1e12:.0f} TFLOP/s (before the copy "
        f"{2 * m ** 3 / ms_before * 1e-9:.0f}, after {2 * m ** 3 / ms_after * 1e-9:.0f})")


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


def part_moe(torch, R, res, shapes, dry, do_bench, deadline):
    from kt.gpu_ops import MoEConfig, fused_moe, pick_config
    from kt.gpu_ops import moe as M
    from kt.gpu_ops.configs import config_from_dict, shape_key
    dev = "cpu" if dry else "cuda"
    table = {}
    for name, sh in shapes.items():
        e2s = make_e2s(torch, sh, dev, 1)
        for dtype in ("bf16", "int8"):
            wts, (w13f, w2f) = make_weights(torch, sh, dtype, dev, 2)
            w_bytes_per_expert = sum(v[0].numel() * v.element_size() for v in wts.values())
            for t in (T_LIST if not dry else (1, 7, 33)):
                key = f"{name} {dtype} T={t}"
                gx = torch.Generator(device=dev).manual_seed(3 + t)
                x = torch.randn(t, sh["H"], device=dev, generator=gx).to(torch.bfloat16)
                ids, w = make_routing(torch, sh, t, e2s, dev, 4 + t)
                slots = gpu_slots(torch, ids, e2s)
                touched = len(touched_slots(slots))
                gpu_rows = int((slots >= 0).sum())
                entry = dict(shape=name, dtype=dtype, T=t, touched_slots=touched, gpu_token_slots=gpu_rows,
                             **sh)
                # ---- correctness
                try:
                    ref = ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
                    out = fused_moe(x, ids, w, e2s, **wts)
                    err = R.relative_error(out, ref)
                    finite = bool(torch.isfinite(out).all())
                    entry.update(rel_err_vs_fp32_gpu_ref=err, finite=finite)
                    n_sub = min(t, 16)
                    if (name != "mixtral-8x7b" or t == 7) and (t in (7, 4096, 33) or dry):
                        rows = torch.randperm(t, generator=torch.Generator().manual_seed(t))[:n_sub].to(dev)
                        kref = ref_kt_subset(torch, R, x, ids, w, e2s, w13f, w2f, rows)
                        entry["gpu_ref_vs_kt_reference"] = R.relative_error(ref[rows].cpu(), kref)
                        entry["rel_err_vs_kt_reference_subset"] = R.relative_error(out[rows].float().cpu(), kref)
                    if not dry:
                        torch.cuda.synchronize()
                        torch.cuda.set_sync_debug_mode("error")
                        try:
                            fused_moe(x, ids, w, e2s, **wts)
                            entry["host_sync_free"] = True
                        except RuntimeError as e:
                            entry["host_sync_free"] = False
                            entry["host_sync_error"] = str(e)[:300]
                        finally:
                            torch.cuda.set_sync_debug_mode("default")
                        g, gout = graph_of(torch, lambda: fused_moe(x, ids, w, e2s, **wts))
                        g.replay()
                        torch.cuda.synchronize()
                        entry["graph_bit_identical_to_eager"] = bool(torch.equal(gout, out))
                        del g
                    ok = finite and err <= 1e-2
                    entry["correct"] = ok
                    log(f"{key}: rel err {err:.2e} ({'ok' if ok else 'FAIL'}) touched {touched} slots, "
                        f"{gpu_rows} token-slots; sync-free {entry.get('host_sync_free')}; "
                        f"graph==eager {entry.get('graph_bit_identical_to_eager')}; "
                        f"vs kt.reference {entry.get('rel_err_vs_kt_reference_subset', '-')}")
                except Exception as e:
                    entry["correct"] = False
                    entry["error"] = repr(e)[:500]
                    res.data["errors"].append(f"{key}: {traceback.format_exc()[-1500:]}")
                    log(f"{key}: ERROR {e!r}")
                res.data["correctness"].append(dict(entry))
                res.save()
                if dry or not entry.get("correct"):
                    continue
                # ---- speed
                weight_bytes = touched * w_bytes_per_expert
                flops = 2 * gpu_rows * 3 * sh["H"] * sh["I"]
                heur = pick_config(t, sh["K"], sh["S"], sh["H"], sh["I"], dtype)
                # what fused_moe runs by default: this GPU's tuned table entry (if any)
                shipped = pick_config(t, sh["K"], sh["S"], sh["H"], sh["I"], dtype,
                                      M._device_table(torch.cuda.current_device()))
                cands = [MoEConfig(*c) for c in CANDIDATES[t]]
                for extra in (heur, shipped):
                    if extra not in cands:
                        cands.append(extra)
                timings = []
                for cfg in cands:
                    if time.time() > deadline:
                        log("  (time budget reached: remaining candidates skipped)")
                        break
                    try:
                        o = fused_moe(x, ids, w, e2s, **wts, config=cfg)
                        e_c = R.relative_error(o, ref)
                        g, _ = graph_of(torch, lambda: fused_moe(x, ids, w, e2s, **wts, config=cfg))
                        ms = do_bench(g.replay, warmup=5, rep=40, return_mode="median")
                        del g
                        timings.append(dict(config=cfg.to_dict(), us=ms * 1e3, rel_err=e_c, ok=e_c <= 1e-2))
                    except Exception as e:
                        timings.append(dict(config=cfg.to_dict(), error=repr(e)[:300]))
                good = [r for r in timings if r.get("ok")]
                sp = dict(shape=name, dtype=dtype, T=t, touched_slots=touched, gpu_token_slots=gpu_rows,
                          weight_bytes_touched=weight_bytes, gemm_flops=flops, candidates=timings,
                          heuristic=heur.to_dict())
                hr = [r for r in timings if r.get("config") == heur.to_dict() and r.get("ok")]
                if hr:
                    sp["heuristic_us"] = hr[0]["us"]
                sr = [r for r in timings if r.get("config") == shipped.to_dict() and r.get("ok")]
                sp["shipped"] = shipped.to_dict()
                if sr:
                    sp["shipped_us"] = sr[0]["us"]
                if good:
                    best = min(good, key=lambda r: r["us"])
                    sp["best"] = best
                    sec = best["us"] * 1e-6
                    c = ceilings_or_nan(res)
                    sp["hbm_fraction"] = weight_bytes / sec / c["hbm_bytes_per_s"]
                    sp["bf16_peak_fraction"] = flops / sec / c["bf16_flops_per_s"]
                    table.setdefault(shape_key(sh["H"], sh["I"], dtype), {})[str(t)] = best["config"]
                    # breakdown: each stage alone, and the fixed floor (every id -1: no tile runs)
                    try:
                        sp.update(stage_times(torch, do_bench, x, ids, w, e2s, wts, sh,
                                              config_from_dict(best["config"])))
                        sec_g = (sp["gate_up_us"] + sp["down_us"]) * 1e-6
                        sp["hbm_fraction_gemms_only"] = weight_bytes / sec_g / c["hbm_bytes_per_s"]
                        sp["bf16_peak_fraction_gemms_only"] = flops / sec_g / c["bf16_flops_per_s"]
                    except Exception as e:
                        sp["stage_error"] = repr(e)[:300]
                        res.data["errors"].append(f"{key} stages: {traceback.format_exc()[-1500:]}")
                    log(f"  speed: best {best['us']:.1f} us {best['config']} (heuristic "
                        f"{sp.get('heuristic_us', float('nan')):.1f} us); HBM {sp['hbm_fraction'] * 100:.0f} % "
                        f"of {weight_bytes / 1e6:.1f} MB; bf16 peak {sp['bf16_peak_fraction'] * 100:.1f} %; "
                        f"stages align/gate_up/down/combine {sp.get('align_us', float('nan')):.1f}/"
                        f"{sp.get('gate_up_us', float('nan')):.1f}/{sp.get('down_us', float('nan')):.1f}/"
                        f"{sp.get('combine_us', float('nan')):.1f} us, floor {sp.get('floor_us', float('nan')):.1f} us")
                res.data["speed"].append(sp)
                res.save()
            del wts, w13f, w2f
            if not dry:
                torch.cuda.empty_cache()
    res.data["tuned_table"] = table
    return table


def stage_times(torch, do_bench, x, ids, w, e2s, wts, sh, cfg):
    """Median graph-replay time of each stage of fused_moe alone, and of the whole op with every id -1."""
    from kt.gpu_ops import fused_moe
    from kt.gpu_ops import moe as M

    def t_us(fn):
        g, _ = graph_of(torch, fn)
        v = do_bench(g.replay, warmup=5, rep=20, return_mode="median") * 1e3
        del g
        return v

    cdt = M._compute_dtype(x.dtype, wts["w13"].dtype)
    none = torch.full_like(ids, -1)
    if isinstance(cfg, M.DirectConfig):
        e32 = e2s.to(torch.int32)
        hb = M.direct_gate_up(x, wts["w13"], wts.get("w13_scale"), ids, e32, cfg, cdt)
        out = torch.empty_like(x)
        return dict(
            align_us=0.0, combine_us=0.0,
            gate_up_us=t_us(lambda: M.direct_gate_up(x, wts["w13"], wts.get("w13_scale"), ids, e32, cfg, cdt)),
            down_us=t_us(lambda: M.direct_down(hb, wts["w2"], wts.get("w2_scale"), w, ids, e32, out, cfg)),
            floor_us=t_us(lambda: fused_moe(x, none, w, e2s, **wts, config=cfg)))
    al = cfg.align_m
    slot32, sid, bsl, npad = M.align_by_slot(ids, e2s, sh["S"], al)
    programs = M._PROGRAMS_PER_SM * M._num_sms(torch.cuda.current_device())
    srt = M.sorted_h_for(cfg.for_down())  # h's layout between the GEMMs, as fused_moe picks it
    hb = M.gate_up(x, wts["w13"], wts.get("w13_scale"), sid, bsl, npad, sh["K"], cfg, cdt, programs, al, srt)
    ydt = M.y_dtype_for(x.dtype)  # as fused_moe: the output has x's dtype
    yy = M.down(hb, wts["w2"], wts.get("w2_scale"), w, sid, bsl, npad, cfg.for_down(), programs, ydt, al, srt)
    out = torch.empty_like(x)
    return dict(
        align_us=t_us(lambda: M.align_by_slot(ids, e2s, sh["S"], al)),
        gate_up_us=t_us(lambda: M.gate_up(x, wts["w13"], wts.get("w13_scale"), sid, bsl, npad, sh["K"], cfg,
                                          cdt, programs, al, srt)),
        down_us=t_us(lambda: M.down(hb, wts["w2"], wts.get("w2_scale"), w, sid, bsl, npad, cfg.for_down(),
                                    programs, ydt, al, srt)),
        combine_us=t_us(lambda: M.combine(yy, slot32, out)),
        floor_us=t_us(lambda: fused_moe(x, none, w, e2s, **wts, config=cfg)))


# ----------------------------------------------------------------------------- tune: stages apart

# Direct path: gate+up (kernel, block_n, block_k, num_warps, num_stages), down (down_block_n,
# down_block_k, down_num_warps, down_num_stages). Sorted path, per block_m: gate+up and down each
# (block_n, block_k, group_m, num_warps, num_stages). The direct GEMV loops run unpipelined at
# stages 1 (until session 15 the pairs' num_stages did nothing: Triton pipelines a loop without
# tl.dot only through tl.range's num_stages); the later entries keep 2-5 k steps in flight.
DIRECT_GU = [("scan", 32, 256, 4, 3), ("scan", 32, 128, 4, 4), ("scan", 64, 128, 4, 3),
             ("pairs", 4, 512, 4, 1), ("pairs", 8, 512, 4, 1), ("pairs", 4, 1024, 4, 1),
             ("pairs", 2, 1024, 2, 1), ("pairs", 8, 1024, 8, 1), ("pairs", 4, 2048, 8, 1),
             ("pairs", 4, 512, 4, 3), ("pairs", 4, 256, 4, 4), ("pairs", 8, 256, 4, 4), ("pairs", 4, 1024, 4, 3),
             ("pairs", 2, 512, 2, 4), ("pairs", 8, 512, 8, 3), ("pairs", 16, 256, 8, 4), ("pairs", 2, 1024, 4, 3),
             ("pairs", 1, 1024, 2, 4), ("pairs", 2, 1024, 4, 4)]
DIRECT_DOWN = [(16, 1024, 4, 1), (8, 1024, 4, 1), (4, 1024, 2, 1), (8, 512, 2, 1), (2, 1024, 2, 1), (4, 512, 4, 1),
               (4, 1024, 4, 1), (16, 2048, 8, 1),
               (2, 1024, 2, 3), (2, 512, 2, 4), (4, 512, 4, 4), (4, 1024, 4, 3), (8, 512, 4, 4), (8, 256, 4, 6),
               (16, 512, 8, 3), (2, 256, 2, 6), (4, 256, 2, 5), (1, 1024, 2, 4), (2, 2048, 4, 4)]
# the block_k 256 entries: more weight bytes in flight per program, for the memory-bound
# small-block_m cases (an int8 tile of a given shape is half a bf16 tile's bytes); the narrow, deep-
# pipelined down tiles (session 15): more programs, all of a decode-sized slot's k steps in flight
SORTED_GU = [(64, 64, 8, 4, 4), (64, 64, 8, 8, 4), (128, 64, 8, 8, 3), (128, 64, 8, 8, 4), (64, 128, 8, 4, 3),
             (64, 128, 8, 8, 3), (128, 32, 8, 8, 4), (32, 64, 8, 4, 4), (64, 256, 8, 4, 3), (32, 256, 8, 4, 4),
             (32, 128, 8, 4, 6), (64, 128, 8, 4, 5)]
SORTED_DOWN = [(128, 64, 8, 8, 4), (128, 128, 8, 8, 3), (256, 64, 8, 8, 3), (128, 64, 8, 4, 4), (64, 128, 8, 4, 4),
               (256, 128, 8, 8, 2), (128, 32, 8, 4, 5), (64, 64, 8, 4, 4), (128, 256, 8, 4, 3), (64, 256, 8, 4, 3),
               (32, 256, 8, 4, 3), (64, 128, 8, 4, 6), (32, 128, 8, 4, 6), (128, 128, 8, 4, 6)]
# int8 weights only: the same gate+up tiles with two-level int8 activations on the int8 tensor cores
# (MoEConfig.a8; block_k >= 64: one wgmma step takes 32 int8 k); the sixth field is a8
SORTED_GU_A8 = [(64, 64, 8, 8, 4, True), (64, 128, 8, 8, 3, True), (128, 64, 8, 8, 3, True),
                (64, 64, 8, 4, 4, True), (32, 128, 8, 4, 4, True), (64, 128, 8, 4, 4, True),
                (128, 64, 8, 8, 4, True), (128, 128, 8, 8, 3, True), (32, 64, 8, 4, 4, True),
                (64, 256, 8, 8, 3, True), (128, 128, 8, 16, 3, True), (128, 64, 8, 4, 4, True),
                (64, 128, 4, 8, 4, True)]
# (T=7 was swept in session 5 and lost to the sorted path, again in session 16; the direct path now
# stops at T*K = 8 or T = 2: configs.takes_direct)
TUNE_CASES = ([("qwen3-30b-a3b", d, t) for d in ("bf16", "int8") for t in (1, 4096)]
              + [("qwen3-30b-a3b", "bf16", 512), ("mixtral-8x7b", "bf16", 1)])
# decode-sized sorted T: int8 weights at T=64 ran at half the bandwidth a plain read of the same
# bytes reaches (gpu_decode_floor.py, session 11), with 16-row blocks re-reading a slot's weights;
# T=16 and 32 (session 16): batched decode between the table's 7 and 64, which used the 64 entry
TUNE_BM = {7: (16,), 16: (16,), 32: (16,), 64: (16, 32), 512: (32, 64), 4096: (64, 128)}
# (tma, flatten) tried on the best tiles of each sorted-path kernel
FLAGS = [(False, False), (True, False), (True, True)]


def pick_flags(gate_up_rows, down_rows):
    """(tma, flatten, down_flatten, estimated us) from the two kernels' flag sweeps (rows of
    ``{"cand": [tma, flatten], "us": ...}``): one tma for both kernels (MoEConfig has one), the
    value whose best gate+up plus best down is least; (.., None) when either sweep has no time."""
    best = None
    for tma in (False, True):
        g = [r for r in gate_up_rows if "us" in r and r["cand"][0] == tma]
        d = [r for r in down_rows if "us" in r and r["cand"][0] == tma]
        if not (g and d):
            continue
        gb, db = min(g, key=lambda r: r["us"]), min(d, key=lambda r: r["us"])
        est = gb["us"] + db["us"]
        if best is None or est < best[3]:
            best = (tma, bool(gb["cand"][1]), bool(db["cand"][1]), est)
    return best if best is not None else (False, False, False, None)


def parse_shape(spec: str):
    """"NAME=E,K,H,I,S" -> (NAME, shape dict) for SHAPES."""
    try:
        name, dims = spec.split("=")
        e, k, h, i, s = (int(v) for v in dims.split(","))
    except ValueError:
        raise SystemExit(f"--add-shape: expected NAME=E,K,H,I,S (integers), got {spec!r}") from None
    if min(e, k, h, i, s) <= 0 or k > e or s > e or not name:
        raise SystemExit(f"--add-shape {spec!r}: need positive sizes with top-k and slots at most E")
    return name, dict(E=e, K=k, H=h, I=i, S=s)


def gu_config(MoEConfig, bm, cand, **kw):
    """The gate+up MoEConfig of a sweep candidate (block_n, block_k, group_m, num_warps, num_stages
    [, a8])."""
    return MoEConfig(bm, *cand[:5], a8=bool(cand[5]) if len(cand) > 5 else False, **kw)


def sweep_act_quant2(M, x, t_us):
    """act_quant2 alone with other elements per program and warps."""
    rows = [dict(elems=elems, warps=warps, us=t_us(lambda: M.act_quant2(x, elems, warps)))
            for elems in (2048, 4096, 8192, 16384) for warps in (2, 4, 8, 16)]
    log("  act_quant2 (elems, warps): " + ", ".join(f"({r['elems']}, {r['warps']}) {r['us']:.1f}" for r in rows))
    return rows


def pick_pair(MoEConfig, per_bm):
    """(config, {name: config}) from the per-block_m sweeps: the gate+up of one block_m and the down
    of another (each slot's rows are then padded to the larger, MoEConfig.down_block_m) whose flag
    sweeps' times sum least under one tma value; the extra dict holds the best pair of one block_m
    when that differs, so the whole-op comparison decides (each kernel was timed at its own
    alignment)."""
    def build(bg, bd):
        g, d = per_bm[bg]["gu"]["cand"], per_bm[bd]["dn"]["cand"]
        tma, gflat, dflat, est = pick_flags(per_bm[bg]["gate_up_flags"], per_bm[bd]["down_flags"])
        if est is None:  # the flag sweeps ran out of time: the plain tiles
            tma, gflat, dflat, est = False, False, False, per_bm[bg]["gu"]["us"] + per_bm[bd]["dn"]["us"]
        cfg = gu_config(MoEConfig, bg, g, down_block_n=d[0], down_block_k=d[1], down_group_m=d[2],
                        down_num_warps=d[3], down_num_stages=d[4], tma=tma, flatten=gflat, down_flatten=dflat,
                        down_block_m=None if bd == bg else bd)
        return est, cfg

    pairs = {(bg, bd): build(bg, bd) for bg in per_bm for bd in per_bm}
    best = min(pairs, key=lambda p: pairs[p][0])
    same = min((p for p in pairs if p[0] == p[1]), key=lambda p: pairs[p][0])
    return pairs[best][1], ({} if same == best else {"tuned_same_bm": pairs[same][1]})


def write_tuned_table(out_dir, gpu_name, shipped, found):
    """The table a tune leaves: the one this GPU used (``shipped``) with the tuned entries
    (``found``, {shape key: {T: config}}) laid over it, written to out_dir/<gpu>_tuned.json (<gpu>
    from kt's table names, else "gpu"); use it with KT_GPU_TABLE=<file>, or ship it as
    kt/gpu_ops/configs/<name>.json. Returns the path."""
    from kt.gpu_ops.configs import table_name

    merged = {k: dict(v) for k, v in shipped.items()}
    for k, v in found.items():
        merged.setdefault(k, {}).update(v)
    merged["_comment"] = (f"Tuned on an {gpu_name} by benchmarks/bench_gpu.py (S=32 slots for qwen3-30b-a3b, "
                          "S=4 for mixtral, --add-shape shapes as given); key H{H}_I{I}_{weight dtype}, then "
                          "T; entries with \"path\": \"direct\" are the direct path's (configs.takes_direct).")
    path = os.path.join(out_dir, f"{table_name(gpu_name) or 'gpu'}_tuned.json")
    with open(path, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True)
    return path


def part_tune(torch, R, res, do_bench, deadline, shipped, dev="cuda", cases=None):
    """Sweep each kernel of a path alone, combine the best, and time it against the shipped table's
    config (interleaved rounds). Returns table entries {shape key: {T: config dict}} that beat it."""
    from dataclasses import replace

    from kt.gpu_ops import DirectConfig, MoEConfig, fused_moe, pick_config
    from kt.gpu_ops import moe as M
    from kt.gpu_ops.configs import config_from_dict, shape_key, takes_direct

    def t_us(fn):
        g, _ = graph_of(torch, fn)
        v = do_bench(g.replay, warmup=5, rep=20, return_mode="median") * 1e3
        del g
        return v

    def sweep(label, fn, cands):
        rows = []
        for c in cands:
            if time.time() > deadline:
                break
            try:
                rows.append(dict(cand=list(c), us=t_us(lambda: fn(c))))
            except Exception as e:
                rows.append(dict(cand=list(c), error=repr(e)[:200]))
        ok = [r for r in rows if "us" in r]
        log(f"  {label}: " + ", ".join(f"{r['cand']} {r['us']:.1f}" for r in ok))
        return rows, (min(ok, key=lambda r: r["us"]) if ok else None)

    found = {}
    for name, dtype, t in (TUNE_CASES if cases is None else cases):
        if time.time() > deadline:
            log("tune: time budget reached")
            break
        sh = SHAPES[name]
        key = shape_key(sh["H"], sh["I"], dtype)
        e2s = make_e2s(torch, sh, dev, 1)
        wts, (w13f, w2f) = make_weights(torch, sh, dtype, dev, 2)
        gx = torch.Generator(device=dev).manual_seed(3 + t)
        x = torch.randn(t, sh["H"], device=dev, generator=gx).to(torch.bfloat16)
        ids, w = make_routing(torch, sh, t, e2s, dev, 4 + t)
        ref = ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
        slots = gpu_slots(torch, ids, e2s)
        touched = len(touched_slots(slots))
        gpu_rows = int((slots >= 0).sum())
        w_bytes = touched * sum(v[0].numel() * v.element_size() for v in wts.values())
        flops = 2 * gpu_rows * 3 * sh["H"] * sh["I"]
        cdt = M._compute_dtype(x.dtype, wts["w13"].dtype)
        s13, s2 = wts.get("w13_scale"), wts.get("w2_scale")
        entry = dict(shape=name, dtype=dtype, T=t, touched_slots=touched, gpu_token_slots=gpu_rows,
                     weight_bytes_touched=w_bytes, gemm_flops=flops)
        log(f"tune {name} {dtype} T={t}")
        if dtype == "int8":  # the two-level activation quantiser alone (part of every a8 gate+up)
            entry["act_quant2_us"] = t_us(lambda: M.act_quant2(x))
            log(f"  act_quant2 alone {entry['act_quant2_us']:.1f} us")
            entry["act_quant2_sweep"] = sweep_act_quant2(M, x, t_us)
        if takes_direct(t, sh["K"]):
            e32 = e2s.to(torch.int32)
            base = pick_config(t, sh["K"], sh["S"], sh["H"], sh["I"], dtype)
            hb = M.direct_gate_up(x, wts["w13"], s13, ids, e32, base, cdt)
            out = torch.empty_like(x)
            gu_rows, gu = sweep("gate+up", lambda c: M.direct_gate_up(
                x, wts["w13"], s13, ids, e32, replace(base, gate_up=c[0], block_n=c[1], block_k=c[2],
                                                      num_warps=c[3], num_stages=c[4]), cdt), DIRECT_GU)
            dn_rows, dn = sweep("down", lambda c: M.direct_down(
                hb, wts["w2"], s2, w, ids, e32, out, replace(base, down_block_n=c[0], down_block_k=c[1],
                                                             down_num_warps=c[2], down_num_stages=c[3])),
                DIRECT_DOWN)
            entry.update(gate_up_sweep=gu_rows, down_sweep=dn_rows)
            if not (gu and dn):
                res.data.setdefault("tune", []).append(entry)
                continue
            extra = {}
            tuned = DirectConfig(gate_up=gu["cand"][0], block_n=gu["cand"][1], block_k=gu["cand"][2],
                                 num_warps=gu["cand"][3], num_stages=gu["cand"][4], down_block_n=dn["cand"][0],
                                 down_block_k=dn["cand"][1], down_num_warps=dn["cand"][2],
                                 down_num_stages=dn["cand"][3])
        elif t not in TUNE_BM:  # a sorted-path T without a block_m sweep (e.g. qwen3 T=7 since
            # the direct path stops at T = 2 for K = 8): nothing to tune here
            log(f"  sorted path at T={t}: no block_m sweep listed (TUNE_BM); skipped")
            continue
        else:
            per_bm = {}
            programs = (M._INTERPRETER_PROGRAMS if dev == "cpu"
                        else M._PROGRAMS_PER_SM * M._num_sms(torch.cuda.current_device()))
            for bm in TUNE_BM[t]:
                slot32, sid, bsl, npad = M.align_by_slot(ids, e2s, sh["S"], bm)
                hb = M.gate_up(x, wts["w13"], s13, sid, bsl, npad, sh["K"], MoEConfig(block_m=bm), cdt, programs)
                # h in sorted order too, for the down candidates that fused_moe would run on it
                hbs = M.gate_up(x, wts["w13"], s13, sid, bsl, npad, sh["K"], MoEConfig(block_m=bm), cdt, programs,
                                sorted_h=True)

                def down_of(cfg):
                    srt = M.sorted_h_for(cfg)
                    return M.down(hbs if srt else hb, wts["w2"], s2, w, sid, bsl, npad, cfg, programs,
                                  M.y_dtype_for(x.dtype), sorted_h=srt)
                gu_rows, gu = sweep(f"bm {bm} gate+up", lambda c: M.gate_up(
                    x, wts["w13"], s13, sid, bsl, npad, sh["K"], gu_config(MoEConfig, bm, c), cdt, programs),
                    SORTED_GU + (SORTED_GU_A8 if dtype == "int8" else []))
                dn_rows, dn = sweep(f"bm {bm} down", lambda c: down_of(MoEConfig(bm, *c)), SORTED_DOWN)
                if gu and dn:
                    # the best tiles again with TMA weight tiles and a flattened tile loop
                    gf_rows, _ = sweep(f"bm {bm} gate+up tma/flatten", lambda f: M.gate_up(
                        x, wts["w13"], s13, sid, bsl, npad, sh["K"],
                        gu_config(MoEConfig, bm, gu["cand"], tma=f[0], flatten=f[1]), cdt, programs), FLAGS)
                    df_rows, _ = sweep(f"bm {bm} down tma/flatten", lambda f: down_of(
                        MoEConfig(bm, *dn["cand"], tma=f[0], flatten=f[1])), FLAGS)
                    tma, gflat, dflat, est = pick_flags(gf_rows, df_rows)
                    if est is None:  # the flag sweeps ran out of time: the plain tiles
                        tma, gflat, dflat, est = False, False, False, gu["us"] + dn["us"]
                    per_bm[bm] = dict(gate_up_sweep=gu_rows, down_sweep=dn_rows, gu=gu, dn=dn,
                                      gate_up_flags=gf_rows, down_flags=df_rows,
                                      flags=dict(tma=tma, flatten=gflat, down_flatten=dflat), est_us=est)
            entry["per_block_m"] = {str(k): v for k, v in per_bm.items()}
            if not per_bm:
                res.data.setdefault("tune", []).append(entry)
                continue
            tuned, extra = pick_pair(MoEConfig, per_bm)
        # ---- the tuned pair vs the shipped table's config (and the old sorted config at decode T)
        variants = {"tuned": tuned, **extra,
                    "shipped": pick_config(t, sh["K"], sh["S"], sh["H"], sh["I"], dtype, shipped)}
        old = (shipped.get(key) or {}).get(str(t))
        if old and old.get("path") != "direct" and not isinstance(variants["shipped"], MoEConfig):
            variants["sorted_shipped"] = config_from_dict(old)
        graphs, cmp = {}, {}
        for vn, cfg in variants.items():
            o = fused_moe(x, ids, w, e2s, **wts, config=cfg)
            err = R.relative_error(o, ref)
            cmp[vn] = dict(config=cfg.to_dict(), rel_err=err, us=[])
            if err <= 1e-2:
                graphs[vn] = graph_of(torch, lambda: fused_moe(x, ids, w, e2s, **wts, config=cfg))[0]
        for _ in range(3):
            for vn, g in graphs.items():
                cmp[vn]["us"].append(do_bench(g.replay, warmup=5, rep=30, return_mode="median") * 1e3)
        c = ceilings_or_nan(res)
        for vn, r in cmp.items():
            if r["us"]:
                r["min_us"], r["median_us"] = min(r["us"]), sorted(r["us"])[len(r["us"]) // 2]
                r["hbm_fraction"] = w_bytes / (r["min_us"] * 1e-6) / c["hbm_bytes_per_s"]
                r["bf16_peak_fraction"] = flops / (r["min_us"] * 1e-6) / c["bf16_flops_per_s"]
        entry["compare"] = cmp
        del graphs
        log("  " + "; ".join(f"{vn} {r.get('min_us', float('nan')):.1f} us (err {r['rel_err']:.1e}, HBM "
                             f"{r.get('hbm_fraction', float('nan')) * 100:.0f} %, peak "
                             f"{r.get('bf16_peak_fraction', float('nan')) * 100:.1f} %)" for vn, r in cmp.items()))
        mine = [vn for vn in cmp if vn.startswith("tuned") and cmp[vn].get("min_us") is not None]
        others = [r.get("min_us", 1e30) for vn, r in cmp.items() if not vn.startswith("tuned")]
        if mine:
            best = min(mine, key=lambda vn: cmp[vn]["min_us"])
            if cmp[best]["min_us"] < min(others):
                found.setdefault(key, {})[str(t)] = variants[best].to_dict()
        res.data.setdefault("tune", []).append(entry)
        res.save()
        del wts, w13f, w2f
        if dev != "cpu":
            torch.cuda.empty_cache()
    return found


# ----------------------------------------------------------------------------- stream sync

_OPS = {}


def _worker_fn():
    """A Numba nogil worker: wait "start", out = in * 3 + 1 on the pinned buffers, set "done"."""
    if "worker" in _OPS:
        return _OPS["worker"]
    import numpy as np
    from numba import njit

    from kt.gpu_ops.stream_sync import _numba_ops

    ops = _numba_ops()
    spin, store, load = ops["spin_wait_clear"], ops["store_flag"], ops["load_flag"]

    @njit(nogil=True)
    def worker(start, done, stop, inp, out):
        n = 0
        while True:
            if spin(start, 100000):
                for j in range(inp.size):
                    out[j] = inp[j] * np.float32(3.0) + np.float32(1.0)
                store(done, 1)
                n += 1
            elif load(stop) == 1:
                return n

    _OPS["worker"] = worker
    return worker


def part_stream_sync(torch, res, n_replays=220, warm=20):
    import numpy as np

    from kt.gpu_ops import CpuSignal

    worker = _worker_fn()
    dev = "cuda"
    n = 4096
    x = torch.zeros(n, device=dev)
    pin_in = torch.zeros(n, pin_memory=True)
    pin_out = torch.zeros(n, pin_memory=True)
    cbuf = torch.zeros(n, device=dev)
    stop = np.zeros(16, np.int32)
    xs = torch.randn(n_replays, n, device=dev)
    expected = xs * 2.0 + (xs * 3.0 + 1.0)
    out = {}

    def step(sig):
        if sig is None:
            return x * 2.0 + cbuf
        pin_in.copy_(x, non_blocking=True)
        sig.signal_start()
        y = x * 2.0
        sig.wait_done()
        cbuf.copy_(pin_out, non_blocking=True)
        return y + cbuf

    def run_mode(mode):
        sig = None if mode == "none" else CpuSignal(mode)
        r = dict(mode=sig.mode if sig else "none (same graph without the CPU part)")
        th = None
        stop[0] = 0
        counts = []
        if sig:
            th = threading.Thread(target=lambda: counts.append(worker(
                sig.start_address, sig.done_address, stop.ctypes.data, pin_in.numpy(), pin_out.numpy())))
            th.start()
        finished = threading.Event()

        def watchdog():
            if not finished.wait(60):
                r["watchdog"] = "fired: releasing the stream"
                while not finished.is_set():
                    if sig:
                        sig.set_done()
                    time.sleep(0.001)
        wd = threading.Thread(target=watchdog, daemon=True)
        wd.start()
        try:
            # eager, pipelined
            ok = True
            cb0 = cbuf.clone()
            res_e = torch.empty_like(xs)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for i in range(n_replays):
                if i == warm:
                    e0.record()
                x.copy_(xs[i])
                res_e[i].copy_(step(sig))
            e1.record()
            torch.cuda.synchronize()
            r["eager_us_per_step"] = e0.elapsed_time(e1) * 1e3 / (n_replays - warm)
            if sig:
                ok &= bool(torch.equal(res_e, expected))
                r["eager_correct"] = bool(torch.equal(res_e, expected))
                r["eager_max_abs_err"] = float((res_e - expected).abs().max())
            # graph
            cbuf.copy_(cb0)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gout = step(sig)
            res_g = torch.empty_like(xs)
            for i in range(n_replays):
                if i == warm:
                    e0.record()
                x.copy_(xs[i])
                g.replay()
                res_g[i].copy_(gout)
            e1.record()
            torch.cuda.synchronize()
            r["graph_us_per_step"] = e0.elapsed_time(e1) * 1e3 / (n_replays - warm)
            if sig:
                r["graph_correct"] = bool(torch.equal(res_g, expected))
                r["graph_max_abs_err"] = float((res_g - expected).abs().max())
            # latency: one replay at a time, synchronised
            t0 = time.perf_counter()
            for i in range(50):
                g.replay()
                torch.cuda.synchronize()
            r["graph_latency_us_synced"] = (time.perf_counter() - t0) * 1e6 / 50
            r["replays"] = n_replays
            del g
        finally:
            finished.set()
            stop[0] = 1
            if th:
                th.join(10)
                r["worker_rounds"] = counts[0] if counts else None
        return r

    for mode in ("none", "memop", "hostfunc"):
        try:
            out[mode] = run_mode(mode)
            log(f"stream_sync {mode}: {out[mode]}")
        except Exception as e:
            out[mode] = dict(error=repr(e)[:500])
            res.data["errors"].append(f"stream_sync {mode}: {traceback.format_exc()[-1500:]}")
            log(f"stream_sync {mode}: ERROR {e!r}")
        res.data["stream_sync"] = out
        res.save()


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for gpu.json, h200.json")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop tuning after this many seconds")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: ceilings,moe,sync")
    ap.add_argument("--tune", action="store_true", help="run the per-stage tuning part (writes h200_tuned.json)")
    ap.add_argument("--tune-budget-s", type=float, default=300.0, help="stop the tuning part after this long")
    ap.add_argument("--tune-T", default="", help="comma list: tune only these T (default: all of TUNE_CASES)")
    ap.add_argument("--tune-cases", default="",
                    help="comma list of shape:dtype:T to tune instead of TUNE_CASES (e.g. mixtral-8x7b:int8:64)")
    ap.add_argument("--add-shape", action="append", default=[], metavar="NAME=E,K,H,I,S",
                    help="another layer shape for --tune-cases (experts, top-k, hidden, intermediate, GPU "
                         "slots), e.g. deepseek-v3=256,8,7168,2048,64; repeatable")
    args = ap.parse_args()
    for spec in args.add_shape:
        SHAPES.update([parse_shape(spec)])
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    import torch

    from kt import reference as R

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    res = Results(args.out)
    import triton

    res.data["env"] = dict(torch=torch.__version__, triton=triton.__version__, python=sys.version.split()[0],
                           device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                           cpus=os.cpu_count())
    log("env", res.data["env"])
    skip = set(filter(None, args.skip.split(",")))
    if args.dry_run:
        part_moe(torch, R, res, DRY_SHAPES, True, None, t_start + 1e9)
        res.save()
        bad = [c for c in res.data["correctness"] if not c.get("correct")]
        log(f"dry run: {len(res.data['correctness'])} cases, {len(bad)} failed")
        return 1 if bad else 0
    from triton.testing import do_bench

    if "ceilings" not in skip:
        part_ceilings(torch, do_bench, res)
        res.save()
    if "moe" not in skip:
        table = part_moe(torch, R, res, SHAPES, False, do_bench, t_start + args.budget_s)
        res.save()
        if args.out:
            table = dict(table)
            table["_comment"] = ("Tuned on an H200 by benchmarks/bench_gpu.py (S=32 slots for qwen3-30b-a3b, "
                                 "S=4 for mixtral); key H{H}_I{I}_{weight dtype}, then T.")
            with open(os.path.join(args.out, "h200.json"), "w") as f:
                json.dump(table, f, indent=1, sort_keys=True)
    if args.tune:
        from kt.gpu_ops.configs import table_for_device

        gpu_name = torch.cuda.get_device_name()
        shipped, source = table_for_device(gpu_name)  # the table this GPU uses now (KT_GPU_TABLE first)
        log(f"tune: {gpu_name}, starting from {source}")
        keep_t = {int(v) for v in args.tune_T.split(",") if v}
        cases = TUNE_CASES
        if args.tune_cases:
            cases = [(n, d, int(t)) for n, d, t in (c.split(":") for c in args.tune_cases.split(","))]
            unknown = [c for c in cases if c[0] not in SHAPES or c[1] not in ("bf16", "int8")]
            if unknown:
                raise SystemExit(f"--tune-cases: unknown shape or dtype in {unknown}; shapes {sorted(SHAPES)}")
        cases = [c for c in cases if not keep_t or c[2] in keep_t]
        found = part_tune(torch, R, res, do_bench, time.time() + args.tune_budget_s, shipped, cases=cases)
        res.save()
        if args.out:
            log(f"tune: wrote {write_tuned_table(args.out, gpu_name, shipped, found)}")
    if "sync" not in skip:
        part_stream_sync(torch, res)
    res.data["wall_s"] = time.time() - t_start
    res.save()
    # short table last
    print("\nshape            dtype T     err       best_us  HBM%   peak%  config")
    for sp in res.data["speed"]:
        b = sp.get("best", {})
        c = b.get("config", {})
        cfg = "/".join(str(c.get(k)) for k in ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages"))
        err = next((x.get("rel_err_vs_fp32_gpu_ref") for x in res.data["correctness"]
                    if (x["shape"], x["dtype"], x["T"]) == (sp["shape"], sp["dtype"], sp["T"])), None)
        print(f"{sp['shape']:16s} {sp['dtype']:5s} {sp['T']:<5d} {err or float('nan'):.2e} "
              f"{b.get('us', float('nan')):8.1f} {sp.get('hbm_fraction', float('nan')) * 100:5.1f} "
              f"{sp.get('bf16_peak_fraction', float('nan')) * 100:6.1f}  {cfg}")
    for k, v in res.data["stream_sync"].items():
        print(f"sync {k:9s}: graph {v.get('graph_us_per_step', float('nan')):.1f} us/step, eager "
              f"{v.get('eager_us_per_step', float('nan')):.1f}, correct {v.get('graph_correct')}")
    print(f"errors: {len(res.data['errors'])}; wall {res.data['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
