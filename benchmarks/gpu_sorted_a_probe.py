#!/usr/bin/env python3
"""Do kt's prefill GEMMs lose time gathering their activation rows? For one device call.

Nsight Compute on the H200 (session 14, ``results/ncu_s14_run3_int8_stalls.csv``) puts qwen3 int8
T=4096's a8 gate+up at 6.7 cycles per issued instruction, 3.2 of them stalled at barriers, and its
int8 down at 6.1, 1.5 at barriers: both load their activation tiles with gathered pointer loads
(row n of a tile is token-slot sorted_ids[n]'s row), which go through registers and shared memory
with a barrier per k step, while the weight tiles come by TMA. If the activations were laid out in
slot order first (one padded row per sorted position, what a quantiser could write directly), the
A tiles would be contiguous rows and TMA could load them too.

This probe times, per kernel, a copy of kt's loop with the A tiles loaded either way:
- ``gather``: as kt (pointer loads through sorted_ids);
- ``sorted``: TMA boxes of a slot-ordered copy of the activations ([P, H] rows, P padded rows);
on qwen3-30b-a3b T=4096 (32 GPU slots) with the tuned table's tiles: the int8 a8 gate+up (both
levels), the bf16 gate+up, the int8 and the bf16 down. Then the whole ``fused_moe`` with kt's h
kept by token-slot against h in sorted order (``moe._forced_sorted_h``) at several shapes and T. Each pair must agree exactly on every row in
use (the same products in the same order). Also timed: kt's own kernels on the same inputs (the
probe's ``gather`` copies should match them), and building the sorted copy with torch (an upper
bound for a quantiser that writes slot order directly). CUDA-graph replay, L2 flushed, min / median
of interleaved rounds (``bench_gpu.interleaved_us``).

    PYTHONPATH=. python3 benchmarks/gpu_sorted_a_probe.py --out $OUT     (~1 min on the H200)
    python3 benchmarks/gpu_sorted_a_probe.py --dry-run                    (interpreter, tiny shape)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402
from _results import write_json  # noqa: E402
from gpu_a8_probe import probe_setup  # noqa: E402


K = None  # kt.gpu_ops._kernels, imported by _kernels() (after the interpreter switch of a dry run)
a_tile = None  # jitted in _kernels()


def _kernels():
    global K, a_tile  # the jitted kernels below find their helpers among the module's globals
    import triton
    import triton.language as tl

    from kt.gpu_ops import _kernels as K

    @triton.jit
    def a_tile(a_desc, a_ptrs, row0, kb, offs_k, D, m_mask, BLOCK_K: tl.constexpr, SORTED_A: tl.constexpr):
        """One activation tile: a TMA box of the slot-ordered copy, or the gathered rows."""
        if SORTED_A:
            a = a_desc.load([row0, kb * BLOCK_K])
        else:
            a = tl.load(a_ptrs, mask=m_mask[:, None] & (offs_k < D - kb * BLOCK_K)[None, :], other=0.0)
        return a

    @triton.jit
    def gate_up(x_ptr, a_desc, w_desc, s13_ptr, h_ptr, sorted_ids_ptr, block_slot_ptr, num_padded_ptr, xs_ptr,
                num_valid, H, I, top_k, P, stride_xt, stride_xl, stride_se, stride_hm,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                ALIGN_M: tl.constexpr, FLATTEN: tl.constexpr, SORTED_A: tl.constexpr, A8: tl.constexpr,
                UPCAST: tl.constexpr):
        """kt's gate_up_kernel with TMA weight tiles (a8 with int8 weights, else bf16), its A tiles
        gathered (x [T, H], or q [2, T, H] levels stride_xl apart) or, SORTED_A, TMA boxes of the
        slot-ordered copy a_desc ([P, H], or [2P, H] for the two levels)."""
        num_pid_m = tl.load(num_padded_ptr) // BLOCK_M
        num_pid_n = tl.cdiv(I, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n, slot, offs_m, tok_slot, m_mask = K._tile_rows(
                tile, num_pid_m, num_pid_n, block_slot_ptr, sorted_ids_ptr, num_valid, BLOCK_M, ALIGN_M, GROUP_M)
            tok = tl.where(m_mask, tok_slot // top_k, 0).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < I
            offs_k = tl.arange(0, BLOCK_K)
            row0 = pid_m * BLOCK_M
            g_row = (slot * 2 * I + pid_n * BLOCK_N).to(tl.int32)
            a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]
            if A8:
                g1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                g2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                u1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                u2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
                for kb in range(0, tl.cdiv(H, BLOCK_K)):
                    if SORTED_A:
                        a1 = a_desc.load([row0, kb * BLOCK_K])
                        a2 = a_desc.load([row0 + P, kb * BLOCK_K])
                    else:
                        k_mask = offs_k < H - kb * BLOCK_K
                        a1 = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0)
                        a2 = tl.load(a_ptrs + stride_xl, mask=m_mask[:, None] & k_mask[None, :], other=0)
                    bg = tl.trans(w_desc.load([g_row, kb * BLOCK_K]))
                    bu = tl.trans(w_desc.load([g_row + I, kb * BLOCK_K]))
                    g1 = tl.dot(a1, bg, g1, out_dtype=tl.int32)
                    g2 = tl.dot(a2, bg, g2, out_dtype=tl.int32)
                    u1 = tl.dot(a1, bu, u1, out_dtype=tl.int32)
                    u2 = tl.dot(a2, bu, u2, out_dtype=tl.int32)
                    a_ptrs += BLOCK_K
                xs1 = tl.load(xs_ptr + 2 * tok, mask=m_mask, other=0.0)[:, None]
                xs2 = tl.load(xs_ptr + 2 * tok + 1, mask=m_mask, other=0.0)[:, None]
                acc_g = g1.to(tl.float32) * xs1 + g2.to(tl.float32) * xs2
                acc_u = u1.to(tl.float32) * xs1 + u2.to(tl.float32) * xs2
            else:
                acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for kb in range(0, tl.cdiv(H, BLOCK_K)):
                    a = K._cast(a_tile(a_desc, a_ptrs, row0, kb, offs_k, H, m_mask, BLOCK_K, SORTED_A), 2, UPCAST)
                    acc_g = tl.dot(a, tl.trans(K._cast(w_desc.load([g_row, kb * BLOCK_K]), 2, UPCAST)), acc_g)
                    acc_u = tl.dot(a, tl.trans(K._cast(w_desc.load([g_row + I, kb * BLOCK_K]), 2, UPCAST)), acc_u)
                    a_ptrs += BLOCK_K
            h = K._silu_up(acc_g, acc_u, s13_ptr, slot, offs_n[None, :], n_mask[None, :], I, stride_se, 1, A8)
            h_ptrs = h_ptr + tl.where(m_mask, tok_slot, 0).to(tl.int64)[:, None] * stride_hm + offs_n[None, :]
            tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    @triton.jit
    def down(h_ptr, a_desc, w_desc, s2_ptr, y_ptr, topk_w_ptr, sorted_ids_ptr, block_slot_ptr, num_padded_ptr,
             num_valid, H, I, stride_hm, stride_se, stride_ym,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
             ALIGN_M: tl.constexpr, FLATTEN: tl.constexpr, SORTED_A: tl.constexpr, INT8_W: tl.constexpr,
             UPCAST: tl.constexpr):
        """kt's down_kernel with TMA weight tiles, its h tiles gathered (h [N, I] by token-slot) or,
        SORTED_A, TMA boxes of the slot-ordered copy a_desc ([P, I])."""
        num_pid_m = tl.load(num_padded_ptr) // BLOCK_M
        num_pid_n = tl.cdiv(H, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
            pid_m, pid_n, slot, offs_m, tok_slot, m_mask = K._tile_rows(
                tile, num_pid_m, num_pid_n, block_slot_ptr, sorted_ids_ptr, num_valid, BLOCK_M, ALIGN_M, GROUP_M)
            row = tl.where(m_mask, tok_slot, 0).to(tl.int64)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = offs_n < H
            offs_k = tl.arange(0, BLOCK_K)
            row0 = pid_m * BLOCK_M
            w_row = (slot * H + pid_n * BLOCK_N).to(tl.int32)
            a_ptrs = h_ptr + row[:, None] * stride_hm + offs_k[None, :]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in range(0, tl.cdiv(I, BLOCK_K)):
                a = a_tile(a_desc, a_ptrs, row0, kb, offs_k, I, m_mask, BLOCK_K, SORTED_A)
                acc = tl.dot(K._cast(a, 2, UPCAST), tl.trans(K._cast(w_desc.load([w_row, kb * BLOCK_K]), 2, UPCAST)),
                             acc)
                a_ptrs += BLOCK_K
            if INT8_W:
                acc = acc * tl.load(s2_ptr + slot * stride_se + offs_n, mask=n_mask, other=0.0)[None, :]
            acc = acc * tl.load(topk_w_ptr + row, mask=m_mask, other=0.0)[:, None]
            y_ptrs = y_ptr + row[:, None] * stride_ym + offs_n[None, :]
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

    return gate_up, down


WHOLE_CASES = [("qwen3-30b-a3b", t) for t in (7, 64, 512, 4096)] + [("mixtral-8x7b", t) for t in (64, 4096)]


def whole_op(torch, M, do_bench, dev, dry, rounds, ceilings, checks):
    """fused_moe with the table's config (the default), h kept by token-slot against h in sorted
    order (what kt now does where the down's weights come by TMA), int8 and bf16 weights; outputs
    must be identical. Rows: min / median us of each, and the fraction of the bf16 matmul rate."""
    from kt.gpu_ops import fused_moe

    rows = []
    for label, t in ([("tiny", 40)] if dry else WHOLE_CASES):
        sh = B.DRY_SHAPES["tiny"] if dry else B.SHAPES[label]
        e2s, x, ids, w, flops = B.op_inputs(torch, sh, t, dev, 3, 9 + t)
        for wname in ("int8", "bf16"):
            wts, _ = B.make_weights(torch, sh, wname, dev, 2)
            cfg = (M.MoEConfig(block_m=16, block_n=16, block_k=32, tma=True) if dry
                   else M._default_config(t, sh["K"], sh["S"], sh["H"], sh["I"], wname, 0))
            if not isinstance(cfg, M.MoEConfig):
                continue  # the direct path keeps no h between GEMMs
            outs, graphs = {}, {}
            for on in (False, True):
                with M._forced_sorted_h(on):
                    outs[on] = fused_moe(x, ids, w, e2s, **wts, config=cfg)
                    graphs[on] = (lambda cfg=cfg, wts=wts: fused_moe(x, ids, w, e2s, **wts, config=cfg)) if dry \
                        else B.graph_of(torch, lambda cfg=cfg, wts=wts: fused_moe(x, ids, w, e2s, **wts,
                                                                                  config=cfg))[0].replay
            checks[f"whole_{label}_{wname}_T{t}_identical"] = bool(torch.equal(outs[False], outs[True]))
            tm = B.interleaved_us(do_bench, {"by_token_slot": graphs[False], "sorted": graphs[True]}, rounds, dry)
            r = dict(shape=label, T=t, weights=wname, config=cfg.to_dict(), default_sorted=M.sorted_h_for(cfg.for_down()),
                     **{f"{k}_min_us": v[0] for k, v in tm.items()}, **{f"{k}_median_us": v[1] for k, v in tm.items()})
            if ceilings:
                for k in tm:
                    r[f"{k}_bf16_peak_frac"] = flops / (r[f"{k}_min_us"] * 1e-6) / ceilings["bf16_flops_per_s"]
            rows.append(r)
            print(f"whole {label} {wname} T={t}: by token-slot {r['by_token_slot_min_us']:.1f}, sorted "
                  f"{r['sorted_min_us']:.1f} us (default sorted: {r['default_sorted']})", flush=True)
            del graphs
    return rows


# int8 down tiles at qwen3 T=4096 now that h comes by TMA too (the gathered loads' address registers
# had made the 256-wide tile spill): (down_block_n, down_block_k, down_num_warps, down_num_stages,
# down_flatten) laid over the table's config
DOWN_VARIANTS = {"table": None, "n256_w8_s3_flat": (256, 64, 8, 3, True), "n256_w8_s3": (256, 64, 8, 3, False),
                 "n128_w8_s3_flat": (128, 64, 8, 3, True), "n128_w8_s3": (128, 64, 8, 3, False),
                 "n128_k128_w8_s3": (128, 128, 8, 3, False)}


def down_variants(torch, M, do_bench, dev, dry, rounds, ceilings, checks):
    """fused_moe at qwen3 int8 T=4096 (tiny under the interpreter) with the table's config and with
    other down tiles (DOWN_VARIANTS), h in slot order; outputs must equal the table config's."""
    from dataclasses import replace

    from kt.gpu_ops import fused_moe

    sh = B.DRY_SHAPES["tiny"] if dry else B.SHAPES["qwen3-30b-a3b"]
    t = 40 if dry else 4096
    e2s, x, ids, w, flops = B.op_inputs(torch, sh, t, dev, 3, 9 + t)
    wts, _ = B.make_weights(torch, sh, "int8", dev, 2)
    base = (M.MoEConfig(block_m=16, block_n=16, block_k=64, a8=True, tma=True) if dry
            else M._default_config(t, sh["K"], sh["S"], sh["H"], sh["I"], "int8", 0))
    graphs, ref, rows = {}, None, []
    for name, v in DOWN_VARIANTS.items():
        cfg = base if v is None else replace(base, down_block_n=v[0] if not dry else 32, down_block_k=v[1],
                                             down_num_warps=v[2], down_num_stages=v[3], down_flatten=v[4])
        out = fused_moe(x, ids, w, e2s, **wts, config=cfg)
        ref = out if ref is None else ref
        checks[f"down_{name}_identical"] = bool(torch.equal(out, ref))
        graphs[name] = (lambda cfg=cfg: fused_moe(x, ids, w, e2s, **wts, config=cfg)) if dry else \
            B.graph_of(torch, lambda cfg=cfg: fused_moe(x, ids, w, e2s, **wts, config=cfg))[0].replay
    for name, (mn, md) in B.interleaved_us(do_bench, graphs, rounds, dry).items():
        r = dict(variant=name, min_us=mn, median_us=md)
        if ceilings:
            r["bf16_peak_frac"] = flops / (mn * 1e-6) / ceilings["bf16_flops_per_s"]
        rows.append(r)
        print(f"int8 T={t} down {name}: {mn:.1f} / {md:.1f} us", flush=True)
    return rows


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv, extra=[
        ("--only-down-variants", dict(action="store_true", help="time only the int8 down tiles (DOWN_VARIANTS)"))])
    dry = a.dry_run
    import torch

    from kt.gpu_ops import moe as M

    if a.only_down_variants:
        checks = {}
        res = dict(ceilings=ceilings, checks=checks,
                   down_variants=down_variants(torch, M, do_bench, dev, dry, a.rounds, ceilings, checks))
        print("checks:", checks, flush=True)
        if not dry:
            print(f"wrote {write_json(a.out, 'gpu_sorted_a_probe_down.json', res)}")
        return 0 if all(checks.values()) else 1

    gate_up_k, down_k = _kernels()
    TD = M._tensor_descriptor()
    sh = B.DRY_SHAPES["tiny"] if dry else B.SHAPES["qwen3-30b-a3b"]
    t = 40 if dry else 4096
    H, I, k, s = sh["H"], sh["I"], sh["K"], sh["S"]
    e2s, x, ids, w, _ = B.op_inputs(torch, sh, t, dev, 7, 4 + t)
    n = ids.numel()
    res = dict(shape=sh, T=t, ceilings=ceilings, kernels={}, checks={})
    runs, checks = {}, {}
    programs = M._INTERPRETER_PROGRAMS if dry else M._PROGRAMS_PER_SM * M._num_sms(0)

    def case(wname):
        """Checks and timed callables of one weight dtype (a scope of its own: the callables must
        keep this case's tensors and configs)."""
        (wts, _) = B.make_weights(torch, sh, wname, dev, 2)
        cfg = (M.MoEConfig(block_m=16, block_n=16, block_k=32, a8=wname == "int8", tma=True) if dry
               else M._default_config(t, k, s, H, I, wname, 0))
        dcfg = cfg.for_down()
        align = cfg.align_m
        a8 = bool(cfg.a8)
        slot32, sorted_ids, block_slot, num_padded = M.align_by_slot(ids, e2s, s, align)
        p = sorted_ids.numel()
        # (rows past num_padded hold whatever the alignment left there: any value)
        real = (sorted_ids >= 0) & (sorted_ids < n)
        row_tok = torch.where(real, sorted_ids // k, 0).long()
        row_ts = torch.where(real, sorted_ids, 0).long()
        if a8:
            xq, xs = M.act_quant2(x)
            xa, sxl = xq, xq.stride(0)

            def sort_a():
                return xq.index_select(1, row_tok).reshape(2 * p, H)
        else:
            xa, xs, sxl = x, x, 0

            def sort_a():
                return x.index_select(0, row_tok)
        xsorted = sort_a()
        w13d, tma13 = M._weight_desc(wts["w13"], cfg)
        w2d, tma2 = M._weight_desc(wts["w2"], dcfg)
        assert tma13 and tma2, "the probe needs TMA weight tiles"
        s13 = wts.get("w13_scale", wts["w13"])
        s2 = wts.get("w2_scale", wts["w2"])
        hbuf = torch.empty((n, I), dtype=torch.bfloat16, device=dev)
        hs = torch.empty_like(hbuf)
        gu_grid = M._grid(block_slot, I, cfg, programs, align)
        dn_grid = M._grid(block_slot, H, dcfg, programs, align)

        def gu(sorted_a, out, a_desc):
            gate_up_k[gu_grid](xa, a_desc, w13d, s13, out, sorted_ids, block_slot, num_padded, xs, n, H, I, k, p,
                               xa.stride(-2), sxl, s13.stride(0), out.stride(0), BLOCK_M=cfg.block_m,
                               BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, ALIGN_M=align,
                               FLATTEN=cfg.flatten, SORTED_A=sorted_a, A8=a8, UPCAST=dry, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages)
            return out

        a_desc_gu = TD.from_tensor(xsorted, [cfg.block_m, cfg.block_k])
        gu(False, hbuf, a_desc_gu)
        gu(True, hs, a_desc_gu)
        kt_h = M.gate_up(x, wts["w13"], wts.get("w13_scale"), sorted_ids, block_slot, num_padded, k, cfg,
                         torch.bfloat16, programs, align)
        used = slot32.long().ge(0).nonzero().flatten()
        checks[f"{wname}_gate_up_sorted_eq_gather"] = bool(torch.equal(hbuf[used], hs[used]))
        checks[f"{wname}_gate_up_gather_eq_kt"] = bool(torch.equal(hbuf[used], kt_h[used]))
        hsorted = hbuf.index_select(0, row_ts)
        y1 = torch.empty((n, H), dtype=torch.bfloat16, device=dev)
        y2 = torch.empty_like(y1)
        wflat = w.reshape(-1)

        def dn(sorted_a, out, a_desc):
            down_k[dn_grid](hbuf, a_desc, w2d, s2, out, wflat, sorted_ids, block_slot, num_padded, n, H, I,
                            hbuf.stride(0), s2.stride(0), out.stride(0), BLOCK_M=dcfg.block_m,
                            BLOCK_N=dcfg.block_n, BLOCK_K=dcfg.block_k, GROUP_M=dcfg.group_m, ALIGN_M=align,
                            FLATTEN=dcfg.flatten, SORTED_A=sorted_a, INT8_W=wname == "int8", UPCAST=dry,
                            num_warps=dcfg.num_warps, num_stages=dcfg.num_stages)
            return out

        a_desc_dn = TD.from_tensor(hsorted, [dcfg.block_m, dcfg.block_k])
        dn(False, y1, a_desc_dn)
        dn(True, y2, a_desc_dn)
        kt_y = M.down(hbuf, wts["w2"], wts.get("w2_scale"), w, sorted_ids, block_slot, num_padded, dcfg,
                      programs, torch.bfloat16, align)
        checks[f"{wname}_down_sorted_eq_gather"] = bool(torch.equal(y1[used], y2[used]))
        checks[f"{wname}_down_gather_eq_kt"] = bool(torch.equal(y1[used], kt_y[used]))
        runs.update({
            f"{wname}_gate_up_kt": lambda cfg=cfg, wts=wts, sorted_ids=sorted_ids, block_slot=block_slot,
            num_padded=num_padded, align=align: M.gate_up(x, wts["w13"], wts.get("w13_scale"), sorted_ids,
                                                          block_slot, num_padded, k, cfg, torch.bfloat16,
                                                          programs, align),
            f"{wname}_gate_up_gather": lambda gu=gu, h=hbuf, d=a_desc_gu: gu(False, h, d),
            f"{wname}_gate_up_sorted": lambda gu=gu, h=hs, d=a_desc_gu: gu(True, h, d),
            f"{wname}_sort_x_torch": sort_a,
            f"{wname}_down_gather": lambda dn=dn, y=y1, d=a_desc_dn: dn(False, y, d),
            f"{wname}_down_sorted": lambda dn=dn, y=y2, d=a_desc_dn: dn(True, y, d),
        })
        res["kernels"][wname] = dict(config=cfg.to_dict(), P=p, rows_used=int(used.numel()))

    for wname in ("int8", "bf16"):
        case(wname)
    res["checks"] = checks
    print("checks:", checks, flush=True)
    graphs = {name: (fn if dry else B.graph_of(torch, fn)[0].replay) for name, fn in runs.items()}
    times = B.interleaved_us(do_bench, graphs, a.rounds, dry)
    res["times_us"] = {name: dict(min_us=mn, median_us=md) for name, (mn, md) in times.items()}
    for name, (mn, md) in times.items():
        print(f"{name}: {mn:.1f} / {md:.1f} us", flush=True)
    del graphs
    res["whole"] = whole_op(torch, M, do_bench, dev, dry, a.rounds, ceilings, checks)
    if not dry:
        print(f"wrote {write_json(a.out, 'gpu_sorted_a_probe.json', res)}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
