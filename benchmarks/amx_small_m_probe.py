#!/usr/bin/env python3
"""Where the AMX INT4 GEMM's time goes at the MoE layer's small per-expert M (qwen3 gate+up: N=1536,
K=2048; T=512 gives ~32 rows per expert, T=2048 ~128), against the INT8 GEMM on the same rows.

Every thread (1 or all cores) calls one kernel on its own weight copies in turn (cold: the copies of
all threads together are >= --pool-gb), timed as calls per wall second over all threads. Parts:
``int8`` (``gemm_int8``), ``int4`` (``gemm_int4``: ratio check + ratio kernel), ``int4_pre`` (the
kernel ``gemm_int4`` picked before session 20, inline up to 32 rows or staged, with the ratios
computed once beforehand), ``int4_keep`` (the inline kernel at any M in keep mode, as ``gemm_int4``
runs it up to 128 rows, the ratios computed beforehand), ``int4_lazy`` (``gemm_int4``'s inline
path, the ratios made pair by pair, on preallocated ratio tables),
``unpack`` (only the nibble unpacking of every block pair with its next-pair prefetch, as the
ratio kernels do it, no tiles; ``unpack_line`` the same with the per-line 8-bit multiply the
kernels used before session 27) and ``ratios`` (only
``_int4_ratios``); ``*_warm``: the same on the thread's first copy every call. A thread's round
of calls runs in one jitted loop (before session 20 each call came from Python, and with 16
threads the GIL hand-offs added ~150 us per call). Rounds interleave the parts; min and median us
per call (a round's wall time / its calls) and GB/s of weights per thread.

Device:  PYTHONPATH=. python3 benchmarks/amx_small_m_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import numpy as np
from numba import njit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from kt import reference as R  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402


def kernels():
    """The probe's parts as jitted loops: each call runs ``calls`` kernel calls on the stacked weight
    copies C ([copies, ...]; warm: always the first copy), so a thread takes the GIL once per
    round, not once per kernel call (which cost ~150 us per call with 16 threads, session 10)."""
    from kt.cpu_ops import kernels_amx as K
    from kt.cpu_ops._amx import prefetch_l2, unpack_int4_line_mul

    @njit(nogil=True)
    def int8(xq, xs, C, scale, wsum, out, calls, warm):
        for i in range(calls):
            K.gemm_int8(xq, xs, C[0 if warm else i % C.shape[0]], scale, wsum, out, 0, C.shape[1])

    @njit(nogil=True)
    def int4(xq, xs, C, scale, out, calls, warm):
        for i in range(calls):
            K.gemm_int4(xq, xs, C[0 if warm else i % C.shape[0]], scale, 64, out, 0, C.shape[1])

    @njit(nogil=True)
    def int4_pre(xq, xs, C, srow, rx, out, calls, warm):
        # what gemm_int4 ran before session 20 after its ratio check
        for i in range(calls):
            data = C[0 if warm else i % C.shape[0]]
            if xq.shape[0] <= 32:
                K.gemm_int4_inline(xq, xs, data, 64, srow, rx, out, 0, data.shape[0], 1, True)
            else:
                K.gemm_int4_staged(xq, xs, data, 64, srow, rx, out, 0, data.shape[0],
                                   K.default_mc(xq.shape[1]), 16, True, True)

    @njit(nogil=True)
    def int4_keep(xq, xs, C, srow, rx, out, calls, warm):
        # the inline kernel at any M, the first panel's unpacked pair kept for the later panels
        for i in range(calls):
            data = C[0 if warm else i % C.shape[0]]
            K.gemm_int4_inline(xq, xs, data, 64, srow, rx, out, 0, data.shape[0], 1, True, True)

    @njit(nogil=True)
    def int4_lazy(xq, xs, C, scale, srow, rx, out, calls, warm):
        # gemm_int4's inline path (ratios made pair by pair) on preallocated srow / rx
        for i in range(calls):
            data = C[0 if warm else i % C.shape[0]]
            K._int4_inline(xq, xs, data, 64, srow, rx, out, 0, data.shape[0], 1, True, True, scale, True)

    @njit(nogil=True)
    def unpack(C, rx, bs, line, calls, warm):
        # the ratio kernel's unpacking of every block pair (``_unpack_pair_ratio``), its next-pair
        # prefetch included; line: one 8-bit multiply per line instead (``unpack_int4_line_mul``,
        # the kernels' unpack before session 27)
        nb, lines = C.shape[1], C.shape[2]
        ng = rx.shape[0] // (nb * 16)
        lpg = lines // ng
        blk = lines * 128
        for i in range(calls):
            data = C[0 if warm else i % C.shape[0]]
            for b in range(0, nb, 2):
                if not line:
                    K._unpack_pair_ratio(data, b, 0, nb, ng, lpg, rx, bs, blk)
                    continue
                for q in range(2):
                    nxt = b + 2 + q
                    ro = (b + q) * ng * 16
                    jg = 0
                    for j in range(lines):
                        if nxt < nb:
                            prefetch_l2(data, (nxt * lines + j) * 64)
                        unpack_int4_line_mul(data, ((b + q) * lines + j) * 64, bs, q * blk + j * 128, rx, ro)
                        jg += 1
                        if jg == lpg:
                            jg = 0
                            ro += 16

    @njit(nogil=True)
    def ratios(scale, srow, rx, calls):
        for _ in range(calls):
            K._int4_ratios(scale, 0, scale.shape[0], srow, rx)

    return K, int8, int4, int4_pre, int4_keep, int4_lazy, unpack, ratios


def run_threads(nthreads, fn_of_thread, calls):
    """Each thread calls fn_of_thread(t)(i) for i < calls; returns wall seconds."""
    start = threading.Barrier(nthreads + 1)
    done, errors = [], []

    def work(t):
        f = fn_of_thread(t)
        start.wait()
        try:
            for i in range(calls):
                f(i)
        except Exception as e:  # surfaced below, in the calling thread
            errors.append(e)
        done.append(time.perf_counter())

    ths = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for th in ths:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in ths:
        th.join()
    if errors:
        raise errors[0]
    return max(done) - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", default="32,128")
    ap.add_argument("--threads", default="1,16")
    ap.add_argument("--pool-gb", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if "amx" not in isa.runnable_variants():
        sys.exit("needs a host that runs AMX")
    K, f8, f4, f4p, f4k, f4l, funp, frat = kernels()
    n, d = 1536, 2048
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
    p8, p4 = pack(w, "int8"), pack(w, "int4", 64)
    nb = p4.num_blocks
    srow = K.empty_line(nb * 16, np.float32)
    rx = K.empty_line(nb * p4.scale.shape[1] * 16, np.int8)
    assert K._int4_ratios(p4.scale, 0, nb, srow, rx)
    thread_counts = [int(t) for t in a.threads.split(",")]
    nmax = max(thread_counts)
    per = max(4, int(a.pool_gb * 2**30 / (p8.data.nbytes + p4.data.nbytes) / nmax))
    t0 = time.perf_counter()
    # each thread's copies stacked in one allocation (over 4 MiB: NumPy asks for huge pages, as for
    # the layer's stacked weights)
    c8 = [K.empty_line(per * p8.data.size, np.int8).reshape((per,) + p8.data.shape) for _ in range(nmax)]
    c4 = [K.empty_line(per * p4.data.size, np.uint8).reshape((per,) + p4.data.shape) for _ in range(nmax)]
    for t in range(nmax):
        c8[t][...] = p8.data
        c4[t][...] = p4.data
    print(f"{nmax} x {per} copies of each weight in {time.perf_counter() - t0:.1f} s", flush=True)
    res = dict(shape=[n, d], copies_per_thread=per, rows=[])
    for m in [int(v) for v in a.M.split(",")]:
        x = rng.standard_normal((m, d), dtype=np.float32)
        xq, xs = R.quantize_act(x)
        outs = [np.empty((m, p8.n_pad), np.float32) for _ in range(nmax)]
        bss = [K.empty_line(2 * p4.data.shape[1] * 128, np.int8) for _ in range(nmax)]
        srows = [srow.copy() for _ in range(nmax)]
        rxs = [rx.copy() for _ in range(nmax)]
        parts = {  # name: (weight bytes per call, thread -> the thread's round of calls)
            "int8": (p8.data.nbytes, lambda t, c: f8(xq, xs, c8[t], p8.scale, p8.wsum, outs[t], c, False)),
            "int4": (p4.data.nbytes, lambda t, c: f4(xq, xs, c4[t], p4.scale, outs[t], c, False)),
            "int4_pre": (p4.data.nbytes, lambda t, c: f4p(xq, xs, c4[t], srows[t], rxs[t], outs[t], c, False)),
            "int4_keep": (p4.data.nbytes, lambda t, c: f4k(xq, xs, c4[t], srows[t], rxs[t], outs[t], c, False)),
            "int4_lazy": (p4.data.nbytes, lambda t, c: f4l(xq, xs, c4[t], p4.scale, srows[t], rxs[t], outs[t], c,
                                                            False)),
            "unpack": (p4.data.nbytes, lambda t, c: funp(c4[t], rxs[t], bss[t], False, c, False)),
            "unpack_line": (p4.data.nbytes, lambda t, c: funp(c4[t], rxs[t], bss[t], True, c, False)),
            "ratios": (0, lambda t, c: frat(p4.scale, srows[t], rxs[t], c)),
            # warm: the thread's first copy every call
            "int8_warm": (p8.data.nbytes, lambda t, c: f8(xq, xs, c8[t], p8.scale, p8.wsum, outs[t], c, True)),
            "int4_pre_warm": (p4.data.nbytes, lambda t, c: f4p(xq, xs, c4[t], srows[t], rxs[t], outs[t], c,
                                                                True)),
            "unpack_warm": (p4.data.nbytes, lambda t, c: funp(c4[t], rxs[t], bss[t], False, c, True)),
            "unpack_line_warm": (p4.data.nbytes, lambda t, c: funp(c4[t], rxs[t], bss[t], True, c, True)),
        }
        for nt in thread_counts:
            for _, f in parts.values():  # compile and warm
                run_threads(nt, lambda t: lambda i: f(t, 2), 1)
            ts = {k: [] for k in parts}
            for _ in range(a.rounds):
                for k, (_, f) in parts.items():
                    ts[k].append(run_threads(nt, lambda t: lambda i: f(t, per), 1) / per)
            for k, v in ts.items():
                nbytes = parts[k][0]
                row = dict(M=m, threads=nt, part=k, min_us=min(v) * 1e6, med_us=statistics.median(v) * 1e6,
                           gbs_per_thread=nbytes / min(v) / 1e9 if nbytes else None,
                           tops_per_thread=2 * m * n * d / min(v) / 1e12 if k.startswith("int") else None)
                res["rows"].append(row)
                extra = (f"  {row['gbs_per_thread']:6.2f} GB/s/thread" if nbytes else "") + \
                    (f"  {row['tops_per_thread']:5.3f} TOPS/thread" if row["tops_per_thread"] else "")
                print(f"M={m:4d} thr={nt:2d} {k:9s} min {row['min_us']:8.1f} us  med {row['med_us']:8.1f}{extra}",
                      flush=True)
    if a.out:
        write_json(a.out, "amx_small_m_probe.json", res)


if __name__ == "__main__":
    main()
