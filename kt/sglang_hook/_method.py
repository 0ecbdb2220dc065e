"""kt's MoE method inside SGLang's FusedMoE (replaces ``KTEPWrapperMethod`` through the hook registry).

Legend: T tokens, E experts, K top-k, H hidden size, I expert intermediate size, S GPU slots.

Per layer, the placement row ``gpu_slot [E]`` (any set of experts, not a prefix of the ids) decides:

- GPU: SGLang's own method (``gpu_method``: unquantised, FP8, ...) holds only the S hot experts, in
  SGLang's own layout, loaded by SGLang's own loader with the expert id remapped to its slot. In
  ``apply`` it runs on ``topk_ids`` remapped to slots (cold ids -> -1, which SGLang's GPU kernels skip).
- CPU: a ``kt.CPUMoE`` over all E experts (hot ones are skipped through its ``gpu_mask``), loaded
  from ``--kt-weight-path`` (kt format) or quantised from the checkpoint tensors SGLang loads.

``apply``: the CPU part is submitted first (stream-ordered on CUDA through kt's StreamBridge, a pool
job on the CPU), SGLang's GPU MoE runs meanwhile, then the CPU result is waited for and added.
Deferral (``--kt-max-deferred-experts-per-token``) and layer-wise GPU prefill follow kt.hybrid.
"""
from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from sglang.srt.layers.moe.kt_ep_wrapper import KTConfig, KTEPWrapperMethod
from sglang.srt.layers.quantization.base_config import FusedMoEMethodBase

from .._version import __version__ as _KT_VERSION
from ..config import QuantScheme
from ._flags import KTArgumentError, KTOptions, ModelInfo, method_scheme, resolve_placement

logger = logging.getLogger("kt.sglang_hook")

__all__ = ["KTMoEMethod", "KTLayerConfig"]


@dataclass
class KTLayerConfig(KTConfig):
    """Upstream's KTConfig (its fields kept for code that reads them) plus kt's options and model."""

    options: Optional[dict] = None
    model: Optional[ModelInfo] = None


# ----------------------------------------------------------------------------- per-process state

class _Process:
    """What the MoE layers of one SGLang process share: the CPU pool, the placement, the deferral
    chain, the statistics recorder, the one start-up log line."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pool = None
        self.placement = None
        self.placement_key = None
        self.chain = None
        self.stats = None
        self.logged = False
        self.placer = None
        self.methods: dict[int, "KTMoEMethod"] = {}
        self.replacements = 0

    def get_pool(self, opts: KTOptions):
        with self.lock:
            if self.pool is None:
                from ._cpu import make_pool

                self.pool = make_pool(opts)
            return self.pool

    def get_placement(self, opts: KTOptions, model: ModelInfo, expert_bytes: int):
        key = (tuple(sorted(opts.to_dict().items(), key=lambda kv: kv[0])).__repr__(), model, expert_bytes)
        with self.lock:
            if self.placement is None or self.placement_key != key:
                self.placement = resolve_placement(opts, model, expert_bytes)
                self.placement_key = key
            return self.placement

    def get_chain(self):
        from ..hybrid import DeferredChain

        with self.lock:
            if self.chain is None:
                self.chain = DeferredChain()
            return self.chain

    def get_placer(self, placement):
        from ..placement import DynamicPlacer

        with self.lock:
            if self.placer is None:
                self.placer = DynamicPlacer(placement.shape, initial=placement)
            return self.placer

    def maybe_replace(self) -> None:
        """After the last MoE layer: ask the policy; on a new placement, every layer copies its newly
        hot experts into their GPU slots (on the forward's stream, so later forwards see them)."""
        new = self.placer.poll()
        if new is None:
            return
        moved = 0
        for m in self.methods.values():
            moved += m._adopt(new)
        self.replacements += 1
        logger.info("kt: dynamic expert update %d: %d experts moved to the GPU", self.replacements, moved)

    def get_stats(self, path: str, model: ModelInfo):
        from ..placement import ExpertStats

        with self.lock:
            if self.stats is None:
                self.stats = ExpertStats(model.num_layers, model.num_experts)
                atexit.register(self._save_stats, path)
            return self.stats

    def _save_stats(self, path: str) -> None:
        try:
            self.stats.save(path)
            logger.info("kt: routing statistics saved to %s", path)
        except Exception as exc:  # noqa: BLE001 - at exit: report, never raise
            logger.warning("kt: could not save routing statistics to %s: %s", path, exc)


_proc = _Process()


class _Pending:
    """A CPU part in flight: a CPUMoE handle (CPU tensors) or a StreamBridge job (CUDA tensors)."""

    def __init__(self, handle=None, bridge=None, job=None):
        self.handle, self.bridge, self.job = handle, bridge, job

    def result(self) -> torch.Tensor:
        if self.bridge is not None:
            return self.bridge.finish(self.job)
        return self.handle.wait()

    wait = result

    def add_into(self, out: torch.Tensor) -> torch.Tensor:
        return out + self.result().to(out.dtype)


def _sglang_version() -> str:
    from . import sglang_version

    return sglang_version() or "?"


# ----------------------------------------------------------------------------- the method

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
        self.wrapper = None
        self.cpu = None
        self.gpu_slot = None
        self._stash = None
        self._bridge = None
        self._prefill = None

    # -- construction --------------------------------------------------------------------------
    def _model(self, layer, E, H, I, K) -> ModelInfo:
        m = getattr(self.kt_config, "model", None)
        if m is not None:
            if (m.num_experts, m.hidden) != (E, H):
                raise KTArgumentError(f"kt: the model config says E={m.num_experts}, H={m.hidden}, but "
                                      f"FusedMoE layer {layer.layer_id} has E={E}, H={H}")
            return m
        # no readable model config (e.g. a dummy model path): the layer count comes from kt's files
        opts = self.options
        if opts.kt_weight_path is not None:
            import json
            from pathlib import Path

            layers = json.loads((Path(opts.kt_weight_path) / "manifest.json").read_text())["layers"]
            return ModelInfo(max(layers) + 1, E, K, H, I, tuple(int(v) for v in layers))
        if opts.kt_placement is not None:
            from ..placement import Placement

            p = Placement.load(opts.kt_placement)
            return ModelInfo(p.num_layers, E, K, H, I, tuple(range(p.num_layers)))
        raise KTArgumentError("kt: cannot tell the model's number of layers (no readable config.json); "
                              "pass --kt-weight-path or --kt-placement")

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
        model = self._model(layer, E, H, I, int(layer.top_k))
        self.model = model
        from ..placement import expert_nbytes

        qname = layer.quant_config.get_name() if getattr(layer, "quant_config", None) is not None else ""
        gdt = "fp8" if "fp8" in str(qname).lower() else {torch.bfloat16: "bf16", torch.float16: "fp16",
                                                          torch.float32: "fp32"}.get(params_dtype, "bf16")
        placement = _proc.get_placement(self.options, model, expert_nbytes(H, I, gdt))
        if self.layer_id >= placement.num_layers:
            raise KTArgumentError(f"kt: layer {self.layer_id} is outside the placement's "
                                  f"{placement.num_layers} layers")
        self.placement = placement
        self.gpu_slot = np.asarray(placement.row(self.layer_id), dtype=np.int64)
        self.num_gpu_experts = int(placement.n_slots[self.layer_id])
        self.gpu_method.num_gpu_experts = self.num_gpu_experts  # as upstream's wrapper tells it
        moe_layers = model.moe_layers or tuple(range(model.num_layers))
        self.is_last_layer = self.layer_id == max(moe_layers)
        d = int(self.options.kt_max_deferred_experts_per_token or 0)
        self.max_deferred = 0 if self.is_last_layer else d
        self.uses_chain = d > 0

        if self.options.kt_weight_path is None and self.tp_rank == 0:
            if getattr(layer, "quant_config", None) is not None:
                raise KTArgumentError(f"kt: the checkpoint is quantised ({qname}); converting its experts "
                                      "while loading needs bf16/fp16 weights: convert them once with "
                                      "`kt convert MODEL DIR` and pass --kt-weight-path DIR")
            self._stash = {"w1": torch.zeros(E, I, H, dtype=params_dtype),
                           "w3": torch.zeros(E, I, H, dtype=params_dtype),
                           "w2": torch.zeros(E, H, I, dtype=params_dtype),
                           "seen": np.zeros((E, 3), dtype=bool)}

        # SGLang's loaders follow the weight layout of this method (e.g. transposed checkpoints)
        layer.weight_load_method = self.gpu_method
        attrs = dict(extra_weight_attrs)
        loader = attrs.get("weight_loader")
        if loader is not None:
            fused = getattr(layer, "weight_loader_fused", None)
            attrs["weight_loader"] = self._wrap_fused_loader(loader) if (
                fused is not None and loader == fused) else self._wrap_loader(layer)
        self.gpu_method.create_weights(layer=layer, num_experts=self.num_gpu_experts, hidden_size=H,
                                       intermediate_size_per_partition=intermediate_size_per_partition,
                                       params_dtype=params_dtype, **attrs)

    def _wrap_loader(self, layer):
        """SGLang's per-expert loader, called with the expert's GPU slot (cold experts: not loaded
        on the GPU; their checkpoint tensors are kept for the CPU when there is no kt directory)."""
        row = self.gpu_slot
        E = len(row)

        def load(param, loaded_weight, weight_name, shard_id, expert_id=None, *args, **kwargs):
            if expert_id is None:
                raise NotImplementedError("kt: loading all experts in one call is not supported; "
                                          f"parameter {weight_name!r}")
            e = int(expert_id)
            if not 0 <= e < E:
                raise KTArgumentError(f"kt: checkpoint expert id {e} of {weight_name!r} is outside "
                                      f"[0, {E}) in layer {self.layer_id}")
            st = self._stash
            if st is not None and shard_id in ("w1", "w2", "w3") and weight_name.endswith("weight"):
                st[shard_id][e].copy_(loaded_weight.to(st[shard_id].dtype))
                st["seen"][e, ("w1", "w3", "w2").index(shard_id)] = True
            slot = int(row[e])
            if slot < 0:
                return
            layer._weight_loader_impl(param=param, loaded_weight=loaded_weight, weight_name=weight_name,
                                      shard_id=shard_id, expert_id=slot)

        return load

    def _wrap_fused_loader(self, original):
        """SGLang's all-experts loader ([E, ...] tensors), given only the hot experts in slot order."""
        hot = None

        def load(param, loaded_weight, weight_name, shard_id, *args, **kwargs):
            nonlocal hot
            if self._stash is not None:
                raise KTArgumentError("kt: this checkpoint stores experts fused; converting them while "
                                      "loading is not supported: run `kt convert MODEL DIR` and pass "
                                      "--kt-weight-path DIR")
            if hot is None:
                hot = torch.from_numpy(self.placement.experts_in_slots(self.layer_id).astype(np.int64))
            if hot.numel() == 0:
                return
            return original(param, loaded_weight.index_select(0, hot.to(loaded_weight.device)), weight_name,
                            shard_id, *args, **kwargs)

        return load

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if self.num_gpu_experts > 0 and hasattr(self.gpu_method, "process_weights_after_loading"):
            self.gpu_method.process_weights_after_loading(layer)
        if self.tp_rank == 0:
            self.cpu = self._build_cpu()
        device = layer.w13_weight.device if hasattr(layer, "w13_weight") else torch.device("cpu")
        self.device = device
        row = self.gpu_slot
        self._gpu_mask_np = row >= 0
        self._any_gpu = bool(self._gpu_mask_np.any())
        self._e2s = torch.from_numpy(row.astype(np.int32)).to(device)
        self._cpu_expert = torch.from_numpy(~self._gpu_mask_np).to(device)
        if self.options.record_kt_gpu_expert_distribution:
            self._stats = _proc.get_stats(self.options.record_kt_gpu_expert_distribution, self.model)
        else:
            self._stats = None
        self._dynamic = False
        if self.options.kt_enable_dynamic_expert_update:
            why = self._dynamic_unsupported(layer)
            if why:
                logger.warning("kt: --kt-enable-dynamic-expert-update is off for layer %d: %s", self.layer_id, why)
            else:
                import weakref

                self._layer_ref = weakref.ref(layer)
                _proc.get_placer(self.placement)
                _proc.methods[self.layer_id] = self
                self._dynamic = True
        self._log_start()

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

    def _adopt(self, placement) -> int:
        """Switch this layer to ``placement``'s row: copy the newly hot experts (dequantised from the
        CPU's packed weights) into their slots, then update the id -> slot map in place."""
        from .._gpu_weights import packed_to_device

        row = np.asarray(placement.row(self.layer_id), dtype=np.int64)
        old = self.gpu_slot
        incoming = [(int(e), int(row[e])) for e in np.nonzero(row >= 0)[0] if old[e] != row[e]]
        layer = self._layer_ref()
        if incoming and layer is not None:
            ex = [e for e, _ in incoming]
            w13, _ = packed_to_device(self.cpu.w13, ex, self.device, "bf16")
            w2, _ = packed_to_device(self.cpu.w2, ex, self.device, "bf16")
            for j, (_, s) in enumerate(incoming):
                layer.w13_weight.data[s].copy_(w13[j])
                layer.w2_weight.data[s].copy_(w2[j])
        self.gpu_slot = row
        self._gpu_mask_np = row >= 0
        self._any_gpu = bool(self._gpu_mask_np.any())
        self._e2s.copy_(torch.from_numpy(row.astype(np.int32)))
        self._cpu_expert.copy_(torch.from_numpy(~self._gpu_mask_np))
        self.placement = placement
        return len(incoming)

    def _build_cpu(self):
        from ..cpu_ops.moe import CPUMoE
        from ..weights import load_cpu_moe

        opts = self.options
        pool = _proc.get_pool(opts)
        E, H = self.global_num_experts, self.hidden_size
        I = self.model.intermediate
        if opts.kt_weight_path is not None:
            cpu = load_cpu_moe(opts.kt_weight_path, self.layer_id, pool=pool)
            src = opts.kt_weight_path
        else:
            st, self._stash = self._stash, None
            missing = np.argwhere(~st["seen"])
            if missing.size:
                e, k = missing[0]
                raise KTArgumentError(f"kt: layer {self.layer_id}: the checkpoint gave no "
                                      f"{('gate', 'up', 'down')[k]} weight for expert {e}")
            cpu = CPUMoE.from_tensors(st["w1"], st["w3"], st["w2"], scheme=self.scheme or QuantScheme.INT8,
                                      pool=pool)
            src = "the checkpoint (converted while loading)"
        if (cpu.num_experts, cpu.hidden, cpu.intermediate) != (E, H, I):
            raise KTArgumentError(f"kt: layer {self.layer_id}: CPU experts from {src} have (E, H, I) = "
                                  f"{(cpu.num_experts, cpu.hidden, cpu.intermediate)}, the model {(E, H, I)}")
        return cpu

    def _log_start(self) -> None:
        with _proc.lock:
            if _proc.logged:
                return
            _proc.logged = True
        p = self.placement
        layers = list(self.model.moe_layers or range(p.num_layers))
        n = int(p.gpu_mask[layers].sum())
        m = len(layers) * p.num_experts
        scheme = self.cpu.scheme.value if self.cpu is not None else (self.scheme.value if self.scheme else "?")
        logger.info("kt: SGLang integration active (kt %s, sglang %s, method %s [CPU %s], %d of %d experts "
                    "on GPU)", _KT_VERSION, _sglang_version(), self.options.kt_method, scheme, n, m)

    # -- SGLang plumbing -----------------------------------------------------------------------
    def create_moe_runner(self, layer, moe_runner_config):
        self.moe_runner_config = moe_runner_config
        moe_runner_config.num_local_experts = self.num_gpu_experts
        self.gpu_method.create_moe_runner(layer, moe_runner_config)

    # -- forward -------------------------------------------------------------------------------
    def _submit_cpu(self, x, topk_ids, topk_weights, slot="now") -> _Pending | None:
        if self.cpu is None:
            return None
        mask = self._gpu_mask_np if self._any_gpu else None
        if x.is_cuda:
            if self._bridge is None:
                from .._stream_bridge import StreamBridge

                self._bridge = StreamBridge(self.cpu, x.device)
            return _Pending(bridge=self._bridge, job=self._bridge.start(x, topk_ids, topk_weights, mask,
                                                                         slot=slot))
        return _Pending(handle=self.cpu.submit(x, topk_ids, topk_weights, gpu_mask=mask))

    def _gpu_part(self, layer, dispatch_output, x, topk_ids, topk_weights, router_logits):
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        if not self._any_gpu:
            return torch.zeros_like(x)
        valid = topk_ids >= 0
        slots = self._e2s[topk_ids.clamp(min=0).long()]
        remapped = torch.where(valid, slots, torch.full_like(slots, -1)).to(topk_ids.dtype)
        if x.is_cuda:  # SGLang's GPU kernels skip id -1
            out = self.gpu_method.apply(layer, dispatch_output._replace(
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
        y = self.gpu_method.apply(layer, sub).hidden_states
        return out.index_add_(0, t_idx, y.to(out.dtype))

    def _prefill_threshold(self, k: int):
        thr = self.options.kt_gpu_prefill_token_threshold
        if thr != "auto":
            return thr
        if self._prefill is None:
            from ..hybrid import PrefillCostModel, measure_h2d

            cm = PrefillCostModel()
            cm.h2d_bytes_per_s = measure_h2d(self.device)
            self._prefill = cm.threshold(k, self.global_num_experts, self.hidden_size, self.model.intermediate,
                                         self.cpu.nbytes / self.global_num_experts)
        return self._prefill

    def _cold_on_gpu(self, x, topk_ids, topk_weights):
        """Layer-wise prefill: this layer's CPU experts copied to the GPU for one large batch and run
        there with kt's Triton MoE (weights dequantised from the CPU's packed copy)."""
        from .._gpu_weights import packed_to_device
        from ..gpu_ops import fused_moe

        cold = np.nonzero(~self._gpu_mask_np)[0]
        w13, s13 = packed_to_device(self.cpu.w13, cold, x.device, "bf16")
        w2, s2 = packed_to_device(self.cpu.w2, cold, x.device, "bf16")
        e2s = torch.full((self.global_num_experts,), -1, dtype=torch.int32)
        e2s[torch.from_numpy(cold)] = torch.arange(len(cold), dtype=torch.int32)
        return fused_moe(x, topk_ids, topk_weights, e2s.to(x.device), w13, w2, w13_scale=s13, w2_scale=s2)

    def apply(self, layer: torch.nn.Module, dispatch_output):
        """x [T, H]; routing [T, K] -> StandardCombineInput(hidden_states [T, H])."""
        out = self._apply(layer, dispatch_output)
        if self._dynamic and self.is_last_layer:
            _proc.maybe_replace()
        return out

    def _apply(self, layer: torch.nn.Module, dispatch_output):
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
            _proc.placer.observe(self.layer_id, topk_ids)
        thr = self.options.kt_gpu_prefill_token_threshold
        if (x.is_cuda and thr is not None and self.cpu is not None
                and x.shape[0] >= self._prefill_threshold(topk_ids.shape[1])):
            out = self._gpu_part(layer, dispatch_output, x, topk_ids, topk_weights, router_logits)
            out = out + self._cold_on_gpu(x, topk_ids, topk_weights).to(out.dtype)
            return StandardCombineInput(hidden_states=self._take_deferred(out))
        if self.max_deferred:
            from ..hybrid import split_deferred

            ids_now, ids_later = split_deferred(topk_ids, topk_weights, self._cpu_expert, self.max_deferred)
        else:
            ids_now, ids_later = topk_ids, None
        pending = self._submit_cpu(x, ids_now, topk_weights)  # CPU first: it runs during the GPU part
        out = self._gpu_part(layer, dispatch_output, x, topk_ids, topk_weights, router_logits)
        if pending is not None:
            out = pending.add_into(out)
        out = self._take_deferred(out)
        if ids_later is not None and self.cpu is not None:
            _proc.get_chain().put(self._submit_cpu(x, ids_later, topk_weights, slot="deferred"))
        return StandardCombineInput(hidden_states=out)

    def _take_deferred(self, out):
        if not self.uses_chain or self.cpu is None:
            return out
        prev = _proc.get_chain().take()
        return out if prev is None else prev.add_into(out)
