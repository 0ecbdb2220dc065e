"""The launch-config heuristic and tuned tables (pure functions; no kernels)."""
import json

import pytest

from kt.gpu_ops.configs import (DIRECT_MAX_T, DirectConfig, MoEConfig, config_from_dict, load_table, pick_config,
                                shape_key, table_name)


def test_heuristic_regimes():
    # Few rows per slot (just above the direct path's limit): smallest row block; prefill: large tiles.
    small = pick_config(DIRECT_MAX_T + 1, 8, 32, 2048, 768, "bf16")
    large = pick_config(4096, 8, 32, 2048, 768, "bf16")
    assert small.block_m == 16 and large.block_m >= 64
    assert large.block_m * large.block_n > small.block_m * small.block_n
    # Monotone in T: block_m never shrinks as T grows.
    ms = [pick_config(t, 8, 32, 2048, 768, "bf16").block_m for t in (16, 64, 256, 1024, 4096)]
    assert ms == sorted(ms)
    # int8 weights with many rows per slot: two-level int8 activations; never for float weights
    assert pick_config(4096, 8, 32, 2048, 768, "int8").a8 and not pick_config(64, 8, 32, 2048, 768, "int8").a8
    assert not any(pick_config(t, 8, 32, 2048, 768, "bf16").a8 for t in (64, 4096))


def test_pick_config_is_pure():
    a = pick_config(64, 8, 32, 2048, 768, "int8")
    b = pick_config(64, 8, 32, 2048, 768, "int8")
    assert a == b and isinstance(a, MoEConfig)


def test_table_lookup_nearest_at_or_above():
    cfg16 = dict(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)
    cfg128 = dict(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
    direct = dict(path="direct", block_n=32, block_k=128, down_block_n=8)
    table = {shape_key(2048, 768, "bf16"): {"16": cfg16, "128": cfg128, "4": direct}}
    assert pick_config(9, 8, 32, 2048, 768, "bf16", table) == MoEConfig(**cfg16)
    assert pick_config(17, 8, 32, 2048, 768, "bf16", table) == MoEConfig(**cfg128)
    assert pick_config(9999, 8, 32, 2048, 768, "bf16", table) == MoEConfig(**cfg128)
    # Decode-sized calls take the direct entries only (nearest at or above, else the largest).
    assert pick_config(1, 8, 32, 2048, 768, "bf16", table) == DirectConfig(block_n=32, block_k=128, down_block_n=8)
    assert pick_config(4, 2, 32, 2048, 768, "bf16", table) == DirectConfig(block_n=32, block_k=128, down_block_n=8)
    # Another shape or dtype falls back to the heuristic.
    assert pick_config(1, 8, 32, 2048, 768, "int8", table) == pick_config(1, 8, 32, 2048, 768, "int8")
    assert pick_config(9, 8, 32, 2048, 768, "int8", table) == pick_config(9, 8, 32, 2048, 768, "int8")


def test_shipped_tables_are_valid():
    for name in ("h200",):
        table = load_table(name)
        for key, entries in table.items():
            assert key.startswith("H") and "_I" in key, key
            for t, cfg in entries.items():
                assert int(t) >= 1
                config_from_dict(cfg)


def test_table_name():
    assert table_name("NVIDIA H200") == "h200"
    assert table_name("NVIDIA H100 80GB HBM3") == "h100"
    assert table_name("Tesla T4") is None
    assert load_table(None) == {} and load_table("no-such-gpu") == {}


@pytest.mark.parametrize("bad,match", [
    (dict(block_m=24), "block_m must be a power of two"),
    (dict(block_k=8), "block_k must be a power of two >= 16"),
    (dict(num_warps=3), "num_warps"),
    (dict(num_stages=0), "num_stages"),
    (dict(group_m=0), "group_m"),
    (dict(down_block_n=48), "down_block_n must be a power of two"),
    (dict(down_block_m=8), "down_block_m must be a power of two >= 16"),
    (dict(a8="yes"), "a8 must be a bool"),
    (dict(down_num_warps=3), "down_num_warps"),
    (dict(down_num_stages=9), "down_num_stages"),
    (dict(down_group_m=0), "down_group_m"),
])
def test_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**bad)


@pytest.mark.parametrize("bad,match", [
    (dict(block_n=8), "block_n must be a power of two >= 16"),
    (dict(gate_up="pairs", block_n=3), "block_n must be a power of two >= 1"),
    (dict(gate_up="rows"), "gate_up must be 'scan' or 'pairs'"),
    (dict(down_block_n=3), "down_block_n must be a power of two >= 1"),
    (dict(down_block_k=8), "down_block_k"),
    (dict(num_stages=0), "num_stages"),
    (dict(down_num_warps=32), "down_num_warps"),
    (dict(down_num_stages=0), "down_num_stages"),
])
def test_direct_config_validation(bad, match):
    with pytest.raises(ValueError, match=match):
        DirectConfig(**bad)


def test_down_fields_and_round_trips():
    c = MoEConfig(block_m=128, block_n=64, down_block_n=128, down_num_warps=8)
    d = c.for_down()
    assert (d.block_m, d.block_n, d.block_k, d.num_warps, d.num_stages) == (128, 128, 64, 8, 3)
    assert MoEConfig().for_down() == MoEConfig()
    own = MoEConfig(block_m=64, down_block_m=128)
    assert own.align_m == 128 and own.for_down().block_m == 128 and own.for_down().align_m == 128
    assert MoEConfig(block_m=128, down_block_m=32).align_m == 128 and MoEConfig(block_m=32).align_m == 32
    assert config_from_dict(own.to_dict()) == own
    assert config_from_dict(c.to_dict()) == c and "down_block_k" not in c.to_dict()
    assert DirectConfig(gate_up="pairs", block_n=2).block_n == 2
    dc = DirectConfig(gate_up="pairs", block_n=4, down_block_n=4)
    assert config_from_dict(json.loads(json.dumps(dc.to_dict()))) == dc
    with pytest.raises(ValueError, match="unknown fields"):
        config_from_dict({"path": "direct", "block_m": 16})


def test_bad_arguments():
    with pytest.raises(ValueError, match="weight_dtype"):
        pick_config(1, 8, 32, 2048, 768, "int4")
    with pytest.raises(ValueError, match="num_tokens"):
        pick_config(-1, 8, 32, 2048, 768, "bf16")
    with pytest.raises(ValueError, match="unknown fields"):
        MoEConfig.from_dict({"block_m": 16, "BLOCK_N": 32})
    json.dumps(MoEConfig().to_dict())


def test_kt_gpu_table_overrides_the_packaged_table(monkeypatch, tmp_path):
    from kt.gpu_ops.configs import table_for_device

    monkeypatch.delenv("KT_GPU_TABLE", raising=False)
    packaged, src = table_for_device("NVIDIA H200")
    assert packaged and src == "packaged h200.json"
    assert table_for_device("Some Future GPU") == ({}, "none (the heuristic)")
    mine = {"H2048_I768_int8": {"64": {"block_m": 32, "a8": True}, "1": {"path": "direct", "block_n": 4,
                                                                       "gate_up": "pairs"}}}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**mine, "_comment": "tuned here"}))
    monkeypatch.setenv("KT_GPU_TABLE", str(path))
    table, src = table_for_device("NVIDIA H200")
    assert table == mine and src == f"KT_GPU_TABLE={path}"
    cfg = pick_config(64, 8, 32, 2048, 768, "int8", table)
    assert cfg.block_m == 32 and cfg.a8
    for bad, match in (("[1, 2]", "expected a JSON object"), ('{"k": [1]}', "k must map T to configs"),
                       ('{"k": {"x": {}}}', "k T=x"), ('{"k": {"8": {"block_q": 1}}}', "unknown fields"),
                       ("{oops", "not a JSON file")):
        path.write_text(bad)
        with pytest.raises(ValueError, match=match):
            table_for_device("NVIDIA H200")
    monkeypatch.setenv("KT_GPU_TABLE", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="KT_GPU_TABLE=.*no such file"):
        table_for_device("NVIDIA H200")
