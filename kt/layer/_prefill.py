"""Layer-wise GPU prefill: for a large batch, every expert of the layer runs on the GPU.

For batches of at least the layer's threshold, all of the layer's experts (the CPU's packed copy,
hot experts included) are copied to the GPU and computed there, through two staging buffers on a
copy stream: the next layer's experts are copied while this one computes (``LayerStaging``).
``"auto"`` picks the threshold from a cost model (``PrefillCostModel``).

Legend: T tokens, E experts, K top-k, H hidden, I intermediate.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..config import QuantScheme

__all__ = ["PrefillCostModel", "measure_h2d", "GpuPrefill", "check_threshold"]


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
    11.4 ms of pure transfer on the H200 with the double-buffered staging
    (``benchmarks/bench_hybrid.py``). The defaults are that machine's 15-thread CPU figures (INT8,
    T=4096: 59 ms).
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
    """Host-to-device copy rate from page-locked memory, bytes/s (three 64 MiB copies)."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - t0)


def check_threshold(value):
    """None (off), "auto" or a positive int; anything else is a ValueError."""
    if value in (None, "auto"):
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("gpu_prefill_token_threshold must be None, 'auto' or a positive int, "
                         f"got {value!r}")
    return value


class GpuPrefill:
    """One layer's layer-wise prefill: when to take it, and the forward that takes it.

    cpu_moe: the layer's ``CPUMoE`` (its packed experts are what is copied); device: the GPU.
    """

    def __init__(self, cpu_moe, device, threshold):
        self.cpu = cpu_moe
        self.device = device
        self.threshold = check_threshold(threshold)
        self.cost = PrefillCostModel()
        self._measured_h2d = False
        self._pinned = False  # the packed experts page-locked (at first use)
        self._all_slots = None

    def bytes_per_expert(self) -> float:
        return (self.cpu.w13.nbytes + self.cpu.w2.nbytes) / self.cpu.num_experts

    def threshold_tokens(self, k: int) -> int | None:
        """The smallest T that takes the GPU path (None: never)."""
        if self.threshold is None:
            return None
        if self.threshold != "auto":
            return int(self.threshold)
        if not self._measured_h2d:
            self.cost.h2d_bytes_per_s = measure_h2d(self.device)
            self._measured_h2d = True
        c = self.cpu
        return self.cost.threshold(k, c.num_experts, c.hidden, c.intermediate, self.bytes_per_expert())

    def wanted(self, t: int, k: int) -> bool:
        thr = self.threshold_tokens(k)
        return thr is not None and t >= thr

    def observe_cpu(self, t: int, k: int, seconds: float) -> None:
        self.cost.observe_cpu(t, k, self.cpu.hidden, self.cpu.intermediate, seconds)

    def arrays(self) -> dict:
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

    def forward(self, owner, x, topk_ids, topk_weights) -> torch.Tensor:
        """Every expert on the GPU for this batch: the layer's packed experts are copied over as
        they are (into the double-buffered staging shared by all layers of the device, on a copy
        stream), unpacked there, and all E experts run in one fused MoE. Meanwhile the experts of
        the layer that followed ``owner`` last time are copied into the other buffer.
        owner: the layer (staging learns the order of layers from it)."""
        from ..gpu_ops import fused_moe
        from ._gpu_weights import LayerStaging, drop_up_padding, unpack_on_device

        stage = LayerStaging.for_device(self.device)
        bufs = stage.acquire(owner, self.arrays())
        cpu = self.cpu
        dtype = "int8" if cpu.scheme is QuantScheme.INT8 else "bf16"
        w13, s13 = unpack_on_device(cpu.w13, bufs["w13"], bufs.get("w13_scale"), dtype)
        w2, s2 = unpack_on_device(cpu.w2, bufs["w2"], bufs.get("w2_scale"), dtype)
        w13, s13 = drop_up_padding(w13, s13, cpu.intermediate, cpu.up_offset)
        if self._all_slots is None:
            self._all_slots = torch.arange(cpu.num_experts, dtype=torch.int32, device=self.device)
        out = fused_moe(x, topk_ids, topk_weights, self._all_slots, w13, w2, w13_scale=s13, w2_scale=s2)
        stage.release()  # the staged bytes (or views of them) are read by now
        nxt = stage.successor(owner)
        nxt_prefill = getattr(nxt, "prefill", None)
        if isinstance(nxt_prefill, GpuPrefill) and nxt_prefill.device == self.device:
            stage.prefetch(nxt, nxt_prefill.arrays())
        return out
