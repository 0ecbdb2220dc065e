#!/usr/bin/env python3
"""kt.gpu_ops on a GPU: correctness, speed against the roofline, tuned configs, stream/CPU sync cost.

On a GPU host, from the repository root (kt need not be installed):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_gpu.py
writes benchmarks/results/<machine>/gpu.json (all figures; see _results.py) and, into --table-dir
(default ./tuned), <gpu>.json: the fastest correct candidate per case, as a table for
kt/gpu_ops/configs/, and with --tune <gpu>_tuned.json, the table this GPU used with the tuned
entries laid over it (use it with KT_GPU_TABLE). ``--dry-run`` runs the same flow on tiny shapes
on the CPU under the Triton interpreter (correctness only, no timings; written only with --out).
Shapes and data: _gpu_cases.py; the tuner: _gpu_tune.py and kt.gpu_ops.tuning.

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
   weight tiles and a flattened tile loop, one tma for both: ``tuning.pick_flags``); the best pair then timed
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _gpu_cases import (DRY_SHAPES, SHAPES, T_LIST, ceilings_or_nan, gpu_slots, graph_of, log,  # noqa: E402
                        make_e2s, make_routing, make_weights, ref_gpu, ref_kt_subset, touched_slots)
from _gpu_tune import TUNE_CASES, parse_shape, part_tune, stage_times  # noqa: E402
from _results import add_out_arguments, out_dir, write_result  # noqa: E402
from kt.gpu_ops.tuning import write_tuned_table  # noqa: E402

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


class Results:
    """gpu.json's document, written to ``folder`` (None: not written) after every part."""

    def __init__(self, folder, machine=None):
        self.folder, self.machine = folder, machine
        self.data = {"env": {}, "ceilings": {}, "correctness": [], "speed": [], "stream_sync": {}, "errors": []}

    def save(self):
        if self.folder is not None:
            write_result(self.folder, "gpu", self.data, self.machine)


# ----------------------------------------------------------------------------- data


# ----------------------------------------------------------------------------- parts

def part_ceilings(torch, do_bench, res):
    m = 8192
    g = torch.Generator(device="cuda").manual_seed(0)
    mats = [torch.randn(m, m, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2)]

    def matmul_ms():
        return do_bench(lambda: torch.matmul(*mats), warmup=50, rep=300, return_mode="median")

    # The matmul rate is read before and after the long copy and the higher one kept: right after
    # the copy it read 679 TFLOP/s where a fresh process read 786-801 (H200), so one reading
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

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_arguments(ap)
    ap.add_argument("--table-dir", default="tuned", help="folder for the config tables the run finds")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="stop tuning after this many seconds")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: ceilings,moe,sync")
    ap.add_argument("--tune", action="store_true", help="run the per-stage tuning part (writes <gpu>_tuned.json into --table-dir)")
    ap.add_argument("--tune-budget-s", type=float, default=300.0, help="stop the tuning part after this long")
    ap.add_argument("--tune-T", default="", help="comma list: tune only these T (default: all of TUNE_CASES)")
    ap.add_argument("--tune-cases", default="",
                    help="comma list of shape:dtype:T to tune instead of TUNE_CASES (e.g. mixtral-8x7b:int8:64)")
    ap.add_argument("--add-shape", action="append", default=[], metavar="NAME=E,K,H,I,S",
                    help="another layer shape for --tune-cases (experts, top-k, hidden, intermediate, GPU "
                         "slots), e.g. deepseek-v3=256,8,7168,2048,64; repeatable")
    args = ap.parse_args(argv)
    for spec in args.add_shape:
        SHAPES.update([parse_shape(spec)])
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    t_start = time.time()
    import torch

    from kt import reference as R

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    res = Results(None if args.dry_run and not args.out else out_dir(args), args.machine)
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
        from kt.gpu_ops.configs import table_name

        gpu_name = torch.cuda.get_device_name()
        table = dict(table)
        table["_comment"] = (f"The fastest correct candidate per case on an {gpu_name}, by benchmarks/bench_gpu.py "
                             "(S=32 slots for qwen3-30b-a3b, S=4 for mixtral); key H{H}_I{I}_{weight dtype}, then T.")
        os.makedirs(args.table_dir, exist_ok=True)
        path = os.path.join(args.table_dir, f"{table_name(gpu_name) or 'gpu'}.json")
        with open(path, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        log(f"wrote {path}")
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
        log(f"tune: wrote {write_tuned_table(args.table_dir, gpu_name, shipped, found)}")
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
