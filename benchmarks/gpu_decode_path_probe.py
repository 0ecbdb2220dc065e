#!/usr/bin/env python3
"""The direct path against the sorted path at small T > 1, whole op; for one device call.

Until session 16 ``fused_moe`` took the direct path (two launches: a gate+up GEMV per token-slot or
per slot, and a down GEMV per token that folds in the combine) only for T*K <= DIRECT_MAX_N = 8, which
session 5 set when the direct down lost at T=7 (qwen3 bf16 63 vs 47 us: it reads an expert's rows
again for every token that uses it). Session 15 made both GEMVs much faster (pipelined loops, one
reduction after the loop, no trip for experts off the GPU: mixtral int8 T=1 down 46 -> 26 us), so the
crossover may have moved: a qwen3 decode step at T=2..16 paid the sorted path's four launches
(alignment, two GEMMs, combine) for a few dozen MB. This probe's run 2 (session 16) moved the default
to T*K <= 8 or T <= 2 (``configs.takes_direct``).

Per case (shape, weight dtype, T): the sorted path with the shipped table's config, and the direct
path with the table's T=1 entry and with the gate+up / down tiles below, each output checked
against the fp32 reference; CUDA-graph replay, L2 flushed, min / median of interleaved rounds, as a
fraction of the HBM copy bandwidth for the touched slots' weights (as gpu_decode_floor.py).

    PYTHONPATH=. python3 benchmarks/gpu_decode_path_probe.py --out $OUT      (~2 min on the H200)
    python3 benchmarks/gpu_decode_path_probe.py --dry-run                    (interpreter: checks only)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402  (shapes, weights, routing, graph capture, ceilings)
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup  # noqa: E402

CASES = ([("qwen3-30b-a3b", d, t) for d in ("bf16", "int8") for t in (2, 4, 7, 16)]
         + [("mixtral-8x7b", d, 7) for d in ("bf16", "int8")])
# gate+up (kernel, block_n, block_k, num_warps, num_stages); None = the table's T=1 entry's
GU = [None, ("scan", 32, 256, 4, 3), ("scan", 64, 128, 4, 3), ("scan", 32, 128, 4, 4), ("pairs", 4, 512, 4, 3)]
# down (down_block_n, down_block_k, down_num_warps, down_num_stages); None = the T=1 entry's
DOWN = [None, (4, 512, 4, 4), (8, 256, 4, 6), (2, 1024, 2, 3)]
DRY = dict(cases=[("tiny", "bf16", 5), ("tiny", "int8", 9)],
           gu=[None, ("scan", 16, 32, 4, 3), ("pairs", 4, 32, 4, 3)], down=[None, (4, 16, 2, 3)])


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv)
    dry = a.dry_run
    from dataclasses import replace

    import torch

    from kt import reference as R
    from kt.gpu_ops import DirectConfig, fused_moe, pick_config
    from kt.gpu_ops import moe as M

    torch.backends.cuda.matmul.allow_tf32 = False
    table = {} if dry else M._device_table(torch.cuda.current_device())
    shapes = B.DRY_SHAPES if dry else B.SHAPES
    res = {"cases": [], "ceilings": ceilings}
    made = {}
    for name, dtype, t in (DRY["cases"] if dry else CASES):
        sh = shapes[name]
        wts, e2s, x, ids, w, nbytes, ref, sorted_cfg = B.decode_case(torch, shapes, made, name, dtype, t, dev,
                                                                     table)
        args = (t, sh["K"], sh["S"], sh["H"], sh["I"], dtype, table)
        base = pick_config(1, *args[1:])
        variants = {"sorted": sorted_cfg}
        for gu in (DRY["gu"] if dry else GU):
            for dn in (DRY["down"] if dry else DOWN):
                cfg = base
                if gu is not None:
                    cfg = replace(cfg, gate_up=gu[0], block_n=gu[1], block_k=gu[2], num_warps=gu[3], num_stages=gu[4])
                if dn is not None:
                    cfg = replace(cfg, down_block_n=dn[0], down_block_k=dn[1], down_num_warps=dn[2],
                                  down_num_stages=dn[3])
                assert isinstance(cfg, DirectConfig)
                variants["direct " + "/".join("t1" if v is None else ",".join(map(str, v)) for v in (gu, dn))] = cfg
        case = dict(shape=name, dtype=dtype, T=t, bytes=nbytes, variants={})
        graphs = {}
        for vn, cfg in variants.items():
            def fn(cfg=cfg):
                return fused_moe(x, ids, w, e2s, **wts, config=cfg)
            case["variants"][vn] = v = dict(config=cfg.to_dict())
            try:  # (a scan tile too big for shared memory fails to compile: recorded, not fatal)
                v["rel_err"] = float(R.relative_error(fn(), ref))
                graphs[vn] = fn if dry else B.graph_of(torch, fn)[0].replay
            except Exception as e:
                v["error"] = repr(e)[:300]
                if dry:
                    raise
                continue
            assert v["rel_err"] <= 1e-2, (name, dtype, t, vn, v["rel_err"])
        for vn, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            v = case["variants"][vn]
            v.update(min_us=mn, median_us=md)
            if not dry:
                v["hbm_frac"] = nbytes / (mn * 1e-6) / ceilings["hbm_bytes_per_s"]
        direct = min((vn for vn in graphs if vn != "sorted"), key=lambda vn: case["variants"][vn]["min_us"])
        case["best_direct"] = direct
        res["cases"].append(case)
        s_, d_ = case["variants"]["sorted"], case["variants"][direct]
        timed = [(vn[7:], v["min_us"]) for vn, v in case["variants"].items() if "min_us" in v and vn != "sorted"]
        print(f"{name} {dtype} T={t} ({nbytes / 1e6:.1f} MB): sorted {s_['min_us']:.1f} us, best direct "
              f"{d_['min_us']:.1f} us ({direct}); " + ", ".join(f"{vn} {us:.1f}" for vn, us in timed), flush=True)
        del graphs
    print(f"wrote {write_json(a.out, 'gpu_decode_path_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
