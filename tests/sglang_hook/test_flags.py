"""kt's --kt-* flags, validation, placement resolution and the version guard, without SGLang (these
run in the test environment itself; the SGLang side is test_sglang_plugin.py)."""
from __future__ import annotations

import argparse
import json
import logging
import sys

import numpy as np
import pytest

import kt.sglang_hook as hook
from kt.placement import ExpertStats, Placement
from kt.sglang_hook._flags import (FLAGS, KTArgumentError, KTOptions, ModelInfo, add_flags, model_info_from_config,
                                   options_from_namespace, parse_numa_nodes, parse_threshold, read_model_info,
                                   resolve_placement, validate)


def _parse(argv):
    p = argparse.ArgumentParser()
    add_flags(p, only_missing=False)
    return options_from_namespace(p.parse_args(argv))


def test_every_flag_parses_and_round_trips_as_a_dict():
    o = _parse(["--kt-weight-path", "/w", "--kt-method", "AMXINT8", "--kt-cpuinfer", "8",
                "--kt-threadpool-count", "2", "--kt-num-gpu-experts", "3", "--kt-max-deferred-experts-per-token",
                "1", "--kt-numa-nodes", "0-1", "--kt-gpu-prefill-token-threshold", "512",
                "--kt-enable-dynamic-expert-update", "--kt-expert-placement-strategy", "front-loading",
                "--init-expert-location", "s.pt", "--record-kt-gpu-expert-distribution",
                "--kt-placement", "p.json", "--kt-gpu-expert-budget", "1.5GB"])
    assert o.kt_numa_nodes == (0, 1) and o.kt_gpu_prefill_token_threshold == 512
    assert o.kt_gpu_expert_budget == 1_500_000_000 and o.record_kt_gpu_expert_distribution == "kt_expert_stats.npz"
    assert o.stats_path == "s.pt" and o.active
    back = KTOptions.from_dict(json.loads(json.dumps(o.to_dict())))
    assert back == o
    assert len(FLAGS) == 15 and len({f.name for f in FLAGS}) == 15


def test_add_flags_skips_names_the_parser_already_has():
    p = argparse.ArgumentParser()
    p.add_argument("--kt-weight-path")
    p.add_argument("--init-expert-location", default="trivial")
    added = add_flags(p)
    assert "--kt-weight-path" not in added and "--init-expert-location" not in added
    assert "--kt-placement" in added and len(added) == 13


def test_defaults_are_upstreams_and_inactive():
    o = _parse([])
    assert (o.kt_method, o.kt_threadpool_count, o.kt_expert_placement_strategy) == ("AMXINT4", 2, "uniform")
    assert not o.active and o.stats_path is None
    assert validate(o) == []


@pytest.mark.parametrize("text, want", [("auto", "auto"), ("AUTO", "auto"), ("1", 1), ("4096", 4096), (None, None)])
def test_threshold_values(text, want):
    assert parse_threshold(text) == want


@pytest.mark.parametrize("text", ["0", "-3", "soon", "1.5"])
def test_threshold_rejects(text):
    with pytest.raises(KTArgumentError, match="positive integer or 'auto'"):
        parse_threshold(text)


def test_numa_nodes():
    assert parse_numa_nodes("0") == (0,) and parse_numa_nodes("0,2") == (0, 2)
    assert parse_numa_nodes("1-3") == (1, 2, 3)
    for bad in ("a", "3-1", "0,0"):
        with pytest.raises(KTArgumentError, match="--kt-numa-nodes"):
            parse_numa_nodes(bad)
    with pytest.raises(KTArgumentError, match="do not exist on this host"):
        validate(KTOptions(kt_numa_nodes=(4095,)))


def test_argparse_shows_kt_messages(capsys):
    p = argparse.ArgumentParser(prog="x")
    add_flags(p, only_missing=False)
    with pytest.raises(SystemExit):
        p.parse_args(["--kt-gpu-experts-ratio", "1.5"])
    assert "expected a number in (0, 1], got 1.5" in capsys.readouterr().err


def _weight_dir(tmp_path, scheme="int8", E=8, H=64, I=32, layers=(0, 1)):
    d = tmp_path / "w"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps({"scheme": scheme, "num_experts": E, "hidden_size": H,
                                                 "intermediate_size": I, "layers": list(layers)}))
    return d


def test_validate_errors_name_the_flag(tmp_path):
    model = ModelInfo(2, 8, 2, 64, 32, (0, 1))
    w = _weight_dir(tmp_path)
    cases = [
        (KTOptions(kt_weight_path=str(w), kt_method="AMX"), "--kt-method 'AMX' is not known"),
        (KTOptions(kt_weight_path=str(tmp_path / "no")), "no such directory"),
        (KTOptions(kt_weight_path=str(tmp_path)), "no manifest.json"),
        (KTOptions(kt_weight_path=str(w), kt_method="AMXINT4x"), "is not known"),
        (KTOptions(kt_weight_path=str(w), kt_method="BF16"), "holds int8"),
        (KTOptions(kt_num_gpu_experts=1, kt_gpu_expert_budget=10), "only one GPU-expert budget"),
        (KTOptions(kt_placement="p.json", kt_num_gpu_experts=1), "--kt-placement fixes"),
        (KTOptions(kt_placement=str(tmp_path / "p.json")), "no such file"),
        (KTOptions(kt_num_gpu_experts=1, init_expert_location=str(tmp_path / "s.pt")), "no such file"),
        (KTOptions(kt_num_gpu_experts=1, kt_cpuinfer=0), "--kt-cpuinfer: expected an integer >= 1"),
        (KTOptions(kt_num_gpu_experts=-1), "--kt-num-gpu-experts: expected an integer >= 0"),
        (KTOptions(kt_num_gpu_experts=1, kt_max_deferred_experts_per_token=2), "below the model's top-k"),
        (KTOptions(kt_num_gpu_experts=1, record_kt_gpu_expert_distribution="x.txt"), ".npz or .json"),
    ]
    for opts, msg in cases:
        with pytest.raises(KTArgumentError, match=None) as ei:
            validate(opts, model)
        assert msg in str(ei.value), (opts, str(ei.value))
    # a directory converted from another model
    w2 = tmp_path / "w2"
    w2.mkdir()
    (w2 / "manifest.json").write_text(json.dumps({"scheme": "int8", "num_experts": 16, "hidden_size": 64,
                                                  "intermediate_size": 32, "layers": [0, 1]}))
    with pytest.raises(KTArgumentError, match=r"\(E, H, I\) = \(16, 64, 32\), but the model has \(8, 64, 32\)"):
        validate(KTOptions(kt_weight_path=str(w2)), model)
    # upstream's default method on an int8 directory: a note, not an error
    assert validate(KTOptions(kt_weight_path=str(w)), model) == [
        "--kt-method defaults to AMXINT4; using the weight directory's scheme int8"]


def test_stats_of_the_wrong_shape(tmp_path):
    s = tmp_path / "s.npy"
    np.save(s, np.ones((2, 9)))
    with pytest.raises(KTArgumentError, match=r"--init-expert-location: .*\[2, 9\]"):
        validate(KTOptions(kt_num_gpu_experts=1, init_expert_location=str(s)), ModelInfo(2, 8, 2, 64, 32, (0, 1)))


def test_model_info_from_configs(tmp_path):
    ds = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "n_routed_experts": 16, "hidden_size": 64,
          "moe_intermediate_size": 32, "num_experts_per_tok": 4, "first_k_dense_replace": 1}
    m = model_info_from_config(ds)
    assert (m.num_layers, m.num_experts, m.top_k, m.hidden, m.intermediate, m.moe_layers) == (4, 16, 4, 64, 32,
                                                                                               (1, 2, 3))
    mx = {"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 8, "hidden_size": 64,
          "intermediate_size": 96, "num_experts_per_tok": 2}
    assert model_info_from_config(mx).intermediate == 96
    assert model_info_from_config({"model_type": "llama", "num_hidden_layers": 2}) is None
    (tmp_path / "config.json").write_text(json.dumps(ds))
    assert read_model_info(tmp_path) == m
    assert read_model_info("Qwen/Qwen3-30B-A3B") is None  # a hub id: SGLang resolves it later


def test_resolve_placement_budgets_and_strategies(tmp_path):
    model = ModelInfo(4, 8, 2, 64, 32, (1, 2, 3))
    p = resolve_placement(KTOptions(kt_num_gpu_experts=2), model)
    assert p.gpu_counts().tolist() == [0, 2, 2, 2]  # the dense layer gets none
    assert p.row(1).tolist() == [0, -1, -1, -1, 1, -1, -1, -1]  # uniform: spread over the ids
    assert resolve_placement(KTOptions(kt_num_gpu_experts=0), model).total_slots == 0
    assert resolve_placement(KTOptions(kt_weight_path="w"), model).total_slots == 0  # no budget: all CPU
    assert resolve_placement(KTOptions(kt_gpu_experts_ratio=0.25), model).total_slots == 6
    eb = 3 * 64 * 32 * 2
    assert resolve_placement(KTOptions(kt_gpu_expert_budget=5 * eb + 7), model, eb).total_slots == 5
    counts = np.zeros((4, 8))
    counts[2, 5] = counts[3, 6] = counts[1, 7] = 9
    ExpertStats.from_array(counts).save(tmp_path / "s.npz")
    f = resolve_placement(KTOptions(kt_gpu_experts_ratio=3 / 24, kt_expert_placement_strategy="frequency",
                                    init_expert_location=str(tmp_path / "s.npz")), model)
    assert sorted(map(tuple, np.argwhere(f.gpu_mask).tolist())) == [(1, 7), (2, 5), (3, 6)]
    fixed = Placement.from_slots(np.array([[-1] * 8, [1, -1, -1, 0, -1, -1, -1, -1], [-1] * 8, [-1] * 7 + [0]]))
    fixed.save(tmp_path / "p.json")
    assert resolve_placement(KTOptions(kt_placement=str(tmp_path / "p.json")), model) == fixed
    with pytest.raises(KTArgumentError, match="--kt-placement"):
        resolve_placement(KTOptions(kt_placement=str(tmp_path / "p.json")), ModelInfo(4, 16, 2, 64, 32, ()))
    with pytest.raises(KTArgumentError, match="exceeds the 8 experts"):
        resolve_placement(KTOptions(kt_num_gpu_experts=9), model)


def test_version_guard_leaves_sglang_untouched(monkeypatch, caplog):
    assert hook.is_supported("0.5.23") and hook.is_supported("0.5.23.post2") and hook.is_supported("0.5.23+cu130")
    assert not hook.is_supported("0.5.22") and not hook.is_supported("0.6.0") and not hook.is_supported(None)
    monkeypatch.setattr(hook, "sglang_version", lambda: "0.5.22")
    monkeypatch.setattr(hook, "_installed", False)
    before = {m for m in sys.modules if m.startswith("sglang")}
    with caplog.at_level(logging.WARNING, logger="kt.sglang_hook"):
        hook.plugin()
    assert "SGLang 0.5.22 is not supported" in caplog.text and "0.5.23" in caplog.text
    assert "leaves SGLang untouched" in caplog.text
    assert {m for m in sys.modules if m.startswith("sglang")} == before
    assert "kt.sglang_hook._hooks" not in sys.modules or hook._installed is False


def test_pool_on_chosen_numa_nodes():
    """--kt-numa-nodes: the pool's workers run on those nodes' CPUs; the caller's affinity is kept."""
    import os

    from kt.cpu_ops.runtime.pool import numa_nodes
    from kt.sglang_hook._cpu import make_pool, node_cpus

    before = os.sched_getaffinity(0)
    node = min(numa_nodes())
    pool = make_pool(KTOptions(kt_numa_nodes=(node,), kt_cpuinfer=2))
    try:
        assert os.sched_getaffinity(0) == before
        assert set(pool.nodes) == {node} and pool.num_threads == 2
        cpus = node_cpus((node,))
        for t in pool._state.threads:
            assert os.sched_getaffinity(t.native_id) <= cpus
    finally:
        pool.shutdown()
    with pytest.raises(KTArgumentError, match="have no CPU this process may use"):
        node_cpus((4095,))


def test_model_config_that_is_not_an_object_is_a_clear_error(tmp_path):
    from kt.sglang_hook._flags import KTArgumentError, read_model_info

    for body in (b"[1, 2]", b"\xff\xfe\x00", b"[" * 100000 + b"]" * 100000):
        (tmp_path / "config.json").write_bytes(body)
        with pytest.raises(KTArgumentError, match="config.json"):
            read_model_info(tmp_path)
