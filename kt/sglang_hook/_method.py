"""kt's MoE method inside SGLang's FusedMoE (replaces ``KTEPWrapperMethod`` through the hook registry).

Legend: T tokens, E experts, K top-k, H hidden size, I expert intermediate size, S GPU slots.

Per layer, the placement row ``gpu_slot [E]`` (any set of experts, not a prefix of the ids) decides:

- GPU: SGLang's own method (``gpu_method``: unquantised, FP8, ...) holds only the S hot experts, in
  SGLang's own layout, loaded by SGLang's own loader with the expert id remapped to its slot. It runs
  on ``topk_ids`` remapped to slots (cold ids -> -1, which SGLang's GPU kernels skip).
- CPU: a ``kt.CPUMoE`` over all E experts, loaded from ``--kt-weight-path`` (kt format) or quantised
  from the checkpoint tensors SGLang loads.

Both run through kt's one layer, ``kt.layer.HybridMoE`` with external GPU experts: the CPU part is
submitted first (stream-ordered on CUDA), SGLang's GPU method runs meanwhile, the CPU result is
added; deferral, layer-wise GPU prefill (every expert on the GPU from staged copies of the CPU's
packed weights) and the per-process pool are the layer's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from sglang.srt.layers.moe.kt_ep_wrapper import KTConfig, KTEPWrapperMethod
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from .._version import __version__ as _KT_VERSION
from ._flags import KTArgumentError, KTOptions, ModelInfo, method_scheme
from ._gpu import gpu_part, model_info
from ._loading import Stash, build_cpu, copy_experts_in, wrap_fused_loader, wrap_loader
from ._process import proc

__all__ = ["KTMoEMethod", "KTLayerConfig"]


@dataclass
class KTLayerConfig(KTConfig):
    """Upstream's KTConfig (its fields kept for code that reads them) plus kt's options and model."""

    options: Optional[dict] = None
    model: Optional[ModelInfo] = None


class KTMoEMethod(KTEPWrapperMethod):
    """kt's CPU-GPU hybrid MoE method; built by ``FusedMoE.__init__`` as ``KTEPWrapperMethod(gpu_method,
    kt_config)`` once kt's hooks are applied."""

    def __init__(self, gpu_method: FusedMoEMethodBase, kt_config: KTConfig):
        # upstream's __init__ requires kt_kernel; kt needs none of it
        FusedMoEMethodBase.__init__(self)
        from sglang.srt.runtime_context import get_parallel

        self.gpu_method = gpu_method
        self.kt_config = kt_config
        d = getattr(kt_config, "options", None)
        self.options = KTOptions.from_dict(d) if d else KTOptions(
            kt_weight_path=kt_config.weight_path, kt_method=kt_config.method,
            kt_cpuinfer=kt_config.cpuinfer_threads, kt_threadpool_count=kt_config.threadpool_count,
            kt_num_gpu_experts=kt_config.num_gpu_experts,
            kt_max_deferred_experts_per_token=kt_config.max_deferred_experts_per_token)
        self.scheme = method_scheme(self.options.kt_method)
        self.tp_rank = get_parallel().tp_rank
        self.override_num_local_experts = True
        self.num_gpu_experts = 0  # GPU slots of this layer, set in create_weights
        self.cpu = None
        self.layer = None  # kt.layer.HybridMoE (tensor-parallel rank 0 only)
        self.gpu_slot = None
        self.stash = None

    # -- construction --------------------------------------------------------------------------
    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs):
        if getattr(layer, "num_fused_shared_experts", 0):
            raise NotImplementedError("kt: fused shared experts are not supported; launch with "
                                      "--disable-shared-experts-fusion")
        if getattr(layer, "moe_ep_size", 1) != 1:
            raise NotImplementedError("kt: expert parallelism (--ep-size > 1) is not supported with kt; "
                                      "use tensor parallelism")
        E, H = int(num_experts), int(hidden_size)
        I = int(layer.intermediate_size_per_partition * layer.moe_tp_size)
        self.global_num_experts, self.hidden_size = E, H
        self.intermediate_size_per_partition = intermediate_size_per_partition
        self.layer_id = int(layer.layer_id)
        self.model = model = model_info(self.kt_config, self.options, layer, E, H, I, int(layer.top_k))
        from ..placement import expert_nbytes

        qname = layer.quant_config.get_name() if getattr(layer, "quant_config", None) is not None else ""
        gdt = "fp8" if "fp8" in str(qname).lower() else {torch.bfloat16: "bf16", torch.float16: "fp16",
                                                          torch.float32: "fp32"}.get(params_dtype, "bf16")
        placement = proc.get_placement(self.options, model, expert_nbytes(H, I, gdt))
        if self.layer_id >= placement.num_layers:
            raise KTArgumentError(f"kt: layer {self.layer_id} is outside the placement's "
                                  f"{placement.num_layers} layers")
        self.placement = placement
        self.gpu_slot = np.asarray(placement.row(self.layer_id), dtype=np.int64)
        self.num_gpu_experts = int(placement.n_slots[self.layer_id])
        self.gpu_method.num_gpu_experts = self.num_gpu_experts  # as upstream's wrapper tells it
        self.is_last_layer = self.layer_id == max(model.moe_layers or tuple(range(model.num_layers)))
        if self.options.kt_weight_path is None and self.tp_rank == 0:
            if getattr(layer, "quant_config", None) is not None:
                raise KTArgumentError(f"kt: the checkpoint is quantised ({qname}); converting its experts "
                                      "while loading needs bf16/fp16 weights: convert them once with "
                                      "`kt convert MODEL DIR` and pass --kt-weight-path DIR")
            self.stash = Stash(E, I, H, params_dtype)
        # SGLang's loaders follow the weight layout of this method (e.g. transposed checkpoints)
        layer.weight_load_method = self.gpu_method
        attrs = dict(extra_weight_attrs)
        loader = attrs.get("weight_loader")
        if loader is not None:
            fused = getattr(layer, "weight_loader_fused", None)
            attrs["weight_loader"] = wrap_fused_loader(self, loader) if (
                fused is not None and loader == fused) else wrap_loader(self, layer)
        self.gpu_method.create_weights(layer=layer, num_experts=self.num_gpu_experts, hidden_size=H,
                                       intermediate_size_per_partition=intermediate_size_per_partition,
                                       params_dtype=params_dtype, **attrs)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.num_gpu_experts > 0 and hasattr(self.gpu_method, "process_weights_after_loading"):
            self.gpu_method.process_weights_after_loading(layer)
        device = layer.w13_weight.device if hasattr(layer, "w13_weight") else torch.device("cpu")
        self.device = device
        self._e2s = torch.from_numpy(self.gpu_slot.astype(np.int32)).to(device)
        if self.tp_rank == 0:
            opts = self.options
            stash, self.stash = self.stash, None
            self.cpu = build_cpu(opts, self.layer_id, stash, self.scheme, proc.get_pool(opts),
                                 (self.global_num_experts, self.hidden_size, self.model.intermediate))
            self.layer = self._build_layer(device)
        self._stats = (proc.get_stats(self.options.record_kt_gpu_expert_distribution, self.model)
                       if self.options.record_kt_gpu_expert_distribution else None)
        self._dynamic = False
        if self.options.kt_enable_dynamic_expert_update:
            why = self._dynamic_unsupported(layer)
            if why:
                from ._process import logger

                logger.warning("kt: --kt-enable-dynamic-expert-update is off for layer %d: %s", self.layer_id, why)
            else:
                import weakref

                self._layer_ref = weakref.ref(layer)
                proc.get_placer(self.placement)
                proc.methods[self.layer_id] = self
                self._dynamic = True
        self._log_start()

    def _build_layer(self, device):
        from ..layer import HybridMoE

        opts = self.options
        cuda = device.type == "cuda"
        d = int(opts.kt_max_deferred_experts_per_token or 0)
        return HybridMoE(self.cpu, self.gpu_slot, device=device if cuda else None, gpu_experts="external",
                         max_deferred_experts_per_token=d, chain=proc.get_chain() if d else None,
                         is_last_layer=self.is_last_layer, layer_idx=self.layer_id, graph_max_tokens=0,
                         gpu_prefill_token_threshold=opts.kt_gpu_prefill_token_threshold if cuda else None)

    def _dynamic_unsupported(self, layer) -> str | None:
        if getattr(layer, "quant_config", None) is not None:
            return "new GPU experts are built from the CPU's weights, which needs an unquantised GPU method"
        if getattr(layer, "moe_tp_size", 1) != 1:
            return "tensor parallelism shards the GPU experts; only rank 0 holds the CPU weights"
        if getattr(self.gpu_method, "use_triton_kernels", False) or getattr(
                self.gpu_method, "load_up_proj_weight_first", False):
            return "this GPU MoE backend stores w13 in another layout"
        if self.cpu is None or getattr(self.cpu, "up_offset", None) != self.model.intermediate:
            return "the CPU weights are not gate-then-up [2I, H]"
        return None

    def adopt(self, placement) -> int:
        """Switch this layer to ``placement``'s row: copy the newly hot experts (dequantised from the
        CPU's packed weights) into their slots, then move the split. Returns the experts copied."""
        row = np.asarray(placement.row(self.layer_id), dtype=np.int64)
        incoming = [(int(e), int(row[e])) for e in np.nonzero(row >= 0)[0] if self.gpu_slot[e] != row[e]]
        layer = self._layer_ref()
        if incoming and layer is not None:
            copy_experts_in(self.cpu, layer, incoming, self.device)
        self.gpu_slot = row
        self._e2s.copy_(torch.from_numpy(row.astype(np.int32)))
        self.layer.update_placement(row)
        self.placement = placement
        return len(incoming)

    def _log_start(self) -> None:
        from ._support import sglang_version

        p = self.placement
        layers = list(self.model.moe_layers or range(p.num_layers))
        scheme = self.cpu.scheme.value if self.cpu is not None else (self.scheme.value if self.scheme else "?")
        proc.log_once("kt: SGLang integration active (kt %s, sglang %s, method %s [CPU %s], %d of %d "
                      "experts on GPU)", _KT_VERSION, sglang_version() or "?", self.options.kt_method,
                      scheme, int(p.gpu_mask[layers].sum()), len(layers) * p.num_experts)

    # -- SGLang plumbing -----------------------------------------------------------------------
    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        moe_runner_config.num_local_experts = self.num_gpu_experts
        self.gpu_method.create_moe_runner(layer, moe_runner_config)

    # -- forward -------------------------------------------------------------------------------
    def apply(self, layer: torch.nn.Module, dispatch_output):
        """x [T, H]; routing [T, K] -> StandardCombineInput(hidden_states [T, H])."""
        from sglang.srt.layers.moe.token_dispatcher import StandardCombineInput
        from sglang.srt.layers.moe.topk import TopKOutputChecker

        topk = dispatch_output.topk_output
        if TopKOutputChecker.format_is_bypassed(topk):
            topk = topk.to_standard()
        topk_weights, topk_ids, router_logits = topk[0], topk[1], topk[2]
        x = dispatch_output.hidden_states
        if getattr(self, "moe_runner_config", None) is not None and self.moe_runner_config.activation != "silu":
            raise NotImplementedError(f"kt: activation {self.moe_runner_config.activation!r}; kt's CPU "
                                      "experts compute SiLU(gate) * up")
        if self._stats is not None:
            self._stats.record(self.layer_id, topk_ids)
        if self._dynamic:
            proc.placer.observe(self.layer_id, topk_ids)

        def hot():
            if not (self.gpu_slot >= 0).any():
                return None
            return gpu_part(self.gpu_method, self._e2s, layer, dispatch_output, x, topk_ids, topk_weights,
                            router_logits)

        if self.layer is None:  # a tensor-parallel rank other than 0: its share of the GPU experts
            out = hot()
            out = torch.zeros_like(x) if out is None else out
        else:
            out = self.layer.forward(x, topk_ids, topk_weights, gpu=hot)
        if self._dynamic and self.is_last_layer:
            proc.maybe_replace()
        return StandardCombineInput(hidden_states=out)
