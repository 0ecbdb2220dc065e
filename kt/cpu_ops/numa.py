"""NUMA: one MoE layer's experts split across nodes by rows of the intermediate dimension.

``NumaMoE`` holds, for every NUMA node n, a ``CPUMoE`` over the intermediate slice [a_n, b_n) of
every expert: gate and up rows [a_n, b_n) and down columns [a_n, b_n). SiLU(gate) * up is
elementwise along the intermediate dimension, so each node computes its slice of every expert on
its own and the layer is the sum of the nodes' outputs:

    down_e(silu(gate_e x) * up_e x) = sum_n down_e[:, a_n:b_n] (silu(gate_e[a_n:b_n] x) * up_e[a_n:b_n] x)

The slices are node shards as the weight loader makes them (``kt.weights.numa_split`` for a
built layer, ``kt.weights.load_cpu_moe(..., numa=True)`` for a kt weight directory: sizes follow
the nodes' CPU counts, boundaries on multiples of 64 and of G, each slice copied by a thread
pinned to its node so Linux's first-touch policy places its pages there): one copy of every
expert in RAM. Each node has its own ``CpuPool`` pinned to its CPUs, which reads only its slice.
The quantised weights are the unsharded layer's, sliced (INT8 down rows keep their whole-row
scale); the activations of SiLU * up are quantised per token *and node* (each node its own slice
and scale), at least as accurate as one scale per token.

On a machine with one node this adds nothing over ``CPUMoE``.
"""
from __future__ import annotations

import numpy as np

from .. import reference as ref
from ._moe_io import _is_torch, _to_numpy_2d
from .moe import CPUMoE
from .runtime.pool import CpuPool

__all__ = ["NumaMoE"]


def _check_threads(threads_per_node):
    if threads_per_node is not None and (not isinstance(threads_per_node, int)
                                         or isinstance(threads_per_node, bool)
                                         or threads_per_node <= 0):
        raise ValueError(f"threads_per_node must be a positive int, got {threads_per_node!r}")


class _Handle:
    def __init__(self, handles, finish):
        self._handles, self._finish, self._result = handles, finish, None

    def done(self) -> bool:
        return all(h.done() for h in self._handles)

    def wait(self):
        if self._finish is not None:
            parts = [h.wait() for h in self._handles]
            self._result = self._finish(parts)
            self._finish = None
        return self._result


class NumaMoE:
    """A ``CPUMoE``-like layer whose experts are split across NUMA nodes (see the module doc).

    shards: one per node with a slice, each with ``node``, ``cpus``, ``i0``, ``i1`` and its
    stacked ``w13`` [E, 2(i1 - i0), H] (gate rows, then up rows) and ``w2`` [E, H, i1 - i0]
    (``kt.weights.NodeShard``; build the layer with ``kt.weights.numa_split`` or
    ``kt.weights.load_cpu_moe``). threads_per_node: pool threads per node (default: the node's
    CPUs). ``cpu_moe_kw`` goes to each node's ``CPUMoE`` (max_tokens, variant, activations,
    tuning, ...). Calls take the arguments of ``CPUMoE.__call__`` / ``submit`` and return the
    same.
    """

    def __init__(self, shards, threads_per_node: int | None = None, **cpu_moe_kw):
        _check_threads(threads_per_node)
        if not shards:
            raise ValueError("NumaMoE needs at least one node shard")
        self.slices = [(sh.i0, sh.i1) for sh in shards]
        self.nodes = {sh.node: list(sh.cpus) for sh in shards}
        self.shards, self.pools = [], []
        for sh in shards:
            pool = CpuPool(threads_per_node or len(sh.cpus), cpus=sh.cpus, caller_joins=False)
            self.pools.append(pool)
            self.shards.append(CPUMoE(sh.w13, sh.w2, up_offset=sh.i1 - sh.i0, pool=pool,
                                      **cpu_moe_kw))
        s0 = self.shards[0]
        self.scheme, self.num_experts, self.hidden = s0.scheme, s0.num_experts, s0.hidden
        self.intermediate = max(b for _, b in self.slices)
        self.group_size = s0.group_size

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def __repr__(self):
        return (f"NumaMoE(E={self.num_experts}, H={self.hidden}, I={self.intermediate}, "
                f"scheme={self.scheme.value}, nodes={sorted(self.nodes)}, slices={self.slices})")

    def __call__(self, x, topk_ids, topk_weights, gpu_mask=None, out=None, incremental=False,
                 tuning=None):
        return self.submit(x, topk_ids, topk_weights, gpu_mask=gpu_mask, out=out,
                           incremental=incremental, tuning=tuning).wait()

    forward = __call__

    def submit(self, x, topk_ids, topk_weights, gpu_mask=None, out=None, incremental=False,
               tuning=None):
        """Start every node's part (each with ``tuning``, default its own); ``.wait()`` sums them
        into the output (x's dtype, or ``out``)."""
        if not isinstance(incremental, (bool, np.bool_)):
            raise TypeError(f"incremental must be a bool, got {type(incremental).__name__}")
        if incremental and out is None:
            raise ValueError("incremental=True needs out= (the output to add into)")
        xa, kind = _to_numpy_2d("x", x, ())
        x32 = np.ascontiguousarray(ref.bf16_bits_to_f32(xa)) if kind == "bf16" else xa
        T = x32.shape[0]
        if out is not None and tuple(out.shape) != (T, self.hidden):
            raise ValueError(f"out must be [T, H] = {(T, self.hidden)}, got {tuple(out.shape)}")
        handles = [s.submit(x32, topk_ids, topk_weights, gpu_mask=gpu_mask, tuning=tuning)
                   for s in self.shards]

        def finish(parts):
            y = parts[0].astype(np.float32, copy=True)
            for p in parts[1:]:
                y += p
            if out is not None:
                if _is_torch(out):
                    import torch

                    yt = torch.from_numpy(y).to(out.dtype).to(out.device)
                    if incremental:
                        out.add_(yt)
                    else:
                        out.copy_(yt)
                elif incremental:
                    np.add(out, y.astype(out.dtype), out=out)
                else:
                    out[...] = y
                return out
            if _is_torch(x):
                import torch

                return torch.from_numpy(y).to(x.dtype).to(x.device)
            return y if np.asarray(x).dtype == np.float32 else y.astype(np.asarray(x).dtype)

        return _Handle(handles, finish)

    def shutdown(self) -> None:
        """Stop every node's pool (the layer cannot be called afterwards)."""
        for p in self.pools:
            p.shutdown()
