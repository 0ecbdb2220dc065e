"""The CPU pool of the plugin's MoE layers, placed on the NUMA nodes ``--kt-numa-nodes`` names.

Worker threads inherit the CPU affinity of the thread that starts them, so the pool is created while
the calling thread is restricted to the chosen nodes' CPUs; the caller's own affinity is restored
afterwards. (Memory placement follows first touch; kt does not bind memory.)
"""
from __future__ import annotations

import os

from ._flags import KTArgumentError, KTOptions

__all__ = ["make_pool", "node_cpus"]


def node_cpus(nodes) -> set[int]:
    """The CPUs of this thread's affinity set on NUMA ``nodes``; KTArgumentError if none."""
    from ..cpu_ops.runtime.pool import numa_nodes

    have = numa_nodes(set(os.sched_getaffinity(0)))
    missing = [n for n in nodes if n not in have]
    if missing:
        raise KTArgumentError(f"--kt-numa-nodes: node(s) {missing} have no CPU this process may use "
                              f"(usable nodes: {sorted(have)})")
    return {c for n in nodes for c in have[n]}


def make_pool(opts: KTOptions):
    """The process's pool of ``--kt-cpuinfer`` threads (default: the CPUs of the chosen nodes,
    or all) on the CPUs of ``--kt-numa-nodes`` (default: all of this process's)."""
    from ..cpu_ops import default_pool

    cpus = None if opts.kt_numa_nodes is None else node_cpus(opts.kt_numa_nodes)
    return default_pool(opts.kt_cpuinfer or None, cpus=cpus)
