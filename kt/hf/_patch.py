"""kt.patch_model: route the experts of a transformers MoE model through kt.

Only the experts module of each sparse MoE block is replaced (see ``families.py``): the model's
router, shared experts, attention and everything else stay as they are, on the model's device.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import GROUP_SIZES, QuantScheme, check_activations
from ._compat import require_transformers
from ._dense import DENSE_SCHEMES, dense_scheme_for, model_dtype, patch_dense
from ._experts import KTExperts
from .families import family_of

__all__ = ["PatchConfig", "PatchInfo", "patch_model", "find_experts", "ExpertsSite"]

_BACKENDS = ("kt", "reference")
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class PatchConfig:
    """How ``patch_model`` runs the routed experts.

    scheme: QuantScheme (or its name) the CPU experts are stored and computed in.
    group_size: G of INT4 (32, 64 or 128).
    threads: threads of the CPU pool kt creates for the model (None: kt's default pool);
      ignored when ``pool`` is given.
    pool: a ``kt.CpuPool`` the caller owns, shared by all layers.
    weight_path: a kt weight directory (``kt convert``) to load the experts from, instead of
      converting the model's own expert weights in memory.
    placement: a ``kt.Placement`` [L, E] putting some experts on the GPU (needs ``kt.HybridMoE``
      and a CUDA device); None = every expert on the CPU.
    deferral: max deferred experts per token (HybridMoE only); 0 = off.
    activations: "int8" (per-token int8, the default) or "int8x2" (two int8 levels: more
      accurate INT8/INT4 layers for about 2x the prefill compute; see ``kt.CPUMoE``).
    backend: "kt" (CPUMoE / HybridMoE, the default) or "reference" (kt.reference in numpy: slow,
      exact to the scheme's arithmetic; for debugging).
    dense_scheme: the dense linears (attention, shared experts, dense MLPs, the LM head) of a
      model run on the CPU: "auto" (the default: for a bf16 / fp16 model on the CPU, kt's kernels
      in INT8, or BF16 when the experts are BF16; torch's for an fp32 model and on a GPU),
      "int8" / "int4" / "bf16" (kt's kernels in that scheme, CPU only) or "torch" (the model's
      own nn.Linear). Routers always stay in torch.
    """

    scheme: QuantScheme | str = QuantScheme.BF16
    group_size: int = 64
    threads: int | None = None
    pool: object | None = field(default=None, compare=False, repr=False)
    weight_path: str | Path | None = None
    placement: object | None = field(default=None, compare=False)
    deferral: int = 0
    backend: str = "kt"
    activations: str = "int8"
    dense_scheme: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "scheme", QuantScheme.parse(self.scheme))
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"PatchConfig.group_size must be one of {GROUP_SIZES}, got {self.group_size!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads <= 0):
            raise ValueError(f"PatchConfig.threads must be a positive int or None, got {self.threads!r}")
        if not isinstance(self.deferral, int) or self.deferral < 0:
            raise ValueError(f"PatchConfig.deferral must be an int >= 0, got {self.deferral!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"PatchConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.weight_path is not None:
            object.__setattr__(self, "weight_path", Path(self.weight_path))
        check_activations(self.activations, self.scheme, "PatchConfig.activations")
        if self.dense_scheme not in DENSE_SCHEMES:
            raise ValueError(f"PatchConfig.dense_scheme must be one of {DENSE_SCHEMES}, got "
                             f"{self.dense_scheme!r}")
        if self.backend == "reference" and (self.placement is not None or self.deferral):
            raise ValueError("the reference backend runs every expert on the CPU; "
                             "placement and deferral need backend='kt'")


@dataclass(frozen=True)
class ExpertsSite:
    """One experts module of the model: where it hangs and which decoder layer it belongs to."""

    name: str  # e.g. "model.layers.3.mlp.experts"
    parent: nn.Module = field(repr=False)
    attr: str
    module: nn.Module = field(repr=False)
    layer_idx: int
    num_experts: int
    hidden: int
    intermediate: int


@dataclass(frozen=True)
class PatchInfo:
    """What ``patch_model`` did; stored on the model as ``model.kt_patch``."""

    config: PatchConfig
    model_type: str
    layers: tuple[int, ...]
    num_experts: int
    hidden: int
    intermediate: int
    backend: str
    freed_bytes: int
    dense_scheme: QuantScheme | None = None  # kt's scheme of the dense linears, None: torch's
    dense_linears: int = 0


def _layer_index(name: str) -> int:
    m = _LAYER_RE.search(name)
    if m is None:
        raise ValueError(f"cannot tell the decoder layer of experts module {name!r}")
    return int(m.group(1))


def _check_experts_module(name: str, mod: nn.Module) -> None:
    """The fused experts of every supported family: SiLU(gate) * up, gate rows first, no bias."""
    problems = []
    if getattr(mod, "has_bias", False) or any(n.endswith("bias") for n, _ in mod.named_parameters()):
        problems.append("expert biases")
    if getattr(mod, "is_transposed", False):
        problems.append("transposed expert weights")
    if not getattr(mod, "is_concatenated", True):
        problems.append("interleaved gate/up rows")
    if not getattr(mod, "has_gate", True):
        problems.append("no gate projection")
    act = getattr(mod, "act_fn", None)
    if not (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")):
        problems.append(f"activation {type(act).__name__} (kt computes SiLU(gate) * up)")
    try:
        from transformers.integrations import moe as _hf_moe

        default_gate = getattr(_hf_moe, "_default_apply_gate", None)
        own_gate = getattr(type(mod), "_apply_gate", default_gate)
        if default_gate is not None and own_gate is not default_gate:
            problems.append("a custom gating function")
    except ImportError:
        pass
    gu, dn = mod.gate_up_proj, mod.down_proj
    e, two_i, h = gu.shape
    if two_i % 2 or tuple(dn.shape) != (e, h, two_i // 2):
        problems.append(f"gate_up_proj {tuple(gu.shape)} / down_proj {tuple(dn.shape)} are not "
                        f"[E, 2I, H] / [E, H, I]")
    if problems:
        raise ValueError(f"experts module {name} ({type(mod).__name__}) has " + ", ".join(problems)
                         + "; kt cannot compute it")


def find_experts(model: nn.Module) -> list[ExpertsSite]:
    """The routed-experts modules of a supported transformers model, in layer order.

    Raises ValueError for an unknown architecture, a model already patched, or a supported
    architecture whose experts are not the fused modules of transformers >= 5.
    """
    require_transformers()
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family_of(model_type)
    sites = []
    modules = dict(model.named_modules())
    for name, mod in modules.items():
        if isinstance(mod, KTExperts):
            raise ValueError(f"model is already patched by kt ({name} is a KTExperts)")
        gu = getattr(mod, "gate_up_proj", None)
        dn = getattr(mod, "down_proj", None)
        if not (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.ndim == 3):
            continue
        _check_experts_module(name, mod)
        parent_name, _, attr = name.rpartition(".")
        e, two_i, h = gu.shape
        sites.append(ExpertsSite(name, modules[parent_name], attr, mod, _layer_index(name),
                                 int(e), int(h), int(two_i // 2)))
    if not sites:
        raise ValueError(
            f"found no fused experts modules (gate_up_proj [E, 2I, H]) in this {model_type} model "
            f"({type(model).__name__}); kt patches transformers >= 5 models")
    return sorted(sites, key=lambda s: s.layer_idx)


# ----------------------------------------------------------------------------- patching

def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def check_sites(sites: list[ExpertsSite]) -> tuple[int, int, int]:
    """(E, H, I) shared by every experts module; ValueError naming the first that differs."""
    e, h, i = sites[0].num_experts, sites[0].hidden, sites[0].intermediate
    for s in sites:
        if (s.num_experts, s.hidden, s.intermediate) != (e, h, i):
            raise ValueError(f"{s.name}: shape E={s.num_experts} H={s.hidden} I={s.intermediate} differs "
                             f"from the first experts module's E={e} H={h} I={i}")
    return e, h, i


def resolve_config(config: PatchConfig | None, overrides: dict) -> PatchConfig:
    if config is None:
        return PatchConfig(**overrides)
    if overrides:
        from dataclasses import replace

        return replace(config, **overrides)
    return config


def reference_warning(config: PatchConfig, stacklevel: int = 3) -> None:
    if config.backend == "reference":
        warnings.warn("kt: backend='reference' computes the experts in numpy (fp64): "
                      "exact but slow; use it for debugging only", stacklevel=stacklevel)


def patch_model(model: nn.Module, config: PatchConfig | None = None, *, progress: bool = True,
                device=None, **overrides) -> nn.Module:
    """Replace the routed experts of ``model`` with kt; returns the same model, patched in place.

    ``config`` (or keyword ``overrides`` of PatchConfig fields) says how. Every sparse MoE block
    keeps its router and shared experts; its experts module becomes a ``KTExperts`` running
    ``CPUMoE`` (or ``HybridMoE`` with a placement), built from a kt weight directory or from the
    model's own expert weights, which are then freed layer by layer (so peak memory grows by one
    layer, not by a second copy of the experts). The architecture, shapes, weight directory and
    placement are all checked before the first layer is touched, so those errors leave the model
    as it was; an error converting a layer's weights (e.g. NaN) leaves the earlier layers patched.

    The model must hold its experts already; ``kt.hf.load_model`` loads a checkpoint without
    ever materialising them (see docs/hf.md).

    ``device``: where the model will run (default: where its weights are now). Give "cuda" to
    patch a model still on the CPU and move it afterwards: the experts never reach the GPU.
    """
    from tqdm import tqdm  # not tqdm.auto: no ipywidgets warning in notebooks

    from ._build import ExpertsBuilder

    config = resolve_config(config, overrides)
    sites = find_experts(model)
    model_type = model.config.model_type
    e, h, i = check_sites(sites)
    for s in sites:
        if s.module.gate_up_proj.device.type == "meta":
            raise ValueError(f"{s.name} holds no weights (meta tensors); load the model with "
                             "kt.hf.load_model, which puts kt experts in place without them")
    num_layers = int(getattr(model.config, "num_hidden_layers", max(s.layer_idx for s in sites) + 1))

    loader = None
    if config.weight_path is not None:
        from ._weights import WeightDirLoader

        by_layer = {s.layer_idx: s.module for s in sites}
        loader = WeightDirLoader(config.weight_path, config, [s.layer_idx for s in sites],
                                 model_type=model_type, num_experts=e, hidden=h, intermediate=i,
                                 model_dir=getattr(model.config, "_name_or_path", None),
                                 gate_up_of=lambda L: by_layer[L].gate_up_proj)
    device = torch.device(device) if device is not None else _model_device(model)
    dense_kt = (dense_scheme_for(config.dense_scheme, config.scheme, device, model_dtype(model))
                if config.backend == "kt" else None)
    builder = ExpertsBuilder(config, num_layers=num_layers, last_layer=sites[-1].layer_idx,
                             num_experts=e, hidden=h, intermediate=i, device=device)

    freed = 0
    for s in tqdm(sites, desc=f"kt: experts -> {config.scheme.value}", unit="layer",
                  disable=not progress or len(sites) < 2):
        mod = s.module
        gu, dn = mod.gate_up_proj.detach(), mod.down_proj.detach()
        freed += gu.numel() * gu.element_size() + dn.numel() * dn.element_size()
        gate, up = gu[:, :i], gu[:, i:]
        if config.backend == "reference":
            dense = loader.dequantized(s.layer_idx) if loader is not None else (gate, up, dn)
            new = builder.build(s.layer_idx, dense=dense)
        else:
            cpu_cls = builder.cpu_class()
            if loader is not None:
                cpu = loader.cpu_moe(cpu_cls, s.layer_idx, builder.pool)
            else:
                cpu = cpu_cls.from_tensors(gate.cpu(), up.cpu(), dn.cpu(), scheme=config.scheme,
                                           group_size=config.group_size, pool=builder.pool)
            new = builder.build(s.layer_idx, cpu=cpu)
        del gu, dn, gate, up
        # drop the parameters themselves, so the memory goes even if someone holds the old module
        mod.gate_up_proj = None
        mod.down_proj = None
        setattr(s.parent, s.attr, new)
    n_dense = 0
    if dense_kt is not None:
        n_dense, _ = patch_dense(model, dense_kt, group_size=config.group_size, pool=builder.pool,
                                 progress=progress)
    model.kt_patch = PatchInfo(config, model_type, tuple(s.layer_idx for s in sites), e, h, i,
                               builder.backend_name, freed, dense_kt, n_dense)
    reference_warning(config)
    return model
