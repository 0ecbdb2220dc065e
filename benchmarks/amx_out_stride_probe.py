#!/usr/bin/env python3
"""One-core AMX INT8 GEMM at the MoE layer's shapes with the output's row stride exact or padded by
one or two cache lines: does writing 32x32 panels into rows 6 KiB (gate+up, N=1536) or 8 KiB (down,
N=2048) apart cost more than into rows a line longer? (16 rows 8 KiB apart fall into the same L1
sets; the layer's gate+up and down outputs have exactly these strides.)

Session 17 (amx_k_sweep_probe.py) found ~1 ns per output element at K=256 whatever N: a per-panel
cost of ~2000 cycles. Weights warm, min of 5 calls per round, interleaved rounds.

Device:  PYTHONPATH=. python3 benchmarks/amx_out_stride_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from _rounds import interleaved_rounds  # noqa: E402
from kt import reference as R  # noqa: E402
from kt.cpu_ops import _align, isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402

SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}  # (N, K) of qwen3-30b-a3b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--m", default="32,128,512")
    a = ap.parse_args()
    if "amx" not in isa.runnable_variants():
        sys.exit("needs a host that runs AMX")
    from kt.cpu_ops import kernels_amx as K

    rng = np.random.default_rng(0)
    cases = {}
    for shape, (n, d) in SHAPES.items():
        w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
        p = pack(w, "int8")
        for m in map(int, a.m.split(",")):
            xq, xs = R.quantize_act(rng.standard_normal((m, d), dtype=np.float32))
            for pad in (0, 16, 32):  # fp32 elements past N: 0, one line, two lines
                out = _align.empty((m, n + pad), np.float32)[:, :n]
                cases[(shape, m, pad)] = (lambda xq=xq, xs=xs, p=p, out=out:
                                          K.gemm_int8(xq, xs, p.data, p.scale, p.wsum, out, 0, p.num_blocks))
    times, _ = interleaved_rounds(cases, a.rounds)
    rows = []
    for (shape, m, pad), ts in times.items():
        n, d = SHAPES[shape]
        base = min(times[(shape, m, 0)])
        row = dict(shape=shape, M=m, N=n, K=d, pad_floats=pad, row_bytes=4 * (n + pad), min_us=min(ts) * 1e6,
                   median_us=sorted(ts)[len(ts) // 2] * 1e6, vs_exact=base / min(ts))
        rows.append(row)
        print(f"{shape:7s} M={m:4d} row {4 * (n + pad):5d} B: min {row['min_us']:8.1f} us, median "
              f"{row['median_us']:8.1f} us, {row['vs_exact']:.3f}x the exact stride's speed", flush=True)
    if a.out:
        write_json(a.out, "amx_out_stride_probe.json", dict(rows=rows))


if __name__ == "__main__":
    main()
