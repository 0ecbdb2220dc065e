"""Why a decode call's Python before its job is slow after another call, and what changes it.

A plain T=1 call of a cold layer copy spends time before its job starts (checks, descriptor,
publish); on the H200 host this part measured 30-70 us after other calls (``cpu_decode_floor.py
--variants stamped``), against ~16-25 us for back-to-back empty calls (``call_overhead.py``).
This probe runs sequences of calls (different copies, as a model's layers), rotating its modes
each round, and reports per mode the median time of the pool's ``begin()`` (the previous job's
participants leaving), of ``submit()`` (the Python before the job), of ``wait()``, and of all,
plus the CPUs the calling thread ran on; then the tensor path's steps one by one on warm caches:

- plain: T=1 calls as a model makes them;
- pinned: the same with the calling thread pinned to the CPU the pool leaves it (the last one);
- empty: the calls with every expert masked (no weights streamed).

Session 24 also ran it with a mode in which the calling thread stayed out of the job (a
``caller_joins=False`` pool job, since removed: no faster on the device, see docs/dev-notes.md).

    PYTHONPATH=. python3 benchmarks/decode_submit_probe.py --threads 16 --out $OUT
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _results import write_json  # noqa: E402
from bench_moe import SHAPES, routing  # noqa: E402
from profile_moe import _layers  # noqa: E402
from kt.config import QuantScheme  # noqa: E402
from kt.cpu_ops.pool import CpuPool  # noqa: E402

MODES = ("plain", "pinned", "empty")


def _cpu_now() -> int:
    """The CPU this thread last ran on (/proc/thread-self/stat field 39), or -1."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return -1


def pieces(L, x, masked) -> dict:
    """Median microseconds of the tensor path's steps, each repeated on warm caches."""
    import torch

    from kt.cpu_ops import _moe_driver as drv
    from kt.cpu_ops.moe import _at

    pool = L.pool
    E, H = L.num_experts, L.hidden
    K = min(8, E)
    ids, w = np.arange(K).reshape(1, K), np.full((1, K), 1.0 / K, np.float32)

    def med(f, n=3000):
        for _ in range(100):
            f()
        ts = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            f()
            ts.append(time.perf_counter_ns() - t0)
        return round(statistics.median(ts) / 1e3, 2)

    desc, words = L._call_words(pool, 1, K, False, "bf16", "bf16", None)
    return {"x checks": med(lambda: (x.dtype is torch.bfloat16, x.shape, x.is_cpu, x.is_contiguous())),
            "_at numpy": med(lambda: _at(ids, torch.Tensor, torch.int64, np.int64, (1, K))),
            "torch.empty": med(lambda: torch.empty(x.shape, dtype=x.dtype)),
            "begin": med(lambda: pool.begin()),
            "_call_words": med(lambda: L._call_words(pool, 1, K, False, "bf16", "bf16", None)),
            "put_call_at": med(lambda: drv.put_call_at(desc, 1, 2, ids.ctypes.data, 4, 5, H, K, E, *words)),
            "masked call": med(lambda: L(x, ids, w, gpu_mask=masked)),
            "pool hand-off": round(pool.handoff_overhead_us(repeats=2000)["median"], 2)}


def main(argv=None):
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--scheme", default="int4")
    ap.add_argument("--pool-gb", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=120)
    ap.add_argument("--sequence", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    E, K, H, I = SHAPES[a.shape]
    pool = CpuPool(a.threads)
    layers = _layers(QuantScheme.parse(a.scheme), a.shape, int(a.pool_gb * 2**30), pool)
    n = len(layers)
    mine = sorted(os.sched_getaffinity(0))
    pin_cpu = mine[-1]
    print(f"{a.scheme}: {n} copies; pool CPUs {[p.cpus for p in pool.placements]}; caller pinned "
          f"to {pin_cpu} in the pinned mode", flush=True)
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((1, H), dtype=np.float32)).to(torch.bfloat16)
    masked = np.ones(E, bool)
    res = {m: {"begin": [], "submit": [], "wait": [], "total": []} for m in MODES}
    cpus = {m: collections.Counter() for m in MODES}
    c = 0
    for i in range(a.rounds + 2):
        r = i % len(MODES)
        for m in MODES[r:] + MODES[:r]:
            pin = m == "pinned"
            if pin:
                os.sched_setaffinity(0, {pin_cpu})
            for k in range(a.sequence):
                L = layers[c % n]
                c += 1
                ids, w = routing(rng, 1, E, K)
                tb = time.perf_counter()
                pool.begin()  # the previous job's participants have all left (submit does this too)
                t0 = time.perf_counter()
                h = L.submit(x, ids, w, gpu_mask=masked if m == "empty" else None)
                t1 = time.perf_counter()
                h.wait()
                t2 = time.perf_counter()
                if i >= 2 and k > 0:
                    res[m]["begin"].append(t0 - tb)
                    res[m]["submit"].append(t1 - t0)
                    res[m]["wait"].append(t2 - t1)
                    res[m]["total"].append(t2 - t0)
                    cpus[m][_cpu_now()] += 1
            if pin:
                os.sched_setaffinity(0, set(mine))
    rows = []
    for m in MODES:
        row = {"mode": m, "threads": a.threads, "scheme": a.scheme}
        for part, v in res[m].items():
            row[f"{part}_median_us"] = round(statistics.median(v) * 1e6, 1)
            row[f"{part}_min_us"] = round(min(v) * 1e6, 1)
        row["caller_cpus"] = dict(cpus[m].most_common(4))
        rows.append(row)
        print(f"  {m:13s} begin {row['begin_median_us']:5.1f}, submit {row['submit_median_us']:6.1f} us "
              f"(min {row['submit_min_us']:.1f}), wait {row['wait_median_us']:6.1f}, total "
              f"{row['total_median_us']:6.1f} (min {row['total_min_us']:.1f}); caller on CPUs "
              f"{row['caller_cpus']}", flush=True)
    rows.append({"pieces_us": pieces(layers[0], x, masked)})
    print("  pieces of the tensor path, warm, median us:", rows[-1]["pieces_us"], flush=True)
    pool.shutdown()
    write_json(a.out, "decode_submit_probe.json", {"rows": rows})


if __name__ == "__main__":
    main()
