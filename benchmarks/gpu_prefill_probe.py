#!/usr/bin/env python3
"""Why the sorted-path GEMMs are slow at prefill sizes: variants of kt's gate+up and down kernels, timed
side by side on qwen3-30b-a3b shapes (T=4096; 32 hot slots as in bench_gpu.py, and all 128 experts as in
layer-wise prefill).

Device:  PYTHONPATH=. python3 benchmarks/gpu_prefill_probe.py --part ybf16 --out $OUT
         PYTHONPATH=. python3 benchmarks/gpu_prefill_probe.py --part gemm --out $OUT
         (two processes, so a variant that breaks the CUDA context loses only its part; each writes
         $OUT/gpu_prefill_probe_<part>.json after every case; --slots 32 for the bench_gpu case alone;
         --ncu-once: one launch of the shipped T=4096 gate+up and down, for ncu; see main())
Local:   TRITON_INTERPRET=1 PYTHONPATH=. python3 benchmarks/gpu_prefill_probe.py --check
         (tiny shapes on the CPU: every variant against kt's kernels, y_bf16's errors; no timings)

Variants (flags of the probe's own kernels, which otherwise follow kt/gpu_ops/_kernels.py):
- down: EVEN (no masks: H % block_n == 0 and I % block_k == 0; padding rows read row 0, never stored),
  SORTED_A (h rows read in sorted order from a [P, I] copy, contiguous per tile, instead of gathered by
  token-slot), TRANS_B (weight tile loaded [block_n, block_k] as stored and transposed for the dot);
  grid persistent (4 programs per SM, as kt) or one program per tile.
- gate+up: CAT (gate and up columns of a tile in one [block_k, 2 block_n] operand and one dot, split
  after), EVEN, TRANS_B.
Times are eager launches with L2 flushed between them (triton do_bench medians; a few us of launch cost
against 100+ us kernels), min and median of rounds interleaved variant by variant; fractions are of
the bf16 matmul rate measured in the same run.

Session 8 (`--set new`, the default; `--set s7` for the lists above, `--only REGEX` picks by name):
- TMA_W (both GEMMs): weight tiles loaded through a host-side TMA descriptor
  (triton.tools.tensor_descriptor.TensorDescriptor over the weight seen as [S*R, C], [block_n, block_k]
  boxes, transposed for the dot); the activation rows, gathered by sorted_ids, stay pointer loads.
- HALF (both): a slot's last row block, when at most half full, runs as a block_m/2-row tile (at T=4096,
  S=32 16 of the 32 slots have one, holding ~15 rows of 128; 80 blocks in all).
- FLATTEN (both): the persistent tile loop as tl.range(..., flatten=True), so the pipeliner can load the
  next tile while this one's epilogue runs; with one program per SM ("1/sm").
- Y_BF16 (down): y stored in bf16 (routing weight applied, as now); `--part ybf16` times down + combine
  with y in fp32 and in bf16 (kt's combine reads either, widening to fp32, same k order)
  and reports the output's relative errors (bf16 and fp32 out) against each other, the spec (bench_gpu's
  fp32 reference from x, TF32 off) and an fp32 down + combine from kt's own h rows.
On the device every variant is checked against kt's kernels before it is timed; one that fails to compile,
launch or match is reported in the JSON (`failed`) and not timed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from kt.gpu_ops import MoEConfig  # noqa: E402
from kt.gpu_ops import moe as M  # noqa: E402
from kt.gpu_ops._kernels import _cast, _tile_ids  # noqa: E402
from _results import write_json  # noqa: E402  (benchmarks/ is on sys.path when run as a script)


@triton.jit
def _down_tile(h_ptr, w2_ptr, w_desc, y_ptr, topk_w_ptr, sorted_ids_ptr, pid_m, pid_n, slot,
               num_valid, H, I,
               stride_hm, stride_hi, stride_we, stride_wn, stride_wi, stride_ym, stride_yh,
               ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN: tl.constexpr, SORTED_A: tl.constexpr, TRANS_B: tl.constexpr, TMA_W: tl.constexpr,
               UPCAST: tl.constexpr):
    # the first ROWS rows of row block pid_m (ROWS < BLOCK_M only where the rest are padding); slot: int32
    offs_m = pid_m * BLOCK_M + tl.arange(0, ROWS)
    tok_slot = tl.load(sorted_ids_ptr + offs_m)
    m_mask = tok_slot < num_valid
    row = tl.where(m_mask, tok_slot, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_row = offs_m.to(tl.int64) if SORTED_A else row
    a_ptrs = h_ptr + a_row[:, None] * stride_hm + offs_k[None, :] * stride_hi
    wbase = w2_ptr + slot.to(tl.int64) * stride_we
    if TRANS_B:
        b_ptrs = wbase + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wi
    else:
        b_ptrs = wbase + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wi
    w_row = slot * H + pid_n * BLOCK_N  # TMA_W: first row of the tile in the [S*H, I] view of w2
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(I, BLOCK_K)):
        k_in = offs_k < I - kb * BLOCK_K
        if EVEN:
            a = tl.load(a_ptrs)
        else:
            a = tl.load(a_ptrs, mask=m_mask[:, None] & k_in[None, :], other=0.0)
        if TMA_W:
            # [BLOCK_N, BLOCK_K] as stored; rows past this expert's H (other experts' rows, or zeros past
            # the last) only feed columns that are not stored, columns past I come back as zeros
            b = w_desc.load([w_row, kb * BLOCK_K])
        elif EVEN:
            b = tl.load(b_ptrs)
        elif TRANS_B:
            b = tl.load(b_ptrs, mask=(offs_n < H)[:, None] & k_in[None, :], other=0.0)
        else:
            b = tl.load(b_ptrs, mask=k_in[:, None] & (offs_n < H)[None, :], other=0.0)
        a = _cast(a, 2, UPCAST)
        b = _cast(b, 2, UPCAST)
        if TRANS_B or TMA_W:
            acc = tl.dot(a, tl.trans(b), acc)
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_hi
        b_ptrs += BLOCK_K * stride_wi
    rw = tl.load(topk_w_ptr + row, mask=m_mask, other=0.0)
    acc = acc * rw[:, None]
    y_ptrs = y_ptr + row[:, None] * stride_ym + offs_n[None, :] * stride_yh
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n < H)[None, :])


@triton.jit
def down_v(h_ptr, w2_ptr, w_desc, y_ptr, topk_w_ptr, sorted_ids_ptr, block_slot_ptr, num_padded_ptr,
           num_valid, H, I,
           stride_hm, stride_hi, stride_we, stride_wn, stride_wi, stride_ym, stride_yh,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
           EVEN: tl.constexpr, SORTED_A: tl.constexpr, TRANS_B: tl.constexpr, TMA_W: tl.constexpr,
           FLATTEN: tl.constexpr, HALF: tl.constexpr, UPCAST: tl.constexpr):
    # y [N, H] in y's dtype (fp32 as kt, or bf16); w_desc: TMA descriptor of w2 as [S*H, I] (TMA_W only)
    num_pid_m = tl.load(num_padded_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(H, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)
        slot = tl.load(block_slot_ptr + pid_m)
        if HALF:
            # A slot's token-slots fill its rows from the slot's first row on (the alignment hands them
            # out by an atomic counter from there), so if row BLOCK_M/2 of the block is padding, every
            # later row is too: such a block (a slot's last) runs as a BLOCK_M/2-row tile.
            if tl.load(sorted_ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_valid:
                _down_tile(h_ptr, w2_ptr, w_desc, y_ptr, topk_w_ptr, sorted_ids_ptr, pid_m, pid_n, slot,
                           num_valid, H, I, stride_hm, stride_hi, stride_we, stride_wn, stride_wi, stride_ym,
                           stride_yh, BLOCK_M // 2, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, SORTED_A, TRANS_B, TMA_W,
                           UPCAST)
            else:
                _down_tile(h_ptr, w2_ptr, w_desc, y_ptr, topk_w_ptr, sorted_ids_ptr, pid_m, pid_n, slot,
                           num_valid, H, I, stride_hm, stride_hi, stride_we, stride_wn, stride_wi, stride_ym,
                           stride_yh, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, SORTED_A, TRANS_B, TMA_W, UPCAST)
        else:
            _down_tile(h_ptr, w2_ptr, w_desc, y_ptr, topk_w_ptr, sorted_ids_ptr, pid_m, pid_n, slot,
                       num_valid, H, I, stride_hm, stride_hi, stride_we, stride_wn, stride_wi, stride_ym,
                       stride_yh, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, SORTED_A, TRANS_B, TMA_W, UPCAST)


@triton.jit
def _gate_up_tile(x_ptr, w13_ptr, w_desc, h_ptr, sorted_ids_ptr, pid_m, pid_n, slot,
                  num_valid, H, I, top_k,
                  stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hm, stride_hi,
                  ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  CAT: tl.constexpr, EVEN: tl.constexpr, TRANS_B: tl.constexpr, TMA_W: tl.constexpr,
                  UPCAST: tl.constexpr):
    # the first ROWS rows of row block pid_m (as _down_tile); slot: int32
    offs_m = pid_m * BLOCK_M + tl.arange(0, ROWS)
    tok_slot = tl.load(sorted_ids_ptr + offs_m)
    m_mask = tok_slot < num_valid
    tok = tl.where(m_mask, tok_slot // top_k, 0).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
    wbase = w13_ptr + slot.to(tl.int64) * stride_we
    if CAT:
        j = tl.arange(0, 2 * BLOCK_N)
        col = tl.where(j < BLOCK_N, pid_n * BLOCK_N + j, I + pid_n * BLOCK_N + j - BLOCK_N).to(tl.int64)
        if TRANS_B:
            b_ptrs = wbase + col[:, None] * stride_wn + offs_k[None, :] * stride_wh
        else:
            b_ptrs = wbase + col[None, :] * stride_wn + offs_k[:, None] * stride_wh
        acc = tl.zeros((ROWS, 2 * BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_in = offs_k < H - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=m_mask[:, None] & k_in[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=(k_in[None, :] if TRANS_B else k_in[:, None]), other=0.0)
            a = _cast(a, 2, UPCAST)
            b = _cast(b, 2, UPCAST)
            if TRANS_B:
                acc = tl.dot(a, tl.trans(b), acc)
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_xh
            b_ptrs += BLOCK_K * stride_wh
        g, u = tl.split(tl.permute(tl.reshape(acc, (ROWS, 2, BLOCK_N)), (0, 2, 1)))
    else:
        if TRANS_B:
            g_ptrs = wbase + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wh
        else:
            g_ptrs = wbase + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
        u_ptrs = g_ptrs + I * stride_wn
        g_row = slot * (2 * I) + pid_n * BLOCK_N  # TMA_W: first gate row of the tile in the [S*2I, H] view
        g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(H, BLOCK_K)):
            k_in = offs_k < H - kb * BLOCK_K
            if EVEN:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=m_mask[:, None] & k_in[None, :], other=0.0)
            if TMA_W:
                # [BLOCK_N, BLOCK_K] as stored; rows past I (up rows, the next expert's, zeros past the
                # last) only feed columns that are not stored, columns past H come back as zeros
                bg = w_desc.load([g_row, kb * BLOCK_K])
                bu = w_desc.load([g_row + I, kb * BLOCK_K])
            elif EVEN:
                bg = tl.load(g_ptrs)
                bu = tl.load(u_ptrs)
            else:
                kb_mask = k_in[None, :] if TRANS_B else k_in[:, None]
                bg = tl.load(g_ptrs, mask=kb_mask, other=0.0)
                bu = tl.load(u_ptrs, mask=kb_mask, other=0.0)
            a = _cast(a, 2, UPCAST)
            if TRANS_B or TMA_W:
                g = tl.dot(a, tl.trans(_cast(bg, 2, UPCAST)), g)
                u = tl.dot(a, tl.trans(_cast(bu, 2, UPCAST)), u)
            else:
                g = tl.dot(a, _cast(bg, 2, UPCAST), g)
                u = tl.dot(a, _cast(bu, 2, UPCAST), u)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += BLOCK_K * stride_wh
            u_ptrs += BLOCK_K * stride_wh
    hv = g / (1.0 + tl.exp(-g)) * u
    h_ptrs = h_ptr + tl.where(m_mask, tok_slot, 0).to(tl.int64)[:, None] * stride_hm \
        + offs_n[None, :] * stride_hi
    tl.store(h_ptrs, hv.to(h_ptr.dtype.element_ty), mask=m_mask[:, None] & (offs_n < I)[None, :])


@triton.jit
def gate_up_v(x_ptr, w13_ptr, w_desc, h_ptr, sorted_ids_ptr, block_slot_ptr, num_padded_ptr,
              num_valid, H, I, top_k,
              stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hm, stride_hi,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
              CAT: tl.constexpr, EVEN: tl.constexpr, TRANS_B: tl.constexpr, TMA_W: tl.constexpr,
              FLATTEN: tl.constexpr, HALF: tl.constexpr, UPCAST: tl.constexpr):
    # w_desc: TMA descriptor of w13 as [S*2I, H] (TMA_W only)
    num_pid_m = tl.load(num_padded_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(I, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)
        slot = tl.load(block_slot_ptr + pid_m)
        if HALF:  # see down_v
            if tl.load(sorted_ids_ptr + pid_m * BLOCK_M + BLOCK_M // 2) >= num_valid:
                _gate_up_tile(x_ptr, w13_ptr, w_desc, h_ptr, sorted_ids_ptr, pid_m, pid_n, slot, num_valid, H, I,
                              top_k, stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hm, stride_hi,
                              BLOCK_M // 2, BLOCK_M, BLOCK_N, BLOCK_K, CAT, EVEN, TRANS_B, TMA_W, UPCAST)
            else:
                _gate_up_tile(x_ptr, w13_ptr, w_desc, h_ptr, sorted_ids_ptr, pid_m, pid_n, slot, num_valid, H, I,
                              top_k, stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hm, stride_hi,
                              BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, CAT, EVEN, TRANS_B, TMA_W, UPCAST)
        else:
            _gate_up_tile(x_ptr, w13_ptr, w_desc, h_ptr, sorted_ids_ptr, pid_m, pid_n, slot, num_valid, H, I,
                          top_k, stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_hm, stride_hi,
                          BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, CAT, EVEN, TRANS_B, TMA_W, UPCAST)


def _w_arg(v, w):
    """The kernels' w_desc: for a TMA_W variant a descriptor of the weight [S, R, C] seen as [S*R, C] (16-byte
    aligned base and row stride, [block_n, block_k] boxes: the kernel loads a tile at (slot*R + row, k));
    otherwise the weight tensor itself, which the kernel does not read."""
    if not v["TMA_W"]:
        return w
    return TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [v["BN"], v["BK"]])


def run_down(v, hb, hs, w2, rw, sid, bsl, npad, y, programs):
    n, inter = hb.shape
    hid = w2.shape[1]
    src = hs if v["SORTED_A"] else hb
    grid = (max(1, min(programs, bsl.numel() * -(-hid // v["BN"]))),)
    down_v[grid](src, w2, _w_arg(v, w2), y, rw, sid, bsl, npad, n, hid, inter,
                 src.stride(0), src.stride(1), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0), y.stride(1),
                 BLOCK_M=v["BM"], BLOCK_N=v["BN"], BLOCK_K=v["BK"], GROUP_M=8, EVEN=v["EVEN"],
                 SORTED_A=v["SORTED_A"], TRANS_B=v["TRANS_B"], TMA_W=v["TMA_W"], FLATTEN=v["FLATTEN"],
                 HALF=v["HALF"], UPCAST=M.kernels_interpreted(), num_warps=v["W"], num_stages=v["S"])
    return y


def run_gate_up(v, x, w13, sid, bsl, npad, top_k, hb, programs):
    inter = w13.shape[1] // 2
    grid = (max(1, min(programs, bsl.numel() * -(-inter // v["BN"]))),)
    gate_up_v[grid](x, w13, _w_arg(v, w13), hb, sid, bsl, npad, hb.shape[0], x.shape[1], inter, top_k,
                    x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), hb.stride(0), hb.stride(1),
                    BLOCK_M=v["BM"], BLOCK_N=v["BN"], BLOCK_K=v["BK"], GROUP_M=8, CAT=v["CAT"], EVEN=v["EVEN"],
                    TRANS_B=v["TRANS_B"], TMA_W=v["TMA_W"], FLATTEN=v["FLATTEN"], HALF=v["HALF"],
                    UPCAST=M.kernels_interpreted(), num_warps=v["W"], num_stages=v["S"])
    return hb


def run_combine(y, slot32, out, block_h=None):
    """kt's combine (it reads y in y's own dtype, fp32 or bf16) with an optional BLOCK_H."""
    M.combine(y, slot32, out, **({"block_h": block_h} if block_h else {}))
    return out


def dv(bm, bn, bk, w, s, even=False, sorted_a=False, trans_b=False, persist=True, tma_w=False, flatten=False,
       half=False, y_bf16=False, per_sm=M._PROGRAMS_PER_SM):
    return dict(BM=bm, BN=bn, BK=bk, W=w, S=s, EVEN=even, SORTED_A=sorted_a, TRANS_B=trans_b, PERSIST=persist,
                TMA_W=tma_w, FLATTEN=flatten, HALF=half, Y_BF16=y_bf16, PER_SM=per_sm)


def gv(bm, bn, bk, w, s, cat=False, even=False, trans_b=False, persist=True, tma_w=False, flatten=False,
       half=False, per_sm=M._PROGRAMS_PER_SM):
    assert not (cat and tma_w), "TMA_W loads gate and up tiles apart (no CAT)"
    return dict(BM=bm, BN=bn, BK=bk, W=w, S=s, CAT=cat, EVEN=even, TRANS_B=trans_b, PERSIST=persist, TMA_W=tma_w,
                FLATTEN=flatten, HALF=half, PER_SM=per_sm)


FLAGS = ("EVEN", "SORTED_A", "TRANS_B", "CAT", "TMA_W", "FLATTEN", "HALF", "Y_BF16")


def name_of(v):
    flags = [k.lower() for k in FLAGS if v.get(k)]
    if not v["PERSIST"]:
        flags.append("grid")
    elif v.get("PER_SM", M._PROGRAMS_PER_SM) != M._PROGRAMS_PER_SM:
        flags.append(f"{v['PER_SM']}/sm")
    return f"{v['BM']}x{v['BN']}x{v['BK']} w{v['W']} s{v['S']}" + (" " + "+".join(flags) if flags else "")


# Session 7's switches (results/gpu_prefill_probe_s7_run2.json): `--set s7`.
DOWN_VARIANTS = [dv(128, 128, 64, 8, 4), dv(128, 128, 64, 8, 4, persist=False), dv(128, 128, 64, 8, 4, even=True),
                 dv(128, 128, 64, 8, 4, sorted_a=True, even=True), dv(128, 128, 64, 8, 4, trans_b=True, even=True),
                 dv(128, 128, 64, 8, 3, even=True, persist=False), dv(128, 256, 64, 8, 3, even=True),
                 dv(64, 128, 64, 4, 4, even=True), dv(128, 64, 64, 4, 4, even=True), dv(128, 128, 128, 8, 3, even=True),
                 dv(64, 256, 64, 8, 4, even=True), dv(128, 128, 64, 4, 4, even=True)]
GU_VARIANTS = [gv(128, 128, 64, 8, 4), gv(128, 64, 64, 8, 4), gv(128, 64, 64, 8, 4, cat=True),
               gv(128, 64, 64, 8, 4, cat=True, even=True), gv(128, 64, 64, 8, 4, cat=True, even=True, trans_b=True),
               gv(128, 64, 64, 8, 3, cat=True, even=True, persist=False), gv(64, 64, 64, 4, 4, cat=True, even=True),
               gv(128, 128, 64, 8, 3, cat=True, even=True), gv(128, 64, 128, 8, 3, cat=True, even=True),
               gv(128, 64, 64, 8, 4, even=True)]
# Session 8 (`--set new`, the default): the shipped T=4096 tiles (down 128x256x64 w8 s3, gate+up 128x128x64 w8
# s4) with weight tiles by TMA, a slot's last block at half height, y in bf16, the persistent loop flattened.
# At ~200 KB of shared memory one program fits on an SM, so with kt's 4 programs per SM each program runs about
# one tile and a flattened loop has nothing to overlap: flattened variants run one program per SM ("1/sm", with
# a 1/sm control unflattened). Flattening adds an epilogue buffer in shared memory (triton 3.6, sm_90a: the
# down 128x256 s3 tile needs 272 KB with fp32 y, over the 227 KB limit; 176 KB with bf16 y), so the flattened
# 128x256 down runs with bf16 y or 2 stages.
DOWN_NEW = [dv(128, 256, 64, 8, 3), dv(128, 256, 64, 8, 3, tma_w=True), dv(128, 256, 64, 8, 4, tma_w=True),
            dv(128, 256, 64, 8, 3, half=True), dv(128, 256, 64, 8, 3, tma_w=True, half=True),
            dv(128, 256, 64, 8, 3, y_bf16=True), dv(128, 256, 64, 8, 3, tma_w=True, y_bf16=True),
            dv(128, 256, 64, 8, 3, y_bf16=True, per_sm=1),
            dv(128, 256, 64, 8, 3, flatten=True, y_bf16=True, per_sm=1),
            dv(128, 256, 64, 8, 3, tma_w=True, flatten=True, y_bf16=True, per_sm=1),
            dv(128, 256, 64, 8, 2, tma_w=True, flatten=True, per_sm=1),
            dv(128, 128, 64, 8, 4), dv(128, 128, 64, 8, 4, tma_w=True), dv(128, 128, 64, 8, 4, flatten=True, per_sm=1),
            dv(128, 128, 64, 8, 4, tma_w=True, flatten=True, per_sm=1)]
GU_NEW = [gv(128, 128, 64, 8, 4), gv(128, 128, 64, 8, 4, tma_w=True), gv(128, 128, 64, 8, 3, tma_w=True),
          gv(128, 128, 64, 8, 4, half=True), gv(128, 128, 64, 8, 4, tma_w=True, half=True),
          gv(128, 128, 64, 8, 4, per_sm=1), gv(128, 128, 64, 8, 4, flatten=True, per_sm=1),
          gv(128, 128, 64, 8, 4, tma_w=True, flatten=True, per_sm=1),
          gv(128, 128, 64, 8, 3, tma_w=True, flatten=True, per_sm=1)]
SETS = {"new": (DOWN_NEW, GU_NEW), "s7": (DOWN_VARIANTS, GU_VARIANTS),
        "all": (DOWN_NEW + DOWN_VARIANTS, GU_NEW + GU_VARIANTS)}
SHIPPED_DOWN = DOWN_NEW[0]  # the down tile of the tuned T=4096 entry (kt/gpu_ops/configs/h200.json)


def setup(dev, T, E, S, K, H, I, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    w13 = (torch.randn(S, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(S, H, I, device=dev, generator=g) / I ** 0.5).to(torch.bfloat16)
    e2s = torch.full((E,), -1, dtype=torch.int32, device=dev)
    e2s[torch.randperm(E, generator=g, device=dev)[:S]] = torch.arange(S, dtype=torch.int32, device=dev)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices.to(torch.int64)
    w = torch.rand(T, K, device=dev, generator=g)
    return x, ids, w, e2s, w13, w2


def case(dev, T, E, S, K, H, I, block_m):
    x, ids, w, e2s, w13, w2 = setup(dev, T, E, S, K, H, I)
    slot32, sid, bsl, npad = M.align_by_slot(ids, e2s, S, block_m)
    ref_cfg = MoEConfig(block_m, 64, 64, 8, 4, 3)
    sms = 0 if dev == "cpu" else M._num_sms(torch.cuda.current_device())
    programs = M._INTERPRETER_PROGRAMS if dev == "cpu" else M._PROGRAMS_PER_SM * sms
    hb = M.gate_up(x, w13, None, sid, bsl, npad, K, ref_cfg, torch.bfloat16, programs)
    rw = w.reshape(-1).float().contiguous()
    y_ref = M.down(hb, w2, None, w, sid, bsl, npad, ref_cfg, programs)
    hs = hb[sid.clamp(max=hb.shape[0] - 1).long()].contiguous()
    on = (slot32 >= 0)
    return dict(x=x, ids=ids, w=w, e2s=e2s, w13=w13, w2=w2, sid=sid, bsl=bsl, npad=npad, hb=hb, hs=hs, rw=rw,
                y_ref=y_ref, on=on, slot32=slot32, programs=programs, sms=sms, K=K, bsl_bm=block_m,
                flops_gu=2 * int(on.sum()) * 2 * H * I, flops_down=2 * int(on.sum()) * H * I)


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def fits(kind, v, H, I):
    """Whether the variant's kernel is valid at this shape: EVEN has no masks at all, and the probe's pointer
    gate+up masks no weight column (a last tile past I would read past the last expert)."""
    n_dim, k_dim = (H, I) if kind == "down" else (I, H)
    if v["EVEN"] and (n_dim % v["BN"] or k_dim % v["BK"]):
        return False
    return kind == "down" or v["TMA_W"] or I % v["BN"] == 0


def run_variant(kind, v, c, out=None):
    """Run one variant on case c into out (a fresh zeroed buffer if None); returns out."""
    if not v["PERSIST"]:
        prog = 1 << 30  # one program per tile
    elif c["sms"]:
        prog = v.get("PER_SM", M._PROGRAMS_PER_SM) * c["sms"]
    else:
        prog = c["programs"]  # interpreter: a few programs, each looping over several tiles
    if kind == "down":
        if out is None:
            out = torch.zeros_like(c["y_ref"], dtype=torch.bfloat16 if v["Y_BF16"] else torch.float32)
        return run_down(v, c["hb"], c["hs"], c["w2"], c["rw"], c["sid"], c["bsl"], c["npad"], out, prog)
    if out is None:
        out = torch.zeros_like(c["hb"])
    return run_gate_up(v, c["x"], c["w13"], c["sid"], c["bsl"], c["npad"], c["K"], out, prog)


def check_one(kind, v, c):
    """Relative error of one variant against kt's kernels on the rows it writes (GPU token-slots)."""
    on = c["on"]
    got = run_variant(kind, v, c)
    return rel(got[on], (c["y_ref"] if kind == "down" else c["hb"])[on])


def check(c, down_vs, gu_vs):
    """Every variant of c's block_m against kt's kernels: [(name, rel err or None, error text or None)]."""
    out = []
    for kind, vs in (("down", down_vs), ("gate_up", gu_vs)):
        for v in vs:
            if v["BM"] != c["bsl_bm"]:
                continue
            name = f"{kind} {name_of(v)}"
            try:
                out.append((name, check_one(kind, v, c), None))
            except Exception as e:  # a variant that does not compile or run is reported, not fatal
                out.append((name, None, f"{type(e).__name__}: {e}"[:3000]))
    return out


def ref_same_h(c):
    """out [T, H] fp32 from kt's own bf16 h rows: sum over GPU k of topk_w * (w2_s @ h) in fp32 (TF32 off),
    i.e. the down GEMM and the combine without rounding, to isolate what y's dtype costs."""
    t, hid = c["x"].shape
    hb, w2f, K = c["hb"].float(), c["w2"].float(), c["K"]
    out = torch.zeros(t, hid, dtype=torch.float32, device=hb.device)
    for s in range(w2f.shape[0]):
        n = torch.nonzero(c["slot32"] == s).flatten()
        if n.numel():
            out.index_add_(0, n // K, (hb[n] @ w2f[s].T) * c["rw"][n][:, None])
    return out


def ybf16_errors(c, v):
    """Outputs of the down tile v with y in fp32 and in bf16 (kt's combine for both), with out in bf16 (as
    shipped) and in fp32, against each other, the spec (fp32 from x, as bench_gpu's reference) and the fp32
    result from kt's own h rows. Returns (errors, (y32, y16))."""
    from bench_gpu import ref_gpu  # the spec on the GPU (benchmarks/ is on sys.path when run as a script)

    t, hid = c["x"].shape
    y32 = run_variant("down", dict(v, Y_BF16=False), c)
    y16 = run_variant("down", dict(v, Y_BF16=True), c)
    spec = ref_gpu(torch, c["x"], c["ids"], c["w"], c["e2s"], c["w13"].float(), c["w2"].float())
    same_h = ref_same_h(c)
    on = c["on"]
    errs = dict(y_rows_bf16_vs_fp32=rel(y16[on], y32[on]))
    for odt, tag in ((torch.bfloat16, "bf16_out"), (torch.float32, "fp32_out")):
        o32 = torch.empty(t, hid, dtype=odt, device=y32.device)
        M.combine(y32, c["slot32"], o32)
        o16 = run_combine(y16, c["slot32"], torch.empty(t, hid, dtype=odt, device=y32.device))
        errs[tag] = dict(bf16y_vs_fp32y=rel(o16, o32), fp32y_vs_spec=rel(o32, spec), bf16y_vs_spec=rel(o16, spec),
                         fp32y_vs_same_h=rel(o32, same_h), bf16y_vs_same_h=rel(o16, same_h))
    return errs, (y32, y16)


def time_rounds(fns, rounds):
    """do_bench medians (us) of each fn, rounds interleaved fn by fn; eager launches, L2 flushed by do_bench."""
    from triton.testing import do_bench

    times = {k: [] for k in fns}
    for r in range(rounds):
        for k, fn in fns.items():
            if r == 0:
                print(f"  timing {k}", flush=True)
            times[k].append(do_bench(fn, warmup=3, rep=25, return_mode="median") * 1e3)
            torch.cuda.synchronize()
    return times


def part_gemm(label, sh, down_vs, gu_vs, rounds, peak):
    """Each variant checked against kt's kernels on the device, then the ones that pass timed."""
    per_bm = {}
    for bm in sorted({v["BM"] for v in down_vs + gu_vs}):
        per_bm[bm] = case("cuda", sh["T"], sh["E"], sh["S"], sh["K"], sh["H"], sh["I"], bm)
    rows, fns = [], {}
    for kind, vs in (("down", down_vs), ("gate_up", gu_vs)):
        for v in vs:
            c, name = per_bm[v["BM"]], name_of(v)
            try:
                err, fail = check_one(kind, v, c), None
                if not err < CHECK_TOL:
                    fail = f"rel err {err:.3g} vs kt's kernels > {CHECK_TOL}"
            except Exception as e:  # reported in the JSON; the other variants still run
                err, fail = None, f"{type(e).__name__}: {e}"[:3000]
            if fail:
                err = err if err == err else None  # NaN is not JSON
                print(f"{label} {kind:7s} {name:42s} FAILED: {fail.splitlines()[0][:300]}", flush=True)
                rows.append(dict(kind=kind, variant=name, rel_err_vs_kt=err, failed=fail))
                continue
            buf = run_variant(kind, v, c)
            fns[(kind, name)] = (lambda kind=kind, v=v, c=c, buf=buf: run_variant(kind, v, c, buf),
                                 c["flops_down" if kind == "down" else "flops_gu"], err)
    times = time_rounds({k: f[0] for k, f in fns.items()}, rounds)
    for (kind, name), ts in times.items():
        _, fl, err = fns[(kind, name)]
        r = dict(kind=kind, variant=name, min_us=min(ts), median_us=sorted(ts)[len(ts) // 2], rounds_us=ts,
                 of_peak=fl / (min(ts) * 1e-6) / peak, rel_err_vs_kt=err)
        rows.append(r)
        print(f"{label} {kind:7s} {name:42s} min {r['min_us']:8.1f} us med {r['median_us']:8.1f} "
              f"{r['of_peak'] * 100:5.1f} % of bf16 peak  err {err:.1e}", flush=True)
    return dict(label=label, **sh, rows=rows)


def part_ybf16(label, sh, rounds, peak):
    """Down (the shipped tile) + combine with y in fp32 (as kt) and in bf16: errors, then times."""
    v32 = SHIPPED_DOWN
    v16 = dict(v32, Y_BF16=True)
    c = case("cuda", sh["T"], sh["E"], sh["S"], sh["K"], sh["H"], sh["I"], v32["BM"])
    errs, (y32, y16) = ybf16_errors(c, v32)
    print(f"{label} y_bf16 errors: {json.dumps(errs)}", flush=True)
    out = torch.empty_like(c["x"])
    s32 = c["slot32"]
    fns = {
        "combine kt (fp32 y)": lambda: M.combine(y32, s32, out),
        "combine probe (fp32 y)": lambda: run_combine(y32, s32, out),
        "combine probe (bf16 y)": lambda: run_combine(y16, s32, out),
        "combine probe (bf16 y, block_h 2048)": lambda: run_combine(y16, s32, out, 2048),
        "down (fp32 y)": lambda: run_variant("down", v32, c, y32),
        "down (bf16 y)": lambda: run_variant("down", v16, c, y16),
        "down + combine kt (fp32 y)": lambda: (run_variant("down", v32, c, y32), M.combine(y32, s32, out)),
        "down + combine probe (bf16 y)": lambda: (run_variant("down", v16, c, y16), run_combine(y16, s32, out)),
    }
    times = time_rounds(fns, rounds)
    rows = []
    for name, ts in times.items():
        r = dict(variant=name, min_us=min(ts), median_us=sorted(ts)[len(ts) // 2], rounds_us=ts)
        if name.startswith("down"):
            r["of_peak"] = c["flops_down"] / (min(ts) * 1e-6) / peak
        rows.append(r)
        print(f"{label} {name:40s} min {r['min_us']:8.1f} us med {r['median_us']:8.1f}", flush=True)
    return dict(label=label, **sh, down_tile=name_of(v32), errors=errs, rows=rows)


CHECK_TOL = 2e-2


def local_check(down_vs, gu_vs):
    """Tiny shapes (under TRITON_INTERPRET=1 on the CPU): every variant against kt's kernels, y_bf16's errors."""
    dev = "cpu" if M.kernels_interpreted() or not torch.cuda.is_available() else "cuda"

    def small(vs, bm, kind, H, I):
        seen = {}
        for v in vs:
            s = dict(v, BM=bm, BN=min(v["BN"], 64), BK=64)
            if (s["HALF"] and bm < 32) or not fits(kind, s, H, I):
                continue  # a half tile needs >= 16 rows (tl.dot)
            seen.setdefault(name_of(s), s)
        return list(seen.values())

    # (T, E, S, K, H, I, block_m): H and I that divide the tiles, then H and I that do not (tails of N and
    # K: masks, TMA bounds) at block_m 32, where 4 of the 9 row blocks take the half-height path
    failed = []
    shapes = ((37, 8, 5, 2, 256, 192, 16), (37, 8, 5, 2, 256, 192, 64), (150, 8, 5, 2, 224, 160, 32))
    for T, E, S, K, H, I, bm in shapes:
        c = case(dev, T, E, S, K, H, I, bm)
        for name, err, fail in check(c, small(down_vs, bm, "down", H, I), small(gu_vs, bm, "gate_up", H, I)):
            tag = f"H={H} I={I} bm={bm} {name}"
            if fail and M.kernels_interpreted() and "tma_w" in name:
                print(f"{tag}: SKIPPED under the interpreter (tensor descriptors: {fail.splitlines()[0][:200]}); "
                      "the device run checks it before timing", flush=True)
                continue
            print(f"{tag}: rel err {err:.2e}" if fail is None else f"{tag}: FAILED {fail}", flush=True)
            if fail or not err < CHECK_TOL:
                failed.append(tag)
    errs, _ = ybf16_errors(c, dict(SHIPPED_DOWN, BM=32, BN=64, BK=64))
    print(f"y_bf16 (T=150 H=224 I=160 bm=32, interpreter rounding: fp32->bf16 truncates): {json.dumps(errs)}")
    if not errs["bf16_out"]["bf16y_vs_fp32y"] < 1e-2:
        failed.append("y_bf16")
    if failed:
        raise SystemExit(f"check FAILED: {failed}")
    print("check ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true",
                    help="tiny shapes, correctness only (use TRITON_INTERPRET=1 on a CPU)")
    ap.add_argument("--part", choices=("all", "gemm", "ybf16"), default="all",
                    help="gemm: the GEMM variants alone; ybf16: down+combine with y in fp32 vs bf16")
    ap.add_argument("--set", choices=sorted(SETS), default=None,
                    help="GEMM variant lists: new (timing default), s7, all (--check default)")
    ap.add_argument("--only", default=None, help="regex: GEMM variants whose 'down NAME' / 'gate_up NAME' match")
    ap.add_argument("--slots", default="32,128", help="cases by GPU slots: 32 (bench_gpu), 128 (all experts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ncu-once", action="store_true", help="one launch of the shipped T=4096 gate+up and down")
    a = ap.parse_args()
    down_vs, gu_vs = SETS[a.set or ("all" if a.check else "new")]
    if a.only:
        pat = re.compile(a.only)
        down_vs = [v for v in down_vs if pat.search("down " + name_of(v))]
        gu_vs = [v for v in gu_vs if pat.search("gate_up " + name_of(v))]
    if a.check:
        local_check(down_vs, gu_vs)
        return
    from triton.testing import do_bench
    torch.backends.cuda.matmul.allow_tf32 = False
    m = 8192
    mats = [torch.randn(m, m, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    peak = 2 * m ** 3 / (do_bench(lambda: torch.matmul(*mats), warmup=30, rep=200, return_mode="median") * 1e-3)
    mats.clear()
    print(f"bf16 matmul {peak / 1e12:.0f} TFLOP/s", flush=True)
    res = dict(peak_bf16=peak, triton=triton.__version__, torch=torch.__version__,
               device=torch.cuda.get_device_name(), part=a.part, set=a.set, only=a.only, cases=[], ybf16=[])
    cases = [("qwen3 S=32 T=4096", dict(T=4096, E=128, S=32, K=8, H=2048, I=768)),
             ("qwen3 S=128 T=4096 (all experts)", dict(T=4096, E=128, S=128, K=8, H=2048, I=768))]
    if a.ncu_once:
        # kt's reference launches first (gate_up_kernel, down_kernel at 128x64x64), then the shipped
        # T=4096 config's: profile with --launch-skip 2 -k regex:'^(gate_up|down)_kernel$'
        sh = cases[0][1]
        c = case("cuda", sh["T"], sh["E"], sh["S"], sh["K"], sh["H"], sh["I"], 128)
        cfg = MoEConfig(128, 128, 64, 8, 8, 4)
        hb = M.gate_up(c["x"], c["w13"], None, c["sid"], c["bsl"], c["npad"], c["K"], cfg, torch.bfloat16,
                       c["programs"])
        M.down(hb, c["w2"], None, c["w"], c["sid"], c["bsl"], c["npad"], cfg, c["programs"])
        torch.cuda.synchronize()
        print("ncu-once: launched", flush=True)
        return
    slots = {int(s) for s in a.slots.split(",")}
    name = f"gpu_prefill_probe_{a.part}.json"
    for part in (("ybf16", "gemm") if a.part == "all" else (a.part,)):
        for label, sh in cases:
            if sh["S"] not in slots:
                continue
            if part == "gemm":
                res["cases"].append(part_gemm(label, sh, down_vs, gu_vs, a.rounds, peak))
            else:
                res["ybf16"].append(part_ybf16(label, sh, a.rounds, peak))
            torch.cuda.empty_cache()
            if a.out:  # after every case, so a later failure loses nothing earlier
                write_json(a.out, name, res)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"wall {time.time() - t0:.0f} s")
