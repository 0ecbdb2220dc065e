"""Where the AMX INT8 GEMM's cycles go: the pipelined kernel with parts switched off.

A diagnostic, not a kernel: each variant is the panel loop of ``kernels_amx._gemm_pipe`` (INT8,
whole K) compiled with some work removed, so its results are wrong by design; the time each removal
saves is the cost of that part. Variants (compile-time switches, so no branch is left in the loop):

- ``full``: the kernel as shipped (epilogue, A and B tile loads every k-step, next-pair L2 prefetch)
- ``no_epi``: tiles stored, but no int32 -> fp32 scaling of the outputs
- ``no_a`` / ``no_b``: A (resp. B) tiles loaded once per panel, not every k-step
- ``no_ab``: neither reloaded (tile products + panel overhead only)
- ``order2``: the same loads, issued in a different order (both B tiles first, then A)
- ``b_l1``: B of the next k-step prefetched into L1 one step ahead
- ``shipped``: ``gemm_int8`` itself (adds the next-pair L2 prefetch and the output prefetch)

One core and all cores (pinned), weights warm, M in {128, 512}, N=1536, D=2048; "of peak" is of
the tile-resident peak on zeroed tiles (the highest measured; the random-tile loop is reported too:
it runs slower than these GEMM panels, see ``kernels_amx._peak``).
Device:  PYTHONPATH=. python3 benchmarks/amx_diag.py --out $OUT   (writes amx_diag.json)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amx_probe import peak_table, run_threads  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402
from kt.reference import quantize_act  # noqa: E402


def make_variant(KA, epi, load_a, load_b, order2, b_l1):
    from kt.cpu_ops._amx import (prefetch_l1, row16_scale_store, tdpbssd, tileloadd64,
                                 tilerelease, tilestored64, tilezero)

    pack_a, config = KA._pack_a, KA._config

    @njit(nogil=True)
    def panel(ap, a0, a1, data, o0, o1, ks, sb):
        tilezero(0)
        tilezero(1)
        tilezero(2)
        tilezero(3)
        tileloadd64(4, ap, a0, 64)
        tileloadd64(6, data, o0, 64)
        tileloadd64(5, ap, a1, 64)
        tileloadd64(7, data, o1, 64)
        for s in range(ks):
            nxt = s + 1 < ks
            if b_l1 and s + 1 < ks:
                for ln in range(16):
                    prefetch_l1(data, o0 + (s + 1) * sb + 64 * ln)
                    prefetch_l1(data, o1 + (s + 1) * sb + 64 * ln)
            if order2:
                tdpbssd(0, 4, 6)
                tdpbssd(2, 5, 6)
                if nxt and load_b:
                    tileloadd64(6, data, o0 + (s + 1) * sb, 64)
                tdpbssd(1, 4, 7)
                if nxt and load_a:
                    tileloadd64(4, ap, a0 + (s + 1) * sb, 64)
                tdpbssd(3, 5, 7)
                if nxt and load_b:
                    tileloadd64(7, data, o1 + (s + 1) * sb, 64)
                if nxt and load_a:
                    tileloadd64(5, ap, a1 + (s + 1) * sb, 64)
            else:
                tdpbssd(0, 4, 6)
                tdpbssd(1, 4, 7)
                if nxt and load_a:
                    tileloadd64(4, ap, a0 + (s + 1) * sb, 64)
                tdpbssd(2, 5, 6)
                if nxt and load_b:
                    tileloadd64(6, data, o0 + (s + 1) * sb, 64)
                tdpbssd(3, 5, 7)
                if nxt and load_a:
                    tileloadd64(5, ap, a1 + (s + 1) * sb, 64)
                if nxt and load_b:
                    tileloadd64(7, data, o1 + (s + 1) * sb, 64)

    @njit(nogil=True)
    def gemm(a, xs, data, scale, out, nb0, nb1):
        m_all = a.shape[0]
        ks = a.shape[1] // 64
        sb = 1024
        ost = out.strides[0] // 4
        blk = data.shape[1] * 64
        ap = pack_a(a, ks, 64)
        mpad = ap.shape[0] * 16
        cp = np.empty((32, 32), np.int32)
        cfg = np.zeros(64, np.uint8)
        config(cfg, 16, 64)
        for b in range(nb0, nb1, 2):
            o0 = b * blk
            o1 = o0 + blk
            for mp in range(0, mpad, 32):
                a0 = (mp // 16) * ks * sb
                panel(ap, a0, a0 + ks * sb, data, o0, o1, ks, sb)
                tilestored64(0, cp, 0, 128)
                tilestored64(1, cp, 16, 128)
                tilestored64(2, cp, 512, 128)
                tilestored64(3, cp, 528, 128)
                if epi:
                    for i in range(min(32, m_all - mp)):
                        oi = (mp + i) * ost + 16 * b
                        row16_scale_store(out, oi, cp, i * 32, scale, 16 * b, xs[mp + i])
                        row16_scale_store(out, oi + 16, cp, i * 32 + 16, scale, 16 * b + 16,
                                          xs[mp + i])
        tilerelease()

    return gemm


VARIANTS = {  # epi, load_a, load_b, order2, b_l1
    "full": (True, True, True, False, False),
    "no_epi": (False, True, True, False, False),
    "no_a": (True, False, True, False, False),
    "no_b": (True, True, False, False, False),
    "no_ab": (True, False, False, False, False),
    "order2": (True, True, True, True, False),
    "b_l1": (True, True, True, False, True),
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--M", default="128,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gop", type=float, default=100, help="GOP per thread per timing")
    a = ap.parse_args(argv)
    if isa.detect().variant != "amx":
        sys.exit("amx_diag needs a CPU where AMX runs")
    from kt.cpu_ops import kernels_amx as KA

    cpus = sorted(os.sched_getaffinity(0))
    sets = {"one": cpus[:1], "all": cpus}
    rows = []
    table = peak_table(KA, sets, rows, zeros=(True, False))
    peaks = {sname: table[(sname, False, True)] for sname in sets}
    rng = np.random.default_rng(0)
    n, d = 1536, 2048
    p = pack(rng.standard_normal((n, d), dtype=np.float32), "int8")
    ks = {k: make_variant(KA, *v) for k, v in VARIANTS.items()}
    ks["shipped"] = lambda xq, xs, data, scale, out, nb0, nb1: KA.gemm_int8(
        xq, xs, data, scale, p.wsum, out, nb0, nb1)
    for m in [int(v) for v in a.M.split(",")]:
        xq, xs = quantize_act(rng.standard_normal((m, d), dtype=np.float32))
        xq = np.ascontiguousarray(xq.astype(np.int8))
        xs = np.ascontiguousarray(xs.astype(np.float32).reshape(-1))
        outs = [np.zeros((m, p.n_pad), np.float32) for _ in cpus]
        ref = np.zeros((m, p.n_pad), np.float32)
        KA.gemm_int8(xq, xs, p.data, p.scale, p.wsum, ref, 0, p.num_blocks)
        ks["full"](xq, xs, p.data, p.scale, outs[0], 0, p.num_blocks)
        if not np.array_equal(ref, outs[0]):
            sys.exit("the 'full' diagnostic variant differs from gemm_int8")
        for f in ks.values():
            f(xq, xs, p.data, p.scale, outs[0], 0, p.num_blocks)
        ops = 2.0 * m * n * d
        calls = max(4, int(a.gop * 1e9 / ops))
        res = {}
        for _ in range(a.rounds):
            for sname, cs in sets.items():
                for name, f in ks.items():
                    took = run_threads(cs, lambda i, f=f: (
                        lambda: [f(xq, xs, p.data, p.scale, outs[i], 0, p.num_blocks)
                                 for _ in range(calls)]))
                    res.setdefault((sname, name), []).append(ops * calls / statistics.mean(took))
        for (sname, name), v in res.items():
            r = {"part": "gemm", "M": m, "set": sname, "variant": name,
                 "TOPS_per_thread_max": round(max(v) / 1e12, 3),
                 "TOPS_per_thread_median": round(statistics.median(v) / 1e12, 3),
                 "of_peak": round(max(v) / peaks[sname], 3)}
            rows.append(r)
            print(f"M={m:4d} {sname:4s} {name:8s} {r['TOPS_per_thread_max']:.3f} / "
                  f"{r['TOPS_per_thread_median']:.3f} TOPS per thread "
                  f"({100 * r['of_peak']:.0f} % of peak)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "amx_diag.json").write_text(json.dumps({"rows": rows}, indent=1))
    print(f"wrote {out / 'amx_diag.json'}")


if __name__ == "__main__":
    main()
