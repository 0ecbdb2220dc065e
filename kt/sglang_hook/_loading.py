"""Loading a kt MoE layer inside SGLang: the GPU slots through SGLang's own loaders, the CPU experts
from a kt weight directory or from the checkpoint tensors SGLang reads.

Legend: E experts, H hidden size, I expert intermediate size, S GPU slots.
"""
from __future__ import annotations

import numpy as np
import torch

from ..config import QuantScheme
from ._flags import KTArgumentError

__all__ = ["Stash", "wrap_loader", "wrap_fused_loader", "build_cpu", "copy_experts_in"]

_SHARDS = ("w1", "w3", "w2")  # gate, up, down


class Stash:
    """Every expert's checkpoint tensors, kept for the CPU when there is no kt weight directory
    (gate / up [E, I, H], down [E, H, I] in the checkpoint's dtype) and which of them arrived."""

    def __init__(self, e: int, i: int, h: int, dtype: torch.dtype):
        self.w = {"w1": torch.zeros(e, i, h, dtype=dtype), "w3": torch.zeros(e, i, h, dtype=dtype),
                  "w2": torch.zeros(e, h, i, dtype=dtype)}
        self.seen = np.zeros((e, 3), dtype=bool)

    def put(self, shard_id: str, e: int, tensor: torch.Tensor) -> None:
        self.w[shard_id][e].copy_(tensor.to(self.w[shard_id].dtype))
        self.seen[e, _SHARDS.index(shard_id)] = True

    def check_complete(self, layer_id: int) -> None:
        missing = np.argwhere(~self.seen)
        if missing.size:
            e, k = missing[0]
            raise KTArgumentError(f"kt: layer {layer_id}: the checkpoint gave no "
                                  f"{('gate', 'up', 'down')[k]} weight for expert {e}")


def wrap_loader(method, layer):
    """SGLang's per-expert loader, called with the expert's GPU slot (cold experts: not loaded
    on the GPU; their checkpoint tensors go to the method's stash when it has one)."""
    row = method.gpu_slot
    n = len(row)

    def load(param, loaded_weight, weight_name, shard_id, expert_id=None, *args, **kwargs):
        if expert_id is None:
            raise NotImplementedError("kt: loading all experts in one call is not supported; "
                                      f"parameter {weight_name!r}")
        e = int(expert_id)
        if not 0 <= e < n:
            raise KTArgumentError(f"kt: checkpoint expert id {e} of {weight_name!r} is outside "
                                  f"[0, {n}) in layer {method.layer_id}")
        st = method.stash
        if st is not None and shard_id in _SHARDS and weight_name.endswith("weight"):
            st.put(shard_id, e, loaded_weight)
        slot = int(row[e])
        if slot < 0:
            return
        layer._weight_loader_impl(param=param, loaded_weight=loaded_weight, weight_name=weight_name,
                                  shard_id=shard_id, expert_id=slot)

    return load


def wrap_fused_loader(method, original):
    """SGLang's all-experts loader ([E, ...] tensors), given only the hot experts in slot order."""
    hot = None

    def load(param, loaded_weight, weight_name, shard_id, *args, **kwargs):
        nonlocal hot
        if method.stash is not None:
            raise KTArgumentError("kt: this checkpoint stores experts fused; converting them while "
                                  "loading is not supported: run `kt convert MODEL DIR` and pass "
                                  "--kt-weight-path DIR")
        if hot is None:
            hot = torch.from_numpy(method.placement.experts_in_slots(method.layer_id).astype(np.int64))
        if hot.numel() == 0:
            return
        return original(param, loaded_weight.index_select(0, hot.to(loaded_weight.device)), weight_name,
                        shard_id, *args, **kwargs)

    return load


def build_cpu(opts, layer_id: int, stash: Stash | None, scheme, pool, shape):
    """The layer's ``CPUMoE``: from ``--kt-weight-path`` or quantised from the stashed checkpoint
    tensors; its (E, H, I) must be ``shape``, the model's."""
    from ..cpu_ops import CPUMoE
    from ..weights import load_cpu_moe

    if opts.kt_weight_path is not None:
        cpu = load_cpu_moe(opts.kt_weight_path, layer_id, pool=pool)
        src = opts.kt_weight_path
    else:
        stash.check_complete(layer_id)
        cpu = CPUMoE.from_tensors(stash.w["w1"], stash.w["w3"], stash.w["w2"],
                                  scheme=scheme or QuantScheme.INT8, pool=pool)
        src = "the checkpoint (converted while loading)"
    got = (cpu.num_experts, cpu.hidden, cpu.intermediate)
    if got != tuple(shape):
        raise KTArgumentError(f"kt: layer {layer_id}: CPU experts from {src} have (E, H, I) = {got}, "
                              f"the model {tuple(shape)}")
    return cpu


def copy_experts_in(cpu, layer, incoming, device) -> None:
    """Copy the experts of ``incoming`` [(expert, slot)] (dequantised from the CPU's packed weights)
    into SGLang's unquantised GPU slots ``layer.w13_weight`` / ``layer.w2_weight``."""
    from ..layer._gpu_weights import packed_to_device

    ex = [e for e, _ in incoming]
    w13, _ = packed_to_device(cpu.w13, ex, device, "bf16")
    w2, _ = packed_to_device(cpu.w2, ex, device, "bf16")
    for j, (_, s) in enumerate(incoming):
        layer.w13_weight.data[s].copy_(w13[j])
        layer.w2_weight.data[s].copy_(w2[j])
