#!/usr/bin/env python3
"""Experiment: the sorted path's weights in tile-major order (each kernel tile one contiguous run of
memory) against row-major, at decode sizes; for one device call.

The decode GEMMs read their weight tiles as BLOCK_N rows x BLOCK_K bytes per k step, rows H (or I)
elements apart: 128-256 contiguous bytes per row per step. ``moe.tile_major`` stores each (column
block, k block) tile contiguously ([S, R/BLOCK_N, C/BLOCK_K, BLOCK_N, BLOCK_K]), so a program's k
step is one 8-32 KB run. Each case: the table's sorted config (pointer loads: TMA off), the four
launches of the sorted path (alignment, gate+up, down, combine) with row-major or tile-major
weights, each GEMM also alone; h, y and the output checked bit-identical; CUDA-graph replays, L2
flushed, interleaved rounds, min / median us.

    PYTHONPATH=. python3 benchmarks/gpu_tiled_probe.py --out $OUT
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup  # noqa: E402

CASES = ([("qwen3-30b-a3b", "int8", t) for t in (7, 16, 64, 128)]
         + [("qwen3-30b-a3b", "bf16", t) for t in (7, 64)] + [("mixtral-8x7b", "int8", t) for t in (7, 64)])
DRY_CASES = [("tiny", "bf16", 5), ("tiny", "int8", 9)]


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv)
    dry = a.dry_run
    import torch

    from kt.gpu_ops import moe as M

    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"cases": [], "ceilings": ceilings}
    table = {} if dry else M._device_table(torch.cuda.current_device())
    shapes = B.DRY_SHAPES if dry else B.SHAPES
    made = {}
    for name, dtype, t in (DRY_CASES if dry else CASES):
        sh = shapes[name]
        wts, e2s, x, ids, w, nbytes, ref, cfg = B.decode_case(torch, shapes, made, name, dtype, t, dev, table)
        cfg = replace(cfg, tma=False, a8=False)
        if dry:  # (tiles that divide the tiny shape)
            cfg = replace(cfg, block_n=16, block_k=32, down_block_n=16, down_block_k=16)
        dcfg = cfg.for_down()
        if sh["I"] % cfg.block_n or sh["H"] % cfg.block_k or sh["H"] % dcfg.block_n or sh["I"] % dcfg.block_k:
            print(f"skip {name} {dtype} T={t}: tiles do not divide the shape", flush=True)
            continue
        w13t = M.tile_major(wts["w13"], cfg.block_n, cfg.block_k)
        w2t = M.tile_major(wts["w2"], dcfg.block_n, dcfg.block_k)
        k = ids.shape[1]
        cdt = M._compute_dtype(x.dtype, wts["w13"].dtype)
        programs = M._INTERPRETER_PROGRAMS if dry else M._PROGRAMS_PER_SM * M._num_sms(0)
        al = cfg.align_m
        srt = M.sorted_h_for(dcfg)
        ydt = M.y_dtype_for(x.dtype)
        slot32, sid, bsl, npad = M.align_by_slot(ids, e2s, sh["S"], al)

        def op(tiled):
            s32, si, bs, npd = M.align_by_slot(ids, e2s, sh["S"], al)
            hb = M.gate_up(x, wts["w13"], wts.get("w13_scale"), si, bs, npd, k, cfg, cdt, programs, al, srt,
                           w13t=w13t if tiled else None)
            yy = M.down(hb, wts["w2"], wts.get("w2_scale"), w, si, bs, npd, dcfg, programs, ydt, al, srt,
                        w2t=w2t if tiled else None)
            out = torch.empty_like(x)
            M.combine(yy, s32, out)
            return out

        hb = {tl_: M.gate_up(x, wts["w13"], wts.get("w13_scale"), sid, bsl, npad, k, cfg, cdt, programs, al, srt,
                             w13t=w13t if tl_ else None) for tl_ in (False, True)}
        rows = (slot32 >= 0).nonzero().flatten()
        assert torch.equal(hb[False][rows], hb[True][rows]), "gate+up: tile-major differs"
        yy = {tl_: M.down(hb[False], wts["w2"], wts.get("w2_scale"), w, sid, bsl, npad, dcfg, programs, ydt, al, srt,
                          w2t=w2t if tl_ else None) for tl_ in (False, True)}
        assert torch.equal(yy[False][rows], yy[True][rows]), "down: tile-major differs"
        outs = {tl_: op(tl_) for tl_ in (False, True)}
        assert torch.equal(outs[False], outs[True]), "op: tile-major differs"
        fns = {}
        for tl_ in (False, True):
            lab = "tiled" if tl_ else "rows"
            fns[f"op {lab}"] = (lambda tl_=tl_: op(tl_))
            fns[f"gate_up {lab}"] = (lambda tl_=tl_: M.gate_up(x, wts["w13"], wts.get("w13_scale"), sid, bsl, npad, k,
                                                              cfg, cdt, programs, al, srt,
                                                              w13t=w13t if tl_ else None))
            fns[f"down {lab}"] = (lambda tl_=tl_: M.down(hb[False], wts["w2"], wts.get("w2_scale"), w, sid, bsl, npad,
                                                        dcfg, programs, ydt, al, srt, w2t=w2t if tl_ else None))
        graphs = {kk: (f if dry else B.graph_of(torch, f)[0].replay) for kk, f in fns.items()}
        case = dict(shape=name, dtype=dtype, T=t, bytes=nbytes, config=cfg.to_dict(), timings={})
        for kk, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            case["timings"][kk] = dict(min_us=mn, median_us=md)
            if not dry and kk.startswith("op"):
                case["timings"][kk]["hbm_frac"] = nbytes / (mn * 1e-6) / ceilings["hbm_bytes_per_s"]
        res["cases"].append(case)
        print(f"{name} {dtype} T={t} ({nbytes / 1e6:.1f} MB): " + ", ".join(
            f"{kk} {v['min_us']:.1f}/{v['median_us']:.1f}" for kk, v in case["timings"].items()), flush=True)
        del graphs, w13t, w2t
        write_json(a.out, "gpu_tiled_probe.json", res)
    print(f"wrote {write_json(a.out, 'gpu_tiled_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
