"""CPU layers from kt weights: a kt weight-format layer as a ``CPUMoE`` (or a ``NumaMoE`` split
across NUMA nodes), and any ``CPUMoE`` split across nodes.

The split is the loader's (``make_shards``: intermediate rows [i0, i1) per node, sizes following
the nodes' CPU counts, each slice copied by a thread pinned to its node so Linux's first-touch
policy places its pages there); ``kt.cpu_ops`` runs the shards and never reads files.
Legend: E experts, H hidden size, I expert intermediate size.
"""
from __future__ import annotations

import os

from ._loader import NumaTopology, load_experts, make_shards

__all__ = ["load_cpu_moe", "numa_split"]


def _topology(nodes) -> NumaTopology:
    """{node: [cpus]} (default: the process's CPUs per NUMA node) as a checked NumaTopology."""
    from ..cpu_ops.runtime.pool import numa_nodes

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


def numa_split(moe, nodes: dict[int, list[int]] | None = None, threads_per_node: int | None = None):
    """``moe`` (a ``kt.CPUMoE``) split across NUMA nodes: a ``kt.NumaMoE`` whose node n computes
    the intermediate slice [i0, i1) of every expert on its own pool (its layer options and tuning
    carried over). nodes: {node: [cpus]} (default: the process's CPUs per NUMA node; a stand-in
    map tests the split on one node); threads_per_node: pool threads per node (default: the
    node's CPUs). Nodes whose share of I rounds to nothing get no slice."""
    from ..cpu_ops.moe import CPUMoE
    from ..cpu_ops.numa import NumaMoE

    if not isinstance(moe, CPUMoE):
        raise TypeError(f"moe must be a CPUMoE, got {type(moe).__name__}")
    topo = _topology(nodes)
    _check_threads(threads_per_node)
    shards = make_shards(moe.w13, moe.w2, moe.intermediate, topo, up_offset=moe.up_offset)
    return NumaMoE(shards, threads_per_node, tuning=moe.tuning, max_tokens=moe.max_tokens,
                   activations=moe.activations,
                   variant=None if moe.variant == "custom" else moe.variant)


def load_cpu_moe(path, layer: int, *, pool=None, physical_to_logical_map=None, numa: bool = False,
                 nodes: dict[int, list[int]] | None = None, threads_per_node: int | None = None,
                 **cpu_moe_kwargs):
    """Layer ``layer`` of the kt weight directory ``path`` (``load_experts``) as a ``kt.CPUMoE``
    on ``pool`` (default: the default pool), or with ``numa`` (or ``nodes`` given) as a
    ``kt.NumaMoE``: the loader copies each node's shard on that node (see ``numa_split`` for
    nodes and threads_per_node; the pools are the NumaMoE's own, so ``pool`` must be None).
    physical_to_logical_map: int [P], physical slot p holds logical expert map[p].
    ``cpu_moe_kwargs`` go to each CPUMoE (max_tokens, variant, activations, tuning, ...)."""
    if not (numa or nodes is not None):
        # one node's layer: no shards (the loader would copy one per NUMA node for nothing)
        one = NumaTopology((tuple(sorted(os.sched_getaffinity(0))),))
        lw = load_experts(path, layer, physical_to_logical_map=physical_to_logical_map, topology=one)
        from ..cpu_ops.moe import CPUMoE

        return CPUMoE(lw.w13, lw.w2, pool=pool, **cpu_moe_kwargs)
    if pool is not None:
        raise ValueError("load_cpu_moe: a NUMA split runs on pools of its own, one per node; "
                         "pass pool=None (and threads_per_node) with numa=True")
    from ..cpu_ops.numa import NumaMoE

    _check_threads(threads_per_node)
    topo = _topology(nodes)
    lw = load_experts(path, layer, physical_to_logical_map=physical_to_logical_map, topology=topo)
    if lw.shards:
        return NumaMoE(lw.shards, threads_per_node, **cpu_moe_kwargs)
    from ..cpu_ops.moe import CPUMoE

    return numa_split(CPUMoE(lw.w13, lw.w2, **cpu_moe_kwargs), nodes=nodes,
                      threads_per_node=threads_per_node)
