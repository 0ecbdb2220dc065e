"""AMX INT4 (tdpbssd on unpacked nibbles): the small-M and large-M kernels of the README
contract, the ratio-table forms the MoE layer uses, and the exact per-group ("-8 flush") form.

Prefill: the quantiser's group scales are s_row * r_g with small integers r_g
(``reference.int4_ratio_scales``), so ``gemm_int4`` unpacks each block pair to the int8 values
r_g * q and runs the INT8 staged loop of ``_tiles`` with one fp32 scaling at the end
(``gemm_int4_staged``: 1.3 / 1.4x the per-group kernel at INT4 T=512 / 2048 on 16 threads). Up
to 128 rows (a prefill layer's experts) ``gemm_int4_inline`` unpacks each k-step just before its
products instead, once per block pair, and makes each pair's ratios as it reaches the pair.

Scales of another form take the per-group kernel, ``gemm_int4_blocked``: each group's nibbles are
unpacked to *signed* int8 (q = nibble - 8) in a small scratch tile and multiplied with
``tdpbssd``; the int32 tile is flushed into an fp32 accumulator with the group's scales after
every group (G = 32 uses half-depth tiles: K 32 per instruction, so no tile straddles two groups).
The alternative, ``tdpbsud`` on the raw nibble q + 8 with a per-(token, group) correction
8 * sum(x), saves one subtract per unpacked byte but adds one per accumulator element at every
group flush. The flush is that kernel's hot spot (it runs once per group per 16x16 tile, the
unpack once per group per B tile and is then reused by every row tile of an M chunk), so the
signed unpack is the cheaper side in prefill and costs only ~16 vector ops per KiB of B in decode.
It is also the one exact for a stored -8 (``gemm_int4_flush``), which the ratio kernels' int8
products r_g * q cannot hold for r_g >= 17.
"""
import numpy as np
from numba import njit

from ... import cache
from ....reference import INT4_RATIO_MAX
from .._simd import empty_line
from ._intrinsics import (prefetch_l1, prefetch_l2, prefetch_w, ratio_row16, row16_fma, row16_max,
                          row16_mul_store, sfence, tdpbssd, tilerelease, tileloadd64, tilestored64,
                          tilezero, unpack_int4_group_mul)
from ._tiles import (AMX_MODE, _NO_SCALE, _config, _config_gemv, _drain, _out_on_lines, _pack_a,
                     _staged_buffers, _staged_pair, _unpack_int4, default_mc)

cache.install()

__all__ = ["gemv_int4", "gemm_int4", "gemm_int4_flush", "gemm_int4_tab", "gemm_int4_tab_stream_out",
           "gemv_int4_pf", "gemm_int4_blocked", "gemm_int4_staged", "gemm_int4_inline",
           "INT4_INLINE_MAX_M", "AMX_MODE"]


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
    prefetch its output lines for writing (outputs other cores wrote last). Same result as
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
def gemm_int4_staged(xq, xs, data, group_size, srow, rx, out, nb0, nb1, mc, kcs, pfw, nta, nt=False):
    """Large-M INT4 for scales of the form s_row * r_g (``_int4_ratios`` gives srow and rx): each
    block pair's nibbles are unpacked to the int8 values r_g * q (exact: |r_g q| <= 126), once per
    M chunk of mc rows, and multiplied as INT8 by the staged loop (``_staged_pair``, K slices of
    at most kcs k-steps); the int32 sums over all of K are scaled by xs[m] * s_row[n]. No
    per-group flush: the same sum as ``gemv_int4`` (sum_g s_row r_g sum_k x q), exact up to the
    fp32 epilogue. While a pair is unpacked, the pair two blocks on is prefetched into L2. pfw,
    nta as ``int8.gemm_int8_staged``; nt: non-temporal output stores (out's rows must start on
    64-byte lines: the caller checks)."""
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
    2048: 7.5 / 10 % faster than with the staged kernel above 32 rows) and making each
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
    int8 products r_g * q cannot hold for r_g >= 17 (``packing.int4_has_minus8``). The AMX INT4
    set's "exact" form (``registry``): ``CPUMoE`` and ``gemm.linear`` take it for weights holding
    -8, and ``gemm_int4`` for the blocks whose scales are not of the ratio form."""
    kc = max(512, group_size)
    gemm_int4_blocked(xq, xs, data, scale, group_size, out, nb0, nb1, default_mc(xq.shape[1]), kc,
                      True, True)


@njit(nogil=True, cache=True)
def gemm_int4_tab(xq, xs, data, tab, group_size, out, nb0, nb1):
    """``gemm_int4`` on a matrix's ratio table (``packing.int4_ratio_table``: tab [1, rows, 16]
    in place of the group scales): the inline kernel up to ``INT4_INLINE_MAX_M`` rows, the staged
    kernel above, with the ratios read instead of made, and 16 bytes of them per (block, group)
    read instead of 64 of scales. The qwen3 INT4 layer with it, against ``gemm_int4``
    (interleaved, ``benchmarks/bench_moe.py``): T=512 9-11 % faster on 2 dev threads and 8-9 % on
    the device's 16, T=2048 0-4 %.
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
