"""SGLang's side of a kt MoE layer: its GPU method over the hot experts, and the model's shape.

Legend: T tokens, E experts, K top-k, H hidden size, I expert intermediate size.
"""
from __future__ import annotations

import torch

from ._flags import KTArgumentError, ModelInfo

__all__ = ["gpu_part", "model_info"]


def gpu_part(gpu_method, e2s, layer, dispatch_output, x, topk_ids, topk_weights, router_logits):
    """The hot experts' output [T, H]: SGLang's GPU method on the ids remapped to GPU slots
    (``e2s`` [E] slot or -1; cold ids become -1)."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    valid = topk_ids >= 0
    slots = e2s[topk_ids.clamp(min=0).long()]
    remapped = torch.where(valid, slots, torch.full_like(slots, -1)).to(topk_ids.dtype)
    if x.is_cuda:  # SGLang's GPU kernels skip id -1
        out = gpu_method.apply(layer, dispatch_output._replace(
            topk_output=StandardTopKOutput(topk_weights, remapped, router_logits)))
        return out.hidden_states
    # CPU tensors: SGLang's CPU MoE paths reject id -1 (and repeated ids in a row), so give it
    # only the hot (token, k) pairs, one per row, and sum the rows back per token
    t_idx, k_idx = (remapped >= 0).nonzero(as_tuple=True)
    out = torch.zeros_like(x)
    if t_idx.numel() == 0:
        return out
    sub = dispatch_output._replace(
        hidden_states=x[t_idx], hidden_states_scale=None,
        topk_output=StandardTopKOutput(topk_weights[t_idx, k_idx][:, None].contiguous(),
                                       remapped[t_idx, k_idx][:, None].contiguous(),
                                       router_logits[t_idx] if router_logits is not None else None))
    if hasattr(sub, "hidden_states_pre_quant"):
        sub = sub._replace(hidden_states_pre_quant=None)
    y = gpu_method.apply(layer, sub).hidden_states
    return out.index_add_(0, t_idx, y.to(out.dtype))


def model_info(kt_config, opts, layer, E: int, H: int, I: int, K: int) -> ModelInfo:
    """The model's shape: from the config the launcher read, else (no readable config.json, e.g. a
    dummy model path) the layer count from kt's weight directory or placement file."""
    m = getattr(kt_config, "model", None)
    if m is not None:
        if (m.num_experts, m.hidden) != (E, H):
            raise KTArgumentError(f"kt: the model config says E={m.num_experts}, H={m.hidden}, but "
                                  f"FusedMoE layer {layer.layer_id} has E={E}, H={H}")
        return m
    if opts.kt_weight_path is not None:
        from ..weights import WeightFormatError
        from ..weights._format import read_manifest

        try:
            layers = read_manifest(opts.kt_weight_path)["layers"]
        except WeightFormatError as exc:
            raise KTArgumentError(f"kt: --kt-weight-path: {exc}") from None
        return ModelInfo(max(layers) + 1, E, K, H, I, tuple(int(v) for v in layers))
    if opts.kt_placement is not None:
        from ..placement import Placement

        p = Placement.load(opts.kt_placement)
        return ModelInfo(p.num_layers, E, K, H, I, tuple(range(p.num_layers)))
    raise KTArgumentError("kt: cannot tell the model's number of layers (no readable config.json); "
                          "pass --kt-weight-path or --kt-placement")
