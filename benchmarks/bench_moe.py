"""CPU MoE layer benchmark: kt.CPUMoE on real model shapes, cold weights, fresh routing per call.

For each shape x scheme x thread count x T, in one process:
- min / median µs per layer call; GB/s of expert weights touched (distinct CPU experts hit x
  the bytes one expert's kernels read, ``CPUMoE.expert_read_bytes``); TOPS (2 * T * K * 3 * H *
  I); fraction of the roofline floor max(bytes / measured bandwidth, ops / (measured per-thread
  peak x threads)), bandwidth and peaks measured in the same run (benchmarks/bench_gemm.py's
  measurements);
- cold weights: every call uses the next of several copies of the layer, totalling --pool-gb;
- uniform routing: each token's K experts drawn without replacement, fresh for every call;
- per-call overhead: the pool's empty-job round trip and a T=1 call whose experts are all masked
  as GPU experts (nothing computed);
- baselines: ``--baseline torch`` (the naive per-expert bf16 loop transformers runs, cold copies
  too), ``--baseline kt-kernel``: kt-kernel 0.7.2 on the same shapes, schemes and T with the largest
  thread count, in a subprocess (``_ktkernel.py --side ktkernel``: its extension driven
  directly, its own cold copies and fresh routing), where its extension is found (``--ktk DIR``:
  a folder holding ``kt_kernel/_kt_kernel_ext_amx.*.so`` and ``kt_kernel.libs/``, default ``.ktk``
  or an installed kt_kernel; ``--ktk-python``: the interpreter to run it with, which must import
  torch, numba and kt); its rows get kt's speed-up (kt's best thread count) beside them.
- bandwidth for the floor: one and two threads (bench_gemm.measure_bandwidth), and for every larger
  thread count asked for, that many threads reading a 4 GiB buffer (bench_gemm.all_thread_bandwidth).

Shapes are names (``--shapes qwen3-30b-a3b,mixtral-8x7b``); ``--add-shape NAME=E,K,H,I`` names
another layer. Writes benchmarks/results/<machine>/moe.json (see _results.py) and prints the table:
    python benchmarks/bench_moe.py --shapes qwen3-30b-a3b --T 1,512 --threads 1,2 --baseline torch
    PYTHONPATH=. python3 benchmarks/bench_moe.py --T 1,32,512,2048 --threads 1,4,8,16 --pool-gb 6 \\
        --baseline torch --baseline kt-kernel --ktk .ktk          (a 16-core host, kt not installed)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import add_out_arguments, out_dir, write_result  # noqa: E402
from bench_gemm import all_thread_bandwidth, measure_bandwidth, measure_peaks, peak_for  # noqa: E402
from kt.config import QuantScheme  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops import CpuPool, CPUMoE  # noqa: E402
from kt.cpu_ops._moe_io import _pack_stack  # noqa: E402
from kt.cpu_ops.packing import PackedWeight  # noqa: E402

SHAPES = {  # E, K, H, I
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def add_shape(spec: str) -> str:
    """``NAME=E,K,H,I`` added to SHAPES (another layer shape, for --add-shape); returns the name."""
    name, _, dims = spec.partition("=")
    try:
        E, K, H, I = (int(v) for v in dims.split(","))
    except ValueError:
        raise ValueError(f"--add-shape {spec!r}: expected NAME=E,K,H,I (four integers)") from None
    if not name or min(E, K, H, I) < 1 or K > E:
        raise ValueError(f"--add-shape {spec!r}: expected a name and 1 <= K <= E, H >= 1, I >= 1")
    SHAPES[name] = (E, K, H, I)
    return name


def check_shape(name: str) -> str:
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)} (or --add-shape NAME=E,K,H,I)")
    return name


def _rand_expert(rng, n, d):
    return (rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d)))


def build_layer(E, H, I, scheme, seed=0):
    """Packed w13 [E, 2I, H], w2 [E, H, I] from random weights, generated one expert at a time."""
    rng = np.random.default_rng(seed)
    w13 = _pack_stack(lambda e: _rand_expert(rng, 2 * I, H), E, scheme, 64)
    w2 = _pack_stack(lambda e: _rand_expert(rng, H, I), E, scheme, 64)
    return w13, w2


def _copy(p: PackedWeight) -> PackedWeight:
    return PackedWeight(p.scheme, p.n, p.d, p.n_pad, p.d_pad, p.group_size, p.data.copy(),
                        p.scale.copy(), p.wsum.copy())


def routing(rng, T, E, K):
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :K].astype(np.int64)
    w = rng.random((T, K), dtype=np.float32)
    return ids, w / w.sum(axis=1, keepdims=True)


def time_calls(fn, layers, T, E, K, H, reps, rng, warm=2):
    """fn(layer, x, ids, w); returns (times_s, distinct experts per call)."""
    xs = [rng.standard_normal((T, H), dtype=np.float32) for _ in range(2)]
    ts, hit = [], []
    n = len(layers)
    for i in range(warm + reps):
        ids, w = routing(rng, T, E, K)
        x = xs[i % 2]
        layer = layers[i % n]
        t0 = time.perf_counter()
        fn(layer, x, ids, w)
        dt = time.perf_counter() - t0
        if i >= warm:
            ts.append(dt)
            hit.append(len(np.unique(ids)))
    return ts, hit


def _bw_for(bw, nt):
    """Bandwidth (B/s) for the floor with nt threads: the figure measured with nt threads for more
    than two, else the best figure measured for at most nt threads (the multi-thread figure is
    wall-clock and drops whenever other processes run on this machine)."""
    if nt > 2 and f"{nt}_thread_GBps" in bw:
        return bw[f"{nt}_thread_GBps"] * 1e9
    v = bw["1_thread_GBps"]
    if nt >= 2:
        v = max(v, bw.get("2_thread_GBps", 0.0))
    return v * 1e9


def find_ktkernel(root=None):
    """The folder holding kt-kernel's ``kt_kernel/`` extension: ``root`` if given, else the repo's
    ``.ktk`` if it exists, else an installed kt_kernel's parent folder; None if none is found."""
    if root:
        return str(root)
    local = Path(__file__).resolve().parent.parent / ".ktk"
    if (local / "kt_kernel").is_dir():
        return str(local)
    spec = importlib.util.find_spec("kt_kernel")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(list(spec.submodule_search_locations)[0]).parent)
    return None


def ktkernel_baseline(shape_name, Ts, schemes, threads, root, rows, notes, python=None, script=None,
                      budget_s=600.0):
    """kt-kernel on one shape in a subprocess (``_ktkernel.py --side ktkernel``): appends its
    rows (impl "kt-kernel", with kt's speed-up against its best thread count when kt's rows are
    there) to ``rows`` and any error to ``notes``."""
    E, K, H, I = SHAPES[shape_name]
    script = script or str(Path(__file__).resolve().parent / "_ktkernel.py")
    repo = str(Path(__file__).resolve().parent.parent)
    paths = [repo] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    with tempfile.TemporaryDirectory() as td:
        cmd = [python or sys.executable, script, "--ktk", root, "--side", "ktkernel", "--threads", str(threads),
               "--shape", f"{E},{K},{H},{I}", "--T", ",".join(map(str, Ts)), "--schemes", ",".join(schemes),
               "--budget-s", str(budget_s), "--out", td]
        print(f"  kt-kernel ({shape_name}, {threads} threads): {' '.join(cmd[1:])}", flush=True)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=2 * budget_s + 300)
        except subprocess.TimeoutExpired:
            notes.append(f"kt-kernel baseline ({shape_name}): no result within {2 * budget_s + 300:.0f} s")
            return
        path = Path(td, "ktkernel.json")
        if not path.exists():
            notes.append(f"kt-kernel baseline ({shape_name}) failed (exit {proc.returncode}): "
                         f"{(proc.stderr or proc.stdout)[-600:]}")
            return
        res = json.loads(path.read_text())
    for what, err in res.get("errors", {}).items():
        notes.append(f"kt-kernel baseline ({shape_name}, {what}): {str(err).strip().splitlines()[-1][:300]}")
    for r in res.get("rows", []):
        kt = [x for x in rows if x["impl"] == "kt" and x["shape"] == shape_name and x["scheme"] == r["scheme"]
              and x["T"] == r["T"]]
        best = min(kt, key=lambda x: x["min_us"]) if kt else None
        tmin = r["ktkernel_min_ms"] * 1e-3
        ops = 2.0 * r["T"] * K * 3 * H * I
        row = {"impl": "kt-kernel", "shape": shape_name, "scheme": r["scheme"],
               "kernels": res.get("ktkernel_variant", "amx"), "threads": threads, "T": r["T"],
               "min_us": round(tmin * 1e6, 1), "median_us": round(r["ktkernel_med_ms"] * 1e3, 1),
               "GBps": round(best["weight_MB"] * 1e6 / tmin / 1e9, 2) if best else None,
               "TOPS": round(ops / tmin / 1e12, 3),
               "frac_of_floor": round(best["floor_us"] * 1e-6 / tmin, 3) if best else None,
               "kt_speedup": round(tmin / (best["min_us"] * 1e-6), 2) if best else None}
        rows.append(row)
        sp = f"kt {row['kt_speedup']:.2f}x faster" if best else "no kt row"
        print(f"    kt-kernel {r['scheme']:4s} thr={threads} T={r['T']:5d}: min {tmin * 1e3:8.2f} ms  {sp}",
              flush=True)


def reps_for(T):
    return 20 if T <= 4 else (8 if T <= 64 else 4)


def bench_kt(shape_name, scheme, threads_list, Ts, pool_bytes, bw, peaks, rows, pin):
    E, K, H, I = SHAPES[shape_name]
    t0 = time.time()
    w13, w2 = build_layer(E, H, I, scheme)
    layer_bytes = w13.nbytes + w2.nbytes
    n_inst = max(2, -(-pool_bytes // layer_bytes))
    insts = [(w13, w2)] + [(_copy(w13), _copy(w2)) for _ in range(n_inst - 1)]
    print(f"  {shape_name} {scheme.value}: layer {layer_bytes / 2**20:.0f} MiB x {n_inst} copies "
          f"(built in {time.time() - t0:.0f} s)", flush=True)
    for nt in threads_list:
        pool = CpuPool(nt, pin=pin)
        layers = [CPUMoE(a, b, pool=pool) for a, b in insts]
        per_expert = layers[0].expert_read_bytes()  # what the kernels read (not every array held)
        variant = layers[0].variant
        peak = peak_for(scheme, variant, peaks)
        bw_t = _bw_for(bw, nt)
        rng = np.random.default_rng(1)
        for T in Ts:
            ts, hit = time_calls(lambda L, x, i, w: L(x, i, w), layers, T, E, K, H, reps_for(T), rng)
            tmin, tmed = min(ts), float(np.median(ts))
            nbytes = float(np.mean(hit)) * per_expert
            ops = 2.0 * T * K * 3 * H * I
            floor = max(nbytes / bw_t, ops / (peak * nt) if peak else 0.0)
            r = {"impl": "kt", "shape": shape_name, "scheme": scheme.value, "kernels": variant,
                 "threads": nt, "T": T, "min_us": round(tmin * 1e6, 1),
                 "median_us": round(tmed * 1e6, 1), "GBps": round(nbytes / tmin / 1e9, 2),
                 "TOPS": round(ops / tmin / 1e12, 3), "floor_us": round(floor * 1e6, 1),
                 "frac_of_floor": round(floor / tmin, 3), "weight_MB": round(nbytes / 1e6, 1)}
            rows.append(r)
            print(f"    kt {scheme.value:4s} thr={nt} T={T:5d}: min {tmin * 1e3:8.2f} ms  "
                  f"med {tmed * 1e3:8.2f} ms  {r['GBps']:6.1f} GB/s  {r['TOPS']:.3f} TOPS  "
                  f"{100 * r['frac_of_floor']:.0f}% of floor", flush=True)
        # per-call overhead: all experts on the "GPU", nothing to compute here
        mask = np.ones(E, bool)
        x = np.zeros((1, H), np.float32)
        ids, w = routing(np.random.default_rng(2), 1, E, K)
        for _ in range(20):
            layers[0](x, ids, w, gpu_mask=mask)
        ts = []
        for _ in range(200):
            t1 = time.perf_counter()
            layers[0](x, ids, w, gpu_mask=mask)
            ts.append(time.perf_counter() - t1)
        ho = pool.handoff_overhead_us(300)
        rows.append({"impl": "kt-overhead", "shape": shape_name, "scheme": scheme.value,
                     "threads": nt, "T": 1, "masked_call_min_us": round(min(ts) * 1e6, 1),
                     "masked_call_median_us": round(float(np.median(ts)) * 1e6, 1),
                     "pool_handoff_us": {k: round(v, 1) for k, v in ho.items()}})
        print(f"    overhead thr={nt}: masked T=1 call median {np.median(ts) * 1e6:.1f} µs, "
              f"pool hand-off median {ho['median']:.1f} µs", flush=True)
        pool.shutdown()
        del layers
    del insts, w13, w2


def bench_torch(shape_name, threads_list, Ts, pool_bytes, bw, rows):
    import torch
    import torch.nn.functional as F

    E, K, H, I = SHAPES[shape_name]
    layer_bytes = 3 * E * I * H * 2
    n_inst = max(2, -(-pool_bytes // layer_bytes))
    g = torch.Generator().manual_seed(0)
    insts = []
    for _ in range(n_inst):
        insts.append(tuple((torch.randn(E, n, d, generator=g) / d ** 0.5).to(torch.bfloat16)
                           for n, d in ((I, H), (I, H), (H, I))))
    print(f"  {shape_name} torch bf16: {layer_bytes / 2**20:.0f} MiB x {n_inst} copies", flush=True)

    def naive(layer, x, ids, w):
        gate, up, down = layer
        xt = torch.from_numpy(x).to(torch.bfloat16)
        idt = torch.from_numpy(ids)
        wt = torch.from_numpy(w).to(torch.bfloat16)
        out = torch.zeros_like(xt)
        for e in torch.unique(idt).tolist():
            tok, slot = torch.nonzero(idt == e, as_tuple=True)
            h = F.silu(xt[tok] @ gate[e].T) * (xt[tok] @ up[e].T)
            out.index_add_(0, tok, (h @ down[e].T) * wt[tok, slot, None])
        return out

    old = torch.get_num_threads()
    for nt in threads_list:
        torch.set_num_threads(nt)
        rng = np.random.default_rng(1)
        bw_t = _bw_for(bw, nt)
        for T in Ts:
            ts, hit = time_calls(naive, insts, T, E, K, H, reps_for(T), rng)
            tmin, tmed = min(ts), float(np.median(ts))
            nbytes = float(np.mean(hit)) * layer_bytes / E
            rows.append({"impl": "torch-bf16", "shape": shape_name, "scheme": "bf16", "threads": nt,
                         "T": T, "min_us": round(tmin * 1e6, 1), "median_us": round(tmed * 1e6, 1),
                         "GBps": round(nbytes / tmin / 1e9, 2),
                         "TOPS": round(2.0 * T * K * 3 * H * I / tmin / 1e12, 3),
                         "frac_of_floor": round(nbytes / bw_t / tmin, 3)})
            print(f"    torch bf16 thr={nt} T={T:5d}: min {tmin * 1e3:8.2f} ms  med {tmed * 1e3:8.2f} ms",
                  flush=True)
    torch.set_num_threads(old)


def markdown(res) -> str:
    lines = ["# CPU MoE layer (kt.CPUMoE)", "",
             f"Host: {res['host']['cpu']} ({res['host']['cpus']} CPUs), variant "
             f"{res['host']['variant']}. Measured bandwidth: " + ", ".join(
                 f"{k.split('_')[0]} thread(s) {v} GB/s" for k, v in res["bandwidth"].items()
                 if k.endswith("_thread_GBps")) + f". Peaks: {res['peaks']}.",
             f"Weights cold: copies totalling {res['pool_gb']} GB; fresh uniform routing per call.", "",
             "| impl | shape | scheme | kernels | thr | T | min ms | median ms | GB/s | TOPS | % of floor | kt speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        if r["impl"] == "kt-overhead":
            continue
        frac = "-" if r.get("frac_of_floor") is None else f"{100 * r['frac_of_floor']:.0f}"
        sp = "-" if r.get("kt_speedup") is None else f"{r['kt_speedup']:.2f}x"
        gbps = "-" if r.get("GBps") is None else r["GBps"]
        lines.append(f"| {r['impl']} | {r['shape']} | {r['scheme']} | {r.get('kernels', '-')} | "
                     f"{r['threads']} | {r['T']} | {r['min_us'] / 1e3:.2f} | {r['median_us'] / 1e3:.2f} | "
                     f"{gbps} | {r['TOPS']} | {frac} | {sp} |")
    lines += ["", "Per-call overhead (T=1, every expert masked as a GPU expert; pool empty-job round trip):", "",
              "| shape | scheme | thr | masked call min / median µs | pool hand-off min / median / p90 µs |",
              "|---|---|---|---|---|"]
    for r in res["rows"]:
        if r["impl"] == "kt-overhead":
            h = r["pool_handoff_us"]
            lines.append(f"| {r['shape']} | {r['scheme']} | {r['threads']} | {r['masked_call_min_us']} / "
                         f"{r['masked_call_median_us']} | {h['min']} / {h['median']} / {h['p90']} |")
    for note in res.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b")
    ap.add_argument("--T", default="1,512")
    ap.add_argument("--schemes", default="int8,int4,bf16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--pool-gb", type=float, default=2.4)
    ap.add_argument("--baseline", action="append", default=[], choices=["torch", "kt-kernel"])
    ap.add_argument("--pin", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--ktk", default=None, help="kt-kernel's extension folder (see --baseline kt-kernel)")
    ap.add_argument("--ktk-python", default=None, help="the interpreter for kt-kernel's run (default: this one)")
    ap.add_argument("--add-shape", action="append", default=[], metavar="NAME=E,K,H,I",
                    help="another layer shape (experts, top-k, hidden, intermediate); repeatable")
    add_out_arguments(ap)
    a = ap.parse_args(argv)
    try:
        for spec in a.add_shape:
            add_shape(spec)
        shapes = [check_shape(s) for s in a.shapes.split(",") if s]
    except ValueError as e:
        ap.error(str(e))
    Ts = [int(t) for t in a.T.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    schemes = [QuantScheme.parse(s) for s in a.schemes.split(",")]
    pool_bytes = int(a.pool_gb * 1e9)
    pin = {"auto": None, "on": True, "off": False}[a.pin]
    print("measuring bandwidth and peaks ...", flush=True)
    bw = measure_bandwidth(1.0)
    for nt in sorted(set(t for t in threads if t > 2)):
        bw[f"{nt}_thread_GBps"] = round(all_thread_bandwidth(nt) / 1e9, 2)
    peaks = measure_peaks(list(isa.runnable_variants()))
    print(f"  bandwidth {bw}\n  peaks {peaks}", flush=True)
    rows = []
    notes = []
    for s in shapes:
        for sch in schemes:
            bench_kt(s, sch, threads, Ts, pool_bytes, bw, peaks, rows, pin)
        if "torch" in a.baseline:
            bench_torch(s, threads, Ts, pool_bytes, bw, rows)
    if "kt-kernel" in a.baseline:
        root = find_ktkernel(a.ktk)
        if root is None:
            notes.append("--baseline kt-kernel skipped: no kt-kernel extension found (pass --ktk DIR, "
                         "a folder holding kt_kernel/ and kt_kernel.libs/ from kt-kernel's wheel)")
            print(notes[-1])
        else:
            for s in shapes:
                ktkernel_baseline(s, Ts, [sch.value for sch in schemes], max(threads), root, rows, notes,
                                  python=a.ktk_python)
    res = {"host": {"cpu": platform.processor() or isa.detect().host.model_name,
                    "cpus": len(os.sched_getaffinity(0)), "variant": isa.cpu_variant()},
           "bandwidth": bw, "peaks": peaks, "pool_gb": a.pool_gb, "rows": rows, "notes": notes}
    path = write_result(out_dir(a), "moe", res, a.machine)
    print(markdown(res))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
