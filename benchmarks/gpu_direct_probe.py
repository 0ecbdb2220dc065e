#!/usr/bin/env python3
"""The direct (decode) path's two GEMV kernels, one kernel source against another. For one device call.

At T=1 mixtral int8 reached 47 % of HBM with a plain read of the same bytes at 82 % (session 11):
the gate+up (117 MB) took ~50 us and the down (59 MB) ~47 us whatever its tile. Both kernels
reduced their [block_n, block_k] products over k at every step (shuffles, and a block barrier when
block_k spans warps) and Triton did not pipeline their loops (no tl.dot in them). Session 15's
kernels sum elementwise and reduce once after the loop, convert int8 down weights through bf16
(byte permutes instead of I2F), take a ``num_stages`` for the k loop (tl.range) and give an
expert that is not on the GPU no trip through the down's loop. (A gate+up on two int8 levels of x
by dp4a, session 15 run 9, tied at mixtral int8 T=1 with its quantiser and lost at qwen3: removed.)

This probe times, per case (shape, weight dtype, T), each of the direct path's two kernels alone
through kt's own launchers (``moe.direct_gate_up`` / ``direct_down``), over a list of tiles; with ``--kernels NAME=FILE`` (an edited copy of
``kt/gpu_ops/_kernels.py`` whose kernels take the same arguments) that file's kernels too, on the
same tiles: CUDA-graph replay, L2 flushed, min / median of interleaved rounds
(``bench_gpu.interleaved_us``). Every variant's output is checked against the fp32 reference.
(Session 15's runs 2-3 compared older kernel files through a launcher of their own, since removed.)

    PYTHONPATH=. python3 benchmarks/gpu_direct_probe.py --out $OUT [--kernels edit=my_kernels.py]
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
# down_num_stages); stages 1 = the loop unpipelined
GU = [(4, 512, 4, 1), (4, 512, 4, 3), (8, 256, 4, 4), (2, 1024, 4, 4), (1, 1024, 2, 4), (4, 1024, 4, 3),
      (8, 512, 8, 3), (2, 512, 2, 4)]
DOWN = [(2, 1024, 2, 1), (2, 1024, 2, 3), (4, 1024, 4, 3), (8, 512, 4, 4), (16, 512, 8, 3), (4, 256, 2, 5),
        (8, 256, 4, 6)]
DRY = dict(cases=[("tiny", "int8", 1), ("tiny", "bf16", 1)],
           gu=[(4, 32, 4, 1), (4, 16, 4, 3)], down=[(2, 16, 2, 1), (4, 16, 2, 3)])


def _load(path):
    spec = importlib.util.spec_from_file_location("other_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _config(gu, dn):
    from kt.gpu_ops import DirectConfig

    return DirectConfig(gate_up="pairs", block_n=gu[0], block_k=gu[1], num_warps=gu[2], num_stages=gu[3],
                        down_block_n=dn[0], down_block_k=dn[1], down_num_warps=dn[2], down_num_stages=dn[3])


def _with_kernels(M, kern, fn):
    """fn() with kt's launchers pointed at the kernel module kern."""
    saved = M._kernels()
    M._kernels_mod = kern
    try:
        return fn()
    finally:
        M._kernels_mod = saved


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv, extra=[
        ("--kernels", dict(action="append", default=[], metavar="NAME=FILE",
                           help="an edited _kernels.py (same kernel arguments as kt's) to time beside kt's; "
                                "repeatable")),
        ("--cases", dict(default="", help="comma list of shape:dtype:T (default: CASES)"))])
    dry = a.dry_run
    import torch

    from kt import reference as R
    from kt.gpu_ops import moe as M

    sources = {"kt": M._kernels()}
    for spec in a.kernels:
        name, _, path = spec.partition("=")
        sources[name] = _load(path)
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
        w13, w2, s13, s2 = wts["w13"], wts["w2"], wts.get("w13_scale"), wts.get("w2_scale")
        ref = B.ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
        cdt = M._compute_dtype(x.dtype, w13.dtype)
        touched = len(B.touched_slots(B.gpu_slots(torch, ids, e2s)))
        gu_bytes = touched * w13[0].numel() * w13.element_size()
        dn_bytes = touched * w2[0].numel() * w2.element_size()
        out = torch.empty_like(x)
        fns, errs = {}, {}
        for src, k in sources.items():
            for gu in gus:
                cfg = _config(gu, downs[0])
                lab = f"{src} gate+up {gu}"
                fns[lab] = (lambda k=k, cfg=cfg: _with_kernels(
                    M, k, lambda: M.direct_gate_up(x, w13, s13, ids, e32, cfg, cdt)))
                h = fns[lab]()  # every gate+up tile checked through the first down tile
                errs[lab] = R.relative_error(_with_kernels(M, k, lambda: M.direct_down(
                    h, w2, s2, w, ids, e32, out, cfg)).float(), ref)
            h0 = _with_kernels(M, k, lambda: M.direct_gate_up(x, w13, s13, ids, e32, _config(gus[0], downs[0]), cdt))
            for dn in downs:
                cfg = _config(gus[0], dn)
                lab = f"{src} down {dn}"
                fns[lab] = (lambda k=k, cfg=cfg, h0=h0: _with_kernels(
                    M, k, lambda: M.direct_down(h0, w2, s2, w, ids, e32, out, cfg)))
                errs[lab] = R.relative_error(fns[lab]().float(), ref)
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
