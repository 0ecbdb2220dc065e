"""bench_e2e.py's run machinery: the watchdog, the budget clock, the results document, the run context.

Ctx holds what the configurations share (model, expert weights, pool, routing statistics,
reference logits); Results the JSON document (benchmarks/results/<machine>/e2e.json), rewritten
after every configuration, with the markdown table and the plots in --report-dir when given.
"""
from __future__ import annotations

import gc
import os
import threading
import time
import traceback

import numpy as np
import torch

from _e2e_report import MD_NAME, checks, make_plots, markdown
from _results import write_result
from kt.config import QuantScheme
from kt.testing.e2e_model import (FusedGPUExperts, HybridExperts, TorchExperts, make_expert_sets, zipf_log_rank,
                                  zipf_top_share)


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
    """The JSON document, rewritten (atomically) after every configuration to ``folder``/e2e.json
    (None: a dry run without --out, not written), and the markdown table and the plots into
    ``report_dir`` when one is given."""

    def __init__(self, folder, meta: dict, report_dir=None, machine=None):
        self.folder, self.report_dir, self.machine = folder, report_dir, machine
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
            if self.folder is not None:
                write_result(self.folder, "e2e", self.data, self.machine)
            if self.report_dir is None:
                return
            os.makedirs(self.report_dir, exist_ok=True)
            try:
                md = markdown(self.data)
            except Exception:  # the JSON above is what matters; say why the table is missing
                md = "# bench_e2e: the table could not be made\n\n```\n" + traceback.format_exc() + "```\n"
            with open(os.path.join(self.report_dir, MD_NAME), "w") as f:
                f.write(md)
        if plots:
            try:
                make_plots(self.data, self.report_dir)
            except Exception as exc:  # plots are a convenience; never lose the run over them
                with self.lock:
                    self.data["meta"]["plot_error"] = repr(exc)


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
        from kt.cpu_ops import CPUMoE

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
        from kt.layer import DeferredChain, HybridMoE

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
