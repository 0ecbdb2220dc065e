#!/usr/bin/env python3
"""One-core AMX GEMM at M=512, N=1536, K=2048 (qwen3 gate+up), warm weights: INT8, INT4 through the
flush-free ratio kernel (``gemm_int4``) and through the per-group flush kernel
(``gemm_int4_blocked``), interleaved rounds, against the tile-resident int8 peak of the same run.

Device:  PYTHONPATH=. python3 benchmarks/amx_int4_ratio_probe.py --out $OUT
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _results import write_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
from _rounds import amx_int8_peak, interleaved_rounds  # noqa: E402
from kt import reference as R  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if "amx" not in isa.runnable_variants():
        sys.exit("needs a host that runs AMX")
    from kt.cpu_ops import kernels_amx as K

    m, n, d = 512, 1536, 2048
    rng = np.random.default_rng(0)
    x = rng.standard_normal((m, d), dtype=np.float32)
    w = (rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d)))
    xq, xs = R.quantize_act(x)
    p8, p4 = pack(w, "int8"), pack(w, "int4", 64)
    out = np.empty((m, n), np.float32)
    mc = K.default_mc(d)
    calls = {
        "int8": lambda: K.gemm_int8(xq, xs, p8.data, p8.scale, p8.wsum, out, 0, p8.num_blocks),
        "int4_ratio": lambda: K.gemm_int4(xq, xs, p4.data, p4.scale, 64, out, 0, p4.num_blocks),
        "int4_flush": lambda: K.gemm_int4_blocked(xq, xs, p4.data, p4.scale, 64, out, 0, p4.num_blocks,
                                                  mc, 512, True, True),
    }
    K.peak_int8(1000)
    times, peaks = interleaved_rounds(calls, a.rounds, lambda: amx_int8_peak(K))
    peak = max(peaks)
    res = dict(shape=[m, n, d], peak_int8_tops=peak, peaks=peaks, rows=[])
    for k, ts in times.items():
        tops = 2 * m * n * d / min(ts) / 1e12
        med = 2 * m * n * d / sorted(ts)[len(ts) // 2] / 1e12
        res["rows"].append(dict(kernel=k, min_ms=min(ts) * 1e3, tops_max=tops, tops_median=med,
                                of_peak=tops / peak))
        print(f"{k:11s} min {min(ts) * 1e3:7.3f} ms  {tops:5.2f} TOPS (median {med:5.2f})  "
              f"{100 * tops / peak:4.1f} % of the {peak:.2f} TOPS tile-resident peak", flush=True)
    if a.out:
        write_json(a.out, "amx_int4_ratio_probe.json", res)


if __name__ == "__main__":
    main()
