"""Decode attention on the CPU: one query token against the KV cache, in fp32 matmuls.

torch's CPU ``scaled_dot_product_attention`` is slow for a single query in bf16 without native
bf16 units: on a 2-core AVX2 host (Zen 3, one thread), 32 query / 4 KV heads of 128 over 512
cached positions take 4.4 ms (17.2 ms over 2048), where two fp32 matmuls and a softmax on the
same inputs take 0.50 ms (1.84 ms), at the same error against an fp32 reference. A Qwen3-30B-A3B
decode step runs 48 of them. ``patch_model`` / ``load_model`` register this function with
transformers (``AttentionInterface``, name "kt_cpu", with sdpa's masks) and select it for a
model that runs on the CPU with its dense part on kt; every call it does not cover (more than
one query, dropout, soft-capping, attention sinks, position biases, attention weights asked
for, a GPU) goes to transformers' sdpa function unchanged.
"""
from __future__ import annotations

import math

import torch

__all__ = ["NAME", "cpu_decode_attention", "register", "use_cpu_attention"]

NAME = "kt_cpu"
_UNCOVERED = ("softcap", "s_aux", "sinks", "position_bias")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def cpu_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                         scaling: float | None = None, is_causal=None, **kwargs):
    """transformers' attention-function contract: query [B, Hq, Q, D], key / value
    [B, Hkv, S, D], an sdpa mask (bool, True = attend; or additive) or None -> ([B, Q, Hq, D],
    None)."""
    B, Hq, Q, D = query.shape
    Hkv, S = key.shape[1], key.shape[2]
    if (Q != 1 or query.device.type != "cpu" or dropout or Hq % Hkv or value.shape[-1] != D
            or kwargs.get("output_attentions") or any(kwargs.get(k) is not None for k in _UNCOVERED)):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)
    G = Hq // Hkv
    q = query.reshape(B, Hkv, G, D).float()
    s = torch.matmul(q, key.float().transpose(-1, -2))  # [B, Hkv, G, S]
    s.mul_(scaling if scaling is not None else 1.0 / math.sqrt(D))
    if attention_mask is not None:
        m = attention_mask[..., -S:]  # [B | 1, 1 | Hq, 1, S]
        s = s.reshape(B, Hq, 1, S)
        if m.dtype == torch.bool:
            s = s.masked_fill(~m, float("-inf"))
        else:
            s = s + m.float()
        s = s.reshape(B, Hkv, G, S)
    p = torch.softmax(s, dim=-1)
    out = torch.matmul(p, value.float())  # [B, Hkv, G, D]
    return out.reshape(B, 1, Hq, D).to(query.dtype), None


def register() -> None:
    """Make "kt_cpu" known to transformers (idempotent): this function, and sdpa's masks."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, cpu_decode_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


def use_cpu_attention(model) -> bool:
    """Select "kt_cpu" for ``model`` if it runs sdpa attention now; True when selected."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or not hasattr(model, "set_attn_implementation"):
        return False
    register()
    model.set_attn_implementation(NAME)
    return getattr(model.config, "_attn_implementation", None) == NAME
