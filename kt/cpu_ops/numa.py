"""NUMA: one MoE layer's experts split across nodes by rows of the intermediate dimension.

``NumaMoE`` holds, for every NUMA node n, a ``CPUMoE`` over the intermediate slice [a_n, b_n) of
every expert: gate and up rows [a_n, b_n) and down columns [a_n, b_n). SiLU(gate) * up is
elementwise along the intermediate dimension, so each node computes its slice of every expert on
its own and the layer is the sum of the nodes' outputs:

    down_e(silu(gate_e x) * up_e x) = sum_n down_e[:, a_n:b_n] (silu(gate_e[a_n:b_n] x) * up_e[a_n:b_n] x)

The slices are the weight loader's NUMA shards (``kt.weights.make_shards``: sizes follow the
nodes' CPU counts, boundaries on multiples of 64 and of G, each slice copied by a thread pinned to
its node so Linux's first-touch policy places its pages there): one copy of every expert in RAM.
Each node has its own ``CpuPool`` pinned to its CPUs, which reads only its slice. The quantised
weights are the unsharded layer's, sliced (INT8 down rows keep their whole-row scale); the
activations of SiLU * up are quantised per token *and node* (each node its own slice and scale),
at least as accurate as one scale per token.

On a machine with one node this adds nothing over ``CPUMoE``. ``nodes=`` overrides the topology
({node: [cpus]}), e.g. to test the split on one node.
"""
from __future__ import annotations

import os

import numpy as np

from .. import reference as ref
from .moe import CPUMoE, _is_torch, _to_numpy_2d
from .pool import CpuPool, numa_nodes

__all__ = ["NumaMoE"]


def _topology(nodes):
    from ..weights import NumaTopology

    if nodes is None:
        nodes = numa_nodes()
    if not isinstance(nodes, dict) or not nodes or not all(
            isinstance(c, (list, tuple)) and len(c) for c in nodes.values()):
        raise ValueError(f"nodes must be a non-empty {{node: [cpus]}} map, got {nodes!r}")
    allowed = set(os.sched_getaffinity(0))
    for n, cpus in nodes.items():
        if not set(cpus) <= allowed:
            raise ValueError(f"node {n}: CPUs {sorted(set(cpus) - allowed)} are not in this "
                             f"process's affinity set")
    keys = sorted(nodes)
    return NumaTopology(tuple(tuple(sorted(nodes[k])) for k in keys), tuple(int(k) for k in keys))


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

    Build it with ``NumaMoE.from_cpu_moe(moe)`` (slicing an existing layer),
    ``NumaMoE.from_tensors(gate, up, down, scheme=...)`` or ``NumaMoE.from_kt(path, layer)``.
    ``nodes``: a {node: [cpus]} map (default: ``numa_nodes()``, the process's CPUs per node);
    ``threads_per_node``: pool threads per node (default: the node's CPUs). Calls take the
    arguments of ``CPUMoE.__call__`` / ``submit`` and return the same.
    """

    def __init__(self, shards, threads_per_node: int | None = None, **cpu_moe_kw):
        """shards: ``kt.weights.NodeShard``s (one per node with a slice); ``cpu_moe_kw`` goes to
        each node's ``CPUMoE`` (chunk_tokens, max_tokens, variant, activations, ...)."""
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

    @classmethod
    def from_cpu_moe(cls, moe: CPUMoE, nodes: dict[int, list[int]] | None = None,
                     threads_per_node: int | None = None) -> "NumaMoE":
        from ..weights import make_shards

        if not isinstance(moe, CPUMoE):
            raise TypeError(f"moe must be a CPUMoE, got {type(moe).__name__}")
        topo = _topology(nodes)
        _check_threads(threads_per_node)
        shards = make_shards(moe.w13, moe.w2, moe.intermediate, topo, up_offset=moe.up_offset)
        return cls(shards, threads_per_node, chunk_tokens=moe.chunk_tokens,
                   max_tokens=moe.max_tokens, activations=moe.activations,
                   variant=None if moe.variant == "custom" else moe.variant)

    @classmethod
    def from_tensors(cls, gate, up, down, scheme="int8", group_size: int = 64, nodes=None,
                     threads_per_node=None, **kw) -> "NumaMoE":
        """gate/up [E, I, H], down [E, H, I]; ``kw`` goes to ``CPUMoE.from_tensors``."""
        moe = CPUMoE.from_tensors(gate, up, down, scheme=scheme, group_size=group_size, **kw)
        return cls.from_cpu_moe(moe, nodes=nodes, threads_per_node=threads_per_node)

    @classmethod
    def from_kt(cls, path, layer: int, nodes=None, threads_per_node=None,
                physical_to_logical_map=None, **kw) -> "NumaMoE":
        """Layer ``layer`` of a kt weight directory: the loader builds the node shards."""
        from ..weights import load_experts

        topo = _topology(nodes)
        lw = load_experts(path, layer, physical_to_logical_map=physical_to_logical_map,
                          topology=topo)
        if lw.shards:
            return cls(lw.shards, threads_per_node, **kw)
        return cls.from_cpu_moe(CPUMoE(lw.w13, lw.w2, **kw), nodes=nodes,
                                threads_per_node=threads_per_node)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def __repr__(self):
        return (f"NumaMoE(E={self.num_experts}, H={self.hidden}, I={self.intermediate}, "
                f"scheme={self.scheme.value}, nodes={sorted(self.nodes)}, slices={self.slices})")

    def __call__(self, x, topk_ids, topk_weights, gpu_mask=None, out=None, incremental=False):
        return self.submit(x, topk_ids, topk_weights, gpu_mask=gpu_mask, out=out,
                           incremental=incremental).wait()

    forward = __call__

    def submit(self, x, topk_ids, topk_weights, gpu_mask=None, out=None, incremental=False):
        """Start every node's part; ``.wait()`` sums them into the output (x's dtype, or ``out``)."""
        if not isinstance(incremental, (bool, np.bool_)):
            raise TypeError(f"incremental must be a bool, got {type(incremental).__name__}")
        if incremental and out is None:
            raise ValueError("incremental=True needs out= (the output to add into)")
        xa, kind = _to_numpy_2d("x", x, ())
        x32 = np.ascontiguousarray(ref.bf16_bits_to_f32(xa)) if kind == "bf16" else xa
        T = x32.shape[0]
        if out is not None and tuple(out.shape) != (T, self.hidden):
            raise ValueError(f"out must be [T, H] = {(T, self.hidden)}, got {tuple(out.shape)}")
        handles = [s.submit(x32, topk_ids, topk_weights, gpu_mask=gpu_mask) for s in self.shards]

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
