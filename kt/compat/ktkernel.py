"""KTMoEWrapper: kt-kernel's ``KTMoEWrapper`` API over kt's ``HybridMoE``.

Code written for kt-kernel 0.7.2 runs unchanged:

    w = KTMoEWrapper(layer_idx, num_experts, num_experts_per_tok, hidden_size,
                     moe_intermediate_size, gpu_experts_mask, cpuinfer_threads, threadpool_count,
                     weight_path, chunked_prefill_size, method="AMXINT8")
    w.load_weights(physical_to_logical_map)            # from the kt weight format at weight_path
    # or w.load_weights_from_tensors(gate_proj, up_proj, down_proj, physical_to_logical_map)
    out = w.forward(hidden_states, topk_ids, topk_weights)    # bf16 [T, H] on the input's device
    w.submit_forward(hidden_states, topk_ids, topk_weights); ...; out = w.sync_forward(hidden_states)

The wrapper computes the CPU experts only (the experts of ``gpu_experts_mask`` are the caller's).
CUDA inputs take the layer's stream-ordered path: the copies and the wait are enqueued on the
given stream and the host never blocks. Methods: AMXINT8 / MOE_INT8 -> INT8 (per-row int8),
AMXINT4 / MOE_INT4 -> INT4 group-wise with G = 64 (kt-kernel's AMXINT4 is per-row; group-wise is
several times more accurate), BF16 -> BF16. kt picks the best kernels for the host CPU itself
(AMX, AVX-512 or AVX2) whatever the method name. FP8, FP8_PERCHANNEL, RAWINT4, GPTQ_INT4 and
LLAMAFILE are not supported: convert such checkpoints to the kt weight format (``kt convert``),
which reads fp8 and GGUF sources.

Legend: T tokens, E experts, K top-k, H hidden size, I intermediate size.
"""
from __future__ import annotations

import numpy as np
import torch

from ..config import QuantScheme
from ._args import check_map, gpu_mask, int_arg, method_scheme, numa_split, tensor_arg
from ._deferred import LayerKeyedChain

__all__ = ["KTMoEWrapper"]


class KTMoEWrapper:
    """The CPU experts of one MoE layer, with kt-kernel's constructor and methods."""

    def __init__(self, layer_idx, num_experts, num_experts_per_tok, hidden_size,
                 moe_intermediate_size, gpu_experts_mask=None, cpuinfer_threads=None,
                 threadpool_count=1, weight_path=None, chunked_prefill_size=512, cpu_save=False,
                 max_deferred_experts_per_token=None, method="AMXINT4", numa_nodes=None,
                 num_gpu_experts=None):
        self.layer_idx = int_arg("layer_idx", layer_idx, low=0)
        self.num_experts = int_arg("num_experts", num_experts)
        self.num_experts_per_tok = int_arg("num_experts_per_tok", num_experts_per_tok)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={num_experts_per_tok} exceeds "
                             f"num_experts={num_experts}")
        self.hidden_size = int_arg("hidden_size", hidden_size)
        self.moe_intermediate_size = int_arg("moe_intermediate_size", moe_intermediate_size)
        self.cpuinfer_threads = None if cpuinfer_threads is None else int_arg("cpuinfer_threads",
                                                                              cpuinfer_threads)
        self.threadpool_count = int_arg("threadpool_count", threadpool_count)
        self.chunked_prefill_size = int_arg("chunked_prefill_size", chunked_prefill_size)
        self.weight_path = weight_path
        self.cpu_save = bool(cpu_save)  # kt-kernel: keep converted weights; kt's format is on disk
        self.numa_nodes = numa_nodes
        d = 0 if max_deferred_experts_per_token is None else max_deferred_experts_per_token
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < self.num_experts_per_tok:
            raise ValueError(f"max_deferred_experts_per_token must be an int in [0, num_experts_per_tok="
                             f"{self.num_experts_per_tok}), got {max_deferred_experts_per_token!r}")
        self.max_deferred_experts_per_token = int(d)
        self.method, self.scheme, self.group_size = method_scheme(method)
        self.gpu_experts_mask = gpu_mask(gpu_experts_mask, num_gpu_experts, self.num_experts)
        self._moe = None
        self._layers: dict = {}  # input device -> HybridMoE over self._moe
        self._pending = None

    # -- weights

    @property
    def pool(self):
        """The CpuPool of this wrapper's thread count, shared by every layer (as kt-kernel shares
        its CPUInfer)."""
        from ..cpu_ops import default_pool

        return default_pool(self.cpuinfer_threads)

    def _pool_arg(self):
        """The pool the layer is built with: None (the default pool, or the GPU layers' pool once
        inputs are on a GPU) unless cpuinfer_threads was given."""
        return None if self.cpuinfer_threads is None else self.pool

    def load_weights(self, physical_to_logical_map=None):
        """Load this layer from the kt weight format at ``weight_path``."""
        from ..cpu_ops import CPUMoE, MoETuning
        from ..weights import load_experts

        if self.weight_path is None:
            raise ValueError("load_weights needs weight_path (a kt weight-format directory); "
                             "or call load_weights_from_tensors")
        p2l = check_map(physical_to_logical_map, self.num_experts)
        lw = load_experts(self.weight_path, self.layer_idx, physical_to_logical_map=p2l,
                          shape=(self.num_experts, self.hidden_size, self.moe_intermediate_size))
        if lw.scheme is not self.scheme:
            raise ValueError(f"{self.weight_path}: layer {self.layer_idx} is {lw.scheme.value}, but "
                             f"method={self.method!r} expects {self.scheme.value}")
        self._set_moe(CPUMoE(lw.w13, lw.w2, pool=self._pool_arg(),
                             tuning=MoETuning(chunk_tokens=self.chunked_prefill_size)))

    def load_weights_from_tensors(self, gate_proj, up_proj, down_proj, physical_to_logical_map=None):
        """gate_proj/up_proj [E, I, H], down_proj [E, H, I] (bf16/fp16/fp32, torch or numpy),
        indexed by logical expert; physical slot p of this layer holds logical expert map[p]."""
        from ..cpu_ops import CPUMoE, MoETuning

        E, H, I = self.num_experts, self.hidden_size, self.moe_intermediate_size
        mats = [tensor_arg(name, a, shp, layout) for name, a, shp, layout in (
            ("gate_proj", gate_proj, (E, I, H), "E, I, H"), ("up_proj", up_proj, (E, I, H), "E, I, H"),
            ("down_proj", down_proj, (E, H, I), "E, H, I"))]
        p2l = check_map(physical_to_logical_map, E)
        if p2l is not None and not np.array_equal(p2l, np.arange(E)):
            mats = [a[torch.as_tensor(p2l, device=a.device)] for a in mats]
        self._set_moe(CPUMoE.from_tensors(*mats, scheme=self.scheme, group_size=self.group_size or 64,
                                          pool=self._pool_arg(),
                                          tuning=MoETuning(chunk_tokens=self.chunked_prefill_size)))

    def _set_moe(self, moe) -> None:
        """kt-kernel's ``threadpool_count`` > 1 means one sub-pool per NUMA node: the layer is
        split across that many nodes when this process has them (``kt.NumaMoE``)."""
        self._moe = numa_split(moe, self.threadpool_count, self.numa_nodes, self.cpuinfer_threads)
        self._layers.clear()

    @property
    def moe(self):
        """The underlying ``kt.CPUMoE`` (``kt.NumaMoE`` when split across NUMA nodes), after
        weights are loaded."""
        if self._moe is None:
            raise RuntimeError(f"KTMoEWrapper layer {self.layer_idx}: weights not loaded; call "
                               "load_weights() or load_weights_from_tensors() first")
        return self._moe

    def _layer(self, device):
        """The layer for inputs on ``device`` (one per device; CUDA ones order the CPU part on
        the caller's stream)."""
        key = str(device)
        layer = self._layers.get(key)
        if layer is None:
            from ..layer import HybridMoE

            mask = self.gpu_experts_mask
            slots = np.full(self.num_experts, -1, np.int64)
            slots[mask] = np.arange(int(mask.sum()))
            layer = HybridMoE(self.moe, slots, device=device if device.type == "cuda" else None,
                              gpu_experts="external", layer_idx=self.layer_idx,
                              max_deferred_experts_per_token=self.max_deferred_experts_per_token,
                              chain=LayerKeyedChain(self.layer_idx), graph_max_tokens=0)
            self._layers[key] = layer
        return layer

    # -- forward

    def submit_forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None):
        """Start the CPU experts on ``hidden_states`` [T, H] (bf16) routed by topk_ids /
        topk_weights [T, K] (torch tensors or numpy arrays); ``sync_forward`` returns the result."""
        if self._pending is not None:
            raise RuntimeError(f"KTMoEWrapper layer {self.layer_idx}: submit_forward called twice "
                               "without sync_forward")
        x, ids, w = (torch.as_tensor(a) if isinstance(a, np.ndarray) else a
                     for a in (hidden_states, topk_ids, topk_weights))
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor or numpy.ndarray, got "
                            f"{type(hidden_states).__name__}")
        if isinstance(ids, torch.Tensor) and ids.dtype is torch.int32:
            ids = ids.long()
        if isinstance(w, torch.Tensor) and w.dtype is not torch.float32:
            w = w.float()
        layer = self._layer(x.device)
        stream = _stream(cuda_stream, x.device)
        if stream is None:
            self._pending = (layer.submit(x, ids, w), None)
        else:
            with torch.cuda.stream(stream):
                self._pending = (layer.submit(x, ids, w), stream)

    def sync_forward(self, hidden_states=None, cuda_stream=None):
        """Wait for the submitted layer; bf16 [T, H] on the input's device (on CUDA, ordered on
        the submit's stream: the host does not wait)."""
        if self._pending is None:
            raise RuntimeError(f"KTMoEWrapper layer {self.layer_idx}: sync_forward without "
                               "submit_forward")
        call, stream = self._pending
        self._pending = None
        layer = self._layer(call.x.device)
        if stream is None:
            out = layer.finish(call)
        else:
            with torch.cuda.stream(stream):
                # a copy: the layer's result may be its stream buffer, which its next call reuses
                return layer.finish(call).to(torch.bfloat16, copy=True)
        return out if out.dtype is torch.bfloat16 else out.to(torch.bfloat16)

    def forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None):
        self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
        return self.sync_forward(hidden_states, cuda_stream)

    __call__ = forward

    def __repr__(self):
        return (f"KTMoEWrapper(layer_idx={self.layer_idx}, E={self.num_experts}, "
                f"K={self.num_experts_per_tok}, H={self.hidden_size}, "
                f"I={self.moe_intermediate_size}, method={self.method!r}, "
                f"gpu_experts={int(self.gpu_experts_mask.sum())}, loaded={self._moe is not None})")


def _stream(cuda_stream, device):
    """The CUDA stream a call on ``device`` is ordered on (None for CPU inputs): the given one (a
    torch stream, or kt-kernel's raw handle as an int), else the current stream."""
    if device.type != "cuda":
        return None
    if cuda_stream is None:
        return torch.cuda.current_stream(device)
    if isinstance(cuda_stream, int):
        return torch.cuda.ExternalStream(cuda_stream, device=device)
    return cuda_stream
