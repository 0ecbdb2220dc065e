"""AMX tiles (AMX-INT8 / AMX-BF16): what the INT8, INT4 and BF16 files share.

Contract and data layout: kt/cpu_ops/README.md and packing.py. Tile registers: C (accumulators)
0-3 everywhere; GEMM A 4-5 and B 6-7, GEMV A 4 and B 5-7 (two config builders). A B tile is 16
"k4 rows" (int8: 4 k of 16 outputs; bf16: 2 k) of 64 bytes; in the packed layout the B tile of
(block b, k-step s) is the contiguous 1 KiB at ``data[b, 16 s : 16 s + 16]``, 64-byte stride.

- The small-M body (``_gemv_pf``, decode): A tiles are loaded straight from the activations with
  the row stride; the tile config has ``rows = min(M, 16)`` (reloaded once for a tail of rows).
  Four 16-output blocks per pass share one A tile (C 0-3, A 4, B 5-7 in rotation), and the B
  lines of the k-step ``pf`` ahead are prefetched. M = 8 costs what M = 1 costs.
- The large-M loop (``_gemm_staged`` / ``_staged_pair``, prefill): A is first copied into tile
  order (``_pack_a``: zero rows pad M to a multiple of 32, so every tile is full and the config
  never changes); 2x2 tiles = a 32x32 output per step. Per M chunk and 16-output block pair, K
  is cut into slices of at most ``kcs`` k-steps (16: the pair's 32 KiB B slice stays in L1 while
  the chunk's A tiles stream past with the non-temporal load), partial sums wait between slices
  in a small buffer, each panel is software-pipelined (each tile load issued right after the
  last product reading its register, two products before its use), the next block pairs are
  prefetched into L2, the output lines are optionally requested for writing (``pfw``: the MoE
  layer's outputs were last written by other cores), and each panel's epilogue (scaling,
  stores) runs a few rows at a time between the next panel's products. One core, M=512: 1.3-1.5x
  a whole-K pipelined panel that loads both operands from L2 at every k-step and stalls the tile
  unit for its epilogue; in the 16-thread layer the two were equal (it is bound by the weight
  stream).

Epilogues (int32 -> fp32 scaling), the A copy and the INT4 unpack use the 64-byte row
intrinsics of ``_intrinsics`` (LLVM leaves such short Numba loops scalar, which cost 2-3x the tile
work).

Importing this module calls ``_intrinsics.require_amx()``: it raises unless ``kt.cpu_ops.isa``
found AMX runnable (hardware and arch_prctl permission), so no AMX code is compiled or run
elsewhere; every AMX kernel file imports it first.
"""
import numpy as np
from numba import njit

from ... import cache
from .._simd import empty_line, line_elems
from ._intrinsics import (copy64, copy64_stream, ldtilecfg, prefetch_l1, prefetch_l2, prefetch_w,
                          require_amx, row16_scale_stream, row16_scale_store, set_tilecfg, sfence,
                          tdpbf16ps, tdpbssd, tilerelease, tileloadd64, tileloaddt164,
                          tilestored64, tilezero, unpack_int4_line)

AMX_MODE = require_amx()
cache.install()

_NO_XS = np.zeros(1, np.float32)  # xs / scale of a BF16 call of the shared INT8/BF16 bodies (unused)
_NO_SCALE = np.zeros((1, 1, 16), np.float32)  # INT4 group scales of a call that does not read them


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
    7-9 % faster on the device (``benchmarks/profile_moe.py``, M chunks of 192 / 256 rows)."""
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
    # reads are 16 row streams (1 MiB, M=512 K=2048: 45 vs 56 us row by row, dev machine)
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
def _pipe_pair_prefetch(b, nb0, nb1, blk, npan, ks, dist):
    """(first and second half's offsets, lines per half, lines per k-step) of the L2 prefetch
    while block pair b is computed: the pair ``dist`` pairs ahead, and at the first pair also
    every pair before it; zero lines when there is none (or dist is 0). The kernels use dist=2:
    one pair ahead was 10 % slower on the device with 16 threads and cold weights
    (``benchmarks/amx_panel_probe.py``: INT8 gate+up 0.910 vs 0.818 TOPS per thread, down 0.657
    vs 0.603, medians)."""
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
    software-pipelined: each tile load is issued right after the last product that reads its
    register's previous contents and two products before its own use, so its latency hides behind
    the products between (tile registers are not renamed). per > 0: ``per`` lines per k-step of the L2 prefetch
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
def _streams_out(out, m, nblocks):
    """Whether a GEMM writes its output with non-temporal stores: an output larger than 1 MiB
    (half the L2, which it leaves anyway; it then goes to memory without being read first) whose
    rows start on 64-byte boundaries (the stores fault otherwise). One core, M=512 N=1536 K=2048:
    8-12 % faster than plain stores (dev machine)."""
    return m * nblocks * 64 > 1 << 20 and _out_on_lines(out)


@njit(nogil=True, cache=True)
def _out_on_lines(out):
    """Whether every row of the fp32 output starts on a 64-byte line (its rows contiguous)."""
    return out.ctypes.data % 64 == 0 and out.strides[0] % 64 == 0 and out.strides[1] == 4
