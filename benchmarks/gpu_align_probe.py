#!/usr/bin/env python3
"""The decode-sized slot alignment: one program per slot against one program for all; for one device call.

Session 25's gather path (results/gpu_gather_probe_s25_run*) showed that at T=4-16 the sorted path's
one-program alignment (``align_small_kernel``: count with atomics, prefix sums, scatter with atomics,
a block barrier between the steps) takes 7.5-10 us alone, against an empty launch's 2.9. The
per-slot alignment (``align_per_slot_kernel``, session 25) runs a program per slot in one launch,
without atomics or barriers: each maps all ids and counts every slot's token-slots (a histogram),
then writes only its own slot's rows.

Part 1, the alignment alone: each path checked against the other (same slot map, rows in use and
token-slots per slot), then timed. Part 2, the whole ``fused_moe`` (the shipped table's sorted
config) with each alignment forced: both outputs checked against the fp32 reference and against
each other (bit-identical: a row's products do not depend on the other rows of its block), then
timed, as a fraction of the HBM copy bandwidth for the touched slots' weights (as
gpu_decode_floor.py). CUDA-graph replays, L2 flushed, min / median of interleaved rounds.

With --large the same at prefill sizes (N > 1024), against the two-launch and atomics paths.

    PYTHONPATH=. python3 benchmarks/gpu_align_probe.py --out $OUT      (~1 min on the H200)
    PYTHONPATH=. python3 benchmarks/gpu_align_probe.py --large --out $OUT
    python3 benchmarks/gpu_align_probe.py --dry-run                    (interpreter: checks only)
"""
from __future__ import annotations

import os
import sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402  (shapes, weights, routing, graph capture, ceilings)
from _results import write_json  # noqa: E402
from gpu_a8_probe import align_case, probe_setup  # noqa: E402

def paths_for(n, slots):
    """The alignment paths a case compares: per-slot first, then the path align_by_slot took before
    session 25 (one program up to N=1024; two launches up to 64 slots; else atomics), and the
    atomics path for any larger N."""
    if n <= 1024:
        return ("per_slot", "one_program")
    return ("per_slot", "two_launch", "atomics") if slots <= 64 else ("per_slot", "atomics")


# (label, (E, K, GPU slots), T, rows per block); --large: the sizes of prefill
ALIGN_CASES = ([("qwen3-30b-a3b", (128, 8, 32), t, 16) for t in (4, 7, 16, 64, 128)]
               + [("qwen3-all-gpu", (128, 8, 128), t, 16) for t in (7, 64)]
               + [("deepseek-v3", (256, 8, 64), 64, 16), ("deepseek-v3-all-gpu", (256, 8, 256), 64, 16),
                  ("mixtral-8x7b", (8, 2, 4), 64, 16)])
ALIGN_LARGE_CASES = ([("qwen3-30b-a3b", (128, 8, 32), t, bm) for t, bm in ((256, 32), (512, 32), (1024, 64),
                                                                          (4096, 128))]
                     + [("qwen3-all-gpu", (128, 8, 128), t, 64) for t in (256, 512, 4096)]
                     + [("deepseek-v3", (256, 8, 64), 512, 64), ("mixtral-8x7b", (8, 2, 4), 4096, 128)])
ALIGN_DRY_CASES = [("tiny", (8, 2, 4), 33, 16), ("tiny", (8, 2, 4), 5, 32)]
FUSED_CASES = ([("qwen3-30b-a3b", d, t) for d in ("int8", "bf16") for t in (4, 7, 16, 32, 64, 128)]
               + [("mixtral-8x7b", d, t) for d in ("int8", "bf16") for t in (7, 64)])
FUSED_LARGE_CASES = [("qwen3-30b-a3b", d, t) for d in ("int8", "bf16") for t in (256, 512, 1024)]
FUSED_DRY_CASES = [("tiny", "bf16", 5), ("tiny", "int8", 9)]


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv, extra=[
        ("--large", dict(action="store_true", help="the prefill sizes (N > 1024) instead of decode's"))])
    dry = a.dry_run
    import torch

    from kt import reference as R
    from kt.gpu_ops import fused_moe
    from kt.gpu_ops import moe as M

    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"align": [], "fused": [], "ceilings": ceilings}

    def replay(fn):
        return fn if dry else B.graph_of(torch, fn)[0].replay

    def forced(path, fn):
        def run():
            with M._forced_align(path):  # (the path is fixed when a graph is captured)
                return fn()
        return run

    for label, (e, k, ns), t, bm in (ALIGN_DRY_CASES if dry else ALIGN_LARGE_CASES if a.large else ALIGN_CASES):
        res["align"].append(align_case(torch, do_bench, dev, label, e, k, ns, t, bm, paths_for, a.rounds, dry))

    table = {} if dry else M._device_table(torch.cuda.current_device())
    shapes = B.DRY_SHAPES if dry else B.SHAPES
    made = {}
    for name, dtype, t in (FUSED_DRY_CASES if dry else FUSED_LARGE_CASES if a.large else FUSED_CASES):
        sh = shapes[name]
        wts, e2s, x, ids, w, nbytes, ref, cfg = B.decode_case(torch, shapes, made, name, dtype, t, dev, table)
        case = dict(shape=name, dtype=dtype, T=t, bytes=nbytes, config=cfg.to_dict(), variants={})
        graphs, outs = {}, {}
        paths = paths_for(ids.numel(), sh["S"])
        for path in paths:
            fn = forced(path, lambda: fused_moe(x, ids, w, e2s, **wts, config=cfg))
            outs[path] = fn()
            err = float(R.relative_error(outs[path], ref))
            assert err <= 1e-2, (name, dtype, t, path, err)
            case["variants"][path] = dict(rel_err=err)
            graphs[path] = replay(fn)
        case["bit_identical"] = all(bool(torch.equal(outs[paths[0]], outs[p])) for p in paths[1:])
        assert case["bit_identical"], (name, dtype, t)
        for path, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            v = case["variants"][path]
            v.update(min_us=mn, median_us=md)
            if not dry:
                v["hbm_frac"] = nbytes / (mn * 1e-6) / ceilings["hbm_bytes_per_s"]
        res["fused"].append(case)
        print(f"fused {name} {dtype} T={t} ({nbytes / 1e6:.1f} MB): " + ", ".join(
            f"{p} {v['min_us']:.1f}/{v['median_us']:.1f} us"
            + (f" ({100 * v['hbm_frac']:.0f} %)" if "hbm_frac" in v else "") for p, v in case["variants"].items()),
            flush=True)
        del graphs
    print(f"wrote {write_json(a.out, 'gpu_align_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
