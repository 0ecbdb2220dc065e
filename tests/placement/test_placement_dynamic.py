"""hit_rate, churn-minimising re-placement, DynamicPlacer, and the skewed-routing comparison
(uniform vs frequency vs dynamic at a 25 % budget)."""
import numpy as np
import pytest
import torch

from kt.placement import (DynamicPlacer, ExpertStats, Placement, expected_hit_rate, hit_rate, plan,
                          replace_keeping_slots, zipf_routing)


def test_hit_rate_counts_token_slots():
    p = Placement.from_mask(np.array([[True, False, False], [False, False, True]]))
    ids = [np.array([[0, 1], [0, -1]]), torch.tensor([[2, 2], [1, 0]])]
    # layer 0: 3 routed slots, 2 on GPU; layer 1: 4 routed, 2 on GPU
    assert hit_rate(p, ids) == pytest.approx(4 / 7, rel=1e-15)
    assert hit_rate(p, {1: ids[1]}) == pytest.approx(0.5, rel=1e-15)
    assert np.isnan(hit_rate(p, {0: np.full((2, 2), -1)}))
    with pytest.raises(ValueError, match="expected ids for 2 layers, got 1"):
        hit_rate(p, ids[:1])
    with pytest.raises(ValueError, match=r"outside \[-1, 3\)"):
        hit_rate(p, {0: np.array([[3]])})
    assert expected_hit_rate(p, np.array([[3.0, 1.0, 0.0], [1.0, 1.0, 2.0]])) == pytest.approx(5 / 8, rel=1e-15)


def test_replace_keeps_hot_experts_in_their_slots():
    cur = Placement.from_slots(np.array([[1, 0, -1, -1, -1], [0, -1, -1, -1, 1]]))
    scores = np.array([[9.0, 1.0, 0.0, 5.0, 0.0],   # expert 0 stays (slot 1), 3 replaces 1 in slot 0
                       [3.0, 0.0, 0.0, 0.0, 2.0]])  # nothing changes
    new = replace_keeping_slots(cur, scores)
    assert new.gpu_slot.tolist() == [[1, -1, -1, 0, -1], [0, -1, -1, -1, 1]]
    assert cur.moves(new) == [(0, 0, 1, 3)]
    assert np.array_equal(new.n_slots, cur.n_slots)
    # hysteresis: a newcomer must be clearly hotter than the incumbent it displaces
    close = np.array([[9.0, 5.0, 0.0, 5.2, 0.0], [3.0, 0.0, 0.0, 0.0, 2.0]])
    assert replace_keeping_slots(cur, close, hysteresis=0.1) == cur
    assert replace_keeping_slots(cur, close, hysteresis=0.0).moves(cur) == [(0, 0, 3, 1)]


def test_replace_fills_empty_slots():
    cur = Placement.from_slots(np.array([[-1, 2, -1, -1]]), n_slots=[3])
    new = replace_keeping_slots(cur, np.array([[1.0, 2.5, 3.0, 0.5]]))
    assert new.experts_in_slots(0).tolist() == [0, 2, 1]  # expert 1 keeps slot 2; 0 and 2 fill 0 and 1
    drop = replace_keeping_slots(cur, np.array([[1.0, 0.5, 3.0, 2.0]]))
    assert drop.experts_in_slots(0).tolist() == [0, 2, 3]  # expert 1 leaves; newcomers by id


def test_dynamic_placer_decides_only_when_due_and_worth_it():
    L, E = 2, 8
    dp = DynamicPlacer((L, E), "2/layer", every_n_tokens=100, drift_threshold=0.05)
    assert dp.placement.gpu_counts().tolist() == [2, 2]  # uniform start: experts 0 and 4
    hot = np.array([[6, 7]] * 60)
    for l in range(L):
        dp.observe(l, hot)
    assert dp.poll() is None  # 60 < 100 tokens: not due
    for l in range(L):
        dp.observe(l, torch.tensor(hot[:40]))
    new = dp.poll()
    assert new is not None and new is dp.placement
    assert [np.flatnonzero(new.gpu_mask[l]).tolist() for l in range(L)] == [[6, 7], [6, 7]]
    assert dp.history[-1]["replaced"] and dp.history[-1]["moves"] == 4
    assert dp.history[-1]["hit_rate"] == 0.0 and dp.history[-1]["best_hit_rate"] == 1.0
    for l in range(L):
        dp.observe(l, np.array([[6, 7]] * 100))
    assert dp.tokens_seen == 200
    assert dp.poll() is None and not dp.history[-1]["replaced"]  # already optimal: no churn
    assert dp.poll(force=True) is None


def test_dynamic_placer_arguments():
    with pytest.raises(ValueError, match="needs a budget or an initial placement"):
        DynamicPlacer((2, 4))
    with pytest.raises(ValueError, match="every_n_tokens"):
        DynamicPlacer((2, 4), 2, every_n_tokens=0)
    init = Placement.from_contiguous(2, 4, 1)
    dp = DynamicPlacer((2, 4), initial=init)
    assert dp.placement is init
    with pytest.raises(ValueError, match="shape"):
        DynamicPlacer((3, 4), initial=init)
    with pytest.raises(ValueError, match="slot counts"):
        dp.adopt(Placement.from_contiguous(2, 4, 2))
    stats = ExpertStats.from_array(np.array([[0.0, 5.0, 1.0, 0.0], [2.0, 0.0, 0.0, 7.0]]))
    assert DynamicPlacer(stats, 2).placement.gpu_mask.astype(int).tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]


def _online(ids, E, dp, step=16):
    L, T, _ = ids.shape
    hits = total = 0
    for t0 in range(0, T, step):
        for l in range(L):
            blk = ids[l, t0:t0 + step]
            hits += int(dp.placement.gpu_mask[l, blk].sum())  # causal: scored before it is observed
            total += blk.size
            dp.observe(l, blk)
        dp.poll()
    return hits / total


def _stats(ids, E):
    s = ExpertStats(ids.shape[0], E)
    for l in range(ids.shape[0]):
        s.record(l, ids[l])
    return s


def test_skewed_routing_frequency_and_dynamic_beat_uniform():
    """Acceptance: at a 25 % budget on Zipf routing (alpha 1, different hot experts per layer),
    frequency and dynamic re-placement serve far more token-slots on the GPU than uniform."""
    L, E, K = 6, 32, 4
    cal = zipf_routing(L, E, K, 2048, alpha=1.0, seed=3, sample_seed=1)
    ev = zipf_routing(L, E, K, 4096, alpha=1.0, seed=3, sample_seed=2)  # same distribution, new sample
    uni = hit_rate(plan((L, E), 0.25, "uniform"), ev)
    freq = hit_rate(plan(_stats(cal, E), 0.25, "frequency"), ev)
    dyn = _online(ev, E, DynamicPlacer((L, E), 0.25, every_n_tokens=256))
    print(f"stationary hit rates: uniform {uni:.3f} frequency {freq:.3f} dynamic {dyn:.3f}")
    assert uni < 0.35  # uniform is blind to routing: near the budget fraction
    assert freq > uni + 0.25 and dyn > uni + 0.2

    # drifting: the hot experts are redrawn 4 times; frequency only saw the first distribution
    cal = zipf_routing(L, E, K, 4 * 1024, alpha=1.0, phases=4, seed=5, sample_seed=1)[:, :1024]
    ev = zipf_routing(L, E, K, 8192, alpha=1.0, phases=4, seed=5, sample_seed=2)
    uni = hit_rate(plan((L, E), 0.25, "uniform"), ev)
    freq = hit_rate(plan(_stats(cal, E), 0.25, "frequency"), ev)
    dyn = _online(ev, E, DynamicPlacer((L, E), 0.25, every_n_tokens=256))
    print(f"drifting hit rates: uniform {uni:.3f} frequency {freq:.3f} dynamic {dyn:.3f}")
    assert dyn > uni + 0.2 and dyn > freq + 0.1
