"""`kt doctor`: what this machine can run, and why."""
from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

_PACKAGES = ["torch", "numba", "llvmlite", "numpy", "triton", "cupy", "transformers", "sglang"]
_ISA_FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni",
              "avx512bf16", "amx-tile", "amx-int8", "amx-bf16"]


def _version(pkg: str) -> str | None:
    names = [pkg] if pkg != "cupy" else ["cupy", "cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x"]
    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    return None


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def numa_nodes(root: str = "/sys/devices/system/node") -> list[dict]:
    """[{node, cpus, mem_total}] from sysfs; one node with all CPUs when sysfs has none."""
    from .._sysinfo import numa_topology

    return numa_topology(root)


def _gpu_info() -> dict:
    if _version("torch") is None:
        return {"cuda_available": False, "reason": "torch not installed", "gpus": []}
    import torch

    if not torch.cuda.is_available():
        return {"cuda_available": False, "reason": "torch.cuda.is_available() is False",
                "gpus": []}
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        gpus.append({"index": i, "name": p.name, "memory_bytes": int(p.total_memory)})
    return {"cuda_available": True, "cuda_version": torch.version.cuda, "gpus": gpus}


def _launch_table(gpu: dict) -> str:
    """Where the GPU kernels' launch configs come from on the first GPU (KT_GPU_TABLE, a packaged
    tuned table, or the heuristic), or what is wrong with KT_GPU_TABLE."""
    if _version("torch") is None:
        return "n/a (torch not installed)"
    from ..gpu_ops.configs import table_for_device

    try:
        return table_for_device(gpu["gpus"][0]["name"] if gpu["gpus"] else "")[1]
    except (OSError, ValueError) as exc:
        return f"ERROR: {exc}"


def collect() -> dict:
    """Everything doctor reports, as plain data."""
    from ..config import get_config
    from ..cpu_ops import cache, isa, registry

    info: dict = {"kt_version": None, "python": sys.version.split()[0],
                  "platform": platform.platform()}
    from .._version import __version__

    info["kt_version"] = __version__
    cfg = get_config()
    host = isa.probe_host()
    cpu = {"model": host.model_name, "llvm_cpu_name": host.cpu_name,
           "flags": {f: host.has(f) for f in _ISA_FLAGS},
           "amx_permission": host.amx_permission, "amx_error": host.amx_error,
           "logical_cpus": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)),
           "runnable_variants": [v for v in isa.VARIANTS if host.can_run(v)]}
    try:
        sel = isa.select_variant(host, cfg.cpu_variant)
        cpu["variant"], cpu["variant_reason"] = sel.variant, sel.reason
        cpu["variant_warnings"] = list(sel.warnings)
        variant_error = None
    except isa.UnsupportedVariantError as exc:
        cpu["variant"], cpu["variant_reason"] = None, str(exc)
        variant_error = str(exc)
    # the kernels (and their forms) the registry picks for each scheme on this host's variant
    cpu["kernels"] = {}
    if cpu["variant"]:
        for scheme in ("int8", "int4", "bf16"):
            try:
                cpu["kernels"][scheme] = registry.kernel_set(scheme, cpu["variant"]).describe()
            except NotImplementedError as exc:
                cpu["kernels"][scheme] = f"none: {exc}"
    info["cpu"] = cpu
    mem = _meminfo()
    info["memory"] = {"total_bytes": mem.get("MemTotal"), "available_bytes": mem.get("MemAvailable")}
    info["numa"] = numa_nodes()
    info["packages"] = {p: _version(p) for p in _PACKAGES}
    info["gpu"] = _gpu_info()
    info["gpu"]["launch_table"] = _launch_table(info["gpu"])
    try:
        key_dir = str(cache.kernel_cache_dir(cpu["variant"])) if cpu["variant"] else None
    except Exception as exc:  # e.g. numba missing
        key_dir = f"unavailable: {exc}"
    try:
        cpu["vector_loops_512"] = cache.prefer_512_bit_vectors()
    except Exception:  # e.g. numba missing
        cpu["vector_loops_512"] = None
    stale = cache.stale_kernel_dirs()
    info["cache"] = {"root": str(cache.cache_root()), "kernel_dir": key_dir,
                     "size_bytes": cache.cache_size_bytes(), "stale_dirs": len(stale),
                     "stale_bytes": sum(cache._bytes_under(p) for p in stale)}
    pk = info["packages"]
    verdict = {}
    if variant_error:
        verdict["cpu_experts"] = f"NO: {variant_error}"
    elif not (pk["numba"] and pk["llvmlite"]):
        verdict["cpu_experts"] = "NO: numba/llvmlite not installed"
    else:
        verdict["cpu_experts"] = f"yes ({cpu['variant']} kernels)"
    if not info["gpu"]["cuda_available"]:
        verdict["gpu_experts"] = f"no: {info['gpu']['reason']} (CPU-only mode works)"
    elif not pk["triton"]:
        verdict["gpu_experts"] = "no: triton not installed (pip install kt[gpu])"
    else:
        verdict["gpu_experts"] = f"yes ({info['gpu']['gpus'][0]['name']})"
    if not pk["sglang"]:
        verdict["sglang_plugin"] = "no: sglang not installed (pip install kt[sglang])"
    elif not info["gpu"]["cuda_available"]:
        verdict["sglang_plugin"] = "installed, but SGLang needs a CUDA GPU to serve"
    else:
        verdict["sglang_plugin"] = f"yes (sglang {pk['sglang']})"
    info["verdict"] = verdict
    return info


def _gib(n) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def render(info: dict) -> str:
    c = info["cpu"]
    lines = [f"kt {info['kt_version']}  (python {info['python']}, {info['platform']})", "", "CPU"]
    lines.append(f"  model          {c['model'] or '?'} (LLVM: {c['llvm_cpu_name']}), "
                 f"{c['usable_cpus']} usable of {c['logical_cpus']} logical CPUs")
    flags = "  ".join(f"{f}{'+' if on else '-'}" for f, on in c["flags"].items())
    lines.append(f"  ISA flags      {flags}")
    amx = {True: "granted", False: f"refused ({c['amx_error']})", None: "not asked (no AMX)"}
    lines.append(f"  AMX permission {amx[c['amx_permission']]}")
    lines.append(f"  variant        {c['variant'] or 'NONE'}: {c['variant_reason']}")
    for w in c.get("variant_warnings", []):
        lines.append(f"  warning        {w}")
    lines.append(f"  runnable       {', '.join(c['runnable_variants']) or 'none'}")
    for scheme, forms in c.get("kernels", {}).items():
        lines.append(f"  {scheme} kernels   {forms}")
    if c.get("vector_loops_512") is not None:
        lines.append("  vector loops   " + ("512-bit (kt asks LLVM for zmm; NUMBA_CPU_FEATURES unset)"
                                          if c["vector_loops_512"] else
                                          "LLVM's default width (no AVX-512, or NUMBA_CPU_FEATURES set)"))
    m = info["memory"]
    lines += ["", "Memory", f"  RAM            {_gib(m['available_bytes'])} available of "
              f"{_gib(m['total_bytes'])}"]
    for n in info["numa"]:
        cpus = n["cpus"]
        span = f"{cpus[0]}-{cpus[-1]}" if cpus else "-"
        lines.append(f"  NUMA node {n['node']}    CPUs {span} ({len(cpus)}), {_gib(n['mem_total'])}")
    lines += ["", "Packages"]
    for p, v in info["packages"].items():
        lines.append(f"  {p:<14} {v or 'not installed'}")
    g = info["gpu"]
    lines += ["", "GPU"]
    if g["cuda_available"]:
        for d in g["gpus"]:
            lines.append(f"  cuda:{d['index']}         {d['name']}, {_gib(d['memory_bytes'])}")
    else:
        lines.append(f"  none           {g['reason']}")
    lines.append(f"  launch table   {g['launch_table']}")
    k = info["cache"]
    lines += ["", "Kernel cache", f"  dir            {k['kernel_dir']}",
              f"  size           {k['size_bytes'] / 2**20:.1f} MiB of kernels under {k['root']}"]
    if k["stale_dirs"]:
        lines.append(f"  stale          {k['stale_dirs']} builds of other kt sources, "
                     f"{k['stale_bytes'] / 2**20:.1f} MiB: kt.clear_cache(stale_only=True) removes them")
    lines += ["", "Verdict"]
    for cap, v in info["verdict"].items():
        lines.append(f"  {cap:<14} {v}")
    return "\n".join(lines)


def run(args) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(render(info))
    return 0 if info["cpu"]["variant"] else 1


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="report CPU features, the kernel variant, memory, GPUs, "
                                      "package versions and what kt can run here")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run)
