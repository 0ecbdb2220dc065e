"""CPU GEMM kernel benchmark: every scheme x every distinct kernel this host runs x M, on one thread.

Measures, in one process, interleaving kernels so machine noise hits them alike:
- roofline: memory read bandwidth (16 streams of 512-bit loads over >= 1 GiB, 1 and 2 Python
  threads calling a nogil kernel) and compute peaks (register-resident vpdpbusd / vdpbf16ps loops,
  AVX2 vpmaddubsw+vpmaddwd and FMA loops; AMX peaks from kernels_amx.peak_* where AMX runs);
- per (scheme, kernel variant, M, N x D): median and min time, GB/s of weights, TOPS, and the
  fraction of the roofline time max(bytes / BW_1thread, ops / peak);
- decode (M = 1) reads weights cold: each call uses the next of a pool of weight copies totalling
  >= 256 MB (> 2x the 32 MiB L3); larger M reuses one copy (compute-bound);
- first-call compile time of the host variant's kernels and their cached load time in a new process.

Writes benchmarks/results/<machine>/gemm.json (see _results.py) and prints the table. Usage:
    python benchmarks/bench_gemm.py [--reps 5] [--quick] [--schemes int8,int4,bf16]
The tile peaks (zero and random tiles) are measured in the same process: an AMX core's rate moves
from minute to minute, so a GEMM's fraction of its peak is read against the peak of its own run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import add_out_arguments, out_dir, write_result  # noqa: E402
from kt.config import QuantScheme  # noqa: E402
from kt.cpu_ops import gemm, isa, packing, registry, tiling  # noqa: E402
from kt.cpu_ops.kernels._simd import (  # noqa: E402
    bcast4_i32x8, bcast4_i32x16, dpbf16ps512, load_i32x16, pmaddubsw256, pmaddwd256, splat_f32x16, splat_f32x8,
    prefetch_l2, splat_i16x16, splat_i32x16, splat_i32x8, store, vadd, vfma, vor, vpdpbusd512)

SHAPES = [(1536, 2048), (2048, 768)]
MS = [1, 32, 512, 2048]
POOL_BYTES = 256 << 20


# ----------------------------------------------------------------------------- roofline kernels

@njit(nogil=True)
def _read_slice(buf, lo, hi, piece, streams, pf, pf_hi):
    """Read buf[lo:hi) (bytes) ``piece`` bytes at a time, each piece as ``streams`` interleaved
    streams of 2 x 64-byte loads, in one call (a thread of ``all_thread_bandwidth`` never returns
    to Python, so no GIL between pieces); pf > 0: each stream also hints the lines pf bytes ahead
    of its loads into L2 (prefetcht1), as the decode GEMVs do, up to byte pf_hi."""
    acc = splat_i32x16(0)
    acc2 = acc
    for p0 in range(lo, hi, piece):
        span = min(piece, hi - p0) // streams // 128 * 128
        for off in range(0, span, 128):
            for s in range(streams):
                b = p0 + s * span + off
                if pf > 0 and b + pf + 128 <= pf_hi:
                    prefetch_l2(buf, b + pf)
                    prefetch_l2(buf, b + pf + 64)
                acc = vor(acc, load_i32x16(buf, b))
                acc2 = vor(acc2, load_i32x16(buf, b + 64))
    out = np.zeros(16, np.int32)
    store(out, 0, vor(acc, acc2))
    return out[0]


@njit(nogil=True)
def _read_bw(buf, lo, hi, streams):
    """``_read_slice`` of buf[lo:hi) as one piece without prefetch; returns (its value, the bytes
    read: the streams' whole 128-byte steps)."""
    return _read_slice(buf, lo, hi, hi - lo, streams, 0, hi), (hi - lo) // streams // 128 * 128 * streams


@njit(nogil=True)
def _peak_vnni(n, seed):
    a = bcast4_i32x16(seed, 0)
    c0 = splat_i32x16(0)
    c1, c2, c3, c4, c5, c6, c7 = c0, c0, c0, c0, c0, c0, c0
    c8, c9, c10, c11 = c0, c0, c0, c0
    for _ in range(n):
        c0 = vpdpbusd512(c0, a, a)
        c1 = vpdpbusd512(c1, a, a)
        c2 = vpdpbusd512(c2, a, a)
        c3 = vpdpbusd512(c3, a, a)
        c4 = vpdpbusd512(c4, a, a)
        c5 = vpdpbusd512(c5, a, a)
        c6 = vpdpbusd512(c6, a, a)
        c7 = vpdpbusd512(c7, a, a)
        c8 = vpdpbusd512(c8, a, a)
        c9 = vpdpbusd512(c9, a, a)
        c10 = vpdpbusd512(c10, a, a)
        c11 = vpdpbusd512(c11, a, a)
    s = vadd(vadd(vadd(c0, c1), vadd(c2, c3)), vadd(vadd(c4, c5), vadd(c6, c7)))
    s = vadd(s, vadd(vadd(c8, c9), vadd(c10, c11)))
    out = np.zeros(16, np.int32)
    store(out, 0, s)
    return out[0], n * 12 * 16 * 4 * 2  # ops: 64 MACs per instruction


@njit(nogil=True)
def _peak_dpbf16(n, seed):
    a = bcast4_i32x16(seed, 0)
    c0 = splat_f32x16(0.0)
    c1, c2, c3, c4, c5, c6, c7 = c0, c0, c0, c0, c0, c0, c0
    c8, c9, c10, c11 = c0, c0, c0, c0
    for _ in range(n):
        c0 = dpbf16ps512(c0, a, a)
        c1 = dpbf16ps512(c1, a, a)
        c2 = dpbf16ps512(c2, a, a)
        c3 = dpbf16ps512(c3, a, a)
        c4 = dpbf16ps512(c4, a, a)
        c5 = dpbf16ps512(c5, a, a)
        c6 = dpbf16ps512(c6, a, a)
        c7 = dpbf16ps512(c7, a, a)
        c8 = dpbf16ps512(c8, a, a)
        c9 = dpbf16ps512(c9, a, a)
        c10 = dpbf16ps512(c10, a, a)
        c11 = dpbf16ps512(c11, a, a)
    s = vadd(vadd(vadd(c0, c1), vadd(c2, c3)), vadd(vadd(c4, c5), vadd(c6, c7)))
    s = vadd(s, vadd(vadd(c8, c9), vadd(c10, c11)))
    out = np.zeros(16, np.float32)
    store(out, 0, s)
    return out[0], n * 12 * 16 * 2 * 2  # ops: 32 MACs per instruction


@njit(nogil=True)
def _peak_avx2_int8(n, seed):
    """vpmaddubsw + vpmaddwd + vpaddd: 32 byte MACs per 3 instructions (the AVX2 INT8 inner op).
    Each chain feeds its accumulator back so nothing is loop-invariant."""
    a = bcast4_i32x8(seed, 0)
    ones = splat_i16x16(1)
    c0 = splat_i32x8(0)
    c1, c2, c3, c4, c5, c6, c7 = c0, c0, c0, c0, c0, c0, c0
    c8, c9, c10, c11 = c0, c0, c0, c0
    for _ in range(n):
        c0 = vadd(c0, pmaddwd256(pmaddubsw256(a, c0), ones))
        c1 = vadd(c1, pmaddwd256(pmaddubsw256(a, c1), ones))
        c2 = vadd(c2, pmaddwd256(pmaddubsw256(a, c2), ones))
        c3 = vadd(c3, pmaddwd256(pmaddubsw256(a, c3), ones))
        c4 = vadd(c4, pmaddwd256(pmaddubsw256(a, c4), ones))
        c5 = vadd(c5, pmaddwd256(pmaddubsw256(a, c5), ones))
        c6 = vadd(c6, pmaddwd256(pmaddubsw256(a, c6), ones))
        c7 = vadd(c7, pmaddwd256(pmaddubsw256(a, c7), ones))
        c8 = vadd(c8, pmaddwd256(pmaddubsw256(a, c8), ones))
        c9 = vadd(c9, pmaddwd256(pmaddubsw256(a, c9), ones))
        c10 = vadd(c10, pmaddwd256(pmaddubsw256(a, c10), ones))
        c11 = vadd(c11, pmaddwd256(pmaddubsw256(a, c11), ones))
    s = vadd(vadd(vadd(c0, c1), vadd(c2, c3)), vadd(vadd(c4, c5), vadd(c6, c7)))
    s = vadd(s, vadd(vadd(c8, c9), vadd(c10, c11)))
    out = np.zeros(8, np.int32)
    store(out, 0, s)
    return out[0], n * 12 * 32 * 2


@njit(nogil=True)
def _peak_fma256(n, seed):
    c0 = splat_f32x8(seed[0])
    a = splat_f32x8(1.0000001)
    b = splat_f32x8(1e-7)
    c1, c2, c3, c4, c5, c6, c7 = c0, c0, c0, c0, c0, c0, c0
    c8, c9, c10, c11 = c0, c0, c0, c0
    for _ in range(n):
        c0 = vfma(c0, a, b)
        c1 = vfma(c1, a, b)
        c2 = vfma(c2, a, b)
        c3 = vfma(c3, a, b)
        c4 = vfma(c4, a, b)
        c5 = vfma(c5, a, b)
        c6 = vfma(c6, a, b)
        c7 = vfma(c7, a, b)
        c8 = vfma(c8, a, b)
        c9 = vfma(c9, a, b)
        c10 = vfma(c10, a, b)
        c11 = vfma(c11, a, b)
    s = vadd(vadd(vadd(c0, c1), vadd(c2, c3)), vadd(vadd(c4, c5), vadd(c6, c7)))
    s = vadd(s, vadd(vadd(c8, c9), vadd(c10, c11)))
    out = np.zeros(8, np.float32)
    store(out, 0, s)
    return out[0], n * 12 * 8 * 2


def threads_wall(work, n: int) -> float:
    """Seconds of wall time for n threads running work(0) .. work(n - 1) at once."""
    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return time.perf_counter() - t0


BW_PREFETCH = (0, 1024, 4096)  # all_thread_bandwidth's software prefetch distances (0: none)


def all_thread_bandwidth(threads: int, gib: float = 4.0, detail: dict | None = None) -> float:
    """All-thread read bandwidth (B/s): ``threads`` Python threads each read their slice of a
    ``gib`` GiB buffer in one nogil call (4 MiB pieces, 4 streams each), without and with a
    software L2 prefetch ``BW_PREFETCH`` bytes ahead; total bytes / wall time, the best of 3
    passes of each, and the best of those (the roofline is the fastest read found: a slower one
    would let a kernel read "above the bandwidth"; one call per thread, so no GIL between
    pieces). ``detail`` gets the best figure per prefetch distance."""
    buf = np.ones(int(gib * (1 << 30)), np.uint8)
    sl = len(buf) // threads // (4 << 20) * (4 << 20)
    best = 0.0
    for pf in BW_PREFETCH:
        _read_slice(buf, 0, 1 << 20, 1 << 20, 4, pf, 1 << 20)

        def work(i, pf=pf):
            _read_slice(buf, i * sl, (i + 1) * sl, 4 << 20, 4, pf, (i + 1) * sl)

        bw = max(sl * threads / threads_wall(work, threads) for _ in range(3))
        if detail is not None:
            detail[f"pf{pf}_GBps"] = round(bw / 1e9, 2)
        best = max(best, bw)
    return best


def measure_bandwidth(gib: float = 1.0, piece: int = 4 << 20) -> dict:
    """Cold read bandwidth: passes over a >= 1 GiB buffer (>> L3) in ``piece``-byte calls.

    On this shared machine long timings are hit by other processes, so each piece is timed by the
    thread's CPU time and the median piece rate is the figure (the same statistic as the GEMM
    rows); 1, 4 and 16 streams per piece are tried and the best median is kept. 2 threads: each
    reads its half in pieces with that stream count; total bytes / wall time (best of 2 passes;
    wall time, so it is low whenever other processes run).
    """
    buf = np.ones(int(gib * (1 << 30)), np.uint8)
    _read_bw(buf, 0, 1 << 20, 1)  # compile
    per_streams = {}
    for ns in (1, 4, 16):
        rates = []
        for o in range(0, len(buf) - piece + 1, piece):
            t0 = time.thread_time()
            nbytes = _read_bw(buf, o, o + piece, ns)[1]
            rates.append(nbytes / (time.thread_time() - t0) / 1e9)
        per_streams[ns] = (float(np.median(rates)), float(np.max(rates)))
    best_ns = max(per_streams, key=lambda k: per_streams[k][0])
    res = {"piece_bytes": piece, "buffer_bytes": len(buf),
           "streams_median_GBps": {k: round(v[0], 2) for k, v in per_streams.items()},
           "1_thread_GBps": round(per_streams[best_ns][0], 2),
           "1_thread_max_GBps": round(per_streams[best_ns][1], 2)}
    half = len(buf) // 2
    best2 = 0.0
    for _ in range(2):
        got = [0, 0]

        def work(i):
            for o in range(i * half, (i + 1) * half - piece + 1, piece):
                got[i] += _read_bw(buf, o, o + piece, best_ns)[1]
        wall = threads_wall(work, 2)
        best2 = max(best2, sum(got) / wall / 1e9)
    res["2_thread_GBps"] = round(best2, 2)
    return res


def measure_peaks(variants: list[str]) -> dict:
    seed8 = np.full(4, 3, np.int8)
    peaks = {}

    def best(fn, arg, n=300_000, reps=7):
        fn(10, arg)
        r = 0.0
        for _ in range(reps):
            t0 = time.thread_time()
            _, ops = fn(n, arg)
            r = max(r, ops / (time.thread_time() - t0) / 1e12)
        return round(r, 3)

    if "avx512_vnni" in variants:
        peaks["vpdpbusd_int8_TOPS"] = best(_peak_vnni, seed8)
    if "avx512_bf16" in variants:
        peaks["vdpbf16ps_bf16_TFLOPS"] = best(_peak_dpbf16, np.full(2, 0x3F80, np.uint16))
    peaks["avx2_int8_TOPS"] = best(_peak_avx2_int8, seed8)
    peaks["fma256_fp32_TFLOPS"] = best(_peak_fma256, np.ones(1, np.float32))
    if "amx" in variants:
        from kt.cpu_ops.kernels.amx import roofline as kernels_amx

        # fn(iters, zero) -> ops done, tiles resident: zeroed tiles (the highest rate, the peak the
        # roofline uses) and random ones (the data a GEMM multiplies: reported beside it)
        for name, key in (("peak_int8", "amx_int8_TOPS"), ("peak_bf16", "amx_bf16_TFLOPS")):
            fn = getattr(kernels_amx, name)
            for zero, k in ((True, key), (False, key.replace("amx_", "amx_random_"))):
                fn(10, zero)
                r = 0.0
                for _ in range(5):
                    t0 = time.thread_time()
                    ops = fn(200_000, zero)
                    r = max(r, ops / (time.thread_time() - t0) / 1e12)
                peaks[k] = round(r, 3)
    return peaks


def random_peak_for(scheme: QuantScheme, variant: str, peaks: dict) -> float | None:
    """The AMX tile-resident rate on random tiles (ops/s) for an AMX kernel, else None."""
    if variant != "amx":
        return None
    v = peaks.get("amx_random_bf16_TFLOPS" if scheme is QuantScheme.BF16 else "amx_random_int8_TOPS")
    return None if v is None else v * 1e12


def peak_for(scheme: QuantScheme, variant: str, peaks: dict) -> float | None:
    """Compute peak (ops/s) for a kernel variant; None when not measured."""
    if variant == "amx":
        k = "amx_bf16_TFLOPS" if scheme is QuantScheme.BF16 else "amx_int8_TOPS"
    elif variant.startswith("avx512"):
        k = "vdpbf16ps_bf16_TFLOPS" if scheme is QuantScheme.BF16 else "vpdpbusd_int8_TOPS"
    else:
        k = "fma256_fp32_TFLOPS" if scheme is QuantScheme.BF16 else "avx2_int8_TOPS"
    v = peaks.get(k)
    return None if v is None else v * 1e12


# ----------------------------------------------------------------------------- GEMM timing

def distinct_kernels(scheme: QuantScheme, variants) -> list[str]:
    """One runnable variant per distinct (gemv, gemm) kernel pair they resolve to (on an AMX host
    the INT8 / INT4 gemv is the VNNI one, registered above AMX's, while the gemm is AMX's: keying on
    the gemv alone dropped the AMX gemm from the table)."""
    seen, keep = [], []
    for v in variants:
        pair = (registry.lookup("gemv", scheme, v).variant, registry.lookup("gemm", scheme, v).variant)
        if pair not in seen:
            seen.append(pair)
            keep.append(pair[1] if pair[1] in variants else v)  # named after its gemm kernel
    return keep


def huge_empty(shape, dtype) -> np.ndarray:
    """An array in its own private anonymous mapping, 2 MiB-aligned, with transparent huge pages
    asked for (madvise; Linux with THP in "madvise" or "always" mode): what a layer's stacked
    weights get, since NumPy asks for huge pages on arrays from 4 MiB. A single matrix of a few MB
    otherwise sits in 4 KiB pages wherever the allocator put it, and the one-core AMX GEMM at
    M=512 read 1.3-1.4x faster in a fresh 2 MiB-aligned mapping than in a NumPy allocation
    (docs/decisions.md); huge pages themselves change nothing beyond that."""
    import mmap

    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    # private: Python's anonymous mmap is MAP_SHARED by default, i.e. shmem, which gets huge pages
    # only under /sys/kernel/mm/transparent_hugepage/shmem_enabled ("never" on the hosts seen)
    mm = mmap.mmap(-1, n + (4 << 20), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = np.frombuffer(mm, np.uint8)  # (holds the mapping for as long as the array lives)
    off = -base.ctypes.data % (2 << 20)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE, 0, len(mm))
    return base[off:off + n].view(dtype).reshape(shape)


def time_case(scheme, kvariants, m, n, d, reps, rng) -> list[dict]:
    w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
    x = rng.standard_normal((m, d), dtype=np.float32)
    p0 = packing.pack(w, scheme, 64)
    cold = m == 1
    copies = max(1, -(-POOL_BYTES // p0.nbytes)) if cold else 1
    # The copies live in one arena, as a stacked expert tensor does (p.expert(e) views): separate
    # small numpy allocations read ~20 % slower here (page-boundary effects), which a real
    # weight store does not have. The arena and the output are in huge pages, as the layer's
    # stacked weights and workspaces are (huge_empty).
    arena = [huge_empty((copies,) + a.shape, a.dtype) for a in (p0.data, p0.scale, p0.wsum)]
    for a, src in zip(arena, (p0.data, p0.scale, p0.wsum)):
        a[:] = src
    pool = [packing.PackedWeight(p0.scheme, p0.n, p0.d, p0.n_pad, p0.d_pad, p0.group_size,
                                 arena[0][i], arena[1][i], arena[2][i]) for i in range(copies)]
    bufs = gemm.activation_buffers(m, p0)
    gemm.prepare_activations(x, p0, bufs)
    out = huge_empty((m, p0.n_pad), np.float32)
    ops = {}
    for v in kvariants:
        tile = tiling.choose(m, n, d, registry.kernel_set(scheme, v))
        ops[v] = (tile.op, gemm.kernel_for(tile.op, scheme, v))
        gemm.launch(ops[v][1], p0, bufs, out)  # compile / warm
    times = {v: [] for v in kvariants}
    cpu = {v: [] for v in kvariants}
    calls = copies if cold else 1
    i = 0
    read_rates = []
    for _ in range(reps):
        if cold:
            # The same arena read by a plain 4-stream read kernel in the same time window: the
            # bandwidth a decode call could get here and now (load from others varies a lot).
            flat = arena[0].reshape(copies, -1).view(np.uint8)
            for c in range(copies):
                c0 = time.thread_time()
                nbytes = _read_bw(flat[c], 0, flat.shape[1], 4)[1]
                read_rates.append(nbytes / (time.thread_time() - c0))
        for v in kvariants:
            k = ops[v][1]
            if not cold:
                # untimed calls first, at least 3 ms of them: a warm AMX GEMM right after the other
                # variants' (tens of ms of AVX-512 / AVX2 work) took 1.7x as long as one after
                # itself (M=512; one untimed call left 1.1x), a switching cost the MoE
                # layer, whose threads stay on one kernel family, does not pay
                w0 = time.perf_counter()
                while True:
                    gemm.launch(k, pool[0], bufs, out)
                    if time.perf_counter() - w0 >= 3e-3:
                        break
            # cold: one call per pool copy so each reads weights not touched for >= 256 MB.
            for _c in range(calls if cold else 2):
                p = pool[i % copies]
                i += 1
                c0 = time.thread_time()
                t0 = time.perf_counter()
                gemm.launch(k, p, bufs, out)
                times[v].append(time.perf_counter() - t0)
                cpu[v].append(time.thread_time() - c0)
    rows = []
    for v in kvariants:
        t = np.array(times[v])
        c = np.array(cpu[v])
        rows.append(dict(scheme=scheme.value, variant=v, op=ops[v][0], M=m, N=n, D=d,
                         cold=cold, weight_bytes=p0.nbytes, median_s=float(np.median(t)),
                         min_s=float(t.min()), cpu_median_s=float(np.median(c)),
                         samples=len(t),
                         arena_read_GBps=float(np.median(read_rates)) / 1e9 if cold else None))
    del pool, arena
    return rows


def compile_times() -> dict:
    """First-call compile of the host variant's kernels, then their load from cache, in fresh
    processes sharing a new, empty KT_CACHE_DIR."""
    code = (
        "import time, numpy as np\n"
        "t0 = time.perf_counter()\n"
        "from kt.cpu_ops import gemm, packing, isa\n"
        "w = np.random.default_rng(0).standard_normal((32, 128), dtype=np.float32)\n"
        "x = np.ones((2, 128), np.float32)\n"
        "t1 = time.perf_counter()\n"
        "for s in ('int8', 'int4', 'bf16'):\n"
        "    p = packing.pack(w, s, 64)\n"
        "    for op in ('gemv', 'gemm'):\n"
        "        gemm.linear(x, p, op=op)\n"
        "print(isa.cpu_variant(), time.perf_counter() - t1, time.perf_counter() - t0)\n")
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, KT_CACHE_DIR=tmp)
        res = {}
        for key in ("first_call", "cached_new_process"):
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise RuntimeError(r.stderr[-2000:])
            v, dt, total = r.stdout.split()
            res["variant"] = v
            res[f"{key}_s"] = round(float(dt), 3)
            res[f"{key}_incl_imports_s"] = round(float(total), 3)
    return res


def markdown(res: dict) -> str:
    bw = res["bandwidth"]
    lines = ["# CPU GEMM kernels (one thread)", "",
             f"Host: {res['host']}; variants runnable: {', '.join(res['variants'])}.", "",
             f"Roofline: read bandwidth {bw['1_thread_GBps']} GB/s (1 thread), "
             f"{bw['2_thread_GBps']} GB/s (2 threads); peaks: "
             + ", ".join(f"{k} {v}" for k, v in res["peaks"].items()) + ".", "",
             "M = 1 rows read weights cold (pool of copies >= 256 MB in one arena); larger M reuse "
             "one copy. Times are per call on one thread. GB/s (weight bytes), TOPS and the "
             "roofline fraction use the median thread CPU time (wall time on this shared 2-core "
             "machine includes other processes' time slices for calls longer than a few ms; both "
             "are listed). Fraction = max(bytes / BW_1thread, ops / peak) / CPU time, with the AMX "
             "peak on zeroed tiles; 'random' is ops / (the AMX peak on random tiles) / CPU time. For M = 1, "
             "'vs read' compares with a plain read kernel streaming the same weight arena "
             "interleaved with the GEMM calls (same memory, same load from other processes).", "",
             "| scheme | kernel | op | M | N x D | CPU median ms | wall median ms | wall min ms "
             "| GB/s | TOPS | roofline | random | vs read |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["gemm"]:
        lines.append(f"| {r['scheme']} | {r['variant']} | {r['op']} | {r['M']} | {r['N']}x{r['D']} | "
                     f"{r['cpu_median_s'] * 1e3:.3f} | "
                     f"{r['median_s'] * 1e3:.3f} | {r['min_s'] * 1e3:.3f} | {r['GBps']:.1f} | "
                     f"{r['TOPS']:.3f} | {r['roofline_frac']:.0%} | "
                     + (f"{r['peak_frac_random_tiles']:.0%} | " if "peak_frac_random_tiles" in r else "- | ")
                     + (f"{r['frac_of_arena_read']:.0%} ({r['arena_read_GBps']:.1f} GB/s) |"
                        if r.get("arena_read_GBps") else "- |"))
    c = res.get("compile")
    if c:
        lines += ["", f"Compile ({c['variant']} kernels: gemv + gemm x 3 schemes + activation "
                      f"prep): first call {c['first_call_s']} s; cached, new process "
                      f"{c['cached_new_process_s']} s ({c['cached_new_process_incl_imports_s']} s "
                      "including imports)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="M in {1, 32} and one shape only")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--schemes", default="int8,int4,bf16")
    add_out_arguments(ap)
    args = ap.parse_args(argv)
    variants = [v for v in isa.runnable_variants()]
    import llvmlite.binding as llvm

    res = {"host": f"{isa.detect().host.model_name} ({llvm.get_host_cpu_name()}), "
                   f"{os.cpu_count()} CPUs", "variants": variants}
    res["bandwidth"] = measure_bandwidth()
    res["peaks"] = measure_peaks(variants)
    print("bandwidth", res["bandwidth"], "peaks", res["peaks"], flush=True)
    bw1 = res["bandwidth"]["1_thread_GBps"] * 1e9
    rng = np.random.default_rng(0)
    rows = []
    shapes = SHAPES[:1] if args.quick else SHAPES
    ms = [1, 32] if args.quick else MS
    for scheme in (QuantScheme.parse(s) for s in args.schemes.split(",")):
        kv = distinct_kernels(scheme, variants)
        for n, d in shapes:
            for m in ms:
                reps = args.reps if m <= 512 else max(2, args.reps // 2)
                for r in time_case(scheme, kv, m, n, d, reps, rng):
                    # Rates from the thread's CPU time: on this shared 2-core machine a call of
                    # more than a few ms is time-sliced with other processes, so wall time
                    # measures the neighbours; CPU time still includes memory stalls.
                    t = r["cpu_median_s"]
                    opsn = 2.0 * m * n * d
                    r["GBps"] = r["weight_bytes"] / t / 1e9
                    r["TOPS"] = opsn / t / 1e12
                    peak = peak_for(scheme, r["variant"], res["peaks"])
                    roof = max(r["weight_bytes"] / bw1, opsn / peak if peak else 0.0)
                    r["roofline_frac"] = roof / t
                    rpeak = random_peak_for(scheme, r["variant"], res["peaks"])
                    if rpeak:
                        r["peak_frac_random_tiles"] = opsn / rpeak / t
                    if r["arena_read_GBps"]:
                        r["frac_of_arena_read"] = r["GBps"] / r["arena_read_GBps"]
                    rows.append(r)
                    print(f"{r['scheme']:5s} {r['variant']:12s} {r['op']} M={m:5d} {n}x{d}: "
                          f"cpu {t * 1e3:8.3f} ms wall {r['median_s'] * 1e3:8.3f} ms  "
                          f"{r['GBps']:6.1f} GB/s  {r['TOPS']:.3f} TOPS  "
                          f"{r['roofline_frac']:.0%}"
                          + (f" (random-tile peak {r['peak_frac_random_tiles']:.0%})"
                             if "peak_frac_random_tiles" in r else "")
                          + (f"  (arena read {r['arena_read_GBps']:.1f} GB/s: "
                             f"{r['frac_of_arena_read']:.0%})" if r["cold"] else ""), flush=True)
    res["gemm"] = rows
    if not args.no_compile:
        res["compile"] = compile_times()
        print("compile", res["compile"])
    path = write_result(out_dir(args), "gemm", res, args.machine)
    print(markdown(res))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
