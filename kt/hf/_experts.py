"""The module that stands in for a transformers experts module, and the reference backend."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .. import reference
from ..config import QuantScheme

__all__ = ["KTExperts", "ReferenceMoE"]


class ReferenceMoE:
    """The "reference backend": kt.reference.moe_forward_quantized, in numpy (fp64 accumulation).

    Computes exactly what a kt kernel of ``scheme`` computes (weights quantised, activations
    rounded as the kernels round them), only slowly. For debugging, and for comparing a patched
    model run through kt's kernels against the spec. Called like CPUMoE:
    ``moe(x [T, H], topk_ids [T, K], topk_weights [T, K]) -> [T, H]`` in x's dtype.
    """

    def __init__(self, gate, up, down, scheme: QuantScheme | str = QuantScheme.BF16,
                 group_size: int = 64, activations: str = "int8"):
        """gate, up: [E, I, H]; down: [E, H, I] (torch tensors or numpy arrays, any float dtype)."""
        self.scheme = QuantScheme.parse(scheme)
        self.group_size = group_size
        self.activations = activations
        gate, up, down = (reference.to_numpy_f32(t) for t in (gate, up, down))
        if gate.ndim != 3 or gate.shape != up.shape or down.shape != (gate.shape[0], gate.shape[2],
                                                                        gate.shape[1]):
            raise ValueError(f"expected gate/up [E, I, H] and down [E, H, I], got gate {gate.shape}, "
                             f"up {up.shape}, down {down.shape}")
        self.num_experts, self.intermediate, self.hidden = gate.shape
        self.q13 = [reference.quantize(np.concatenate([gate[e], up[e]]), self.scheme, group_size)
                    for e in range(self.num_experts)]
        self.q2 = [reference.quantize(down[e], self.scheme, group_size)
                   for e in range(self.num_experts)]

    def __call__(self, x, topk_ids, topk_weights):
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got {tuple(x.shape)}")
        out = reference.moe_forward_quantized(x, topk_ids, topk_weights, self.q13, self.q2,
                                              activations=self.activations)
        return torch.from_numpy(out).to(x.dtype)

    def __repr__(self):
        return (f"ReferenceMoE(E={self.num_experts}, H={self.hidden}, I={self.intermediate}, "
                f"scheme={self.scheme.value})")


class KTExperts(nn.Module):
    """Replaces a transformers experts module: same call, experts computed by a kt backend.

    ``forward(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]`` in the
    dtype and on the device of ``hidden_states``. The model's router chose ``top_k_index`` and
    ``top_k_weights`` (scaling included); this module only computes
    ``sum_k w[t, k] * down_e(SiLU(gate_e x_t) * up_e x_t)``. It holds no torch parameters, so
    ``model.to("cuda")`` moves only the rest of the model.
    """

    def __init__(self, moe, *, layer_idx: int, num_experts: int, hidden: int, intermediate: int,
                 scheme: QuantScheme, backend: str, device_inputs: bool = False):
        super().__init__()
        self.moe = moe
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.hidden_dim = hidden
        self.intermediate_dim = intermediate
        self.scheme = scheme
        self.backend = backend
        # True when the backend takes tensors on the model's device (HybridMoE); else inputs go
        # to the host and the result comes back.
        self.device_inputs = device_inputs

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        dev, dtype = hidden_states.device, hidden_states.dtype
        x, ids, w = hidden_states.detach(), top_k_index.detach(), top_k_weights.detach()
        if not self.device_inputs and dev.type != "cpu":
            x, ids, w = x.cpu(), ids.cpu(), w.cpu()
        out = self.moe(x, ids, w.float())
        return out.to(device=dev, dtype=dtype)

    def extra_repr(self) -> str:
        return (f"layer={self.layer_idx}, E={self.num_experts}, H={self.hidden_dim}, "
                f"I={self.intermediate_dim}, scheme={self.scheme.value}, backend={self.backend}")
