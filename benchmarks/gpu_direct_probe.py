#!/usr/bin/env python3
"""The direct (decode) path's two GEMV kernels, one kernel source against another. For one device call.

At T=1 mixtral int8 reached 47 % of HBM with a plain read of the same bytes at 82 % (session 11):
the gate+up (117 MB) took ~50 us and the down (59 MB) ~47 us whatever its tile. Both kernels
reduced their [block_n, block_k] products over k at every step (shuffles, and a block barrier when
block_k spans warps) and Triton did not pipeline their loops (no tl.dot in them). Session 15's
kernels sum elementwise and reduce once after the loop, convert int8 down weights through bf16
(byte permutes instead of I2F) and take a ``num_stages`` for the k loop (tl.range).

This probe times, per case (shape, weight dtype, T), each of the direct path's two kernels alone, for
kt's kernels over a list of tiles and, with ``--kernels NAME=FILE`` (a copy of
an older or changed ``kt/gpu_ops/_kernels.py``), that file's kernels on the same tiles (only the
unpipelined ones where its kernels take no stages): CUDA-graph replay, L2 flushed, min / median of
interleaved rounds (``bench_gpu.interleaved_us``). Every variant's output is checked against the fp32 reference.

    PYTHONPATH=. python3 benchmarks/gpu_direct_probe.py --out $OUT --kernels base=old_kernels.py
    python3 benchmarks/gpu_direct_probe.py --dry-run              (interpreter, tiny shape)
"""
from __future__ import annotations

import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup  # noqa: E402

CASES = [("mixtral-8x7b", "int8", 1), ("mixtral-8x7b", "bf16", 1), ("qwen3-30b-a3b", "int8", 1),
         ("qwen3-30b-a3b", "bf16", 1)]
# gate+up (block_n, block_k, num_warps, stages), down (down_block_n, down_block_k, down_num_warps,
# stages); stages 1 = the loop unpipelined (the only kind a kernel file without stages runs). The narrow,
# deep tiles read longer contiguous runs of each weight row per step.
GU = [(4, 512, 4, 1), (4, 1024, 4, 1), (4, 2048, 8, 1), (4, 512, 4, 3), (8, 256, 4, 4), (2, 512, 2, 4),
      (8, 512, 8, 3), (1, 2048, 4, 3), (2, 2048, 8, 3), (1, 4096, 8, 2), (2, 1024, 4, 4), (1, 1024, 2, 4)]
DOWN = [(2, 1024, 2, 1), (4, 1024, 4, 1), (2, 1024, 2, 3), (4, 1024, 4, 3), (8, 512, 4, 4), (16, 512, 8, 3),
        (1, 2048, 4, 3), (2, 2048, 8, 3), (1, 2048, 2, 4), (1, 4096, 8, 2), (2, 2048, 4, 4), (1, 1024, 2, 4),
        (4, 2048, 8, 3)]
DRY = dict(cases=[("tiny", "int8", 1), ("tiny", "bf16", 1)], gu=[(4, 32, 4, 1), (4, 16, 4, 3)],
           down=[(2, 16, 2, 1), (4, 16, 2, 3)])


def _load(path):
    spec = importlib.util.spec_from_file_location("base_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _launch(fn, grid, args, consts, warps, stages):
    """fn[grid](*args, **consts) with the constants fn has (an older source may lack STAGES)."""
    fn[grid](*args, **{k: v for k, v in consts.items() if k in fn.arg_names}, num_warps=warps,
             num_stages=stages)


def gate_up(kern, M, x, w13, s13, ids, e2s, h, cfg, cdt):
    bn, bk, warps, stages = cfg
    n = ids.numel()
    s, two_i, hid = w13.shape
    inter = two_i // 2
    int8w = w13.dtype.itemsize == 1
    s13v = s13 if int8w else w13
    _launch(kern.gate_up_pairs_kernel, (n, -(-inter // bn)),
            (x, w13, s13v, h, ids, e2s, e2s.numel(), s, hid, inter, ids.shape[1], x.stride(0), x.stride(1),
             w13.stride(0), w13.stride(1), w13.stride(2), *((s13.stride(0), s13.stride(1)) if int8w else (0, 0)),
             h.stride(0), h.stride(1)),
            dict(BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, INT8_W=int8w, CT=M._CT[cdt],
                 UPCAST=M.kernels_interpreted()), warps, stages)
    return h


def down(kern, M, h, w2, s2, w, ids, e2s, out, cfg):
    bn, bk, warps, stages = cfg
    t, top_k = ids.shape
    s, hid, inter = w2.shape
    int8w = w2.dtype.itemsize == 1
    s2v = s2 if int8w else w2
    rw = w.reshape(-1).float().contiguous()
    _launch(kern.down_tokens_kernel, (t, -(-hid // bn)),
            (h, w2, s2v, out, rw, ids, e2s, e2s.numel(), s, hid, inter, h.stride(0), h.stride(1),
             w2.stride(0), w2.stride(1), w2.stride(2), *((s2.stride(0), s2.stride(1)) if int8w else (0, 0)),
             out.stride(0), out.stride(1)),
            dict(TOP_K=top_k, KP=M._np2k(top_k), BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, INT8_W=int8w,
                 UPCAST=M.kernels_interpreted()),
            warps, 1)
    return out


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv, extra=[
        ("--kernels", dict(action="append", default=[], metavar="NAME=FILE",
                           help="another _kernels.py to time beside kt's (only the stages-1 tiles where its "
                                "kernels take no STAGES); repeatable")),
        ("--cases", dict(default="", help="comma list of shape:dtype:T (default: CASES)"))])
    dry = a.dry_run
    import torch

    from kt import reference as R
    from kt.gpu_ops import moe as M

    kern = M._kernels()
    sources = {"kt": kern}
    for spec in a.kernels:
        name, _, path = spec.partition("=")
        sources[name] = _load(path)
    staged = {src: "STAGES" in k.down_tokens_kernel.arg_names for src, k in sources.items()}
    cases, gus, downs = (DRY["cases"], DRY["gu"], DRY["down"]) if dry else (CASES, GU, DOWN)
    if a.cases:
        cases = [(n, d, int(t)) for n, d, t in (c.split(":") for c in a.cases.split(","))]
    shapes = B.DRY_SHAPES if dry else B.SHAPES
    res = dict(ceilings=ceilings, cases=[])
    for name, dtype, t in cases:
        sh = shapes[name]
        e2s, x, ids, w, _ = B.op_inputs(torch, sh, t, dev, 3 + t, 4 + t)
        e32 = e2s.to(torch.int32)
        wts, (w13f, w2f) = B.make_weights(torch, sh, dtype, dev, 2)
        ref = B.ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
        cdt = M._compute_dtype(x.dtype, wts["w13"].dtype)
        slots = torch.where(ids >= 0, e2s[ids.clamp(min=0)], -1)
        touched = int(torch.unique(slots[slots >= 0]).numel())
        gu_bytes = touched * wts["w13"][0].numel() * wts["w13"].element_size()
        dn_bytes = touched * wts["w2"][0].numel() * wts["w2"].element_size()
        h = torch.zeros(ids.numel(), sh["I"], dtype=cdt, device=dev)
        out = torch.empty_like(x)
        fns, errs = {}, {}
        for src, k in sources.items():
            for cfg in gus:
                if cfg[3] != 1 and not staged[src]:
                    continue
                lab = f"{src} gate+up {cfg}"
                fns[lab] = (lambda k=k, cfg=cfg: gate_up(k, M, x, wts["w13"], wts.get("w13_scale"), ids, e32, h,
                                                         cfg, cdt))
            gate_up(k, M, x, wts["w13"], wts.get("w13_scale"), ids, e32, h, gus[0], cdt)
            h_ok = h.clone()
            for cfg in downs:
                if cfg[3] != 1 and not staged[src]:
                    continue
                lab = f"{src} down {cfg}"
                fns[lab] = (lambda k=k, cfg=cfg, hh=h_ok: down(k, M, hh, wts["w2"], wts.get("w2_scale"), w, ids,
                                                              e32, out, cfg))
                o = down(k, M, h_ok, wts["w2"], wts.get("w2_scale"), w, ids, e32, out, cfg)
                errs[lab] = R.relative_error(o.float(), ref)
            for cfg in gus:  # every gate+up tile checked through the first down tile
                if cfg[3] != 1 and not staged[src]:
                    continue
                h.zero_()
                gate_up(k, M, x, wts["w13"], wts.get("w13_scale"), ids, e32, h, cfg, cdt)
                o = down(k, M, h, wts["w2"], wts.get("w2_scale"), w, ids, e32, out, downs[0])
                errs[f"{src} gate+up {cfg}"] = R.relative_error(o.float(), ref)
        bad = {k: v for k, v in errs.items() if not v <= 1e-2}
        if bad:
            raise SystemExit(f"{name} {dtype} T={t}: outputs off the reference: {bad}")
        if dry:
            timed = {k: B.min_median_us(None, f, True) for k, f in fns.items()}
        else:
            graphs = {k: B.graph_of(torch, f)[0] for k, f in fns.items()}
            timed = B.interleaved_us(do_bench, {k: g.replay for k, g in graphs.items()}, a.rounds)
            del graphs
        rows = []
        for lab, (mn, med) in timed.items():
            nbytes = gu_bytes if " gate+up " in lab else dn_bytes
            frac = nbytes / (mn * 1e-6) / ceilings["hbm_bytes_per_s"] if ceilings else None
            rows.append(dict(variant=lab, min_us=mn, median_us=med, rel_err=errs[lab], hbm_fraction=frac))
            print(f"{name} {dtype} T={t} {lab:36s} {mn:7.1f} / {med:7.1f} us  err {errs[lab]:.1e}"
                  + (f"  HBM {frac * 100:5.1f} %" if frac else ""), flush=True)
        res["cases"].append(dict(shape=name, dtype=dtype, T=t, touched_slots=touched, gate_up_bytes=gu_bytes,
                                 down_bytes=dn_bytes, rows=rows))
        if not dry:
            del wts, w13f, w2f
            torch.cuda.empty_cache()
    if not dry:
        print("wrote", write_json(a.out, "gpu_direct_probe.json", res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
