#!/usr/bin/env python3
"""One-core AMX INT8 GEMM (M=512, N=1536, K=2048) with its weights and output in 4 KiB pages
against the same in 2 MiB pages (transparent huge pages: a 2 MiB-aligned anonymous buffer with
madvise(MADV_HUGEPAGE)), four copies of each, interleaved rounds, against the tile-resident peak.

NumPy asks for huge pages only on arrays of 4 MiB and more, so a single packed 3 MB matrix and
its 3 MB output (as in bench_gemm.py and amx_int4_ratio_probe.py) sit in 4 KiB pages, placed
wherever the allocator put them, while the MoE layer's stacked weights get huge pages. Session 17
(runs 11-12): 1.3-1.4x faster in huge pages in every round, and the same from copy to copy (4 KiB
copies differed by up to 1.3x); the layer itself (weights_pages_probe.py) showed no difference.
Session 19: ``huge_empty`` was a shared anonymous mapping then, which got no huge pages on these
hosts (shmem THP off), so that gain was a fresh 2 MiB-aligned mapping against a NumPy allocation,
not the page size; it now maps privately (real huge pages), with no further gain.

Device:  PYTHONPATH=. python3 benchmarks/amx_hugepage_probe.py
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _rounds import amx_int8_peak, interleaved_rounds  # noqa: E402
from bench_gemm import huge_empty  # noqa: E402
from kt import reference as R  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402


def main():
    if "amx" not in isa.runnable_variants():
        sys.exit("needs a host that runs AMX")
    from kt.cpu_ops import kernels_amx as K

    for f in ("enabled", "defrag"):
        p = f"/sys/kernel/mm/transparent_hugepage/{f}"
        print(f"THP {f}: {open(p).read().strip() if os.path.exists(p) else '?'}")
    rng = np.random.default_rng(0)
    m, n, d = 512, 1536, 2048
    x = rng.standard_normal((m, d), dtype=np.float32)
    w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
    xq, xs = R.quantize_act(x)
    p = pack(w, "int8")
    cases = {}
    for c in range(4):
        for kind in ("plain", "huge"):
            if kind == "plain":
                data, out = p.data.copy(), np.empty((m, n), np.float32)
            else:
                data, out = huge_empty(p.data.shape, p.data.dtype), huge_empty((m, n), np.float32)
                data[...] = p.data
            cases[(kind, c)] = (lambda data=data, out=out:
                                K.gemm_int8(xq, xs, data, p.scale, p.wsum, out, 0, p.num_blocks))
    res, peaks = interleaved_rounds(cases, 5, lambda: amx_int8_peak(K))
    pk = max(peaks)
    for k, v in res.items():
        tops = 2 * m * n * d / min(v) / 1e12
        print(k, " ".join(f"{t * 1e6:7.0f}" for t in v), f"us per round; min {tops:.2f} TOPS = "
              f"{100 * tops / pk:.1f} % of {pk:.2f}")
    print([ln.strip() for ln in open("/proc/meminfo") if "AnonHugePages" in ln])


if __name__ == "__main__":
    main()
