"""The dense part of a CPU-run model on kt's kernels: every ``nn.Linear`` outside the experts
and the routers (attention projections, shared experts, dense MLP layers, the LM head) becomes a
``KTLinear`` running ``kt.cpu_ops.dense.DenseLinear`` on the experts' pool.

A CPU decode step reads every dense weight once, as it reads the routed experts it uses; on
torch's kernels those reads run on torch's own threads, which compete with kt's pool for the
same cores. On kt's kernels the whole step runs on one pool, in the experts' weight format.
"""
from __future__ import annotations

import torch
from torch import nn

from ..config import QuantScheme

__all__ = ["KTLinear", "DENSE_SCHEMES", "dense_scheme_for", "model_dtype", "patch_dense"]

DENSE_SCHEMES = ("auto", "torch", "int8", "int4", "bf16")


class KTLinear(nn.Module):
    """Stands in for an ``nn.Linear``: ``y = x @ W^T (+ bias)`` with W packed for kt's CPU
    kernels (activations rounded as the scheme's kernels round them), in x's dtype. Holds no
    torch parameters (the bias is a buffer)."""

    def __init__(self, lin, bias: torch.Tensor | None, *, name: str = ""):
        super().__init__()
        self.lin = lin
        self.in_features, self.out_features = lin.d, lin.n
        self.name = name
        if bias is not None:
            self.register_buffer("bias", bias.detach().clone(), persistent=False)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise RuntimeError(f"{self.name or 'KTLinear'} runs on the CPU; got an input on {x.device} "
                               "(dense_scheme='torch' keeps the model's own linears)")
        shape = x.shape
        y = self.lin(x.reshape(-1, shape[-1]))
        y = y.reshape(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, scheme={self.lin.scheme.value}"


def dense_scheme_for(dense_scheme: str, experts: QuantScheme, device: torch.device,
                     dtype: torch.dtype = torch.bfloat16) -> QuantScheme | None:
    """The scheme of the dense linears, or None to keep torch's. "auto": for a bf16 / fp16
    model on the CPU, INT8 for INT8 / INT4 experts and BF16 for BF16 experts (attention in INT4
    costs more accuracy than its bytes save); torch's for an fp32 model (kt's kernels would
    round it to bf16 or int8) and on a GPU."""
    if dense_scheme not in DENSE_SCHEMES:
        raise ValueError(f"dense_scheme must be one of {DENSE_SCHEMES}, got {dense_scheme!r}")
    if dense_scheme == "torch":
        return None
    if device.type != "cpu":
        if dense_scheme == "auto":
            return None
        raise ValueError(f"dense_scheme={dense_scheme!r} runs the dense linears on the CPU, but the "
                         f"model runs on {device}; use 'auto' or 'torch' there")
    if dense_scheme == "auto":
        if dtype not in (torch.bfloat16, torch.float16):
            return None
        return QuantScheme.BF16 if experts is QuantScheme.BF16 else QuantScheme.INT8
    return QuantScheme.parse(dense_scheme)


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (bf16 if it has none)."""
    for p in model.parameters():
        if p.dtype.is_floating_point:
            return p.dtype
    return torch.bfloat16


def _targets(model: nn.Module) -> list[tuple[nn.Module, str, str, nn.Linear]]:
    """(parent, attribute, name, module) of every nn.Linear kt takes over: not the routers
    (their scores choose the experts; small, kept exact) and not inside an experts module."""
    from ._experts import KTExperts

    skip = [name + "." for name, m in model.named_modules() if isinstance(m, KTExperts)]
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or any(name.startswith(s) for s in skip):
            continue
        if name.endswith(("mlp.gate", "block_sparse_moe.gate", "router")):
            continue
        parent_name, _, attr = name.rpartition(".")
        out.append((model.get_submodule(parent_name) if parent_name else model, attr, name, mod))
    return out


def patch_dense(model: nn.Module, scheme: QuantScheme, *, group_size: int = 64, pool=None,
                progress: bool = True) -> tuple[int, int]:
    """Replace the model's dense linears with ``KTLinear`` of ``scheme``, freeing each torch
    weight as it goes, and select kt's CPU decode attention (``_attention``) where the model
    runs sdpa; returns (linears replaced, bytes of their packed weights)."""
    from ._attention import use_cpu_attention

    from tqdm import tqdm

    from ..cpu_ops.dense import DenseLinear

    targets = _targets(model)
    tied = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    count = nbytes = 0
    for parent, attr, name, mod in tqdm(targets, desc=f"kt: dense -> {scheme.value}", unit="linear",
                                        disable=not progress or len(targets) < 8):
        w = mod.weight.detach()
        if w.device.type != "cpu":
            raise ValueError(f"{name} is on {w.device}; kt's dense kernels run on the CPU")
        lin = DenseLinear.from_tensor(w, scheme, group_size if scheme is QuantScheme.INT4 else 64, pool=pool)
        setattr(parent, attr, KTLinear(lin, mod.bias, name=name))
        if tied is None or w.data_ptr() != tied.data_ptr():
            mod.weight = None  # the memory goes even if someone holds the old module
        count += 1
        nbytes += lin.nbytes
    use_cpu_attention(model)
    return count, nbytes
