"""HybridMoE: the one MoE layer, split between GPU slots (hot experts) and the CPU (cold experts).

Legend: T tokens, E experts, K top-k, H hidden, I intermediate, S GPU slots.

Data flow of ``forward`` with CUDA tensors (no host synchronisation, CUDA-graph capturable):

    x, ids, w (GPU) --D2H on the stream--> pinned buffers --stream writes "start"--> CPU pool
    GPU: the hot experts (kt's Triton fused MoE, or the caller's own GPU method) run meanwhile
    stream waits for "done" --H2D of the CPU result--> out = gpu_out + cpu_out (+ deferred)

The CPU pool's job is published before the stream reaches "start" and its threads wait for the
flag inside it (``kt.layer._stream_bridge``, ``CPUMoE.submit_gated``). On CPU tensors the same
steps run as a pool job and a wait.

Pieces, each in its own module: deferred experts (``_deferral``), layer-wise GPU prefill
(``_prefill``), GPU expert weights made from the CPU's packed copy (``_gpu_weights``), the stream
bridge, decode graphs (eager T <= ``graph_max_tokens`` calls replayed from CUDA graphs the layer
captures itself, ``_decode_graphs``), and dynamic re-placement (``_replacement``).

Adapters use the layer in one of two ways:
- ``gpu_experts="kt"`` (the default): the layer holds the hot experts itself, as bf16 or int8
  weights unpacked from the CPU's packed copy (an expert computes with the same quantised values
  wherever it runs), and computes them with kt's Triton kernels.
- ``gpu_experts="external"``: the caller computes the hot experts (SGLang's own GPU method, or
  kt-kernel-style callers of ``KTMoEWrapper``); the layer skips them on the CPU. ``forward`` then
  takes ``gpu=`` (a callable giving the hot experts' output), or the caller uses ``submit`` and
  ``finish`` around its own GPU work.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from ._deferral import CpuPending, DeferredChain, StreamPending, split_deferred

__all__ = ["HybridMoE"]

GPU_EXPERTS = ("kt", "external")


def _ignore(*args) -> None:
    return None


@dataclass
class _Stats:
    calls: int = 0
    paths: dict = field(default_factory=lambda: {"hybrid": 0, "gpu_prefill": 0, "cpu_only": 0})
    last_path: str = ""


@dataclass(frozen=True)
class _Route:
    """One placement, as the forward reads it (swapped whole by ``update_placement``)."""
    row: np.ndarray               # [E] GPU slot or -1
    mask: np.ndarray | None       # [E] bool, the experts the CPU skips; None when it skips none
    all_gpu: bool                 # no expert on the CPU
    gpu: dict | None              # kt's own GPU expert weights (gpu_experts="kt"), or None
    cpu_expert: torch.Tensor      # [E] bool on the CPU: True = computed on the CPU
    cpu_expert_dev: torch.Tensor | None  # the same on the layer's device


@dataclass
class Call:
    """The CPU part of one call in flight (``HybridMoE.submit``); ``HybridMoE.finish`` ends it."""
    x: torch.Tensor
    ids_later: torch.Tensor | None
    topk_weights: torch.Tensor
    mask: np.ndarray | None
    handle: object = None          # a CPUMoE handle (CPU tensors) or a bridge job (CUDA)
    t0: float = 0.0
    done: bool = False


class HybridMoE:
    """One MoE layer: hot experts on GPU slots, cold experts on the CPU, computed in parallel.

    cpu_moe: a ``kt.CPUMoE`` holding every expert (the authoritative copy; GPU experts are skipped).
    gpu_slot: [E] int, the GPU slot of each expert or -1 (a row of ``Placement.gpu_slot``); None or
      all -1 means all experts on the CPU.
    device: the CUDA device for the hot experts and the stream-ordered CPU part (None: no GPU;
      only all-CPU placements then, unless ``gpu_experts="external"``).
    gpu_dtype: "bf16" or "int8" (weight-only, per-row scales; needs the INT8 CPU scheme).
    gpu_experts: "kt" (the layer computes the hot experts) or "external" (the caller does; see the
      module doc).
    max_deferred_experts_per_token / chain / is_last_layer: deferral (``kt.layer._deferral``).
    gpu_prefill_token_threshold: None (off), an int, or "auto" (``kt.layer._prefill``).
    graph_max_tokens: eager CUDA calls with at most this many tokens are replayed from CUDA graphs
      the layer captures itself (bit-identical; on the H200 machine a T=1 call's host time fell
      from 0.46-0.48 to 0.21-0.23 ms at 25 % on the GPU, ``benchmarks/bench_hybrid.py``); 0 =
      always eager. Not used with deferral, with external GPU experts or inside the caller's own
      capture.
    """

    def __init__(self, cpu_moe, gpu_slot=None, *, device=None, gpu_dtype: str = "bf16",
                 gpu_experts: str = "kt", max_deferred_experts_per_token: int = 0,
                 chain: DeferredChain | None = None, is_last_layer: bool = False,
                 gpu_prefill_token_threshold=None, layer_idx: int = 0, graph_max_tokens: int = 8):
        from ._decode_graphs import DecodeGraphs
        from ._prefill import GpuPrefill, check_threshold

        self.graphs = DecodeGraphs(graph_max_tokens)
        self.cpu = cpu_moe
        self.num_experts = int(cpu_moe.num_experts)
        self.hidden = int(cpu_moe.hidden)
        self.intermediate = int(cpu_moe.intermediate)
        self.layer_idx = layer_idx
        if gpu_experts not in GPU_EXPERTS:
            raise ValueError(f"HybridMoE: gpu_experts must be one of {GPU_EXPERTS}, got {gpu_experts!r}")
        self.external = gpu_experts == "external"
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type != "cuda":
            raise ValueError(f"HybridMoE: device must be a CUDA device or None, got {self.device}")
        if self.device is not None and not torch.cuda.is_available():
            raise RuntimeError("HybridMoE: a CUDA device was given but torch sees no CUDA GPU")
        if self.device is not None and getattr(cpu_moe, "owns_default_pool", False):
            from ._pools import layer_pool

            cpu_moe.use_pool(layer_pool(gpu=True))
        self.gpu_dtype = gpu_dtype
        d = int(max_deferred_experts_per_token or 0)
        if d < 0:
            raise ValueError(f"max_deferred_experts_per_token must be >= 0, got {d}")
        self.max_deferred = 0 if is_last_layer else d
        self.chain = chain if chain is not None else (DeferredChain() if d else None)
        self.is_last_layer = is_last_layer
        check_threshold(gpu_prefill_token_threshold)
        if gpu_prefill_token_threshold is not None and self.device is None:
            raise ValueError("layer-wise GPU prefill needs a CUDA device")
        self.prefill = (GpuPrefill(cpu_moe, self.device, gpu_prefill_token_threshold)
                        if self.device is not None else None)
        self.stats = _Stats()
        self._lock = threading.Lock()  # forward vs update_placement
        self._bridge = None
        self._streams_seen: set = set()
        self.observer = None  # e.g. a DynamicPlacer: observer.observe(layer_idx, topk_ids, weights)
        self.after_forward = None  # callable run after each forward (DynamicReplacement)
        self._route: _Route
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
        if len(used) and self.device is None and not self.external:
            raise ValueError(f"HybridMoE: {len(used)} experts are placed on the GPU but no CUDA device "
                             "was given (pass device='cuda', or an all-CPU placement)")
        return row

    def _gpu_weights(self, row: np.ndarray) -> dict | None:
        """kt's own GPU experts for ``row`` (None: none placed, or they are the caller's)."""
        if self.external or not (row >= 0).any():
            return None
        from ._gpu_weights import expert_weights

        on_gpu = np.nonzero(row >= 0)[0]
        experts = on_gpu[np.argsort(row[on_gpu])]  # slot order
        w13, w2, s13, s2 = expert_weights(self.cpu, experts, self.device, self.gpu_dtype)
        return dict(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2,
                    e2s=torch.from_numpy(row.astype(np.int32)).to(self.device))

    def _set_placement(self, gpu_slot) -> None:
        row = self._validated_slots(gpu_slot)
        self._apply(row, self._gpu_weights(row))

    def _apply(self, row: np.ndarray, gpu: dict | None) -> None:
        mask = row >= 0
        cpu_expert = torch.from_numpy(~mask)
        dev = cpu_expert.to(self.device) if self.device is not None else None
        route = _Route(row, mask if mask.any() else None, bool(mask.all()), gpu, cpu_expert, dev)
        with self._lock:
            self._route = route

    def update_placement(self, gpu_slot) -> None:
        """Switch to a new placement row. kt's GPU weights are built first on a side stream
        (forwards keep using the old ones meanwhile) and swapped in under a lock, so no forward
        ever sees a half-written slot. Safe to call from another thread while forwards run. The
        CPU keeps every expert, so nothing is copied back. With external GPU experts only the
        split changes (the caller has moved its weights). CUDA graphs captured before an update
        keep the old placement: capture again after updating."""
        row = self._validated_slots(gpu_slot)
        gpu = None
        if not self.external and (row >= 0).any():
            side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(side):
                gpu = self._gpu_weights(row)
            side.synchronize()  # the new slots are complete before anyone can see them
            # the allocator must not hand these blocks to the side stream while forward
            # streams still read them
            for t in gpu.values():
                if t is not None:
                    for st in list(self._streams_seen):
                        t.record_stream(st)
        self._apply(row, gpu)

    @property
    def gpu_slot(self) -> np.ndarray:
        return self._route.row

    @property
    def gpu_mask(self) -> np.ndarray:
        return self._route.row >= 0

    @property
    def num_gpu_experts(self) -> int:
        return int((self._route.row >= 0).sum())

    # -- layer-wise prefill settings (kt.layer._prefill) ----------------------------------------
    @property
    def prefill_threshold(self):
        return None if self.prefill is None else self.prefill.threshold

    @prefill_threshold.setter
    def prefill_threshold(self, value) -> None:
        from ._prefill import check_threshold

        if value is not None and self.prefill is None:
            raise ValueError("layer-wise GPU prefill needs a CUDA device")
        if self.prefill is not None:
            self.prefill.threshold = check_threshold(value)

    def prefill_threshold_tokens(self, k: int) -> int | None:
        return None if self.prefill is None else self.prefill.threshold_tokens(k)

    @property
    def cost(self):
        """The layer-wise prefill cost model (``PrefillCostModel``; needs a device)."""
        if self.prefill is None:
            raise AttributeError("HybridMoE: a layer without a CUDA device has no prefill cost model")
        return self.prefill.cost

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
        elif self._route.mask is not None and not self.external:
            raise ValueError("HybridMoE: CPU inputs, but some experts are placed on the GPU; pass CUDA "
                             "tensors (or use an all-CPU placement)")

    def _begin(self, x, topk_ids, topk_weights) -> _Route:
        """What every call does first: check, read the placement, count, report routing."""
        self._check(x, topk_ids, topk_weights)
        with self._lock:
            route = self._route
        self.stats.calls += 1
        if self.observer is not None:
            self.observer.observe(self.layer_idx, topk_ids, topk_weights)
        if x.is_cuda:
            st = torch.cuda.current_stream(x.device)
            if st not in self._streams_seen:
                self._streams_seen.add(st)
        return route

    def _end_call(self, path: str) -> None:
        self.stats.paths[path] += 1
        self.stats.last_path = path
        if self.after_forward is not None:
            self.after_forward()

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                gpu=None) -> torch.Tensor:
        """x [T, H]; topk_ids [T, K] (-1 = skip); topk_weights [T, K] -> out [T, H] in x's dtype.

        gpu: with ``gpu_experts="external"``, a callable () -> the hot experts' output [T, H] (or
        None: the caller adds it itself); it runs while the CPU part computes."""
        if gpu is not None and not self.external:
            raise ValueError("HybridMoE: gpu= is for layers built with gpu_experts='external'")
        route = self._begin(x, topk_ids, topk_weights)
        if not x.is_cuda:
            path = "cpu_only"
            out = self._run(x, topk_ids, topk_weights, route, gpu)
        elif self.prefill is not None and self.prefill.wanted(x.shape[0], topk_ids.shape[1]):
            path = "gpu_prefill"
            out = self._add_pending(self.prefill.forward(self, x, topk_ids, topk_weights))
        else:
            path = "hybrid"
            if gpu is None and not self.external and self.graphs.wanted(x, self.chain is not None):
                out = self.graphs.run(
                    lambda: (route.gpu, route.mask) + self._bridge_buffers(),
                    lambda a, b, c: self._run(a, b, c, route, None), x, topk_ids, topk_weights)
            else:
                out = self._run(x, topk_ids, topk_weights, route, gpu)
        self._end_call(path)
        return out

    __call__ = forward

    def submit(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> Call:
        """Start this call's CPU part (the caller computes the GPU part meanwhile, then calls
        ``finish``). Stream-ordered on the current CUDA stream for CUDA tensors."""
        route = self._begin(x, topk_ids, topk_weights)
        return self._start(x, topk_ids, topk_weights, route)

    def finish(self, call: Call, gpu_out: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for a ``submit``ted call: its CPU part (waited for; on CUDA the
        stream waits), plus ``gpu_out``, plus the previous layer's deferred part."""
        if call.done:
            raise RuntimeError("HybridMoE.finish: this call was finished already")
        out = self._end(call, gpu_out)
        self._end_call("cpu_only" if not call.x.is_cuda else "hybrid")
        return out

    def _run(self, x, topk_ids, topk_weights, route: _Route, gpu) -> torch.Tensor:
        call = self._start(x, topk_ids, topk_weights, route)
        gpu_out = gpu() if gpu is not None else self._kt_gpu(route, x, topk_ids, topk_weights)
        return self._end(call, gpu_out)

    @staticmethod
    def _kt_gpu(route: _Route, x, topk_ids, topk_weights):
        g = route.gpu
        if g is None:
            return None
        from ..gpu_ops import fused_moe

        return fused_moe(x, topk_ids, topk_weights, g["e2s"], g["w13"], g["w2"],
                         w13_scale=g["w13_scale"], w2_scale=g["w2_scale"])

    def _start(self, x, topk_ids, topk_weights, route: _Route) -> Call:
        call = Call(x, None, topk_weights, route.mask)
        if route.all_gpu:  # no CPU part (and nothing to defer)
            return call
        if self.max_deferred:
            cpu_expert = route.cpu_expert_dev if x.is_cuda else route.cpu_expert
            ids_now, call.ids_later = split_deferred(topk_ids, topk_weights, cpu_expert, self.max_deferred)
        else:  # (split_deferred would also build an unused all -1 tensor: one more launch)
            ids_now = topk_ids
        if x.is_cuda:
            call.handle = self._get_bridge().start(x, ids_now, topk_weights, route.mask)
        else:
            call.t0 = time.perf_counter()
            call.handle = self.cpu.submit(x, ids_now, topk_weights, gpu_mask=route.mask)
        return call

    def _end(self, call: Call, gpu_out) -> torch.Tensor:
        call.done = True
        x = call.x
        cpu_out = None
        if call.handle is not None:
            if x.is_cuda:
                cpu_out = self._bridge.finish(call.handle)  # stream waits for "done", then H2D
            else:
                cpu_out = call.handle.wait()
                if self.prefill is not None:
                    self.prefill.observe_cpu(x.shape[0], call.topk_weights.shape[1],
                                             time.perf_counter() - call.t0)
        if cpu_out is None:
            out = gpu_out if gpu_out is not None else torch.zeros_like(x)
        else:
            out = cpu_out if gpu_out is None else gpu_out + cpu_out.to(gpu_out.dtype)
        out = self._add_pending(out)
        if call.ids_later is not None and self.chain is not None:
            if x.is_cuda:
                later = self._bridge.start(x, call.ids_later, call.topk_weights, call.mask,
                                           slot="deferred")
                self.chain.put(StreamPending(self._bridge, later))
            else:
                self.chain.put(CpuPending(self.cpu.submit(x, call.ids_later, call.topk_weights,
                                                          gpu_mask=call.mask)))
        return out

    def _add_pending(self, out: torch.Tensor) -> torch.Tensor:
        """Add the previous layer's deferred contribution (computed meanwhile on the CPU)."""
        if self.chain is None:
            return out
        pending = self.chain.take()
        if pending is None:
            return out
        return pending.add_into(out)

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
        if t * k >= 64 and self.prefill is not None:
            self.prefill.observe_cpu(t, k, seconds)

    # -- construction helpers ---------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, gate, up, down, gpu_slot=None, *, scheme="int8", group_size: int = 64,
                     pool=None, activations: str = "int8", **kwargs) -> "HybridMoE":
        """gate/up [E, I, H], down [E, H, I]; activations: the CPU experts' ("int8" or
        "int8x2", see ``CPUMoE``); see the class doc for the other arguments."""
        from ..cpu_ops.moe import CPUMoE

        cpu = CPUMoE.from_tensors(gate, up, down, scheme=scheme, group_size=group_size, pool=pool,
                                  activations=activations)
        return cls(cpu, gpu_slot, **kwargs)
