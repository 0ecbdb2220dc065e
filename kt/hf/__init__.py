"""kt.hf: run Hugging Face transformers MoE models with their experts on kt.

The only kt package that imports transformers (lazily: importing ``kt.hf`` needs torch only;
a missing transformers raises ImportError naming ``pip install 'kt[hf]'`` at first use).

    # a checkpoint on disk: its experts are never materialised (docs/hf.md)
    model, tok = kt.hf.load_model(path, kt.hf.PatchConfig(scheme="int8", weight_path=kt_dir))
    # a model already in memory: its experts are replaced and freed layer by layer
    kt.patch_model(model, kt.hf.PatchConfig(scheme="int8"))

Supported families: ``kt.hf.FAMILIES`` (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek-V2/V3, OLMoE).
"""
from __future__ import annotations

from .._lazy import lazy_getattr

_LAZY = {
    "PatchConfig": "kt.hf._patch:PatchConfig",
    "PatchInfo": "kt.hf._patch:PatchInfo",
    "patch_model": "kt.hf._patch:patch_model",
    "find_experts": "kt.hf._patch:find_experts",
    "KTExperts": "kt.hf._experts:KTExperts",
    "ReferenceMoE": "kt.hf._experts:ReferenceMoE",
    "FAMILIES": "kt.hf.families:FAMILIES",
    "family_of": "kt.hf.families:family_of",
    "build_tiny_model": "kt.hf.tiny:build_tiny_model",
    "save_tiny_model": "kt.hf.tiny:save_tiny_model",
    "train_tokenizer": "kt.hf.tiny:train_tokenizer",
    "tiny_config": "kt.hf.tiny:tiny_config",
    "Agreement": "kt.hf.accuracy:Agreement",
    "compare_models": "kt.hf.accuracy:compare_models",
    "load_model": "kt.hf.run:load_model",
    "LoadInfo": "kt.hf._loader:LoadInfo",
    "require_transformers": "kt.hf._compat:require_transformers",
    "record_routing": "kt.hf.stats:record_routing",
    "moe_layers": "kt.hf.stats:moe_layers",
}

__all__ = sorted(_LAZY)


__getattr__ = lazy_getattr("kt.hf", globals(), _LAZY)


def __dir__():
    return sorted(set(globals()) | set(__all__))
