"""bench_e2e.py's measurements of one configuration: correctness, TTFT, decode (eager and CUDA
graph), the decode floor, the per-layer overlap, long prefills with and without layer-wise prefill.
docs/performance.md says what each figure means.
"""
from __future__ import annotations

import gc
import time
import traceback

import numpy as np
import torch

from _e2e_report import RunConfig
from _e2e_run import Ctx, rss_gib
from kt.testing.e2e_model import DecodeState, FusedGPUExperts, HybridExperts, KVCache


# ----------------------------------------------------------------------------- measurements

def _timed(fn, sync, reps: int, warm: int = 1):
    for _ in range(warm):
        fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _logit_compare(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """out, ref [T, V] fp32. KL(ref || out) per position, relative error, top-1 agreement."""
    lr, lo = torch.log_softmax(ref.double(), -1), torch.log_softmax(out.double(), -1)
    kl = (lr.exp() * (lr - lo)).sum(-1)
    rel = (out.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)
    return dict(positions=int(ref.shape[0]), kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                rel_err_mean=float(rel.mean()), rel_err_max=float(rel.max()),
                top1_agree=float((out.argmax(-1) == ref.argmax(-1)).double().mean()))


def measure_correctness(ctx: Ctx, rc: RunConfig, entry: dict) -> None:
    model = ctx.model
    if rc.all_gpu:
        # the references: the all-GPU bf16 run on the same (dequantised) weights, both routings
        saved = model.router_bias
        for routing in ("uniform", "skewed"):
            ctx.set_routing(routing)
            ctx.ref_logits[routing] = model.prefill(ctx.corr_tokens[None], all_logits=True)[0].float().cpu()
            ctx.results.data["correctness_reference"][routing] = dict(
                config=rc.name, experts_backend=model.experts.kind, positions=int(ctx.corr_tokens.numel()))
        if ctx.cuda:
            # how far this random 48-layer model moves under a perturbation of bf16-rounding size:
            # the same all-GPU run with the experts' exact INT8 values (q * row scale in fp32 in the
            # kernel) instead of those values rounded to bf16 -- the yardstick for the hybrid's KL
            saved_experts = model.experts
            try:
                model.experts = FusedGPUExperts(ctx.expert_sets("int8"), ctx.layer_set, ctx.device, "int8")
                sens = {}
                for routing in ("uniform", "skewed"):
                    ctx.set_routing(routing)
                    out = model.prefill(ctx.corr_tokens[None], all_logits=True)[0].float().cpu()
                    sens[routing] = _logit_compare(out, ctx.ref_logits[routing])
                ctx.results.data["correctness_reference"]["bf16_rounding_sensitivity"] = sens
                ctx.log("all-GPU int8-exact vs bf16 weights (the model's sensitivity): " + ", ".join(
                    f"{r} KL {v['kl_mean']:.3g} rel {v['rel_err_mean']:.3g}" for r, v in sens.items()))
            except Exception as exc:  # a yardstick only: never fail the run over it
                ctx.results.data["correctness_reference"]["bf16_rounding_sensitivity"] = f"error: {exc!r}"
            finally:
                model.experts = saved_experts
                torch.cuda.empty_cache()
        model.router_bias = saved
        entry["correctness"] = "reference for the other configurations"
        return
    if rc.scheme != "int8":
        entry["correctness"] = "n/a: different weights than the all-GPU reference (INT8 dequantised)"
        return
    ref = ctx.ref_logits.get(rc.routing)
    if ref is None:
        entry["correctness"] = "n/a: no all-GPU reference (gpu100_bf16 run missing or failed)"
        return
    out = model.prefill(ctx.corr_tokens[None], all_logits=True)[0].float().cpu()
    ctx.sync()
    entry["correctness"] = dict(vs="gpu100_bf16 (same weights, dequantised to bf16)",
                                deferral_changes_math=rc.deferred > 0, **_logit_compare(out, ref))
    # the same with two-level int8 activations (the CPU experts' accuracy mode: a layer error of
    # 0.013 instead of 0.023): what is left is the weights' own int8 error and the GPU/CPU arithmetic
    cpus = {id(layer.cpu): layer.cpu for layer in getattr(model.experts, "layers", ())
            if getattr(layer, "cpu", None) is not None}
    if cpus:
        try:
            for c in cpus.values():
                c.activations = "int8x2"
            out2 = model.prefill(ctx.corr_tokens[None], all_logits=True)[0].float().cpu()
            ctx.sync()
            entry["correctness_int8x2"] = _logit_compare(out2, ref)
        finally:
            for c in cpus.values():
                c.activations = "int8"


def measure_ttft(ctx: Ctx, rc: RunConfig, entry: dict, backend, gpu_mask):
    """Prefill of the P-token prompt at batch 1 (+ first token): cold, then warm. Returns the cache.
    gpu_mask [L, E]: the planned placement; the prompt's routing is checked against it."""
    from kt.placement import ExpertStats

    cfg, model, p = ctx.cfg, ctx.model, ctx.args.prompt_tokens
    cache = KVCache.empty(cfg, 1, ctx.max_len, ctx.device)
    times, first = [], None
    for rep in range(2):
        stats = ExpertStats(cfg.num_layers, cfg.num_experts) if rep == 0 and gpu_mask is not None else None
        model.stats = stats
        ctx.sync()
        t0 = time.perf_counter()
        logits = model.prefill(ctx.prompt[None], cache)
        first = logits.argmax(-1)
        first_host = int(first[0])  # the first token reaches the host: this is the TTFT point
        times.append(time.perf_counter() - t0)
        model.stats = None
        if stats is not None:
            c = stats.counts
            entry["gpu_hit_share_prompt"] = float((c * gpu_mask).sum() / c.sum())
    del first_host
    entry["ttft_s"] = times[-1]
    entry["ttft_cold_s"] = times[0]
    entry.setdefault("prefill", {})[f"{p}_off"] = dict(tokens=p, layerwise=False, seconds=times[-1],
                                                      tok_s=p / times[-1], includes_first_token=True)
    return cache, first


def _capture_step(ctx: Ctx, st: DecodeState):
    from kt.layer import GraphRunner

    model = ctx.model
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        model.decode_step(st)  # warm on the side stream (allocator pools, Triton, bridges)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    runner = GraphRunner()
    with runner.capture():
        model.decode_step(st)
    torch.cuda.synchronize()
    return runner


def _drop_pending(backend) -> None:
    """After a failed capture: forget deferred work a captured layer left in the chain (it never
    ran, so waiting for it would hang the stream)."""
    for layer in getattr(backend, "layers", []):
        if layer.chain is not None:
            layer.chain.take()


def _run_steps(ctx: Ctx, step, max_steps: int, cap_s: float) -> tuple[int, float]:
    """Run step() (each followed by a sync, as a serving loop reads its token) until max_steps or
    cap_s seconds. Returns (steps, seconds)."""
    n = 0
    t0 = time.perf_counter()
    while n < max_steps:
        step()
        ctx.sync()  # also the watchdog's heartbeat
        n += 1
        if time.perf_counter() - t0 > cap_s:
            break
    return n, time.perf_counter() - t0


def measure_decode(ctx: Ctx, rc: RunConfig, entry: dict, backend, cache1: KVCache, first, batch: int,
                   rows_mask) -> None:
    args, cfg, model = ctx.args, ctx.cfg, ctx.model
    p = args.prompt_tokens
    if batch == 1:
        cache = cache1
        first_b = first.reshape(1)
    else:
        cache = KVCache.empty(cfg, batch, ctx.max_len, ctx.device)
        cache.broadcast_from(cache1)
        first_b = torch.cat([first.reshape(1), ctx.decode_extra[: batch - 1]])
    stream = ctx.stream[:, :batch].contiguous()
    st = DecodeState.make(cache, first_b, p, stream)
    res = dict(batch=batch, prompt_tokens=p)
    # eager steps: warm-up (compiles, bridge buffers) and the eager time; one step records the
    # MoE inputs for the overlap and floor measurements
    eager = []
    for i in range(3):
        if i == 1:
            model.moe_capture = []
        ctx.sync()
        t0 = time.perf_counter()
        model.decode_step(st)
        ctx.sync()
        eager.append(time.perf_counter() - t0)
        if i == 1:
            captured, model.moe_capture = model.moe_capture, None
    res["eager_ms_per_step"] = 1e3 * min(eager[1:])
    entry.setdefault("decode", {})[str(batch)] = res  # kept even if what follows never returns
    ctx.results.write(plots=False)
    max_steps = min(args.new_tokens, ctx.max_len - p - 1)
    cap = max(0.5, min(args.decode_max_s, ctx.clock.left() - 5))
    runner = None
    if ctx.cuda and not args.no_graphs:
        try:
            runner = _capture_step(ctx, st)
        except Exception:  # record it and fall back to eager decode rather than lose the row
            res["graph_error"] = traceback.format_exc()
            print(res["graph_error"], flush=True)
            _drop_pending(backend)
            torch.cuda.synchronize()
    if runner is not None:
        st.reset(first_b, p)
        n, dt = _run_steps(ctx, runner.replay, max_steps, cap)
        res["cuda_graph"] = True
    else:
        st.reset(first_b, p)
        n, dt = _run_steps(ctx, lambda: model.decode_step(st), max_steps, cap)
        res["cuda_graph"] = False
        if not ctx.cuda:
            res["cuda_graph_note"] = "dry run: CUDA graphs skipped (CPU tensors), decode timed eagerly"
    res.update(steps=n, seconds=dt, ms_per_step=1e3 * dt / n, tok_s=batch * n / dt,
               stopped_by_time_cap=n < max_steps)
    del runner
    ctx.log(f"{rc.name} decode b={batch}: {res['tok_s']:.1f} tok/s ({res['ms_per_step']:.2f} ms/step, "
            f"{n} steps, graph={res['cuda_graph']})")
    if backend.kind == "hybrid" and ctx.clock.left() > 10:
        try:
            measure_floor(ctx, entry, backend, st, captured, res, rows_mask)
        except Exception:
            res["floor_error"] = traceback.format_exc()
        if not args.skip_overlap:
            try:
                measure_overlap(ctx, backend, captured, res, rows_mask)
            except Exception:
                res["overlap_error"] = traceback.format_exc()
    del st, cache


def measure_floor(ctx: Ctx, entry, backend: HybridExperts, st: DecodeState, captured, res, rows_mask):
    """decode floor = CPU expert bytes touched / CPU bandwidth + the step's GPU-only time."""
    cfg = ctx.cfg
    host = [(layer, x.cpu(), ids.cpu(), w.cpu()) for layer, x, ids, w in captured]
    nbytes = 0
    for layer, _, ids, _ in host:
        cpu = backend.layers[layer].cpu
        used = np.unique(ids.numpy())
        used = used[used >= 0]
        if rows_mask is not None:
            used = used[~rows_mask[layer][used]]
        nbytes += len(used) * cpu.expert_read_bytes()

    def cpu_alone():
        for layer, x, ids, w in host:
            m = None if rows_mask is None or not rows_mask[layer].any() else rows_mask[layer]
            backend.layers[layer].cpu(x, ids, w, gpu_mask=m)

    t_cpu = _timed(cpu_alone, lambda: None, reps=3)
    # the step with the CPU experts dropped: dense part + GPU slots (graph replay on the GPU)
    backend.mode = "gpu_only"
    try:
        p = ctx.args.prompt_tokens
        first = st.tokens.clone()
        if ctx.cuda and not ctx.args.no_graphs:
            runner = _capture_step(ctx, st)
            st.reset(first, p)
            t_gpu = _timed(runner.replay, ctx.sync, reps=10, warm=2)
            del runner
        else:
            st.reset(first, p)
            t_gpu = _timed(lambda: ctx.model.decode_step(st), ctx.sync, reps=3)
    finally:
        backend.mode = "full"
    step_s = res["ms_per_step"] / 1e3
    bw = ctx.results.data["meta"]["host_read_GBps"] * 1e9
    floor_bw = nbytes / bw + t_gpu
    floor_cpu = t_cpu + t_gpu
    res["floor"] = dict(cpu_expert_bytes_per_step=nbytes, host_read_GBps=bw / 1e9,
                        cpu_alone_step_ms=1e3 * t_cpu, cpu_moe_GBps=nbytes / t_cpu / 1e9,
                        gpu_only_step_ms=1e3 * t_gpu,
                        floor_membw_ms=1e3 * floor_bw, ratio_to_floor_membw=step_s / floor_bw,
                        floor_cpu_moe_ms=1e3 * floor_cpu, ratio_to_floor_cpu_moe=step_s / floor_cpu,
                        layers=cfg.num_layers)


def measure_overlap(ctx: Ctx, backend: HybridExperts, captured, res, rows_mask):
    """Layer 0 alone: HybridMoE vs its CPU part alone vs its GPU part alone (same inputs)."""
    layer_idx, x, ids, w = captured[0]
    layer = backend.layers[layer_idx]
    xh, ih, wh = x.cpu(), ids.cpu(), w.cpu()
    m = None if rows_mask is None or not rows_mask[layer_idx].any() else rows_mask[layer_idx]
    chain = layer.chain

    def hybrid():
        layer(x, ids, w)
        if chain is not None:
            chain.reset()  # the deferred part is waited for here (it would overlap the next layer)

    t_h = _timed(hybrid, ctx.sync, reps=10, warm=2)
    t_c = _timed(lambda: layer.cpu(xh, ih, wh, gpu_mask=m), lambda: None, reps=10, warm=1)
    t_g = None
    gw = backend.gpu_part(layer_idx)
    if gw is not None:
        from kt.gpu_ops import fused_moe

        t_g = _timed(lambda: fused_moe(x, ids, w, gw["e2s"], gw["w13"], gw["w2"], w13_scale=gw["w13_scale"],
                                       w2_scale=gw["w2_scale"]), ctx.sync, reps=10, warm=2)
    bound = max(t_c, t_g or 0.0)
    res["overlap_layer0"] = dict(
        hybrid_ms=1e3 * t_h, cpu_alone_ms=1e3 * t_c, gpu_alone_ms=None if t_g is None else 1e3 * t_g,
        ratio_to_max=t_h / bound if bound else None,
        hidden_share=(((t_c + t_g) - t_h) / min(t_c, t_g)) if t_g else None,
        deferred_waited_in_layer=chain is not None)


def measure_prefill_long(ctx: Ctx, rc: RunConfig, entry: dict, backend) -> None:
    args, model = ctx.args, ctx.model
    modes = [False]
    if backend.kind == "hybrid":
        if ctx.cuda:
            modes.append(True)
        else:
            entry.setdefault("skipped", []).append("layer-wise prefill: needs a CUDA device (dry run)")
    warmed = False
    for t in args.prefill_tokens:
        for lw in modes:
            key = f"{t}_{'on' if lw else 'off'}"
            if t == args.prompt_tokens and not lw:
                continue  # measured as the TTFT
            need = args.min_step_s * (3 if t > 4096 and not lw else 1)
            if ctx.clock.left() < need:
                entry.setdefault("skipped", []).append(f"prefill {key}: budget")
                continue
            if backend.kind == "hybrid":
                for layer in backend.layers:
                    layer.prefill_threshold = args.layerwise_threshold if lw else None
            try:
                if lw and not warmed:
                    # first layer-wise call of these weights: page-locks the CPU experts and sizes
                    # the GPU staging buffers (once per process): not part of any prefill's time
                    for layer in backend.layers:
                        layer.prefill_threshold = 1
                    ctx.sync()
                    t0 = time.perf_counter()
                    model.prefill(ctx.prompt[None, :16])
                    ctx.sync()
                    entry["layerwise_warmup_s"] = time.perf_counter() - t0
                    warmed = True
                    for layer in backend.layers:
                        layer.prefill_threshold = args.layerwise_threshold
                tokens = ctx.prompt if t == args.prompt_tokens else ctx.long_tokens[t]
                # twice: the first call of a length compiles the GPU kernels of its launch
                # configurations (Triton) and sizes buffers; the figure is the warm (second) one
                times = []
                for rep in range(2):
                    if rep and ctx.clock.left() < need:
                        break
                    ctx.sync()
                    t0 = time.perf_counter()
                    model.prefill(tokens[None]).argmax(-1).cpu()
                    times.append(time.perf_counter() - t0)
                dt = times[-1]
                r = dict(tokens=t, layerwise=lw, seconds=dt, tok_s=t / dt, includes_first_token=True,
                         seconds_first_call=times[0], warm=len(times) > 1)
                if backend.kind == "hybrid":
                    paths = {}
                    for layer in backend.layers:
                        paths[layer.stats.last_path] = paths.get(layer.stats.last_path, 0) + 1
                    r["layer_paths"] = paths
                entry.setdefault("prefill", {})[key] = r
                ctx.log(f"{rc.name} prefill {key}: {t / dt:.0f} tok/s ({dt:.2f} s)")
            finally:
                if backend.kind == "hybrid":
                    for layer in backend.layers:
                        layer.prefill_threshold = None
    if backend.kind == "hybrid" and ctx.cuda:
        try:  # what the cost model would pick on this machine (measures H2D once)
            layer = backend.layers[0]
            layer.prefill_threshold = "auto"
            entry["layerwise_auto_threshold_tokens"] = layer.prefill_threshold_tokens(ctx.cfg.top_k)
        except Exception as exc:
            entry["layerwise_auto_threshold_tokens"] = f"error: {exc!r}"
        finally:
            backend.layers[0].prefill_threshold = None


def run_config(ctx: Ctx, rc: RunConfig, entry: dict) -> None:
    from kt.placement import Budget, plan

    args, cfg, model = ctx.args, ctx.cfg, ctx.model
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    rows = rows_mask = planned_mask = None
    t0 = time.perf_counter()
    if rc.all_gpu:
        backend = ctx.all_gpu_backend()
        entry["gpu_experts"] = cfg.num_layers * cfg.num_experts
    else:
        if rc.gpu_pct:
            ctx.ensure_stats(rc.routing)
            stats = ctx.stats[rc.routing]
            pl = plan(stats, Budget.ratio(rc.gpu_pct / 100), "frequency")
            c = stats.counts
            per_layer = pl.gpu_mask.sum(axis=1)
            planned_mask = np.asarray(pl.gpu_mask)
            entry.update(gpu_experts=int(pl.gpu_mask.sum()),
                         gpu_experts_per_layer_min=int(per_layer.min()),
                         gpu_experts_per_layer_max=int(per_layer.max()),
                         gpu_hit_share_calibration=float((c * pl.gpu_mask).sum() / c.sum()))
            if ctx.cuda:
                rows = np.asarray(pl.gpu_slot, dtype=np.int64)
                rows_mask = rows >= 0
                entry["placement_applied"] = True
            else:
                entry["placement_applied"] = False
                entry["placement_note"] = ("dry run: HybridMoE without a GPU takes only all-CPU placements; "
                                           "the planned placement is recorded, every expert runs on the CPU")
        else:
            entry["gpu_experts"] = 0
        backend = ctx.hybrid_backend(rc.scheme, rows, rc.deferred)
    entry["gpu_expert_share"] = entry["gpu_experts"] / (cfg.num_layers * cfg.num_experts)
    entry["experts_backend"] = backend.kind
    ctx.sync()
    entry["build_s"] = time.perf_counter() - t0
    if ctx.cuda:
        entry["vram_after_build_gib"] = torch.cuda.memory_allocated() / 2**30
    model.experts = backend
    ctx.set_routing(rc.routing)
    try:
        if backend.kind != "hybrid":  # cheap on the GPU: statistics for the placements to come
            for routing in ("uniform", "skewed"):
                if routing not in ctx.stats and ctx.clock.left() > args.min_step_s:
                    ctx.calibrate(routing)
            ctx.set_routing(rc.routing)
        measure_correctness(ctx, rc, entry)
        cache1, first = measure_ttft(ctx, rc, entry, backend, planned_mask)
        ctx.log(f"{rc.name} TTFT({args.prompt_tokens}) {entry['ttft_s'] * 1e3:.1f} ms "
                f"(cold {entry['ttft_cold_s'] * 1e3:.1f} ms)")
        for b in args.decode_batches:
            if ctx.clock.left() < args.min_step_s:
                entry.setdefault("skipped", []).append(f"decode b={b}: budget")
                continue
            measure_decode(ctx, rc, entry, backend, cache1, first, b, rows_mask)
        del cache1
        if rc.name in args.prefill_configs:
            measure_prefill_long(ctx, rc, entry, backend)
    finally:
        model.experts = None
        model.router_bias = None
        entry.update(rss_gib())
        if ctx.cuda:
            entry["vram_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        del backend
        ctx.drop_scheme(rc.scheme)
        gc.collect()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
