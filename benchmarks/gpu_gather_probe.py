#!/usr/bin/env python3
"""The gather path against the sorted path at a few tokens per slot, whole op; for one device call.

The sorted path spends two of its four launches on the alignment (one program: count, offsets,
scatter) and the combine: at qwen3 int8 T=64 on the H200 its 66.8 us hold ~52 us of GEMMs (ncu,
session 15), and issue 6's 60 % of HBM needs 58.8 us. The gather path (``MoEConfig.gather``,
session 25) has neither launch: each gate+up program scans the ids for its slot's token-slots, and
the last down program of each column block sums the tokens' rows.

Per case (shape, weight dtype, T): the sorted path with the shipped table's config, the gather path
with the same tiles, and gather variants with other column blocks; every output checked against the
fp32 reference, and every gather variant's CUDA-graph replays (three) checked bit-identical to its
eager output (the combine's program is picked by an atomic counter; the sums' order must not
depend on it). CUDA-graph replay, L2 flushed, min / median of interleaved rounds, as a fraction of
the HBM copy bandwidth for the touched slots' weights (as gpu_decode_floor.py).

    PYTHONPATH=. python3 benchmarks/gpu_gather_probe.py --out $OUT      (~4 min on the H200)
    python3 benchmarks/gpu_gather_probe.py --dry-run                    (interpreter: checks only)
"""
from __future__ import annotations

import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402  (shapes, weights, routing, graph capture, ceilings)
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup  # noqa: E402

CASES = ([("qwen3-30b-a3b", "int8", t) for t in (64, 32, 16, 7, 4)] + [("qwen3-30b-a3b", "bf16", t) for t in (16, 7, 4)]
         + [("mixtral-8x7b", d, 7) for d in ("int8", "bf16")])
# variants: (changes to the table's sorted config, the moe module's switches while the variant is
# called and captured). swap: the products formed transposed (weight tile @ rows^T: wgmma with the
# weights as its 64-row side instead of mma.sync on 16-row blocks); a8: two-level int8 activations
# on the int8 tensor cores (no weight conversion)
VARIANTS = {
    "sorted a8": (dict(a8=True), {}),
    "gather": (dict(gather=True, a8=False), {}),
    "gather swap": (dict(gather=True, a8=False, swap=True), {}),
}


def variants_for(dtype, t):
    """The variant names a case runs: a8 only for int8 weights at T >= 16 (where the weights'
    conversion may be what bounds the gate+up), swap only up to T=16."""
    return [vn for vn in VARIANTS
            if (vn != "sorted a8" or (dtype == "int8" and t >= 16)) and (vn != "gather swap" or t <= 16)]


DRY = dict(cases=[("tiny", "bf16", 5), ("tiny", "int8", 9)])


def gather_stage_times(torch, do_bench, M, x, ids, w, e2s, wts, cfg):
    """Median graph-replay us of the gather path's gate+up launch alone and of its down launch alone."""
    def t_us(fn):
        g, _ = B.graph_of(torch, fn)
        v = do_bench(g.replay, warmup=5, rep=20, return_mode="median") * 1e3
        del g
        return v

    cdt = M._compute_dtype(x.dtype, wts["w13"].dtype)
    e32 = e2s.to(torch.int32)
    hb, lists = M.gather_gate_up(x, wts["w13"], wts.get("w13_scale"), ids, e32, cfg, cdt)
    out = torch.empty_like(x)
    return dict(
        gate_up_us=t_us(lambda: M.gather_gate_up(x, wts["w13"], wts.get("w13_scale"), ids, e32, cfg, cdt)),
        down_us=t_us(lambda: M.gather_down(hb, lists, wts["w2"], wts.get("w2_scale"), w, ids, e32, out,
                                           cfg.for_down())))


def compiled_kernels():
    """Registers, spills and shared memory of every compiled kt.gpu_ops kernel (from Triton's caches;
    best effort: the cache layout is Triton's own)."""
    from kt.gpu_ops import _kernels as K
    rows = []
    for name in dir(K):
        fn = getattr(K, name)
        for dev_cache in getattr(fn, "device_caches", {}).values():
            cache = dev_cache[0] if isinstance(dev_cache, tuple) else dev_cache
            for key, ker in getattr(cache, "items", lambda: [])():
                try:
                    consts = getattr(getattr(ker, "src", None), "constants", None) or {}
                    short = {str(k[0] if isinstance(k, tuple) else k): v for k, v in dict(consts).items()
                             if str(k[0] if isinstance(k, tuple) else k).isupper()}
                    rows.append(dict(kernel=name, n_regs=getattr(ker, "n_regs", None),
                                     n_spills=getattr(ker, "n_spills", None),
                                     shared=getattr(ker.metadata, "shared", None),
                                     num_warps=getattr(ker.metadata, "num_warps", None),
                                     num_stages=getattr(ker.metadata, "num_stages", None),
                                     constants={k: v for k, v in short.items() if isinstance(v, (int, bool))}))
                except Exception as e:  # noqa: BLE001 - a report, not a check
                    rows.append(dict(kernel=name, error=repr(e)[:200]))
    return rows


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv, extra=[
        ("--cases", dict(default="", help="comma-separated shape:dtype:T (default: all)"))])
    dry = a.dry_run
    from dataclasses import replace

    import torch

    from kt import reference as R
    from kt.gpu_ops import MoEConfig, fused_moe, pick_config
    from kt.gpu_ops import configs as C
    from kt.gpu_ops import moe as M

    torch.backends.cuda.matmul.allow_tf32 = False
    table = {} if dry else M._device_table(torch.cuda.current_device())
    shapes = B.DRY_SHAPES if dry else B.SHAPES
    cases = DRY["cases"] if dry else CASES
    if a.cases:
        cases = [(n, d, int(t)) for n, d, t in (c.split(":") for c in a.cases.split(","))]
    res = {"cases": [], "ceilings": ceilings}
    made = {}
    t_start = time.time()
    for name, dtype, t in cases:
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
        with mock.patch.multiple(C, DIRECT_MAX_T=0, DIRECT_MAX_N=0):  # the sorted path's table entry
            sorted_cfg = pick_config(t, sh["K"], sh["S"], sh["H"], sh["I"], dtype, table)
        assert isinstance(sorted_cfg, MoEConfig)
        variants = {"sorted": sorted_cfg}
        switches = {"sorted": {}}
        for vn in (VARIANTS if dry else variants_for(dtype, t)):
            change, sw = VARIANTS[vn]
            if dtype != "int8" and change.get("a8"):
                continue
            variants[vn] = replace(sorted_cfg, **change)
            switches[vn] = sw
        case = dict(shape=name, dtype=dtype, T=t, bytes=nbytes, variants={})
        graphs = {}
        for vn, cfg in variants.items():
            def fn(cfg=cfg, sw=switches[vn]):
                with M._overriding(**sw):
                    return fused_moe(x, ids, w, e2s, **wts, config=cfg)
            case["variants"][vn] = v = dict(config=cfg.to_dict())
            try:
                eager = fn()
                v["rel_err"] = float(R.relative_error(eager, ref))
                if dry:
                    graphs[vn] = fn
                else:
                    g, g_out = B.graph_of(torch, fn)
                    same = []
                    for _ in range(3):
                        g.replay()
                        torch.cuda.synchronize()
                        same.append(bool(torch.equal(g_out, eager)))
                    v["replay_bit_identical"] = all(same)
                    graphs[vn] = g.replay
            except Exception as e:
                v["error"] = repr(e)[:400]
                if dry:
                    raise
                print(f"{name} {dtype} T={t} {vn}: {v['error']}", flush=True)
                continue
            assert v["rel_err"] <= 1e-2, (name, dtype, t, vn, v["rel_err"])
            assert v.get("replay_bit_identical", True), (name, dtype, t, vn)
        for vn, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            v = case["variants"][vn]
            v.update(min_us=mn, median_us=md)
            if not dry:
                v["hbm_frac"] = nbytes / (mn * 1e-6) / ceilings["hbm_bytes_per_s"]
        if not dry:
            for vn in graphs:
                cfg = variants[vn]
                with M._overriding(**switches[vn]):
                    case["variants"][vn]["stages"] = (
                        gather_stage_times(torch, do_bench, M, x, ids, w, e2s, wts, cfg) if cfg.gather
                        else B.stage_times(torch, do_bench, x, ids, w, e2s, wts, sh, cfg))
        res["cases"].append(case)
        timed = [(vn, v) for vn, v in case["variants"].items() if "min_us" in v]
        print(f"{name} {dtype} T={t} ({nbytes / 1e6:.1f} MB, {time.time() - t_start:.0f} s): "
              + ", ".join(f"{vn} {v['min_us']:.1f}/{v['median_us']:.1f} us"
                          + (f" ({100 * v['hbm_frac']:.0f} %)" if "hbm_frac" in v else "") for vn, v in timed),
              flush=True)
        if not dry:
            print("   stages (graph replay of each launch alone, median us; align / gate+up / down / combine): "
                  + ", ".join(f"{vn} " + " / ".join(f"{v['stages'].get(k, 0.0):.1f}" for k in
                                                   ("align_us", "gate_up_us", "down_us", "combine_us"))
                              for vn, v in case["variants"].items() if "stages" in v), flush=True)
        del graphs
        write_json(a.out, "gpu_gather_probe.json", res)  # (partial results survive a timeout)
    if not dry:
        res["kernels"] = compiled_kernels()
        for k in res["kernels"]:
            print("   ", k, flush=True)
    print(f"wrote {write_json(a.out, 'gpu_gather_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
