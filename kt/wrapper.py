"""KTMoEWrapper: kt-kernel's ``KTMoEWrapper`` API on top of ``kt.CPUMoE``.

Code written for kt-kernel 0.7.2 runs unchanged:

    w = KTMoEWrapper(layer_idx, num_experts, num_experts_per_tok, hidden_size,
                     moe_intermediate_size, gpu_experts_mask, cpuinfer_threads, threadpool_count,
                     weight_path, chunked_prefill_size, method="AMXINT8")
    w.load_weights(physical_to_logical_map)            # from the kt weight format at weight_path
    # or w.load_weights_from_tensors(gate_proj, up_proj, down_proj, physical_to_logical_map)
    out = w.forward(hidden_states, topk_ids, topk_weights)    # bf16 [T, H] on the input's device
    w.submit_forward(hidden_states, topk_ids, topk_weights); ...; out = w.sync_forward(hidden_states)

Methods: AMXINT8 / MOE_INT8 -> INT8 (per-row int8), AMXINT4 / MOE_INT4 -> INT4 group-wise with
G = 64 (kt-kernel's AMXINT4 is per-row; group-wise is several times more accurate), BF16 -> BF16.
kt picks the best kernels for the host CPU itself (AMX, AVX-512 or AVX2) whatever the method name.
FP8, FP8_PERCHANNEL, RAWINT4, GPTQ_INT4 and LLAMAFILE are not supported: convert such checkpoints
to the kt weight format (``kt convert``), which reads fp8 and GGUF sources.

Legend: T tokens, E experts, K top-k, H hidden size, I intermediate size.
"""
from __future__ import annotations

import threading

import numpy as np

from .config import QuantScheme

__all__ = ["KTMoEWrapper", "METHODS", "UNSUPPORTED_METHODS"]

METHODS = {
    "AMXINT8": (QuantScheme.INT8, 0),
    "MOE_INT8": (QuantScheme.INT8, 0),
    "AMXINT4": (QuantScheme.INT4, 64),
    "MOE_INT4": (QuantScheme.INT4, 64),
    "BF16": (QuantScheme.BF16, 0),
}
UNSUPPORTED_METHODS = ("FP8", "FP8_PERCHANNEL", "RAWINT4", "GPTQ_INT4", "LLAMAFILE")

_pools: dict[int | None, object] = {}
_pools_lock = threading.Lock()


def _shared_pool(threads: int | None):
    """One CpuPool per thread count, shared by every layer (as kt-kernel shares its CPUInfer)."""
    from .cpu_ops.runtime.pool import CpuPool, default_pool

    if threads is None:
        return default_pool()
    with _pools_lock:
        p = _pools.get(threads)
        if p is None or p.closed:
            p = CpuPool(threads)
            _pools[threads] = p
        return p


def _pos_int(name, v, allow_none=False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _np(a):
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


class KTMoEWrapper:
    """The CPU experts of one MoE layer, with kt-kernel's constructor and methods."""

    def __init__(self, layer_idx, num_experts, num_experts_per_tok, hidden_size,
                 moe_intermediate_size, gpu_experts_mask=None, cpuinfer_threads=None,
                 threadpool_count=1, weight_path=None, chunked_prefill_size=512, cpu_save=False,
                 max_deferred_experts_per_token=None, method="AMXINT4", numa_nodes=None,
                 num_gpu_experts=None):
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, (int, np.integer)) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a non-negative int, got {layer_idx!r}")
        self.layer_idx = int(layer_idx)
        self.num_experts = _pos_int("num_experts", num_experts)
        self.num_experts_per_tok = _pos_int("num_experts_per_tok", num_experts_per_tok)
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok={num_experts_per_tok} exceeds "
                             f"num_experts={num_experts}")
        self.hidden_size = _pos_int("hidden_size", hidden_size)
        self.moe_intermediate_size = _pos_int("moe_intermediate_size", moe_intermediate_size)
        self.cpuinfer_threads = _pos_int("cpuinfer_threads", cpuinfer_threads, allow_none=True)
        self.threadpool_count = _pos_int("threadpool_count", threadpool_count)
        self.chunked_prefill_size = _pos_int("chunked_prefill_size", chunked_prefill_size)
        self.weight_path = weight_path
        self.cpu_save = bool(cpu_save)  # kt-kernel: keep converted weights; kt's format is on disk
        self.numa_nodes = numa_nodes
        d = 0 if max_deferred_experts_per_token is None else max_deferred_experts_per_token
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 <= d < self.num_experts_per_tok:
            raise ValueError(f"max_deferred_experts_per_token must be an int in [0, num_experts_per_tok="
                             f"{self.num_experts_per_tok}), got {max_deferred_experts_per_token!r}")
        self.max_deferred_experts_per_token = int(d)
        if not isinstance(method, str):
            raise TypeError(f"method must be a str, got {type(method).__name__}")
        key = method.strip().upper()
        if key not in METHODS:
            what = ("is not supported by kt" if key in UNSUPPORTED_METHODS
                    else "is not a kt-kernel method")
            raise ValueError(f"method={method!r} {what}; supported: {sorted(METHODS)} "
                             f"(convert fp8/GGUF checkpoints with `kt convert` and use AMXINT8, "
                             f"AMXINT4 or BF16)")
        self.method = key
        self.scheme, self.group_size = METHODS[key]
        E = self.num_experts
        mask = np.zeros(E, bool)
        if gpu_experts_mask is not None:
            gm = _np(gpu_experts_mask)
            if gm.shape != (E,):
                raise ValueError(f"gpu_experts_mask must be bool [num_experts={E}], got shape {gm.shape}")
            if gm.dtype != np.bool_:
                raise TypeError(f"gpu_experts_mask must be bool, got {gm.dtype}")
            mask |= gm
        if num_gpu_experts is not None:
            if isinstance(num_gpu_experts, bool) or not isinstance(num_gpu_experts, (int, np.integer)) \
                    or not 0 <= num_gpu_experts <= E:
                raise ValueError(f"num_gpu_experts must be an int in [0, {E}], got {num_gpu_experts!r}")
            mask[: int(num_gpu_experts)] = True
        self.gpu_experts_mask = mask
        self._mask_arg = mask if mask.any() else None
        self._moe = None
        self._pending = None
        self._pinned: dict = {}

    # -- weights

    @property
    def pool(self):
        return _shared_pool(self.cpuinfer_threads)

    def _check_map(self, p2l):
        if p2l is None:
            return None
        m = _np(p2l)
        E = self.num_experts
        if m.ndim != 1 or not np.issubdtype(m.dtype, np.integer):
            raise ValueError(f"physical_to_logical_map must be a 1-D int array, got {m.dtype} {m.shape}")
        if m.size and (m.min() < 0 or m.max() >= E):
            raise ValueError(f"physical_to_logical_map values must be in [0, {E}), got "
                             f"[{m.min()}, {m.max()}]")
        if m.shape != (E,):
            raise ValueError(f"physical_to_logical_map must have num_experts={E} entries, got {m.size}")
        return m.astype(np.int64)

    def load_weights(self, physical_to_logical_map=None):
        """Load this layer from the kt weight format at ``weight_path``."""
        from .cpu_ops.moe import CPUMoE, MoETuning

        if self.weight_path is None:
            raise ValueError("load_weights needs weight_path (a kt weight-format directory); "
                             "or call load_weights_from_tensors")
        p2l = self._check_map(physical_to_logical_map)
        from .weights import load_experts

        lw = load_experts(self.weight_path, self.layer_idx, physical_to_logical_map=p2l,
                          shape=(self.num_experts, self.hidden_size, self.moe_intermediate_size))
        if lw.scheme is not self.scheme:
            raise ValueError(f"{self.weight_path}: layer {self.layer_idx} is {lw.scheme.value}, but "
                             f"method={self.method!r} expects {self.scheme.value}")
        self._moe = self._split_numa(CPUMoE(lw.w13, lw.w2, pool=self._pool_arg(),
                                            tuning=MoETuning(chunk_tokens=self.chunked_prefill_size)))

    def load_weights_from_tensors(self, gate_proj, up_proj, down_proj, physical_to_logical_map=None):
        """gate_proj/up_proj [E, I, H], down_proj [E, H, I] (bf16/fp16/fp32, torch or numpy),
        indexed by logical expert; physical slot p of this layer holds logical expert map[p]."""
        from .cpu_ops.moe import CPUMoE, MoETuning

        E, H, I = self.num_experts, self.hidden_size, self.moe_intermediate_size
        for name, a, shp in (("gate_proj", gate_proj, (E, I, H)), ("up_proj", up_proj, (E, I, H)),
                             ("down_proj", down_proj, (E, H, I))):
            if tuple(a.shape) != shp:
                raise ValueError(f"{name} must be [E, {'I, H' if name != 'down_proj' else 'H, I'}]"
                                 f" = {shp}, got {tuple(a.shape)}")
        p2l = self._check_map(physical_to_logical_map)
        if p2l is not None and not np.array_equal(p2l, np.arange(E)):
            gate_proj, up_proj, down_proj = (_take(a, p2l) for a in (gate_proj, up_proj, down_proj))
        moe = CPUMoE.from_tensors(gate_proj, up_proj, down_proj, scheme=self.scheme,
                                  group_size=self.group_size or 64, pool=self._pool_arg(),
                                  tuning=MoETuning(chunk_tokens=self.chunked_prefill_size))
        self._moe = self._split_numa(moe)

    def _split_numa(self, moe):
        """kt-kernel's ``threadpool_count`` > 1 means one sub-pool per NUMA node: split the layer
        across that many nodes (``kt.NumaMoE``; ``numa_nodes`` picks which) when this process
        has them; with fewer nodes, warn and keep one pool."""
        if self.threadpool_count <= 1:
            return moe
        import warnings

        from .cpu_ops.runtime import pool as _pool
        from .weights import numa_split

        nodes = _pool.numa_nodes()
        if self.numa_nodes is not None:
            want = [int(n) for n in self.numa_nodes]
            missing = [n for n in want if n not in nodes]
            if missing:
                raise ValueError(f"numa_nodes {missing} are not NUMA nodes of this process "
                                 f"(it has {sorted(nodes)})")
            nodes = {n: nodes[n] for n in want}
        if len(nodes) < self.threadpool_count:
            warnings.warn(f"KTMoEWrapper: threadpool_count={self.threadpool_count} but this process "
                          f"has {len(nodes)} NUMA node(s); using one thread pool", stacklevel=3)
            return moe
        keys = sorted(nodes)[: self.threadpool_count]
        per = None if self.cpuinfer_threads is None else max(1, self.cpuinfer_threads // len(keys))
        return numa_split(moe, nodes={k: nodes[k] for k in keys}, threads_per_node=per)

    def _pool_arg(self):
        return None if self.cpuinfer_threads is None else self.pool

    @property
    def moe(self):
        """The underlying ``kt.CPUMoE`` (``kt.NumaMoE`` when split across NUMA nodes), after
        weights are loaded."""
        if self._moe is None:
            raise RuntimeError(f"KTMoEWrapper layer {self.layer_idx}: weights not loaded; call "
                               "load_weights() or load_weights_from_tensors() first")
        return self._moe

    # -- forward

    def _to_host(self, a, name):
        """CPU tensors pass through; device tensors are copied into a pinned host buffer."""
        if not hasattr(a, "device") or a.device.type == "cpu":
            return a
        import torch

        key = (name, a.dtype)
        buf = self._pinned.get(key)
        if buf is None or buf.numel() < a.numel():
            buf = torch.empty(a.numel(), dtype=a.dtype, pin_memory=True)
            self._pinned[key] = buf
        host = buf[: a.numel()].view(a.shape)
        host.copy_(a, non_blocking=True)
        return host

    def submit_forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None):
        """Start the CPU experts on ``hidden_states`` [T, H] (bf16) routed by topk_ids /
        topk_weights [T, K]; ``sync_forward`` returns the result."""
        moe = self.moe
        if self._pending is not None:
            raise RuntimeError(f"KTMoEWrapper layer {self.layer_idx}: submit_forward called twice "
                               "without sync_forward")
        on_device = hasattr(hidden_states, "device") and hidden_states.device.type != "cpu"
        if on_device:
            import torch

            if cuda_stream is None:
                stream = torch.cuda.current_stream(hidden_states.device)
            elif isinstance(cuda_stream, int):  # kt-kernel callers pass the raw handle
                stream = torch.cuda.ExternalStream(cuda_stream, device=hidden_states.device)
            else:
                stream = cuda_stream
            with torch.cuda.stream(stream):
                x = self._to_host(hidden_states, "x")
                ids = self._to_host(topk_ids, "ids")
                w = self._to_host(topk_weights, "w")
            stream.synchronize()
        else:
            x, ids, w = hidden_states, topk_ids, topk_weights
        if hasattr(w, "dtype") and str(w.dtype) == "torch.bfloat16":
            w = w.float()
        later = None
        if self.max_deferred_experts_per_token:
            ids, later = self._split_deferred(ids, w)
        self._pending = (moe.submit(x, ids, w, gpu_mask=self._mask_arg), hidden_states, (x, later, w))

    # Deferred experts, as kt-kernel does them: each token's d lowest-weight CPU experts of layer
    # l are computed after layer l's result is returned, while the model runs on, and their
    # output is added to layer l+1's result. Give the model's last MoE layer d = 0 (its deferred
    # part would have no next layer to land in). Keyed by layer_idx, shared by the wrappers.
    _deferred: dict = {}

    def _split_deferred(self, ids, w):
        import torch

        from .hybrid import split_deferred

        ids_t = ids if isinstance(ids, torch.Tensor) else torch.from_numpy(np.asarray(ids))
        w_t = w if isinstance(w, torch.Tensor) else torch.from_numpy(np.asarray(w, np.float32))
        cpu_expert = torch.from_numpy(~self.gpu_experts_mask)
        now, later = split_deferred(ids_t.long(), w_t.float(), cpu_expert, self.max_deferred_experts_per_token)
        return now, later

    def sync_forward(self, hidden_states=None, cuda_stream=None):
        """Wait for the submitted layer; bf16 [T, H] on hidden_states' device."""
        if self._pending is None:
            raise RuntimeError(f"KTMoEWrapper layer {self.layer_idx}: sync_forward without "
                               "submit_forward")
        handle, src, (x, later, w) = self._pending
        self._pending = None
        out = handle.wait()
        prev = KTMoEWrapper._deferred.pop(self.layer_idx - 1, None)
        if prev is not None:  # the previous layer's deferred experts land here
            out = out + prev.wait()
        stale = KTMoEWrapper._deferred.pop(self.layer_idx, None)
        if stale is not None:
            stale.wait()  # never consumed (no next layer ran): finish it, drop it
        if later is not None and bool((later >= 0).any()):
            KTMoEWrapper._deferred[self.layer_idx] = self.moe.submit(x, later, w, gpu_mask=self._mask_arg)
        ref = hidden_states if hidden_states is not None else src
        if hasattr(out, "dtype") and hasattr(out, "to"):
            import torch

            if out.dtype != torch.bfloat16:
                out = out.to(torch.bfloat16)
            if hasattr(ref, "device") and ref.device.type != "cpu":
                out = out.pin_memory().to(ref.device, non_blocking=True)
            return out
        return out

    def forward(self, hidden_states, topk_ids, topk_weights, cuda_stream=None):
        self.submit_forward(hidden_states, topk_ids, topk_weights, cuda_stream)
        return self.sync_forward(hidden_states, cuda_stream)

    __call__ = forward

    def __repr__(self):
        return (f"KTMoEWrapper(layer_idx={self.layer_idx}, E={self.num_experts}, "
                f"K={self.num_experts_per_tok}, H={self.hidden_size}, "
                f"I={self.moe_intermediate_size}, method={self.method!r}, "
                f"gpu_experts={int(self.gpu_experts_mask.sum())}, loaded={self._moe is not None})")


def _take(a, idx):
    """a[idx] along the expert axis (torch or numpy)."""
    if hasattr(a, "detach"):
        import torch

        return a[torch.as_tensor(idx, device=a.device)]
    return np.asarray(a)[idx]
