"""Where the benchmarks write their results: ``benchmarks/results/<machine>/<benchmark>.json``.

One file per benchmark and machine, overwritten by the next run there (git keeps the older ones).
The machine is named by what it is: ``KT_BENCH_MACHINE`` (or a benchmark's ``--machine``) if set,
else ``[<gpu>-]<cpu><cores>``, e.g. ``h200-xeon16`` (an H200 beside 16 Xeon cores), ``xeon2-amx``
(2 Xeon cores with AMX, no GPU), ``zen3-2`` (2 AMD Zen 3 cores). Every file carries a ``meta``
block: benchmark, machine, UTC date, the git commit of the code that ran (``KT_BENCH_COMMIT`` where
the tree has no ``.git``, as on a copied checkout) and the command line.
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def _gpu_name() -> str | None:
    """The first NVIDIA GPU's short name (``h200``), read from the driver's /proc files (no torch)."""
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(info) as f:
                for line in f:
                    if line.startswith("Model:"):
                        words = [w for w in line.split(":", 1)[1].split() if w.upper() not in ("NVIDIA", "TESLA")]
                        return words[0].lower() if words else None
        except OSError:
            return None
    return None


def _cpu_name(gpu: bool) -> str:
    cores = len(os.sched_getaffinity(0))
    try:
        import llvmlite.binding as llvm

        llvm_name = llvm.get_host_cpu_name()
    except Exception:
        llvm_name = platform.machine()
    if llvm_name.startswith("znver"):
        return f"zen{llvm_name[5:]}-{cores}"
    vendor = ""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id") and not vendor:
                    vendor = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1]
    except OSError:
        pass
    if vendor == "GenuineIntel":
        # a CPU-only host is told apart by AMX, which picks its CPU kernels; the GPU hosts seen all have it
        amx = "amx_tile" in flags.split() and not gpu
        return f"xeon{cores}" + ("-amx" if amx else "")
    return f"{llvm_name}-{cores}"


def machine_name() -> str:
    env = os.environ.get("KT_BENCH_MACHINE")
    if env:
        return env
    gpu = _gpu_name()
    cpu = _cpu_name(gpu is not None)
    return f"{gpu}-{cpu}" if gpu else cpu


def default_out(machine: str | None = None) -> Path:
    """benchmarks/results/<machine>/"""
    return RESULTS / (machine or machine_name())


def add_out_arguments(ap) -> None:
    """--out DIR and --machine NAME, the same for every benchmark."""
    ap.add_argument("--out", default=None,
                    help="folder for the result (default: benchmarks/results/<machine>/)")
    ap.add_argument("--machine", default=None,
                    help="the machine's name for the default --out (default: derived, see _results.py)")


def out_dir(args) -> Path:
    return Path(args.out) if args.out else default_out(args.machine)


def _commit() -> str | None:
    env = os.environ.get("KT_BENCH_COMMIT")
    if env:
        return env
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True,
                           text=True, timeout=10)
        if r.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "kt"],
                               cwd=HERE.parent, capture_output=True, text=True, timeout=10).stdout.strip()
        return r.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _default(o):
    """JSON for numpy scalars and arrays; anything else as its str."""
    if hasattr(o, "item") and getattr(o, "ndim", 1) == 0:
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    return str(o)


def meta(benchmark: str, machine: str | None = None) -> dict:
    return {"benchmark": benchmark, "machine": machine or machine_name(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": _commit(), "command": " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
            "python": platform.python_version()}


def write_result(folder, benchmark: str, data: dict, machine: str | None = None) -> Path:
    """Write ``data`` (with a ``meta`` block first) to ``folder/<benchmark>.json``; returns the path.
    Callers rewrite it after each part, so a run cut short keeps what it measured."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"meta": {**meta(benchmark, machine), **data.get("meta", {})}}
    doc.update((k, v) for k, v in data.items() if k != "meta")
    path = folder / f"{benchmark}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=_default) + "\n")
    os.replace(tmp, path)
    return path


def write_json(out_dir: str, name: str, data) -> str:
    """Write ``data`` as it is to ``out_dir/name`` (side files such as a tuned config table)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return path
