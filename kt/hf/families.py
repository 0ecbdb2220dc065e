"""The model families kt can patch, and what a tiny random model of each looks like.

Every family here (in transformers >= 5) keeps its router and shared experts in the sparse MoE
block and calls one experts module ``experts(x [T, H], topk_ids [T, K], topk_weights [T, K])``
holding fused weights ``gate_up_proj [E, 2I, H]`` (gate rows first) and ``down_proj [E, H, I]``,
with SiLU(gate) * up and no biases. That module is the only thing kt replaces, so each family's
routing (softmax / sigmoid, top-k normalisation, DeepSeek's grouped routing, score-correction
bias and ``routed_scaling_factor``) runs exactly as the model defines it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

__all__ = ["Family", "FAMILIES", "UNSUPPORTED", "family_of"]


@dataclass(frozen=True)
class Family:
    model_type: str
    title: str
    routing: str
    tiny: Mapping[str, object] = field(default_factory=dict)


def _f(model_type, title, routing, **tiny) -> Family:
    return Family(model_type, title, routing, MappingProxyType(tiny))


# The tiny configs exercise each family's routing options (top-k normalisation on and off,
# grouped routing, scaling factor, shared experts, a dense first layer for DeepSeek).
FAMILIES: Mapping[str, Family] = MappingProxyType({f.model_type: f for f in (
    _f("qwen3_moe", "Qwen3-MoE", "softmax, top-k, renormalised (norm_topk_prob)",
       num_experts=16, num_experts_per_tok=4, norm_topk_prob=True, head_dim=32),
    _f("qwen2_moe", "Qwen2-MoE", "softmax, top-k; sigmoid-gated shared expert",
       num_experts=16, num_experts_per_tok=4, norm_topk_prob=False,
       shared_expert_intermediate_size=128),
    _f("mixtral", "Mixtral", "softmax, top-k, renormalised",
       num_local_experts=8, num_experts_per_tok=2),
    _f("deepseek_v2", "DeepSeek-V2", "softmax, group-limited greedy top-k, routed_scaling_factor; "
       "shared experts",
       n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, kv_lora_rank=32,
       q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, head_dim=16,
       topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
       first_k_dense_replace=1, num_hidden_layers=3),
    _f("deepseek_v3", "DeepSeek-V3", "sigmoid + e_score_correction_bias, grouped top-k, "
       "renormalised, routed_scaling_factor; shared experts",
       n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, kv_lora_rank=32,
       q_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=32, head_dim=16,
       n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
       first_k_dense_replace=1, num_hidden_layers=3),
    _f("olmoe", "OLMoE", "softmax, top-k (no renormalisation)",
       num_experts=16, num_experts_per_tok=4, norm_topk_prob=False),
)})

# Known MoE families kt does not patch, and why (shown in the error).
UNSUPPORTED: Mapping[str, str] = MappingProxyType({
    "gpt_oss": "GPT-OSS experts use a clamped SwiGLU with biases on interleaved gate/up rows; "
               "kt's CPU experts compute SiLU(gate) * up without biases",
    "jetmoe": "JetMoE routes attention heads too (mixture of attention), not only the MLP",
    "nllb_moe": "NLLB-MoE is an encoder-decoder with ReLU experts",
})


def family_of(model_type: str | None) -> Family:
    """The Family of a transformers ``config.model_type``; ValueError naming the supported ones."""
    fam = FAMILIES.get(model_type or "")
    if fam is not None:
        return fam
    supported = ", ".join(sorted(FAMILIES))
    why = UNSUPPORTED.get(model_type or "")
    if why:
        raise ValueError(f"kt cannot patch model_type {model_type!r}: {why}. Supported: {supported}")
    raise ValueError(f"kt does not know model_type {model_type!r}; supported: {supported}")
