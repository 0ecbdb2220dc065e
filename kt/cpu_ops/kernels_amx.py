"""AMX (AMX-INT8 / AMX-BF16 tiles): INT8, INT4 and BF16 GEMM kernels, small-M and large-M paths.

Contract and data layout: kt/cpu_ops/README.md and packing.py. Tile registers: C (accumulators)
0-3 everywhere; GEMM A 4-5 and B 6-7, GEMV A 4 and B 5-7 (two config builders). A B tile is 16
"k4 rows" (int8: 4 k of 16 outputs; bf16: 2 k) of 64 bytes; in the packed layout the B tile of
(block b, k-step s) is the contiguous 1 KiB at ``data[b, 16 s : 16 s + 16]``, 64-byte stride.

- ``gemv_*`` (decode, small M): A tiles are loaded straight from the activations with the row
  stride; the tile config has ``rows = min(M, 16)`` (reloaded once for a tail of rows). Four
  16-output blocks per pass share one A tile (C 0-3, A 4, B 5-7 in rotation), and the B lines of
  the k-step 4 ahead are prefetched into L1. M = 8 costs what M = 1 costs.
- ``gemm_*`` (prefill): A is first copied into tile order (zero rows pad M to a multiple of 32, so
  every tile is full and the config never changes); 2x2 tiles = a 32x32 output per step. The
  default since session 18 is the staged kernel (``gemm_*_staged``, ``_staged_pair``): per M chunk
  and 16-output block pair, K slices of at most 16 k-steps (the pair's 32 KiB B slice stays in L1
  while the chunk's A tiles stream past with the non-temporal load), partial sums between slices
  in a small buffer, each panel software-pipelined (each tile load issued right after the last
  product reading its register, two products before its use), the next block pairs prefetched
  into L2, the output lines prefetched for writing (``pfw``: the MoE layer's outputs were last
  written by other cores), and each panel's epilogue (scaling, stores) run a few rows at a time
  between the next panel's products. One core, M=512: 1.3-1.5x the whole-K pipelined kernel
  (``gemm_*_pipe``, the default of sessions 2-17, which loads both operands from L2 at every
  k-step and stalls the tile unit for its epilogue); in the 16-thread layer the two are equal
  (it is bound by the weight stream). The older ``gemm_*_blocked`` kernels (K slices, no
  pipelining) and ``gemm_*_pipe`` stay for comparison. INT4 on other scales than the quantiser's
  (``gemm_int4_blocked``): M chunks (about 512 KiB of A) x pairs of blocks x K slices x panels,
  the next (pair, slice) prefetched into L2.

INT4 prefill: the quantiser's group scales are s_row * r_g with small integers r_g
(``reference.int4_ratio_scales``), so ``gemm_int4`` unpacks each block pair to the int8 values
r_g * q and runs the INT8 staged loop with one fp32 scaling at the end (``gemm_int4_staged``; its
whole-K predecessor ``gemm_int4_ratio`` was 1.3 / 1.4x faster than the flush kernel at INT4
T=512 / 2048 on 16 threads). Up to 128 rows (a prefill layer's experts) ``gemm_int4_inline``
unpacks each k-step just before its products instead, once per block pair, and makes each pair's
ratios as it reaches the pair. Scales of another form take the flush kernel, ``gemm_int4_blocked``:

INT4 flush kernel: each group's nibbles are unpacked to *signed* int8 (q = nibble - 8) in a small scratch
tile and multiplied with ``tdpbssd``; the int32 tile is flushed into an fp32 accumulator with the
group's scales after every group (G = 32 uses half-depth tiles: K 32 per instruction, so no tile
straddles two groups). The alternative, ``tdpbsud`` on the raw nibble q + 8 with a per-(token,
group) correction 8 * sum(x), saves one subtract per unpacked byte but adds one per accumulator
element at every group flush. The flush is the INT4 hot spot (it runs once per group per 16x16
tile, the unpack once per group per B tile and is then reused by every row tile of an M chunk), so
the signed unpack is the cheaper side in prefill and costs only ~16 vector ops per KiB of B in decode.

Epilogues (int32 -> fp32 scaling, INT4 group flush), the A copy and the INT4 unpack use the 64-byte
row intrinsics of ``_amx`` (LLVM leaves such short Numba loops scalar, which cost 2-3x the tile
work). Every tuning knob is an argument of ``gemv_*_pf`` / ``gemm_*_blocked``.

This module calls ``_amx.require_amx()`` at import: it raises unless ``kt.cpu_ops.isa`` found AMX
runnable (hardware and arch_prctl permission), so no AMX code is compiled or run elsewhere.
"""
import numpy as np
from numba import njit

from . import cache
from ._simd import empty_line, line_elems
from ..reference import INT4_RATIO_MAX
from ._amx import (copy64, copy64_stream, ldtilecfg, prefetch_l1, prefetch_l2, prefetch_w, ratio_row16, require_amx,
                   row16_fma, row16_max, row16_mul_store, row16_scale_bits, row16_scale_store,
                   row16_scale_stream, set_tilecfg, sfence, tdpbf16ps, tdpbssd, tilezero, tileloadd64,
                   tileloaddt164, tilerelease, tilestored64,
                   unpack_int4_group_mul, unpack_int4_line)

AMX_MODE = require_amx()
cache.install()

_NO_XS = np.zeros(1, np.float32)  # xs / scale of a BF16 call of the shared INT8/BF16 bodies (unused)
_NO_SCALE = np.zeros((1, 1, 16), np.float32)  # INT4 group scales of a call that does not read them

__all__ = ["gemv_int8", "gemm_int8", "gemv_int4", "gemm_int4", "gemv_bf16", "gemm_bf16", "gemm_int8_shared_out",
           "gemm_int8_stream_out", "gemm_int4_tab_stream_out", "gemm_bf16_stream_out", "STREAM_OUT_FORM",
           "gemv_int8_pf", "gemv_int4_pf", "gemv_bf16_pf", "gemm_int8_blocked", "gemm_int4_blocked",
           "gemm_bf16_blocked", "gemm_int8_pipe", "gemm_bf16_pipe", "gemm_int8_staged",
           "gemm_bf16_staged", "gemm_int4_staged", "gemm_int4_inline", "gemm_int4_ratio",
           "peak_int8", "peak_bf16", "default_mc"]

# The contract entry points (gemv_*, gemm_*) pass their tuning as literal arguments to the
# *_pf / *_blocked kernels; the values were chosen from the device sweeps in
# benchmarks/results/amx_device.md (one Emerald Rapids core, N=1536, D=2048):
# - GEMV B prefetch 4 k-steps ahead: cold-weight M=1 decode 185 -> 126 us (int8), 385 -> 247 us
#   (bf16); warm and M=8 within +-8 %.
# - GEMM mc = ~512 KiB of A, whole K per slice when D <= 2048 (int8 kcs=32, bf16 kcs=64), no A
#   prefetch: int8 M=512 2.15 TOPS = 41 % of the 5.2 TOPS tile-resident peak; bf16 0.99 TFLOPS
#   = 37 % of 2.6; A prefetch (pf=2) was 2-7 % slower in every configuration.


# ----------------------------------------------------------------------------- shared helpers

@njit(nogil=True, cache=True)
def _config(cfg, rows, kbytes):
    """GEMM config: C 0-3 rows x 64 B, A 4-5 rows x kbytes, B 6-7 kbytes/4 x 64 B."""
    for i in range(64):
        cfg[i] = 0
    for t in range(4):
        set_tilecfg(cfg, t, rows, 64)
    set_tilecfg(cfg, 4, rows, kbytes)
    set_tilecfg(cfg, 5, rows, kbytes)
    set_tilecfg(cfg, 6, kbytes // 4, 64)
    set_tilecfg(cfg, 7, kbytes // 4, 64)
    ldtilecfg(cfg)


@njit(nogil=True, cache=True)
def _config_gemv(cfg, rows, kbytes):
    """GEMV config: C 0-3 rows x 64 B, A 4 rows x kbytes, B 5-7 kbytes/4 x 64 B (three B tiles
    in rotation, so a B load need not wait for the previous product on the same register)."""
    for i in range(64):
        cfg[i] = 0
    for t in range(4):
        set_tilecfg(cfg, t, rows, 64)
    set_tilecfg(cfg, 4, rows, kbytes)
    for t in range(5, 8):
        set_tilecfg(cfg, t, kbytes // 4, 64)
    ldtilecfg(cfg)


@njit(nogil=True, cache=True)
def default_mc(row_bytes):
    """Rows of an M chunk (a multiple of 32, at least 32): about 512 KiB of A (L2-resident), or
    up to 256 rows while that stays within 1 MiB. Every chunk streams the weights again: with
    128-row chunks (512 KiB of BF16 rows at D=2048) half the experts of a qwen3 T=2048 layer
    (128 +- 11 rows each) streamed their gate+up weights twice; 256 rows made the BF16 layer
    7-9 % faster on the device (profile_moe variants mc192 / mc256, session 9)."""
    budget = min(1 << 20, max(1 << 19, 256 * row_bytes))
    return max(budget // row_bytes // 32 * 32, 32)


@njit(nogil=True, cache=True)
def _pack_a(x, ks, kel):
    """x [M, ks * kel] -> [2 * ceil(M / 32), ks, 16, kel]: every A tile as 1 KiB, zero-padded rows.

    kel * itemsize must be 64 (int8: 64, bf16 bits: 32)."""
    m_all = x.shape[0]
    xel = x.strides[0] // x.itemsize
    mt = (m_all + 31) // 32 * 2
    a = empty_line(mt * ks * 16 * kel, x.dtype).reshape((mt, ks, 16, kel))
    for m in range(m_all, mt * 16):  # padding rows only
        for s in range(ks):
            for c in range(kel):
                a[m // 16, s, m % 16, c] = 0
    # in the packed order (each tile's 16 rows, then the next k-step): the writes stream, the
    # reads are 16 row streams (1 MiB, M=512 K=2048: 45 vs 56 us row by row, dev, session 26)
    for t in range((m_all + 15) // 16):
        r1 = min(16, m_all - t * 16)
        for s in range(ks):
            for i in range(r1):
                copy64(a, ((t * ks + s) * 16 + i) * kel, x, (t * 16 + i) * xel + s * kel)
    return a


@njit(nogil=True, cache=True)
def _unpack_int4(data, src_line, nlines, dst, dst_off):
    """INT4 lines [src_line, src_line + nlines) of ``data`` (uint8, flat line index) -> signed int8
    k4 rows of ``dst`` from byte dst_off: line j gives rows 2j (low nibbles) and 2j+1 (high)."""
    for j in range(nlines):
        unpack_int4_line(data, (src_line + j) * 64, dst, dst_off + j * 128)


# ----------------------------------------------------------------------------- INT8

@njit(nogil=True, cache=True)
def _gemv_pf(a, data, out, nb0, nb1, pf, bf, xs, scale, l2):
    """The small-M kernel of ``gemv_int8_pf`` (bf False: int8 A, int32 sums scaled by
    xs[m] * scale[n]) and ``gemv_bf16_pf`` (bf True: bf16-bits A, fp32 sums copied); pf: B
    prefetch distance in k-steps (0: none), into L1 (prefetcht0) or with l2 into L2 (prefetcht1)."""
    m_all = a.shape[0]
    kel = line_elems(a)             # A elements per 64-byte k-step row
    ks = a.shape[1] // kel
    sb = 16 * line_elems(data)      # data elements per k-step tile
    xst = a.strides[0]
    xel = xst // a.itemsize
    ost = out.strides[0] // 4
    blk = data.shape[1] * (32 if bf else 64)
    cfg = np.zeros(64, np.uint8)
    cb = empty_line(1024, np.int32).reshape((16, 64))
    cbf = cb.view(np.float32)
    rows_cfg = 0
    for m0 in range(0, m_all, 16):
        r = min(16, m_all - m0)
        if r != rows_cfg:
            _config_gemv(cfg, r, 64)
            rows_cfg = r
        xo = m0 * xel
        for b in range(nb0, nb1, 4):
            nq = min(4, nb1 - b)
            o = b * blk
            tilezero(0)
            tilezero(1)
            tilezero(2)
            tilezero(3)
            for s in range(ks):
                if pf > 0 and s + pf < ks:
                    for q in range(nq):
                        pb = o + q * blk + (s + pf) * sb
                        if l2:
                            for ln in range(16):
                                prefetch_l2(data, pb + kel * ln)
                        else:
                            for ln in range(16):
                                prefetch_l1(data, pb + kel * ln)
                tileloadd64(4, a, xo + kel * s, xst)
                tileloadd64(5, data, o + sb * s, 64)
                if bf:
                    tdpbf16ps(0, 4, 5)
                else:
                    tdpbssd(0, 4, 5)
                if nq > 1:
                    tileloadd64(6, data, o + blk + sb * s, 64)
                    if bf:
                        tdpbf16ps(1, 4, 6)
                    else:
                        tdpbssd(1, 4, 6)
                if nq > 2:
                    tileloadd64(7, data, o + 2 * blk + sb * s, 64)
                    if bf:
                        tdpbf16ps(2, 4, 7)
                    else:
                        tdpbssd(2, 4, 7)
                if nq > 3:
                    tileloadd64(5, data, o + 3 * blk + sb * s, 64)
                    if bf:
                        tdpbf16ps(3, 4, 5)
                    else:
                        tdpbssd(3, 4, 5)
            tilestored64(0, cb, 0, 256)
            if nq > 1:
                tilestored64(1, cb, 16, 256)
            if nq > 2:
                tilestored64(2, cb, 32, 256)
            if nq > 3:
                tilestored64(3, cb, 48, 256)
            n0 = 16 * b
            for i in range(r):
                for q in range(nq):
                    oi = (m0 + i) * ost + n0 + 16 * q
                    if bf:
                        copy64(out, oi, cbf, i * 64 + 16 * q)
                    else:
                        row16_scale_store(out, oi, cb, i * 64 + 16 * q, scale, n0 + 16 * q,
                                          xs[m0 + i])
    tilerelease()


@njit(nogil=True, cache=True)
def gemv_int8_pf(xq, xs, data, scale, out, nb0, nb1, pf):
    """``gemv_int8`` with an explicit B prefetch distance of pf k-steps (0: none)."""
    _gemv_pf(xq, data, out, nb0, nb1, pf, False, xs, scale, False)


@njit(nogil=True, cache=True)
def gemv_int8(xq, xs, data, scale, wsum, out, nb0, nb1):
    """Small-M INT8: out[m, n] = xs[m] * scale[n] * sum_k xq[m, k] q[n, k] for n in blocks [nb0, nb1).

    xq int8 [M, d_pad]; xs fp32 [M]; data int8 [NB, d_pad/4, 16, 4]; scale fp32 [n_pad];
    wsum unused (signed x signed needs no compensation); out fp32 [M, >= 16 nb1].
    """
    gemv_int8_pf(xq, xs, data, scale, out, nb0, nb1, 4)


@njit(nogil=True, cache=True)
def _pipe_panel(ap, a0, a1, data, o0, o1, ks, sb, bf, pfb, nxt0, nxt1, pl0, per, nlines,
                out, wo, wst, wrows, wtwo):
    """One 32x32 output panel over all ks k-steps into tiles C 0-3, software-pipelined.

    A rows of the panel at ap[a0:], ap[a1:] and B blocks at data[o0:], data[o1:] (flat element
    indices), sb elements per k-step (a 1 KiB tile). Every tile load is issued right after the
    last product that reads its register's previous contents and two products before its own
    use, so its latency hides behind the products between (tile registers are not renamed).
    bf: tdpbf16ps instead of tdpbssd. pfb > 0: prefetch B of k-step s + pfb into L1 (cold B).
    per > 0: also prefetch ``per`` lines per k-step of the next block pair (data[nxt0:] then
    data[nxt1:], nlines lines each, continuing at line pl0) into L2; returns the next line.
    wrows > 0: request ownership (prefetchw) of the output lines the epilogue will write, spread
    over the k-steps: out[wo + r * wst] for r < wrows (and the next 16 elements if wtwo), so the
    stores into rows another core wrote last do not wait for their lines.
    Leaves the products in C 0-3 (C0 = rows 0-15 x block 0, C1 = x block 1, C2/C3 rows 16-31).
    """
    lw = line_elems(data)  # elements per line
    wper = (wrows + ks - 1) // ks
    tilezero(0)
    tilezero(1)
    tilezero(2)
    tilezero(3)
    tileloadd64(4, ap, a0, 64)
    tileloadd64(6, data, o0, 64)
    tileloadd64(5, ap, a1, 64)
    tileloadd64(7, data, o1, 64)
    pl = pl0
    for s in range(ks):
        if pfb > 0 and s + pfb < ks:
            for ln in range(16):
                prefetch_l1(data, o0 + (s + pfb) * sb + lw * ln)
                prefetch_l1(data, o1 + (s + pfb) * sb + lw * ln)
        for _ in range(per):
            if pl < nlines:
                prefetch_l2(data, nxt0 + lw * pl)
            elif pl < 2 * nlines:
                prefetch_l2(data, nxt1 + lw * (pl - nlines))
            pl += 1
        for q in range(s * wper, min((s + 1) * wper, wrows)):
            prefetch_w(out, wo + q * wst)
            if wtwo:
                prefetch_w(out, wo + q * wst + 16)
        nxt = s + 1 < ks
        if bf:
            tdpbf16ps(0, 4, 6)
            tdpbf16ps(1, 4, 7)
        else:
            tdpbssd(0, 4, 6)
            tdpbssd(1, 4, 7)
        if nxt:
            tileloadd64(4, ap, a0 + (s + 1) * sb, 64)
        if bf:
            tdpbf16ps(2, 5, 6)
        else:
            tdpbssd(2, 5, 6)
        if nxt:
            tileloadd64(6, data, o0 + (s + 1) * sb, 64)
        if bf:
            tdpbf16ps(3, 5, 7)
        else:
            tdpbssd(3, 5, 7)
        if nxt:
            tileloadd64(5, ap, a1 + (s + 1) * sb, 64)
            tileloadd64(7, data, o1 + (s + 1) * sb, 64)
    return pl


@njit(nogil=True, cache=True, inline="always")
def _store_panel(cp, cpf, out, m0, ost, n0, rows, two, bf, scale, so, xs):
    """Tiles C 0-3 (a 32x32 panel of rows m0.., columns n0..) -> out.

    A full panel (32 rows, both blocks) is stored straight into out: the fp32 sums (bf), or the
    int32 sums, which ``_scale_full`` turns into fp32 once the M chunk is done. Staging the tiles
    and scaling 64 rows here, between one panel's products and the next one's, kept the tile unit
    idle: on the device the INT8 GEMM ran 1.1-1.4x faster without it (benchmarks/
    amx_panel_probe.py, session 8). Other panels go through cp (the [32, 32] int32 staging
    buffer, cpf the same as fp32): the fp32 sums copied, or the int32 sums times
    xs[m] * scale[so + j]; the second 16 columns only if two."""
    if rows == 32 and two:
        tilestored64(0, out, m0 * ost + n0, 4 * ost)
        tilestored64(1, out, m0 * ost + n0 + 16, 4 * ost)
        tilestored64(2, out, (m0 + 16) * ost + n0, 4 * ost)
        tilestored64(3, out, (m0 + 16) * ost + n0 + 16, 4 * ost)
        return
    tilestored64(0, cp, 0, 128)
    tilestored64(1, cp, 16, 128)
    tilestored64(2, cp, 512, 128)
    tilestored64(3, cp, 528, 128)
    for i in range(rows):
        oi = (m0 + i) * ost + n0
        if bf:
            copy64(out, oi, cpf, i * 32)
        else:
            row16_scale_store(out, oi, cp, i * 32, scale, so, xs[m0 + i])
        if two:
            if bf:
                copy64(out, oi + 16, cpf, i * 32 + 16)
            else:
                row16_scale_store(out, oi + 16, cp, i * 32 + 16, scale, so + 16, xs[m0 + i])


@njit(nogil=True, cache=True)
def _scale_full(out, ost, m0, m1, m_all, nb0, nb1, scale, s0, xs):
    """The int32 sums ``_store_panel`` left in the full panels of M chunk [m0, m1) x blocks
    [nb0, nb1) -> fp32 times xs[m] * scale[16 b - s0 + j], in place. Full panels: rows below
    m_all rounded down to 32, blocks of whole pairs (an odd last block was scaled when stored)."""
    m1 = min(m1, m_all // 32 * 32)
    b1 = nb1 - (nb1 - nb0) % 2
    for m in range(m0, m1):
        for b in range(nb0, b1):
            row16_scale_bits(out, m * ost + 16 * b, scale, 16 * b - s0, xs[m])


@njit(nogil=True, cache=True)
def _pipe_pair_prefetch(b, nb0, nb1, blk, npan, ks, dist):
    """(first and second half's offsets, lines per half, lines per k-step) of the L2 prefetch
    while block pair b is computed: the pair ``dist`` pairs ahead, and at the first pair also
    every pair before it; zero lines when there is none (or dist is 0). The kernels use dist=2:
    one pair ahead was 10 % slower on the device with 16 threads and cold weights
    (amx_panel_probe, session 9: INT8 gate+up 0.910 vs 0.818 TOPS per thread, down 0.657 vs
    0.603, medians)."""
    if dist <= 0:
        return 0, 0, 0, 0
    lo = (b + 2 if b == nb0 else b + 2 * dist) * blk
    hi = min(b + 2 * dist + 2, nb1) * blk
    if hi <= lo:
        return 0, 0, 0, 0
    lw = blk // (ks * 16)            # elements per line
    tot = (hi - lo) // lw
    nlines = (tot + 1) // 2
    per = (tot + npan * ks - 1) // (npan * ks)
    return lo, lo + nlines * lw, nlines, per


@njit(nogil=True, cache=True)
def _gemm_pipe(a, data, out, nb0, nb1, mc, pfb, l2, pfw, bf, xs, scale):
    """The pipelined large-M GEMM of ``gemm_int8_pipe`` (bf False: int8 A, int32 products scaled
    by xs[m] * scale[n]) and ``gemm_bf16_pipe`` (bf True: bf16-bits A, fp32 products copied).
    pfw: prefetch each panel's output lines for writing while it is computed (outputs that
    another core wrote last: the MoE layer's shared gu / y rows)."""
    m_all = a.shape[0]
    kel = line_elems(a)             # A elements per 64-byte k-step row
    ks = a.shape[1] // kel
    sb = 16 * line_elems(data)      # data elements per k-step tile
    ost = out.strides[0] // 4
    blk = data.shape[1] * (32 if bf else 64)
    ap = _pack_a(a, ks, kel)
    mpad = ap.shape[0] * 16
    cp = empty_line(1024, np.int32).reshape((32, 32))
    cpf = cp.view(np.float32)
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, 64)
    for mc0 in range(0, mpad, mc):
        mc1 = min(mc0 + mc, mpad)
        npan = (mc1 - mc0) // 32
        for b in range(nb0, nb1, 2):
            o0 = b * blk
            # an odd last block pairs with itself (its second product is computed, not stored)
            o1 = o0 + blk if b + 1 < nb1 else o0
            n0, n1, nlines, per = _pipe_pair_prefetch(b, nb0, nb1, blk, npan, ks, l2)
            pl = 0
            for mp in range(mc0, mc1, 32):
                a0 = (mp // 16) * ks * sb
                rows = min(32, m_all - mp)
                pl = _pipe_panel(ap, a0, a0 + ks * sb, data, o0, o1, ks, sb, bf,
                                 pfb if mp == mc0 else 0, n0, n1, pl, per, nlines,
                                 out, mp * ost + 16 * b, ost, rows if pfw else 0, b + 1 < nb1)
                _store_panel(cp, cpf, out, mp, ost, 16 * b, rows, b + 1 < nb1, bf, scale, 16 * b, xs)
        if not bf:
            _scale_full(out, ost, mc0, mc1, m_all, nb0, nb1, scale, 0, xs)
    tilerelease()


@njit(nogil=True, cache=True)
def gemm_int8_pipe(xq, xs, data, scale, out, nb0, nb1, mc, pfb, l2, pfw):
    """Large-M INT8, software-pipelined (``_pipe_panel``), whole K per panel, mc rows per M chunk;
    pfb: L1 prefetch distance of cold B (k-steps, 0: none); l2: prefetch the block pair l2
    pairs ahead into L2 while this one is computed (0: none; 2 by default); pfw: prefetch the
    output lines for writing. Same result as ``gemv_int8``."""
    _gemm_pipe(xq, data, out, nb0, nb1, mc, pfb, l2, pfw, False, xs, scale)


@njit(nogil=True, cache=True)
def gemm_bf16_pipe(xb, data, out, nb0, nb1, mc, pfb, l2, pfw):
    """Large-M BF16 with the pipelined panel of ``gemm_int8_pipe`` (tdpbf16ps, 32 k per step).
    Same result as ``gemm_bf16`` (the same per-panel fp32 summation order over K)."""
    _gemm_pipe(xb, data, out, nb0, nb1, mc, pfb, l2, pfw, True, _NO_XS, _NO_XS)


@njit(nogil=True, cache=True, inline="always")
def _drain(out, ost, cp, cpf, st, q0, q1, bf, scale, xs, nt):
    """Half-rows q in [q0, q1) of the panel staged in cp (int32 [32 x 32]; row q >> 1, columns
    16 (q & 1)..; cpf: the same buffer as fp32) -> out: the fp32 sums copied (bf), or the int32
    sums times xs[m] * scale[so + j]; stored non-temporally where nt (out's rows on lines).
    st: the staged panel (first row, first column, rows, two blocks, scale offset; st[0] < 0:
    none)."""
    pm = st[0]
    pn = st[1]
    for q in range(q0, min(q1, 2 * st[2])):
        h = (q & 1) * 16
        if h == 0 or st[3]:
            i = q >> 1
            oi = (pm + i) * ost + pn + h
            if bf and nt:
                copy64_stream(out, oi, cpf, i * 32 + h)
            elif bf:
                copy64(out, oi, cpf, i * 32 + h)
            elif nt:
                row16_scale_stream(out, oi, cp, i * 32 + h, scale, st[4] + h, xs[pm + i])
            else:
                row16_scale_store(out, oi, cp, i * 32 + h, scale, st[4] + h, xs[pm + i])


@njit(nogil=True, cache=True, inline="always")
def _prefetch_w_rows(out, o, ost, rows, two, i, per):
    """Step i of requesting the output rows [o, o + rows * ost) for writing, per rows a step (both
    16-column halves where two). Under ``if pfw`` in the staged loop, so that a kernel compiled
    with pfw False carries none of it (its counters had held the loop's state on the stack: one
    core, M=512 N=1536 K=2048, ~4 % slower)."""
    for q in range(i * per, min((i + 1) * per, rows)):
        prefetch_w(out, o + q * ost)
        if two:
            prefetch_w(out, o + q * ost + 16)


@njit(nogil=True, cache=True)
def _staged_pair(ap, mc0, mc1, m_all, bd, o0, o1, ks, kcs, out, ost, n0, two, cp, cpart, st,
                 bf, scale, so, xs, pf0, pf1, nlines, per, pfw, nta, nt):
    """Every (K slice, 32-row panel) unit of one block pair (16-output blocks at bd[o0:], bd[o1:])
    over the M chunk [mc0, mc1) of the packed A ap, in that order; output columns n0...

    K is cut into the fewest slices of at most kcs k-steps (equal up to one), so the pair's B slice
    (kcs KiB per block) stays in L1 while the chunk's panels stream their A tiles past it with the
    non-temporal hint; a panel's partial sums wait in cpart between slices (its own 4 KiB, 128-byte
    rows, no cache-set conflicts). A panel's last slice stores its tiles into cp, and the next unit
    writes them out (``_drain``, a few rows after each k-step's first two products) while its own
    products run, so the epilogue overlaps the tile unit instead of stalling it. The panel loop is
    software-pipelined as ``_pipe_panel``'s. per > 0: ``per`` lines per k-step of the L2 prefetch
    of ``_pipe_pair_prefetch`` (pf0, pf1, nlines). pfw: request ownership of the output lines of
    a panel's last slice spread over its k-steps. nt: the drain's stores are non-temporal."""
    sa = 16 * line_elems(ap)          # elements per 1 KiB tile (constants: see line_elems)
    sb = 16 * line_elems(bd)
    lw = line_elems(bd)
    cpf = cp.view(np.float32)
    nsl = (ks + kcs - 1) // kcs
    kc = (ks + nsl - 1) // nsl
    pl = 0
    for k0 in range(0, ks, kc):
        k1 = min(k0 + kc, ks)
        dper = (63 + k1 - k0) // (k1 - k0)
        for mp in range(mc0, mc1, 32):
            a0 = (mp // 16) * ks * sa
            a1 = a0 + ks * sa
            ci = (mp - mc0) // 32 * 1024
            rows = min(32, m_all - mp)
            wper = (rows + k1 - k0 - 1) // (k1 - k0) if pfw and k1 == ks else 0
            if k0 == 0:
                tilezero(0)
                tilezero(1)
                tilezero(2)
                tilezero(3)
            else:
                tileloadd64(0, cpart, ci, 128)
                tileloadd64(1, cpart, ci + 16, 128)
                tileloadd64(2, cpart, ci + 512, 128)
                tileloadd64(3, cpart, ci + 528, 128)
            if nta:
                tileloaddt164(4, ap, a0 + k0 * sa, 64)
            else:
                tileloadd64(4, ap, a0 + k0 * sa, 64)
            tileloadd64(6, bd, o0 + k0 * sb, 64)
            if nta:
                tileloaddt164(5, ap, a1 + k0 * sa, 64)
            else:
                tileloadd64(5, ap, a1 + k0 * sa, 64)
            tileloadd64(7, bd, o1 + k0 * sb, 64)
            for s in range(k0, k1):
                for _ in range(per):
                    if pl < nlines:
                        prefetch_l2(bd, pf0 + lw * pl)
                    elif pl < 2 * nlines:
                        prefetch_l2(bd, pf1 + lw * (pl - nlines))
                    pl += 1
                if pfw and k1 == ks:
                    _prefetch_w_rows(out, mp * ost + n0, ost, rows, two, s - k0, wper)
                nxt = s + 1 < k1
                if bf:
                    tdpbf16ps(0, 4, 6)
                    tdpbf16ps(1, 4, 7)
                else:
                    tdpbssd(0, 4, 6)
                    tdpbssd(1, 4, 7)
                if st[0] >= 0:
                    _drain(out, ost, cp, cpf, st, (s - k0) * dper, (s - k0 + 1) * dper, bf, scale, xs, nt)
                if nxt:
                    if nta:
                        tileloaddt164(4, ap, a0 + (s + 1) * sa, 64)
                    else:
                        tileloadd64(4, ap, a0 + (s + 1) * sa, 64)
                if bf:
                    tdpbf16ps(2, 5, 6)
                else:
                    tdpbssd(2, 5, 6)
                if nxt:
                    tileloadd64(6, bd, o0 + (s + 1) * sb, 64)
                if bf:
                    tdpbf16ps(3, 5, 7)
                else:
                    tdpbssd(3, 5, 7)
                if nxt:
                    if nta:
                        tileloaddt164(5, ap, a1 + (s + 1) * sa, 64)
                    else:
                        tileloadd64(5, ap, a1 + (s + 1) * sa, 64)
                    tileloadd64(7, bd, o1 + (s + 1) * sb, 64)
            st[0] = -1  # drained: dper * (k1 - k0) >= 64 half-rows
            if k1 == ks:
                tilestored64(0, cp, 0, 128)
                tilestored64(1, cp, 16, 128)
                tilestored64(2, cp, 512, 128)
                tilestored64(3, cp, 528, 128)
                st[0] = mp
                st[1] = n0
                st[2] = rows
                st[3] = 1 if two else 0
                st[4] = so
            else:
                tilestored64(0, cpart, ci, 128)
                tilestored64(1, cpart, ci + 16, 128)
                tilestored64(2, cpart, ci + 512, 128)
                tilestored64(3, cpart, ci + 528, 128)


@njit(nogil=True, cache=True)
def _staged_buffers(mc):
    """(cp, cpart, st) of the staged kernels: the staging panel, the partial sums of an M chunk
    of mc rows, and the staged panel's state (none yet)."""
    st = np.empty(5, np.int64)
    st[0] = -1
    return empty_line(1024, np.int32), empty_line((mc // 32) * 1024, np.int32), st


@njit(nogil=True, cache=True)
def _gemm_staged(a, data, out, nb0, nb1, mc, kcs, l2, pfw, nta, bf, xs, scale, nt):
    """The staged large-M GEMM of ``gemm_int8_staged`` (bf False) and ``gemm_bf16_staged`` (bf
    True): M chunks of mc rows x block pairs x ``_staged_pair``; the last staged panel is
    written out at the end. nt: the output is stored non-temporally, and fenced before the
    return (with bf, only the last K slice's sums reach out: the partial sums wait in cpart)."""
    m_all = a.shape[0]
    kel = line_elems(a)
    ks = a.shape[1] // kel
    ost = out.strides[0] // 4
    blk = data.shape[1] * (32 if bf else 64)
    ap = _pack_a(a, ks, kel)
    mpad = ap.shape[0] * 16
    mc = min(mc, mpad)
    cp, cpart, st = _staged_buffers(mc)
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, 64)
    for mc0 in range(0, mpad, mc):
        mc1 = min(mc0 + mc, mpad)
        for b in range(nb0, nb1, 2):
            o0 = b * blk
            two = b + 1 < nb1
            # an odd last block pairs with itself (its second product is computed, not stored)
            pf0, pf1, nlines, per = _pipe_pair_prefetch(b, nb0, nb1, blk, (mc1 - mc0) // 32, ks, l2)
            _staged_pair(ap, mc0, mc1, m_all, data, o0, o0 + blk if two else o0, ks, kcs, out, ost,
                         16 * b, two, cp, cpart, st, bf, scale, 16 * b, xs, pf0, pf1, nlines, per,
                         pfw, nta, nt)
    if st[0] >= 0:
        _drain(out, ost, cp, cp.view(np.float32), st, 0, 64, bf, scale, xs, nt)
    if nt:
        sfence()
    tilerelease()


@njit(nogil=True, cache=True)
def gemm_int8_staged(xq, xs, data, scale, out, nb0, nb1, mc, kcs, l2, pfw, nta, nt=False):
    """Large-M INT8, staged (``_staged_pair``): K slices of at most kcs k-steps (16: a block pair's
    32 KiB slice of B fits L1), mc rows per M chunk, A streamed with the non-temporal hint (nta;
    False: plain loads), each panel's epilogue overlapped with the next panel's products; l2 / pfw
    as ``gemm_int8_pipe``. nt: store the output with non-temporal stores (a ValueError unless out's
    rows start on 64-byte lines: the stores would fault). Same result as ``gemv_int8``."""
    if nt and not _out_on_lines(out):
        raise ValueError("gemm_int8_staged: nt=True needs an output whose address and row stride "
                         "are multiples of 64 bytes")
    _gemm_staged(xq, data, out, nb0, nb1, mc, kcs, l2, pfw, nta, False, xs, scale, nt)


@njit(nogil=True, cache=True)
def gemm_bf16_staged(xb, data, out, nb0, nb1, mc, kcs, l2, pfw, nta):
    """Large-M BF16 with the staged kernel of ``gemm_int8_staged`` (tdpbf16ps, 32 k per step;
    partial sums in fp32 between K slices, so the summation order over K is that of
    ``gemm_bf16``'s panels)."""
    _gemm_staged(xb, data, out, nb0, nb1, mc, kcs, l2, pfw, nta, True, _NO_XS, _NO_XS, False)


@njit(nogil=True, cache=True)
def _gemm_int8(xq, xs, data, scale, out, nb0, nb1, pfw, stream):
    """``gemm_int8`` / ``gemm_int8_shared_out`` / ``gemm_int8_stream_out``: the staged kernel with K sliced as follows. K is
    not sliced (32 k-steps: all of qwen3's gate+up) when the rows fit one M chunk, as a layer's
    experts do up to T=2048: in the layer, T=2048 was 0-8 % faster that way (three dev runs; 4 %
    in one device run, the other within its noise) and T=512 level or faster (session 21), though
    one core alone at M=128 on warm weights was 6 % slower. Above one chunk (issue 3's one core at
    M=512: 10 % faster) 16. Rows whose A fits 1 MiB make one M chunk (M=512 at K=2048, which
    ``default_mc`` cuts in two): the weights stream once instead of twice. stream: 0 never
    non-temporal stores, 1 for an output over 1 MiB on lines (``_streams_out``), 2 for any output
    on lines; otherwise the output lines are requested for writing where pfw."""
    m = xq.shape[0]
    mc = default_mc(xq.shape[1])
    kcs = 32 if m <= mc else 16
    if m * xq.shape[1] <= 1 << 20:
        mc = max(mc, (m + 31) // 32 * 32)
    # two calls with literal flags, so that each compiles a loop with only its own store form
    if (stream == 2 and _out_on_lines(out)) or (stream == 1 and _streams_out(out, m, nb1 - nb0)):
        _gemm_staged(xq, data, out, nb0, nb1, mc, kcs, 2, False, True, False, xs, scale, True)
    else:
        _gemm_staged(xq, data, out, nb0, nb1, mc, kcs, 2, pfw, True, False, xs, scale, False)


@njit(nogil=True, cache=True)
def _streams_out(out, m, nblocks):
    """Whether a GEMM writes its output with non-temporal stores: an output larger than 1 MiB
    (half the L2, which it leaves anyway; it then goes to memory without being read first) whose
    rows start on 64-byte boundaries (the stores fault otherwise). One core, M=512 N=1536 K=2048:
    8-12 % faster than plain stores (dev, session 28)."""
    return m * nblocks * 64 > 1 << 20 and _out_on_lines(out)


@njit(nogil=True, cache=True)
def _out_on_lines(out):
    """Whether every row of the fp32 output starts on a 64-byte line (its rows contiguous)."""
    return out.ctypes.data % 64 == 0 and out.strides[0] % 64 == 0 and out.strides[1] == 4


@njit(nogil=True, cache=True)
def gemm_int8(xq, xs, data, scale, wsum, out, nb0, nb1):
    """Large-M INT8 (same contract as ``gemv_int8``): the staged kernel (``gemm_int8_staged``: K
    slices of 16 k-steps, the block pair two ahead prefetched into L2). One core, M=512 (session
    18, dev and device, fast-state rounds): 1.26-1.29x the pipelined ``gemm_int8_pipe`` at N=1536
    K=2048, 1.5x at N=2048 K=768; the 16-thread layer the same within the noise.
    The output is not prefetched for writing: a caller's own output gains nothing from it (one
    core, M=512: 4-9 % faster without, sessions 19-26). An output over 1 MiB whose rows start on
    64-byte lines is written with non-temporal stores (``_streams_out``; one core, M=512: 8-12 %
    faster, session 28), so it is not in the caches afterwards. The MoE layer, whose output rows
    were last written by other cores and are read next, takes ``gemm_int8_shared_out`` instead."""
    _gemm_int8(xq, xs, data, scale, out, nb0, nb1, False, 1)


@njit(nogil=True, cache=True)
def gemm_int8_shared_out(xq, xs, data, scale, wsum, out, nb0, nb1):
    """``gemm_int8`` with each panel's output lines requested for writing during its last K slice
    (``prefetch_w``): for outputs whose lines other cores wrote last, as the MoE layer's shared
    gate+up and down rows are (session 3: such an output made the down GEMM 2x slower). The layer
    was 15-18 % slower at T=2048 without it on 2 dev threads and 6-9 % on the device's 16 (qwen3,
    session 20), and T=512 1-5 % slower."""
    _gemm_int8(xq, xs, data, scale, out, nb0, nb1, True, 0)


@njit(nogil=True, cache=True)
def gemm_int8_stream_out(xq, xs, data, scale, wsum, out, nb0, nb1):
    """``gemm_int8`` with non-temporal stores whenever the output rows start on 64-byte lines
    (else as ``gemm_int8_shared_out``): for the MoE layer's down outputs of a large chunk, which
    leave the core's caches before the combine reads them, so reading each line before writing
    it is traffic for nothing."""
    _gemm_int8(xq, xs, data, scale, out, nb0, nb1, True, 2)


# ----------------------------------------------------------------------------- INT4

@njit(nogil=True, cache=True)
def gemv_int4(xq, xs, data, scale, group_size, out, nb0, nb1):
    """Small-M INT4: out[m, n] = xs[m] * sum_g scale[n, g] * sum_{k in g} xq[m, k] q[n, k].

    xq int8 [M, d_pad]; xs fp32 [M]; data uint8 [NB, d_pad/8, 16, 4] (nibbles q + 8);
    scale fp32 [NB, d_pad/G, 16]; group_size G in {32, 64, 128}; out fp32 [M, >= 16 nb1].
    """
    gemv_int4_pf(xq, xs, data, scale, group_size, out, nb0, nb1, 0)


@njit(nogil=True, cache=True)
def gemv_int4_pf(xq, xs, data, scale, group_size, out, nb0, nb1, pfg):
    """``gemv_int4`` prefetching the packed lines pfg groups ahead into L1 (0: none; the default
    of ``gemv_int4`` until a device sweep says otherwise)."""
    g = group_size
    tk = min(g, 64)
    spg = g // tk
    ng = xq.shape[1] // g
    m_all = xq.shape[0]
    xst = xq.strides[0]
    ost = out.strides[0] // 4
    lines = data.shape[1]
    bs = empty_line(64 * g, np.int8)       # 4 blocks x G/4 k4 rows x 64 B
    cb = empty_line(1024, np.int32).reshape((16, 64))
    acc = empty_line(1024, np.float32).reshape((16, 64))
    cfg = np.zeros(64, np.uint8)
    rows_cfg = 0
    for m0 in range(0, m_all, 16):
        r = min(16, m_all - m0)
        if r != rows_cfg:
            _config_gemv(cfg, r, tk)
            rows_cfg = r
        xo = m0 * xst
        for b in range(nb0, nb1, 4):
            nq = min(4, nb1 - b)
            acc[:, :] = 0.0
            for gi in range(ng):
                if pfg > 0 and gi + pfg < ng:
                    for q in range(nq):
                        pl = (b + q) * lines + (gi + pfg) * (g // 8)
                        for ln in range(g // 8):
                            prefetch_l1(data, (pl + ln) * 64)
                for q in range(nq):
                    _unpack_int4(data, (b + q) * lines + gi * (g // 8), g // 8, bs, q * 16 * g)
                tilezero(0)
                tilezero(1)
                tilezero(2)
                tilezero(3)
                for t in range(spg):
                    xk = xo + gi * g + t * tk
                    bo = t * tk * 16
                    tileloadd64(4, xq, xk, xst)
                    tileloadd64(5, bs, bo, 64)
                    tdpbssd(0, 4, 5)
                    if nq > 1:
                        tileloadd64(6, bs, 16 * g + bo, 64)
                        tdpbssd(1, 4, 6)
                    if nq > 2:
                        tileloadd64(7, bs, 32 * g + bo, 64)
                        tdpbssd(2, 4, 7)
                    if nq > 3:
                        tileloadd64(5, bs, 48 * g + bo, 64)
                        tdpbssd(3, 4, 5)
                tilestored64(0, cb, 0, 256)
                if nq > 1:
                    tilestored64(1, cb, 16, 256)
                if nq > 2:
                    tilestored64(2, cb, 32, 256)
                if nq > 3:
                    tilestored64(3, cb, 48, 256)
                for q in range(nq):
                    so = ((b + q) * ng + gi) * 16
                    for i in range(r):
                        row16_fma(acc, i * 64 + 16 * q, cb, i * 64 + 16 * q, scale, so)
            n0 = 16 * b
            for i in range(r):
                xm = xs[m0 + i]
                for q in range(nq):
                    row16_mul_store(out, (m0 + i) * ost + n0 + 16 * q, acc, i * 64 + 16 * q, xm)
    tilerelease()


@njit(nogil=True, cache=True)
def gemm_int4_blocked(xq, xs, data, scale, group_size, out, nb0, nb1, mc, kc, l2, pfw):
    """Large-M INT4 with explicit blocking: mc rows per M chunk (multiple of 32), kc K per slice
    (a multiple of 64 and of G); l2: while a (block pair, K slice) is computed, prefetch the
    packed lines of the next one into L2 (cold weights); pfw: during a panel's last K slice,
    prefetch its output lines for writing (as ``gemm_int8_pipe``). Same result as
    ``gemv_int4``."""
    g = group_size
    tk = min(g, 64)
    spg = g // tk
    m_all = xq.shape[0]
    d_pad = xq.shape[1]
    ks = d_pad // 64
    ng = d_pad // g
    ost = out.strides[0] // 4
    lines = data.shape[1]
    ap = _pack_a(xq, ks, 64)
    mpad = ap.shape[0] * 16
    bs = empty_line(32 * kc, np.int8)      # 2 blocks x kc/4 k4 rows x 64 B
    acc = empty_line(mc * 32, np.float32).reshape((mc, 32))
    cb = empty_line(1024, np.int32).reshape((32, 32))
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, tk)
    for mc0 in range(0, mpad, mc):
        mc1 = min(mc0 + mc, mpad)
        for b in range(nb0, nb1, 2):
            two = b + 1 < nb1
            for k0 in range(0, d_pad, kc):
                k1 = min(k0 + kc, d_pad)
                _unpack_int4(data, b * lines + k0 // 8, (k1 - k0) // 8, bs, 0)
                if two:
                    _unpack_int4(data, (b + 1) * lines + k0 // 8, (k1 - k0) // 8, bs, 16 * kc)
                # the next (pair, K slice) in loop order: its lines, spread over this one's groups
                nb_, nk0 = (b, k1) if k1 < d_pad else (b + 2, 0)
                nkl = (min(nk0 + kc, d_pad) - nk0) // 8 if nb_ < nb1 else 0
                nlast = nb_ + 1 if nb_ + 1 < nb1 else nb_
                iters = (mc1 - mc0) // 32 * ((k1 - k0) // g)
                per = (2 * nkl + iters - 1) // iters if l2 else 0
                pl = 0
                for mp in range(mc0, mc1, 32):
                    lr = mp - mc0
                    rv = min(32, m_all - mp)
                    if k0 == 0:
                        acc[lr:lr + 32, :] = 0.0
                    t0 = mp // 16
                    wrows = rv if pfw and k1 == d_pad else 0
                    wper = (wrows * g + k1 - k0 - 1) // (k1 - k0)  # rows per group
                    wq = 0
                    for gi in range(k0 // g, k1 // g):
                        for _ in range(wper):
                            if wq < wrows:
                                prefetch_w(out, (mp + wq) * ost + 16 * b)
                                if two:
                                    prefetch_w(out, (mp + wq) * ost + 16 * b + 16)
                            wq += 1
                        for _ in range(per):
                            if pl < nkl:
                                prefetch_l2(data, (nb_ * lines + nk0 // 8 + pl) * 64)
                            elif pl < 2 * nkl:
                                prefetch_l2(data, (nlast * lines + nk0 // 8 + pl - nkl) * 64)
                            pl += 1
                        tilezero(0)
                        tilezero(1)
                        tilezero(2)
                        tilezero(3)
                        for t in range(spg):
                            kk = gi * g + t * tk
                            ao = (t0 * ks + kk // 64) * 1024 + kk % 64
                            bo = (kk - k0) * 16
                            tileloadd64(4, ap, ao, 64)
                            tileloadd64(6, bs, bo, 64)
                            tdpbssd(0, 4, 6)
                            tileloadd64(5, ap, ao + ks * 1024, 64)
                            tdpbssd(2, 5, 6)
                            if two:
                                tileloadd64(7, bs, 16 * kc + bo, 64)
                                tdpbssd(1, 4, 7)
                                tdpbssd(3, 5, 7)
                        tilestored64(0, cb, 0, 128)
                        tilestored64(2, cb, 512, 128)
                        if two:
                            tilestored64(1, cb, 16, 128)
                            tilestored64(3, cb, 528, 128)
                        s0 = (b * ng + gi) * 16
                        for i in range(rv):
                            row16_fma(acc, (lr + i) * 32, cb, i * 32, scale, s0)
                        if two:
                            for i in range(rv):
                                row16_fma(acc, (lr + i) * 32 + 16, cb, i * 32 + 16, scale,
                                          s0 + ng * 16)
                    if k1 == d_pad:
                        n0 = 16 * b
                        for i in range(rv):
                            xm = xs[mp + i]
                            row16_mul_store(out, (mp + i) * ost + n0, acc, (lr + i) * 32, xm)
                            if two:
                                row16_mul_store(out, (mp + i) * ost + n0 + 16, acc,
                                                (lr + i) * 32 + 16, xm)
    tilerelease()


@njit(nogil=True, cache=True)
def _block_ratios(scale, b, lb, srow, rx, m, inv):
    """``_int4_ratios`` for block b alone, stored as the lb-th block of srow / rx (m, inv: 16-float
    scratch lines)."""
    ng = scale.shape[1]
    m[:] = 0.0
    for g in range(ng):
        row16_max(m, 0, scale, (b * ng + g) * 16)
    for c in range(16):
        sr = np.float32(m[c] / np.float32(INT4_RATIO_MAX))
        srow[lb * 16 + c] = sr
        inv[c] = np.float32(np.float32(1.0) / sr) if sr > 0 else np.float32(0.0)
    for g in range(ng):
        if not ratio_row16(scale, (b * ng + g) * 16, inv, 0, srow, lb * 16, rx, (lb * ng + g) * 16,
                           INT4_RATIO_MAX):
            return False
    return True


@njit(nogil=True, cache=True)
def _int4_ratios(scale, nb0, nb1, srow, rx):
    """Whether every group scale of blocks [nb0, nb1) is s_row * r_g with r_g an integer in
    [0, INT4_RATIO_MAX] (``reference.int4_ratio_scales``, the quantiser's rule); if so, srow
    [16 (nb1 - nb0)] holds each column's s_row and rx [(nb1 - nb0) * ng * 16] each (block, group)'s
    16 ratios (int8, one per column: ``unpack_int4_group_mul`` spreads each over its 4 k)."""
    m = empty_line(16, np.float32)
    inv = empty_line(16, np.float32)
    for b in range(nb0, nb1):
        if not _block_ratios(scale, b, b - nb0, srow, rx, m, inv):
            return False
    return True


@njit(nogil=True, cache=True, inline="always")
def _unpack_kstep(data, b, lines, s, lpg, ng, lb, rx, bs, bo):
    """k-step s of packed INT4 block b (its 8 lines) -> the 1 KiB int8 tile r_g * q at bs[bo:]
    (lb: the block's index in rx). A k-step is one group of 64 or half a group of 128 (one ratio
    vector for its 8 lines), or two groups of 32."""
    src = (b * lines + 8 * s) * 64
    if lpg >= 8:
        unpack_int4_group_mul(data, src, bs, bo, rx, (lb * ng + 8 * s // lpg) * 16, 8)
    else:
        unpack_int4_group_mul(data, src, bs, bo, rx, (lb * ng + 2 * s) * 16, 4)
        unpack_int4_group_mul(data, src + 256, bs, bo + 512, rx, (lb * ng + 2 * s + 1) * 16, 4)


@njit(nogil=True, cache=True)
def _unpack_pair_ratio(data, b, nb0, nb1, ng, lpg, rx, bs, blk):
    """Blocks b and b + 1 (if < nb1) of packed INT4 ``data`` -> the int8 values r_g * q in bs
    (block q at bs[q * blk:], k-step tiles of 1 KiB), rx as ``_int4_ratios`` made it for blocks
    from nb0; lpg packed lines per group of ng. While unpacking, the pair two blocks on is
    prefetched into L2."""
    lines = data.shape[1]
    for q in range(2 if b + 1 < nb1 else 1):
        nxt = b + 2 + q
        for s in range(lines // 8):
            if nxt < nb1:
                for i in range(8):
                    prefetch_l2(data, (nxt * lines + 8 * s + i) * 64)
            _unpack_kstep(data, b + q, lines, s, lpg, ng, b + q - nb0, rx, bs, q * blk + s * 1024)


@njit(nogil=True, cache=True)
def gemm_int4_ratio(xq, xs, data, group_size, srow, rx, out, nb0, nb1, mc, pfw):
    """Large-M INT4 for scales of the form s_row * r_g (``_int4_ratios`` gives srow and rx): each
    block pair's nibbles are unpacked to the int8 values r_g * q (exact: |r_g q| <= 126), once per
    M chunk of mc rows, and multiplied as INT8 by the pipelined panel of ``gemm_int8_pipe``; the
    int32 sums over all of K are scaled by xs[m] * s_row[n]. No per-group flush: the same sum as
    ``gemv_int4`` (sum_g s_row r_g sum_k x q), exact up to the fp32 epilogue. While a pair is
    unpacked, the next pair's packed lines are prefetched into L2 (two pairs ahead measured the
    same in the layer, session 9); pfw as ``gemm_int8_pipe``."""
    g = group_size
    d_pad = xq.shape[1]
    ks = d_pad // 64
    ng = d_pad // g
    lpg = g // 8                     # packed lines per group
    m_all = xq.shape[0]
    ost = out.strides[0] // 4
    ap = _pack_a(xq, ks, 64)
    mpad = ap.shape[0] * 16
    blk = ks * 1024                  # one unpacked block: ks k-step tiles of 1 KiB
    bs = empty_line(2 * blk, np.int8)
    cp = empty_line(1024, np.int32).reshape((32, 32))
    cpf = cp.view(np.float32)
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, 64)
    for mc0 in range(0, mpad, mc):
        mc1 = min(mc0 + mc, mpad)
        for b in range(nb0, nb1, 2):
            two = b + 1 < nb1
            _unpack_pair_ratio(data, b, nb0, nb1, ng, lpg, rx, bs, blk)
            o1 = blk if two else 0
            so = (b - nb0) * 16
            for mp in range(mc0, mc1, 32):
                a0 = (mp // 16) * ks * 1024
                rows = min(32, m_all - mp)
                _pipe_panel(ap, a0, a0 + ks * 1024, bs, 0, o1, ks, 1024, False, 0, 0, 0, 0, 0, 0,
                            out, mp * ost + 16 * b, ost, rows if pfw else 0, two)
                _store_panel(cp, cpf, out, mp, ost, 16 * b, rows, two, False, srow, so, xs)
        _scale_full(out, ost, mc0, mc1, m_all, nb0, nb1, srow, 16 * nb0, xs)
    tilerelease()


@njit(nogil=True, cache=True)
def gemm_int4_staged(xq, xs, data, group_size, srow, rx, out, nb0, nb1, mc, kcs, pfw, nta, nt=False):
    """``gemm_int4_ratio`` with the staged INT8 loop (``_staged_pair``, K slices of at most kcs
    k-steps) in place of the whole-K pipelined panel: each block pair is unpacked to r_g * q once
    per M chunk, then multiplied slice by slice. nt: non-temporal output stores (out's rows must
    start on 64-byte lines: the caller checks). Same result as ``gemm_int4_ratio``."""
    g = group_size
    ks = xq.shape[1] // 64
    ng = xq.shape[1] // g
    lpg = g // 8                     # packed lines per group
    m_all = xq.shape[0]
    ost = out.strides[0] // 4
    ap = _pack_a(xq, ks, 64)
    mpad = ap.shape[0] * 16
    mc = min(mc, mpad)
    blk = ks * 1024                  # one unpacked block: ks k-step tiles of 1 KiB
    bs = empty_line(2 * blk, np.int8)
    cp, cpart, st = _staged_buffers(mc)
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, 64)
    for mc0 in range(0, mpad, mc):
        mc1 = min(mc0 + mc, mpad)
        for b in range(nb0, nb1, 2):
            two = b + 1 < nb1
            _unpack_pair_ratio(data, b, nb0, nb1, ng, lpg, rx, bs, blk)
            _staged_pair(ap, mc0, mc1, m_all, bs, 0, blk if two else 0, ks, kcs, out, ost, 16 * b, two,
                         cp, cpart, st, False, srow, (b - nb0) * 16, xs, 0, 0, 0, 0, pfw, nta, nt)
    if st[0] >= 0:
        _drain(out, ost, cp, cp.view(np.float32), st, 0, 64, False, srow, xs, nt)
    if nt:
        sfence()
    tilerelease()


@njit(nogil=True, cache=True)
def gemm_int4_inline(xq, xs, data, group_size, srow, rx, out, nb0, nb1, l2, pfw, keep=False, nt=False):
    """Small-M INT4 (the experts of a prefill layer: tens of rows) on ratio scales, as
    ``gemm_int4_staged`` computes it but unpacking each k-step's two B tiles just before its
    products, into a two-slot ring of 2 KiB that stays in L1, instead of a whole block pair into a
    64 KiB buffer first: the unpack of k-step s + 1 (vector work) runs while the tile unit does
    k-step s. Every 32-row panel unpacks again, so this pays only for one or two panels (at M=32
    the pair unpack was ~40 % of the call). l2 > 0: prefetch the packed lines of the block pair l2
    pairs ahead into L2, a k-step's worth per k-step. pfw as ``gemm_int8_staged``. keep: the first
    panel unpacks every k-step into a whole-K buffer of the pair (2 KiB per k-step) instead of the
    ring, and the later panels multiply from it without unpacking again (for 2-4 panels: the
    unpack still overlaps the first panel's products, once per pair). nt as
    ``gemm_int4_staged``. Same result as ``gemm_int4_staged``."""
    _int4_inline(xq, xs, data, group_size, srow, rx, out, nb0, nb1, l2, pfw, keep, _NO_SCALE, False, nt)


@njit(nogil=True, cache=True)
def _int4_inline(xq, xs, data, group_size, srow, rx, out, nb0, nb1, l2, pfw, keep, scale, lazy, nt):
    """The body of ``gemm_int4_inline`` (nt: non-temporal output stores). lazy: srow / rx are not made yet; each block pair's
    ratios are made from ``scale`` (``_block_ratios``) just before the pair is first unpacked, and
    the group scales of the pair l2 ahead are prefetched with its packed lines, so reading the
    scales overlaps the products instead of preceding the call. Returns nb1, or (lazy) the first
    block of the first pair with a block whose scales are not of the ratio form: the blocks from
    there on are not computed."""
    g = group_size
    ks = xq.shape[1] // 64
    ng = xq.shape[1] // g
    lpg = g // 8
    lines = data.shape[1]
    m_all = xq.shape[0]
    ost = out.strides[0] // 4
    ap = _pack_a(xq, ks, 64)
    mpad = ap.shape[0] * 16
    keep = keep and mpad > 32
    # 2 slots (keep: ks slots) x (block 0, block 1) x 1 KiB
    ring = empty_line(ks * 2048 if keep else 4096, np.int8)
    cp, cpart, st = _staged_buffers(32)
    cpf = cp.view(np.float32)
    mx = empty_line(16, np.float32)
    inv = empty_line(16, np.float32)
    sper = (ng + ks - 1) // ks          # scale lines (16 floats: one group of a block) per k-step
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, 64)
    stop = nb1
    for b in range(nb0, nb1, 2):
        two = b + 1 < nb1
        b1 = b + 1 if two else b
        pb = b + 2 * l2
        if lazy:
            if not _block_ratios(scale, b, b - nb0, srow, rx, mx, inv):
                stop = b
                break
            if two and not _block_ratios(scale, b1, b1 - nb0, srow, rx, mx, inv):
                stop = b
                break
        for mp in range(0, mpad, 32):
            a0 = (mp // 16) * ks * 1024
            a1 = a0 + ks * 1024
            rows = min(32, m_all - mp)
            wrows = rows if pfw else 0
            wper = (wrows + ks - 1) // ks
            wo = mp * ost + 16 * b
            dper = (63 + ks) // ks
            tilezero(0)
            tilezero(1)
            tilezero(2)
            tilezero(3)
            unp = mp == 0 or not keep
            if unp:
                _unpack_kstep(data, b, lines, 0, lpg, ng, b - nb0, rx, ring, 0)
                _unpack_kstep(data, b1, lines, 0, lpg, ng, b1 - nb0, rx, ring, 1024)
            tileloadd64(4, ap, a0, 64)
            tileloadd64(6, ring, 0, 64)
            tileloadd64(5, ap, a1, 64)
            tileloadd64(7, ring, 1024, 64)
            for s in range(ks):
                nxt = s + 1 < ks
                so = (s + 1 if keep else (s + 1) % 2) * 2048     # the ring slot of k-step s + 1
                if l2 > 0 and mp == 0 and pb < nb1:
                    for j in range(8 * s, 8 * s + 8):
                        prefetch_l2(data, (pb * lines + j) * 64)
                        if pb + 1 < nb1:
                            prefetch_l2(data, ((pb + 1) * lines + j) * 64)
                    if lazy:
                        for q in range(s * sper, min((s + 1) * sper, ng)):
                            prefetch_l2(scale, (pb * ng + q) * 16)
                            if pb + 1 < nb1:
                                prefetch_l2(scale, ((pb + 1) * ng + q) * 16)
                for q in range(s * wper, min((s + 1) * wper, wrows)):
                    prefetch_w(out, wo + q * ost)
                    if two:
                        prefetch_w(out, wo + q * ost + 16)
                tdpbssd(0, 4, 6)
                tdpbssd(1, 4, 7)
                if st[0] >= 0:
                    _drain(out, ost, cp, cpf, st, s * dper, (s + 1) * dper, False, srow, xs, nt)
                if nxt:
                    if unp:
                        _unpack_kstep(data, b, lines, s + 1, lpg, ng, b - nb0, rx, ring, so)
                        _unpack_kstep(data, b1, lines, s + 1, lpg, ng, b1 - nb0, rx, ring, so + 1024)
                    tileloadd64(4, ap, a0 + (s + 1) * 1024, 64)
                tdpbssd(2, 5, 6)
                if nxt:
                    tileloadd64(6, ring, so, 64)
                tdpbssd(3, 5, 7)
                if nxt:
                    tileloadd64(5, ap, a1 + (s + 1) * 1024, 64)
                    tileloadd64(7, ring, so + 1024, 64)
            tilestored64(0, cp, 0, 128)   # the staged panel was drained: dper * ks >= 64
            tilestored64(1, cp, 16, 128)
            tilestored64(2, cp, 512, 128)
            tilestored64(3, cp, 528, 128)
            st[0] = mp
            st[1] = 16 * b
            st[2] = rows
            st[3] = 1 if two else 0
            st[4] = (b - nb0) * 16
    if st[0] >= 0:
        _drain(out, ost, cp, cpf, st, 0, 64, False, srow, xs, nt)
    if nt:
        sfence()
    tilerelease()
    return stop


# the most rows gemm_int4 gives its inline kernel (keep mode); more go to the staged kernel
INT4_INLINE_MAX_M = 128


@njit(nogil=True, cache=True)
def gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1):
    """Large-M INT4 (same contract as ``gemv_int4``). Scales of the quantiser's form s_row * r_g
    (every matrix ``reference.quantize`` or the converter made): ``gemm_int4_staged``, INT8 speed
    with no per-group flush; up to 128 rows (four panels) ``gemm_int4_inline``, which unpacks as it
    multiplies (one core, M=20-32, cold weights: 1.2-1.5x the staged kernel, medians), its first
    panel keeping the unpacked pair for the others (the qwen3 INT4 layer on two threads, T=512 /
    2048: 7.5 / 10 % faster than with the staged kernel above 32 rows, session 20) and making each
    block pair's ratios as it reaches the pair. Other scales (weights quantised elsewhere):
    ``gemm_int4_blocked``, 2x2 tiles with the per-group fp32 flush, from the first pair whose
    scales are not of the ratio form on."""
    _gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1, 1)


@njit(nogil=True, cache=True)
def _gemm_int4(xq, xs, data, scale, group_size, out, nb0, nb1, l2):
    """``gemm_int4`` with the inline kernel's L2 prefetch l2 block pairs ahead (``gemm_int4``: 1;
    other distances for ``benchmarks/profile_moe.py``'s variants)."""
    nbr = max(nb1 - nb0, 0)
    srow = empty_line(nbr * 16, np.float32)
    rx = empty_line(nbr * scale.shape[1] * 16, np.int8)
    mc = default_mc(xq.shape[1])
    if xq.shape[0] <= INT4_INLINE_MAX_M:
        nb0 = _int4_inline(xq, xs, data, group_size, srow, rx, out, nb0, nb1, l2, True, True, scale,
                           True, False)
    elif _int4_ratios(scale, nb0, nb1, srow, rx):
        gemm_int4_staged(xq, xs, data, group_size, srow, rx, out, nb0, nb1, mc, 16, True, True)
        return
    if nb0 < nb1:
        gemm_int4_flush(xq, xs, data, scale, group_size, out, nb0, nb1)


@njit(nogil=True, cache=True)
def gemm_int4_flush(xq, xs, data, scale, group_size, out, nb0, nb1):
    """Large-M INT4 (the ``gemm_int4`` contract) on the per-group flush kernel alone
    (``gemm_int4_blocked``): exact for every stored value, -8 included, which the ratio kernels'
    int8 products r_g * q cannot hold for r_g >= 17 (``packing.int4_has_minus8``). Not
    registered: ``CPUMoE`` and ``gemm.linear`` take it for weights holding -8, and ``gemm_int4``
    for the blocks whose scales are not of the ratio form."""
    kc = max(512, group_size)
    gemm_int4_blocked(xq, xs, data, scale, group_size, out, nb0, nb1, default_mc(xq.shape[1]), kc,
                      True, True)


@njit(nogil=True, cache=True)
def gemm_int4_tab(xq, xs, data, tab, group_size, out, nb0, nb1):
    """``gemm_int4`` on a matrix's ratio table (``packing.int4_ratio_table``: tab [1, rows, 16]
    in place of the group scales): the inline kernel up to ``INT4_INLINE_MAX_M`` rows, the staged kernel
    above, with the ratios read instead of made, and 16 bytes of them per (block, group) read
    instead of 64 of scales. The qwen3 INT4 layer with it, against ``gemm_int4`` (interleaved,
    session 21): T=512 9-11 % faster on 2 dev threads and 8-9 % on the device's 16, T=2048 0-4 %.
    Same result as ``gemm_int4``. Not a contract kernel: ``CPUMoE`` calls it with its tables."""
    _int4_tab(xq, xs, data, tab, group_size, out, nb0, nb1, False)


@njit(nogil=True, cache=True)
def gemm_int4_tab_stream_out(xq, xs, data, tab, group_size, out, nb0, nb1):
    """``gemm_int4_tab`` with non-temporal stores whenever the output rows start on 64-byte
    lines, as ``gemm_int8_stream_out``: for the MoE layer's down outputs of a large chunk."""
    _int4_tab(xq, xs, data, tab, group_size, out, nb0, nb1, _out_on_lines(out))


@njit(nogil=True, cache=True)
def _int4_tab(xq, xs, data, tab, group_size, out, nb0, nb1, stream):
    """The body of ``gemm_int4_tab`` (stream False) and ``gemm_int4_tab_stream_out``: the
    stores non-temporal, and no output prefetch for writing, where stream (two calls with
    literal flags each, so that the plain form's loops stay as they were)."""
    flat = tab.reshape(-1)
    nb = data.shape[0]
    ng = xq.shape[1] // group_size
    srow = flat[nb0 * 16:nb1 * 16]
    rx = flat[nb * 16:].view(np.int8)[nb0 * ng * 16:nb1 * ng * 16]
    mc = default_mc(xq.shape[1])
    if xq.shape[0] <= INT4_INLINE_MAX_M:
        if stream:
            gemm_int4_inline(xq, xs, data, group_size, srow, rx, out, nb0, nb1, 1, False, True, True)
        else:
            gemm_int4_inline(xq, xs, data, group_size, srow, rx, out, nb0, nb1, 1, True, True, False)
    elif stream:
        gemm_int4_staged(xq, xs, data, group_size, srow, rx, out, nb0, nb1, mc, 16, False, True, True)
    else:
        gemm_int4_staged(xq, xs, data, group_size, srow, rx, out, nb0, nb1, mc, 16, True, True, False)


# ----------------------------------------------------------------------------- BF16

@njit(nogil=True, cache=True)
def gemv_bf16_pf(xb, data, out, nb0, nb1, pf):
    """``gemv_bf16`` with an explicit B prefetch distance of pf k-steps (0: none)."""
    _gemv_pf(xb, data, out, nb0, nb1, pf, True, _NO_XS, _NO_XS, False)


@njit(nogil=True, cache=True)
def gemv_bf16(xb, data, out, nb0, nb1):
    """Small-M BF16: out[m, n] = sum_k bf16(x[m, k]) bf16(w[n, k]) with fp32 accumulation.

    xb uint16 [M, d_pad] (bf16 bits); data uint16 [NB, d_pad/2, 16, 2]; out fp32 [M, >= 16 nb1].
    """
    gemv_bf16_pf(xb, data, out, nb0, nb1, 4)


@njit(nogil=True, cache=True)
def _gemm_blocked(a, data, out, nb0, nb1, mc, kcs, pf, bf, xs, scale):
    """The K-sliced large-M GEMM (the default before ``_gemm_pipe``; kept for comparison): mc rows
    per M chunk (multiple of 32), kcs k-steps per K slice with partial sums through a buffer,
    A prefetch distance pf k-steps (0: none). bf False: int8 A, int32 sums scaled by
    xs[m] * scale[n]; bf True: bf16-bits A, fp32 sums copied."""
    m_all = a.shape[0]
    kel = line_elems(a)             # A elements per 64-byte k-step row
    ks = a.shape[1] // kel
    sb = 16 * line_elems(data)      # data elements per k-step tile
    ost = out.strides[0] // 4
    blk = data.shape[1] * (32 if bf else 64)
    ap = _pack_a(a, ks, kel)
    mpad = ap.shape[0] * 16
    cp = empty_line(mc * 32, np.int32).reshape((mc, 32))
    cpf = cp.view(np.float32)
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, 64)
    for mc0 in range(0, mpad, mc):
        mc1 = min(mc0 + mc, mpad)
        for b in range(nb0, nb1, 2):
            two = b + 1 < nb1
            o0 = b * blk
            o1 = o0 + blk
            for k0 in range(0, ks, kcs):
                k1 = min(k0 + kcs, ks)
                for mp in range(mc0, mc1, 32):
                    lr = mp - mc0
                    if k0 == 0:
                        tilezero(0)
                        tilezero(1)
                        tilezero(2)
                        tilezero(3)
                    else:
                        tileloadd64(0, cp, lr * 32, 128)
                        tileloadd64(2, cp, (lr + 16) * 32, 128)
                        if two:
                            tileloadd64(1, cp, lr * 32 + 16, 128)
                            tileloadd64(3, cp, (lr + 16) * 32 + 16, 128)
                    a0 = (mp // 16) * ks * sb
                    a1 = a0 + ks * sb
                    for s in range(k0, k1):
                        if pf > 0 and s + pf < k1:
                            for ln in range(16):
                                prefetch_l1(ap, a0 + (s + pf) * sb + kel * ln)
                                prefetch_l1(ap, a1 + (s + pf) * sb + kel * ln)
                        tileloadd64(4, ap, a0 + s * sb, 64)
                        tileloadd64(6, data, o0 + s * sb, 64)
                        if bf:
                            tdpbf16ps(0, 4, 6)
                        else:
                            tdpbssd(0, 4, 6)
                        tileloadd64(5, ap, a1 + s * sb, 64)
                        if bf:
                            tdpbf16ps(2, 5, 6)
                        else:
                            tdpbssd(2, 5, 6)
                        if two:
                            tileloadd64(7, data, o1 + s * sb, 64)
                            if bf:
                                tdpbf16ps(1, 4, 7)
                                tdpbf16ps(3, 5, 7)
                            else:
                                tdpbssd(1, 4, 7)
                                tdpbssd(3, 5, 7)
                    tilestored64(0, cp, lr * 32, 128)
                    tilestored64(2, cp, (lr + 16) * 32, 128)
                    if two:
                        tilestored64(1, cp, lr * 32 + 16, 128)
                        tilestored64(3, cp, (lr + 16) * 32 + 16, 128)
                    if k1 == ks:
                        n0 = 16 * b
                        for i in range(min(32, m_all - mp)):
                            oi = (mp + i) * ost + n0
                            ci = (lr + i) * 32
                            if bf:
                                copy64(out, oi, cpf, ci)
                                if two:
                                    copy64(out, oi + 16, cpf, ci + 16)
                            else:
                                row16_scale_store(out, oi, cp, ci, scale, n0, xs[mp + i])
                                if two:
                                    row16_scale_store(out, oi + 16, cp, ci + 16, scale, n0 + 16,
                                                      xs[mp + i])
    tilerelease()


@njit(nogil=True, cache=True)
def gemm_int8_blocked(xq, xs, data, scale, out, nb0, nb1, mc, kcs, pf):
    """Large-M INT8, K-sliced (``_gemm_blocked``; kcs 64-deep k-steps per slice). Same result as
    ``gemv_int8``."""
    _gemm_blocked(xq, data, out, nb0, nb1, mc, kcs, pf, False, xs, scale)


@njit(nogil=True, cache=True)
def gemm_bf16_blocked(xb, data, out, nb0, nb1, mc, kcs, pf):
    """Large-M BF16, K-sliced (``_gemm_blocked``; kcs 32-deep k-steps per slice). Same result as
    ``gemv_bf16`` up to fp32 summation order."""
    _gemm_blocked(xb, data, out, nb0, nb1, mc, kcs, pf, True, _NO_XS, _NO_XS)


@njit(nogil=True, cache=True)
def gemm_bf16(xb, data, out, nb0, nb1):
    """Large-M BF16 (same contract as ``gemv_bf16``): the staged kernel, K slices of 16 k-steps
    (32 k each), the L2 prefetch one block pair ahead as the pipelined kernel before it had it (at
    T=2048 one ahead was 3-5 % faster than two on three leases of four, sessions 14-15). One core,
    M=512 (session 18, dev): 1.1x / 1.2x the pipelined ``gemm_bf16_pipe`` (gate+up / down); the
    16-thread layer the same within 3 %."""
    gemm_bf16_staged(xb, data, out, nb0, nb1, default_mc(2 * xb.shape[1]), 16, 1, True, True)


@njit(nogil=True, cache=True)
def gemm_bf16_stream_out(xb, data, out, nb0, nb1):
    """``gemm_bf16`` with non-temporal stores and no output prefetch for writing whenever the
    output rows start on 64-byte lines (else as ``gemm_bf16``), as ``gemm_int8_stream_out``: for
    the MoE layer's down outputs of a large chunk. Same result as ``gemm_bf16``."""
    if _out_on_lines(out):
        _gemm_staged(xb, data, out, nb0, nb1, default_mc(2 * xb.shape[1]), 16, 1, False, True, True,
                     _NO_XS, _NO_XS, True)
    else:
        gemm_bf16(xb, data, out, nb0, nb1)


# The MoE layer's large-T down GEMM: each prefill kernel it may run -> the form of it that stores
# its output with non-temporal stores (CPUMoE.y_stream_bytes)
STREAM_OUT_FORM = {gemm_int8_shared_out: gemm_int8_stream_out, gemm_int4_tab: gemm_int4_tab_stream_out,
                   gemm_bf16: gemm_bf16_stream_out}


# ----------------------------------------------------------------------------- roofline

@njit(nogil=True, cache=True)
def _peak(iters, bf, zero):
    """The tile-resident product loop of ``peak_int8`` / ``peak_bf16``: four accumulators, four
    input tiles zeroed (``zero``) or loaded once from pseudo-random data (bf16: values of
    magnitude [1, 2), random signs and mantissas).

    Measured on the device (session 3, ``benchmarks/results/amx_diag_s3_run7_peaks.json``): the
    random-tile loop runs at 0.6x the zero-tile one on one core and 0.7x on all 16, and slower
    than GEMM panels that multiply random data between tile loads, so back-to-back products on
    random data are power-limited. The zero-tile rate is the highest measured, so it is the
    default "peak": fractions of it are conservative."""
    cfg = np.zeros(64, np.uint8)
    _config(cfg, 16, 64)
    buf = empty_line(4096, np.uint8)
    v = np.uint32(12345)
    for i in range(4096):
        v = v * np.uint32(1664525) + np.uint32(1013904223)
        buf[i] = np.uint8(v >> np.uint32(24))
    if bf:
        b16 = buf.view(np.uint16)
        for i in range(2048):
            r = b16[i]
            b16[i] = np.uint16(0x3F80 | (r & 0x7F) | (r & 0x8000))
    tilezero(0)
    tilezero(1)
    tilezero(2)
    tilezero(3)
    if zero:
        tilezero(4)
        tilezero(5)
        tilezero(6)
        tilezero(7)
    else:
        tileloadd64(4, buf, 0, 64)
        tileloadd64(5, buf, 1024, 64)
        tileloadd64(6, buf, 2048, 64)
        tileloadd64(7, buf, 3072, 64)
    for _ in range(iters):
        if bf:
            tdpbf16ps(0, 4, 6)
            tdpbf16ps(1, 4, 7)
            tdpbf16ps(2, 5, 6)
            tdpbf16ps(3, 5, 7)
        else:
            tdpbssd(0, 4, 6)
            tdpbssd(1, 4, 7)
            tdpbssd(2, 5, 6)
            tdpbssd(3, 5, 7)
    sink = np.empty(256, np.int32)
    tilestored64(0, sink, 0, 64)  # the products are used: nothing above is dead
    tilerelease()
    return iters * 4 * 2 * 16 * 16 * (32 if bf else 64)


@njit(nogil=True, cache=True)
def peak_int8(iters, zero=True):
    """Tile-resident tdpbssd loop (no memory traffic) on zeroed tiles (``zero=False``: random
    int8 tiles, see ``_peak``); returns the integer ops done (2 per MAC)."""
    return _peak(iters, False, zero)


@njit(nogil=True, cache=True)
def peak_bf16(iters, zero=True):
    """Tile-resident tdpbf16ps loop on zeroed tiles (``zero=False``: random bf16 tiles); returns
    the flops done (2 per MAC)."""
    return _peak(iters, True, zero)
