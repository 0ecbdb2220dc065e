"""A decode call (T=1) of the CPU MoE layer against a floor measured beside it, call by call.

A T=1 layer call and a plain read of the same bytes alternate on the same pool: the read covers the
arrays the call's kernels read (``CPUMoE.read_arrays``: packed values and scales or ratio tables) for
the same experts, taken from another cold copy of the layer, split into 64 KiB chunks that the
pool's threads claim as the layer's tasks are claimed, each read with 64-byte loads and an L2
prefetch 4 KiB ahead (as the decode GEMVs read). Each round gives the layer's wall time (a plain
call, as a model makes it), the read's span on the time-stamp counter (first chunk started to last
chunk done: the bandwidth the pool got for those bytes at that moment, without the hand-off), and
their ratio. One all-thread bandwidth reading moves by up to 1.4x within minutes on the H200 host
(91-129 GB/s), far more than the calls do, so a floor taken once per run says as much about the
moment as about the layer; this one is taken within milliseconds of each call.

``--variants gated`` adds the stream-gated job (the CPU part of a hybrid layer's decode step:
published ahead, started by a flag, no Python between its start and done flags) beside the plain
call. The variants' order turns each round. ``--sequence N`` runs each variant N calls in a row
(other copies, as a model's layers come) and leaves the first out, so a call follows one of its
own kind rather than the read (what ran before moves a call's Python by tens of microseconds).

    PYTHONPATH=. python3 benchmarks/cpu_decode_floor.py --threads 16 --rounds 300 --sequence 4 \\
        --x-bf16 --variants gated
    python benchmarks/cpu_decode_floor.py --threads 2 --pool-gb 2.4 --rounds 100 --x-bf16

Writes benchmarks/results/<machine>/cpu_decode_floor.json (see _results.py).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import carray, njit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import add_out_arguments, out_dir, write_result  # noqa: E402
from bench_gemm import _read_slice  # noqa: E402
from bench_moe import SHAPES, _copy, add_shape, build_layer, check_shape, routing  # noqa: E402
from kt.config import QuantScheme  # noqa: E402
from kt.cpu_ops import CpuPool, CPUMoE  # noqa: E402
from kt.cpu_ops.runtime.atomics import atomic_add, atomic_store, cycles, tsc_hz  # noqa: E402
from kt.cpu_ops.runtime.native import ptr as _ptr  # noqa: E402
from kt.cpu_ops.runtime.worker import CTRL_STRIDE, DESC_SIZE, JOB_COMPLETE, JOB_FREE, JOB_JOIN  # noqa: E402

CHUNK = 64 << 10
PF = 4096
RES_WORDS = 16  # per participant: first chunk's start, last chunk's end, a checksum (own lines)


@njit(nogil=True, cache=True)
def _read_job(nth, jctrl, desc):
    """desc: [segments, chunk bytes, result address, chunks in all, (address, bytes) per segment].
    Participants claim chunks (jctrl[JOB_FREE]) and read them; the last of nth to leave completes."""
    me = atomic_add(jctrl, JOB_JOIN, 1)
    if me >= nth:
        return
    nseg = desc[0]
    ch = desc[1]
    res = carray(_ptr(desc[2], np.int64), (nth * RES_WORDS,))
    nch = desc[3]
    sink = np.int64(0)
    t_first = np.int64(0)
    while True:
        i = atomic_add(jctrl, JOB_FREE, 1)
        if i >= nch:
            break
        if t_first == 0:
            t_first = cycles()
        s = 0
        ci = i
        while s < nseg:
            nc = (desc[5 + 2 * s] + ch - 1) // ch
            if ci < nc:
                break
            ci -= nc
            s += 1
        n = desc[5 + 2 * s]
        buf = carray(_ptr(desc[4 + 2 * s], np.uint8), (n,))
        lo = ci * ch
        # one stream, the L2 prefetch running on past the chunk to the segment's end
        sink ^= _read_slice(buf, lo, min(n, lo + ch), ch, 1, PF, n)
    res[me * RES_WORDS] = t_first
    res[me * RES_WORDS + 1] = cycles() if t_first != 0 else 0
    res[me * RES_WORDS + 2] = sink
    if atomic_add(jctrl, JOB_FREE + CTRL_STRIDE, 1) == nth - 1:
        atomic_store(jctrl, JOB_COMPLETE, 1)


def read_segments(layer, experts) -> list[tuple[np.ndarray, int]]:
    """(array slice, bytes) of every array the layer's kernels read, for those experts."""
    return [(a[e], a[e].nbytes) for e in experts for a in layer.read_arrays()]


def timed_read(pool: CpuPool, segs, res: np.ndarray) -> tuple[float, float]:
    """(wall seconds of the read job, seconds from its first chunk's start to its last chunk's end)."""
    nth = pool.num_threads
    t0 = time.perf_counter()
    if 4 + 2 * len(segs) > DESC_SIZE:
        raise ValueError(f"{len(segs)} segments do not fit the pool's job descriptor")
    desc, _ = pool.begin(JOB_FREE + 2 * CTRL_STRIDE)
    desc[0] = len(segs)
    desc[1] = CHUNK
    desc[2] = res.ctypes.data
    desc[3] = sum(-(-n // CHUNK) for _, n in segs)
    for s, (a, n) in enumerate(segs):
        desc[4 + 2 * s] = a.ctypes.data
        desc[5 + 2 * s] = n
    res[:] = 0
    pool.submit_native(_read_job, keep=(segs, res)).wait()
    wall = time.perf_counter() - t0
    r = res.reshape(nth, RES_WORDS)
    used = r[:, 0] > 0
    span = (r[used, 1].max() - r[used, 0].min()) / tsc_hz()
    return wall, span


def cold_copies(scheme, shape, pool_bytes, pool) -> list[CPUMoE]:
    """Copies of one random layer totalling about ``pool_bytes`` (at least 2), each in its own memory."""
    E, K, H, I = SHAPES[shape]
    w13, w2 = build_layer(E, H, I, scheme)
    n = max(2, -(-pool_bytes // (w13.nbytes + w2.nbytes)))
    insts = [(w13, w2)] + [(_copy(w13), _copy(w2)) for _ in range(n - 1)]
    return [CPUMoE(a, b, pool=pool) for a, b in insts]


class GatedCall:
    """Time a layer's stream-gated decode job (``CPUMoE.submit_gated``, the decode path of a hybrid
    layer) from its start flag to its done flag: the job is published first (the Python part,
    untimed, as a hybrid layer publishes it before the stream needs it), the pool's background
    threads wait at its gate, and this thread sets "start" and spins until "done". The caller is
    not a participant (as a hybrid layer's service thread is not): one pool thread fewer than a
    plain call, and the spinning caller takes the core it leaves."""

    def __init__(self, x, K):
        if not isinstance(x, np.ndarray):  # a torch bf16 tensor: its bits
            import torch

            x = x.view(torch.int16).numpy().view(np.uint16)
        self.x = np.ascontiguousarray(x)
        self.out = np.empty_like(self.x)
        self.ids = np.zeros((self.x.shape[0], K), np.int64)
        self.w = np.zeros((self.x.shape[0], K), np.float32)
        self.flags = np.zeros(32, np.int32)  # start at [0], done at [16]: lines of their own

    def __call__(self, layer, ids, w) -> float:
        self.ids[...] = ids
        self.w[...] = w
        self.flags[:] = 0
        f = self.flags
        h = layer.submit_gated(self.x, self.ids, self.w, self.out, f[0:].ctypes.data, f[16:].ctypes.data)
        t_pub = time.perf_counter()
        while time.perf_counter() - t_pub < 50e-6:  # the workers reach the gate
            pass
        t0 = time.perf_counter()
        f[0] = 1
        while f[16] == 0:
            pass
        dt = time.perf_counter() - t0
        r = h.wait()
        if not r.finished:
            raise RuntimeError(f"gated job did not finish: {r}")
        return dt


def call_variant(v, L, x, ids, w, gated) -> float:
    """One T=1 call of variant ``v`` on layer ``L``; its seconds."""
    if v == "gated":
        return gated(L, ids, w)
    t1 = time.perf_counter()
    L(x, ids, w)
    return time.perf_counter() - t1


def run_scheme(sname, a, pool, rng, rows):
    scheme = QuantScheme.parse(sname)
    E, K, H, I = SHAPES[a.shape]
    t0 = time.time()
    layers = cold_copies(scheme, a.shape, int(a.pool_gb * 2**30), pool)
    n = len(layers)
    if n < 3:
        raise SystemExit(f"--pool-gb {a.pool_gb} holds {n} copies of the layer; at least 3 are needed")
    per_expert = layers[0].expert_read_bytes()
    print(f"{sname}: {n} copies built in {time.time() - t0:.0f} s; {per_expert / 1e6:.2f} MB read per "
          f"expert", flush=True)
    variants = {"default": layers}
    if a.gated:
        variants["gated"] = layers
    x = rng.standard_normal((1, H), dtype=np.float32)
    if a.x_bf16:
        import torch

        x = torch.from_numpy(x).to(torch.bfloat16)
    res = np.zeros(pool.num_threads * RES_WORDS, np.int64)
    gated = GatedCall(x, K) if a.gated else None
    calls = {v: [] for v in variants}
    spans, walls, nbytes, experts = [], [], [], []
    kinds = list(variants)
    seq = a.sequence
    c = 0  # copies in turn, calls and reads alike: a copy comes back after n uses (cold again)
    for i in range(a.rounds + 3):
        ids, w = routing(rng, 1, E, K)
        used = sorted(set(int(e) for e in ids.ravel() if e >= 0))
        # the variants' order turns each round: none always follows the read (a job the caller
        # took part in) or the same other variant
        r = i % len(kinds)
        for v in kinds[r:] + kinds[:r]:
            # with sequences, the first call (after another variant) is left out
            ts = []
            for _ in range(seq):
                ts.append(call_variant(v, variants[v][c % n], x, ids, w, gated))
                c += 1
            if i >= 3:
                calls[v].append(statistics.fmean(ts[1:]) if seq > 1 else ts[0])
        # the same experts of a copy no call of this round read
        segs = read_segments(layers[c % n], used)
        c += 1
        wall, span = timed_read(pool, segs, res)
        if i < 3:  # warm-up (compile, first touch)
            continue
        spans.append(span)
        walls.append(wall)
        nbytes.append(sum(nb for _, nb in segs))
        experts.append(len(used))
    mb = statistics.median(nbytes)
    read = {"read_span_min_ms": round(min(spans) * 1e3, 4),
            "read_span_median_ms": round(statistics.median(spans) * 1e3, 4),
            "read_wall_median_ms": round(statistics.median(walls) * 1e3, 4),
            "read_GBps_best": round(max(b / s for b, s in zip(nbytes, spans)) / 1e9, 1),
            "read_GBps_median": round(statistics.median(b / s for b, s in zip(nbytes, spans)) / 1e9, 1)}
    print(f"  read of the same {mb / 1e6:.1f} MB: {read['read_span_min_ms']:.3f} / "
          f"{read['read_span_median_ms']:.3f} ms ({read['read_GBps_median']} GB/s median, best "
          f"{read['read_GBps_best']})", flush=True)
    for v, cs in calls.items():
        ratios = [s / c for s, c in zip(spans, cs)]
        r = {"scheme": sname, "variant": v, "kernels": layers[0].variant, "T": 1, "threads": pool.num_threads,
             "rounds": a.rounds, "sequence": seq, "expert_read_bytes": per_expert,
             "experts_per_call_median": statistics.median(experts), "MB_per_call": round(mb / 1e6, 2),
             "call_min_ms": round(min(cs) * 1e3, 4), "call_median_ms": round(statistics.median(cs) * 1e3, 4),
             **read, "frac_of_floor_per_round_median": round(statistics.median(ratios), 3),
             "frac_of_floor_minima": round(min(spans) / min(cs), 3)}
        rows.append(r)
        print(f"  T=1 {v:9s}: call {r['call_min_ms']:.3f} / {r['call_median_ms']:.3f} ms (min / median); "
              f"floor / call {100 * r['frac_of_floor_per_round_median']:.0f} % per round (median), "
              f"{100 * r['frac_of_floor_minima']:.0f} % of minima", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b", help="a name of bench_moe.SHAPES")
    ap.add_argument("--add-shape", action="append", default=[], metavar="NAME=E,K,H,I",
                    help="another layer shape (experts, top-k, hidden, intermediate); repeatable")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--pool-gb", type=float, default=4.0, help="cold copies of the layer totalling this")
    ap.add_argument("--schemes", default="int4,int8,bf16")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--x-bf16", action="store_true", help="bf16 torch input, as a model passes it")
    ap.add_argument("--variants", default="", help="'gated': also the stream-gated job (a hybrid "
                    "layer's decode path) from its start flag to its done flag, interleaved")
    ap.add_argument("--sequence", type=int, default=1,
                    help="calls of a variant in a row per round (on other copies), as a model's "
                         "layers come one after another; the first of each run is left out")
    add_out_arguments(ap)
    a = ap.parse_args(argv)
    if a.sequence < 1:
        ap.error(f"--sequence must be at least 1, got {a.sequence}")
    unknown = [v for v in a.variants.split(",") if v and v != "gated"]
    if unknown:
        ap.error(f"unknown --variants {unknown}; the one variant is 'gated'")
    a.gated = "gated" in a.variants.split(",")
    try:
        for spec in a.add_shape:
            add_shape(spec)
        check_shape(a.shape)
    except ValueError as e:
        ap.error(str(e))
    pool = CpuPool(a.threads)
    rng = np.random.default_rng(0)
    rows = []
    try:
        for s in a.schemes.split(","):
            run_scheme(s, a, pool, rng, rows)
    finally:
        pool.shutdown()
    path = write_result(out_dir(a), "cpu_decode_floor", {"shape": a.shape, "dims_EKHI": SHAPES[a.shape],
                                                          "rows": rows}, a.machine)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
