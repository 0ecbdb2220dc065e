"""HybridMoE on a GPU host: overlap of the CPU and GPU parts, CUDA graphs, layer-wise prefill.

From the repository root of a GPU host (kt need not be installed; leave two cores to the
launching and the stream service threads: --threads cores - 2):
    PYTHONPATH=. python3 benchmarks/bench_hybrid.py --threads 14 --sections graph_overlap,eager_graphs
Writes benchmarks/results/<machine>/hybrid.json (see _results.py), rewritten after each section.

Sections (each independent; a failure is recorded and the script goes on):
  correctness  HybridMoE (25 % GPU) vs the fp32 reference of the same quantised weights
  overlap      qwen3-30b-a3b layer, INT8 CPU experts, 0/25/50/100 % of experts on the GPU,
               T in {1, 8, 64, 512, 4096}: hybrid time vs max(CPU part alone, GPU part alone)
  graph_overlap  the same for T in {1, 8, 64} with the layer (and the GPU part alone) replayed from
               CUDA graphs, as decode runs it; the gated CPU part (the default) interleaved with
               the polled one (kt.layer._stream_bridge)
  eager_graphs the eager T in {1, 8} cases with the layer's own CUDA graphs (the default) against
               the always-eager path, interleaved, and a 4-layer eager step
  graph        a 4-layer decode step captured in a CUDA graph, replayed: identical to eager?
  concurrency  forwards on one stream while another thread keeps calling update_placement
  prefill      T=4096 with layer-wise GPU prefill vs the CPU path, and what "auto" picks
Weights are random (std 1/sqrt(fan_in)); routing is uniform random, fresh per call.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import add_out_arguments, out_dir, write_result  # noqa: E402
from kt import reference as ref  # noqa: E402
from kt.cpu_ops import CpuPool, CPUMoE  # noqa: E402
from kt.layer import HybridMoE  # noqa: E402

E, K, H, I = 128, 8, 2048, 768
SECTIONS = ("correctness", "overlap", "graph_overlap", "eager_graphs", "graph", "concurrency", "prefill")


def routing(t, e, k, gen, device):
    ids = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :k]
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=1)
    return ids.to(device), w.to(device)


def placement_row(frac, e, seed=0):
    n = int(round(frac * e))
    rng = np.random.default_rng(seed)
    row = np.full(e, -1, np.int64)
    chosen = np.sort(rng.permutation(e)[:n])  # a non-contiguous set
    row[chosen] = np.arange(n)
    return row


def _runs(fn, reps, warm):
    """(seconds until fn returned, seconds until the device finished) per call, a host sync after each."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        out.append((t1 - t0, time.perf_counter() - t0))
    return out


def enqueue_time(fn, reps, warm=2):
    """Minimum seconds fn takes to return (the host's enqueueing work)."""
    return min(r[0] for r in _runs(fn, reps, warm))


def timed(fn, reps, warm=2):
    """(min, median) seconds per call including a host sync."""
    ts = [r[1] for r in _runs(fn, reps, warm)]
    return min(ts), statistics.median(ts)


def section_correctness(cpu, dev, res):
    row = placement_row(0.25, E, 1)
    layer = HybridMoE(cpu, row, device=dev)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for t in (1, 7, 64):
        x = (torch.randn(t, H, generator=gen) * 0.5).to(torch.bfloat16)
        ids, w = routing(t, E, K, gen, "cpu")
        y = layer(x.to(dev), ids.to(dev), w.to(dev)).float().cpu()
        q13 = [ref.QuantizedWeight(cpu.scheme, *_unpacked(cpu.w13.expert(e))) for e in range(E)]
        q2 = [ref.QuantizedWeight(cpu.scheme, *_unpacked(cpu.w2.expert(e))) for e in range(E)]
        exp = ref.moe_forward_quantized(x.float(), ids, w, q13, q2)
        out[t] = ref.relative_error(y, exp)
    res["correctness_rel_err_vs_quantized_reference"] = out


def _unpacked(p):
    from kt.cpu_ops.packing import unpack

    u = unpack(p)
    return u.q, u.scale


def _part_fns(cpu, layer, x, ids, w):
    """Callables for the layer's CPU part alone (the same CPU experts, inputs already on the host)
    and its GPU part alone (the Triton experts, eager; absent without GPU experts)."""
    from kt.gpu_ops import fused_moe

    xc, ic, wc = x.cpu(), ids.cpu(), w.cpu()
    mask = layer.gpu_mask
    fns = {"cpu_alone": lambda: cpu(xc, ic, wc, gpu_mask=mask if mask.any() else None)}
    g = layer._gpu
    if g is not None:
        fns["gpu_alone"] = lambda: fused_moe(x, ids, w, g["e2s"], g["w13"], g["w2"],
                                             w13_scale=g["w13_scale"], w2_scale=g["w2_scale"])
    return fns


def interleaved(fns, reps, rounds):
    """{name: (min, median of the rounds' medians) seconds}: each round times every callable in
    turn (``timed``: reps calls, a host sync after each), so drift of the machine hits all alike."""
    got = {n: [] for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            got[n].append(timed(f, reps))
    return {n: (min(a for a, _ in v), statistics.median(m for _, m in v)) for n, v in got.items()}


def section_overlap(cpu, dev, res, reps, ts=(1, 8, 64, 512, 4096), rounds=3):
    """Eager layer calls (with the layer's own CUDA graphs at T <= 8, the default) against the CPU
    part alone and the GPU part alone, the three interleaved in rounds."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for frac in (0.0, 0.25, 0.5, 1.0):
        row = placement_row(frac, E, 2)
        layer = HybridMoE(cpu, row, device=dev)
        for t in ts:
            x = (torch.randn(t, H, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
            ids, w = routing(t, E, K, gen, dev)
            fns = dict(hybrid=lambda: layer(x, ids, w), **_part_fns(cpu, layer, x, ids, w))
            got = interleaved(fns, reps, rounds if t < 4096 else 2)
            enq = enqueue_time(lambda: layer(x, ids, w), reps) if t <= 64 else None
            hyb = got["hybrid"]
            cpu_alone, gpu_alone = got["cpu_alone"], got.get("gpu_alone", (0.0, 0.0))
            bound = max(cpu_alone[0], gpu_alone[0])
            rows.append(dict(gpu_frac=frac, T=t, hybrid_min_ms=hyb[0] * 1e3, hybrid_med_ms=hyb[1] * 1e3,
                             cpu_alone_min_ms=cpu_alone[0] * 1e3, gpu_alone_min_ms=gpu_alone[0] * 1e3,
                             ratio_to_max=hyb[0] / bound if bound else None,
                             target_ok=hyb[0] <= 1.15 * bound + 50e-6,
                             hybrid_enqueue_min_ms=enq * 1e3 if enq is not None else None))
            print(f"overlap frac={frac:.2f} T={t:5d} hybrid {hyb[0]*1e3:8.3f} ms  cpu {cpu_alone[0]*1e3:8.3f}"
                  f"  gpu {gpu_alone[0]*1e3:8.3f}  ratio {rows[-1]['ratio_to_max']:.2f}"
                  f"  ok {rows[-1]['target_ok']}"
                  + (f"  enqueue {enq * 1e3:.3f}" if enq is not None else ""), flush=True)
    res["overlap"] = rows


def section_eager_graphs(cpu, dev, res, reps, rounds=4):
    """Eager decode-sized calls as a model's eager forward makes them: the layer replaying its own
    CUDA graphs (graph_max_tokens=8, the default) against the always-eager path
    (graph_max_tokens=0), each against max(CPU part alone, GPU part alone), all four interleaved
    in rounds; outputs compared bit for bit. Then a 4-layer eager step at T=1 (25 % on the GPU),
    each layer's output the next one's input."""
    gen = torch.Generator().manual_seed(6)
    rows = []
    for frac in (0.0, 0.25, 0.5, 1.0):
        row = placement_row(frac, E, 2)
        layers = {"graphs": HybridMoE(cpu, row, device=dev),
                  "eager": HybridMoE(cpu, row, device=dev, graph_max_tokens=0)}
        for t in (1, 8):
            x = (torch.randn(t, H, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
            ids, w = routing(t, E, K, gen, dev)
            fns = {n: (lambda layer=layer: layer(x, ids, w)) for n, layer in layers.items()}
            got = interleaved(dict(fns, **_part_fns(cpu, layers["eager"], x, ids, w)), reps, rounds)
            enq = {n: enqueue_time(f, reps) for n, f in fns.items()}
            same = torch.equal(layers["graphs"](x, ids, w), layers["eager"](x, ids, w))
            cpu_alone, gpu_alone = got["cpu_alone"], got.get("gpu_alone", (0.0, 0.0))
            bound = max(cpu_alone[0], gpu_alone[0])
            r = dict(gpu_frac=frac, T=t, cpu_alone_min_ms=cpu_alone[0] * 1e3,
                     gpu_alone_min_ms=gpu_alone[0] * 1e3, bit_identical=same,
                     replays=layers["graphs"].graphs.replays)
            for n in layers:
                lo, med = got[n]
                r.update({f"{n}_min_ms": lo * 1e3, f"{n}_med_ms": med * 1e3,
                          f"{n}_enqueue_min_ms": enq[n] * 1e3, f"{n}_ratio_to_max": lo / bound,
                          f"{n}_target_ok": lo <= 1.15 * bound + 50e-6})
            rows.append(r)
            print(f"eager graphs frac={frac:.2f} T={t}: graphs {r['graphs_min_ms']:.3f} ms (enqueue "
                  f"{r['graphs_enqueue_min_ms']:.3f}), eager {r['eager_min_ms']:.3f} ({r['eager_enqueue_min_ms']:.3f}); "
                  f"cpu {r['cpu_alone_min_ms']:.3f} gpu {r['gpu_alone_min_ms']:.3f}; ok {r['graphs_target_ok']} "
                  f"/ {r['eager_target_ok']}; identical {same}", flush=True)
    row = placement_row(0.25, E, 2)
    x = (torch.randn(1, H, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    ids, w = routing(1, E, K, gen, dev)
    steps = {}
    for n, gmax in (("graphs", 8), ("eager", 0)):
        stack = [HybridMoE(cpu, row, device=dev, graph_max_tokens=gmax) for _ in range(4)]

        def four(stack=stack):
            y = x
            for layer in stack:
                y = layer(y, ids, w)
            return y

        steps[n] = four
    step = interleaved(steps, 3 * reps, rounds)
    res["eager_graphs"] = dict(rows=rows, step4_T1_25pct_min_ms={n: v[0] * 1e3 for n, v in step.items()},
                               step4_T1_25pct_med_ms={n: v[1] * 1e3 for n, v in step.items()})
    print("eager 4-layer step, T=1, 25 %:", res["eager_graphs"]["step4_T1_25pct_min_ms"], flush=True)


def section_graph_overlap(cpu, dev, res, reps):
    """Decode-sized overlap as decode runs it: one hybrid layer captured in a CUDA graph (kt's
    GraphRunner) and replayed, against the CPU part alone and the GPU part alone replayed from
    its own graph; each timing includes one host synchronisation."""
    from kt.layer import _stream_bridge as sb
    from kt.layer import GraphRunner
    from kt.gpu_ops import fused_moe

    gen = torch.Generator().manual_seed(4)
    rows = []
    for frac in (0.0, 0.25, 0.5, 1.0):
        row = placement_row(frac, E, 2)
        layer = HybridMoE(cpu, row, device=dev)
        g = layer._gpu
        for t in (1, 8, 64):
            x = (torch.randn(t, H, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
            ids, w = routing(t, E, K, gen, dev)
            layer(x, ids, w)
            torch.cuda.synchronize()
            runner = GraphRunner()
            with runner.capture():
                layer(x, ids, w)
            # the CPU part published before the stream's start flag (gated, the default) vs the
            # service thread polling the flag and then calling the layer (polled), interleaved
            ts = {True: [], False: []}
            for _ in range(4):
                for gated in (True, False):
                    sb.GATED = gated
                    ts[gated].append(timed(runner.replay, reps + reps // 4))
            sb.GATED = True
            hyb = (min(a for a, _ in ts[True]), statistics.median(m for _, m in ts[True]))
            polled = (min(a for a, _ in ts[False]), statistics.median(m for _, m in ts[False]))
            gpu_alone = (0.0, 0.0)
            if g is not None:
                gg = torch.cuda.CUDAGraph()
                fused_moe(x, ids, w, g["e2s"], g["w13"], g["w2"], w13_scale=g["w13_scale"],
                          w2_scale=g["w2_scale"])
                torch.cuda.synchronize()
                with torch.cuda.graph(gg):
                    fused_moe(x, ids, w, g["e2s"], g["w13"], g["w2"], w13_scale=g["w13_scale"],
                              w2_scale=g["w2_scale"])
                gpu_alone = timed(gg.replay, 5 * reps)
            xc, ic, wc = x.cpu(), ids.cpu(), w.cpu()
            cpu_alone = (timed(lambda: cpu(xc, ic, wc, gpu_mask=row >= 0), 5 * reps) if frac < 1
                         else (0.0, 0.0))
            bound = max(cpu_alone[0], gpu_alone[0])
            rows.append(dict(gpu_frac=frac, T=t, hybrid_graph_min_ms=hyb[0] * 1e3,
                             hybrid_graph_med_ms=hyb[1] * 1e3, polled_graph_min_ms=polled[0] * 1e3,
                             polled_graph_med_ms=polled[1] * 1e3, cpu_alone_min_ms=cpu_alone[0] * 1e3,
                             gpu_alone_graph_min_ms=gpu_alone[0] * 1e3,
                             ratio_to_max=hyb[0] / bound,
                             target_ok=hyb[0] <= 1.15 * bound + 50e-6))
            print(f"graph overlap frac={frac:.2f} T={t}: gated {hyb[0] * 1e3:.3f} ms (med "
                  f"{hyb[1] * 1e3:.3f}), polled {polled[0] * 1e3:.3f} ({polled[1] * 1e3:.3f}); "
                  f"cpu {cpu_alone[0] * 1e3:.3f}  gpu {gpu_alone[0] * 1e3:.3f}"
                  f"  ratio {rows[-1]['ratio_to_max']:.2f}  ok {rows[-1]['target_ok']}", flush=True)
    res["graph_overlap"] = rows


def section_graph(cpu, dev, res):
    from kt.layer import GraphRunner
    from kt.layer import DeferredChain

    out = {}
    for frac in (0.0, 0.25):
        for t in (1, 8):
            for d in (0, 1):
                key = f"gpu{int(frac * 100)}_T{t}_d{d}"
                try:
                    out[key] = _graph_case(cpu, dev, frac, t, d, GraphRunner, DeferredChain)
                except Exception:
                    out[key] = {"error": traceback.format_exc()}
                print(f"graph {key}: {out[key]}", flush=True)
    res["graph"] = out


def _graph_case(cpu, dev, frac, t, d, GraphRunner, DeferredChain):
    chain = DeferredChain() if d else None
    layers = [HybridMoE(cpu, placement_row(frac, E, 10 + i), device=dev,
                        max_deferred_experts_per_token=d, chain=chain, is_last_layer=(i == 3))
              for i in range(4)]
    gen = torch.Generator().manual_seed(3)
    routes = [routing(t, E, K, gen, dev) for _ in range(4)]
    x_static = (torch.randn(t, H, generator=gen) * 0.5).to(torch.bfloat16).to(dev)

    def step():
        h = x_static
        for layer, (ids, w) in zip(layers, routes):
            h = h + layer(h, ids, w)
        return h

    eager = step().clone()
    torch.cuda.synchronize()
    runner = GraphRunner()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm on the side stream
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    with runner.capture():
        y = step()
    same = True
    t0 = time.perf_counter()
    n = 30
    for _ in range(n):
        runner.replay()
        torch.cuda.synchronize()
        same &= bool(torch.equal(y, eager))
    per = (time.perf_counter() - t0) / n
    eager_t = timed(step, 8)
    return dict(bit_identical=same, replay_ms=per * 1e3, eager_min_ms=eager_t[0] * 1e3)


def section_concurrency(cpu, dev, res, seconds=5.0):
    """Forwards in one thread (own stream) while another thread keeps re-placing experts; T=16
    runs the eager path, T=4 the layer's own CUDA graphs (dropped and captured again as the
    placement changes under them)."""
    import threading

    res["concurrency"] = {}
    q13 = [ref.QuantizedWeight(cpu.scheme, *_unpacked(cpu.w13.expert(e))) for e in range(E)]
    q2 = [ref.QuantizedWeight(cpu.scheme, *_unpacked(cpu.w2.expert(e))) for e in range(E)]
    for t in (16, 4):
        layer = HybridMoE(cpu, placement_row(0.25, E, 20), device=dev, gpu_dtype="int8")
        gen = torch.Generator().manual_seed(7)
        x = (torch.randn(t, H, generator=gen) * 0.5).to(torch.bfloat16)
        ids, w = routing(t, E, K, gen, "cpu")
        exp = ref.moe_forward_quantized(x.float(), ids, w, q13, q2)
        xd, idd, wd = x.to(dev), ids.to(dev), w.to(dev)
        stop = threading.Event()
        errs, updates = [], [0]

        def replacer():
            k = 0
            while not stop.is_set():
                layer.update_placement(placement_row([0.1, 0.25, 0.5][k % 3], E, 100 + k))
                updates[0] += 1
                k += 1

        th = threading.Thread(target=replacer)
        th.start()
        s = torch.cuda.Stream()
        t_end = time.perf_counter() + seconds
        n = 0
        with torch.cuda.stream(s):
            while time.perf_counter() < t_end:
                y = layer(xd, idd, wd).float().cpu()
                errs.append(ref.relative_error(y, exp))
                n += 1
        stop.set()
        th.join()
        res["concurrency"][f"T{t}"] = dict(forwards=n, placement_updates=updates[0], max_rel_err=max(errs),
                                           graph_captures=layer.graphs.captures,
                                           graph_replays=layer.graphs.replays, ok=max(errs) < 0.02)
        print("concurrency", t, res["concurrency"][f"T{t}"], flush=True)


def section_prefill(cpu, dev, res, reps):
    gen = torch.Generator().manual_seed(4)
    t = 4096
    x = (torch.randn(t, H, generator=gen) * 0.5).to(torch.bfloat16).to(dev)
    ids, w = routing(t, E, K, gen, dev)
    row = placement_row(0.25, E, 5)
    base = HybridMoE(cpu, row, device=dev)
    pre = HybridMoE(cpu, row, device=dev, gpu_prefill_token_threshold=1024)
    auto = HybridMoE(cpu, row, device=dev, gpu_prefill_token_threshold="auto")
    tb = timed(lambda: base(x, ids, w), reps)
    tp = timed(lambda: pre(x, ids, w), reps)
    ya, yb = auto(x, ids, w), base(x, ids, w)
    torch.cuda.synchronize()
    res["prefill"] = dict(T=t, hybrid_cpu_path_min_ms=tb[0] * 1e3, layerwise_gpu_min_ms=tp[0] * 1e3,
                          speedup=tb[0] / tp[0], auto_threshold=auto.prefill_threshold_tokens(K),
                          auto_path=auto.stats.last_path,
                          auto_h2d_GBps=auto.cost.h2d_bytes_per_s / 1e9,
                          rel_diff_gpu_vs_cpu_path=ref.relative_error(ya.float().cpu(), yb.float().cpu()))
    print("prefill", res["prefill"], flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_arguments(ap)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--overlap-T", default="1,8,64,512,4096", help="T values of the overlap section")
    ap.add_argument("--sections", default="correctness,graph,concurrency,prefill,overlap",
                    help=f"comma list of {','.join(SECTIONS)}")
    args = ap.parse_args(argv)
    unknown = [n for n in args.sections.split(",") if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_hybrid: no CUDA device (tests/test_hybrid.py covers the all-CPU placements)")
    folder = out_dir(args)
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(0), "threads": args.threads, "shape": dict(E=E, K=K, H=H, I=I),
           "scheme": "int8", "errors": {}}
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    gate = (rng.standard_normal((E, I, H), dtype=np.float32) / np.sqrt(H))
    up = (rng.standard_normal((E, I, H), dtype=np.float32) / np.sqrt(H))
    down = (rng.standard_normal((E, H, I), dtype=np.float32) / np.sqrt(I))
    pool = CpuPool(args.threads)
    cpu = CPUMoE.from_tensors(gate, up, down, scheme="int8", pool=pool)
    del gate, up, down
    res["setup_s"] = time.perf_counter() - t0
    print(f"setup {res['setup_s']:.1f} s, {args.threads} CPU threads", flush=True)
    for name in args.sections.split(","):
        fn = {"correctness": lambda: section_correctness(cpu, dev, res),
              "overlap": lambda: section_overlap(cpu, dev, res, args.reps,
                                                 tuple(int(v) for v in args.overlap_T.split(","))),
              "graph_overlap": lambda: section_graph_overlap(cpu, dev, res, args.reps),
              "eager_graphs": lambda: section_eager_graphs(cpu, dev, res, args.reps),
              "graph": lambda: section_graph(cpu, dev, res),
              "concurrency": lambda: section_concurrency(cpu, dev, res),
              "prefill": lambda: section_prefill(cpu, dev, res, max(3, args.reps // 3))}[name]
        try:
            fn()
        except Exception:
            res["errors"][name] = traceback.format_exc()
            print(res["errors"][name], flush=True)
        path = write_result(folder, "hybrid", res, args.machine)
    print(json.dumps({k: v for k, v in res.items() if k != "errors"}, default=str)[:3000])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
