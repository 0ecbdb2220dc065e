"""Why the AMX GEMM is slower inside the MoE layer than alone: the same kernels, one core vs all.

Each thread (pinned to its own CPU) runs the large-M kernel on its own weights, either warm (one
matrix, called again and again) or cold (its own copies, called in turn, so B comes from DRAM),
or cold_out (cold, and each call writes an output buffer another thread wrote last),
with the layer's per-expert shapes (gate+up N=1536, D=2048; M = 128 is T=2048's tokens per
expert, M = 512 the one-core figure of issue 3). Thread sets: one CPU, one CPU per physical core,
every CPU. Variants run interleaved, round by round. Also the tile-resident peak per thread set
and the CPU topology, so per-thread TOPS can be read against the peak of the same thread set.

Device:  PYTHONPATH=. python3 benchmarks/amx_probe.py --out $OUT   (writes amx_probe.json)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402
from kt.reference import f32_to_bf16_bits, quantize_act  # noqa: E402


def topology():
    """{cpu: core} from ``lscpu -p``, and the lscpu summary lines worth keeping."""
    cores = {}
    for line in subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET,NODE"], capture_output=True,
                               text=True).stdout.splitlines():
        if line and not line.startswith("#"):
            c, core, *_ = line.split(",")
            cores[int(c)] = int(core)
    keep = ("Model name", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "NUMA node(s)",
            "L2 cache", "L3 cache", "CPU max MHz", "Hypervisor")
    summary = [ln.strip() for ln in subprocess.run(["lscpu"], capture_output=True,
                                                   text=True).stdout.splitlines()
               if ln.strip().startswith(keep)]
    return cores, summary


def run_threads(cpus, fn_for):
    """Run fn_for(i)() on one thread per cpu (pinned to it; None: not pinned), started together;
    per-thread seconds."""
    bar = threading.Barrier(len(cpus))
    took = [0.0] * len(cpus)

    def body(i, cpu):
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        f = fn_for(i)
        bar.wait()
        t0 = time.perf_counter()
        f()
        took[i] = time.perf_counter() - t0

    ts = [threading.Thread(target=body, args=(i, c)) for i, c in enumerate(cpus)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return took


def peak(KA, cpus, bf, zero=True):
    """Tile-resident peak of the thread set (ops/s, all threads together); zeroed tiles (the
    highest rate) unless ``zero`` is False."""
    n = 200000
    f = KA.peak_bf16 if bf else KA.peak_int8
    f(1000, zero)
    best = min(max(run_threads(cpus, lambda i: (lambda: f(n, zero)))) for _ in range(3))
    return n * 4 * 2 * 16 * 16 * (32 if bf else 64) * len(cpus) / best


def peak_table(KA, sets, rows, zeros=(True,)):
    """Tile-resident peaks per thread set x scheme x tile data (``zeros``: True zeroed tiles,
    False random), appended to rows and printed; returns {(set, bf, zero): ops/s per thread}."""
    out = {}
    for sname, cpus in sets.items():
        for bf in (False, True):
            for zero in zeros:
                p = peak(KA, cpus, bf, zero)
                out[(sname, bf, zero)] = p / len(cpus)
                what = f"{'bf16' if bf else 'int8'} {'zero' if zero else 'random'} tiles"
                rows.append({"part": "peak", "set": sname, "threads": len(cpus),
                             "scheme": "bf16" if bf else "int8",
                             "tiles": "zero" if zero else "random",
                             "TOPS": round(p / 1e12, 3),
                             "TOPS_per_thread": round(p / len(cpus) / 1e12, 3)})
                print(f"peak {what} {sname:8s} ({len(cpus):2d} thr): {p / 1e12:6.2f} TOPS, "
                      f"{p / len(cpus) / 1e12:.2f} per thread", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--M", default="128,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold-mb", type=int, default=240, help="weight copies per thread (MiB)")
    ap.add_argument("--shapes", default="1536x2048", help="NxD list: 1536x2048 gate+up, 2048x768 down")
    ap.add_argument("--schemes", default="int8,bf16")
    ap.add_argument("--variants", default="", help="comma list (empty: all)")
    a = ap.parse_args(argv)
    if isa.detect().variant != "amx":
        sys.exit("amx_probe needs a CPU where AMX runs")
    from kt.cpu_ops import kernels_amx as KA

    cores, summary = topology()
    cpus_all = sorted(os.sched_getaffinity(0))
    seen, cpus_phys = set(), []
    for c in cpus_all:
        if cores.get(c, c) not in seen:
            seen.add(cores.get(c, c))
            cpus_phys.append(c)
    sets = {"one": cpus_all[:1], "per_core": cpus_phys, "all": cpus_all}
    if len(cpus_phys) == len(cpus_all):
        del sets["per_core"]
    rows = [{"part": "topology", "summary": summary, "cpus": cpus_all, "per_core": cpus_phys}]
    print("\n".join(summary), f"\nCPUs {len(cpus_all)}, physical cores {len(cpus_phys)}",
          flush=True)
    peaks = {(sname, bf): v for (sname, bf, _), v in peak_table(KA, sets, rows).items()}

    rng = np.random.default_rng(0)
    nthr = len(cpus_all)
    for shape in a.shapes.split(","):
        n, d = (int(v) for v in shape.split("x"))
        w = rng.standard_normal((n, d), dtype=np.float32)
        for scheme in a.schemes.split(","):
            probe_shape(KA, a, rows, sets, peaks, nthr, rng, n, d, scheme, pack(w, scheme))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "amx_probe.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out / 'amx_probe.json'}")


def probe_shape(KA, a, rows, sets, peaks, nthr, rng, n, d, scheme, p):
    """Time the variants of one (N, D, scheme) over M, thread sets and warm/cold weights."""
    bf = scheme == "bf16"
    ncopy = max(2, a.cold_mb * 2**20 // p.data.nbytes)
    copies = [[p.data.copy() for _ in range(ncopy)] for _ in range(nthr)]
    nb = p.num_blocks
    for m in [int(v) for v in a.M.split(",")]:
        x = rng.standard_normal((m, d), dtype=np.float32)
        if bf:
            xa = np.ascontiguousarray(f32_to_bf16_bits(x))
            mc = KA.default_mc(2 * d)
        else:
            xq, xs = quantize_act(x)
            xa = np.ascontiguousarray(xq.astype(np.int8))
            xs = np.ascontiguousarray(xs.astype(np.float32).reshape(-1))
            mc = KA.default_mc(d)
        outs = [np.zeros((m, p.n_pad), np.float32) for _ in range(nthr)]

        def kern(l2, pfw=False):
            if bf:
                return lambda data, out: KA.gemm_bf16_pipe(xa, data, out, 0, nb, mc, 0, l2, pfw)
            return lambda data, out: KA.gemm_int8_pipe(xa, xs, data, p.scale, out, 0, nb, mc,
                                                       0, l2, pfw)

        variants = {"pipe": kern(True), "pipe_pfw": kern(True, True)}
        if not bf:
            variants["blocked_kc8"] = lambda data, out: KA.gemm_int8_blocked(
                xa, xs, data, p.scale, out, 0, nb, mc, 8, 0)
        if a.variants:
            variants = {k: v for k, v in variants.items() if k in a.variants.split(",")}
        ref = None
        for name, f in variants.items():  # compile, and the variants agree exactly
            outs[0][:] = np.nan
            f(p.data, outs[0])
            if ref is None:
                ref = outs[0].copy()
            elif not np.array_equal(ref, outs[0]):
                sys.exit(f"{scheme} M={m}: variant {name} differs from pipe")
        ops = 2.0 * m * n * d
        calls = max(4, int(6e10 / ops))  # ~60 GOP per thread per timing
        res = {}
        for _ in range(a.rounds):
            for sname, cpus in sets.items():
                for temp in ("warm", "cold", "cold_out"):
                    for name, f in variants.items():
                        def fn_for(i, f=f, temp=temp):
                            cs = copies[i]
                            out = outs[i]
                            if temp == "warm":
                                return lambda: [f(cs[0], out) for _ in range(calls)]
                            if temp == "cold":
                                return lambda: [f(cs[j % len(cs)], out) for j in range(calls)]
                            # cold weights and an output last written by another thread (as the
                            # layer's shared gu / y rows): ownership moves between cores
                            return lambda: [f(cs[j % len(cs)], outs[(i + j) % nthr])
                                            for j in range(calls)]
                        took = run_threads(cpus, fn_for)
                        per_thr = ops * calls / statistics.mean(took)
                        res.setdefault((sname, temp, name), []).append(per_thr)
        for (sname, temp, name), v in res.items():
            pk = peaks[(sname, bf)]
            r = {"part": "gemm", "scheme": scheme, "N": n, "D": d, "M": m, "set": sname,
                 "threads": len(sets[sname]), "weights": temp, "variant": name,
                 "TOPS_per_thread_max": round(max(v) / 1e12, 3),
                 "TOPS_per_thread_median": round(statistics.median(v) / 1e12, 3),
                 "of_set_peak": round(max(v) / pk, 3)}
            rows.append(r)
            print(f"{scheme} {n}x{d} M={m:4d} {sname:8s} {temp} {name:12s} "
                  f"{r['TOPS_per_thread_max']:.3f} / {r['TOPS_per_thread_median']:.3f} TOPS "
                  f"per thread ({100 * r['of_set_peak']:.0f} % of the set's peak)", flush=True)


if __name__ == "__main__":
    main()
