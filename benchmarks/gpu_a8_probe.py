#!/usr/bin/env python3
"""The a8 path's fixed costs at prefill sizes: the activation quantiser (``moe.act_quant2``) and the
slot alignment (``moe.align_by_slot``), each against variants, and the whole int8 op with each; for
one device call.

Session 12 measured ``act_quant2`` at 20-26 us for qwen3 T=4096 (twice its HBM time): most of its
~50 instructions per element were the rounding (floor, where, negations for "half away from zero")
and the NaN guards. Session 13 (these variants, results/gpu_s13_run*_a8_probe.json) moved kt to
round-to-nearest-even by adding and subtracting 1.5 * 2**23 and dropped the per-code NaN guard
(15.7 us). Variants, each checked against ``kt.reference.quantize_act2`` first (level-1 codes at
most one apart, a few; level-2 within the GPU's fused-residual difference where level 1 agrees;
reconstruction within half a level-2 step):
- ``kt``: ``moe.act_quant2`` as shipped;
- ``rne``: the probe's own one-pass kernel with the same rounding;
- ``rne_nan1``: rne with the NaN guard only on the row maximum.
Each variant is timed at several rows per program (CUDA-graph replay, L2 flushed, min / median of
interleaved rounds) for x [T, H] at H=2048 (qwen3) T=512 / 4096, H=4096 (mixtral) and H=7168
(DeepSeek-V3) at T=4096, as a fraction of its bytes' HBM time. Then the alignment's paths (one
program per slot up to N=4096, one program, two launches, four with atomics) over N and S; then ``fused_moe`` at qwen3 T=4096 with
int8 weights (the table's a8 config, each quantiser; the four-launch alignment) and bf16 weights
(either alignment), as a fraction of the bf16 matmul rate measured in the same run (issue 6's
"T=4096 at >= 40 %").

    PYTHONPATH=. python3 benchmarks/gpu_a8_probe.py --out $OUT        (~1 min on the H200)
    python3 benchmarks/gpu_a8_probe.py --dry-run                       (interpreter: checks only)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402  (shapes, weights, routing, graph capture, ceilings)
from _results import write_json  # noqa: E402

VARIANTS = {"kt": None, "rne": (True, True), "rne_nan1": (True, False)}  # (RNE rounding, NaN guard per code)
ELEMS = (2048, 4096, 8192)  # elements per program (whole rows)
X_CASES = [("qwen3-30b-a3b", 2048, 512), ("qwen3-30b-a3b", 2048, 4096), ("mixtral-8x7b", 4096, 4096),
           ("deepseek-v3", 7168, 4096)]
DRY_X_CASES = [("tiny", 64, 5), ("tiny", 96, 33)]
# (shape, (E, K, GPU slots), T, rows per block): the table's align_m at qwen3 int8 T=4096 is 128
ALIGN_CASES = [("qwen3-30b-a3b", (128, 8, 32), t, bm) for t, bm in ((64, 16), (128, 64), (512, 64), (1024, 128),
                                                                    (4096, 128))] + [
    ("mixtral-8x7b", (8, 2, 4), 4096, 128), ("deepseek-v3", (256, 8, 64), 4096, 128),
    ("qwen3-30b-a3b-all-gpu", (128, 8, 128), 4096, 64)]
ALIGN_DRY_CASES = [("tiny", (8, 2, 4), 33, 16), ("tiny", (8, 2, 4), 300, 32)]


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def code(v, RNE: tl.constexpr, GUARD: tl.constexpr):
        """One level's int8 codes of v (|v| <= 127 here: far below 2**22, where the two adds round
        to the nearest even integer) or, without RNE, rounded half away from zero (kt before session 13)."""
        if RNE:
            r = (v + 12582912.0) - 12582912.0
        else:
            r = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
        r = tl.minimum(tl.maximum(r, -127.0), 127.0)
        if GUARD:
            r = tl.where(r == r, r, 0.0)
        return r

    # a jitted kernel finds its helpers among its module's globals, and triton must be imported
    # after TRITON_INTERPRET is set: so the helper is made here and published there
    globals()["_code"] = code

    @triton.jit
    def quant2_kernel(x_ptr, q_ptr, s_ptr, T, H, stride_xt, stride_ql, ROWS: tl.constexpr,
                      BLOCK_H: tl.constexpr, RNE: tl.constexpr, GUARD: tl.constexpr):
        """moe.act_quant2's one-pass body (whole rows in registers) with the rounding switches."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        r_ok = rows < T
        rows64 = tl.where(r_ok, rows, 0).to(tl.int64)
        offs = tl.arange(0, BLOCK_H)
        m = r_ok[:, None] & (offs < H)[None, :]
        v = tl.load(x_ptr + rows64[:, None] * stride_xt + offs[None, :], mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.where(v == v, tl.abs(v), float("inf")), 1)
        s1 = amax / 127.0
        inv1 = tl.where(amax > 0, 127.0 / amax, 0.0)
        q1 = _code(v * inv1[:, None], RNE, GUARD)  # noqa: F821 (published by _kernels)
        r = v - q1 * s1[:, None]
        amax2 = tl.max(tl.abs(r), 1)
        s2 = amax2 / 127.0
        inv2 = tl.where(amax2 > 0, 127.0 / amax2, 0.0)
        q2 = _code(r * inv2[:, None], RNE, GUARD)  # noqa: F821
        q_row = q_ptr + rows64[:, None] * H + offs[None, :]
        tl.store(q_row, q1.to(tl.int8), mask=m)
        tl.store(q_row + stride_ql, q2.to(tl.int8), mask=m)
        tl.store(s_ptr + 2 * rows64, s1, mask=r_ok)
        tl.store(s_ptr + 2 * rows64 + 1, s2, mask=r_ok)

    return quant2_kernel


def _variant_fn(torch, kernel, rne, guard, elems, warps):
    """An act_quant2 replacement (x [T, H] contiguous rows, H <= elems) -> (q [2, T, H], s [T, 2])."""
    def fn(x):
        t, h = x.shape
        q = torch.empty((2, t, h), dtype=torch.int8, device=x.device)
        s = torch.empty((t, 2), dtype=torch.float32, device=x.device)
        bh = max(16, 1 << (h - 1).bit_length())
        assert bh <= elems and x.stride(1) == 1, (h, elems, x.stride())
        rows = min(elems // bh, max(1, 1 << (t - 1).bit_length()))
        kernel[(-(-t // rows),)](x, q, s, t, h, x.stride(0), q.stride(0), ROWS=rows, BLOCK_H=bh, RNE=rne,
                                 GUARD=guard, num_warps=warps)
        return q, s
    return fn


def _check(R, np, x, q, s):
    """Codes and scales against kt.reference.quantize_act2; returns the level-1 code mismatches."""
    xf = R.to_numpy_f32(x.cpu())
    q1, s1, q2, s2 = R.quantize_act2(xf)
    q, s = q.cpu().numpy().astype(np.int32), s.cpu().numpy()
    assert np.allclose(s[:, 0], s1, rtol=1e-6, atol=0) and np.allclose(s[:, 1], s2, rtol=5e-3, atol=0)
    d1 = np.abs(q[0] - q1)
    # where a level-1 code rounds the other way (a tie, or the GPU's fused multiply landing on the
    # other side of one), the residual changes sign and its level-2 code is a different number
    # altogether: level 2 is compared only where level 1 agrees (the reconstruction check covers all)
    d2 = np.where(d1 == 0, np.abs(q[1] - q2), 0)
    assert d1.max() <= 1 and d2.max() <= 1 and (d2 > 0).mean() <= 2e-2, (d1.max(), d2.max(), (d2 > 0).mean())
    recon = s[:, 0:1] * q[0] + s[:, 1:2] * q[1]
    assert np.all(np.abs(xf - recon) <= 0.5 * s[:, 1:2] + 1e-6 * np.abs(xf).max(axis=1, keepdims=True))
    return int((d1 > 0).sum())


def _align_layout(torch, out, n, bm):
    """What any correct alignment must agree on: the token-slot -> slot map, the rows in use, and
    per slot the set of its token-slots (a sorted tuple)."""
    slot, sorted_ids, block_slot, num_padded = [v.cpu() for v in out]
    used = int(num_padded[0])
    rows = sorted_ids[:used].reshape(-1, bm)
    per_slot = {}
    for b in range(rows.shape[0]):
        per_slot.setdefault(int(block_slot[b]), []).extend(r for r in rows[b].tolist() if r < n)
    return slot.tolist(), used, {k: tuple(sorted(v)) for k, v in per_slot.items()}


def align_case(torch, do_bench, dev, label, e, k, ns, t, bm, paths, rounds, dry):
    """One alignment case: routing of T tokens over E experts (K each, ns on the GPU), then
    ``align_by_slot`` on each path (forced at each capture: the path is fixed when a graph is
    captured), every layout checked against the first path's, timed in interleaved rounds (min /
    median us). paths: a function of (N, ns). Prints a line; returns the case's record."""
    from kt.gpu_ops import moe as M

    sh = dict(E=e, K=k, S=ns)
    e2s = B.make_e2s(torch, sh, dev, 3)
    ids, _ = B.make_routing(torch, sh, t, e2s, dev, 5 + t)
    n = ids.numel()
    case = dict(shape=label, E=e, K=k, S=ns, T=t, N=n, block_m=bm, variants={})
    graphs, ref = {}, None
    for path in paths(n, ns):
        with M._forced_align(path):
            lay = _align_layout(torch, M.align_by_slot(ids, e2s, ns, bm), n, bm)
            ref = ref or lay
            assert lay == ref, (label, t, path)
            fn = lambda: M.align_by_slot(ids, e2s, ns, bm)  # noqa: E731
            graphs[path] = fn if dry else B.graph_of(torch, fn)[0].replay
    for path, (mn, md) in B.interleaved_us(do_bench, graphs, rounds, dry).items():
        case["variants"][path] = dict(min_us=mn, median_us=md)
    print(f"align {label} T={t} N={n} S={ns} block_m={bm}: " + ", ".join(
        f"{p} {v['min_us']:.1f}/{v['median_us']:.1f} us" for p, v in case["variants"].items()), flush=True)
    return case


def probe_setup(doc, argv, extra=()):
    """The probe's start: parse --out / --rounds / --dry-run (and ``extra``: (flag, add_argument
    keywords) pairs), switch the interpreter on for a dry run (before triton is first imported),
    measure the ceilings on a GPU. Returns (args, do_bench or None, device, ceilings or None)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes under the Triton interpreter, no timings")
    for flag, kw in extra:
        ap.add_argument(flag, **kw)
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        return a, None, "cpu", None
    import torch
    from triton.testing import do_bench

    ceil = B.Results(None)
    B.part_ceilings(torch, do_bench, ceil)
    return a, do_bench, "cuda", ceil.data["ceilings"]


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv)
    dry = a.dry_run
    import numpy as np
    import torch

    from kt import reference as R
    from kt.gpu_ops import fused_moe
    from kt.gpu_ops import moe as M

    kernel = _kernels()
    res = {"x_cases": [], "align": [], "fused": [], "ceilings": ceilings}

    def replay(fn):
        return fn if dry else B.graph_of(torch, fn)[0].replay

    fns = {}  # (variant, elems, warps) -> quantiser
    shipped = M.act_quant2
    for name, rne_guard in VARIANTS.items():
        for elems in ELEMS:
            for warps in (4, 8):
                if rne_guard is None:
                    def fn(x, elems=elems, warps=warps):
                        return shipped(x, elems, warps)
                else:
                    fn = _variant_fn(torch, kernel, *rne_guard, elems, warps)
                fns[(name, elems, warps)] = fn
    for label, h, t in (DRY_X_CASES if dry else X_CASES):
        g = torch.Generator(device=dev).manual_seed(h + t)
        x = (torch.randn(t, h, device=dev, generator=g) * torch.logspace(-2, 2, t, device=dev)[:, None]
             ).to(torch.bfloat16)
        case = dict(shape=label, H=h, T=t, bytes=3 * t * h, variants={})
        ok = {k: fn for k, fn in fns.items() if h <= k[1]}
        for k, fn in ok.items():
            case["variants"]["/".join(map(str, k))] = dict(code1_mismatches=_check(R, np, x, *fn(x)))
        graphs = {k: replay(lambda fn=fn: fn(x)) for k, fn in ok.items()}
        for k, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            case["variants"]["/".join(map(str, k))].update(min_us=mn, median_us=md)
        for v in case["variants"].values():
            if not dry:
                v["hbm_frac"] = case["bytes"] / (v["min_us"] * 1e-6) / res["ceilings"]["hbm_bytes_per_s"]
        best = {}
        for k in ok:
            kk = "/".join(map(str, k))
            if k[0] not in best or case["variants"][kk]["min_us"] < case["variants"][best[k[0]]]["min_us"]:
                best[k[0]] = kk
        case["best"] = best
        res["x_cases"].append(case)
        print(f"{label} H={h} T={t}: " + ", ".join(f"{n} {case['variants'][kk]['min_us']:.1f} us ({kk}, "
                                                      f"{case['variants'][kk]['code1_mismatches']} level-1 codes off)"
                                                      for n, kk in best.items()), flush=True)
        del graphs

    # the slot alignment's paths over N and S (align_by_slot picks one by N and S), each checked
    # against the others (same rows in use, same token-slots in the same slots' blocks)
    def paths(n, ns):
        return (["per_slot"] if n <= 4096 else []) + ["two_launch", "atomics"] + (["one_program"] if n <= 8192 else [])

    for label, (e, k, ns), t, bm in (ALIGN_DRY_CASES if dry else ALIGN_CASES):
        res["align"].append(align_case(torch, do_bench, dev, label, e, k, ns, t, bm, paths, a.rounds, dry))

    # the whole int8 op with each variant's best quantiser at qwen3 T=4096 (the dry run: tiny, T=33)
    sh = B.DRY_SHAPES["tiny"] if dry else B.SHAPES["qwen3-30b-a3b"]
    t = 33 if dry else 4096
    e2s, x, ids, w, flops = B.op_inputs(torch, sh, t, dev, 7, 4 + t)
    last = next(c for c in res["x_cases"][::-1] if c["H"] == sh["H"]) if not dry else res["x_cases"][-1]
    chosen = {n: tuple(int(p) if p.isdigit() else p for p in kk.split("/")) for n, kk in last["best"].items()}
    # (row name, weights, quantiser, alignment): each quantiser with the shipped alignment, and the
    # shipped quantiser with the previous alignment, for int8; bf16 with either alignment
    plan = [(n, "int8", k, None) for n, k in chosen.items()]
    plan += [("kt+atomics_align", "int8", chosen["kt"], "atomics"),
             ("bf16", "bf16", None, None), ("bf16+atomics_align", "bf16", None, "atomics")]
    graphs, rows, made = {}, {}, {}
    try:
        for n, wname, k, al in plan:
            if wname not in made:
                made[wname] = B.make_weights(torch, sh, wname, dev, 2)
            wts, (w13f, w2f) = made[wname]
            if ("ref", wname) not in made:
                made[("ref", wname)] = B.ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
            cfg = M._default_config(t, sh["K"], sh["S"], sh["H"], sh["I"], wname, -1 if dry else 0)
            if dry and wname == "int8":  # the interpreter has no table: force the a8 path
                cfg = M.MoEConfig(block_m=16, block_n=16, block_k=64, a8=True)
            M.act_quant2 = fns[k] if k else shipped
            with M._forced_align(al) if al else contextlib.nullcontext():
                err = float(R.relative_error(fused_moe(x, ids, w, e2s, **wts, config=cfg), made[("ref", wname)]))
                graphs[n] = replay(lambda wts=wts, cfg=cfg: fused_moe(x, ids, w, e2s, **wts, config=cfg))
            rows[n] = dict(weights=wname, quantiser="/".join(map(str, k)) if k else None, align=al or "shipped",
                           config=cfg.to_dict(), rel_err=err)
        for n, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            rows[n].update(min_us=mn, median_us=md)
    finally:
        M.act_quant2 = shipped
    for n, r in rows.items():
        if not dry:
            r["bf16_peak_frac"] = flops / (r["min_us"] * 1e-6) / res["ceilings"]["bf16_flops_per_s"]
        res["fused"].append(dict(variant=n, **r))
        print(f"fused_moe {r['weights']} T={t} {n}: {r['min_us']:.1f} us"
              + (f" ({100 * r['bf16_peak_frac']:.1f} % of the bf16 rate)" if not dry else "")
              + f", rel err {r['rel_err']:.2e}", flush=True)
    bad = [r for r in rows.values() if r["rel_err"] > 1e-2]
    if not dry:
        print(f"wrote {write_json(a.out, 'gpu_a8_probe.json', res)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
