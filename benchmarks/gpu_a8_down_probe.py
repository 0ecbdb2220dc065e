#!/usr/bin/env python3
"""Would the int8 down GEMM gain from two-level int8 activations as gate+up did (``MoEConfig.a8``)?
A probe with its own copy of the down kernel, for one device call.

With int8 weights the down GEMM still converts every weight tile to bf16 in its k loop: on the H200
(session 12) it took 100 us at qwen3 T=4096 (32 GPU slots) against bf16's 86, and the whole int8 op
(295-302 us) stays under issue 6's 40 % of the bf16 rate. Here the SiLU*up rows h that gate+up wrote
(bf16) are quantised into two int8 levels per row, only the rows the GPU computes (read through
``sorted_ids``: ~8192 of the 32768 token-slots at this slot share), and a copy of kt's down kernel
multiplies them on the int8 tensor cores (exact int32 sums, one accumulator per level), each level's
sums scaled by its row scale, then by the weight's row scale and the routing weight, as kt's does.

Timed (CUDA-graph replay, L2 flushed, min / median of interleaved rounds) and checked against kt's
own down output (relative difference, which should stay at the bf16 rounding of y): kt's ``down``
with the table's config, and the quantiser + a8 down for a few tiles. Then the whole op estimated
as kt's align + gate+up + combine plus each down variant, as a fraction of the bf16 matmul rate.

    PYTHONPATH=. python3 benchmarks/gpu_a8_down_probe.py --out $OUT       (~1 min on the H200)
    python3 benchmarks/gpu_a8_down_probe.py --dry-run                      (interpreter: checks only)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402  (shapes, weights, routing, graph capture)
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup, time_us  # noqa: E402

# (block_m, block_n, block_k, num_warps, num_stages) of the a8 down kernel; block_m divides the
# alignment the table's config uses (128 at qwen3 int8 T=4096)
TILES = [(128, 128, 64, 4, 4), (128, 128, 128, 8, 3), (64, 128, 128, 4, 4), (128, 64, 128, 4, 4),
         (128, 256, 64, 8, 3), (64, 256, 128, 8, 3)]
DRY_TILES = [(16, 16, 32, 4, 2), (32, 32, 64, 4, 2)]


def _kernels():
    import triton
    import triton.language as tl

    from kt.gpu_ops import moe as M

    # kt's grouped tile order, published where the jitted kernel below looks its helpers up (kt's
    # kernels are imported only now: after a dry run has switched the interpreter on)
    globals()["_tile_ids"] = M._kernels()._tile_ids

    @triton.jit
    def quant_rows_kernel(h_ptr, q_ptr, s_ptr, sorted_ids_ptr, num_padded_ptr, num_valid, I, stride_hm,
                          stride_ql, BLOCK_I: tl.constexpr):
        """Two-level int8 of h's row sorted_ids[p] for p = program_id(0) (if p is in use and not
        padding): q [2, N, I] int8, s [N, 2] fp32, as moe.act_quant2's one-pass body (I <= BLOCK_I),
        rounding to nearest even by two adds."""
        p = tl.program_id(0)
        row = tl.load(sorted_ids_ptr + p)
        if (p < tl.load(num_padded_ptr)) & (row < num_valid):
            r64 = row.to(tl.int64)
            offs = tl.arange(0, BLOCK_I)
            m = offs < I
            v = tl.load(h_ptr + r64 * stride_hm + offs, mask=m, other=0.0).to(tl.float32)
            amax = tl.max(tl.where(v == v, tl.abs(v), float("inf")), 0)
            s1 = amax / 127.0
            q1 = (v * tl.where(amax > 0, 127.0 / amax, 0.0) + 12582912.0) - 12582912.0
            q1 = tl.where(q1 == q1, tl.minimum(tl.maximum(q1, -127.0), 127.0), 0.0)
            r = v - q1 * s1
            amax2 = tl.max(tl.abs(r), 0)
            q2 = (r * tl.where(amax2 > 0, 127.0 / amax2, 0.0) + 12582912.0) - 12582912.0
            q2 = tl.where(q2 == q2, tl.minimum(tl.maximum(q2, -127.0), 127.0), 0.0)
            tl.store(q_ptr + r64 * I + offs, q1.to(tl.int8), mask=m)
            tl.store(q_ptr + stride_ql + r64 * I + offs, q2.to(tl.int8), mask=m)
            tl.store(s_ptr + 2 * r64, s1)
            tl.store(s_ptr + 2 * r64 + 1, amax2 / 127.0)

    @triton.jit
    def down_a8_kernel(q_ptr, hs_ptr, w2_ptr, s2_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr, block_slot_ptr,
                       num_padded_ptr, num_valid, H, I, stride_ql, stride_we, stride_wn, stride_se, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, ALIGN_M: tl.constexpr):
        """kt's down_kernel (pointer weight tiles, contiguous rows) with h as two int8 levels."""
        num_pid_m = tl.load(num_padded_ptr) // BLOCK_M
        num_pid_n = tl.cdiv(H, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0)):
            pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)  # noqa: F821 (kt's, see below)
            slot = tl.load(block_slot_ptr + pid_m // (ALIGN_M // BLOCK_M)).to(tl.int64)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            tok_slot = tl.load(sorted_ids_ptr + offs_m)
            m_mask = tok_slot < num_valid
            row = tl.where(m_mask, tok_slot, 0).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < H
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = q_ptr + row[:, None] * I + offs_k[None, :]
            b_ptrs = w2_ptr + slot * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
            acc1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for kb in range(0, tl.cdiv(I, BLOCK_K)):
                k_mask = offs_k < I - kb * BLOCK_K
                a1 = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0)
                a2 = tl.load(a_ptrs + stride_ql, mask=m_mask[:, None] & k_mask[None, :], other=0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0)
                acc1 = tl.dot(a1, b, acc1, out_dtype=tl.int32)
                acc2 = tl.dot(a2, b, acc2, out_dtype=tl.int32)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            hs1 = tl.load(hs_ptr + 2 * row, mask=m_mask, other=0.0)[:, None]
            hs2 = tl.load(hs_ptr + 2 * row + 1, mask=m_mask, other=0.0)[:, None]
            acc = acc1.to(tl.float32) * hs1 + acc2.to(tl.float32) * hs2
            acc = acc * tl.load(s2_ptr + slot * stride_se + offs_n, mask=n_mask, other=0.0)[None, :]
            acc = acc * tl.load(topk_w_ptr + row, mask=m_mask, other=0.0)[:, None]
            tl.store(y_ptr + row[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])

    return quant_rows_kernel, down_a8_kernel


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv)
    dry = a.dry_run
    import torch

    from kt import reference as R
    from kt.gpu_ops import moe as M

    quant_rows_kernel, down_a8_kernel = _kernels()
    res = {"down": {}, "stages_us": {}, "ceilings": ceilings}
    sh = B.DRY_SHAPES["tiny"] if dry else B.SHAPES["qwen3-30b-a3b"]
    t = 33 if dry else 4096
    e2s = B.make_e2s(torch, sh, dev, 1)
    wts, _ = B.make_weights(torch, sh, "int8", dev, 2)
    x = torch.randn(t, sh["H"], device=dev, generator=torch.Generator(device=dev).manual_seed(7)).to(torch.bfloat16)
    ids, w = B.make_routing(torch, sh, t, e2s, dev, 4 + t)
    slots = torch.where(ids >= 0, e2s[ids.clamp(min=0)], -1)
    flops = 2 * int((slots >= 0).sum()) * 3 * sh["H"] * sh["I"]
    if dry:
        cfg = M.MoEConfig(block_m=16, block_n=16, block_k=64, a8=True, down_block_m=32)
    else:
        cfg = M._default_config(t, sh["K"], sh["S"], sh["H"], sh["I"], "int8", 0)
    align = cfg.align_m
    tiles = [tl_ for tl_ in (DRY_TILES if dry else TILES) if align % tl_[0] == 0]
    programs = M._INTERPRETER_PROGRAMS if dry else M._PROGRAMS_PER_SM * M._num_sms(0)
    n, inter, hid = ids.numel(), sh["I"], sh["H"]
    slot32, sid, bsl, npad = M.align_by_slot(ids, e2s, sh["S"], align)
    hb = M.gate_up(x, wts["w13"], wts["w13_scale"], sid, bsl, npad, sh["K"], cfg, torch.bfloat16, programs, align)
    ydt = M.y_dtype_for(x.dtype)
    rw = w.reshape(n).to(torch.float32).contiguous()
    q = torch.zeros((2, n, inter), dtype=torch.int8, device=dev)
    hs = torch.zeros((n, 2), dtype=torch.float32, device=dev)
    w2, s2 = wts["w2"], wts["w2_scale"]

    def kt_down():
        return M.down(hb, w2, s2, w, sid, bsl, npad, cfg.for_down(), programs, ydt, align)

    def quant():
        quant_rows_kernel[(sid.numel(),)](hb, q, hs, sid, npad, n, inter, hb.stride(0), q.stride(0),
                                          BLOCK_I=max(16, 1 << (inter - 1).bit_length()), num_warps=4)

    def a8_down(tile):
        bm, bn, bk, warps, stages = tile

        def fn():
            quant()
            y = torch.empty((n, hid), dtype=ydt, device=dev)
            grid = (max(1, min(programs, bsl.numel() * (align // bm) * -(-hid // bn))),)
            down_a8_kernel[grid](q, hs, w2, s2, y, rw, sid, bsl, npad, n, hid, inter, q.stride(0), w2.stride(0),
                                 w2.stride(1), s2.stride(0), y.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                 GROUP_M=8, ALIGN_M=align, num_warps=warps, num_stages=stages)
            return y
        return fn

    y_ref = kt_down().float()
    gpu_rows = (slot32 >= 0).nonzero().flatten()
    fns = {"kt": kt_down, "quant_only": quant}
    for tile in tiles:
        name = "a8/" + "/".join(map(str, tile))
        try:
            y = a8_down(tile)().float()
            diff = float(R.relative_error(y[gpu_rows], y_ref[gpu_rows]))
            res["down"][name] = dict(tile=list(tile), rel_diff_vs_kt=diff)
            if diff <= 1e-2:
                fns[name] = a8_down(tile)
        except Exception as e:  # a tile that does not compile or fit
            res["down"][name] = dict(tile=list(tile), error=repr(e)[:300])
    res["down"].setdefault("kt", {})
    res["down"].setdefault("quant_only", {})
    stages = {"align": lambda: M.align_by_slot(ids, e2s, sh["S"], align),
              "gate_up": lambda: M.gate_up(x, wts["w13"], wts["w13_scale"], sid, bsl, npad, sh["K"], cfg,
                                           torch.bfloat16, programs, align)}
    yk = kt_down()
    out = torch.empty_like(x)
    stages["combine"] = lambda: M.combine(yk, slot32, out)
    stages["whole_op"] = lambda: M.fused_moe(x, ids, w, e2s, **wts, config=cfg)
    graphs = {k: (fn if dry else B.graph_of(torch, fn)[0].replay) for k, fn in {**fns, **stages}.items()}
    rec = {k: [] for k in graphs}
    for _ in range(a.rounds):
        for k, g in graphs.items():
            rec[k].append(time_us(do_bench, g, dry))
    for k, v in rec.items():
        mn, md = min(r[0] for r in v), sorted(r[1] for r in v)[len(v) // 2]
        (res["down"][k] if k in res["down"] else res["stages_us"].setdefault(k, {})).update(min_us=mn, median_us=md)
    rest = sum(res["stages_us"][k]["min_us"] for k in ("align", "gate_up", "combine"))
    for k, r in res["down"].items():
        if "min_us" in r and k != "quant_only":
            r["whole_op_estimate_us"] = rest + r["min_us"]
            if not dry:
                r["whole_op_bf16_peak_frac"] = flops / (r["whole_op_estimate_us"] * 1e-6) / \
                    res["ceilings"]["bf16_flops_per_s"]
    for k, r in res["down"].items():
        print(f"{k}: " + ", ".join(f"{f} {r[f]:.3g}" for f in ("min_us", "rel_diff_vs_kt", "whole_op_estimate_us",
                                                                "whole_op_bf16_peak_frac") if f in r)
              + (f" ERROR {r['error'][:120]}" if "error" in r else ""), flush=True)
    print("stages: " + ", ".join(f"{k} {v['min_us']:.1f} us" for k, v in res["stages_us"].items()), flush=True)
    if not dry:
        print(f"wrote {write_json(a.out, 'gpu_a8_down_probe.json', res)}")
    bad = [k for k, r in res["down"].items() if r.get("rel_diff_vs_kt", 0) > 1e-2]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
