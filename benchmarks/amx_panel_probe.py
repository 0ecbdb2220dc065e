"""Tile-load scheduling of the AMX INT8 GEMM panel: variants side by side, one core and all cores.

``amx_diag.py`` (session 3) found the tile loads to be most of the GEMM's cost: with 2x2 blocking
(4 accumulators, 2 A and 2 B tiles) the next B tile has one product (16 cycles) between its load and
its use. This probe times alternatives to the shipped panel (``kernels_amx.gemm_int8_pipe``), each
a copy of its loop with one change (compile-time switches, so nothing else differs):

- ``shipped``: ``gemm_int8_pipe`` with the layer's settings (next pair into L2, output lines
  prefetched for writing)
- ``pfa1`` / ``pfa2``: also prefetch the A tiles of k-step s + 1 / s + 2 into L1, every panel
- ``pfab2``: A and B tiles of k-step s + 2 into L1, every panel
- ``raw``: the epilogue stores the int32 tiles straight into the output (no scaling); what an
  epilogue moved into the activation / combine passes would cost here
- ``db12``: 1x2 blocking with double-buffered inputs (16-row panels; C 0-1, A 4/5, B 6-7 / 2-3):
  1.5 tile loads per product instead of 1, but every load two or more products ahead of its use

Also the tile-resident peak with four accumulators (as ``kernels_amx.peak_int8``) and with two
(``peak2``: each accumulator reused every other product), which says whether two accumulators can
keep the tile unit busy at all.

Shapes: qwen3-30b-a3b's gate+up (N=1536, D=2048) and down (N=2048, D=768), M = 128 (T=2048's rows
per expert) and 512 (issue 3's one-core figure); weights warm or cold with an output last written
by another thread (``cold_out``, as in the layer). Rounds interleave the variants.
Device:  PYTHONPATH=. python3 benchmarks/amx_panel_probe.py --out $OUT   (writes amx_panel_probe.json)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amx_probe import peak_table, run_threads  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402
from kt.reference import quantize_act  # noqa: E402

VARIANTS = {  # pfa (A L1 distance), pfb (B L1 distance), raw epilogue, 1x2 double-buffered,
    # A packed at a 64-byte boundary; weights and output at a 64-byte boundary (else 32 past one)
    "pfab2": (2, 2, False, False, False, False),
    "raw": (0, 0, True, False, False, False),
    "db12": (0, 0, False, True, False, False),
    "alB": None,  # gemm_int8_pipe itself on 64-byte aligned weights and output
    "alAB": (0, 0, False, False, True, True),
    "alAB_raw": (0, 0, True, False, True, True),
    "alAB_pfab2": (2, 2, False, False, True, True),
    # K slices of kcs k-steps (the pair's B slice stays in L1 across the chunk's panels; partial
    # sums stored and reloaded as tiles), aligned buffers
    "alAB_kc8": (0, 0, False, False, True, True, 8),
    "alAB_kc16": (0, 0, False, False, True, True, 16),
    # raw tiles stored into the output, then scaled in place: after each block pair over the
    # chunk's panels (2), or once at the end of the call (3)
    "alAB_rawpair": (0, 0, 2, False, True, True),
    "alAB_rawend": (0, 0, 3, False, True, True),
    # the block pairs' L2 prefetch (shipped since session 9: the pair two ahead, spread over this
    # pair's k-steps): none at all, the next pair only (before), or the next pair all issued
    # during this pair's first panel
    "l2none": (0, 0, 3, False, True, True, 0, "none"),
    "l2d1": (0, 0, 3, False, True, True, 0, "d1"),
    "l2front": (0, 0, 3, False, True, True, 0, "front"),
    "l2d3": (0, 0, 3, False, True, True, 0, "d3"),
    "l2d4": (0, 0, 3, False, True, True, 0, "d4"),
}


def aligned_empty(shape, dtype, off=0):
    """An array whose data starts ``off`` bytes past a 64-byte boundary."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    buf = np.empty(nbytes + 128, np.uint8)
    o = (-buf.ctypes.data) % 64 + off
    return buf[o:o + nbytes].view(dtype).reshape(shape)


def aligned_copy(a, off=0):
    b = aligned_empty(a.shape, a.dtype, off)
    b[...] = a
    return b


def make_variant(KA, pfa, pfb, raw, db, al_a, al_bo, kcs=0, l2=""):
    from kt.cpu_ops._amx import (prefetch_l1, prefetch_l2, prefetch_w, row16_scale_store, tdpbssd,
                                 tileloadd64, tilerelease, tilestored64, tilezero)

    config, pair_pf, store_panel = KA._config, KA._pipe_pair_prefetch, KA._store_panel
    # l2: "" the shipped prefetch (two pairs ahead), "none", "front" (the next pair, all issued in
    # the first panel), "dN" (N pairs ahead, spread over the pair's k-steps)
    l2_front = l2 == "front"
    l2_dist = 0 if l2 == "none" else 1 if l2_front else int(l2[1:]) if l2.startswith("d") else 2
    copy64 = KA.copy64
    empty_line = KA.empty_line

    @njit(nogil=True)
    def pack_a_al(x, ks, kel):
        """kernels_amx._pack_a into a buffer that starts at a 64-byte boundary."""
        m_all = x.shape[0]
        xel = x.strides[0] // x.itemsize
        mt = (m_all + 31) // 32 * 2
        n = mt * ks * 16 * kel
        buf = np.empty(n + 64, x.dtype)
        o = (-buf.ctypes.data) % 64
        a = buf[o:o + n].reshape((mt, ks, 16, kel))
        for m in range(m_all, mt * 16):
            for s in range(ks):
                for c in range(kel):
                    a[m // 16, s, m % 16, c] = 0
        for m in range(m_all):
            t = m // 16
            i = m % 16
            for s in range(ks):
                copy64(a, ((t * ks + s) * 16 + i) * kel, x, m * xel + s * kel)
        return a

    pack_a = pack_a_al if al_a else KA._pack_a

    @njit(nogil=True, inline="always")
    def prefetch_steps(ap, a0, a1, data, o0, o1, s, ks, sb):
        if pfa > 0 and s + pfa < ks:
            for ln in range(16):
                prefetch_l1(ap, a0 + (s + pfa) * sb + 64 * ln)
                prefetch_l1(ap, a1 + (s + pfa) * sb + 64 * ln)
        if pfb > 0 and s + pfb < ks:
            for ln in range(16):
                prefetch_l1(data, o0 + (s + pfb) * sb + 64 * ln)
                prefetch_l1(data, o1 + (s + pfb) * sb + 64 * ln)

    @njit(nogil=True, inline="always")
    def side_prefetch(data, out, s, ks, per, pl, nxt0, nxt1, nlines, wo, wst, wrows, wtwo):
        for _ in range(per):
            if pl < nlines:
                prefetch_l2(data, nxt0 + 64 * pl)
            elif pl < 2 * nlines:
                prefetch_l2(data, nxt1 + 64 * (pl - nlines))
            pl += 1
        wper = (wrows + ks - 1) // ks
        for q in range(s * wper, min((s + 1) * wper, wrows)):
            prefetch_w(out, wo + q * wst)
            if wtwo:
                prefetch_w(out, wo + q * wst + 16)
        return pl

    @njit(nogil=True)
    def panel22(ap, a0, a1, data, o0, o1, ks, sb, nxt0, nxt1, pl, per, nlines, out, wo, wst,
                wrows, wtwo):
        tilezero(0)
        tilezero(1)
        tilezero(2)
        tilezero(3)
        tileloadd64(4, ap, a0, 64)
        tileloadd64(6, data, o0, 64)
        tileloadd64(5, ap, a1, 64)
        tileloadd64(7, data, o1, 64)
        for s in range(ks):
            prefetch_steps(ap, a0, a1, data, o0, o1, s, ks, sb)
            pl = side_prefetch(data, out, s, ks, per, pl, nxt0, nxt1, nlines, wo, wst, wrows, wtwo)
            nxt = s + 1 < ks
            tdpbssd(0, 4, 6)
            tdpbssd(1, 4, 7)
            if nxt:
                tileloadd64(4, ap, a0 + (s + 1) * sb, 64)
            tdpbssd(2, 5, 6)
            if nxt:
                tileloadd64(6, data, o0 + (s + 1) * sb, 64)
            tdpbssd(3, 5, 7)
            if nxt:
                tileloadd64(5, ap, a1 + (s + 1) * sb, 64)
                tileloadd64(7, data, o1 + (s + 1) * sb, 64)
        return pl

    @njit(nogil=True)
    def panel12(ap, a0, data, o0, o1, ks, sb, nxt0, nxt1, pl, per, nlines, out, wo, wst,
                wrows, wtwo):
        """16 rows x 32 columns: C0 = A B0, C1 = A B1; even k-steps read A 4, B 6 / 7, odd ones
        A 5, B 2 / 3; each input is loaded right after its last product, for the step after
        next."""
        tilezero(0)
        tilezero(1)
        tileloadd64(4, ap, a0, 64)
        tileloadd64(6, data, o0, 64)
        tileloadd64(7, data, o1, 64)
        if ks > 1:
            tileloadd64(5, ap, a0 + sb, 64)
            tileloadd64(2, data, o0 + sb, 64)
            tileloadd64(3, data, o1 + sb, 64)
        for s in range(0, ks, 2):
            pl = side_prefetch(data, out, s, ks, per, pl, nxt0, nxt1, nlines, wo, wst, wrows, wtwo)
            tdpbssd(0, 4, 6)
            if s + 2 < ks:
                tileloadd64(6, data, o0 + (s + 2) * sb, 64)
            tdpbssd(1, 4, 7)
            if s + 2 < ks:
                tileloadd64(4, ap, a0 + (s + 2) * sb, 64)
                tileloadd64(7, data, o1 + (s + 2) * sb, 64)
            if s + 1 < ks:
                tdpbssd(0, 5, 2)
                if s + 3 < ks:
                    tileloadd64(2, data, o0 + (s + 3) * sb, 64)
                tdpbssd(1, 5, 3)
                if s + 3 < ks:
                    tileloadd64(5, ap, a0 + (s + 3) * sb, 64)
                    tileloadd64(3, data, o1 + (s + 3) * sb, 64)
        return pl

    @njit(nogil=True)
    def slice22(ap, a0, a1, data, o0, o1, s0, s1, sb, first, part, po):
        """k-steps [s0, s1) of a 2x2 panel; C from the partial sums at part[po:] unless first."""
        if first:
            tilezero(0)
            tilezero(1)
            tilezero(2)
            tilezero(3)
        else:
            tileloadd64(0, part, po, 128)
            tileloadd64(1, part, po + 16, 128)
            tileloadd64(2, part, po + 512, 128)
            tileloadd64(3, part, po + 528, 128)
        tileloadd64(4, ap, a0 + s0 * sb, 64)
        tileloadd64(6, data, o0 + s0 * sb, 64)
        tileloadd64(5, ap, a1 + s0 * sb, 64)
        tileloadd64(7, data, o1 + s0 * sb, 64)
        for s in range(s0, s1):
            nxt = s + 1 < s1
            tdpbssd(0, 4, 6)
            tdpbssd(1, 4, 7)
            if nxt:
                tileloadd64(4, ap, a0 + (s + 1) * sb, 64)
            tdpbssd(2, 5, 6)
            if nxt:
                tileloadd64(6, data, o0 + (s + 1) * sb, 64)
            tdpbssd(3, 5, 7)
            if nxt:
                tileloadd64(5, ap, a1 + (s + 1) * sb, 64)
                tileloadd64(7, data, o1 + (s + 1) * sb, 64)

    @njit(nogil=True)
    def gemm_ks(a, xs, data, scale, out, nb0, nb1, mc):
        m_all = a.shape[0]
        ks = a.shape[1] // 64
        sb = 1024
        ost = out.strides[0] // 4
        blk = data.shape[1] * 64
        ap = pack_a(a, ks, 64)
        mpad = ap.shape[0] * 16
        part = empty_line(mc * 32, np.int32)
        cp = empty_line(1024, np.int32).reshape((32, 32))
        cpf = cp.view(np.float32)
        cfg = np.zeros(64, np.uint8)
        config(cfg, 16, 64)
        for mc0 in range(0, mpad, mc):
            mc1 = min(mc0 + mc, mpad)
            npan = (mc1 - mc0) // 32
            for b in range(nb0, nb1, 2):
                o0 = b * blk
                o1 = o0 + blk if b + 1 < nb1 else o0
                two = b + 1 < nb1
                n0, n1, nlines, per = pair_pf(b, nb0, nb1, blk, npan, ks, 2)
                pl = 0
                for s0 in range(0, ks, kcs):
                    s1 = min(ks, s0 + kcs)
                    for mp in range(mc0, mc1, 32):
                        a0 = (mp // 16) * ks * sb
                        po = (mp - mc0) * 32
                        for _ in range((s1 - s0) * per):
                            if pl < nlines:
                                prefetch_l2(data, n0 + 64 * pl)
                            elif pl < 2 * nlines:
                                prefetch_l2(data, n1 + 64 * (pl - nlines))
                            pl += 1
                        slice22(ap, a0, a0 + ks * sb, data, o0, o1, s0, s1, sb, s0 == 0, part, po)
                        if s1 < ks:
                            tilestored64(0, part, po, 128)
                            tilestored64(1, part, po + 16, 128)
                            tilestored64(2, part, po + 512, 128)
                            tilestored64(3, part, po + 528, 128)
                        else:
                            rows = min(32, m_all - mp)
                            store_panel(cp, cpf, out, mp, ost, 16 * b, rows, two, False, scale,
                                        16 * b, xs)
        tilerelease()

    @njit(nogil=True)
    def scale_full(out, oi32, m0, m1, ost, b0, b1, scale, xs):
        """In place: the int32 sums of rows [m0, m1) x blocks [b0, b1) -> fp32 scaled."""
        for m in range(m0, m1):
            for b in range(b0, b1):
                row16_scale_store(out, m * ost + 16 * b, oi32, m * ost + 16 * b, scale, 16 * b, xs[m])

    @njit(nogil=True)
    def gemm(a, xs, data, scale, out, nb0, nb1, mc):
        m_all = a.shape[0]
        ks = a.shape[1] // 64
        sb = 1024
        ost = out.strides[0] // 4
        blk = data.shape[1] * 64
        ap = pack_a(a, ks, 64)
        mpad = ap.shape[0] * 16
        oi32 = out.view(np.int32)
        cp = np.empty((32, 32), np.int32)
        cpf = cp.view(np.float32)
        cfg = np.zeros(64, np.uint8)
        config(cfg, 16, 64)
        for mc0 in range(0, mpad, mc):
            mc1 = min(mc0 + mc, mpad)
            npan = (mc1 - mc0) // 32
            for b in range(nb0, nb1, 2):
                o0 = b * blk
                o1 = o0 + blk if b + 1 < nb1 else o0
                two = b + 1 < nb1
                n0, n1, nlines, per = pair_pf(b, nb0, nb1, blk, npan, ks, l2_dist)
                if l2_front and nlines:  # all of them while the pair's first panel runs
                    per = (2 * nlines + ks - 1) // ks
                pl = 0
                for mp in range(mc0, mc1, 32):
                    a0 = (mp // 16) * ks * sb
                    rows = min(32, m_all - mp)
                    if db:
                        for h in range(2):
                            r = min(16, m_all - mp - 16 * h)
                            if r <= 0:
                                break
                            pl = panel12(ap, a0 + h * ks * sb, data, o0, o1, ks, sb, n0, n1, pl,
                                         per, nlines, out, (mp + 16 * h) * ost + 16 * b, ost,
                                         r, two)
                            tilestored64(0, cp, 512 * h, 128)
                            tilestored64(1, cp, 512 * h + 16, 128)
                        for i in range(rows):
                            for q in range(2 if two else 1):
                                row16_scale_store(out, (mp + i) * ost + 16 * b + 16 * q, cp,
                                                  i * 32 + 16 * q, scale, 16 * b + 16 * q, xs[mp + i])
                        continue
                    pl = panel22(ap, a0, a0 + ks * sb, data, o0, o1, ks, sb, n0, n1, pl, per,
                                 nlines, out, mp * ost + 16 * b, ost, rows, two)
                    if raw > 1 and not (rows == 32 and two):
                        store_panel(cp, cpf, out, mp, ost, 16 * b, rows, two, False, scale, 16 * b, xs)
                    elif raw and rows == 32 and two:
                        tilestored64(0, oi32, mp * ost + 16 * b, 4 * ost)
                        tilestored64(1, oi32, mp * ost + 16 * b + 16, 4 * ost)
                        tilestored64(2, oi32, (mp + 16) * ost + 16 * b, 4 * ost)
                        tilestored64(3, oi32, (mp + 16) * ost + 16 * b + 16, 4 * ost)
                    elif raw:
                        tilestored64(0, cp, 0, 128)
                        tilestored64(1, cp, 16, 128)
                        tilestored64(2, cp, 512, 128)
                        tilestored64(3, cp, 528, 128)
                        for i in range(rows):
                            for j in range(32 if two else 16):
                                oi32[mp + i, 16 * b + j] = cp[i, j]
                    else:
                        store_panel(cp, cpf, out, mp, ost, 16 * b, rows, two, False, scale, 16 * b, xs)
                if raw == 2 and two:
                    scale_full(out, oi32, mc0, min(mc1, m_all // 32 * 32), ost, b, b + 2, scale, xs)
            if raw == 3:
                scale_full(out, oi32, mc0, min(mc1, m_all // 32 * 32), ost, nb0, nb1 - (nb1 - nb0) % 2, scale,
                           xs)
        tilerelease()

    return gemm_ks if kcs > 0 else gemm


def peak2(KA, cpus, iters=200000):
    """Tile-resident tdpbssd rate with two accumulators (C0, C1 in turn), zeroed tiles."""
    from kt.cpu_ops._amx import tdpbssd, tilerelease, tilestored64, tilezero

    config = KA._config

    @njit(nogil=True)
    def loop(n):
        cfg = np.zeros(64, np.uint8)
        config(cfg, 16, 64)
        tilezero(0)
        tilezero(1)
        tilezero(4)
        tilezero(5)
        tilezero(6)
        tilezero(7)
        for _ in range(n):
            tdpbssd(0, 4, 6)
            tdpbssd(1, 4, 7)
            tdpbssd(0, 5, 6)
            tdpbssd(1, 5, 7)
        sink = np.empty(256, np.int32)
        tilestored64(0, sink, 0, 64)
        tilerelease()
        return n

    loop(1000)
    best = min(max(run_threads(cpus, lambda i: (lambda: loop(iters)))) for _ in range(3))
    return iters * 4 * 2 * 16 * 16 * 64 / best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--M", default="128,512")
    ap.add_argument("--shapes", default="1536x2048,2048x768")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gop", type=float, default=40, help="GOP per thread per timing")
    ap.add_argument("--cold-mb", type=int, default=200, help="weight copies per thread (MiB)")
    ap.add_argument("--variants", default="", help="comma list (empty: all)")
    a = ap.parse_args(argv)
    if isa.detect().variant != "amx":
        sys.exit("amx_panel_probe needs a CPU where AMX runs")
    from kt.cpu_ops import kernels_amx as KA

    t_start = time.time()
    cpus = sorted(os.sched_getaffinity(0))
    sets = {"one": cpus[:1], "all": cpus}
    rows = []
    table = peak_table(KA, sets, rows)
    for sname, cs in sets.items():
        p2 = peak2(KA, cs) / len(cs)
        rows.append({"part": "peak2", "set": sname, "TOPS_per_thread": round(p2 / 1e12, 3),
                     "of_4acc": round(p2 / table[(sname, False, True)], 3)})
        print(f"peak with 2 accumulators {sname}: {p2 / 1e12:.2f} TOPS per thread "
              f"({100 * rows[-1]['of_4acc']:.0f} % of 4)", flush=True)
    names = [v for v in (a.variants.split(",") if a.variants else VARIANTS)]
    ks = {name: make_variant(KA, *VARIANTS[name]) for name in names if VARIANTS[name]}
    al_names = {name for name in names if VARIANTS[name] is None or VARIANTS[name][5]}
    print("numpy / numba allocations mod 64:", [np.empty(n, np.int8).ctypes.data % 64
                                               for n in (1 << 10, 1 << 16, 1 << 20, 1 << 28)],
          flush=True)
    rng = np.random.default_rng(0)
    nthr = len(cpus)
    for shape in a.shapes.split(","):
        n, d = (int(v) for v in shape.split("x"))
        p = pack(rng.standard_normal((n, d), dtype=np.float32), "int8")
        nb = p.num_blocks
        mc = KA.default_mc(d)
        ncopy = max(2, a.cold_mb * 2**20 // p.data.nbytes)
        # the shipped layout: 32 bytes past a line boundary, as numpy allocates here
        copies = [[aligned_copy(p.data, 32) for _ in range(ncopy)] for _ in range(nthr)]
        copies_al = [[aligned_copy(p.data) for _ in range(ncopy)] for _ in range(nthr)]
        for m in [int(v) for v in a.M.split(",")]:
            xq, xs = quantize_act(rng.standard_normal((m, d), dtype=np.float32))
            xq = np.ascontiguousarray(xq.astype(np.int8))
            xs = np.ascontiguousarray(xs.astype(np.float32).reshape(-1))
            fs = {"shipped": lambda data, out: KA.gemm_int8_pipe(xq, xs, data, p.scale, out, 0, nb,
                                                                 mc, 0, 2, True)}
            if "alB" in names:
                fs["alB"] = fs["shipped"]
            for name, g in ks.items():
                fs[name] = lambda data, out, g=g: g(xq, xs, data, p.scale, out, 0, nb, mc)
            ref = np.zeros((m, p.n_pad), np.float32)
            fs["shipped"](p.data, ref)
            for name, f in fs.items():  # compile, and check against the shipped kernel
                o = np.full((m, p.n_pad), np.nan, np.float32)
                f(p.data, o)
                if name.endswith("raw"):
                    o = o.view(np.int32).astype(np.float32) * (xs[:, None] * p.scale[None, :])
                err = float(np.max(np.abs(o - ref)) / np.max(np.abs(ref)))
                if not err <= 1e-6:
                    sys.exit(f"{n}x{d} M={m}: variant {name} differs from gemm_int8_pipe ({err})")
            outs = [aligned_copy(np.zeros((m, p.n_pad), np.float32), 32) for _ in range(nthr)]
            outs_al = [aligned_copy(np.zeros((m, p.n_pad), np.float32)) for _ in range(nthr)]
            ops = 2.0 * m * n * d
            calls = max(4, int(a.gop * 1e9 / ops))
            res = {}
            for _ in range(a.rounds):
                for sname, cs in sets.items():
                    temps = ("warm", "cold_out") if sname == "all" else ("warm",)
                    for temp in temps:
                        for name, f in fs.items():
                            def fn_for(i, f=f, temp=temp, al=name in al_names):
                                cp = (copies_al if al else copies)[i]
                                os_ = outs_al if al else outs
                                if temp == "warm":
                                    return lambda: [f(cp[0], os_[i]) for _ in range(calls)]
                                return lambda: [f(cp[j % len(cp)], os_[(i + j) % nthr])
                                                for j in range(calls)]
                            took = run_threads(cs, fn_for)
                            res.setdefault((sname, temp, name), []).append(
                                ops * calls / statistics.mean(took))
            for (sname, temp, name), v in res.items():
                pk = table[(sname, False, True)]
                r = {"part": "gemm", "N": n, "D": d, "M": m, "set": sname, "weights": temp,
                     "variant": name, "TOPS_per_thread_max": round(max(v) / 1e12, 3),
                     "TOPS_per_thread_median": round(statistics.median(v) / 1e12, 3),
                     "of_peak": round(max(v) / pk, 3),
                     "vs_shipped_median": round(statistics.median(v) / statistics.median(
                         res[(sname, temp, "shipped")]), 3)}
                rows.append(r)
                print(f"{n}x{d} M={m:4d} {sname:3s} {temp:8s} {name:8s} "
                      f"{r['TOPS_per_thread_max']:.3f} / {r['TOPS_per_thread_median']:.3f} TOPS "
                      f"({100 * r['of_peak']:.0f} % of peak, x{r['vs_shipped_median']:.2f} "
                      f"shipped)", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "amx_panel_probe.json").write_text(json.dumps({"rows": rows, "seconds": time.time() - t_start},
                                                         indent=1))
    print(f"wrote {out / 'amx_panel_probe.json'} after {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
