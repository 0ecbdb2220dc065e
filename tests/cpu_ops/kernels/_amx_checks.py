"""Inputs, references and checks shared by the AMX tests on real tiles (test_amx.py) and on the
tile unit model (test_amx_emulated.py). ``mod`` is either kernel namespace (``_amx_model``).

Tolerances: integer schemes accumulate exactly in int32, so INT8 differs from the exact value
only by the fp32 epilogue (three roundings: rtol 1e-5 is ~80x that). The reference itself rounds
each dequantised operand to fp32 (xq * xs, q * scale) before its fp64 sum, which moves it by up to
2 * 2^-24 * (|x| @ |w|^T) elementwise (visible where terms cancel), so that is added as an
absolute part. INT4 adds one fp32 sum over the D/G group terms: (D/G) * 2^-24 * (|x| @ |w|^T)
more. With unit scales the outputs must equal the integer product exactly. BF16 products are
exact in fp32, so the only error is fp32 summation of D terms: |out - ref| <= D * 2^-24 *
(|x| @ |w|^T) elementwise.
"""
from __future__ import annotations

import numpy as np

from kt import reference as ref
from kt.config import QuantScheme
from kt.cpu_ops.packing import pack, pack_quantized
from kt.testing import assert_exact

U = 2.0 ** -24
M_LIST = (1, 2, 7, 16, 33, 512)
# (N, D): N=100 pads to 112 (7 blocks, odd: exercises the 1-block tails), D=200 pads to 256.
ND_LIST = ((16, 64), (100, 200), (48, 256), (72, 2048))


def inputs(m, n, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d), dtype=np.float32)
    w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
    return x, w


def pad_cols(a, d_pad):
    out = np.zeros((a.shape[0], d_pad), a.dtype)
    out[:, : a.shape[1]] = a
    return out


def run_kernel(K, scheme, op, x, p, nb0=None, nb1=None, fill=np.nan):
    """Call the AMX kernel on blocks [nb0, nb1) (default all); returns out [M, n_pad]."""
    nb0 = 0 if nb0 is None else nb0
    nb1 = p.num_blocks if nb1 is None else nb1
    m = x.shape[0]
    out = np.full((m, p.n_pad), fill, np.float32)
    if scheme is QuantScheme.BF16:
        xb = pad_cols(ref.f32_to_bf16_bits(x), p.d_pad)
        getattr(K, f"{op}_bf16")(xb, p.data, out, nb0, nb1)
    else:
        xq, xs = ref.quantize_act(x)
        xq = pad_cols(xq, p.d_pad)
        if scheme is QuantScheme.INT8:
            getattr(K, f"{op}_int8")(xq, xs, p.data, p.scale, p.wsum, out, nb0, nb1)
        else:
            getattr(K, f"{op}_int4")(xq, xs, p.data, p.scale, p.group_size, out, nb0, nb1)
    return out


def int_ref(x, qw, groups):
    """Reference for an integer scheme and its elementwise tolerance (see the module docstring)."""
    xd = ref.act_roundtrip(x, "int8")
    wd = ref.dequantize(qw)
    want = ref.linear(xd, wd)
    terms = np.abs(xd).astype(np.float64) @ np.abs(wd).astype(np.float64).T
    return want, 1e-5 * np.abs(want) + (2 + groups) * U * terms


def check_within(refv, out, bound, what):
    err = np.abs(out.astype(np.float64) - refv.astype(np.float64))
    assert np.isfinite(out).all(), f"{what}: non-finite output"
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} of {err.size} elements beyond the bound; "
                             f"worst at {tuple(int(v) for v in i)}: ref={refv[i]:.8g} "
                             f"out={out[i]:.8g} err={err[i]:.3g} bound={bound[i]:.3g}")


def check_staged(mod, run, whole, p, what):
    """The staged kernel ``run(out, nb0, mc, kcs, l2, pfw, nta)`` gives ``whole`` exactly for K
    slices of 1, 3 and all k-steps, M chunks of 32 and 64 rows, with and without its prefetches
    and the non-temporal A loads; a block range leaves the other columns untouched; (emulated)
    pfw asks for exactly the output lines the drain writes."""
    m = whole.shape[0]
    nb = p.num_blocks
    for mc, kcs, l2, pfw, nta in ((32, 1, 2, True, True), (64, 3, 0, False, False),
                                  (64, 1000, 1, True, True)):
        o = np.full(whole.shape, np.nan, np.float32)
        if hasattr(mod, "unit"):
            mod.unit.prefetched_w.clear()
        run(o, 0, mc, kcs, l2, pfw, nta)
        assert_exact(whole, o, what=f"{what} staged mc={mc} kcs={kcs} vs gemm")
        if hasattr(mod, "unit"):
            want = {r * p.n_pad + 16 * b for r in range(m) for b in range(nb)} if pfw else set()
            assert mod.unit.prefetched_w == want, what
    part = np.full(whole.shape, np.nan, np.float32)
    run(part, 1, 64, 2, 2, True, True)
    assert np.isnan(part[:, :16]).all()
    assert_exact(whole[:, 16:], part[:, 16:], what=f"{what} staged block range")


def check_slices(mod, scheme, pf):
    """Small M chunks and K slices (partial sums cross slices and chunks) and prefetching give the
    unsliced result exactly (integer schemes; BF16 sums K in the same order at any slicing)."""
    scheme = QuantScheme.parse(scheme)
    m, n, d = 70, 80, 256
    x, w = inputs(m, n, d, seed=3)
    p = pack(w, scheme, 64)
    nb = p.num_blocks
    whole = run_kernel(mod, scheme, "gemm", x, p)
    if scheme is QuantScheme.BF16:
        xb = pad_cols(ref.f32_to_bf16_bits(x), p.d_pad)
        # the staged kernel: K slices carry the fp32 partial sums bit for bit, so any slicing
        # sums in gemm_bf16's order
        check_staged(mod, lambda o, nb0, mc, kcs, l2, pfw, nta: mod.gemm_bf16_staged(
            xb, p.data, o, nb0, nb, mc, kcs, l2, pfw, nta), whole, p, "bf16")
        xr, wr = ref.bf16_round(x), ref.dequantize(ref.quantize(w, "bf16"))
        bound = d * U * (np.abs(xr).astype(np.float64) @ np.abs(wr).astype(np.float64).T)
        check_within(ref.linear(xr, wr), whole[:, :n], bound, "bf16 gemm")
        gv = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemv_bf16_pf(xb, p.data, gv, 0, nb, pf)
        check_within(ref.linear(xr, wr), gv[:, :n], bound, f"bf16 gemv pf={pf}")
        return
    xq, xs = ref.quantize_act(x)
    xq = pad_cols(xq, p.d_pad)
    if scheme is QuantScheme.INT8:
        check_staged(mod, lambda o, nb0, mc, kcs, l2, pfw, nta: mod.gemm_int8_staged(
            xq, xs, p.data, p.scale, o, nb0, nb, mc, kcs, l2, pfw, nta), whole, p, "int8")
        if hasattr(mod, "unit"):
            # the L2 prefetch l2 pairs ahead: inside the weights, every block after the first
            # pair once per M chunk (all of them at the first pair when l2 reaches the end),
            # over one K slice and over several
            blk = p.data.size // nb
            out = np.full((m, p.n_pad), np.nan, np.float32)
            for l2 in (0, 1, 2, 3):
                for kcs in (16, 1):
                    mod.unit.prefetched_l2.clear()
                    mod.gemm_int8_staged(xq, xs, p.data, p.scale, out, 0, nb, 1024, kcs, l2, False, True)
                    idx = [i for size, i in mod.unit.prefetched_l2 if size == p.data.size]
                    assert all(0 <= i < p.data.size for i in idx), l2
                    assert sorted(idx) == sorted(set(idx)), f"l2={l2}: a line prefetched twice"
                    assert {i // blk for i in idx} == (set(range(2, nb)) if l2 else set()), l2
        # the layer's form (output lines requested for writing) against the contract kernel
        shared = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemm_int8_shared_out(xq, xs, p.data, p.scale, p.wsum, shared, 0, nb)
        assert_exact(whole, shared, what="int8 gemm_int8_shared_out vs gemm_int8")
        gv = np.full((m, p.n_pad), np.nan, np.float32)
        mod.gemv_int8_pf(xq, xs, p.data, p.scale, gv, 0, nb, pf)
        assert_exact(whole, gv, what=f"int8 gemv pf={pf} vs gemm")
        return
    # gemm_int4 takes the flush-free ratio kernels on the quantiser's scales: their slices, M
    # chunks and block ranges give its whole result exactly; the per-group flush kernel sliced
    # gives its own unsliced result exactly
    whole_flush = np.full((m, p.n_pad), np.nan, np.float32)
    mod.gemm_int4_blocked(xq, xs, p.data, p.scale, 64, whole_flush, 0, nb, 128, p.d_pad, False, False)
    srow = np.empty(nb * 16, np.float32)
    rx = np.empty(nb * p.scale.shape[1] * 16, np.int8)
    assert mod._int4_ratios(p.scale, 0, nb, srow, rx)
    ng = p.scale.shape[1]
    check_staged(mod, lambda o, nb0, mc, kcs, l2, pfw, nta: mod.gemm_int4_staged(
        xq, xs, p.data, 64, srow[16 * nb0:], rx[16 * ng * nb0:], o, nb0, nb, mc, kcs, pfw, nta),
        whole, p, "int4")
    # the small-M kernel that unpacks as it multiplies (any M: each panel unpacks again; keep:
    # the later panels multiply the first panel's unpacked pair)
    for keep in (False, True):
        check_staged(mod, lambda o, nb0, mc, kcs, l2, pfw, nta: mod.gemm_int4_inline(
            xq, xs, p.data, 64, srow[16 * nb0:], rx[16 * ng * nb0:], o, nb0, nb, l2, pfw, keep),
            whole, p, f"int4 inline keep={keep}")
    out = np.full((m, p.n_pad), np.nan, np.float32)
    if hasattr(mod, "unit"):
        mod.unit.prefetched_w.clear()
    mod.gemm_int4_blocked(xq, xs, p.data, p.scale, 64, out, 0, nb, 32, 64, pf > 0, True)
    if hasattr(mod, "unit"):  # emulated: pfw requested exactly the lines the epilogue wrote
        assert mod.unit.prefetched_w == {r * p.n_pad + 16 * b for r in range(m) for b in range(nb)}
    assert_exact(whole_flush, out, what="int4 flush kernel sliced vs whole")
    gv = np.full((m, p.n_pad), np.nan, np.float32)
    mod.gemv_int4_pf(xq, xs, p.data, p.scale, 64, gv, 0, nb, pf)
    ref_gv = np.full((m, p.n_pad), np.nan, np.float32)
    mod.gemv_int4(xq, xs, p.data, p.scale, 64, ref_gv, 0, nb)
    assert_exact(ref_gv, gv, what=f"int4 gemv prefetch {pf} groups vs none")


def check_int4_fallback(mod):
    """INT4 scales not of the quantiser's s_row * r_g form (weights quantised elsewhere): gemm_int4
    takes the per-group flush kernel, and its result is gemm_int4_blocked's exactly."""
    m, n, d = 40, 48, 256
    x, w = inputs(m, n, d, seed=5)
    qw = ref.quantize(w, "int4", 64)
    rng = np.random.default_rng(5)
    scale = (qw.scale * rng.uniform(0.9, 1.1, qw.scale.shape)).astype(np.float32)
    p = pack_quantized(ref.QuantizedWeight(qw.scheme, qw.q, scale, 64), 64)
    nb = p.num_blocks
    assert not mod._int4_ratios(p.scale, 0, nb, np.empty(nb * 16, np.float32),
                                np.empty(nb * p.scale.shape[1] * 16, np.int8))
    out = run_kernel(mod, QuantScheme.INT4, "gemm", x, p)
    xq, xs = ref.quantize_act(x)
    flush = np.full_like(out, np.nan)
    mod.gemm_int4_blocked(pad_cols(xq, p.d_pad), xs, p.data, p.scale, 64, flush, 0, nb,
                          mod.default_mc(p.d_pad), 512, True, True)
    assert_exact(flush, out, what="int4 gemm on non-ratio scales vs the flush kernel")
    want, bound = int_ref(x, ref.QuantizedWeight(qw.scheme, qw.q, scale, 64), d // 64)
    check_within(want, out[:, :n], bound, "int4 gemm on non-ratio scales")


def check_int4_partial_fallback(mod):
    """Scales of the ratio form in blocks 0-1 only (block 3's columns scaled off it): gemm_int4's
    inline kernel, which makes each pair's ratios as it reaches the pair, computes blocks 0-1 and
    stops at pair 2-3; the flush kernel computes blocks 2-4. Each part equals its kernel exactly."""
    m, n, d = 40, 80, 256
    x, w = inputs(m, n, d, seed=6)
    qw = ref.quantize(w, "int4", 64)
    scale = qw.scale.copy()
    scale[48:64] *= np.float32(1.01)
    p = pack_quantized(ref.QuantizedWeight(qw.scheme, qw.q, scale, 64), 64)
    nb, ng = p.num_blocks, p.scale.shape[1]
    assert nb == 5
    out = run_kernel(mod, QuantScheme.INT4, "gemm", x, p)
    xq, xs = ref.quantize_act(x)
    xq = pad_cols(xq, p.d_pad)
    srow, rx = np.empty(2 * 16, np.float32), np.empty(2 * ng * 16, np.int8)
    assert mod._int4_ratios(p.scale, 0, 2, srow, rx)
    assert not mod._int4_ratios(p.scale, 2, 4, np.empty(2 * 16, np.float32), np.empty(2 * ng * 16, np.int8))
    head = np.full_like(out, np.nan)
    mod.gemm_int4_inline(xq, xs, p.data, 64, srow, rx, head, 0, 2, 1, True)
    assert_exact(head[:, :32], out[:, :32], what="int4 gemm, ratio blocks vs the inline kernel")
    tail = np.full_like(out, np.nan)
    mod.gemm_int4_blocked(xq, xs, p.data, p.scale, 64, tail, 2, nb, mod.default_mc(p.d_pad), 512, True, True)
    assert_exact(tail[:, 32:], out[:, 32:], what="int4 gemm, the other blocks vs the flush kernel")
    want, bound = int_ref(x, ref.QuantizedWeight(qw.scheme, qw.q, scale, 64), d // 64)
    check_within(want, out[:, :n], bound, "int4 gemm on partly ratio scales")


def stream_cases():
    """(what, out, streams) for gemm_int8 at M=520, N=1040 (65 blocks: the last pair is half),
    D=64: an output on lines and over 1 MiB (streamed), the same 16 bytes off a line, and one
    under 1 MiB (not streamed)."""
    from kt.cpu_ops import _align

    big = _align.empty((520, 1040), np.float32)
    buf = _align.empty(520 * 1040 + 16, np.float32)
    off = buf[4:4 + 520 * 1040].reshape(520, 1040)         # 16 bytes past a line
    small = _align.empty((200, 1040), np.float32)
    return [("aligned > 1 MiB", big, True), ("off a line", off, False), ("< 1 MiB", small, False)]


def check_streams(mod, count):
    m, n, d = 520, 1040, 64
    x, w = inputs(m, n, d, seed=21)
    p = pack(w, "int8", 64)
    xq, xs = ref.quantize_act(x)
    for what, out, streams in stream_cases():
        rows = out.shape[0]
        want = np.full(out.shape, np.nan, np.float32)
        mod.gemm_int8_shared_out(xq[:rows], xs[:rows], p.data, p.scale, p.wsum, want, 0, p.num_blocks)
        out[...] = np.nan
        before = count()
        mod.gemm_int8(xq[:rows], xs[:rows], p.data, p.scale, p.wsum, out, 0, p.num_blocks)
        assert_exact(want, out, what=f"gemm_int8 {what}")
        if before is not None:
            assert (count() > before) == streams, what


def check_stream_out(mod, count):
    """gemm_int8_stream_out, gemm_int4_tab_stream_out and gemm_bf16_stream_out (the MoE layer's
    down GEMMs of large chunks) against their plain forms: the same bits into outputs of any size, inline (<= 128 rows)
    and staged INT4, streamed exactly when the rows start on lines (the model asserts each streamed
    row is on one), and one fence per streamed call."""
    from kt.cpu_ops import _align
    from kt.cpu_ops.packing import int4_ratio_table, pack_experts

    n, d, g = 80, 128, 64                  # 5 blocks: the last pair is half
    for m in (7, 150):
        x, w = inputs(m, n, d, seed=m + 5)
        xq, xs = ref.quantize_act(x)
        p8 = pack(w, "int8", 64)
        p4 = pack_experts(w[None], QuantScheme.INT4, g)
        tab = int4_ratio_table(p4.scale)
        # BF16 over K = 1056: three K slices, whose fp32 partial sums wait in cpart (only the last
        # slice's sums are stored, streamed or not)
        xbf, wbf = inputs(m, n, 1056, seed=m + 6)
        pb = pack(wbf, "bf16", 64)
        xb = pad_cols(ref.f32_to_bf16_bits(xbf), pb.d_pad)
        runs = (("int8", lambda o: mod.gemm_int8_shared_out(xq, xs, p8.data, p8.scale, p8.wsum, o, 0, p8.num_blocks),
                 lambda o: mod.gemm_int8_stream_out(xq, xs, p8.data, p8.scale, p8.wsum, o, 0, p8.num_blocks)),
                ("int4", lambda o: mod.gemm_int4_tab(xq, xs, p4.data[0], tab[0], g, o, 0, p4.data.shape[1]),
                 lambda o: mod.gemm_int4_tab_stream_out(xq, xs, p4.data[0], tab[0], g, o, 0, p4.data.shape[1])),
                ("bf16", lambda o: mod.gemm_bf16(xb, pb.data, o, 0, pb.num_blocks),
                 lambda o: mod.gemm_bf16_stream_out(xb, pb.data, o, 0, pb.num_blocks)))
        for scheme, plain, streamed in runs:
            on = _align.empty((m, 80), np.float32)
            off = _align.empty(m * 80 + 16, np.float32)[4:4 + m * 80].reshape(m, 80)
            for what, out, streams in (("on lines", on, True), ("off a line", off, False)):
                want = np.full(out.shape, np.nan, np.float32)
                plain(want)
                out[...] = np.nan
                before = count()
                streamed(out)
                assert_exact(want, out, what=f"{scheme} stream_out M={m} {what}")
                if before is not None:
                    assert (count()[0] > before[0]) == streams, (scheme, m, what)
                    assert count()[1] - before[1] == (1 if streams else 0), (scheme, m, what)
