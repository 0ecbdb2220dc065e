"""The four strategies (exact masks on small statistics) and the planner's budget arithmetic."""
import warnings

import numpy as np
import pytest
import torch

from kt.placement import (STRATEGIES, Budget, ExpertStats, Placement, expert_nbytes, frequency_mask,
                          front_loading_mask, parse_bytes, plan, random_mask, resolve_budget, uniform_mask)

COUNTS = np.array([[5.0, 1.0, 3.0, 0.0],
                   [4.0, 4.0, 2.0, 9.0]])


def test_uniform_exact_masks():
    # 5 over 2 layers: 3 + 2, ids spread floor(i * E / k)
    assert uniform_mask(5, 2, 4).astype(int).tolist() == [[1, 1, 1, 0], [1, 0, 1, 0]]
    assert uniform_mask(2, 2, 8).astype(int).tolist() == [[1, 0, 0, 0, 0, 0, 0, 0]] * 2
    assert np.flatnonzero(uniform_mask(6, 2, 8)[0]).tolist() == [0, 2, 5]
    assert np.flatnonzero(uniform_mask(8, 2, 8)[1]).tolist() == [0, 2, 4, 6]
    assert uniform_mask(8, 2, 4).all() and not uniform_mask(0, 2, 4).any()


def test_frequency_exact_mask_global_top_n():
    # top 3 of the whole model: (1,3)=9, (0,0)=5, then the tie 4/4 in layer 1 goes to the lower id
    assert frequency_mask(3, 2, 4, COUNTS).astype(int).tolist() == [[1, 0, 0, 0], [1, 0, 0, 1]]
    assert frequency_mask(5, 2, 4, COUNTS).astype(int).tolist() == [[1, 0, 1, 0], [1, 1, 0, 1]]  # 9 5 4 4 3
    # ties across layers go to the earlier layer
    assert frequency_mask(1, 2, 2, np.ones((2, 2))).astype(int).tolist() == [[1, 0], [0, 0]]
    with pytest.raises(ValueError, match="'frequency' needs activation statistics"):
        frequency_mask(3, 2, 4, None)


def test_front_loading_exact_mask():
    assert front_loading_mask(5, 2, 4).astype(int).tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    assert front_loading_mask(2, 3, 4).astype(int).tolist() == [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]


def test_random_exact_and_reproducible():
    assert random_mask(5, 2, 4, seed=42).astype(int).tolist() == [[0, 0, 1, 1], [1, 0, 1, 1]]
    assert random_mask(5, 2, 4, seed=7).astype(int).tolist() == [[1, 0, 1, 0], [1, 0, 1, 1]]
    big = random_mask(100, 10, 32, seed=1)
    assert big.sum() == 100 and np.array_equal(big, random_mask(100, 10, 32, seed=1))


def test_strategy_names():
    assert set(STRATEGIES) == {"uniform", "frequency", "front-loading", "random"}
    p = plan((2, 4), 5, "front_loading")
    assert p.gpu_mask.astype(int).tolist() == [[1, 1, 1, 1], [1, 0, 0, 0]]
    with pytest.raises(ValueError, match="unknown placement strategy 'hottest'"):
        plan((2, 4), 5, "hottest")


@pytest.mark.parametrize("text, expected", [
    ("24GiB", 24 * 2**30), ("24 GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
    ("10", 10), ("4k", 4096), ("2G", 2 * 2**30), ("100B", 100), (123, 123)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["abc", "-1GiB", "1 parsec", "", "GiB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes(text)


@pytest.mark.parametrize("value, kind, v", [
    (96, "total", 96), (0.25, "ratio", 0.25), ("25%", "ratio", 0.25), ("0.5", "ratio", 0.5),
    ("8/layer", "per_layer", 8), ("8 per layer", "per_layer", 8), ("96", "total", 96),
    ("24GiB", "bytes", 24 * 2**30), (Budget.bytes(1000), "bytes", 1000)])
def test_budget_parse(value, kind, v):
    b = Budget.parse(value)
    assert (b.kind, b.value) == (kind, v)


@pytest.mark.parametrize("value, message", [
    (0.0, r"ratio budget must be in \(0, 1\]"), (1.5, r"ratio budget must be in \(0, 1\]"),
    ("150%", r"ratio budget must be in \(0, 1\]"), (-3, "non-negative integer"),
    ("lots", "cannot read budget 'lots'"), (True, None)])
def test_budget_parse_rejects(value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Budget.parse(value)


def test_expert_nbytes():
    assert expert_nbytes(2048, 768, "bf16") == 3 * 2048 * 768 * 2
    assert expert_nbytes(2048, 768, "fp32") == 3 * 2048 * 768 * 4
    # fp8: one byte per weight + fp32 scale per 128x128 block: gate/up 6x16 blocks each, down 16x6
    assert expert_nbytes(2048, 768, "fp8") == 3 * 2048 * 768 + 4 * (2 * 6 * 16 + 16 * 6)
    assert expert_nbytes(2048, 768, "int8") == 3 * 2048 * 768 + 4 * (2 * 768 + 2048)
    assert expert_nbytes(256, 128, "int4", group_size=64) == 3 * 256 * 128 // 2 + 4 * (2 * 128 * 4 + 256 * 2)
    with pytest.raises(ValueError, match="unknown GPU dtype"):
        expert_nbytes(8, 8, "int3")


def test_ratio_budget_edges():
    assert resolve_budget(0.25, 4, 8) == 8
    assert resolve_budget(1.0, 4, 8) == 32
    assert resolve_budget(1 / 32, 4, 8) == 1
    with pytest.raises(ValueError, match="less than one expert"):
        resolve_budget(0.03, 4, 8)  # 0.96 experts
    p = plan(COUNTS, 0.5, "frequency")
    assert p.num_gpu_experts() == 4


def test_count_budgets():
    assert resolve_budget("3/layer", 4, 8) == 12
    p = plan((4, 8), "3/layer", "uniform")
    assert p.gpu_counts().tolist() == [3, 3, 3, 3]
    assert plan((4, 8), 0, "uniform") == Placement.all_cpu(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plan((4, 8), 32, "random").gpu_mask.all()  # exactly all: no warning
    with pytest.warns(UserWarning, match="allows 33 experts but the model has only 32"):
        assert plan((4, 8), 33, "uniform").gpu_mask.all()
    with pytest.warns(UserWarning, match="placing every expert on the GPU"):
        assert plan((4, 8), "9/layer", "front-loading").gpu_mask.all()


def test_byte_budget_edges():
    eb = 1000
    assert resolve_budget(Budget.bytes(2999), 4, 8, expert_bytes=eb) == 2
    assert resolve_budget(Budget.bytes(3000), 4, 8, expert_bytes=eb) == 3
    assert resolve_budget("5000B", 4, 8, expert_bytes=eb, reserve_bytes=2001) == 2
    assert resolve_budget("5000B", 4, 8, expert_bytes=eb, reserve_bytes="2000") == 3
    with pytest.raises(ValueError, match=r"smaller than one expert \(1000 B\)"):
        resolve_budget(Budget.bytes(999), 4, 8, expert_bytes=eb)
    with pytest.raises(ValueError, match="minus .* reserved is smaller than one expert"):
        resolve_budget("3000B", 4, 8, expert_bytes=eb, reserve_bytes=2500)
    with pytest.raises(ValueError, match="needs expert_bytes"):
        resolve_budget("24GiB", 4, 8)
    with pytest.raises(ValueError, match="reserve_bytes applies to a byte budget"):
        resolve_budget(10, 4, 8, reserve_bytes=100)
    # 24 GiB minus 4 GiB of KV cache in bf16 qwen3-30b-a3b experts (9 MiB each) = 2275 experts
    eb = expert_nbytes(2048, 768, "bf16")
    assert resolve_budget("24GiB", 48, 128, expert_bytes=eb, reserve_bytes="4GiB") == (20 * 2**30) // eb == 2275
    p = plan((48, 128), "24GiB", "uniform", expert_bytes=eb, reserve_bytes="4GiB")
    assert p.num_gpu_experts() == 2275 and p.gpu_bytes() <= 20 * 2**30 and p.expert_bytes == eb
    with pytest.warns(UserWarning, match="every expert"):
        assert plan(COUNTS, "1GiB", "frequency", expert_bytes=eb).gpu_mask.all()


def test_plan_inputs_and_moe_layers():
    stats = ExpertStats.from_array(COUNTS, model="toy")
    p = plan(stats, 3)
    assert p.gpu_mask.astype(int).tolist() == [[1, 0, 0, 0], [1, 0, 0, 1]] and p.model == "toy"
    assert plan(torch.tensor(COUNTS), 3) == plan(COUNTS, 3, model=None)
    with pytest.raises(ValueError, match="needs activation statistics"):
        plan((2, 4), 3, "frequency")
    with pytest.raises(ValueError, match="negative count"):
        plan(-COUNTS, 3)
    with pytest.raises(TypeError, match="plan: expected ExpertStats"):
        plan("stats.npz", 3)
    # dense layers 0 and 3 get nothing and do not count toward a per-layer budget
    q = plan((4, 8), "2/layer", "uniform", moe_layers=[1, 2])
    assert q.gpu_counts().tolist() == [0, 2, 2, 0]
    r = plan((4, 8), 0.5, "front-loading", moe_layers=[2, 3])
    assert r.gpu_counts().tolist() == [0, 0, 8, 0]
    with pytest.raises(ValueError, match="moe_layers"):
        plan((4, 8), 1, "uniform", moe_layers=[4])
