#!/usr/bin/env python3
"""The down GEMM's weights asked into L2 by the gate+up tiles: whole ``fused_moe`` with and without;
for one device call.

At decode sizes the two GEMMs read their weights from HBM one after the other, each well below
HBM's rate (qwen3 int8 T=64: gate+up ~2.7 TB/s, down ~2.2 of 4.3). With ``moe._PF_DOWN`` each gate+up
tile of slot s issues bulk L2 prefetches (cp.async.bulk.prefetch.L2) for its share of slot s's down
weights (1 plain, 2 with an evict_last policy), at the tile's start or, with ``moe._PF_END``, after
its k loop, so the down GEMM finds them in L2. Each case: the table's sorted config with each
variant, outputs checked against the fp32 reference and against each other (bit-identical: a
prefetch changes no value), timed as CUDA-graph replays with L2 flushed, interleaved rounds, min /
median us and the fraction of the HBM copy bandwidth for the touched slots' weights.

    PYTHONPATH=. python3 benchmarks/gpu_pf_probe.py --out $OUT
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup  # noqa: E402

CASES = ([("qwen3-30b-a3b", "int8", t) for t in (7, 16, 32, 64, 128, 512)]
         + [("qwen3-30b-a3b", "bf16", t) for t in (7, 64, 512)] + [("mixtral-8x7b", "int8", t) for t in (7, 64)])
DRY_CASES = [("tiny", "bf16", 5), ("tiny", "int8", 9)]
VARIANTS = {"base": dict(_PF_DOWN=0), "pf": dict(_PF_DOWN=1), "pf_last": dict(_PF_DOWN=2),
            "pf_end": dict(_PF_DOWN=1, _PF_END=True), "pf_last_end": dict(_PF_DOWN=2, _PF_END=True)}


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
        for label, sw in VARIANTS.items():
            def fn(sw=sw):  # (the switches are fixed when a graph is captured)
                with M._overriding(**sw):
                    return fused_moe(x, ids, w, e2s, **wts, config=cfg)
            outs[label] = fn()
            err = float(R.relative_error(outs[label], ref))
            assert err <= 1e-2, (name, dtype, t, label, err)
            case["variants"][label] = dict(rel_err=err)
            graphs[label] = fn if dry else B.graph_of(torch, fn)[0].replay
        case["bit_identical"] = all(bool(torch.equal(outs["base"], o)) for o in outs.values())
        assert case["bit_identical"], (name, dtype, t)
        for label, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            v = case["variants"][label]
            v.update(min_us=mn, median_us=md)
            if not dry:
                v["hbm_frac"] = nbytes / (mn * 1e-6) / ceilings["hbm_bytes_per_s"]
        res["fused"].append(case)
        print(f"fused {name} {dtype} T={t} ({nbytes / 1e6:.1f} MB): " + ", ".join(
            f"{p} {v['min_us']:.1f}/{v['median_us']:.1f}"
            + (f" ({100 * v['hbm_frac']:.0f} %)" if "hbm_frac" in v else "") for p, v in case["variants"].items()),
            flush=True)
        del graphs
        write_json(a.out, "gpu_pf_probe.json", res)  # (after every case: a cut run keeps its cases)
    print(f"wrote {write_json(a.out, 'gpu_pf_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
