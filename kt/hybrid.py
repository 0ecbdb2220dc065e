"""HybridMoE: one MoE layer split between GPU slots (hot experts) and the CPU (cold experts).

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, S GPU slots.

Data flow of ``forward`` with CUDA tensors (no host synchronisation, CUDA-graph capturable):

    x, ids, w (GPU) --D2H on the stream--> pinned buffers --stream writes "start"--> CPU pool
    GPU: Triton fused MoE over the hot experts (runs while the CPU computes the cold ones)
    stream waits for "done" --H2D of the CPU result--> out = gpu_out + cpu_out (+ deferred)

The CPU pool's job is published before the stream reaches "start" and its threads wait for the
flag inside it (``kt._stream_bridge``, ``CPUMoE.submit_gated``).

Eager decode-sized calls (T <= ``graph_max_tokens``) replay a CUDA graph of the same forward that
the layer captured itself (``kt._decode_graphs``): same kernels, same output bits, none of the
eager path's host Python.

Deferred experts (``max_deferred_experts_per_token = d``): for each token, its d lowest-weight
CPU experts are not waited for in this layer; they are computed while the next layer runs and
their contribution is added to the *next* layer's MoE output. This changes the model's math (the
deferred part skips the next layer's attention and router input); the last layer defers nothing.

Layer-wise GPU prefill: for batches of at least ``gpu_prefill_token_threshold`` tokens, all of the
layer's CPU experts are copied to the GPU and computed there, through two staging buffers on a
copy stream: the next layer's experts are copied while this one computes (``LayerStaging``).
``"auto"`` picks the threshold from a cost model (see ``PrefillCostModel``).
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import QuantScheme

__all__ = ["HybridMoE", "DeferredChain", "DynamicReplacement", "split_deferred", "PrefillCostModel"]


# ----------------------------------------------------------------------------- routing helpers

def _ignore(*args) -> None:
    return None


def split_deferred(topk_ids: torch.Tensor, topk_weights: torch.Tensor, cpu_expert: torch.Tensor,
                   d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split routing into (now, later): each token's d lowest-weight CPU experts go to later.

    topk_ids [T, K] (-1 = skip), topk_weights [T, K], cpu_expert [E] bool (True = on the CPU).
    Returns two [T, K] id tensors with -1 where a slot belongs to the other part. Ties break by
    slot position (stable). Runs on the ids' device with no host synchronisation.
    """
    if d <= 0:
        return topk_ids, torch.full_like(topk_ids, -1)
    k = topk_ids.shape[1]
    valid = topk_ids >= 0
    on_cpu = valid & cpu_expert[topk_ids.clamp(min=0)]
    key = torch.where(on_cpu, topk_weights.float(), torch.full_like(topk_weights, float("inf"),
                                                                    dtype=torch.float32))
    order = torch.argsort(key, dim=1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(k, device=order.device).expand_as(order).contiguous())
    later = on_cpu & (rank < d)
    minus = torch.full_like(topk_ids, -1)
    return torch.where(later, minus, topk_ids), torch.where(later, topk_ids, minus)


class DeferredChain:
    """Carries the deferred CPU work of one layer into the next layer's output.

    One chain is shared by the MoE layers of a model, in forward order. A layer ``take()``s the
    pending work of the previous layer (to add it to its own output) and may ``put()`` its own.
    """

    def __init__(self):
        self._pending = None
        self._lock = threading.Lock()

    def put(self, pending) -> None:
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("DeferredChain: the previous layer's deferred work was never taken")
            self._pending = pending

    def take(self):
        with self._lock:
            p, self._pending = self._pending, None
            return p

    def reset(self) -> None:
        """Drop pending work (e.g. at the start of a new forward pass after an error)."""
        p = self.take()
        if p is not None:
            p.wait()


# ----------------------------------------------------------------------------- layer-wise prefill

@dataclass
class PrefillCostModel:
    """When is copying a layer's CPU experts to the GPU faster than computing them on the CPU?

    CPU time for T tokens:  max(bytes of the experts touched / cpu_bytes_per_s,
                                2 * 3 * H * I * T * K / cpu_flops)
    GPU path:               gpu_overhead * layer_bytes / h2d_bytes_per_s
                            + 2 * 3 * H * I * T * K / gpu_flops
    The threshold is the smallest power of two T where the GPU path wins.

    Calibration: the H2D rate is measured once (page-locked, 64 MiB); ``cpu_flops`` and
    ``cpu_bytes_per_s`` follow the CPU part of earlier calls (an exponential average: prefill-sized
    calls inform the compute rate, decode-sized ones the bandwidth). ``gpu_overhead`` covers the
    unpacking on the GPU and the launches: 12.7 ms for a 604 MB qwen3-30b-a3b INT8 layer against
    11.4 ms of pure transfer on the H200 with the double-buffered staging (session 4,
    benchmarks/results/hybrid_s4_run8_prefill.json; 15.1 ms before it, hybrid_run3_prefill.json).
    The defaults are that machine's 15-thread CPU figures (INT8, T=4096: 59 ms).
    """

    h2d_bytes_per_s: float = 25e9
    cpu_bytes_per_s: float = 100e9
    cpu_flops: float = 5e12
    gpu_flops: float = 300e12
    gpu_overhead: float = 1.15
    observations: int = 0

    def cpu_seconds(self, t: int, k: int, e: int, h: int, i: int, bytes_per_expert: float) -> float:
        touched = e * (1.0 - (1.0 - 1.0 / e) ** (t * k))  # expected distinct experts hit
        return max(touched * bytes_per_expert / self.cpu_bytes_per_s, 6.0 * h * i * t * k / self.cpu_flops)

    def gpu_seconds(self, t: int, k: int, e: int, h: int, i: int, bytes_per_expert: float) -> float:
        return (self.gpu_overhead * e * bytes_per_expert / self.h2d_bytes_per_s
                + 6.0 * h * i * t * k / self.gpu_flops)

    def threshold(self, k: int, e: int, h: int, i: int, bytes_per_expert: float) -> int:
        t = 1
        while t < (1 << 20):
            if self.gpu_seconds(t, k, e, h, i, bytes_per_expert) < self.cpu_seconds(
                    t, k, e, h, i, bytes_per_expert):
                return t
            t *= 2
        return 1 << 20

    def observe_cpu(self, t: int, k: int, h: int, i: int, seconds: float,
                    bytes_touched: float | None = None) -> None:
        """Fold one measured CPU call into the rates."""
        if seconds <= 0:
            return
        if t * k < 64:  # decode-sized: a bandwidth measurement
            if bytes_touched:
                rate = bytes_touched / seconds
                self.cpu_bytes_per_s = 0.7 * self.cpu_bytes_per_s + 0.3 * rate
            return
        rate = 6.0 * h * i * t * k / seconds
        self.cpu_flops = rate if self.observations == 0 else 0.7 * self.cpu_flops + 0.3 * rate
        self.observations += 1


def measure_h2d(device, nbytes: int = 64 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - t0)


# ----------------------------------------------------------------------------- the layer

_hybrid_pool = None
_hybrid_pool_lock = threading.Lock()


def hybrid_default_pool():
    """The CPU pool HybridMoE layers use when their CPUMoE was given none.

    It leaves two of the process's CPUs free: one for the thread that launches GPU work and one
    for the stream service thread, which joins the pool's jobs as a worker. Measured on the H200's
    16 cores: with 15 pool threads a T=1 hybrid layer took 4.8 ms (threads preempting each other),
    with 14 it took 0.57 ms. KT_NUM_THREADS overrides the count.
    """
    global _hybrid_pool
    import os

    from .config import get_config
    from .cpu_ops.runtime.pool import CpuPool

    with _hybrid_pool_lock:
        if _hybrid_pool is None or _hybrid_pool.closed:
            n = get_config().num_threads or max(1, len(os.sched_getaffinity(0)) - 2)
            _hybrid_pool = CpuPool(n)
        return _hybrid_pool


@dataclass
class _Stats:
    calls: int = 0
    paths: dict = field(default_factory=lambda: {"hybrid": 0, "gpu_prefill": 0, "cpu_only": 0})
    last_path: str = ""


class HybridMoE:
    """One MoE layer: hot experts on GPU slots, cold experts on the CPU, computed in parallel.

    cpu_moe: a ``kt.CPUMoE`` holding every expert (the authoritative copy; GPU experts are skipped).
    gpu_slot: [E] int, the GPU slot of each expert or -1 (a row of ``Placement.gpu_slot``); None or
      all -1 means all experts on the CPU.
    device: the CUDA device for the hot experts (None: no GPU; only all-CPU placements then).
    gpu_dtype: "bf16" or "int8" (weight-only, per-row scales; needs the INT8 CPU scheme).
    max_deferred_experts_per_token / chain / is_last_layer: deferral (see module doc).
    gpu_prefill_token_threshold: None (off), an int, or "auto".
    graph_max_tokens: eager CUDA calls with at most this many tokens are replayed from CUDA graphs
      the layer captures itself (``kt._decode_graphs``; bit-identical; on the H200 machine a T=1
      call's host time fell from 0.46-0.48 to 0.21-0.23 ms at 25 % on the GPU); 0 = always eager. Not
      used with deferral or inside the caller's own capture.
    """

    def __init__(self, cpu_moe, gpu_slot=None, *, device=None, gpu_dtype: str = "bf16",
                 max_deferred_experts_per_token: int = 0, chain: DeferredChain | None = None,
                 is_last_layer: bool = False, gpu_prefill_token_threshold=None, layer_idx: int = 0,
                 graph_max_tokens: int = 8):
        from ._decode_graphs import DecodeGraphs

        self.graphs = DecodeGraphs(graph_max_tokens)
        self.cpu = cpu_moe
        self.num_experts = int(cpu_moe.num_experts)
        self.hidden = int(cpu_moe.hidden)
        self.intermediate = int(cpu_moe.intermediate)
        self.layer_idx = layer_idx
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type != "cuda":
            raise ValueError(f"HybridMoE: device must be a CUDA device or None, got {self.device}")
        if self.device is not None and not torch.cuda.is_available():
            raise RuntimeError("HybridMoE: a CUDA device was given but torch sees no CUDA GPU")
        if self.device is not None and getattr(cpu_moe, "owns_default_pool", False):
            cpu_moe.use_pool(hybrid_default_pool())
        self.gpu_dtype = gpu_dtype
        d = int(max_deferred_experts_per_token or 0)
        if d < 0:
            raise ValueError(f"max_deferred_experts_per_token must be >= 0, got {d}")
        self.max_deferred = 0 if is_last_layer else d
        self.chain = chain if chain is not None else (DeferredChain() if d else None)
        self.is_last_layer = is_last_layer
        if gpu_prefill_token_threshold not in (None, "auto") and (
                not isinstance(gpu_prefill_token_threshold, int) or gpu_prefill_token_threshold < 1):
            raise ValueError("gpu_prefill_token_threshold must be None, 'auto' or a positive int, "
                             f"got {gpu_prefill_token_threshold!r}")
        if gpu_prefill_token_threshold is not None and self.device is None:
            raise ValueError("layer-wise GPU prefill needs a CUDA device")
        self.prefill_threshold = gpu_prefill_token_threshold
        self.cost = PrefillCostModel()
        self._measured_h2d = False
        self.stats = _Stats()
        self._lock = threading.Lock()  # forward vs update_placement
        self._bridge = None
        self._streams_seen: set = set()
        self._pinned = False  # CPU expert memory page-locked for layer-wise prefill
        self._all_slots = None
        self.observer = None  # e.g. a DynamicPlacer: observer.observe(layer_idx, topk_ids, weights)
        self.after_forward = None  # callable run after each forward (DynamicReplacement)
        self._set_placement(gpu_slot)

    # -- placement ---------------------------------------------------------------------------
    def _validated_slots(self, gpu_slot) -> np.ndarray:
        e = self.num_experts
        if gpu_slot is None:
            return np.full(e, -1, np.int64)
        if isinstance(gpu_slot, torch.Tensor):
            gpu_slot = gpu_slot.detach().cpu().numpy()
        row = np.asarray(gpu_slot)
        if row.shape != (e,) or not np.issubdtype(row.dtype, np.integer):
            raise ValueError(f"HybridMoE: gpu_slot must be an integer [E={e}] row, got shape "
                             f"{row.shape} dtype {row.dtype}")
        row = row.astype(np.int64)
        used = row[row >= 0]
        if (row < -1).any() or len(np.unique(used)) != len(used) or (used >= max(len(used), 1)).any():
            raise ValueError("HybridMoE: gpu_slot values must be -1 or distinct slots 0..S-1, got "
                             f"{row.tolist()}")
        if len(used) and self.device is None:
            raise ValueError(f"HybridMoE: {len(used)} experts are placed on the GPU but no CUDA device "
                             "was given (pass device='cuda', or an all-CPU placement)")
        return row

    def _build_gpu_weights(self, row: np.ndarray):
        from ._gpu_weights import packed_to_device

        on_gpu = np.nonzero(row >= 0)[0]
        experts = on_gpu[np.argsort(row[on_gpu])]  # slot order
        w13, s13 = packed_to_device(self.cpu.w13, experts, self.device, self.gpu_dtype)
        w2, s2 = packed_to_device(self.cpu.w2, experts, self.device, self.gpu_dtype)
        i, off = self.intermediate, int(getattr(self.cpu, "up_offset", self.intermediate))
        if off != i:  # gate rows [0, I), up rows [off, off + I): drop the padding between them
            w13 = torch.cat([w13[:, :i], w13[:, off:off + i]], dim=1).contiguous()
            if s13 is not None:
                s13 = torch.cat([s13[:, :i], s13[:, off:off + i]], dim=1).contiguous()
        return w13, w2, s13, s2

    def _set_placement(self, gpu_slot) -> None:
        row = self._validated_slots(gpu_slot)
        gpu = None
        if (row >= 0).any():
            w13, w2, s13, s2 = self._build_gpu_weights(row)
            gpu = dict(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
                       e2s=torch.from_numpy(row.astype(np.int32)).to(self.device))
        self._apply(row, gpu)

    def _apply(self, row, gpu) -> None:
        with self._lock:
            self.gpu_slot = row
            self.gpu_mask = row >= 0
            # what the CPU part is called with: None when no expert is on the GPU
            self._mask_arg = self.gpu_mask if self.gpu_mask.any() else None
            self._all_gpu = bool(self.gpu_mask.all())
            self._gpu = gpu
            if self.device is not None:
                self._cpu_expert_dev = torch.from_numpy(~self.gpu_mask).to(self.device)
            self._cpu_expert = torch.from_numpy(~self.gpu_mask)

    def update_placement(self, gpu_slot) -> None:
        """Switch to a new placement row. The new GPU weights are built first on a side stream
        (forwards keep using the old ones meanwhile) and swapped in under a lock, so no forward
        ever sees a half-written slot. Safe to call from another thread while forwards run. The
        CPU keeps every expert, so nothing is copied back. CUDA graphs captured before an update
        keep the old placement: capture again after updating."""
        row = self._validated_slots(gpu_slot)
        gpu = None
        if (row >= 0).any():
            side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(side):
                w13, w2, s13, s2 = self._build_gpu_weights(row)
                e2s = torch.from_numpy(row.astype(np.int32)).to(self.device)
            side.synchronize()  # the new slots are complete before anyone can see them
            gpu = dict(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, e2s=e2s)
            # the allocator must not hand these blocks to the side stream while forward
            # streams still read them
            for t in gpu.values():
                if t is not None:
                    for st in list(self._streams_seen):
                        t.record_stream(st)
        self._apply(row, gpu)

    @property
    def num_gpu_experts(self) -> int:
        return int(self.gpu_mask.sum())

    # -- forward -------------------------------------------------------------------------------
    def _check(self, x, topk_ids, topk_weights):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"HybridMoE: x must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"HybridMoE: x must be [T, H={self.hidden}], got {tuple(x.shape)}")
        for name, v in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"HybridMoE: {name} must be a torch.Tensor")
            if v.device != x.device:
                raise ValueError(f"HybridMoE: {name} is on {v.device} but x is on {x.device}")
        if topk_ids.shape != topk_weights.shape or topk_ids.ndim != 2 or topk_ids.shape[0] != x.shape[0]:
            raise ValueError(f"HybridMoE: topk_ids {tuple(topk_ids.shape)} and topk_weights "
                             f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, K]")
        if x.device.type == "cuda":
            if self.device is None:
                raise ValueError("HybridMoE: CUDA inputs but the layer was built without a device")
            if x.device != self.device and not (self.device.index is None and x.device.index ==
                                                torch.cuda.current_device()):
                raise ValueError(f"HybridMoE: x is on {x.device}, the layer's GPU experts on {self.device}")
        elif self.gpu_mask.any():
            raise ValueError("HybridMoE: CPU inputs, but some experts are placed on the GPU; pass CUDA "
                             "tensors (or use an all-CPU placement)")

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_ids [T, K] (-1 = skip); topk_weights [T, K] -> out [T, H] in x's dtype."""
        self._check(x, topk_ids, topk_weights)
        with self._lock:
            gpu, cpu_expert = self._gpu, (self._cpu_expert_dev if x.device.type == "cuda"
                                          else self._cpu_expert)
            mask = self._mask_arg
            all_gpu = self._all_gpu
        self.stats.calls += 1
        if self.observer is not None:
            self.observer.observe(self.layer_idx, topk_ids, topk_weights)
        t = x.shape[0]
        if x.device.type == "cuda":
            st = torch.cuda.current_stream(x.device)
            if st not in self._streams_seen:
                self._streams_seen.add(st)
        if x.device.type != "cuda":
            path = "cpu_only"
            out = self._forward_cpu(x, topk_ids, topk_weights, cpu_expert, mask)
        elif self._use_gpu_prefill(t, topk_ids.shape[1]):
            path = "gpu_prefill"
            out = self._forward_gpu_prefill(x, topk_ids, topk_weights)
        else:
            path = "hybrid"
            if self.graphs.wanted(x, self.chain is not None):
                out = self.graphs.run(
                    lambda: (gpu, mask) + self._bridge_buffers(),
                    lambda a, b, c: self._forward_hybrid(a, b, c, gpu, cpu_expert, mask, all_gpu),
                    x, topk_ids, topk_weights)
            else:
                out = self._forward_hybrid(x, topk_ids, topk_weights, gpu, cpu_expert, mask, all_gpu)
        self.stats.paths[path] += 1
        self.stats.last_path = path
        if self.after_forward is not None:
            self.after_forward()
        return out

    __call__ = forward

    def _add_pending(self, out: torch.Tensor) -> torch.Tensor:
        """Add the previous layer's deferred contribution (computed meanwhile on the CPU)."""
        if self.chain is None:
            return out
        pending = self.chain.take()
        if pending is None:
            return out
        return pending.add_into(out)

    def _forward_cpu(self, x, topk_ids, topk_weights, cpu_expert, mask):
        """mask: the GPU experts to skip, or None."""
        ids_now, ids_later = split_deferred(topk_ids, topk_weights, cpu_expert, self.max_deferred)
        t0 = time.perf_counter()
        out = self.cpu(x, ids_now, topk_weights, gpu_mask=mask)
        self.cost.observe_cpu(x.shape[0], topk_ids.shape[1], self.hidden, self.intermediate,
                              time.perf_counter() - t0)
        out = self._add_pending(out)
        if self.max_deferred and self.chain is not None:
            h = self.cpu.submit(x, ids_later, topk_weights, gpu_mask=mask)
            self.chain.put(_CpuPending(h))
        return out

    def _forward_hybrid(self, x, topk_ids, topk_weights, gpu, cpu_expert, mask, all_gpu):
        from .gpu_ops import fused_moe

        if gpu is None:  # every expert on the CPU: the CPU part is the whole layer
            return self._cuda_cpu_part(x, topk_ids, topk_weights, cpu_expert, mask, None)
        if all_gpu:  # every expert on the GPU: no CPU part (and nothing to defer)
            out = fused_moe(x, topk_ids, topk_weights, gpu["e2s"], gpu["w13"], gpu["w2"],
                            w13_scale=gpu["w13_scale"], w2_scale=gpu["w2_scale"])
            return self._add_pending(out)
        return self._cuda_cpu_part(x, topk_ids, topk_weights, cpu_expert, mask,
                                   lambda: fused_moe(x, topk_ids, topk_weights, gpu["e2s"], gpu["w13"],
                                                     gpu["w2"], w13_scale=gpu["w13_scale"],
                                                     w2_scale=gpu["w2_scale"]))

    def _cuda_cpu_part(self, x, topk_ids, topk_weights, cpu_expert, mask, gpu_fn):
        """Stream-ordered CPU part around the GPU work ``gpu_fn`` (see module doc); mask: the GPU
        experts to skip, or None."""
        bridge = self._get_bridge()
        if self.max_deferred:
            ids_now, ids_later = split_deferred(topk_ids, topk_weights, cpu_expert, self.max_deferred)
        else:  # (split_deferred would also build an unused all -1 tensor: one more launch)
            ids_now, ids_later = topk_ids, None
        job = bridge.start(x, ids_now, topk_weights, mask)  # D2H + "start" on the stream
        gpu_out = gpu_fn() if gpu_fn is not None else None
        cpu_out = bridge.finish(job)  # stream waits for "done", then H2D
        out = cpu_out if gpu_out is None else gpu_out + cpu_out
        out = self._add_pending(out)
        if self.max_deferred and self.chain is not None:
            later = bridge.start(x, ids_later, topk_weights, mask, slot="deferred")
            self.chain.put(_StreamPending(bridge, later))
        return out

    def _bridge_buffers(self) -> tuple:
        """The pinned buffers a captured forward reads and writes (reallocated for larger calls)."""
        ch = self._bridge.channels["now"] if self._bridge is not None else None
        return (None, None) if ch is None else (ch.h_x, ch.d_out)

    def _get_bridge(self):
        if self._bridge is None:
            from ._stream_bridge import StreamBridge

            self._bridge = StreamBridge(self.cpu, self.device)
            # a weak reference: the bridge must not keep the layer (and its pinned buffers) in a
            # reference cycle that only the garbage collector frees, at an unpredictable moment
            ref = weakref.WeakMethod(self._observe_cpu_job)
            self._bridge.on_cpu_time = lambda t, k, s: (ref() or _ignore)(t, k, s)
        return self._bridge

    def _observe_cpu_job(self, t: int, k: int, seconds: float) -> None:
        # runs in the stream service thread: the CPU part's own duration, no host sync needed
        if t * k >= 64:
            self.cost.observe_cpu(t, k, self.hidden, self.intermediate, seconds)

    # -- layer-wise prefill ----------------------------------------------------------------------
    def _bytes_per_expert(self) -> float:
        return (self.cpu.w13.nbytes + self.cpu.w2.nbytes) / self.num_experts

    def prefill_threshold_tokens(self, k: int) -> int | None:
        if self.prefill_threshold is None:
            return None
        if self.prefill_threshold != "auto":
            return int(self.prefill_threshold)
        if not self._measured_h2d:
            self.cost.h2d_bytes_per_s = measure_h2d(self.device)
            self._measured_h2d = True
        return self.cost.threshold(k, self.num_experts, self.hidden, self.intermediate,
                                   self._bytes_per_expert())

    def _use_gpu_prefill(self, t: int, k: int) -> bool:
        thr = self.prefill_threshold_tokens(k)
        return thr is not None and t >= thr

    def _forward_gpu_prefill(self, x, topk_ids, topk_weights):
        """Every expert on the GPU for this batch: the layer's packed experts are copied over as
        they are (from page-locked host memory, into double-buffered staging shared by all layers,
        on a copy stream), unpacked there, and all E experts run in one fused MoE. Meanwhile the
        next layer's experts (the one that followed this layer last time) are copied into the
        other buffer (``kt._gpu_weights.LayerStaging``)."""
        from ._gpu_weights import LayerStaging, unpack_on_device
        from .gpu_ops import fused_moe

        stage = LayerStaging.for_device(self.device)
        bufs = stage.acquire(self, self._prefill_arrays())
        dtype = "int8" if self.cpu.scheme is QuantScheme.INT8 else "bf16"
        w = {name: unpack_on_device(p, bufs[name], bufs.get(name + "_scale"), dtype)
             for name, p in (("w13", self.cpu.w13), ("w2", self.cpu.w2))}
        w13, s13 = w["w13"]
        w2, s2 = w["w2"]
        i, off = self.intermediate, int(getattr(self.cpu, "up_offset", self.intermediate))
        if off != i:
            w13 = torch.cat([w13[:, :i], w13[:, off:off + i]], dim=1)
            s13 = None if s13 is None else torch.cat([s13[:, :i], s13[:, off:off + i]], dim=1)
        if self._all_slots is None:
            self._all_slots = torch.arange(self.num_experts, dtype=torch.int32, device=self.device)
        out = fused_moe(x, topk_ids, topk_weights, self._all_slots, w13, w2,
                        w13_scale=s13, w2_scale=s2)
        stage.release()  # the staged bytes (or views of them) are read by now
        nxt = stage.successor(self)
        if isinstance(nxt, HybridMoE) and nxt.device == self.device:
            stage.prefetch(nxt, nxt._prefill_arrays())
        return self._add_pending(out)

    def _prefill_arrays(self) -> dict:
        """The packed expert arrays layer-wise prefill copies, page-locked at first use."""
        from ._gpu_weights import pin_host_array

        arrays = {}
        for name, p in (("w13", self.cpu.w13), ("w2", self.cpu.w2)):
            arrays[name] = p.data
            if p.scale.size:
                arrays[name + "_scale"] = p.scale
        if not self._pinned:
            self._pinned = True
            for a in arrays.values():
                pin_host_array(a)
        return arrays

    # -- construction helpers ---------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, gate, up, down, gpu_slot=None, *, scheme: QuantScheme | str = "int8",
                     group_size: int = 64, pool=None, activations: str = "int8",
                     **kwargs) -> "HybridMoE":
        """gate/up [E, I, H], down [E, H, I]; activations: the CPU experts' ("int8" or
        "int8x2", see ``CPUMoE``); see the class doc for the other arguments."""
        from .cpu_ops.moe import CPUMoE

        cpu = CPUMoE.from_tensors(gate, up, down, scheme=scheme, group_size=group_size, pool=pool,
                                  activations=activations)
        return cls(cpu, gpu_slot, **kwargs)


class _CpuPending:
    """Deferred work running in the CPU pool (CPU tensors)."""

    def __init__(self, handle):
        self.handle = handle

    def wait(self):
        return self.handle.wait()

    def add_into(self, out):
        return out + self.handle.wait()


class _StreamPending:
    """Deferred work ordered on the CUDA stream: the next layer's stream waits for it."""

    def __init__(self, bridge, job):
        self.bridge, self.job = bridge, job

    def wait(self):
        return self.bridge.finish(self.job)

    def add_into(self, out):
        return out + self.bridge.finish(self.job)


class DynamicReplacement:
    """Re-places experts while serving (decode included), driven by a ``kt.placement.DynamicPlacer``.

    Every layer reports its routing to the placer (``placer.observe``, a bincount on the device, no
    host sync); after each forward of the last layer the placer is polled (it reads its statistics
    once every ``every_n_tokens`` tokens). When it returns a new placement, the newly hot experts are
    copied into GPU slots in a background thread and each layer switches atomically
    (``HybridMoE.update_placement``); forwards go on meanwhile with the old placement.

    layers: the model's HybridMoE layers; layer i uses row ``layers[i].layer_idx`` of the placement.
    """

    def __init__(self, layers, placer, *, background: bool = True):
        if not layers:
            raise ValueError("DynamicReplacement needs at least one layer")
        self.layers = list(layers)
        self.placer = placer
        self.background = background
        self._thread: threading.Thread | None = None
        self.updates = 0
        self.errors: list[BaseException] = []
        for layer in self.layers:
            layer.observer = placer
        self.layers[-1].after_forward = self.step

    def step(self) -> bool:
        """Poll the policy; start an update if one is due. True when an update started."""
        if self._thread is not None and self._thread.is_alive():
            return False  # one update at a time; the policy keeps observing meanwhile
        new = self.placer.poll()
        if new is None:
            return False
        if self.background:
            self._thread = threading.Thread(target=self._apply, args=(new,), daemon=True,
                                            name="kt-replace")
            self._thread.start()
        else:
            self._apply(new)
        return True

    def _apply(self, placement) -> None:
        try:
            for layer in self.layers:
                layer.update_placement(placement.gpu_slot[layer.layer_idx])
            self.updates += 1
        except BaseException as exc:  # surfaced by wait()
            self.errors.append(exc)

    def wait(self) -> None:
        """Block until a running update has finished; re-raise its error, if any."""
        if self._thread is not None:
            self._thread.join()
        if self.errors:
            raise RuntimeError(f"expert re-placement failed: {self.errors[0]!r}") from self.errors[0]

    def detach(self) -> None:
        self.wait()
        for layer in self.layers:
            layer.observer = None
            layer.after_forward = None
