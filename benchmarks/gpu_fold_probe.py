#!/usr/bin/env python3
"""The sorted path's combine folded into the down GEMM (``MoEConfig.fold_combine``) against its own
launch, whole ``fused_moe``; for one device call.

At decode sizes the combine is a launch of its own (qwen3 int8 T=64: 6.8 us alone, 4-5 above an
empty launch; session 25). Folded, each down tile counts itself done for its column block and the
block's last tile sums every token's rows for those columns (the same sums in the same order), so
one launch goes and a serial tail that grows with T comes. Each case: the table's sorted config
with the fold off and on (16, 32 or 64 tokens per step of its sum), both outputs checked against the fp32 reference and against each other
(bit-identical), then timed as CUDA-graph replays with L2 flushed, interleaved rounds, min / median
us and the fraction of the HBM copy bandwidth for the touched slots' weights (as
gpu_decode_floor.py).

    PYTHONPATH=. python3 benchmarks/gpu_fold_probe.py --out $OUT      (~1 min on the H200)
    python3 benchmarks/gpu_fold_probe.py --dry-run                    (interpreter: checks only)
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402  (shapes, weights, routing, graph capture, ceilings)
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup  # noqa: E402

CASES = ([("qwen3-30b-a3b", d, t) for d in ("int8", "bf16") for t in (4, 7, 16, 32, 64, 128, 256, 512)]
         + [("mixtral-8x7b", d, t) for d in ("int8", "bf16") for t in (7, 64, 256)])
DRY_CASES = [("tiny", "bf16", 5), ("tiny", "int8", 9)]
FOLD_TOKENS = (16, 32, 64)  # tokens per step of the folded sum (moe._FOLD_TOKENS)


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv)
    dry = a.dry_run
    import torch

    from kt import reference as R
    from kt.gpu_ops import fused_moe
    from kt.gpu_ops import moe as M

    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"fused": [], "ceilings": ceilings}
    table = {} if dry else M._device_table(torch.cuda.current_device())
    shapes = B.DRY_SHAPES if dry else B.SHAPES
    made = {}
    for name, dtype, t in (DRY_CASES if dry else CASES):
        wts, e2s, x, ids, w, nbytes, ref, cfg = B.decode_case(torch, shapes, made, name, dtype, t, dev, table)
        case = dict(shape=name, dtype=dtype, T=t, bytes=nbytes, config=cfg.to_dict(), variants={})
        graphs, outs = {}, {}
        if cfg.for_down().flatten:  # (the fold needs a down loop that is not flattened)
            cfg = replace(cfg, down_flatten=False)
            case["config"] = cfg.to_dict()
        for label, on, steps in (("launch", False, None),) + tuple((f"fold{n}", True, n) for n in FOLD_TOKENS):
            c = replace(cfg, fold_combine=on)

            def fn(c=c, steps=steps):  # (the tokens per step are fixed when a graph is captured)
                with M._overriding(_FOLD_TOKENS=steps or M._FOLD_TOKENS):
                    return fused_moe(x, ids, w, e2s, **wts, config=c)
            outs[label] = fn()
            err = float(R.relative_error(outs[label], ref))
            assert err <= 1e-2, (name, dtype, t, label, err)
            case["variants"][label] = dict(rel_err=err)
            graphs[label] = fn if dry else B.graph_of(torch, fn)[0].replay
        case["bit_identical"] = all(bool(torch.equal(outs["launch"], o)) for o in outs.values())
        assert case["bit_identical"], (name, dtype, t)
        for label, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            v = case["variants"][label]
            v.update(min_us=mn, median_us=md)
            if not dry:
                v["hbm_frac"] = nbytes / (mn * 1e-6) / ceilings["hbm_bytes_per_s"]
        res["fused"].append(case)
        print(f"fused {name} {dtype} T={t} ({nbytes / 1e6:.1f} MB): " + ", ".join(
            f"{p} {v['min_us']:.1f}/{v['median_us']:.1f} us"
            + (f" ({100 * v['hbm_frac']:.0f} %)" if "hbm_frac" in v else "") for p, v in case["variants"].items()),
            flush=True)
        del graphs
        write_json(a.out, "gpu_fold_probe.json", res)  # (after every case: a cut run keeps its cases)
    print(f"wrote {write_json(a.out, 'gpu_fold_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
