"""Issue 4's decode figure against a floor measured beside it, call by call.

A T=1 layer call and a plain read of the same bytes alternate on the same pool: the read covers the
arrays the call's kernels read (``CPUMoE.read_arrays``: packed values and scales or ratio tables) for
the same experts, taken from another cold copy of the layer, split into 64 KiB chunks that the
pool's threads claim as the layer's tasks are claimed, each read with 64-byte loads and an L2
prefetch 4 KiB ahead (as the decode GEMVs read). Each round gives the layer's wall time (a plain
call, as a model makes it), the read's span on the time-stamp counter (first chunk started to last
chunk done: the bandwidth the pool got for those bytes at that moment, without the hand-off), and
their ratio. A single all-thread bandwidth figure moved 91-129 GB/s within one device lease
(session 23), far more than the calls did, so a floor taken once per run says as much about the
moment as about the layer; this one is taken within milliseconds of each call.

    PYTHONPATH=. python3 benchmarks/cpu_decode_floor.py --threads 16 --rounds 300 --out $OUT

``--variants gated`` adds the stream-gated job (a hybrid layer's decode path, no Python between
its start and done flags) beside the plain call; ``stamped`` the plain call with its parts timed
(the Python before its job, the job, what follows); ``general`` the plain call without the tensor
path (``CPUMoE._submit_tensors``); the other variants swap the decode GEMV's prefetch
(``DECODE_VARIANTS``). The variants' order turns each round. ``--sequence N`` runs each variant N
calls in a row (other copies, as a model's layers come) and leaves the first out: a call after
one of its own kind rather than after the read (session 24 found the order moved a call's Python
by tens of microseconds).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from numba import carray, njit

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import write_json  # noqa: E402
from bench_gemm import _read_slice  # noqa: E402
from bench_moe import SHAPES, routing  # noqa: E402
from profile_moe import _layers  # noqa: E402
from kt.config import QuantScheme  # noqa: E402
from kt.cpu_ops._moe_driver import _ptr, cycles  # noqa: E402
from kt.cpu_ops.moe import tsc_hz  # noqa: E402
from kt.cpu_ops.pool import (CTRL_STRIDE, DESC_SIZE, JOB_COMPLETE, JOB_FREE, JOB_JOIN, CpuPool,  # noqa: E402
                             atomic_add, atomic_store)

CHUNK = 64 << 10
PF = 4096
RES_WORDS = 16  # per participant: first chunk's start, last chunk's end, a checksum (own lines)


@njit(nogil=True, cache=True)
def _read_job(nth, jctrl, desc):
    """desc: [segments, chunk bytes, result address, chunks in all, (address, bytes) per segment].
    Participants claim chunks (jctrl[JOB_FREE]) and read them; the last of nth to leave completes."""
    me = atomic_add(jctrl, JOB_JOIN, 1)
    if me >= nth:
        return
    nseg = desc[0]
    ch = desc[1]
    res = carray(_ptr(desc[2], np.int64), (nth * RES_WORDS,))
    nch = desc[3]
    sink = np.int64(0)
    t_first = np.int64(0)
    while True:
        i = atomic_add(jctrl, JOB_FREE, 1)
        if i >= nch:
            break
        if t_first == 0:
            t_first = cycles()
        s = 0
        ci = i
        while s < nseg:
            nc = (desc[5 + 2 * s] + ch - 1) // ch
            if ci < nc:
                break
            ci -= nc
            s += 1
        n = desc[5 + 2 * s]
        buf = carray(_ptr(desc[4 + 2 * s], np.uint8), (n,))
        lo = ci * ch
        # one stream, the L2 prefetch running on past the chunk to the segment's end
        sink ^= _read_slice(buf, lo, min(n, lo + ch), ch, 1, PF, n)
    res[me * RES_WORDS] = t_first
    res[me * RES_WORDS + 1] = cycles() if t_first != 0 else 0
    res[me * RES_WORDS + 2] = sink
    if atomic_add(jctrl, JOB_FREE + CTRL_STRIDE, 1) == nth - 1:
        atomic_store(jctrl, JOB_COMPLETE, 1)


def read_segments(layer, experts) -> list[tuple[np.ndarray, int]]:
    """(array slice, bytes) of every array the layer's kernels read, for those experts."""
    return [(a[e], a[e].nbytes) for e in experts for a in layer.read_arrays()]


def timed_read(pool: CpuPool, segs, res: np.ndarray) -> tuple[float, float]:
    """(wall seconds of the read job, seconds from its first chunk's start to its last chunk's end)."""
    nth = pool.num_threads
    t0 = time.perf_counter()
    if 4 + 2 * len(segs) > DESC_SIZE:
        raise ValueError(f"{len(segs)} segments do not fit the pool's job descriptor")
    desc, _ = pool.begin(JOB_FREE + 2 * CTRL_STRIDE)
    desc[0] = len(segs)
    desc[1] = CHUNK
    desc[2] = res.ctypes.data
    desc[3] = sum(-(-n // CHUNK) for _, n in segs)
    for s, (a, n) in enumerate(segs):
        desc[4 + 2 * s] = a.ctypes.data
        desc[5 + 2 * s] = n
    res[:] = 0
    pool.submit_native(_read_job, keep=(segs, res)).wait()
    wall = time.perf_counter() - t0
    r = res.reshape(nth, RES_WORDS)
    used = r[:, 0] > 0
    span = (r[used, 1].max() - r[used, 0].min()) / tsc_hz()
    return wall, span


def _int4_tab_gemv(ahead: int, l2: bool):
    """The AMX / AVX-512 INT4 decode GEMV on ratio tables (``gemv_int4_tab``) with another
    prefetch: ``ahead`` bytes, into L1 (before session 23: 4 KiB) or L2 (shipped: 8 KiB)."""
    from kt.cpu_ops import kernels_avx512 as KV

    @njit(nogil=True)
    def k(xq, xs, data, tab, group_size, out, nb0, nb1):
        KV._gemv_int4(xq, xs, data, tab, group_size, out, nb0, nb1, ahead, True,
                      tab.reshape(-1).view(np.int8), l2)
    return k


def _amx_gemv(scheme: str, pf: int, l2: bool):
    """The AMX INT8 / BF16 decode GEMV (``gemv_int8`` / ``gemv_bf16``: 4 k-steps ahead into L1)
    with another prefetch: pf k-steps (1 KiB each per block) ahead, into L1 or L2."""
    from kt.cpu_ops import kernels_amx as KA

    if scheme == "int8":
        @njit(nogil=True)
        def k8(xq, xs, data, scale, wsum, out, nb0, nb1):
            KA._gemv_pf(xq, data, out, nb0, nb1, pf, False, xs, scale, l2)
        return k8

    @njit(nogil=True)
    def kb(xb, data, out, nb0, nb1):
        KA._gemv_pf(xb, data, out, nb0, nb1, pf, True, KA._NO_XS, KA._NO_XS, l2)
    return kb


# name -> (scheme, prefetch distance, into L2)
DECODE_VARIANTS = {"i4l1_4k": ("int4", 4096, False), "i4l1_8k": ("int4", 8192, False),
                   "i4l2_4k": ("int4", 4096, True), "i4l2_16k": ("int4", 16384, True),
                   "l2_4": ("amx", 4, True), "l2_8": ("amx", 8, True), "l2_16": ("amx", 16, True),
                   "l1_8": ("amx", 8, False), "avx512": ("avx512", 0, False)}


def decode_variant(sname: str, name: str):
    """The decode kernel of variant ``name`` for scheme ``sname``, or None if it is not for it."""
    kind, dist, l2 = DECODE_VARIANTS[name]
    if kind == "avx512":  # the AVX-512 GEMV on the same packed weights (VNNI / BF16 dot products)
        from kt.cpu_ops import kernels_avx512 as KV

        return {"int8": KV.gemv_int8, "bf16": KV.gemv_bf16}.get(sname)
    if kind == "int4":
        return _int4_tab_gemv(dist, l2) if sname == "int4" else None
    return _amx_gemv(sname, dist, l2) if sname in ("int8", "bf16") else None


def with_decode_kernel(layer, kernel):
    """A layer on the same weights (and tables) whose decode calls run ``kernel`` (benchmark use:
    it swaps the entry point the driver calls)."""
    from kt.cpu_ops import _moe_driver as drv
    from kt.cpu_ops.moe import _SCHEME_CODE, CPUMoE

    m = CPUMoE(layer.w13, layer.w2, pool=layer.pool)
    m._tabs = layer._tabs
    m._kaddr = (drv.kernel_address(kernel, _SCHEME_CODE[layer.scheme]), m._kaddr[1])
    m._wdesc = m._weight_desc()
    m._tmpl.clear()
    return m


class GatedCall:
    """Time a layer's stream-gated decode job (``CPUMoE.submit_gated``, the decode path of a hybrid
    layer) from its start flag to its done flag: the job is published first (the Python part,
    untimed, as a hybrid layer publishes it before the stream needs it), the pool's background
    threads wait at its gate, and this thread sets "start" and spins until "done". The caller is
    not a participant (as a hybrid layer's service thread is not): one pool thread fewer than a
    plain call, and the spinning caller takes the core it leaves."""

    def __init__(self, x, K):
        if not isinstance(x, np.ndarray):  # a torch bf16 tensor: its bits
            import torch

            x = x.view(torch.int16).numpy().view(np.uint16)
        self.x = np.ascontiguousarray(x)
        self.out = np.empty_like(self.x)
        self.ids = np.zeros((self.x.shape[0], K), np.int64)
        self.w = np.zeros((self.x.shape[0], K), np.float32)
        self.flags = np.zeros(32, np.int32)  # start at [0], done at [16]: lines of their own

    def __call__(self, layer, ids, w) -> float:
        self.ids[...] = ids
        self.w[...] = w
        self.flags[:] = 0
        f = self.flags
        h = layer.submit_gated(self.x, self.ids, self.w, self.out, f[0:].ctypes.data, f[16:].ctypes.data)
        t_pub = time.perf_counter()
        while time.perf_counter() - t_pub < 50e-6:  # the workers reach the gate
            pass
        t0 = time.perf_counter()
        f[0] = 1
        while f[16] == 0:
            pass
        dt = time.perf_counter() - t0
        r = h.wait()
        if not r.finished:
            raise RuntimeError(f"gated job did not finish: {r}")
        return dt


def stamped_job(stamps: np.ndarray):
    """``moe_job`` wrapped to note each participant's entry and exit (time-stamp counter) in
    ``stamps`` (int64: a claim counter, then an (entry, exit) pair per participant), so that a
    plain call's wall time splits into its Python before the job, the job, and what follows."""
    from kt.cpu_ops._moe_driver import moe_job

    addr = stamps.ctypes.data
    size = stamps.size
    n = (size - CTRL_STRIDE) // 2

    @njit(nogil=True)
    def job(nth, jctrl, desc):
        st = carray(_ptr(addr, np.int64), (size,))
        t = cycles()
        k = atomic_add(st, 0, 1)
        moe_job(nth, jctrl, desc)
        if k < n:
            st[CTRL_STRIDE + 2 * k] = t
            st[CTRL_STRIDE + 2 * k + 1] = cycles()
    return job


class StampedCall:
    """A plain call with its job swapped for ``stamped_job``: returns its wall seconds and
    notes (Python before the first participant entered, before the last one did, first entry
    to last exit, last exit to the call's return), in microseconds."""

    def __init__(self, nthreads: int):
        from kt.cpu_ops import _moe_driver as drv

        self.drv = drv
        self.stamps = np.zeros(CTRL_STRIDE + 2 * (nthreads + 4), np.int64)
        self.job = stamped_job(self.stamps)
        self.parts = []

    def __call__(self, layer, x, ids, w, keep: bool = True) -> float:
        drv = self.drv
        real = drv.moe_job
        st = self.stamps
        st[:] = 0
        drv.moe_job = self.job
        try:
            t1 = time.perf_counter()
            c0 = drv.read_cycles()
            layer(x, ids, w)
            c1 = drv.read_cycles()
            dt = time.perf_counter() - t1
        finally:
            drv.moe_job = real
        k = min(int(st[0]), (st.size - CTRL_STRIDE) // 2)
        ent = st[CTRL_STRIDE: CTRL_STRIDE + 2 * k: 2]
        ext = st[CTRL_STRIDE + 1: CTRL_STRIDE + 2 * k: 2]
        us = 1e6 / tsc_hz()
        if keep:
            self.parts.append(((ent.min() - c0) * us, (ent.max() - c0) * us,
                               (ext.max() - ent.min()) * us, (c1 - ext.max()) * us))
        return dt


def call_variant(v, L, x, ids, w, gated, stamped, keep) -> float:
    """One T=1 call of variant ``v`` on layer ``L``; its seconds (``keep``: a call that counts)."""
    if v == "gated":
        return gated(L, ids, w)
    if v == "stamped":
        return stamped(L, x, ids, w, keep)
    if v == "general":  # without the tensor path (CPUMoE._submit_tensors)
        L._submit_tensors = _off_path
    try:
        t1 = time.perf_counter()
        L(x, ids, w)
        return time.perf_counter() - t1
    finally:
        L.__dict__.pop("_submit_tensors", None)


def run_scheme(sname, a, pool, rng, rows):
    scheme = QuantScheme.parse(sname)
    E, K, H, I = SHAPES[a.shape]
    t0 = time.time()
    layers = _layers(scheme, a.shape, int(a.pool_gb * 2**30), pool)
    n = len(layers)
    if n < 3:
        raise SystemExit("--pool-gb too small: need at least 3 copies")
    print(f"{sname}: {n} copies built in {time.time() - t0:.0f} s; {layers[0].expert_read_bytes() / 1e6:.2f} "
          f"MB read per expert", flush=True)
    variants = {"default": layers}
    names = [v for v in a.variants.split(",") if v]
    if layers[0].variant == "amx" and (scheme is not QuantScheme.INT4 or layers[0]._tabs is not None):
        for v in names:
            k = decode_variant(sname, v) if v in DECODE_VARIANTS else None
            if k is not None:
                variants[v] = [with_decode_kernel(L, k) for L in layers]
    for v in ("gated", "stamped", "general"):
        if v in names:
            variants[v] = layers
    x = rng.standard_normal((1, H), dtype=np.float32)
    if a.x_bf16:
        import torch

        x = torch.from_numpy(x).to(torch.bfloat16)
    res = np.zeros(pool.num_threads * RES_WORDS, np.int64)
    gated = GatedCall(x, K) if "gated" in variants else None
    stamped = StampedCall(pool.num_threads) if "stamped" in variants else None
    calls = {v: [] for v in variants}
    spans, walls, nbytes = [], [], []
    kinds = list(variants)
    seq = a.sequence
    c = 0  # copies in turn, calls and reads alike: a copy comes back after n uses (cold again)
    for i in range(a.rounds + 3):
        ids, w = routing(rng, 1, E, K)
        used = sorted(set(int(e) for e in ids.ravel() if e >= 0))
        # the variants' order turns each round: none always follows the read (a job the caller
        # took part in) or the same other variant
        r = i % len(kinds)
        for v in kinds[r:] + kinds[:r]:
            # with sequences, the first call (after another variant) is left out
            ts = []
            for k in range(seq):
                keep = i >= 3 and (seq == 1 or k > 0)
                ts.append(call_variant(v, variants[v][c % n], x, ids, w, gated, stamped, keep))
                c += 1
            if i >= 3:
                calls[v].append(statistics.fmean(ts[1:]) if seq > 1 else ts[0])
        # the same experts of a copy no call of this round read
        segs = read_segments(layers[c % n], used)
        c += 1
        wall, span = timed_read(pool, segs, res)
        if i < 3:  # warm-up (compile, first touch)
            continue
        spans.append(span)
        walls.append(wall)
        nbytes.append(sum(nb for _, nb in segs))
    mb = statistics.median(nbytes)
    read = {"read_span_min_ms": round(min(spans) * 1e3, 4),
            "read_span_median_ms": round(statistics.median(spans) * 1e3, 4),
            "read_wall_median_ms": round(statistics.median(walls) * 1e3, 4),
            "read_GBps_best": round(max(b / s for b, s in zip(nbytes, spans)) / 1e9, 1),
            "read_GBps_median": round(statistics.median(b / s for b, s in zip(nbytes, spans)) / 1e9, 1)}
    print(f"  read of the same {mb / 1e6:.1f} MB: {read['read_span_min_ms']:.3f} / "
          f"{read['read_span_median_ms']:.3f} ms ({read['read_GBps_median']} GB/s median, best "
          f"{read['read_GBps_best']})", flush=True)
    for v, cs in calls.items():
        ratios = [s / c for s, c in zip(spans, cs)]
        r = {"scheme": sname, "variant": v, "T": 1, "threads": pool.num_threads, "rounds": a.rounds,
             "MB_per_call": round(mb / 1e6, 2), "call_min_ms": round(min(cs) * 1e3, 4),
             "call_median_ms": round(statistics.median(cs) * 1e3, 4), **read,
             "frac_of_floor_per_round_median": round(statistics.median(ratios), 3),
             "frac_of_floor_minima": round(min(spans) / min(cs), 3)}
        if v == "stamped":
            parts = np.array(stamped.parts)
            med = np.median(parts, axis=0)
            r.update({"us_to_first_entry_median": round(float(med[0]), 1),
                      "us_to_last_entry_median": round(float(med[1]), 1),
                      "us_job_median": round(float(med[2]), 1),
                      "us_after_job_median": round(float(med[3]), 1)})
        rows.append(r)
        if v == "stamped":
            print(f"  T=1 stamped parts (median us): call to first entry "
                  f"{r['us_to_first_entry_median']}, to last entry {r['us_to_last_entry_median']}, "
                  f"first entry to last exit {r['us_job_median']}, last exit to return "
                  f"{r['us_after_job_median']}")
        print(f"  T=1 {v:9s}: call {r['call_min_ms']:.3f} / {r['call_median_ms']:.3f} ms (min / median); "
              f"floor / call {100 * r['frac_of_floor_per_round_median']:.0f} % per round (median), "
              f"{100 * r['frac_of_floor_minima']:.0f} % of minima", flush=True)


def _off_path(*args):
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--pool-gb", type=float, default=4.0)
    ap.add_argument("--schemes", default="int4,int8,bf16")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--x-bf16", action="store_true", help="bf16 torch input, as a model passes it")
    ap.add_argument("--variants", default="", help=f"decode GEMV variants beside the default, "
                    f"interleaved (i4*: INT4, the others INT8 / BF16): {','.join(DECODE_VARIANTS)}; "
                    f"and 'gated': the stream-gated job from its start flag to its done flag; "
                    f"'stamped': the plain call with its parts timed; 'general': the plain call "
                    f"without the tensor path")
    ap.add_argument("--sequence", type=int, default=1,
                    help="calls of a variant in a row per round (on other copies), as a model's "
                         "layers come one after another; the first of each run is left out")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if a.sequence < 1:
        ap.error(f"--sequence must be at least 1, got {a.sequence}")
    pool = CpuPool(a.threads)
    rng = np.random.default_rng(0)
    rows = []
    for s in a.schemes.split(","):
        run_scheme(s, a, pool, rng, rows)
    pool.shutdown()
    print(f"wrote {write_json(a.out, 'cpu_decode_floor.json', {'shape': a.shape, 'rows': rows})}")


if __name__ == "__main__":
    main()
