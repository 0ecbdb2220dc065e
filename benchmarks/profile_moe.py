"""Where a CPU MoE layer call spends its time, per driver phase, and which prefill variant is faster.

Part 1 (profile): ``CPUMoE.profile``-style per-phase busy / barrier-wait time, summed over the
pool's participants, for each scheme x T, on cold weights (layer copies used in turn) and fresh
uniform routing per call; its wall times include the profile's own cost (at T=1 on 16 threads
~5 %: take decode times from the variant rows or ``cpu_decode_floor.py``), and its floor counts
``CPUMoE.expert_read_bytes`` against the all-thread bandwidth read once at the start.
Part 2 (variants, interleaved call by call): the large-M kernel of the layer (the default
``gemm`` against alternatives passed as ``kernels=``) and the token chunk size.
Part 3 (one core, kernels_amx only): the INT8 GEMM alone, blocked vs software-pipelined.

Device (16 cores; kt not installed there):
    PYTHONPATH=. python3 benchmarks/profile_moe.py --threads 16 --pool-gb 4 --out $OUT
Writes profile_moe.json (and prints a table) under --out.
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

from bench_gemm import all_thread_bandwidth  # noqa: E402
from bench_moe import SHAPES, _copy, build_layer, routing  # noqa: E402
from kt.config import QuantScheme  # noqa: E402
from kt.cpu_ops import isa  # noqa: E402
from kt.cpu_ops.moe import PHASE_NAMES, CPUMoE, _kernel_pair, new_profile, profile_cycles, tsc_hz  # noqa: E402
from kt.cpu_ops.pool import CpuPool  # noqa: E402


def _layers(scheme, shape, pool_bytes, pool, **kw):
    E, K, H, I = SHAPES[shape]
    w13, w2 = build_layer(E, H, I, scheme)
    n = max(2, -(-pool_bytes // (w13.nbytes + w2.nbytes)))
    insts = [(w13, w2)] + [(_copy(w13), _copy(w2)) for _ in range(n - 1)]
    return [CPUMoE(a, b, pool=pool, **kw) for a, b in insts]


X_BF16 = [False]  # --x-bf16: the layer's input (and output) in bf16, as a model serves it


def _x(rng, T, H):
    x = rng.standard_normal((T, H), dtype=np.float32)
    if X_BF16[0]:
        import torch

        return torch.from_numpy(x).to(torch.bfloat16)
    return x


def profile(layers, T, reps, rng, shape):
    E, K, H, I = SHAPES[shape]
    pool = layers[0].pool
    prof = new_profile(pool.num_threads)
    x = _x(rng, T, H)
    for i in range(2):  # warm-up calls, not profiled
        ids, w = routing(rng, T, E, K)
        layers[i % len(layers)](x, ids, w)
    walls = []
    for i in range(reps):
        ids, w = routing(rng, T, E, K)
        L = layers[(i + 2) % len(layers)]
        L._prof = prof
        t0 = time.perf_counter()
        L(x, ids, w)
        walls.append(time.perf_counter() - t0)
        L._prof = None
    tot = profile_cycles(prof).sum(axis=0) / tsc_hz() / reps * 1e3
    return {"wall_min_ms": round(min(walls) * 1e3, 3),
            "wall_median_ms": round(statistics.median(walls) * 1e3, 3),
            "threads": pool.num_threads,
            "phases": {n: {"busy_ms": round(float(tot[j, 0]), 3),
                           "wait_ms": round(float(tot[j, 1]), 3)}
                       for j, n in enumerate(PHASE_NAMES)}}


def interleaved(variants, T, reps, rng, shape):
    """variants: {name: [layers]}; calls alternate between variants; returns {name: stats}.

    The variants' lists wrap the same weight copies in the same order; variant j starts its
    rotation j * n / len(variants) copies later, so no call finds the copy the previous call
    just read in the cache (which biased small-T comparisons)."""
    E, K, H, I = SHAPES[shape]
    x = _x(rng, T, H)
    ts = {n: [] for n in variants}
    n_copies = min(len(v) for v in variants.values())
    off = max(1, n_copies // len(variants))
    for i in range(reps + 1):
        ids, w = routing(rng, T, E, K)
        for j, (n, layers) in enumerate(variants.items()):
            L = layers[(i + j * off) % len(layers)]
            t0 = time.perf_counter()
            L(x, ids, w)
            if i:
                ts[n].append(time.perf_counter() - t0)
    return {n: {"min_ms": round(min(v) * 1e3, 3), "median_ms": round(statistics.median(v) * 1e3, 3)}
            for n, v in ts.items()}


def _int4_gemv_variants():
    """The AVX-512 VNNI INT4 gemv with a software prefetch of its packed lines, by name (contract
    signatures), all the library's own body (``kernels_avx512._gemv_int4``): every other line
    512 B / 2 KB ahead (``i4pf512``, ``i4pf2k``: 2 KB is ``gemv_int4_pf``, the AMX hosts' kernel
    until session 7), every line 2 KB / 4 KB ahead (``i4pfl2k``, ``i4pfl4k``: 4 KB is
    ``gemv_int4_pfl``, the default on AVX-512 and AMX hosts). Each row compares with the host's
    default kernel."""
    from kt.cpu_ops import kernels_avx512 as KV

    @njit(nogil=True)
    def pf512(xq, xs, data, scale, group_size, out, nb0, nb1):
        KV._gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1, 512, False, KV._NO_RX, False)

    @njit(nogil=True)
    def pf2k(xq, xs, data, scale, group_size, out, nb0, nb1):
        KV._gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1, 2048, False, KV._NO_RX, False)

    @njit(nogil=True)
    def pfl2k(xq, xs, data, scale, group_size, out, nb0, nb1):
        KV._gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1, 2048, True, KV._NO_RX, False)

    return {"i4pf512": pf512, "i4pf2k": pf2k, "i4pfl2k": pfl2k, "i4pfl4k": KV.gemv_int4_pfl,
            "i4plain": KV.gemv_int4}


def _vector_gemm_variants(scheme, variant):
    """The AVX-512 or AVX2 large-M kernel of ``scheme`` with and without its next-block L2
    prefetch (``gemm_pf``, ``gemm_nopf``), by name: the library's own body called with ``pf`` from
    a jitted wrapper (``gemm_pf`` is the control: compiled in this process with ``pf`` constant,
    like ``gemm_nopf``). On an AMX host these are the AVX-512 kernels (VNNI / BF16) in place of
    the AMX ones: the same packed layout, so they compare the two units on one layer."""
    if variant in ("amx", "avx512_vnni", "avx512_bf16") and (
            scheme is not QuantScheme.BF16 or variant in ("amx", "avx512_bf16")):
        from kt.cpu_ops import kernels_avx512 as KM
        wsum_arg = True
    elif variant in ("avx512", "avx2", "avx512_vnni", "avx512_bf16"):
        from kt.cpu_ops import kernels_avx2 as KM
        wsum_arg = False
    else:
        return {}

    def make(pf):  # pf is a closure constant, frozen at compile time
        if scheme is QuantScheme.INT8 and wsum_arg:
            @njit(nogil=True)
            def k(xq, xs, data, scale, wsum, out, nb0, nb1):
                KM._gemm_int8(xq, xs, data, scale, wsum, out, nb0, nb1, pf)
        elif scheme is QuantScheme.INT8:
            @njit(nogil=True)
            def k(xq, xs, data, scale, wsum, out, nb0, nb1):
                KM._gemm_int8(xq, xs, data, scale, out, nb0, nb1, pf)
        elif scheme is QuantScheme.INT4:
            @njit(nogil=True)
            def k(xq, xs, data, scale, group_size, out, nb0, nb1):
                KM._gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1, pf)
        else:
            @njit(nogil=True)
            def k(xb, data, out, nb0, nb1):
                KM._gemm_bf16(xb, data, out, nb0, nb1, pf)
        return k

    return {"gemm_pf": make(True), "gemm_nopf": make(False)}


def _amx_variants(scheme):
    """Alternative large-M kernels for ``kernels=`` (contract signatures), by name: the
    K-sliced ``gemm_*_blocked`` kernels that were the default before the pipelined ones, the
    pipelined kernels (``gemm_*_pipe``: ``pipe`` with the settings they were the default with,
    ``no_pfw`` without the output prefetch for writing, ``l2d<d>``: the L2 prefetch d block pairs
    ahead, 0: none) that were the default before the staged ones, the staged kernels with other K
    slices (``st_kc<k>``; ``st_kc16`` is INT8's default before session 21), without the output
    prefetch for writing (``st_nopfw``; INT8's default ran without it in session 19), and INT4's
    per-group flush kernel (``i4flush``)."""
    from kt.cpu_ops import kernels_amx as KA

    if scheme is QuantScheme.INT8:
        @njit(nogil=True)
        def k(xq, xs, data, scale, wsum, out, nb0, nb1):
            KA.gemm_int8_blocked(xq, xs, data, scale, out, nb0, nb1, KA.default_mc(xq.shape[1]),
                                 32, 0)

        @njit(nogil=True)
        def k8(xq, xs, data, scale, wsum, out, nb0, nb1):
            KA.gemm_int8_pipe(xq, xs, data, scale, out, nb0, nb1, KA.default_mc(xq.shape[1]),
                              0, 2, False)

        def dist(d):  # the pipelined kernel, L2 prefetch d block pairs ahead (it used 2)
            @njit(nogil=True)
            def kd(xq, xs, data, scale, wsum, out, nb0, nb1):
                KA.gemm_int8_pipe(xq, xs, data, scale, out, nb0, nb1, KA.default_mc(xq.shape[1]),
                                  0, d, True)
            return kd

        def staged(kcs, pfw):  # the staged kernel (the default: pfw True, kcs 32 up to one M
            # chunk of rows, 16 above; before session 21 always 16)
            @njit(nogil=True)
            def ks(xq, xs, data, scale, wsum, out, nb0, nb1):
                KA.gemm_int8_staged(xq, xs, data, scale, out, nb0, nb1, KA.default_mc(xq.shape[1]),
                                    kcs, 2, pfw, True)
            return ks
    elif scheme is QuantScheme.BF16:
        @njit(nogil=True)
        def k(xb, data, out, nb0, nb1):
            KA.gemm_bf16_blocked(xb, data, out, nb0, nb1, KA.default_mc(2 * xb.shape[1]), 64, 0)

        @njit(nogil=True)
        def k8(xb, data, out, nb0, nb1):
            KA.gemm_bf16_pipe(xb, data, out, nb0, nb1, KA.default_mc(2 * xb.shape[1]), 0, 1,
                              False)

        # the M chunks before session 9: 512 KiB of A (128 rows at D=2048, so an expert of 129+
        # rows streams its weights twice)
        @njit(nogil=True)
        def k128(xb, data, out, nb0, nb1):
            KA.gemm_bf16_pipe(xb, data, out, nb0, nb1, max((1 << 19) // (2 * xb.shape[1]) // 32 * 32,
                                                           32), 0, 1, True)

        def dist(d):  # the pipelined kernel, L2 prefetch d pairs ahead (it used 1 from session 15)
            @njit(nogil=True)
            def kd(xb, data, out, nb0, nb1):
                KA.gemm_bf16_pipe(xb, data, out, nb0, nb1, KA.default_mc(2 * xb.shape[1]), 0, d,
                                  True)
            return kd

        def staged(kcs, pfw):  # the staged kernel (the default: kcs 16, pfw True)
            @njit(nogil=True)
            def ks(xb, data, out, nb0, nb1):
                KA.gemm_bf16_staged(xb, data, out, nb0, nb1, KA.default_mc(2 * xb.shape[1]), kcs, 1,
                                    pfw, True)
            return ks

        return {"blocked": k, "no_pfw": k8, "mc512k": k128, "pipe": dist(1), "l2d2": dist(2),
                "l2d3": dist(3), "l2d4": dist(4), "st_kc32": staged(32, True),
                "st_nopfw": staged(16, False)}
    else:
        # INT4: the per-group flush kernel that gemm_int4 used for every matrix before the
        # flush-free ratio kernel (and still uses for scales not of the quantiser's form)
        @njit(nogil=True)
        def k4(xq, xs, data, scale, group_size, out, nb0, nb1):
            KA.gemm_int4_blocked(xq, xs, data, scale, group_size, out, nb0, nb1,
                                 KA.default_mc(xq.shape[1]), max(512, group_size), True, True)

        def ratio(staged):
            """On the quantiser's ratio scales: the whole-K pipelined kernel gemm_int4 used in
            sessions 9-17 (staged False), or the staged kernel at every M (gemm_int4 itself takes
            gemm_int4_inline up to KA.INT4_INLINE_MAX_M rows); other scales: gemm_int4."""
            @njit(nogil=True)
            def kr(xq, xs, data, scale, group_size, out, nb0, nb1):
                nbr = max(nb1 - nb0, 0)
                srow = np.empty(nbr * 16, np.float32)
                rx = np.empty(nbr * scale.shape[1] * 16, np.int8)
                mc = KA.default_mc(xq.shape[1])
                if not KA._int4_ratios(scale, nb0, nb1, srow, rx):
                    KA.gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1)
                elif staged:
                    KA.gemm_int4_staged(xq, xs, data, group_size, srow, rx, out, nb0, nb1, mc, 16,
                                        True, True)
                else:
                    KA.gemm_int4_ratio(xq, xs, data, group_size, srow, rx, out, nb0, nb1, mc, True)
            return kr

        def inline(mmax):
            """On the quantiser's ratio scales: the inline kernel (keep mode) up to mmax rows, the
            staged kernel above (gemm_int4 itself: up to KA.INT4_INLINE_MAX_M rows; before session
            20: 32 rows, no keep mode, which inline(32) is)."""
            @njit(nogil=True)
            def kk(xq, xs, data, scale, group_size, out, nb0, nb1):
                nbr = max(nb1 - nb0, 0)
                srow = np.empty(nbr * 16, np.float32)
                rx = np.empty(nbr * scale.shape[1] * 16, np.int8)
                if not KA._int4_ratios(scale, nb0, nb1, srow, rx):
                    KA.gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1)
                elif xq.shape[0] <= mmax:
                    KA.gemm_int4_inline(xq, xs, data, group_size, srow, rx, out, nb0, nb1, 1, True,
                                        True)
                else:
                    KA.gemm_int4_staged(xq, xs, data, group_size, srow, rx, out, nb0, nb1,
                                        KA.default_mc(xq.shape[1]), 16, True, True)
            return kk

        def dist(l2):
            """gemm_int4 with the inline kernel's L2 prefetch l2 block pairs ahead (default 1)."""
            @njit(nogil=True)
            def kd(xq, xs, data, scale, group_size, out, nb0, nb1):
                KA._gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1, l2)
            return kd

        @njit(nogil=True)
        def klazy(xq, xs, data, scale, group_size, out, nb0, nb1):
            KA.gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1)

        # i4lazy: the default before session 21, which made each block pair's ratios from the
        # group scales at every call (the layer now reads them from tables made at load)
        return {"i4lazy": klazy, "i4flush": k4, "pipe": ratio(False), "no_inline": ratio(True),
                "i4l2d0": dist(0), "i4l2d2": dist(2), "i4l2d3": dist(3), "i4l2d4": dist(4),
                "i4l2d6": dist(6),
                "inline32": inline(32), "inline64": inline(64), "inline128": inline(128),
                "inline256": inline(256)}
    return {"blocked": k, "no_pfw": k8, "pipe": dist(2), "l2d0": dist(0), "l2d1": dist(1),
            "l2d3": dist(3), "l2d4": dist(4), "st_kc8": staged(8, True), "st_kc16": staged(16, True),
            "st_kc32": staged(32, True), "st_nopfw": staged(16, False)}


def _timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def gemm_alone(rows, rng):
    """One core: INT8 GEMM N=1536, D=2048 at M in (32, 128, 512), warm, variants interleaved."""
    from kt.cpu_ops import kernels_amx as KA
    from kt.cpu_ops.packing import pack
    from kt.reference import quantize_act

    n, d = 1536, 2048
    KA.peak_int8(1000)
    best = min(_timed(lambda: KA.peak_int8(200000)) for _ in range(5))
    peak = 200000 * 4 * 2 * 16 * 16 * 64 / best
    rows.append({"part": "gemm_alone", "tile_peak_int8_TOPS": round(peak / 1e12, 3)})
    print(f"  tile-resident int8 peak, one core: {peak / 1e12:.3f} TOPS", flush=True)
    w = rng.standard_normal((n, d), dtype=np.float32)
    p = pack(w, "int8")
    for m in (32, 128, 512):
        x = rng.standard_normal((m, d), dtype=np.float32)
        xq, xs = quantize_act(x)
        xq = np.ascontiguousarray(xq.astype(np.int8))
        xs = np.ascontiguousarray(xs.astype(np.float32).reshape(-1))
        out = np.zeros((m, p.n_pad), np.float32)
        mc = KA.default_mc(d)
        nb = p.num_blocks
        cold = [p.data.copy() for _ in range(48)]  # 144 MiB of copies: B from DRAM
        cur = [0]

        def nxt():
            cur[0] = (cur[0] + 1) % len(cold)
            return cold[cur[0]]

        fns = {
            "blocked": lambda: KA.gemm_int8_blocked(xq, xs, p.data, p.scale, out, 0, nb, mc, 32, 0),
            "pipe": lambda: KA.gemm_int8_pipe(xq, xs, p.data, p.scale, out, 0, nb, mc, 0, 0, True),
            "pipe_l2": lambda: KA.gemm_int8_pipe(xq, xs, p.data, p.scale, out, 0, nb, mc, 0, 2, True),
            "blocked_cold": lambda: KA.gemm_int8_blocked(xq, xs, nxt(), p.scale, out, 0, nb, mc, 32, 0),
            "pipe_pf8_cold": lambda: KA.gemm_int8_pipe(xq, xs, nxt(), p.scale, out, 0, nb, mc, 8, 0, True),
            "pipe_l2_cold": lambda: KA.gemm_int8_pipe(xq, xs, nxt(), p.scale, out, 0, nb, mc, 0, 2, True),
            "pipe_pf4_l2_cold": lambda: KA.gemm_int8_pipe(xq, xs, nxt(), p.scale, out, 0, nb, mc, 4, 2, True),
        }
        outs = {}
        for k, f in fns.items():
            out[:] = 0
            f()
            outs[k] = out.copy()
        same = all(np.array_equal(outs["blocked"], v) for v in outs.values())
        ts = {k: [] for k in fns}
        reps = 100 if m <= 128 else 30
        for _ in range(reps):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                ts[k].append(time.perf_counter() - t0)
        ops = 2.0 * m * n * d
        for k, v in ts.items():
            r = {"part": "gemm_alone", "M": m, "variant": k, "min_us": round(min(v) * 1e6, 1),
                 "median_us": round(statistics.median(v) * 1e6, 1),
                 "TOPS": round(ops / min(v) / 1e12, 3), "of_peak": round(ops / min(v) / peak, 3),
                 "identical": same}
            rows.append(r)
            print(f"  gemm M={m:4d} {k:9s} min {r['min_us']:8.1f} us  med {r['median_us']:8.1f} us "
                  f" {r['TOPS']:.3f} TOPS ({100 * r['of_peak']:.0f} % of peak) identical={same}",
                  flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--pool-gb", type=float, default=4.0)
    ap.add_argument("--schemes", default="int8,int4,bf16")
    ap.add_argument("--T", default="1,512,2048")
    ap.add_argument("--variants", action="store_true", default=True)
    ap.add_argument("--variant-T", default="512,2048")
    ap.add_argument("--variant-names", default="",
                    help="comma list of the variants to run besides default (empty: all)")
    ap.add_argument("--variant-reps", type=int, default=0,
                    help="calls per variant (default: 6 at T >= 512, 20 above T=8, else 100)")
    ap.add_argument("--no-gemm", action="store_true", help="skip the one-core GEMM part")
    ap.add_argument("--x-bf16", action="store_true",
                    help="bf16 input and output (torch tensors), as a model serves the layer")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    a.variant_T = [int(t) for t in a.variant_T.split(",") if t]
    X_BF16[0] = a.x_bf16
    rng = np.random.default_rng(0)
    rows = []
    variant = isa.detect().variant
    print(f"variant {variant}, threads {a.threads}, tsc {tsc_hz() / 1e9:.2f} GHz", flush=True)
    bw_detail = {}
    bw = all_thread_bandwidth(a.threads, detail=bw_detail)
    rows.append({"part": "bandwidth", "threads": a.threads, "GBps": round(bw / 1e9, 2), **bw_detail})
    print(f"read bandwidth, {a.threads} threads: {bw / 1e9:.1f} GB/s", flush=True)
    pool = CpuPool(a.threads)
    Ts = [int(t) for t in a.T.split(",") if t]
    pool_bytes = int(a.pool_gb * 2**30)
    for sname in a.schemes.split(","):
        scheme = QuantScheme.parse(sname)
        t0 = time.time()
        layers = _layers(scheme, a.shape, pool_bytes, pool)
        print(f"{sname}: {len(layers)} copies built in {time.time() - t0:.0f} s", flush=True)
        if 1 in Ts:
            # the fixed cost of a decode call: T=1 with every expert masked (plan, barriers,
            # combine, the Python call path), to read the T=1 figures against
            E, K, H, I = SHAPES[a.shape]
            x1 = rng.standard_normal((1, H), dtype=np.float32)
            ids1, w1 = routing(rng, 1, E, K)
            allm = np.ones(E, bool)
            first = layers[0]  # (a name pyflakes can follow past the loop's `del layers`)
            ts = [_timed(lambda: first(x1, ids1, w1, gpu_mask=allm)) for _ in range(300)]
            ts.sort()
            rows.append({"part": "empty_call", "scheme": sname, "min_us": round(ts[0] * 1e6, 1),
                         "median_us": round(ts[150] * 1e6, 1), "p90_us": round(ts[270] * 1e6, 1)})
            print(f"  T=1, every expert masked: min {ts[0] * 1e6:.1f} us, median {ts[150] * 1e6:.1f} us",
                  flush=True)
        for T in Ts:
            r = profile(layers, T, 6 if T >= 512 else (100 if T <= 8 else 20), rng, a.shape)
            E, K, H, I = SHAPES[a.shape]
            hit = E * (1 - (1 - K / E) ** T)  # expected distinct experts under uniform routing
            floor_ms = hit * layers[0].expert_read_bytes() / bw * 1e3
            r.update(part="profile", scheme=sname, T=T, bw_floor_ms=round(floor_ms, 3),
                     frac_of_bw_floor=round(floor_ms / r["wall_min_ms"], 3))
            # the GEMM phases' rate per busy thread (T*K rows through 2I x H and H x I)
            for ph, ops in (("gate_up", 4.0 * T * K * H * I), ("down", 2.0 * T * K * H * I)):
                busy = r["phases"][ph]["busy_ms"]
                r[f"{ph}_TOPS_per_busy_thread"] = round(ops / (busy * 1e-3) / 1e12, 3) if busy else None
            rows.append(r)
            ph = "  ".join(f"{k} {v['busy_ms']:.2f}/{v['wait_ms']:.2f}" for k, v in r["phases"].items())
            print(f"  T={T:5d} wall min {r['wall_min_ms']:.2f} med {r['wall_median_ms']:.2f} ms "
                  f"({100 * r['frac_of_bw_floor']:.0f} % of the bandwidth floor; TOPS per busy thread "
                  f"gate_up {r['gate_up_TOPS_per_busy_thread']} down {r['down_TOPS_per_busy_thread']}) | "
                  f"busy/wait ms (sum over threads): {ph}", flush=True)
        if a.variants:
            kv, km, _ = _kernel_pair(scheme, None)
            vars_ = {"default": layers}
            if variant == "amx":
                for name, k in _amx_variants(scheme).items():
                    vars_[name] = [CPUMoE(L.w13, L.w2, pool=pool, kernels=(kv, k), variant=L.variant)
                                   for L in layers]
            # variant=: the gemv/gemm switch of the layer's own variant (a custom pair gets the
            # generic one, which differs below AVX-512 and would confound small T)
            for name, k in _vector_gemm_variants(scheme, variant).items():
                vars_[name] = [CPUMoE(L.w13, L.w2, pool=pool, kernels=(kv, k), variant=L.variant)
                               for L in layers]
            if scheme is QuantScheme.INT4 and variant in ("amx", "avx512_vnni", "avx512_bf16"):
                for name, k in _int4_gemv_variants().items():
                    vars_[name] = [CPUMoE(L.w13, L.w2, pool=pool, kernels=(k, km)) for L in layers]
            # row-block tasks instead of whole experts: separate act and down phases
            split = [CPUMoE(L.w13, L.w2, pool=pool) for L in layers]
            for L in split:
                L.blocks_per_task = (48, 64)
            vars_["split"] = split
            if scheme is not QuantScheme.BF16:
                vars_["int8x2"] = [CPUMoE(L.w13, L.w2, pool=pool, activations="int8x2")
                                   for L in layers]
            if sname == "int8":
                vars_["chunk1024"] = [CPUMoE(L.w13, L.w2, pool=pool, chunk_tokens=1024)
                                      for L in layers]
            # finer decode tasks: fixed row blocks per task (the heuristic gives 12-16 at T=1)
            for bpt in (4, 8):
                fine = [CPUMoE(L.w13, L.w2, pool=pool) for L in layers]
                for L in fine:
                    L.blocks_per_task = (bpt, bpt)
                vars_[f"bpt{bpt}"] = fine
            # finer down tasks only (the tail of a pipelined decode step is its last down tasks)
            for bpt in (4, 8):
                fine = [CPUMoE(L.w13, L.w2, pool=pool) for L in layers]
                for L in fine:
                    L.blocks_per_task = (0, bpt)
                vars_[f"d{bpt}"] = fine
            # the gemv/gemm switch one row higher (gemv for one more expert size)
            gv_up = [CPUMoE(L.w13, L.w2, pool=pool, gemv_max=L.gemv_max + 1) for L in layers]
            vars_["gvmax+1"] = gv_up
            # phase-by-phase decode (before the pipelined order: all-thread barriers between
            # gate+up, act and down)
            nopipe = [CPUMoE(L.w13, L.w2, pool=pool) for L in layers]
            for L in nopipe:
                L.pipelined_decode = False
            vars_["nopipe"] = nopipe
            # the last experts of a whole-expert chunk split into part tasks (default: as many
            # experts as threads, gate+up in 4 parts): off, other part counts, twice the experts
            for name, tail, parts in (("tail_off", None, 1), ("tailp2", None, 2), ("tailp8", None, 8),
                                      ("tail2n", 2 * pool.num_threads, 4)):
                tl = [CPUMoE(L.w13, L.w2, pool=pool) for L in layers]
                for L in tl:
                    L.tail_experts, L.tail_parts = tail, parts
                vars_[name] = tl
            # the down GEMM's outputs with non-temporal stores at every T (where the layer's
            # kernels have that form), and never; the default streams from y_stream_bytes of
            # outputs on (qwen3 T=2048)
            for name, ysb in (("ynt", 0), ("ynt_off", 1 << 62)):
                vars_[name] = [CPUMoE(L.w13, L.w2, pool=pool) for L in layers]
                for L in vars_[name]:
                    L.y_stream_bytes = ysb
            if a.variant_names:
                keep = set(a.variant_names.split(",")) | {"default"}
                vars_ = {n: v for n, v in vars_.items() if n in keep}
            for T in a.variant_T:
                # the fixed fine decode tasks only mean something at decode-sized T
                decode_only = ("nopipe", "d4", "d8", "gvmax+1")
                vt = {n: v for n, v in vars_.items()
                      if T <= 64 or not (n.startswith(("bpt", "i4pf")) or n in decode_only)}
                reps = a.variant_reps or (6 if T >= 512 else (100 if T <= 8 else 20))
                res = interleaved(vt, T, reps, rng, a.shape)
                for n, v in res.items():
                    rows.append({"part": "variants", "scheme": sname, "T": T, "variant": n, **v})
                print(f"  variants T={T}: " + "  ".join(
                    f"{n} {v['min_ms']:.2f}/{v['median_ms']:.2f}" for n, v in res.items()), flush=True)
            del vars_
        del layers
    pool.shutdown()
    if variant == "amx" and not a.no_gemm:
        gemm_alone(rows, rng)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_moe.json").write_text(json.dumps({"variant": variant, "threads": a.threads,
                                                      "shape": a.shape, "rows": rows}, indent=1))
    print(f"wrote {out / 'profile_moe.json'}")


if __name__ == "__main__":
    main()
