#!/usr/bin/env python3
"""What the one-core AMX INT8 GEMM's epilogue costs at M=512, N=1536 (qwen3 gate+up), K=256 and 2048:
the shipped pipelined kernel's loop (``kernels_amx._gemm_pipe``) rebuilt from its own parts with
pieces switched off: the scale pass (``_scale_full``), the tile stores (``_store_panel``), and the
A packing (done once beforehand). Weights and output in huge pages (``bench_gemm.huge_empty``),
5 interleaved rounds with the tile peak between them.

Session 17 (dev machine, an Emerald Rapids with AMX): K=2048 1736 / 1610 / 1405 / 1341 us (full,
no scale pass, no stores, no stores and A packed beforehand) = 34.4 / 37.1 / 42.5 / 44.5 % of the
peak; K=256 529 / 398 / 241 / 236 us.

    PYTHONPATH=. python3 benchmarks/amx_epilogue_probe.py
"""
from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _rounds import amx_int8_peak, interleaved_rounds  # noqa: E402
from bench_gemm import huge_empty  # noqa: E402
from kt import reference as R  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.packing import pack  # noqa: E402

VARIANTS = {  # name: (tile stores, scale pass, A packed beforehand)
    "full": (True, True, False), "noscale": (True, False, False), "nostore": (False, False, False),
    "full_prepacked": (True, True, True), "bare_prepacked": (False, False, True)}


def _kernel():
    from numba import njit

    from kt.cpu_ops import kernels_amx as K
    from kt.cpu_ops._amx import tilerelease
    from kt.cpu_ops._simd import empty_line

    @njit(nogil=True)
    def gemm(a, data, out, nb0, nb1, mc, xs, scale, do_store, do_scale, ap):
        """_gemm_pipe (INT8, L2 prefetch two pairs ahead, output prefetched for writing) with the
        stores / scale pass optional and A packed here unless ap is given (non-empty)."""
        m_all = a.shape[0]
        ks = a.shape[1] // 64
        sb = 1024
        ost = out.strides[0] // 4
        blk = data.shape[1] * 64
        if ap.shape[0] == 0:
            ap = K._pack_a(a, ks, 64)
        mpad = ap.shape[0] * 16
        cp = empty_line(1024, np.int32).reshape((32, 32))
        cpf = cp.view(np.float32)
        cfg = np.zeros(64, np.uint8)
        K._config(cfg, 16, 64)
        for mc0 in range(0, mpad, mc):
            mc1 = min(mc0 + mc, mpad)
            npan = (mc1 - mc0) // 32
            for b in range(nb0, nb1, 2):
                o0 = b * blk
                o1 = o0 + blk if b + 1 < nb1 else o0
                n0, n1, nlines, per = K._pipe_pair_prefetch(b, nb0, nb1, blk, npan, ks, 2)
                pl = 0
                for mp in range(mc0, mc1, 32):
                    a0 = (mp // 16) * ks * sb
                    rows = min(32, m_all - mp)
                    pl = K._pipe_panel(ap, a0, a0 + ks * sb, data, o0, o1, ks, sb, False, 0, n0, n1, pl, per,
                                       nlines, out, mp * ost + 16 * b, ost, rows, b + 1 < nb1)
                    if do_store:
                        K._store_panel(cp, cpf, out, mp, ost, 16 * b, rows, b + 1 < nb1, False, scale, 16 * b, xs)
            if do_scale:
                K._scale_full(out, ost, mc0, mc1, m_all, nb0, nb1, scale, 0, xs)
        tilerelease()

    return K, gemm


def main():
    if "amx" not in isa.runnable_variants():
        sys.exit("needs a host that runs AMX")
    K, gemm = _kernel()
    rng = np.random.default_rng(0)
    m, n = 512, 1536
    cases = {}
    for d in (256, 2048):
        xq, xs = R.quantize_act(rng.standard_normal((m, d), dtype=np.float32))
        p = pack(rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d)), "int8")
        data = huge_empty(p.data.shape, p.data.dtype)
        data[...] = p.data
        out = huge_empty((m, n), np.float32)
        pre = K._pack_a(xq, d // 64, 64)
        none = np.zeros((0,) + pre.shape[1:], np.int8)
        for name, (st, sc, pp) in VARIANTS.items():
            cases[(d, name)] = (lambda xq=xq, xs=xs, data=data, out=out, p=p, st=st, sc=sc, ap=(pre if pp else none):
                                gemm(xq, data, out, 0, p.num_blocks, K.default_mc(xq.shape[1]), xs, p.scale, st, sc, ap))
    K.peak_int8(1000)
    times, peaks = interleaved_rounds(cases, 5, lambda: amx_int8_peak(K))
    pk = max(peaks)
    for (d, name), ts in times.items():
        t = min(ts)
        tops = 2 * m * n * d / t / 1e12
        print(f"K={d:5d} {name:15s}: {t * 1e6:8.1f} us, {t / (m * n / 1024) * 1e9:6.0f} ns per panel, "
              f"{tops:.2f} TOPS = {100 * tops / pk:.1f} % of {pk:.2f}")


if __name__ == "__main__":
    main()
