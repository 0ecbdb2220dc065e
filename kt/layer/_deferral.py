"""Deferred experts: a token's lowest-weight CPU experts finish during the next layer.

With ``max_deferred_experts_per_token = d``, each token's d lowest-weight CPU experts of layer l are
not waited for in layer l: they are computed while the model runs on, and their contribution is
added to layer l+1's MoE output. This changes the model's math (the deferred part skips layer l+1's
attention and router input); the last layer defers nothing.

Legend: T tokens, E experts, K top-k.
"""
from __future__ import annotations

import threading

import torch

__all__ = ["split_deferred", "DeferredChain", "CpuPending", "StreamPending"]


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


class CpuPending:
    """CPU work running in the pool (CPU tensors): a ``CPUMoE.submit`` handle."""

    def __init__(self, handle):
        self.handle = handle

    def wait(self):
        return self.handle.wait()

    def add_into(self, out):
        return out + self.handle.wait().to(out.dtype)


class StreamPending:
    """CPU work ordered on the CUDA stream (a ``StreamBridge`` job): whoever adds it makes the
    current stream wait for it, with no host synchronisation."""

    def __init__(self, bridge, job):
        self.bridge, self.job = bridge, job

    def wait(self):
        return self.bridge.finish(self.job)

    def add_into(self, out):
        return out + self.bridge.finish(self.job).to(out.dtype)
