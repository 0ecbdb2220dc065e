"""The MoE driver (kt/cpu_ops/driver/): its task orders, plan and profile, on the scalar contract
doubles (and the registry's kernels where noted). Orders that reorder the same arithmetic must
give bit-identical outputs; tolerances of the tight checks: _moe_cases.py.
"""
import numpy as np
import pytest

from kt.cpu_ops.moe import CPUMoE
from kt.cpu_ops.tuning import MoETuning

from _moe_cases import BEST, SCHEMES, check_tight, layer, routing
from _moe_doubles import DOUBLES


def _masked_setup(scheme, kind, pool, seed, masked):
    """(layer, its kernel pair for new CPUMoEs, rng, gpu mask with ``masked`` experts set)."""
    base = layer(scheme, kind, pool=pool)[0]
    kern = DOUBLES[scheme] if kind == "double" else (base._kv, base._km)
    gmask = np.zeros(base.num_experts, bool)
    gmask[masked] = True
    return base, kern, np.random.default_rng(seed), gmask


@pytest.mark.parametrize("scheme,kind", [(s, "double") for s in SCHEMES] + BEST)
def test_gathered_calls_are_identical(scheme, kind, pool, monkeypatch):
    """Gate+up calls gather their rows' activations (quantised once per token) into the
    participant's scratch, in calls of at most S_GCH rows, and a whole-expert task keeps its
    gate+up outputs in its own scratch (S_GUS rows) when they fit. Every row is computed by the
    same kernel on the same numbers however the rows are split into calls and wherever the
    outputs go: whole-expert and split tasks, one call or many (32 rows), own or shared gate+up
    rows, give bit-identical outputs; with masks, chunks and two-level activations."""
    from kt.cpu_ops import _moe_desc

    base, kern, rng, gmask = _masked_setup(scheme, kind, pool, 23, [2, 4])
    E, H = base.num_experts, base.hidden
    real = _moe_desc.call_rows
    T = 120
    x = rng.standard_normal((T, H), dtype=np.float32)
    ids, w = routing(rng, T, E, 3)
    ids[:, 0] = 5  # one expert with T rows: several 32-row calls
    kinds = [dict(), dict(chunk_tokens=50)] + ([dict(activations="int8x2")] if scheme != "bf16" else [])
    for kw in kinds:
        outs = {}
        for rows in ("default", (32, 32), (32, 0)):
            for bpt in ((64, 64), (4, 4)):
                if rows != "default":
                    monkeypatch.setattr(_moe_desc, "call_rows", lambda xb, n13, r=rows: r)
                tun = MoETuning(blocks_per_task=bpt, **({"chunk_tokens": kw["chunk_tokens"]} if "chunk_tokens" in kw else {}))
                m = CPUMoE(base.w13, base.w2, pool=pool, kernels=kern, tuning=tun,
                           **{k: v for k, v in kw.items() if k != "chunk_tokens"})
                outs[(rows, bpt)] = m(x, ids, w, gpu_mask=gmask)
                monkeypatch.setattr(_moe_desc, "call_rows", real)
        ref_out = outs[("default", (64, 64))]
        for k, o in outs.items():
            assert np.array_equal(o, ref_out), (kw, k)
        check_tight(m, x, ids, w, ref_out, mask=gmask, what=f"{kw}", whole=1e-3)


def _order_case(scheme, pool, seed, chunk_tokens, E=8):
    """A scalar-kernel layer, an rng, two GPU-masked experts and the layer options under which a task
    order must give bit-identical outputs (plain, chunked, two-level activations)."""
    base = layer(scheme, "double", E=E, pool=pool)[0]
    gmask = np.zeros(base.num_experts, bool)
    gmask[[2, 5]] = True
    kinds = [dict(), dict(chunk_tokens=chunk_tokens)] + ([dict(activations="int8x2")] if scheme != "bf16" else [])
    return base, np.random.default_rng(seed), base.num_experts, base.hidden, gmask, kinds


def _layer(base, scheme, pool, kw, **tuning):
    """A doubles layer on ``base``'s weights with layer options ``kw`` (chunk_tokens goes into
    the tuning) and the tuning fields ``tuning``."""
    kw = dict(kw)
    if "chunk_tokens" in kw:
        tuning["chunk_tokens"] = kw.pop("chunk_tokens")
    return CPUMoE(base.w13, base.w2, pool=pool, kernels=DOUBLES[scheme], tuning=MoETuning(**tuning), **kw)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_pipelined_decode_is_identical(scheme, pool):
    """Pipelined decode (down tasks wait per expert; the last gate+up task of an expert computes its
    activations) runs the same kernels on the same rows as the phase-by-phase order: bit-identical,
    with masks, incremental output, chunks, two-level activations and bf16 input and output."""
    import torch

    base, rng, E, H, gmask, kinds = _order_case(scheme, pool, 12, chunk_tokens=2)
    for kw in kinds:
        # tasks split within experts: the decode layout
        on = _layer(base, scheme, pool, kw, blocks_per_task=(2, 3))
        off = _layer(base, scheme, pool, kw, blocks_per_task=(2, 3), pipelined_decode=False)
        for T in (1, 3, 9):
            x = rng.standard_normal((T, H), dtype=np.float32)
            ids, w = routing(rng, T, E, 3)
            a = on(x, ids, w, gpu_mask=gmask)
            assert np.array_equal(a, off(x, ids, w, gpu_mask=gmask)), (kw, T)
            check_tight(on, x, ids, w, a, mask=gmask, what=f"pipelined {scheme} {kw} T={T}")
            xb = torch.from_numpy(x).to(torch.bfloat16)  # bf16 in and out, as a model calls it
            bits = [m(xb, ids, w, gpu_mask=gmask).view(torch.int16).numpy() for m in (on, off)]
            assert np.array_equal(bits[0], bits[1]), (kw, T, "bf16")
            acc_on = np.ones((T, H), np.float32)
            acc_off = acc_on.copy()
            on(x, ids, w, out=acc_on, incremental=True)
            off(x, ids, w, out=acc_off, incremental=True)
            assert np.array_equal(acc_on, acc_off), (kw, T, "incremental")
    # the pipelined order really ran: its per-expert words (pool scratch) end as "0 gate+up tasks
    # left, ready" for exactly the experts of the last chunk; the phase order leaves them alone
    from kt.cpu_ops.driver import layout as drv
    dep = pool.scratch("moe.dep", E * drv.DEP_STRIDE, np.int64).reshape(E, drv.DEP_STRIDE)
    ids = np.array([[0, 3, -1], [3, 6, 1]], np.int64)
    x = rng.standard_normal((2, H), dtype=np.float32)
    w = np.ones((2, 3), np.float32)
    dep[:] = 7
    off(x, ids, w)
    assert (dep == 7).all()
    on(x, ids, w)
    used = [0, 1, 3, 6]
    assert (dep[used, :2] == [0, 1]).all() and (np.delete(dep, used, axis=0) == 7).all(), dep[:, :2]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tail_split_is_identical(scheme, pool):
    """Prefill with whole-expert tasks: the last experts split into gate+up and down part tasks (the
    pipelined order within a fused chunk) run the same kernels on the same rows as whole-expert tasks:
    bit-identical, with masks, incremental output, chunks and two-level activations."""
    base, rng, E, H, gmask, kinds = _order_case(scheme, pool, 13, chunk_tokens=24, E=16)
    for kw in kinds:
        off = _layer(base, scheme, pool, kw, tail_parts=1)
        ons = [_layer(base, scheme, pool, kw, tail_experts=tail, tail_parts=parts)
               for tail, parts in ((None, 4), (3, 2), (100, 8))]
        for T in (40, 61):
            x = rng.standard_normal((T, H), dtype=np.float32)
            ids, w = routing(rng, T, E, 3)
            want = off(x, ids, w, gpu_mask=gmask)
            check_tight(off, x, ids, w, want, mask=gmask, what=f"tail {scheme} {kw} T={T}")
            acc_off = np.ones((T, H), np.float32)
            off(x, ids, w, out=acc_off, incremental=True)
            for m in ons:
                assert np.array_equal(m(x, ids, w, gpu_mask=gmask), want), (kw, T, m.tuning.tail_experts)
                acc = np.ones((T, H), np.float32)
                m(x, ids, w, out=acc, incremental=True)
                assert np.array_equal(acc, acc_off), (kw, T, m.tuning.tail_experts, "incremental")
    # a layer too narrow to split (4 gate+up blocks: a part would be the whole expert) keeps whole
    # experts: the same output, and no down task waits for activations nobody computes
    narrow = layer(scheme, "double", E=16, I=32, pool=pool)[0]
    x = rng.standard_normal((40, H), dtype=np.float32)
    ids, w = routing(rng, 40, E, 3)
    outs = []
    for parts in (1, 2, 4, 8):
        outs.append(narrow(x, ids, w, tuning=MoETuning(tail_parts=parts)))
    assert all(np.array_equal(o, outs[0]) for o in outs[1:])
    # the split really ran: a fused chunk arms per-expert words for all its experts; the split ones
    # end "0 gate+up tasks left, ready", whole ones "1 left, not ready" (never counted down); the
    # split ones are the smallest (taken last); tail_parts = 1 leaves the words alone
    from kt.cpu_ops.driver import layout as drv
    dep = pool.scratch("moe.dep", E * drv.DEP_STRIDE, np.int64).reshape(E, drv.DEP_STRIDE)
    T = 48
    x = rng.standard_normal((T, H), dtype=np.float32)
    ids, w = routing(rng, T, E, 3, skip_frac=0.0)
    counts = np.bincount(ids.ravel(), minlength=E)
    assert (counts > 0).sum() >= 6  # enough experts for a fused chunk with 3 split
    off = _layer(base, scheme, pool, {}, tail_parts=1)  # one chunk
    on = _layer(base, scheme, pool, {}, tail_experts=3, tail_parts=2)
    dep[:] = 7
    off(x, ids, w)
    assert (dep == 7).all()
    on(x, ids, w)
    split = (dep[:, 0] == 0) & (dep[:, 1] == 1)
    whole = (dep[:, 0] == 1) & (dep[:, 1] == 0)
    assert split.sum() == 3 and (split | whole | (counts == 0)).all(), dep[:, :2]
    assert (whole == ((counts > 0) & ~split)).all(), dep[:, :2]
    assert counts[split].max() <= counts[whole].min(), (counts, dep[:, :2])


def test_profile_books_every_phase(pool):
    """CPUMoE.profile: the same output as a plain call, and busy time in the phases that ran:
    split tasks (decode-sized: act and down phases of their own) and whole-expert tasks (prefill:
    the fused tasks' activations and down GEMM booked under act and down)."""
    m = layer("int8", "double", pool=pool)[0]
    rng = np.random.default_rng(9)
    for T in (1, 64):
        x = rng.standard_normal((T, m.hidden), dtype=np.float32)
        ids, w = routing(rng, T, m.num_experts, 3, skip_frac=0.0)
        tun = MoETuning(blocks_per_task=(0, 0) if T > 1 else (1, 1))
        want = m(x, ids, w, tuning=tun)
        p = m.profile(x, ids, w, repeats=2, tuning=tun)
        assert p["threads"] == pool.num_threads and p["wall_ms"] > 0
        assert set(p["phases"]) == {"plan", "quantise", "gate_up", "act", "down", "combine"}
        for name in ("plan", "gate_up", "act", "down", "combine"):
            assert p["phases"][name]["busy_ms"] > 0, (T, name, p["phases"])
        assert abs(sum(v["share"] for v in p["phases"].values()) - 1) < 1e-9
        assert np.array_equal(m(x, ids, w, tuning=tun), want)
    with pytest.raises(ValueError, match="repeats"):
        m.profile(x, ids, w, repeats=0)
    # each participant's words on cache lines of its own (a shared line slowed the profiled call)
    from kt.cpu_ops.driver.profile import new_profile, profile_cycles

    prof = new_profile(3)
    assert prof.ctypes.data % 64 == 0 and prof.strides[0] % 64 == 0
    assert profile_cycles(prof).shape == (3, 6, 2) and np.shares_memory(profile_cycles(prof), prof)


def test_plan_tasks_cover_every_expert_once():
    """The driver's plan over a grid of layer widths, thread counts and tail settings: every active
    expert's gate+up and down blocks are covered exactly once; in a fused chunk an expert has down
    tasks exactly when it is split, a split expert has no task covering all its gate+up blocks (that
    task would run as a whole expert and never release the down tasks), and the split experts are
    the last of the order (the smallest)."""
    from kt.cpu_ops.driver import plan as drv

    rng = np.random.default_rng(5)
    for nb13, nb2, E, T, K, nth, tail, tailp in [
            (4, 4, 16, 40, 3, 2, 2, 4), (8, 4, 16, 40, 3, 2, 2, 2), (96, 128, 128, 512, 8, 16, 16, 4),
            (96, 128, 128, 2048, 8, 16, 16, 8), (14, 13, 16, 61, 3, 2, 100, 8), (5, 3, 12, 30, 2, 3, 4, 3),
            (96, 128, 128, 1, 8, 16, 16, 4), (12, 8, 8, 6, 2, 4, 4, 4), (2, 2, 16, 50, 4, 2, 2, 4)]:
        ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64)
        ids[rng.random(ids.shape) < 0.05] = -1
        mask = np.zeros(E, np.uint8)  # nothing on the GPU
        pos = np.zeros((T, K), np.int32)
        rslot = np.zeros(T * K, np.int32)
        offs = np.zeros(E + 1, np.int32)
        order = np.zeros(E, np.int32)
        t13 = np.full((E * nb13, 3), -1, np.int32)
        t2 = np.full((E * nb2, 3), -1, np.int32)
        rows, n13, n2, fused, bad = drv._plan(0, T, ids, mask, pos, rslot, offs, order, t13, t2, nb13, nb2,
                                              nth, 0, 0, 1, tail, tailp)
        what = (nb13, nb2, E, T, nth, tail, tailp)
        active = [e for e in range(E) if offs[e + 1] > offs[e]]
        assert rows == (ids >= 0).sum() and bad == 0, what

        def cover(tasks, n, nb):
            got = {}
            for e, b0, b1 in tasks[:n]:
                assert 0 <= b0 < b1 <= nb, what
                got.setdefault(int(e), []).append((int(b0), int(b1)))
            for e, spans in got.items():
                spans.sort()
                assert spans[0][0] == 0 and spans[-1][1] == nb, (what, e, spans)
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (what, e, spans)
            return got

        g13 = cover(t13, n13, nb13)
        g2 = cover(t2, n2, nb2)
        assert sorted(g13) == active, what
        if not fused:
            assert sorted(g2) == active, what
            continue
        split = sorted(g2)
        for e in split:
            assert all(sp != (0, nb13) for sp in g13[e]), (what, e)
        for e in set(active) - set(split):
            assert g13[e] == [(0, nb13)], (what, e)
        n_act = len(active)
        assert sorted(order[n_act - len(split):n_act]) == split, what
        if tailp > 1 and nb13 > 4 and n_act >= 2:
            assert len(split) == min(tail, n_act // 2), what  # room in tasks13 in these cases
