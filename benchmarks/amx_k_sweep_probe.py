#!/usr/bin/env python3
"""Where a one-core AMX INT8 GEMM's time goes at M=512 (issue 3's figure): its time against K, N,
the M chunk and the output prefetch, interleaved with the tile-resident peak.

Session 17 found the one-core qwen3 gate+up GEMM (M=512, N=1536, K=2048) at 24-27 % of the peak
on a lease where session 8 had seen up to 44 %, and its TOPS growing with K (0.4 at K=256, 2.1 at
K=4096): each call has a cost proportional to M x N, not to K. This probe measures that split:
``gemm_int8`` (the shipped call) for M in {32, 128, 512} and K from 64 to 4096 at N=1536, then
``gemm_int8_pipe`` at M=512 with K in {256, 2048}, N in {256, 512, 1536} (the output fitting L2
or not), the default M chunk or 64 rows, and the output prefetch for writing on or off. Warm
weights, min of 5 calls per round, 5 interleaved rounds; us per call, ns per 32x32 output panel,
TOPS and the fraction of the peak (zero tiles, measured between the rounds).

Device:  PYTHONPATH=. python3 benchmarks/amx_k_sweep_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from _rounds import amx_int8_peak, interleaved_rounds  # noqa: E402
from bench_gemm import huge_empty  # noqa: E402
from kt import reference as R  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import PackedWeight, pack  # noqa: E402

N = 1536


def _operands(rng, m, n, d, huge):
    x = rng.standard_normal((m, d), dtype=np.float32)
    w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
    xq, xs = R.quantize_act(x)
    p = pack(w, "int8")
    if not huge:
        return xq, xs, p, np.empty((m, n), np.float32)
    data = huge_empty(p.data.shape, p.data.dtype)
    data[...] = p.data
    p = PackedWeight(p.scheme, p.n, p.d, p.n_pad, p.d_pad, p.group_size, data, p.scale, p.wsum)
    return xq, xs, p, huge_empty((m, n), np.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--m", default="32,128,512", help="M of the shipped call's sweep")
    ap.add_argument("--k", default="64,128,256,512,1024,2048,4096", help="K of the shipped call's sweep")
    ap.add_argument("--no-pipe", action="store_true", help="skip the gemm_int8_pipe part")
    ap.add_argument("--huge", action="store_true", help="weights and outputs in huge pages (bench_gemm.huge_empty)")
    a = ap.parse_args()
    if "amx" not in isa.runnable_variants():
        sys.exit("needs a host that runs AMX")
    from kt.cpu_ops import kernels_amx as K

    rng = np.random.default_rng(0)
    cases = {}
    for m in map(int, a.m.split(",")):
        for d in map(int, a.k.split(",")):
            xq, xs, p, out = _operands(rng, m, N, d, a.huge)
            cases[("shipped", m, d, N, 0, True)] = (
                lambda xq=xq, xs=xs, p=p, out=out:
                K.gemm_int8(xq, xs, p.data, p.scale, p.wsum, out, 0, p.num_blocks))
    for d in () if a.no_pipe else (256, 2048):
        xq, xs, p, out = _operands(rng, 512, N, d, a.huge)
        for nb in (96, 32, 16):
            for mc in (K.default_mc(d), 64):
                for pfw in (True, False):
                    cases[("pipe", 512, d, 16 * nb, mc, pfw)] = (
                        lambda xq=xq, xs=xs, p=p, out=out, nb=nb, mc=mc, pfw=pfw:
                        K.gemm_int8_pipe(xq, xs, p.data, p.scale, out, 0, nb, mc, 0, 2, pfw))
    K.peak_int8(1000)
    times, peaks = interleaved_rounds(cases, a.rounds, lambda: amx_int8_peak(K))
    peak = max(peaks)
    rows = []
    for (kind, m, d, n, mc, pfw), ts in times.items():
        t = min(ts)
        tops = 2 * m * n * d / t / 1e12
        row = dict(kernel=kind, M=m, K=d, N=n, mc=mc or None, pfw=pfw, min_us=t * 1e6,
                   median_us=sorted(ts)[len(ts) // 2] * 1e6, ns_per_panel=t / (m * n / 1024) * 1e9,
                   tops=tops, of_peak=tops / peak)
        rows.append(row)
        print(f"{kind:7s} M={m:4d} K={d:5d} N={n:5d} mc={mc or '-':>4} pfw={int(pfw)}: {t * 1e6:8.1f} us, "
              f"{row['ns_per_panel']:6.0f} ns per panel, {tops:5.2f} TOPS ({100 * tops / peak:4.1f} % of "
              f"{peak:.2f})", flush=True)
    if a.out:
        write_json(a.out, "amx_k_sweep_probe.json", dict(peak_int8_tops=peak, peaks=peaks, rows=rows))


if __name__ == "__main__":
    main()
