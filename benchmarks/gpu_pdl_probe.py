#!/usr/bin/env python3
"""Programmatic dependent launch (PDL) in fused_moe, against plain launches, whole op; one device call.

At decode sizes the op is a chain of short kernels (alignment, gate+up, down, combine; or the direct
path's two), and between two kernels the GPU drains one grid before it starts the next. With PDL
(Hopper and later; ``kt.gpu_ops.moe._PDL``) each kernel is launched so that it may start while the
previous one finishes: it waits (griddepcontrol.wait) before its first load, but its launch and
start overlap the previous kernel's tail. Issue 6's decode cells this is for: qwen3 int8 T=64
(52-53 % of HBM in session 16) and bf16 T=7 (46 %).

Run 1 (session 17, results/gpu_pdl_probe_s17_run1.json) also had the L2 prefetch variants (the
sorted down's first 1 or 2 tiles per program, the direct down's expert rows): no gain beyond
PDL's within the rounds' spread, so the prefetch was removed. PDL itself won 0.5-1.2 us on the
direct path and was mixed on the sorted path (mixtral int8 a8 lost 20 %), hence the default
(``moe._pdl_for``): the direct path only.

Variants per case (shape, weight dtype, T; the shipped table's config): ``plain`` (no PDL) and
``pdl`` (both paths). Each output must equal the plain one bit for bit. CUDA-graph replay, L2
flushed, min / median of interleaved rounds, as a fraction of the HBM copy bandwidth for the
touched slots' weights (as gpu_decode_floor.py).

    PYTHONPATH=. python3 benchmarks/gpu_pdl_probe.py --out $OUT      (~2 min on the H200)
    python3 benchmarks/gpu_pdl_probe.py --dry-run                    (interpreter: no PDL, checks only)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402  (shapes, weights, routing, graph capture, ceilings)
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup  # noqa: E402

CASES = ([("qwen3-30b-a3b", d, t) for d in ("bf16", "int8") for t in (1, 2, 7, 16, 64)]
         + [("mixtral-8x7b", d, t) for d in ("bf16", "int8") for t in (1, 7, 64)])
VARIANTS = {"plain": dict(_PDL=False), "pdl": dict(_PDL=True)}
DRY_CASES = [("tiny", "bf16", 1), ("tiny", "int8", 9)]


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv)
    dry = a.dry_run
    import torch

    from kt import reference as R
    from kt.gpu_ops import fused_moe
    from kt.gpu_ops import moe as M

    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = B.DRY_SHAPES if dry else B.SHAPES
    res = {"cases": [], "ceilings": ceilings,
           "pdl_supported": (not dry) and M.pdl_supported(torch.cuda.current_device())}
    made = {}
    for name, dtype, t in (DRY_CASES if dry else CASES):
        sh = shapes[name]
        if (name, dtype) not in made:
            made.clear()
            if not dry:
                torch.cuda.empty_cache()
            made[(name, dtype)] = B.make_weights(torch, sh, dtype, dev, 2)
        wts, (w13f, w2f) = made[(name, dtype)]
        e2s = B.make_e2s(torch, sh, dev, 1)  # (the seeds of gpu_decode_floor.py)
        gx = torch.Generator(device=dev).manual_seed(3 + t)
        x = torch.randn(t, sh["H"], device=dev, generator=gx).to(torch.bfloat16)
        ids, w = B.make_routing(torch, sh, t, e2s, dev, 4 + t)
        per_slot = sum(wts[n].numel() * wts[n].element_size() for n in ("w13", "w2")) // sh["S"]
        nbytes = per_slot * len(B.touched_slots(B.gpu_slots(torch, ids, e2s)))
        ref = B.ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
        case = dict(shape=name, dtype=dtype, T=t, bytes=nbytes, variants={})
        graphs, outs = {}, {}

        def fn():
            return fused_moe(x, ids, w, e2s, **wts)
        for vn, knobs in VARIANTS.items():
            case["variants"][vn] = v = dict(knobs={k: int(x_) for k, x_ in knobs.items()})
            try:
                with M._overriding(**knobs):
                    outs[vn] = fn()
                    v["rel_err"] = float(R.relative_error(outs[vn], ref))
                    v["identical_to_plain"] = bool(torch.equal(outs[vn], outs["plain"]))
                    if dry:
                        graphs[vn] = fn
                    else:
                        g, gout = B.graph_of(torch, fn)
                        g.replay()
                        torch.cuda.synchronize()
                        v["graph_identical_to_plain"] = bool(torch.equal(gout, outs["plain"]))
                        graphs[vn] = g.replay
            except Exception as e:  # recorded, not fatal: the other variants still run
                v["error"] = repr(e)[:400]
                if dry:
                    raise
        for vn, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            v = case["variants"][vn]
            v.update(min_us=mn, median_us=md)
            if not dry:
                v["hbm_frac"] = nbytes / (mn * 1e-6) / ceilings["hbm_bytes_per_s"]
        res["cases"].append(case)
        line = []
        for vn, v in case["variants"].items():
            if "min_us" in v:
                same = "" if v.get("identical_to_plain") and v.get("graph_identical_to_plain", True) else " DIFFERS"
                line.append(f"{vn} {v['min_us']:.1f}{same}")
            else:
                line.append(f"{vn} ERROR")
        print(f"{name} {dtype} T={t} ({nbytes / 1e6:.1f} MB): " + ", ".join(line), flush=True)
        del graphs, outs
    print(f"wrote {write_json(a.out, 'gpu_pdl_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
