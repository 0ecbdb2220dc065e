"""NUMA: one MoE layer's experts split across nodes by rows of the intermediate dimension.

``NumaMoE`` holds, for every NUMA node n, a ``CPUMoE`` over the intermediate slice [a_n, b_n) of
every expert: gate and up rows [a_n, b_n) and down columns [a_n, b_n). SiLU(gate) * up is
elementwise along the intermediate dimension, so each node computes its slice of every expert on
its own and the layer is the sum of the nodes' outputs:

    down_e(silu(gate_e x) * up_e x) = sum_n down_e[:, a_n:b_n] (silu(gate_e[a_n:b_n] x) * up_e[a_n:b_n] x)

There is one copy of every expert in RAM: each node's slice lives in memory first touched by a
thread pinned to that node (Linux's default first-touch policy then places its pages there), and
the node's own pool of threads, pinned to its CPUs, reads only that slice. The quantised weights
are the unsharded layer's, sliced (INT8 down rows keep their whole-row scale; INT4 slices are cut
on group boundaries); the activations of SiLU * up are quantised per token *and node* (each node
quantises its slice with its own scale), which is at least as accurate as one scale per token.

On a machine with one node this adds nothing over ``CPUMoE``: use ``NumaMoE`` where
``kt.cpu_ops.pool.numa_nodes()`` reports several nodes (``nodes=`` overrides the topology, e.g. to
test on one node).
"""
from __future__ import annotations

import os
import threading

import numpy as np

from .. import reference as ref
from ..config import QuantScheme
from .moe import CPUMoE, _is_torch, _to_numpy_2d
from .packing import PackedWeight, pack_quantized, unpack
from .pool import CpuPool, numa_nodes

__all__ = ["NumaMoE", "split_intermediate"]


def split_intermediate(inter: int, n_parts: int, align: int) -> list[tuple[int, int]]:
    """[a, b) slices of range(inter) for n_parts nodes: boundaries on multiples of ``align``,
    sizes as even as that allows; a node may get an empty slice only when inter < n_parts * align."""
    if n_parts <= 0:
        raise ValueError(f"n_parts must be positive, got {n_parts}")
    units = -(-inter // align)
    out = []
    for i in range(n_parts):
        a = min(inter, (units * i // n_parts) * align)
        b = min(inter, (units * (i + 1) // n_parts) * align)
        out.append((a, b))
    return out


def _slice_rows(qw: ref.QuantizedWeight, rows) -> ref.QuantizedWeight:
    sc = None if qw.scale is None else qw.scale[rows]
    return ref.QuantizedWeight(qw.scheme, qw.q[rows], sc, qw.group_size)


def _slice_cols(qw: ref.QuantizedWeight, a: int, b: int) -> ref.QuantizedWeight:
    if qw.scheme is QuantScheme.INT4:
        g = qw.group_size
        return ref.QuantizedWeight(qw.scheme, qw.q[:, a:b], qw.scale[:, a // g: -(-b // g)], g)
    return ref.QuantizedWeight(qw.scheme, qw.q[:, a:b], qw.scale, qw.group_size)


def _stack(parts: list[PackedWeight]) -> PackedWeight:
    p0 = parts[0]
    data = np.empty((len(parts),) + p0.data.shape, p0.data.dtype)
    scale = np.empty((len(parts),) + p0.scale.shape, p0.scale.dtype)
    wsum = np.empty((len(parts),) + p0.wsum.shape, p0.wsum.dtype)
    for e, p in enumerate(parts):  # written here: the pages are first touched by this thread
        data[e] = p.data
        scale[e] = p.scale
        wsum[e] = p.wsum
    return PackedWeight(p0.scheme, p0.n, p0.d, p0.n_pad, p0.d_pad, p0.group_size, data, scale, wsum)


def _shard(moe: CPUMoE, a: int, b: int) -> tuple[PackedWeight, PackedWeight]:
    """Packed w13 / w2 stacks of the intermediate slice [a, b) of every expert of ``moe``."""
    inter, off = moe.intermediate, moe.up_offset
    rows = np.r_[a:b, off + a:off + b]
    g = moe.group_size or 64
    w13, w2 = [], []
    for e in range(moe.num_experts):
        w13.append(pack_quantized(_slice_rows(unpack(moe.w13.expert(e)), rows), g))
        w2.append(pack_quantized(_slice_cols(unpack(moe.w2.expert(e)), a, b), g))
    assert inter >= b
    return _stack(w13), _stack(w2)


def _on_cpus(cpus, fn):
    """fn() in a thread pinned to ``cpus`` (so what it allocates and writes is first touched
    there); returns its result or raises its exception."""
    box = {}

    def run():
        try:
            try:
                os.sched_setaffinity(0, cpus)
            except OSError:
                pass  # not allowed here: the memory lands wherever the thread runs
            box["v"] = fn()
        except BaseException as exc:  # re-raised in the caller
            box["e"] = exc

    t = threading.Thread(target=run, name="kt-numa-alloc")
    t.start()
    t.join()
    if "e" in box:
        raise box["e"]
    return box["v"]


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

    Build it with ``NumaMoE.from_cpu_moe(moe)`` (re-slicing an existing layer, e.g. one from
    ``CPUMoE.from_kt``) or ``NumaMoE.from_tensors(gate, up, down, scheme=...)``. ``nodes``: a
    {node: [cpus]} map (default: ``numa_nodes()``, the process's CPUs per node);
    ``threads_per_node``: pool threads per node (default: the node's CPUs). Calls take the
    arguments of ``CPUMoE.__call__`` / ``submit`` and return the same.
    """

    def __init__(self, shards: list[CPUMoE], pools: list[CpuPool], nodes: dict[int, list[int]],
                 slices: list[tuple[int, int]]):
        if not shards or len(shards) != len(pools):
            raise ValueError("NumaMoE needs one CPUMoE and one CpuPool per node")
        self.shards, self.pools, self.nodes, self.slices = shards, pools, dict(nodes), slices
        s0 = shards[0]
        self.scheme, self.num_experts, self.hidden = s0.scheme, s0.num_experts, s0.hidden
        self.intermediate = slices[-1][1]
        self.group_size = s0.group_size

    @classmethod
    def from_cpu_moe(cls, moe: CPUMoE, nodes: dict[int, list[int]] | None = None,
                     threads_per_node: int | None = None) -> "NumaMoE":
        if not isinstance(moe, CPUMoE):
            raise TypeError(f"moe must be a CPUMoE, got {type(moe).__name__}")
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
        if threads_per_node is not None and (not isinstance(threads_per_node, int)
                                             or threads_per_node <= 0):
            raise ValueError(f"threads_per_node must be a positive int, got {threads_per_node!r}")
        align = max(64, moe.group_size or 0)
        keys = sorted(nodes)
        slices = split_intermediate(moe.intermediate, len(keys), align)
        if any(a == b for a, b in slices):
            raise ValueError(f"intermediate size {moe.intermediate} is too small to split over "
                             f"{len(keys)} nodes in slices of multiples of {align}")
        shards, pools = [], []
        for k, (a, b) in zip(keys, slices):
            cpus = sorted(nodes[k])
            w13, w2 = _on_cpus(cpus, lambda a=a, b=b: _shard(moe, a, b))
            pool = CpuPool(threads_per_node or len(cpus), cpus=cpus, caller_joins=False)
            shard = CPUMoE(w13, w2, up_offset=b - a, pool=pool, chunk_tokens=moe.chunk_tokens,
                           max_tokens=moe.max_tokens, variant=None if moe.variant == "custom"
                           else moe.variant, activations=moe.activations)
            shards.append(shard)
            pools.append(pool)
        return cls(shards, pools, {k: sorted(nodes[k]) for k in keys}, slices)

    @classmethod
    def from_tensors(cls, gate, up, down, scheme: QuantScheme | str = "int8", group_size: int = 64,
                     nodes=None, threads_per_node=None, **kw) -> "NumaMoE":
        """gate/up [E, I, H], down [E, H, I]; ``kw`` goes to ``CPUMoE.from_tensors``."""
        moe = CPUMoE.from_tensors(gate, up, down, scheme=scheme, group_size=group_size, **kw)
        return cls.from_cpu_moe(moe, nodes=nodes, threads_per_node=threads_per_node)

    @classmethod
    def from_kt(cls, path, layer: int, nodes=None, threads_per_node=None,
                physical_to_logical_map=None, **kw) -> "NumaMoE":
        """Layer ``layer`` of a kt weight directory, split across ``nodes``."""
        moe = CPUMoE.from_kt(path, layer, physical_to_logical_map=physical_to_logical_map, **kw)
        return cls.from_cpu_moe(moe, nodes=nodes, threads_per_node=threads_per_node)

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

                    yt = torch.from_numpy(y)
                    if incremental:
                        out.add_(yt.to(out.dtype).to(out.device))
                    else:
                        out.copy_(yt)
                else:
                    if incremental:
                        np.add(out, y.astype(out.dtype), out=out)
                    else:
                        out[...] = y
                return out
            if _is_torch(x):
                return __import__("torch").from_numpy(y).to(x.dtype).to(x.device)
            return y if np.asarray(x).dtype == np.float32 else y.astype(np.asarray(x).dtype)

        return _Handle(handles, finish)

    def shutdown(self) -> None:
        """Stop every node's pool (the layer cannot be called afterwards)."""
        for p in self.pools:
            p.shutdown()
