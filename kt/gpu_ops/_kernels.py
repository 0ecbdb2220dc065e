"""Triton kernels (GPU, or the CPU under TRITON_INTERPRET=1) for the hot-expert fused MoE: bf16/fp16/fp32
or int8 weight-only (per-output-row fp32 scales).

Only @triton.jit code lives here; kt/gpu_ops/moe.py checks, allocates, picks the config and launches.

Legend: T tokens, K top-k, H hidden, I intermediate, S GPU expert slots, N = T*K token-slots.
A "token-slot" n = t*K + k is one (token, choice) pair. The wrapper sorts token-slots by expert slot
into blocks of ALIGN_M rows (`sorted_ids`, padded with the sentinel N) and gives each block its slot
(`block_slot`); a GEMM kernel's BLOCK_M divides ALIGN_M, so its row block b lies in aligned block
b // (ALIGN_M // BLOCK_M); `num_padded[0]` is how many rows of `sorted_ids` are in use. The GEMM
kernels are persistent: a fixed grid (about a few programs per SM) loops over the tiles of the row
blocks in use, read from `num_padded` on the device, so nothing is read back to the host and no
program is spent on the worst-case padding of the grid (most token-slots of a hybrid layer are on
the CPU).

Offsets inside one expert's weights (and scales) are 32-bit, with the expert's base and every activation
row offset in 64 bits: 64-bit, clamped (tl.where) column offsets made the T=4096 GEMMs 1.6-3x slower on
the H200 (docs/decisions.md; git show lab-archive:benchmarks/gpu_prefill_probe.py). The wrapper checks
that one expert spans < 2**31 elements.

Compute dtype code CT: 0 fp32, 1 fp16, 2 bf16. UPCAST (interpreter only) does every dot in fp32, because
the interpreter keeps bf16 as raw bits and a bf16 tl.dot there is silently wrong.
"""
import triton
import triton.language as tl

# the wrapper reaches every kernel through this module
from ._align_kernels import (align_per_slot_kernel, align_small_kernel, slot_count_kernel,  # noqa: F401
                             slot_hist_kernel, slot_offsets_kernel, slot_place_kernel, slot_scatter_kernel)


@triton.jit
def _cast(v, CT: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return v.to(tl.float32)
    elif CT == 2:
        return v.to(tl.bfloat16)
    elif CT == 1:
        return v.to(tl.float16)
    else:
        return v.to(tl.float32)


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row blocks walk the N blocks together, so one slot's weight tiles are
    # reused from L2 by the row blocks that share that slot.
    num_in_group = GROUP_M * num_pid_n
    group = pid // num_in_group
    first_m = group * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + ((pid % num_in_group) % size_m)
    pid_n = (pid % num_in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _gate_up_acc(a_ptrs, g_ptrs, u_ptrs, w_desc, g_row, I, row_mask, col_mask, H, stride_xh, stride_wh,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 TMA_W: tl.constexpr, CT: tl.constexpr, UPCAST: tl.constexpr):
    """Gate and up accumulators [ROWS, BLOCK_N] of the gathered activation rows (a_ptrs, rows where
    row_mask) against the weight tiles (g_ptrs / u_ptrs: [BLOCK_K, BLOCK_N], columns where
    col_mask), over all of H. TMA_W: the weight tiles come from w_desc instead, a TMA descriptor of
    w13 seen as [S*2I, H] with [BLOCK_N, BLOCK_K] boxes, gate rows from g_row and up rows I further:
    rows past this expert's gate (or up) rows only feed columns that are never stored, and columns
    past H read as zeros."""
    offs_k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        k_mask = offs_k < H - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = _cast(a, CT, UPCAST)
        if TMA_W:
            bg = w_desc.load([g_row, kb * BLOCK_K])
            bu = w_desc.load([g_row + I, kb * BLOCK_K])
            acc_g = tl.dot(a, tl.trans(_cast(bg, CT, UPCAST)), acc_g)
            acc_u = tl.dot(a, tl.trans(_cast(bu, CT, UPCAST)), acc_u)
        else:
            bg = tl.load(g_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc_g = tl.dot(a, _cast(bg, CT, UPCAST), acc_g)
            acc_u = tl.dot(a, _cast(bu, CT, UPCAST), acc_u)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    return acc_g, acc_u


@triton.jit
def _tile_rows(tile, num_pid_m, num_pid_n, block_slot_ptr, sorted_ids_ptr, num_valid, BLOCK_M: tl.constexpr,
               ALIGN_M: tl.constexpr, GROUP_M: tl.constexpr):
    """The sorted-path tile ``tile``: (pid_m, pid_n, its slot (int64), its sorted positions offs_m,
    their token-slots, and which of those are real rows (not padding))."""
    pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)
    slot = tl.load(block_slot_ptr + pid_m // (ALIGN_M // BLOCK_M)).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tok_slot = tl.load(sorted_ids_ptr + offs_m)
    return pid_m, pid_n, slot, offs_m, tok_slot, tok_slot < num_valid


@triton.jit
def _gate_up_acc_a8(a_ptrs, stride_xl, g_ptrs, u_ptrs, w_desc, g_row, I, row_mask, col_mask, H, stride_xh,
                    stride_wh, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    TMA_W: tl.constexpr):
    """As _gate_up_acc for int8 weights and two-level int8 activations (a_ptrs: level 1, level 2
    stride_xl further): int8 tensor-core products, exact int32 sums, one accumulator per (level,
    gate/up) -> (gate level 1, gate level 2, up level 1, up level 2)."""
    # (out_dtype: triton 3.6 asserts that an int32 accumulator is named as such)
    offs_k = tl.arange(0, BLOCK_K)
    acc_g1 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
    acc_g2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
    acc_u1 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
    acc_u2 = tl.zeros((ROWS, BLOCK_N), dtype=tl.int32)
    for kb in range(0, tl.cdiv(H, BLOCK_K)):
        k_mask = offs_k < H - kb * BLOCK_K
        a1 = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0)
        a2 = tl.load(a_ptrs + stride_xl, mask=row_mask[:, None] & k_mask[None, :], other=0)
        if TMA_W:
            bg = tl.trans(w_desc.load([g_row, kb * BLOCK_K]))
            bu = tl.trans(w_desc.load([g_row + I, kb * BLOCK_K]))
        else:
            bg = tl.load(g_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0)
            bu = tl.load(u_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0)
        acc_g1 = tl.dot(a1, bg, acc_g1, out_dtype=tl.int32)
        acc_g2 = tl.dot(a2, bg, acc_g2, out_dtype=tl.int32)
        acc_u1 = tl.dot(a1, bu, acc_u1, out_dtype=tl.int32)
        acc_u2 = tl.dot(a2, bu, acc_u2, out_dtype=tl.int32)
        a_ptrs += BLOCK_K * stride_xh
        g_ptrs += BLOCK_K * stride_wh
        u_ptrs += BLOCK_K * stride_wh
    return acc_g1, acc_g2, acc_u1, acc_u2


@triton.jit
def _round127(v):
    # round to nearest, ties to even (the reference's np.rint), clamped to the int8 codes [-127, 127].
    # |v| <= 127 here, far below 2**22, so adding and subtracting 1.5 * 2**23 leaves v rounded to an
    # integer by the fp32 adds themselves. No per-element NaN guard (it was a compare and a select per
    # code): a code that is NaN (a NaN or Inf in the row) clamps to +-127 on a GPU, and its row's
    # level-1 scale is NaN (_scale127), which makes every output of the row NaN anyway.
    # H200, qwen3 T=4096: act_quant2 19.3 -> 15.5 us with both changes (docs/decisions.md).
    r = (v + 12582912.0) - 12582912.0
    return tl.minimum(tl.maximum(r, -127.0), 127.0)


@triton.jit
def _scale127(amax, FINITE_ONLY: tl.constexpr):
    """(scale, 1 / scale) of rows with absmax amax [R] (a NaN counted as Inf): amax / 127, or NaN
    when FINITE_ONLY and the row is not finite; the inverse is 0 for a zero or non-finite row."""
    ok = amax < float("inf")
    s = amax / 127.0
    if FINITE_ONLY:
        s = tl.where(ok, s, float("nan"))
    return s, tl.where(ok & (amax > 0), 127.0 / amax, 0.0)


@triton.jit
def _quant2_levels(v, amax, amax2_in, ONE_PASS: tl.constexpr):
    """(q1, q2, s1, s2) of rows v [R, B] (fp32) given each row's absmax [R] (NaN/Inf counted as
    Inf); with ONE_PASS the residual's absmax is taken from v itself, else amax2_in is used."""
    s1, inv1 = _scale127(amax, True)
    q1 = _round127(v * inv1[:, None])
    r = v - q1 * s1[:, None]
    amax2 = tl.max(tl.abs(r), 1) if ONE_PASS else amax2_in
    s2, inv2 = _scale127(amax2, False)
    return q1, _round127(r * inv2[:, None]), s1, s2


@triton.jit
def act_quant2_kernel(x_ptr, q_ptr, s_ptr, T, H, stride_xt, stride_xh, stride_ql, stride_qt,
                      ROWS: tl.constexpr, BLOCK_H: tl.constexpr, ONE_PASS: tl.constexpr):
    """Two-level per-token int8 of ROWS rows t (kt.reference.quantize_act2): q[0, t] =
    round(x * 127 / amax) with s[t, 0] = amax / 127, then the residual r = x - q[0, t] * s[t, 0]
    the same way into q[1, t], s[t, 1]. x [T, H] float; q [2, T, H] int8; s [T, 2] fp32. Rounding
    is to nearest even, as the reference (a GPU's fp32 division 127 / amax may differ from the
    reference's by an ulp, moving a code near a rounding boundary by one). A NaN or Inf in a row
    makes its level-1 scale NaN, so its outputs are NaN (propagated, as the float path would; its
    codes are not defined). ONE_PASS (BLOCK_H >= H): every row is read once and kept
    in registers; else in three passes (absmax, residual absmax, codes)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = rows < T
    rows64 = tl.where(r_ok, rows, 0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    x_row = x_ptr + rows64[:, None] * stride_xt
    q_row = q_ptr + rows64[:, None] * stride_qt
    if ONE_PASS:
        m = r_ok[:, None] & (offs < H)[None, :]
        v = tl.load(x_row + offs[None, :] * stride_xh, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.where(v == v, tl.abs(v), float("inf")), 1)
        q1, q2, s1, s2 = _quant2_levels(v, amax, amax, True)
        tl.store(q_row + offs[None, :], q1.to(tl.int8), mask=m)
        tl.store(q_row + stride_ql + offs[None, :], q2.to(tl.int8), mask=m)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            m = r_ok[:, None] & (offs < H - h0)[None, :]
            v = tl.load(x_row + (h0 + offs)[None, :] * stride_xh, mask=m, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.where(v == v, tl.abs(v), float("inf")), 1))
        amax2 = tl.zeros((ROWS,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            m = r_ok[:, None] & (offs < H - h0)[None, :]
            v = tl.load(x_row + (h0 + offs)[None, :] * stride_xh, mask=m, other=0.0).to(tl.float32)
            q1, q2, s1, s2 = _quant2_levels(v, amax, amax, True)
            amax2 = tl.maximum(amax2, tl.max(tl.abs(v - q1 * s1[:, None]), 1))
        for h0 in range(0, H, BLOCK_H):
            m = r_ok[:, None] & (offs < H - h0)[None, :]
            v = tl.load(x_row + (h0 + offs)[None, :] * stride_xh, mask=m, other=0.0).to(tl.float32)
            q1, q2, s1, s2 = _quant2_levels(v, amax, amax2, False)
            tl.store(q_row + h0 + offs[None, :], q1.to(tl.int8), mask=m)
            tl.store(q_row + stride_ql + h0 + offs[None, :], q2.to(tl.int8), mask=m)
        s1 = _scale127(amax, True)[0]
        s2 = _scale127(amax2, False)[0]
    tl.store(s_ptr + 2 * rows64, s1, mask=r_ok)
    tl.store(s_ptr + 2 * rows64 + 1, s2, mask=r_ok)


@triton.jit
def _silu_up(acc_g, acc_u, s13_ptr, slot, offs_n, n_mask, I, stride_se, stride_sn, INT8_W: tl.constexpr):
    """silu(gate) * up, the int8 weights' per-row scales applied first (slot: int64; columns
    offs_n where n_mask)."""
    if INT8_W:
        acc_g = acc_g * tl.load(s13_ptr + slot * stride_se + offs_n * stride_sn, mask=n_mask, other=0.0)
        acc_u = acc_u * tl.load(s13_ptr + slot * stride_se + (offs_n + I) * stride_sn, mask=n_mask, other=0.0)
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def gate_up_kernel(
    x_ptr, w13_ptr, w_desc, s13_ptr, h_ptr,
    sorted_ids_ptr, block_slot_ptr, num_padded_ptr, xs_ptr,
    num_valid, H, I, top_k,
    stride_xt, stride_xh, stride_xl,
    stride_we, stride_wn, stride_wh,
    stride_se, stride_sn,
    stride_hm, stride_hi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ALIGN_M: tl.constexpr, INT8_W: tl.constexpr, TMA_W: tl.constexpr, FLATTEN: tl.constexpr, CT: tl.constexpr,
    UPCAST: tl.constexpr, A8: tl.constexpr, SORTED_H: tl.constexpr,
):
    """h[n, :] = silu(gate_s x_t) * (up_s x_t) for every token-slot n = t*K + k routed to slot s.

    x [T, H]; w13 [S, 2I, H] (gate rows, then up rows); s13 [S, 2I] fp32 (INT8_W only);
    h [N, I] in the compute dtype. Tile: BLOCK_M sorted rows x BLOCK_N columns of gate and of up.
    TMA_W: weight tiles through w_desc (see _gate_up_acc). FLATTEN: the tile loop flattened with the
    k loop, so the pipeliner loads the next tile while this one's epilogue runs (one program per SM).
    A8 (int8 weights only): x is act_quant2_kernel's q [2, T, H] int8 (levels stride_xl apart) with
    xs [T, 2] fp32, and the products run on int8 tensor cores (_gate_up_acc_a8); xs is not read
    otherwise. SORTED_H: h [P, I] in the sorted order instead (row r = sorted position r, padding rows
    left unwritten), so the down GEMM reads whole row blocks (down_kernel's SORTED_H).
    """
    num_pid_m = tl.load(num_padded_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(I, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n, slot, offs_m, tok_slot, m_mask = _tile_rows(
            tile, num_pid_m, num_pid_n, block_slot_ptr, sorted_ids_ptr, num_valid, BLOCK_M, ALIGN_M, GROUP_M)
        tok = tl.where(m_mask, tok_slot // top_k, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)

        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
        g_ptrs = w13_ptr + slot * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
        g_row = (slot * 2 * I + pid_n * BLOCK_N).to(tl.int32)  # TMA_W: in the [S*2I, H] view
        if A8:
            g1, g2, u1, u2 = _gate_up_acc_a8(a_ptrs, stride_xl, g_ptrs, g_ptrs + I * stride_wn, w_desc, g_row, I,
                                             m_mask, n_mask, H, stride_xh, stride_wh, BLOCK_M, BLOCK_N, BLOCK_K,
                                             TMA_W)
            xs1 = tl.load(xs_ptr + 2 * tok, mask=m_mask, other=0.0)[:, None]
            xs2 = tl.load(xs_ptr + 2 * tok + 1, mask=m_mask, other=0.0)[:, None]
            acc_g = g1.to(tl.float32) * xs1 + g2.to(tl.float32) * xs2
            acc_u = u1.to(tl.float32) * xs1 + u2.to(tl.float32) * xs2
        else:
            acc_g, acc_u = _gate_up_acc(a_ptrs, g_ptrs, g_ptrs + I * stride_wn, w_desc, g_row, I, m_mask,
                                        n_mask, H, stride_xh, stride_wh, BLOCK_M, BLOCK_N, BLOCK_K, TMA_W, CT,
                                        UPCAST)
        h = _silu_up(acc_g, acc_u, s13_ptr, slot, offs_n[None, :], n_mask[None, :], I, stride_se, stride_sn,
                     INT8_W)
        h_row = offs_m.to(tl.int64) if SORTED_H else tl.where(m_mask, tok_slot, 0).to(tl.int64)
        h_ptrs = h_ptr + h_row[:, None] * stride_hm + offs_n[None, :] * stride_hi
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def down_kernel(
    h_ptr, h_desc, w2_ptr, w_desc, s2_ptr, y_ptr, topk_w_ptr,
    sorted_ids_ptr, block_slot_ptr, num_padded_ptr,
    num_valid, H, I,
    stride_hm, stride_hi,
    stride_we, stride_wn, stride_wi,
    stride_se, stride_sn,
    stride_ym, stride_yh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ALIGN_M: tl.constexpr, INT8_W: tl.constexpr, TMA_W: tl.constexpr, FLATTEN: tl.constexpr, CT: tl.constexpr,
    UPCAST: tl.constexpr, SORTED_H: tl.constexpr, TMA_H: tl.constexpr,
):
    """y[n, :] = topk_w[n] * (w2_s @ h[n, :]) summed in fp32, stored in y's dtype (fp32, or bf16
    for a bf16 output), for every token-slot n routed to slot s.

    h [N, I]; w2 [S, H, I]; s2 [S, H] fp32 (INT8_W only); topk_w [N] fp32; y [N, H].
    Rows of y whose token-slot is not on the GPU are left unwritten (the combine never reads them).
    TMA_W: weight tiles through w_desc, a TMA descriptor of w2 seen as [S*H, I] ([BLOCK_N, BLOCK_K]
    boxes; rows past this expert's H only feed columns that are never stored, columns past I read as
    zeros). FLATTEN: as gate_up_kernel.
    SORTED_H: h is [P, I] in the sorted order (gate_up_kernel's SORTED_H): a tile's rows are one
    contiguous block, read through h_desc (TMA_H: a TMA descriptor of h, [BLOCK_M, BLOCK_K] boxes) or
    pointers. H200, qwen3 int8 T=4096: 98.4 -> 88.2 us with TMA_H (docs/decisions.md).
    """
    num_pid_m = tl.load(num_padded_ptr) // BLOCK_M
    num_pid_n = tl.cdiv(H, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=FLATTEN):
        pid_m, pid_n, slot, offs_m, tok_slot, m_mask = _tile_rows(
            tile, num_pid_m, num_pid_n, block_slot_ptr, sorted_ids_ptr, num_valid, BLOCK_M, ALIGN_M, GROUP_M)
        row = tl.where(m_mask, tok_slot, 0).to(tl.int64)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)

        h_row = offs_m.to(tl.int64) if SORTED_H else row
        a_ptrs = h_ptr + h_row[:, None] * stride_hm + offs_k[None, :] * stride_hi
        b_ptrs = w2_ptr + slot * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wi
        w_row = (slot * H + pid_n * BLOCK_N).to(tl.int32)  # TMA_W: in the [S*H, I] view
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, tl.cdiv(I, BLOCK_K)):
            k_mask = offs_k < I - kb * BLOCK_K
            if TMA_H:  # (padding rows: whatever h holds there; their outputs are not stored)
                a = h_desc.load([(pid_m * BLOCK_M).to(tl.int32), kb * BLOCK_K])
            else:
                a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a = _cast(a, CT, UPCAST)
            if TMA_W:
                b = w_desc.load([w_row, kb * BLOCK_K])
                acc = tl.dot(a, tl.trans(_cast(b, CT, UPCAST)), acc)
            else:
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                acc = tl.dot(a, _cast(b, CT, UPCAST), acc)
            a_ptrs += BLOCK_K * stride_hi
            b_ptrs += BLOCK_K * stride_wi
        if INT8_W:
            s = tl.load(s2_ptr + slot * stride_se + offs_n * stride_sn, mask=n_mask, other=0.0)
            acc = acc * s[None, :]
        rw = tl.load(topk_w_ptr + row, mask=m_mask, other=0.0)
        acc = acc * rw[:, None]
        y_ptrs = y_ptr + row[:, None] * stride_ym + offs_n[None, :] * stride_yh
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def combine_kernel(
    y_ptr, slot_ptr, out_ptr,
    H,
    stride_ym, stride_yh, stride_ot, stride_oh,
    TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """out[t, :] = sum over k with slot[t*K + k] >= 0 of y[t*K + k, :], summed in fp32 in k order.

    y [N, H] fp32 or bf16 (widened to fp32 here); slot [N] int32 (-1 = not on the GPU); out [T, H] in
    its own dtype. Every element of out is written (zeros for a token with no GPU expert), and the sum
    order is fixed, so the result is deterministic. The token's K slots are read as one vector (KP =
    next power of two >= K) and the k loop is unrolled, so the K row loads go out together instead of
    each behind its own slot load.
    """
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs < H
    kk = tl.arange(0, KP)
    sv = tl.load(slot_ptr + t * TOP_K + kk, mask=kk < TOP_K, other=-1)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        on = tl.sum(tl.where((kk == k) & (sv >= 0), 1, 0), 0)
        on_gpu = (offs * 0 + on) > 0  # a block-shaped mask (a scalar & block mask fails in the interpreter)
        v = tl.load(y_ptr + (t * TOP_K + k) * stride_ym + offs * stride_yh, mask=h_mask & on_gpu, other=0.0)
        acc += v.to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


# ----------------------------------------------------------------------------- direct path (decode)
# For few token-slots (N <= a few dozen) the sorted path's fixed cost (an alignment launch, a combine
# launch and a fp32 [N, H] round trip) is most of the time. The direct path is two launches: gate+up
# with one program per (slot, column block) that finds its own token-slots by scanning all N ids, and
# down with one program per (token, column block) that sums the token's GPU experts in k order (the
# combine folded in; the order is fixed, so the result is deterministic).

@triton.jit
def gate_up_scan_kernel(
    x_ptr, w13_ptr, s13_ptr, h_ptr, ids_ptr, e2s_ptr,
    N, E, H, I, top_k,
    stride_xt, stride_xh,
    stride_we, stride_wn, stride_wh,
    stride_se, stride_sn,
    stride_hm, stride_hi,
    NP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INT8_W: tl.constexpr, CT: tl.constexpr, UPCAST: tl.constexpr,
):
    """h[n, :] = silu(gate_s x_t) * (up_s x_t) for the token-slots n = t*K + k routed to slot
    s = program_id(0); program_id(1) picks BLOCK_N columns. NP >= N (a power of two >= 16): all ids are
    read at once and the slot's rows form one masked [NP, BLOCK_K] tile, so each weight tile is read
    once however many tokens share the slot. A program whose slot has no token-slot does nothing.
    Shapes and dtypes as gate_up_kernel; ids [N] int, e2s [E] int32."""
    slot = tl.program_id(0)
    offs_p = tl.arange(0, NP)
    p_in = offs_p < N
    e = tl.load(ids_ptr + offs_p, mask=p_in, other=-1).to(tl.int32)
    e_ok = p_in & (e >= 0) & (e < E)
    sl = tl.load(e2s_ptr + tl.where(e_ok, e, 0), mask=e_ok, other=-1)
    mine = e_ok & (sl == slot)
    if tl.sum(mine.to(tl.int32), 0) > 0:
        tok = tl.where(mine, offs_p // top_k, 0).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        slot64 = slot.to(tl.int64)
        a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
        g_ptrs = w13_ptr + slot64 * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wh
        acc_g, acc_u = _gate_up_acc(a_ptrs, g_ptrs, g_ptrs + I * stride_wn, w13_ptr, 0, I, mine, n_mask, H,
                                    stride_xh, stride_wh, NP, BLOCK_N, BLOCK_K, False, CT, UPCAST)
        h = _silu_up(acc_g, acc_u, s13_ptr, slot64, offs_n[None, :], n_mask[None, :], I, stride_se, stride_sn,
                     INT8_W)
        h_ptrs = h_ptr + tl.where(mine, offs_p, 0).to(tl.int64)[:, None] * stride_hm + offs_n[None, :] * stride_hi
        tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=mine[:, None] & n_mask[None, :])


@triton.jit
def gate_up_pairs_kernel(
    x_ptr, w13_ptr, s13_ptr, h_ptr, ids_ptr, e2s_ptr,
    E, S, H, I, top_k,
    stride_xt, stride_xh,
    stride_we, stride_wn, stride_wh,
    stride_se, stride_sn,
    stride_hm, stride_hi,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    INT8_W: tl.constexpr, CT: tl.constexpr, UPCAST: tl.constexpr,
):
    """h[n, cols] = silu(gate_s x_t) * (up_s x_t) for token-slot n = program_id(0) (if on the GPU) and
    BLOCK_N columns picked by program_id(1), as a GEMV: any BLOCK_N (no tensor-core minimum), so a
    decode step has enough programs in flight to pull HBM bandwidth. Token-slots sharing a slot read
    its rows again (from L2: their programs run side by side). Products in fp32 of the values the
    compute dtype gives (exact for bf16/int8). STAGES > 1 pipelines the k loop (cp.async into
    shared memory, STAGES - 1 steps of weights in flight ahead of the sums): Triton pipelines a
    loop without tl.dot only when asked."""
    n = tl.program_id(0).to(tl.int64)
    e = tl.load(ids_ptr + n).to(tl.int32)
    e_ok = (e >= 0) & (e < E)
    s = tl.load(e2s_ptr + tl.where(e_ok, e, 0))
    if e_ok & (s >= 0) & (s < S):
        t = n // top_k
        s64 = s.to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        g_ptrs = w13_ptr + s64 * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :] * stride_wh
        u_ptrs = g_ptrs + I * stride_wn
        # elementwise fp32 sums, reduced over k once after the loop: a reduction per step would put
        # shuffles and a block barrier (BLOCK_K spans warps) between every step's loads and the next
        acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for kb in tl.range(0, tl.cdiv(H, BLOCK_K), num_stages=STAGES):
            k_mask = offs_k < H - kb * BLOCK_K
            xv = tl.load(x_ptr + t * stride_xt + (kb * BLOCK_K + offs_k) * stride_xh, mask=k_mask, other=0.0)
            xv = _cast(xv, CT, UPCAST).to(tl.float32)
            g = tl.load(g_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            u = tl.load(u_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc_g += _cast(g, CT, UPCAST).to(tl.float32) * xv[None, :]
            acc_u += _cast(u, CT, UPCAST).to(tl.float32) * xv[None, :]
            g_ptrs += BLOCK_K * stride_wh
            u_ptrs += BLOCK_K * stride_wh
        h = _silu_up(tl.sum(acc_g, 1), tl.sum(acc_u, 1), s13_ptr, s64, offs_n, n_mask, I, stride_se, stride_sn,
                     INT8_W)
        tl.store(h_ptr + n * stride_hm + offs_n * stride_hi, h.to(h_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def down_tokens_kernel(
    h_ptr, w2_ptr, s2_ptr, out_ptr, topk_w_ptr, ids_ptr, e2s_ptr,
    E, S, H, I,
    stride_hm, stride_hi,
    stride_we, stride_wn, stride_wi,
    stride_se, stride_sn,
    stride_ot, stride_oh,
    TOP_K: tl.constexpr, KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    INT8_W: tl.constexpr, UPCAST: tl.constexpr,
):
    """out[t, cols] = sum over k (in order) with a GPU slot s of topk_w[t, k] * (w2_s @ h[t*K + k])[cols]
    for t = program_id(0), cols = BLOCK_N columns picked by program_id(1); fp32 sums, out in its dtype
    (zeros for a token with no GPU expert). The token's K ids, slots and weights are read as vectors
    up front (KP = next power of two >= K), so that no expert's weights wait behind K chains of
    dependent id/slot loads; the k loop is unrolled, and an expert off the GPU takes no trip
    through its reduction loop.
    h [N, I]; w2 [S, H, I]; s2 [S, H] fp32 (INT8_W only). Products are formed in fp32 from the exact h
    and weight values (bf16 x bf16 products are exact in fp32). STAGES pipelines the k loop as in
    gate_up_pairs_kernel."""
    t = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    kk = tl.arange(0, KP)
    kk_in = kk < TOP_K
    ev = tl.load(ids_ptr + t * TOP_K + kk, mask=kk_in, other=-1).to(tl.int32)
    e_ok = kk_in & (ev >= 0) & (ev < E)
    sv = tl.load(e2s_ptr + tl.where(e_ok, ev, 0), mask=e_ok, other=-1)
    on_v = e_ok & (sv >= 0) & (sv < S)
    rwv = tl.load(topk_w_ptr + t * TOP_K + kk, mask=on_v, other=0.0)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        n = t * TOP_K + k
        sel = kk == k
        on = tl.sum(tl.where(sel & on_v, 1, 0), 0)
        s64 = tl.sum(tl.where(sel & on_v, sv, 0), 0).to(tl.int64)
        rw = tl.sum(tl.where(sel, rwv, 0.0), 0)
        on_n = n_mask & ((offs_n * 0 + on) > 0)  # block-shaped (see combine_kernel)
        part2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)  # summed over k after the loop (as pairs)
        # no trip for a token-slot off the GPU: masked-off steps still cost (mixtral int8 T=1: 42 -> 26 us)
        for kb in tl.range(0, tl.cdiv(I, BLOCK_K) * on, num_stages=STAGES):
            k_mask = offs_k < I - kb * BLOCK_K
            hv = tl.load(h_ptr + n * stride_hm + (kb * BLOCK_K + offs_k) * stride_hi, mask=k_mask, other=0.0)
            wv = tl.load(w2_ptr + s64 * stride_we + offs_n[:, None] * stride_wn
                         + (kb * BLOCK_K + offs_k)[None, :] * stride_wi,
                         mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            if INT8_W and not UPCAST:  # int8 -> bf16: exact, byte permutes; int8 -> fp32: I2F, quarter rate
                wv = wv.to(tl.bfloat16)
            part2 += wv.to(tl.float32) * hv.to(tl.float32)[None, :]
        part = tl.sum(part2, 1)
        if INT8_W:
            part = part * tl.load(s2_ptr + s64 * stride_se + offs_n * stride_sn, mask=on_n, other=0.0)
        acc += tl.where(on_n, part * rw, 0.0)
    tl.store(out_ptr + t * stride_ot + offs_n * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=n_mask)
