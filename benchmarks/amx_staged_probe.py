#!/usr/bin/env python3
"""One-core AMX GEMMs: the staged kernels (``kernels_amx.gemm_*_staged``, the large-M default
from session 18) against the whole-K pipelined ones they replaced (``gemm_*_pipe``,
``gemm_int4_ratio``), INT8 / INT4 (G=64) / BF16 at qwen3-30b-a3b's gate+up (N=1536, K=2048) and
down (N=2048, K=768), M in {128, 512}, plus K-slice lengths (``kc<k>``) and M chunks (``mc<rows>``)
of the staged kernel. Weights and output in 2 MiB pages, interleaved rounds with the tile peak
between them; the fraction is of the best INT8 (BF16: the bf16) tile-resident peak of the run, on
zeroed tiles (the highest rate) and on random tiles (the data the GEMMs multiply).

What the staged kernel changes (see ``kernels_amx._staged_pair``): the pipelined loop loads both
operands from L2 at every k-step (4 KiB per 4 products, ~110-120 cycles against 64 at the tile
rate); cutting K into slices of 16 k-steps keeps a block pair's B slice (32 KiB) in L1 while A
streams past with the non-temporal hint, and each panel's epilogue runs during the next panel's
products instead of after them.

    PYTHONPATH=. python3 benchmarks/amx_staged_probe.py [--out DIR] [--rounds 5]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_json  # noqa: E402
from _rounds import amx_int8_peak, interleaved_rounds  # noqa: E402
from bench_gemm import huge_empty  # noqa: E402
from kt import reference as R  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402

SHAPES = ((1536, 2048), (2048, 768))


def _cases(K, scheme, m, n, d, rng):
    """{variant: f} for one (scheme, M, N, K): every variant writes the same output buffer."""
    x = rng.standard_normal((m, d), dtype=np.float32)
    w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
    p = pack(w, scheme, 64)
    data = huge_empty(p.data.shape, p.data.dtype)
    data[...] = p.data
    out = huge_empty((m, n), np.float32)
    nb = p.num_blocks
    if scheme == "bf16":
        import torch

        xb = torch.from_numpy(x).bfloat16().view(torch.int16).numpy().view(np.uint16)
        mc = K.default_mc(2 * d)
        c = {"pipe": lambda: K.gemm_bf16_pipe(xb, data, out, 0, nb, mc, 0, 1, True)}
        for kcs in (16, 32):
            c[f"staged kc{kcs}"] = lambda kcs=kcs: K.gemm_bf16_staged(xb, data, out, 0, nb, mc, kcs, 1,
                                                                      True, True)
        return c
    xq, xs = R.quantize_act(x)
    mc = K.default_mc(d)
    if scheme == "int8":
        # "staged kc16": gemm_int8's settings where M exceeds one M chunk (at M=512; below, gemm_int8
        # does not slice K), no output prefetch for writing since session 26; "pfw": the MoE layer's
        # form (gemm_int8_shared_out); "gemm_int8": the shipped call itself, at any M
        c = {"pipe": lambda: K.gemm_int8_pipe(xq, xs, data, p.scale, out, 0, nb, mc, 0, 2, True)}
        for kcs in (8, 16, 32):
            c[f"staged kc{kcs}"] = lambda kcs=kcs: K.gemm_int8_staged(xq, xs, data, p.scale, out, 0, nb, mc,
                                                                      kcs, 2, False, True)
        for mcs in (128, 512):  # 128 rows: the partial sums (mc x 128 B) and B's slice share L1
            c[f"staged kc16 mc{mcs}"] = lambda mcs=mcs: K.gemm_int8_staged(xq, xs, data, p.scale, out, 0, nb,
                                                                           mcs, 16, 2, False, True)
        c["staged kc16 pfw"] = lambda: K.gemm_int8_staged(xq, xs, data, p.scale, out, 0, nb, mc, 16, 2,
                                                          True, True)
        c["staged kc16 nonta"] = lambda: K.gemm_int8_staged(xq, xs, data, p.scale, out, 0, nb, mc, 16, 2,
                                                            False, False)
        c["staged kc16 l2d0"] = lambda: K.gemm_int8_staged(xq, xs, data, p.scale, out, 0, nb, mc, 16, 0,
                                                           False, True)
        c["staged kc16 l2d1"] = lambda: K.gemm_int8_staged(xq, xs, data, p.scale, out, 0, nb, mc, 16, 1,
                                                           False, True)
        c["gemm_int8"] = lambda: K.gemm_int8(xq, xs, data, p.scale, p.wsum, out, 0, nb)
        return c
    srow = np.empty(nb * 16, np.float32)
    rx = np.empty(nb * p.scale.shape[1] * 16, np.int8)
    assert K._int4_ratios(p.scale, 0, nb, srow, rx)
    return {"pipe": lambda: K.gemm_int4_ratio(xq, xs, data, 64, srow, rx, out, 0, nb, mc, True),
            "staged kc16": lambda: K.gemm_int4_staged(xq, xs, data, 64, srow, rx, out, 0, nb, mc, 16, True,
                                                      True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="directory for amx_staged_probe.json")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--M", default="128,512")
    ap.add_argument("--schemes", default="int8,int4,bf16")
    a = ap.parse_args()
    if "amx" not in isa.runnable_variants():
        sys.exit("needs a host that runs AMX")
    from kt.cpu_ops import kernels_amx as K

    rng = np.random.default_rng(0)
    cases, ops = {}, {}
    for scheme in a.schemes.split(","):
        for m in (int(v) for v in a.M.split(",")):
            for n, d in SHAPES:
                for name, f in _cases(K, scheme, m, n, d, rng).items():
                    cases[(scheme, m, n, d, name)] = f
                    ops[(scheme, m, n, d, name)] = 2 * m * n * d

    amx_int8_peak(K, 1000), amx_int8_peak(K, 1000, bf16=True)  # compile / load both
    amx_int8_peak(K, 1000, zero=False), amx_int8_peak(K, 1000, bf16=True, zero=False)
    times, pk = interleaved_rounds(cases, a.rounds, between=lambda: (
        amx_int8_peak(K, 100000), amx_int8_peak(K, 100000, bf16=True),
        amx_int8_peak(K, 100000, zero=False), amx_int8_peak(K, 100000, bf16=True, zero=False)))
    p8, p16, r8, r16 = (max(p[i] for p in pk) for i in range(4))
    rows = []
    base = {}
    for key, ts in times.items():
        scheme, m, n, d, name = key
        t, tm = min(ts), sorted(ts)[len(ts) // 2]
        peak = p16 if scheme == "bf16" else p8
        rpeak = r16 if scheme == "bf16" else r8
        if name == "pipe":
            base[key[:4]] = t
        rows.append({"scheme": scheme, "M": m, "N": n, "K": d, "variant": name, "min_us": round(t * 1e6, 1),
                     "median_us": round(tm * 1e6, 1), "tops": round(ops[key] / t / 1e12, 3),
                     "peak_frac": round(ops[key] / t / 1e12 / peak, 4),
                     "median_peak_frac": round(ops[key] / tm / 1e12 / peak, 4),
                     "random_peak_frac": round(ops[key] / t / 1e12 / rpeak, 4),
                     "median_random_peak_frac": round(ops[key] / tm / 1e12 / rpeak, 4),
                     "vs_pipe": round(base[key[:4]] / t, 3)})
        r = rows[-1]
        print(f"{scheme:4s} M={m:4d} N={n} K={d:4d} {name:18s} min {r['min_us']:8.1f} us  "
              f"{100 * r['peak_frac']:5.1f} % (median {100 * r['median_peak_frac']:5.1f} %; random-tile peak "
              f"{100 * r['random_peak_frac']:5.1f} / {100 * r['median_random_peak_frac']:5.1f} %)  "
              f"{r['vs_pipe']:.2f}x pipe", flush=True)
    print(f"tile peaks: int8 {p8:.2f} TOPS, bf16 {p16:.2f} TFLOPS (zero tiles); "
          f"int8 {r8:.2f}, bf16 {r16:.2f} (random tiles)")
    if a.out:
        write_json(a.out, "amx_staged_probe.json", {"int8_peak_tops": p8, "bf16_peak_tflops": p16,
                                                      "int8_random_peak_tops": r8,
                                                      "bf16_random_peak_tflops": r16,
                                                      "rounds": a.rounds, "rows": rows})


if __name__ == "__main__":
    main()
