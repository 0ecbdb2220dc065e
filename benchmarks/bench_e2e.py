"""End to end: a Qwen3-30B-A3B-shaped model decoding and prefilling with kt, vs all-GPU and CPU-only.

Run on the device (one H200 + 16 cores), from the repo root, in one call:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_e2e.py --out $OUT --budget-s 300
Locally (CPU tensors, a tiny model, the same code path; CUDA graphs and GPU placements left out):
    python benchmarks/bench_e2e.py --dry-run --out /tmp/e2e

The model (benchmarks/_e2e_model.py) has Qwen3-30B-A3B's configuration and random weights made on
the machine: a minimal torch forward for attention and the dense parts (not transformers: building
that module at this size takes longer than the device time we have), experts through kt. Expert
weights are made directly in kt's packed INT8/INT4 layout.

Configurations are run one after another in priority order (``--configs``), each in its own
try/except; the JSON (e2e.json), the markdown table (e2e.md) and the plots (e2e_decode.png,
e2e_prefill.png) under --out are rewritten after every configuration. ``--budget-s`` is a global
time budget: when it runs out, the remaining measurements and configurations are recorded as
skipped. ``--hard-limit-s`` (device runs only) ends the process, results written, if something
hangs. Names: ``gpu100_bf16_<routing>`` (every expert on the GPU, kt.gpu_ops.fused_moe) and
``cpu0_<scheme>_<routing>_d<d>`` / ``gpu<pct>_<scheme>_<routing>_d<d>`` (HybridMoE, ``pct`` % of all
experts on the GPU by frequency placement, d deferred experts per token); routing ``uniform`` is the
model's own router on random weights (close to uniform), ``skewed`` adds a per-layer bias fitted so
that expert popularity follows a Zipf law.
docs/performance.md says what each figure means.
"""
from __future__ import annotations

import time

_T_START = time.perf_counter()  # the budget counts from process start when run as a script

import argparse
import dataclasses
import gc
import json
import os
import sys
import threading
import traceback

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

from _e2e_model import (QWEN3_30B_A3B, TINY, DecodeState, DenseWeights, FusedGPUExperts,  # noqa: E402
                        HybridExperts, KVCache, Model, TorchExperts, make_expert_sets, zipf_log_rank,
                        zipf_top_share)
from _e2e_report import (JSON_NAME, MD_NAME, PLOT_DECODE, PLOT_PREFILL, RunConfig, checks,  # noqa: E402,F401
                         make_plots, markdown, parse_config)
from kt.config import QuantScheme  # noqa: E402

# Priority order: the lead's run may stop anywhere in this list (--budget-s).
DEFAULT_CONFIGS = [
    "gpu100_bf16_uniform",
    "cpu0_int8_uniform_d0",
    "cpu0_int8_skewed_d0",
    "gpu25_int8_skewed_d0",
    "gpu25_int8_skewed_d1",
    "cpu0_int4_uniform_d0",
    "gpu25_int8_uniform_d0",
    "gpu10_int8_skewed_d0",
    "gpu50_int8_skewed_d0",
    "gpu25_int8_skewed_d2",
    "gpu10_int8_skewed_d1",
    "gpu50_int8_skewed_d1",
    "cpu0_int8_skewed_d1",
    "gpu25_int8_uniform_d1",
    "gpu10_int8_skewed_d2",
    "gpu50_int8_skewed_d2",
]
DEFAULT_PREFILL_CONFIGS = "gpu100_bf16_uniform,cpu0_int8_uniform_d0,gpu25_int8_skewed_d0"


# ----------------------------------------------------------------------------- small helpers

class Watchdog(threading.Thread):
    """Ends a device run that hangs (a stream waiting for a CPU part that never comes cannot be
    interrupted from Python): past ``hard_limit_s`` in all, or ``stall_s`` without progress
    (``Ctx.beat``), it calls ``on_kill(reason)``, which writes the results and exits the process."""

    def __init__(self, ctx, hard_limit_s: float, stall_s: float, on_kill):
        super().__init__(name="bench-e2e-watchdog", daemon=True)
        self.ctx, self.hard_limit_s, self.stall_s, self.on_kill = ctx, hard_limit_s, stall_s, on_kill
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(1.0):
            if self.ctx.clock.elapsed() > self.hard_limit_s:
                self.on_kill(f"hard limit {self.hard_limit_s:.0f} s reached")
                return
            idle = time.monotonic() - self.ctx.last_beat
            if idle > self.stall_s:
                self.on_kill(f"no progress for {idle:.0f} s (stall limit {self.stall_s:.0f} s): "
                             "probably a hang; rerun the rest with --no-graphs or without this configuration")
                return


class Clock:
    def __init__(self, budget_s: float, t0: float | None = None):
        self.t0 = time.perf_counter() if t0 is None else t0
        self.budget_s = float(budget_s)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()


def rss_gib() -> dict:
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return {"rss_gib": out.get("VmRSS"), "rss_peak_gib": out.get("VmHWM")}


def host_read_bandwidth(nbytes: int, threads: int) -> float:
    """Bytes/s of a multi-threaded read of a buffer far larger than the caches (torch sum, fp32)."""
    old = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a = torch.ones(nbytes // 4, dtype=torch.float32)
        a.sum()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            a.sum()
            best = min(best, time.perf_counter() - t0)
        del a
        return nbytes / best
    finally:
        torch.set_num_threads(old)


# ----------------------------------------------------------------------------- results

class Results:
    """The JSON document, rewritten (atomically) after every configuration, plus md and plots."""

    def __init__(self, out_dir: str, meta: dict):
        self.out_dir = out_dir
        self.data = {"meta": meta, "calibration": {}, "correctness_reference": {}, "configs": []}
        self.lock = threading.RLock()

    def add(self, entry: dict) -> dict:
        with self.lock:
            self.data["configs"].append(entry)
        return entry

    def write(self, plots: bool = True) -> None:
        with self.lock:
            try:
                self.data["checks"] = checks(self.data)
            except Exception as exc:
                self.data["checks"] = {"error": repr(exc)}
            text = json.dumps(self.data, indent=1, default=_json_default)
            path = os.path.join(self.out_dir, JSON_NAME)
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
            try:
                md = markdown(self.data)
            except Exception:  # the JSON above is what matters; say why the table is missing
                md = "# bench_e2e: the table could not be made\n\n```\n" + traceback.format_exc() + "```\n"
            with open(os.path.join(self.out_dir, MD_NAME), "w") as f:
                f.write(md)
        if plots:
            try:
                make_plots(self.data, self.out_dir)
            except Exception as exc:  # plots are a convenience; never lose the run over them
                with self.lock:
                    self.data["meta"]["plot_error"] = repr(exc)


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# ----------------------------------------------------------------------------- the run context

class Ctx:
    """What the configurations share: the model, weights, pool, statistics, reference logits."""

    def __init__(self, args, cfg, device, clock, results, cpu_kernels):
        self.args, self.cfg, self.device, self.clock, self.results = args, cfg, device, clock, results
        self.cuda = device.type == "cuda"
        self.cpu_kernels = cpu_kernels or {}
        self.layer_set = [layer % self.n_sets for layer in range(cfg.num_layers)]
        self.sets: dict[str, list] = {}
        self.cpu_moes: dict[str, list] = {}
        self.stats: dict[str, object] = {}
        self.ref_logits: dict[str, torch.Tensor] = {}
        self.bias = None
        gen = torch.Generator().manual_seed(args.seed + 1)
        v = cfg.vocab
        self.prompt = torch.randint(0, v, (args.prompt_tokens,), generator=gen).to(device)
        self.corr_tokens = torch.randint(0, v, (args.correctness_positions,), generator=gen).to(device)
        self.calib_tokens = torch.randint(0, v, (args.calib_tokens,), generator=gen).to(device)
        self.long_tokens = {t: torch.randint(0, v, (t,), generator=gen).to(device)
                            for t in args.prefill_tokens if t != args.prompt_tokens}
        self.decode_extra = torch.randint(0, v, (max(args.decode_batches), ), generator=gen).to(device)
        # KV cache length, a multiple of 16 so the attention mask rows stay aligned for SDPA's kernels
        self.max_len = -(-(args.prompt_tokens + args.new_tokens + 8) // 16) * 16
        self.max_pos = max([self.max_len, args.calib_tokens, args.correctness_positions]
                           + list(args.prefill_tokens))
        self.stream = torch.randint(0, v, (args.new_tokens + 8, max(args.decode_batches)),
                                    generator=gen).to(device)
        self.pool = None
        self.model = None
        self.last_beat = time.monotonic()

    @property
    def n_sets(self) -> int:
        n = self.args.weight_sets
        return self.cfg.num_layers if n <= 0 else min(n, self.cfg.num_layers)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.beat()

    def beat(self) -> None:
        """Progress for the stall watchdog (see Watchdog)."""
        self.last_beat = time.monotonic()

    def log(self, msg: str) -> None:
        self.beat()
        print(f"[{self.clock.elapsed():7.1f}s] {msg}", flush=True)

    # -- weights
    def expert_sets(self, scheme: str):
        if scheme not in self.sets:
            for other in [s for s in self.sets if s != "int8"]:  # keep at most one extra scheme
                del self.sets[other]
                self.cpu_moes.pop(other, None)
                gc.collect()
            t0 = time.perf_counter()
            sets = make_expert_sets(self.cfg, QuantScheme.parse(scheme), self.n_sets,
                                    group_size=self.args.int4_group, seed=self.args.seed,
                                    threads=self.args.gen_threads,
                                    pool_lines=(1 << 20) if not self.args.dry_run else 4096)
            dt = time.perf_counter() - t0
            nbytes = sum(w13.nbytes + w2.nbytes for w13, w2 in sets)
            self.results.data["meta"].setdefault("weight_generation", {})[scheme] = dict(
                seconds=dt, bytes=nbytes, sets=self.n_sets, GBps=nbytes / dt / 1e9 if dt else None)
            self.log(f"{scheme} expert weights: {self.n_sets} sets, {nbytes / 2**30:.2f} GiB in {dt:.1f} s")
            self.sets[scheme] = sets
        return self.sets[scheme]

    def cpu_moe_list(self, scheme: str):
        from kt.cpu_ops.moe import CPUMoE

        if scheme not in self.cpu_moes:
            kern = self.cpu_kernels.get(scheme)
            cpus = [CPUMoE(w13, w2, pool=self.pool, kernels=kern) for w13, w2 in self.expert_sets(scheme)]
            # compile the CPU job now (bf16 in and out, as the stream bridge calls it), so that no
            # timed call, not even the cold TTFT, waits for Numba
            t0 = time.perf_counter()
            cfg = self.cfg
            x = torch.zeros(2, cfg.hidden, dtype=torch.bfloat16)
            ids = torch.arange(2 * cfg.top_k).reshape(2, cfg.top_k) % cfg.num_experts
            cpus[0](x, ids, torch.full((2, cfg.top_k), 1.0 / cfg.top_k))
            self.results.data["meta"].setdefault("cpu_job_compile_s", {})[scheme] = time.perf_counter() - t0
            self.results.data["meta"]["cpu_kernel_variant"] = cpus[0].variant
            self.log(f"{scheme} CPU MoE ready ({cpus[0].variant}), first call {time.perf_counter() - t0:.1f} s")
            self.cpu_moes[scheme] = cpus
        return self.cpu_moes[scheme]

    def drop_scheme(self, scheme: str) -> None:
        """Free a scheme's weights (the INT8 set stays: the all-GPU reference and most runs use it)."""
        if scheme != "int8":
            self.sets.pop(scheme, None)
            self.cpu_moes.pop(scheme, None)
            gc.collect()

    def hybrid_backend(self, scheme: str, rows, deferred: int) -> HybridExperts:
        from kt.hybrid import DeferredChain, HybridMoE

        cfg = self.cfg
        cpus = self.cpu_moe_list(scheme)
        chain = DeferredChain() if deferred else None
        layers = []
        for layer in range(cfg.num_layers):
            row = None if rows is None else rows[layer]
            layers.append(HybridMoE(cpus[self.layer_set[layer]], row, device=self.device if self.cuda else None,
                                    gpu_dtype=self.args.gpu_dtype, max_deferred_experts_per_token=deferred,
                                    chain=chain, is_last_layer=layer == cfg.num_layers - 1,
                                    gpu_prefill_token_threshold=None, layer_idx=layer))
        return HybridExperts(layers)

    def all_gpu_backend(self):
        sets = self.expert_sets("int8")
        if self.cuda:
            return FusedGPUExperts(sets, self.layer_set, self.device, "bf16")
        return TorchExperts(sets, self.layer_set)

    # -- routing
    def set_routing(self, routing: str) -> None:
        if routing == "skewed":
            if self.bias is None:
                self.fit_skew()
            self.model.router_bias = self.bias
        else:
            self.model.router_bias = None

    def fit_skew(self) -> None:
        """The skewed router's bias: scale[l] * -ln(rank) per layer, with scale[l] bisected over
        --skew-fit-iters calibration prefills so that in every layer the top 25 % of experts take
        the share of token-slots a Zipf(alpha) popularity gives them (75 % at alpha 1, E = 128).
        Fitted rather than set: with top-K routing, a bias of exactly -alpha*ln(rank) concentrates
        the load far beyond Zipf (95 % at alpha 1), since each token takes its K best experts."""
        from kt.placement import ExpertStats

        cfg, model, args = self.cfg, self.model, self.args
        log_rank = zipf_log_rank(cfg, self.device, args.seed)
        target = zipf_top_share(cfg.num_experts, args.zipf_alpha)
        q = max(1, cfg.num_experts // 4)
        lo = torch.zeros(cfg.num_layers, device=self.device)
        hi = torch.full((cfg.num_layers,), 8.0, device=self.device)
        saved = model.router_bias
        t0 = time.perf_counter()
        try:
            for _ in range(args.skew_fit_iters):
                mid = (lo + hi) / 2
                model.router_bias = mid[:, None] * log_rank
                stats = ExpertStats(cfg.num_layers, cfg.num_experts)
                model.stats = stats
                model.prefill(self.calib_tokens[None])
                c = stats.counts
                share = torch.from_numpy(-np.sort(-c, axis=1)[:, :q].sum(axis=1) / c.sum(axis=1)).to(lo)
                lo = torch.where(share < target, mid, lo)
                hi = torch.where(share < target, hi, mid)
        finally:
            model.stats = None
            model.router_bias = saved
        scale = (lo + hi) / 2
        self.bias = scale[:, None] * log_rank
        self.results.data["calibration"]["skew_fit"] = dict(
            zipf_alpha=args.zipf_alpha, target_top25pct_share=target, iterations=args.skew_fit_iters,
            scale_min=float(scale.min()), scale_mean=float(scale.mean()), scale_max=float(scale.max()),
            experts_backend=model.experts.kind, seconds=time.perf_counter() - t0)
        self.log(f"skewed router fitted: scale {float(scale.mean()):.2f} (target: top-25% experts take "
                 f"{target:.0%})")

    def calibrate(self, routing: str) -> None:
        """Record the router's choices on --calib-tokens tokens with the current experts."""
        from kt.placement import ExpertStats

        cfg, model = self.cfg, self.model
        saved_bias = model.router_bias
        self.set_routing(routing)
        stats = ExpertStats(cfg.num_layers, cfg.num_experts, model=cfg.name)
        model.stats = stats
        t0 = time.perf_counter()
        try:
            model.prefill(self.calib_tokens[None])
            self.sync()
        finally:
            model.stats = None
            model.router_bias = saved_bias
        c = stats.counts
        q = max(1, cfg.num_experts // 4)
        srt = -np.sort(-c, axis=1)
        # the same statistic for truly uniform routing of as many tokens (sampling noise alone)
        rng = np.random.default_rng(0)
        t = int(self.calib_tokens.numel())
        u = np.stack([np.bincount(np.argsort(rng.random((t, cfg.num_experts)), axis=1)[:, :cfg.top_k].ravel(),
                                  minlength=cfg.num_experts) for _ in range(4)])
        us = -np.sort(-u, axis=1)
        info = dict(tokens=int(self.calib_tokens.numel()), experts_backend=model.experts.kind,
                    seconds=time.perf_counter() - t0,
                    top25pct_experts_share=float(srt[:, :q].sum() / c.sum()),
                    top25pct_experts_share_max_layer=float((srt[:, :q].sum(axis=1) / c.sum(axis=1)).max()),
                    top25pct_experts_share_if_uniform=float(us[:, :q].sum() / us.sum()),
                    top1_expert_share_mean=float((srt[:, 0] / c.sum(axis=1)).mean()))
        self.results.data["calibration"][routing] = info
        self.stats[routing] = stats
        self.log(f"calibrated {routing}: top-25% experts take {info['top25pct_experts_share']:.1%} of token-slots "
                 f"(uniform routing: {info['top25pct_experts_share_if_uniform']:.1%})")

    def ensure_stats(self, routing: str) -> None:
        if routing in self.stats:
            return
        model = self.model
        saved = model.experts
        if saved is None or saved.kind == "hybrid":  # the all-GPU run did not calibrate: use all-CPU
            model.experts = self.hybrid_backend("int8", None, 0)
        try:
            self.calibrate(routing)
        finally:
            model.experts = saved


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
    # the same with two-level int8 activations (the CPU experts' accuracy mode, issue 4's 0.015
    # per layer): what is left is the weights' own int8 error and the GPU/CPU arithmetic
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
    from kt._stream_bridge import GraphRunner

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


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="output folder (JSON, md, plots)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny model on CPU tensors: the same code path, no GPU, no CUDA graphs")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="global time budget: configurations/measurements that do not fit are skipped")
    ap.add_argument("--hard-limit-s", type=float, default=None,
                    help="device runs: write the results and end the process after this long "
                         "(default budget + 45 s)")
    ap.add_argument("--stall-s", type=float, default=150.0,
                    help="device runs: write the results and end the process after this long without "
                         "progress (a hang)")
    ap.add_argument("--min-step-s", type=float, default=8.0,
                    help="a measurement starts only if this much budget is left")
    ap.add_argument("--configs", default="default",
                    help="comma list of configuration names, 'default' (all, in priority order)")
    ap.add_argument("--prefill-configs", default=DEFAULT_PREFILL_CONFIGS,
                    help="configurations that also measure the long prefills (layer-wise on/off)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="P (default 512; dry run 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="N decode steps at most (default 256; dry 6)")
    ap.add_argument("--decode-batches", default="1,8")
    ap.add_argument("--decode-max-s", type=float, default=6.0,
                    help="stop a decode measurement after this many seconds (steps done are reported)")
    ap.add_argument("--prefill-tokens", default=None, help="prefill lengths (default 512,8192; dry 16,48)")
    ap.add_argument("--layerwise-threshold", default="1",
                    help="gpu_prefill_token_threshold when layer-wise prefill is on (int or 'auto')")
    ap.add_argument("--calib-tokens", type=int, default=None, help="tokens of the calibration run (512)")
    ap.add_argument("--correctness-positions", type=int, default=8)
    ap.add_argument("--weight-sets", type=int, default=0,
                    help="distinct expert weight sets, reused cyclically by the layers (0 = one per layer)")
    ap.add_argument("--threads", type=int, default=None, help="CPU pool threads (default: cores - 1)")
    ap.add_argument("--gen-threads", type=int, default=None, help="threads generating weights (default: cores)")
    ap.add_argument("--gpu-dtype", default="bf16", choices=["bf16", "int8"], help="hybrid GPU slot dtype")
    ap.add_argument("--int4-group", type=int, default=64)
    ap.add_argument("--zipf-alpha", type=float, default=1.0,
                    help="skewed routing: expert popularity fitted to 1/rank**alpha")
    ap.add_argument("--skew-fit-iters", type=int, default=7,
                    help="bisection steps (calibration prefills) fitting the skewed router")
    ap.add_argument("--no-graphs", action="store_true", help="decode eagerly even on a GPU")
    ap.add_argument("--skip-overlap", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", choices=["qwen3-30b-a3b", "tiny"], default=None,
                    help="model shape (default: qwen3-30b-a3b, tiny with --dry-run)")
    ap.add_argument("--layers", type=int, default=None, help="keep only this many layers (quick checks)")
    ap.add_argument("--replot", metavar="JSON", default=None,
                    help="only redraw e2e.md and the plots into --out from an existing e2e.json")
    return ap


def replot(path: str, out_dir: str) -> dict:
    with open(path) as f:
        data = json.load(f)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, MD_NAME), "w") as f:
        f.write(markdown(data))
    make_plots(data, out_dir)
    print(markdown(data), flush=True)
    return data


def _finish_args(args) -> None:
    dry = args.dry_run
    args.prompt_tokens = args.prompt_tokens or (16 if dry else 512)
    args.new_tokens = args.new_tokens or (6 if dry else 256)
    args.calib_tokens = args.calib_tokens or (32 if dry else 512)
    if args.prefill_tokens is None:
        args.prefill_tokens = "16,48" if dry else "512,8192"
    args.prefill_tokens = [int(v) for v in str(args.prefill_tokens).split(",") if v]
    args.decode_batches = [int(v) for v in str(args.decode_batches).split(",") if v]
    if any(b < 1 for b in args.decode_batches) or not args.decode_batches:
        raise ValueError(f"--decode-batches must be positive ints, got {args.decode_batches}")
    if args.layerwise_threshold != "auto":
        args.layerwise_threshold = int(args.layerwise_threshold)
    cores = len(os.sched_getaffinity(0))
    args.threads = args.threads or max(1, cores - 1)
    args.gen_threads = args.gen_threads or cores
    args.configs = DEFAULT_CONFIGS if args.configs in ("default", "all") else \
        [c.strip() for c in args.configs.split(",") if c.strip()]
    args.prefill_configs = [c.strip() for c in str(args.prefill_configs).split(",") if c.strip()]
    for name in args.configs:
        parse_config(name)
    if args.hard_limit_s is None:
        args.hard_limit_s = args.budget_s + 45.0


def run(args, cpu_kernels: dict | None = None) -> dict:
    """Run the benchmark; returns the results document. cpu_kernels: optional {scheme: (gemv, gemm)}
    passed to CPUMoE (tests on hosts the kernel registry has nothing for)."""
    from kt.cpu_ops.pool import CpuPool

    _finish_args(args)
    clock = Clock(args.budget_s, getattr(args, "t0", None))
    os.makedirs(args.out, exist_ok=True)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        raise SystemExit("bench_e2e: no CUDA device; use --dry-run for the CPU check")
    device = torch.device("cpu" if dry else "cuda")
    cfg = {"tiny": TINY, "qwen3-30b-a3b": QWEN3_30B_A3B}[args.model or ("tiny" if dry else "qwen3-30b-a3b")]
    if args.layers:
        cfg = dataclasses.replace(cfg, num_layers=args.layers, name=f"{cfg.name} ({args.layers} layers)")
    meta = dict(model=cfg.as_dict(), dry_run=dry, args={k: v for k, v in vars(args).items()},
                device=torch.cuda.get_device_name(0) if not dry else "cpu (dry run)",
                torch=torch.__version__, threads=args.threads, cpu_count=os.cpu_count(),
                forward="minimal torch forward (not transformers)", started_unix=time.time())
    try:
        import kt

        meta["cpu_variant"] = kt.cpu_variant()
    except Exception as exc:
        meta["cpu_variant"] = f"error: {exc!r}"
    try:
        import subprocess

        meta["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(_HERE),
                                            capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        meta["git_commit"] = None
    results = Results(args.out, meta)
    ctx = Ctx(args, cfg, device, clock, results, cpu_kernels)
    meta["weight_sets"] = ("one per layer" if ctx.n_sets == cfg.num_layers
                           else f"{ctx.n_sets} sets reused cyclically by the {cfg.num_layers} layers")
    current = {"entry": None}
    timer = None
    if not dry:
        def on_kill(reason: str):
            e = current["entry"]
            if e is not None:
                e["status"] = "killed"
                e["reason"] = reason + " while this configuration ran"
            results.data["meta"]["ended_by_watchdog"] = reason
            results.data["meta"]["elapsed_s"] = clock.elapsed()
            try:
                results.write(plots=True)
            finally:
                print(f"bench_e2e: {reason}; results written, exiting", flush=True)
                os._exit(3)

        timer = Watchdog(ctx, args.hard_limit_s, args.stall_s, on_kill)
        timer.start()
    torch_threads = torch.get_num_threads()
    if dry:  # torch's CPU threads would spin against the kt pool on a small host (restored below)
        torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        ctx.pool = CpuPool(args.threads)
        dense = DenseWeights(cfg, device, seed=args.seed)
        meta["dense_bytes"] = dense.nbytes()
        ctx.model = Model(cfg, dense, device, ctx.max_pos)
        ctx.sync()
        meta["dense_setup_s"] = time.perf_counter() - t0
        bw_bytes = (64 << 20) if dry else (4 << 30)
        meta["host_read_GBps"] = host_read_bandwidth(bw_bytes, args.threads + 1) / 1e9
        ctx.log(f"dense part {meta['dense_bytes'] / 2**30:.2f} GiB on {device}; host read "
                f"{meta['host_read_GBps']:.1f} GB/s")
        ctx.expert_sets("int8")
        results.write(plots=False)
        for name in args.configs:
            rc = parse_config(name)
            entry = results.add(dict(name=name, gpu_pct=rc.gpu_pct, scheme=rc.scheme, routing=rc.routing,
                                     deferred=rc.deferred, gpu_dtype="bf16" if rc.all_gpu else args.gpu_dtype,
                                     status="running"))
            current["entry"] = entry
            if clock.left() < args.min_step_s:
                entry.update(status="skipped", reason=f"budget ({args.budget_s:.0f} s) used up")
                ctx.log(f"{name}: skipped (budget)")
                results.write(plots=False)
                continue
            t_cfg = time.perf_counter()
            ctx.log(f"== {name}")
            try:
                run_config(ctx, rc, entry)
                entry["status"] = "partial" if entry.get("skipped") else "ok"
            except Exception:
                entry["status"] = "error"
                entry["error"] = traceback.format_exc()
                print(entry["error"], flush=True)
            entry["config_s"] = time.perf_counter() - t_cfg
            current["entry"] = None
            meta["elapsed_s"] = clock.elapsed()
            results.write(plots=True)
    finally:
        meta["elapsed_s"] = clock.elapsed()
        meta.update({f"final_{k}": v for k, v in rss_gib().items()})
        results.write(plots=True)
        if timer is not None:
            timer.stopped.set()
        torch.set_num_threads(torch_threads)
        if ctx.pool is not None:
            ctx.pool.shutdown()
    print(markdown(results.data), flush=True)
    return results.data


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.t0 = _T_START  # imports (torch, triton) count against the budget too
    if args.replot:
        replot(args.replot, args.out)
        return 0
    data = run(args)
    bad = [e["name"] for e in data["configs"] if e.get("status") == "error"]
    if bad:
        print(f"bench_e2e: configurations with errors: {', '.join(bad)}", flush=True)
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if "--dry-run" not in sys.argv and "--replot" not in sys.argv:
        os._exit(rc)  # do not wait on CUDA / pinned-memory / worker teardown after the results are out
    sys.exit(rc)
