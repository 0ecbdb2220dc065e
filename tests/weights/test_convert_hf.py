"""Convert tiny HF checkpoints of every supported family, load them, check the MoE layer output.

Two checks per converted layer (kt.reference.moe_forward_quantized on the weights unpacked from
the loaded files):
- exact: equal to the same forward on ``reference.quantize(source weights)``: the converter adds
  no error beyond the scheme's own quantisation (the packed bytes are bit-identical);
- accuracy vs the fp32 forward on the source weights (std 1/sqrt(fan_in), x ~ N(0, 1)):
  INT8 <= 0.03, INT4 (G=64) <= 0.25, BF16 <= 0.006. These are ~1.3x what the reference
  quantiser itself reaches on such weights (INT8 ~0.02, INT4 G=64 ~0.19, BF16 ~0.004, measured
  with kt.reference on 8 experts, H=256, I=128): symmetric absmax INT4 with 15 levels has ~10 %
  RMS error per weight, so a whole layer cannot get below ~0.15 whatever the converter does.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from kt.testing.checkpoints import fp8_checkpoint, fused_checkpoint, hf_checkpoint, layer_errors

import kt
from kt.weights import SourceError, convert, load_experts, verify

BOUND = {"int8": 0.03, "int4": 0.25, "bf16": 0.006}
FAMILIES = [("qwen2_moe", "float16", None), ("qwen3_moe", "bfloat16", None),
            ("mixtral", "float32", None), ("deepseek_v2", "bfloat16", None),
            ("deepseek_v3", "bfloat16", "40KB")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    pytest.importorskip("transformers", reason="the HF checkpoint tests build models with transformers")
    root = tmp_path_factory.mktemp("hf")
    return {fam: hf_checkpoint(root, fam, dt, shard) for fam, dt, shard in FAMILIES}


@pytest.mark.parametrize("scheme", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("family", [f[0] for f in FAMILIES])
def test_family_convert_load_accuracy(ckpts, tmp_path, family, scheme):
    src, refs = ckpts[family]
    out = tmp_path / "out"
    m = convert(src, out, scheme, 64, progress=False, threads=2)
    assert m["layers"] == sorted(refs), "MoE layers (dense layers skipped)"
    assert verify(out) == []
    for L, (w13, w2) in refs.items():
        rel, diff, le = layer_errors(out, L, w13, w2)
        assert diff == 0.0, f"{family} {scheme} layer {L}: differs from reference.quantize by {diff}"
        assert rel <= BOUND[scheme], f"{family} {scheme} layer {L}: relative error {rel:.4f}"
        assert (le.E, le.H, le.I) == (w13.shape[0], w13.shape[2], w13.shape[1] // 2)
        for a in (le.w13.data, le.w13.scale, le.w2.data, le.w2.scale):
            assert a.flags.c_contiguous and a.ctypes.data % 64 == 0
            assert isinstance(a.base, np.memmap) or isinstance(a, np.memmap) or a.size == 0


def test_deepseek_skips_dense_and_shared(ckpts, tmp_path):
    src, refs = ckpts["deepseek_v3"]
    assert (src / "model.safetensors.index.json").exists(), "fixture should be sharded"
    m = convert(src, tmp_path / "o", "int8", progress=False)
    assert m["layers"] == [1, 2] and m["num_experts"] == 8 and m["intermediate_size"] == 32
    assert m["architecture"] == "DeepseekV3ForCausalLM"


@pytest.mark.parametrize("transposed", [False, True])
def test_fused_experts(tmp_path, transposed):
    src, refs = fused_checkpoint(tmp_path, transposed)
    out = tmp_path / "o"
    convert(src, out, "int4", 32, progress=False)
    for L, (w13, w2) in refs.items():
        rel, diff, le = layer_errors(out, L, w13, w2)
        assert diff == 0.0 and rel <= BOUND["int4"], (rel, diff)
        assert le.group_size == 32


def test_fp8_block_scaled(tmp_path):
    src, refs = fp8_checkpoint(tmp_path)
    out = tmp_path / "o"
    convert(src, out, "int8", progress=False)
    for L, (w13, w2) in refs.items():
        rel, diff, _ = layer_errors(out, L, w13, w2)
        assert diff == 0.0 and rel <= BOUND["int8"], (rel, diff)


def test_fp8_lut_matches_torch():
    torch = pytest.importorskip("torch")
    from kt.weights._quant_kernels import fp8_e4m3_block_dequant

    bytes_ = np.arange(256, dtype=np.uint8).reshape(16, 16)
    out = np.empty((16, 16), np.float32)
    fp8_e4m3_block_dequant(bytes_, np.ones((1, 1), np.float32), 128, 128, out)
    want = torch.from_numpy(bytes_).view(torch.float8_e4m3fn).float().numpy()
    np.testing.assert_array_equal(out, want)


def test_physical_to_logical_map(ckpts, tmp_path):
    src, refs = ckpts["qwen3_moe"]
    out = tmp_path / "o"
    convert(src, out, "int8", progress=False)
    base = load_experts(out, 0)
    p2l = np.array([3, 3, 0, 7, 1])
    le = load_experts(out, 0, p2l)
    assert le.E == 5 and le.w13.data.shape[0] == 5
    for p, e in enumerate(p2l):
        np.testing.assert_array_equal(le.w13.data[p], base.w13.data[e])
        np.testing.assert_array_equal(le.w2.scale[p], base.w2.scale[e])
    ident = load_experts(out, 0, np.arange(8))
    assert isinstance(ident.w13.data.base, np.memmap), "identity map must not copy"
    with pytest.raises(ValueError, match=r"physical_to_logical_map values must be in \[0, 8\)"):
        load_experts(out, 0, [0, 8])


def test_layer_subset_and_top_level_api(ckpts, tmp_path):
    src, _ = ckpts["mixtral"]
    out = tmp_path / "o"
    m = kt.convert(src, out, "bf16", layers="1", progress=False)
    assert m["layers"] == [1]
    assert kt.load_experts(out, 1).scheme is kt.QuantScheme.BF16
    with pytest.raises(ValueError, match=r"layers \[5\] are not MoE layers"):
        convert(src, tmp_path / "o2", "int8", layers=[5], progress=False)


def test_unknown_architecture(tmp_path):
    d = tmp_path / "llama"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                               "model_type": "llama"}))
    with pytest.raises(SourceError, match=r"unknown architecture 'LlamaForCausalLM' \(model_type 'llama'\)"):
        convert(d, tmp_path / "o", "int8", progress=False)


def test_checkpoint_without_experts(tmp_path):
    import torch
    from safetensors.torch import save_file

    d = tmp_path / "dense"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"],
                                               "model_type": "qwen3_moe", "num_hidden_layers": 1}))
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.zeros(8, 8)}, d / "model.safetensors")
    with pytest.raises(SourceError, match="no routed-expert tensors"):
        convert(d, tmp_path / "o", "int8", progress=False)


def test_missing_config_and_shard(ckpts, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        convert(tmp_path / "nope", tmp_path / "o", "int8", progress=False)
    src, _ = ckpts["deepseek_v3"]
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        convert(broken, tmp_path / "o", "int8", progress=False)


def test_truncated_source(ckpts, tmp_path):
    import shutil

    src, _ = ckpts["qwen3_moe"]
    broken = tmp_path / "trunc"
    shutil.copytree(src, broken)
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(SourceError, match="truncated"):
        convert(broken, tmp_path / "o", "int8", progress=False)


def test_config_disagrees_with_tensors(tmp_path):
    from kt.testing.checkpoints import small_checkpoint

    src, _ = small_checkpoint(tmp_path, 1, 4)
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = 99
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SourceError, match="moe_intermediate_size = 32 but config.json says 99"):
        convert(src, tmp_path / "o", "int8", progress=False)
