"""Turning one MoE layer's expert weights into the ``KTExperts`` module that replaces it.

Shared by ``patch_model`` (weights taken from a model already in memory) and ``load_model``
(weights from a kt weight directory or converted from the checkpoint, the model never holding
them). Legend: E experts, H hidden size, I expert intermediate size, L layers.
"""
from __future__ import annotations

import torch

from ._experts import KTExperts, ReferenceMoE

__all__ = ["ExpertsBuilder"]


class ExpertsBuilder:
    """Builds the KTExperts of every MoE layer for one PatchConfig, checked once up front.

    The placement (shape [L, E], GPU experts only where the model runs on CUDA) is checked
    when the builder is made, so a refused configuration touches no layer. ``build`` wraps a
    CPU backend (``CPUMoE``, or the dense weights for the reference backend) into the
    module the model calls, inside a ``HybridMoE`` when a placement or deferral asks for it.
    """

    def __init__(self, config, *, num_layers: int, last_layer: int, num_experts: int,
                 hidden: int, intermediate: int, device: torch.device):
        self.config = config
        self.shape = (num_experts, hidden, intermediate)
        self.last_layer = last_layer
        self.device = device
        self.hybrid = config.placement is not None or config.deferral > 0
        if config.placement is not None:
            check = getattr(config.placement, "check_model", None)
            if check is not None:
                check(num_layers, num_experts)
        if self.hybrid and device.type != "cuda" and config.placement is not None \
                and int(config.placement.gpu_mask.sum()) > 0:
            raise ValueError(f"the placement puts experts on the GPU but the model runs on {device}; "
                             "pass device='cuda' (or move the model to a CUDA device)")
        self.pool = self._pool()
        self._chain = None

    @property
    def backend_name(self) -> str:
        if self.config.backend == "reference":
            return "reference"
        return "hybrid" if self.hybrid else "cpu"

    def _pool(self):
        """The config's pool, or the process's pool of ``threads`` threads (None: each layer's
        default)."""
        cfg = self.config
        if cfg.pool is not None or cfg.threads is None or cfg.backend != "kt":
            return cfg.pool
        from ..cpu_ops import default_pool

        return default_pool(cfg.threads)

    def cpu_class(self):
        from ..cpu_ops.moe import CPUMoE

        return CPUMoE

    def build(self, layer_idx: int, *, cpu=None, dense=None) -> KTExperts:
        """The KTExperts of layer ``layer_idx``.

        cpu: a ``CPUMoE`` holding the layer's experts (backend "kt").
        dense: (gate [E, I, H], up [E, I, H], down [E, H, I]) any float dtype (backend
          "reference", quantised here as the kernels would).
        """
        cfg = self.config
        e, h, i = self.shape
        if cfg.backend == "reference":
            if dense is None:
                raise ValueError("the reference backend needs the layer's dense expert weights")
            moe = ReferenceMoE(*dense, cfg.scheme, cfg.group_size, cfg.activations)
        else:
            if cpu is None:
                raise ValueError("backend 'kt' needs the layer's CPUMoE")
            if cfg.activations != "int8":
                cpu.activations = cfg.activations
            moe = cpu
            if self.hybrid:
                from ..layer import DeferredChain, HybridMoE

                if self._chain is None and cfg.deferral:
                    self._chain = DeferredChain()
                row = None if cfg.placement is None else cfg.placement.gpu_slot[layer_idx]
                moe = HybridMoE(cpu, row, device=self.device if self.device.type == "cuda" else None,
                                max_deferred_experts_per_token=cfg.deferral, chain=self._chain,
                                is_last_layer=layer_idx == self.last_layer, layer_idx=layer_idx)
        name = self.backend_name
        return KTExperts(moe, layer_idx=layer_idx, num_experts=e, hidden=h, intermediate=i,
                         scheme=cfg.scheme, backend=name, device_inputs=name == "hybrid")
