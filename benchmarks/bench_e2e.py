"""End to end: a Qwen3-30B-A3B-shaped model decoding and prefilling with kt, vs all-GPU and CPU-only.

On a GPU host (one H200 + 16 cores here), from the repository root, in one call:
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_e2e.py --budget-s 330 --decode-max-s 4
Without a GPU (CPU tensors, a tiny model, the same code path; CUDA graphs and GPU placements left out):
    python benchmarks/bench_e2e.py --dry-run --out /tmp/e2e --report-dir /tmp/e2e

The model (kt/testing/e2e_model.py) has Qwen3-30B-A3B's configuration and random weights made on
the machine: a minimal torch forward for attention and the dense parts, experts through kt.
Expert weights are made directly in kt's packed INT8/INT4 layout.

Configurations run one after another in priority order (``--configs``), each in its own
try/except; benchmarks/results/<machine>/e2e.json (see _results.py; a dry run only with --out)
is rewritten after every configuration, and so are the markdown table (e2e.md) and the plots
(e2e_decode.png, e2e_prefill.png) when ``--report-dir`` is given. ``--budget-s`` is a global
time budget: when it runs out, the remaining measurements and configurations are recorded as
skipped. A watchdog ends the process, results written, past ``--hard-limit-s`` or after
``--stall-s`` without progress (a CUDA stream waiting for a CPU part that never comes cannot be
interrupted from Python). Names: ``gpu100_bf16_<routing>`` (every expert on the GPU,
kt.gpu_ops.fused_moe) and ``cpu0_<scheme>_<routing>_d<d>`` / ``gpu<pct>_<scheme>_<routing>_d<d>``
(HybridMoE, ``pct`` % of all experts on the GPU by frequency placement, d deferred experts per
token); routing ``uniform`` is the model's own router on random weights (close to uniform),
``skewed`` adds a per-layer bias fitted so that expert popularity follows a Zipf law.
docs/performance.md says what each figure means.
"""
from __future__ import annotations

import time

_T_START = time.perf_counter()  # the budget counts from process start when run as a script

import argparse
import dataclasses
import json
import os
import sys
import traceback

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

from _e2e_measure import run_config  # noqa: E402
from _e2e_report import MD_NAME, make_plots, markdown, parse_config  # noqa: E402
from _e2e_run import Clock, Ctx, Results, Watchdog, host_read_bandwidth, rss_gib  # noqa: E402
from _results import add_out_arguments, out_dir  # noqa: E402
from kt.cpu_ops import CpuPool  # noqa: E402
from kt.testing.e2e_model import QWEN3_30B_A3B, TINY, DenseWeights, Model  # noqa: E402

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


# ----------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_arguments(ap)
    ap.add_argument("--report-dir", default=None, help="folder for e2e.md and the two plots (default: none)")
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny model on CPU tensors: the same code path, no GPU, no CUDA graphs")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="global time budget: configurations/measurements that do not fit are skipped")
    ap.add_argument("--hard-limit-s", type=float, default=None,
                    help="write the results and end the process after this long (default budget + 45 s)")
    ap.add_argument("--stall-s", type=float, default=150.0,
                    help="write the results and end the process after this long without progress (a hang)")
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
                    help="only redraw e2e.md and the plots into --report-dir from an existing e2e.json")
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
    """Defaults that depend on --dry-run, lists parsed, names checked (ValueError says what is wrong)."""
    if getattr(args, "finished", False):
        return
    args.finished = True
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
    passed to CPUMoE instead of the registry's."""
    _finish_args(args)
    clock = Clock(args.budget_s, getattr(args, "t0", None))
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
    results = Results(None if dry and not args.out else out_dir(args), meta, args.report_dir, args.machine)
    ctx = Ctx(args, cfg, device, clock, results, cpu_kernels)
    meta["weight_sets"] = ("one per layer" if ctx.n_sets == cfg.num_layers
                           else f"{ctx.n_sets} sets reused cyclically by the {cfg.num_layers} layers")
    current = {"entry": None}

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
        timer.stopped.set()
        # joined here: the watchdog holds the model through ctx, and a daemon thread that drops
        # the last reference to a tensor while the interpreter shuts down aborts the process
        timer.join()
        torch.set_num_threads(torch_threads)
        if ctx.pool is not None:
            ctx.pool.shutdown()
    print(markdown(results.data), flush=True)
    return results.data


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.t0 = _T_START  # imports (torch, triton) count against the budget too
    if args.replot:
        if not args.report_dir:
            raise SystemExit("bench_e2e: --replot needs --report-dir (where e2e.md and the plots go)")
        replot(args.replot, args.report_dir)
        return 0
    try:
        _finish_args(args)
    except ValueError as e:
        ap.error(str(e))
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
