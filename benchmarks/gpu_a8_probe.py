#!/usr/bin/env python3
"""Where the a8 path's activation quantiser (``moe.act_quant2``) spends its time, and what the whole
int8 op would gain from a cheaper one: a probe with its own variants, for one device call.

On the H200 (session 12) ``act_quant2`` took 20-26 us for qwen3 T=4096 (16 MB in, 16 MB out: twice
its HBM time) and no launch shape helped. Counted per element it issues about 50 instructions, most
of them in the rounding (floor, where, negations for "half away from zero", twice) and the NaN
guards: at the H200's issue rate that alone is ~12 us for 8M elements. Variants, each checked
against ``kt.reference.quantize_act2`` first (level-1 codes at most one apart, a few; level-2 within
the GPU's fused-residual difference; reconstruction within half a level-2 step):
- ``kt``: ``moe.act_quant2`` as shipped;
- ``rne``: the same kernel with round-to-nearest-even by adding and subtracting 1.5 * 2**23 (two
  adds per code; the reference's own rounding mode);
- ``rne_nan1``: rne with the NaN guard only on the row maximum (a NaN row's codes are whatever the
  rounding gives; its scale is Inf, so its outputs are NaN either way).
Each variant is timed at several rows per program (CUDA-graph replay, L2 flushed, min / median of
interleaved rounds) for x [T, H] at H=2048 (qwen3) T=512 / 4096, H=4096 (mixtral) and H=7168
(DeepSeek-V3) at T=4096, as a fraction of its bytes' HBM time; then ``fused_moe`` at qwen3 int8
T=4096 (the table's a8 config) with ``moe.act_quant2`` replaced by each variant's best shape, as a
fraction of the bf16 matmul rate measured in the same run (issue 6's "T=4096 at >= 40 %").

    PYTHONPATH=. python3 benchmarks/gpu_a8_probe.py --out $OUT        (~1 min on the H200)
    python3 benchmarks/gpu_a8_probe.py --dry-run                       (interpreter: checks only)
"""
from __future__ import annotations

import argparse
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


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def code(v, RNE: tl.constexpr, GUARD: tl.constexpr):
        """One level's int8 codes of v (|v| <= 127 here: far below 2**22, where the two adds round
        to the nearest even integer) or, without RNE, rounded half away from zero as kt does."""
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
    d2 = np.abs(q[1] - q2)
    assert d1.max() <= 1 and d2.max() <= 1 and (d2 > 0).mean() <= 2e-2, (d1.max(), d2.max(), (d2 > 0).mean())
    recon = s[:, 0:1] * q[0] + s[:, 1:2] * q[1]
    assert np.all(np.abs(xf - recon) <= 0.5 * s[:, 1:2] + 1e-6 * np.abs(xf).max(axis=1, keepdims=True))
    return int((d1 > 0).sum())


time_us = B.min_median_us  # (the a8 down probe imports it from here too)


def probe_setup(doc, argv):
    """The a8 probes' common start: parse --out / --rounds / --dry-run, switch the interpreter on
    for a dry run (before triton is first imported), measure the ceilings on a GPU. Returns (args,
    do_bench or None, device, ceilings or None)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes under the Triton interpreter, no timings")
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
    res = {"x_cases": [], "fused": [], "ceilings": ceilings}

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
        for _ in range(a.rounds):
            for k, gr in graphs.items():
                mn, md = time_us(do_bench, gr, dry)
                v = case["variants"]["/".join(map(str, k))]
                v["min_us"] = min(v.get("min_us", 1e30), mn)
                v.setdefault("medians", []).append(md)
        for v in case["variants"].values():
            meds = sorted(v.pop("medians"))
            v["median_us"] = meds[len(meds) // 2]
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

    # the whole int8 op with each variant's best quantiser at qwen3 T=4096 (the dry run: tiny, T=33)
    sh = B.DRY_SHAPES["tiny"] if dry else B.SHAPES["qwen3-30b-a3b"]
    t = 33 if dry else 4096
    e2s = B.make_e2s(torch, sh, dev, 1)
    wts, (w13f, w2f) = B.make_weights(torch, sh, "int8", dev, 2)
    x = torch.randn(t, sh["H"], device=dev, generator=torch.Generator(device=dev).manual_seed(7)).to(torch.bfloat16)
    ids, w = B.make_routing(torch, sh, t, e2s, dev, 4 + t)
    ref = B.ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
    slots = torch.where(ids >= 0, e2s[ids.clamp(min=0)], -1)
    flops = 2 * int((slots >= 0).sum()) * 3 * sh["H"] * sh["I"]
    cfg = M._default_config(t, sh["K"], sh["S"], sh["H"], sh["I"], "int8", -1 if dry else 0)
    if dry:  # the interpreter has no table: force the a8 path
        cfg = M.MoEConfig(block_m=16, block_n=16, block_k=64, a8=True)
    last = next(c for c in res["x_cases"][::-1] if c["H"] == sh["H"]) if not dry else res["x_cases"][-1]
    chosen = {n: tuple(int(p) if p.isdigit() else p for p in kk.split("/")) for n, kk in last["best"].items()}
    graphs, rows = {}, {}
    try:
        for n, k in chosen.items():
            M.act_quant2 = fns[k]
            err = float(R.relative_error(fused_moe(x, ids, w, e2s, **wts, config=cfg), ref))
            rows[n] = dict(quantiser="/".join(map(str, k)), rel_err=err, us=[])
            graphs[n] = replay(lambda: fused_moe(x, ids, w, e2s, **wts, config=cfg))
        for _ in range(a.rounds):
            for n, gr in graphs.items():
                rows[n]["us"].append(time_us(do_bench, gr, dry)[0])
    finally:
        M.act_quant2 = shipped
    for n, r in rows.items():
        r["min_us"] = min(r["us"])
        if not dry:
            r["bf16_peak_frac"] = flops / (r["min_us"] * 1e-6) / res["ceilings"]["bf16_flops_per_s"]
        res["fused"].append(dict(variant=n, config=cfg.to_dict(), **r))
        print(f"fused_moe int8 T={t} with {n}: {r['min_us']:.1f} us"
              + (f" ({100 * r['bf16_peak_frac']:.1f} % of the bf16 rate)" if not dry else "")
              + f", rel err {r['rel_err']:.2e}", flush=True)
    bad = [r for r in rows.values() if r["rel_err"] > 1e-2]
    if not dry:
        print(f"wrote {write_json(a.out, 'gpu_a8_probe.json', res)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
