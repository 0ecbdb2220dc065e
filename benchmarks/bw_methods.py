"""The all-thread read bandwidth by each method the benchmarks have used, interleaved, so a floor's
bandwidth can be judged: session 22's (one nogil call per 4 MiB piece, the GIL taken between
pieces, no software prefetch) and session 23's (``bench_gemm.all_thread_bandwidth``: one call per
thread, without and with an L2 prefetch 1 or 4 KiB ahead). Prints GB/s per round; writes
bw_methods.json under --out.

    PYTHONPATH=. python3 benchmarks/bw_methods.py --threads 16 --rounds 3 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import _read_bw, all_thread_bandwidth, threads_wall  # noqa: E402


def per_piece(buf, threads: int) -> float:
    """Session 22's method: each thread calls the read kernel once per 4 MiB piece; best of 3."""
    sl = len(buf) // threads // (4 << 20) * (4 << 20)

    def work(i):
        for o in range(i * sl, (i + 1) * sl, 4 << 20):
            _read_bw(buf, o, o + (4 << 20), 4)

    return max(sl * threads / threads_wall(work, threads) for _ in range(3))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    buf = np.ones(int(a.gib * (1 << 30)), np.uint8)
    _read_bw(buf, 0, 1 << 20, 4)
    rows = []
    for r in range(a.rounds):
        old = per_piece(buf, a.threads) / 1e9
        detail = {}
        new = all_thread_bandwidth(a.threads, a.gib, detail) / 1e9
        rows.append({"round": r, "per_piece_GBps": round(old, 2), "best_GBps": round(new, 2), **detail})
        print(f"round {r}: per-piece calls {old:.1f} GB/s; one call per thread {detail} -> {new:.1f}",
              flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bw_methods.json").write_text(json.dumps({"threads": a.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
