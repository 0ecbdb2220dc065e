"""kt.patch_model from a kt weight directory (kt.weights.convert of a saved HF checkpoint), and
the clear errors for a directory that does not belong to the model."""
from __future__ import annotations

import copy

import pytest
import torch

from _hf_models import require_kt_backend  # noqa: F401  (sets the transformers skip)

from kt.hf import PatchConfig, patch_model
from kt.hf.accuracy import random_prompts
from kt.hf.tiny import save_tiny_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import kt.weights
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("hfw")
    model_dir = save_tiny_model(root / "model", "qwen3_moe", seed=0)
    other_dir = save_tiny_model(root / "other", "qwen3_moe", seed=1)
    w8 = root / "kt-int8"
    kt.weights.convert(model_dir, w8, scheme="int8", progress=False)

    def load(d=model_dir):
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()

    return {"model": model_dir, "other": other_dir, "w8": w8, "load": load}


def test_weight_dir_gives_the_in_memory_result(saved):
    require_kt_backend()
    ids = random_prompts(512, n=1, length=16, seed=0)[0]
    base = saved["load"]()
    from_dir = patch_model(copy.deepcopy(base), PatchConfig(scheme="int8", weight_path=saved["w8"]),
                           progress=False)
    in_mem = patch_model(copy.deepcopy(base), PatchConfig(scheme="int8"), progress=False)
    with torch.no_grad():
        a, b = from_dir(ids).logits, in_mem(ids).logits
    # kt convert and CPUMoE.from_tensors quantise the same bf16 weights the same way
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_weight_dir_with_reference_backend(saved):
    ids = random_prompts(512, n=1, length=8, seed=1)[0]
    base = saved["load"]()
    with pytest.warns(UserWarning, match="reference"):
        a = patch_model(copy.deepcopy(base), PatchConfig(scheme="int8", weight_path=saved["w8"],
                                                         backend="reference"), progress=False)
        b = patch_model(copy.deepcopy(base), PatchConfig(scheme="int8", backend="reference"),
                        progress=False)
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case, match", [
    ("scheme", "converted with scheme int8, but PatchConfig asks for int4"),
    ("other_model", "differs from this model's weights"),
    ("other_family", "converted from a 'qwen3_moe' model, but this model is 'mixtral'"),
    ("not_a_dir", "not a directory"),
    ("no_manifest", "missing; not a complete kt weight directory"),
])
def test_weight_dir_mismatch_is_a_clear_error(saved, tmp_path, case, match):
    from kt.hf.tiny import build_tiny_model
    from kt.weights import WeightFormatError

    model, scheme, path = saved["load"](), "int8", saved["w8"]
    if case == "scheme":
        scheme = "int4"
    elif case == "other_model":
        model = saved["load"](saved["other"])
    elif case == "other_family":
        model = build_tiny_model("mixtral")
    elif case == "not_a_dir":
        path = tmp_path / "nothing"
    elif case == "no_manifest":
        path = tmp_path
    with pytest.raises(WeightFormatError, match=match):
        patch_model(model, PatchConfig(scheme=scheme, weight_path=path, backend="reference"),
                    progress=False)
    assert not hasattr(model, "kt_patch"), "a refused weight dir must leave the model unpatched"
