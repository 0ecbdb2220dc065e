"""Host topology read from sysfs (no numba, no torch): NUMA nodes, their CPUs and memory."""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["parse_cpulist", "numa_topology"]


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the sysfs cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        cpus.extend(range(int(a), int(b or a) + 1))
    return cpus


def numa_topology(root: str = "/sys/devices/system/node") -> list[dict]:
    """[{node, cpus, mem_total}] from sysfs; one node with this process's CPUs when sysfs has none."""
    nodes = []
    for d in sorted(Path(root).glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((d / "cpulist").read_text())
        except (OSError, ValueError):
            continue
        mem = None
        try:
            for line in (d / "meminfo").read_text().splitlines():
                if "MemTotal" in line:
                    mem = int(line.split()[-2]) * 1024
        except (OSError, ValueError):
            pass
        nodes.append({"node": int(d.name[4:]), "cpus": cpus, "mem_total": mem})
    if not nodes:
        nodes.append({"node": 0, "cpus": sorted(os.sched_getaffinity(0)), "mem_total": None})
    return nodes
