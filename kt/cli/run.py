"""`kt run MODEL [--kt-... options] [-- extra sglang args]`: serve a MoE model with SGLang and kt.

Builds the ``python -m sglang.launch_server`` command from kt's defaults, prints it and runs it
(``--dry-run`` only prints). Defaults, each replaced by the flag when given:

- ``--kt-cpuinfer``: the CPUs this process may run on; ``--kt-threadpool-count``: the NUMA nodes;
- GPU experts: ``--kt-gpu-expert-budget`` from the free GPU memory (``nvidia-smi``, or ``--vram``)
  minus the model's non-expert weights and a reserve for the KV cache and activations
  (``gpu_expert_budget``); no GPU: every expert on the CPU.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

__all__ = ["add_parser", "parse_rest", "build_command", "gpu_expert_budget", "free_vram", "model_bytes"]

_BUDGET_FLAGS = ("kt_num_gpu_experts", "kt_gpu_experts_ratio", "kt_gpu_expert_budget", "kt_placement")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2}
GiB = 2**30


def _add_options(p) -> None:
    from ..sglang_hook._flags import FLAGS

    for f in FLAGS:  # same names and parsing as inside SGLang; unset flags keep kt's defaults
        kw = dict(f.kwargs)
        kw["default"] = argparse.SUPPRESS
        p.add_argument(f.name, dest=f.dest, **kw)
    p.add_argument("--vram", metavar="BYTES", default=argparse.SUPPRESS,
                   help="GPU memory to plan the expert budget for (default: free memory of the first GPU "
                        "from nvidia-smi)")
    p.add_argument("--python", metavar="PY", default=argparse.SUPPRESS,
                   help="Python with SGLang installed (default: this one if it has sglang, else a kt-managed "
                        "venv under ~/.cache/kt/venvs)")
    p.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS,
                   help="print the command, do not run it")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run", help="serve a MoE model with SGLang, experts split between GPU and CPU",
        usage="kt run MODEL [--kt-... options] [--dry-run] [-- extra sglang args]",
        description="Build and run `python -m sglang.launch_server` with kt's flags. kt's defaults: CPU "
                    "threads from this machine, GPU experts from the free GPU memory. Anything after "
                    "`--` is passed to SGLang as is.",
        epilog="example: kt run Qwen/Qwen3-30B-A3B --kt-weight-path qwen3-int8 -- --port 30000")
    _add_options(p)
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="MODEL ...",
                   help="model directory or Hugging Face id (SGLang's --model-path), then options")
    p.set_defaults(func=_run)


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message):
        raise argparse.ArgumentError(None, message)


def parse_rest(args) -> argparse.Namespace:
    """Options given after MODEL (argparse stops at the first positional) and the ``--`` tail."""
    rest = list(args.rest or [])
    if "--" in rest:
        i = rest.index("--")
        head, extra = rest[:i], rest[i + 1:]
    else:
        head, extra = rest, []
    if not head or head[0].startswith("-"):
        raise ValueError("kt run needs a MODEL (a model directory or a Hugging Face id) before its options")
    p = _RaisingParser(prog="kt run", add_help=False)
    _add_options(p)
    try:
        later = p.parse_args(head[1:])
    except argparse.ArgumentError as exc:
        raise ValueError(f"{exc} (SGLang's own arguments go after `--`)") from None
    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in ("rest", "func", "command")})
    for k, v in vars(later).items():
        setattr(ns, k, v)
    ns.model, ns.extra = head[0], extra
    for k, v in (("vram", None), ("python", None), ("dry_run", False)):
        if not hasattr(ns, k):
            setattr(ns, k, v)
    return ns


# ----------------------------------------------------------------------------- defaults (pure)

def gpu_expert_budget(free_bytes: int, non_expert_bytes: int, *, reserve_fraction: float = 0.2,
                      min_reserve: int = 2 * GiB) -> int:
    """Bytes of routed experts to place on the GPU: what is free, minus the model's other weights,
    minus a reserve for the KV cache and activations (``reserve_fraction`` of the free memory, at
    least ``min_reserve``). Never negative."""
    reserve = max(int(free_bytes * reserve_fraction), int(min_reserve))
    return max(0, int(free_bytes) - int(non_expert_bytes) - reserve)


def free_vram() -> int | None:
    """Free bytes of the first visible GPU (nvidia-smi), or None without a GPU."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or not r.stdout.strip():
        return None
    try:
        return int(float(r.stdout.strip().splitlines()[0])) * 2**20
    except ValueError:
        return None


def model_bytes(model: str, info) -> tuple[int | None, int | None]:
    """(all weight bytes, routed-expert bytes) of a local model directory; (None, None) otherwise."""
    d = Path(model).expanduser()
    files = glob.glob(str(d / "*.safetensors"))
    if not files or info is None:
        return None, None
    total = sum(os.path.getsize(f) for f in files)
    try:
        cfg = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        cfg = {}
    per = _DTYPE_BYTES.get(str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16"))), 2)
    experts = len(info.moe_layers) * info.num_experts * 3 * info.hidden * info.intermediate * per
    return total, min(experts, total)


def _sglang_python(explicit: str | None) -> tuple[str, str | None]:
    if explicit:
        return explicit, None
    if importlib.util.find_spec("sglang") is not None:
        return sys.executable, None
    venvs = sorted(glob.glob(str(Path("~/.cache/kt/venvs/sglang-*/bin/python").expanduser())))
    if venvs:
        return venvs[-1], None
    return sys.executable, ("sglang is not installed in this Python; install it (pip install 'kt[sglang]') "
                            "or pass --python")


def build_command(args) -> tuple[list[str], list[str]]:
    """(command, notes) for the parsed ``kt run`` arguments."""
    from ..placement import parse_bytes
    from ..sglang_hook._flags import FLAGS, KTOptions, default_threads, read_model_info, validate
    from ..sglang_hook._flags import _numa_node_ids

    notes: list[str] = []
    given = {f.dest: getattr(args, f.dest) for f in FLAGS if hasattr(args, f.dest)}
    info = read_model_info(args.model)
    if info is None:
        notes.append(f"{args.model}: not a local MoE model directory; SGLang resolves it (kt's checks of "
                     "the model happen at launch)")
    given.setdefault("kt_cpuinfer", default_threads())
    given.setdefault("kt_threadpool_count", max(1, len(_numa_node_ids())))
    if not any(k in given for k in _BUDGET_FLAGS):
        free = parse_bytes(args.vram) if args.vram is not None else free_vram()
        if not free:
            given["kt_num_gpu_experts"] = 0
            notes.append("no GPU memory found (nvidia-smi): every expert on the CPU; pass --vram or a "
                         "--kt-* budget to plan for a GPU")
        else:
            total, experts = model_bytes(args.model, info)
            other = (total - experts) if total is not None else 0
            if total is None:
                notes.append(f"no *.safetensors with a MoE config.json in {args.model}: the budget does not "
                             "subtract the model's non-expert weights")
            b = gpu_expert_budget(free, other)
            if b == 0:
                given["kt_num_gpu_experts"] = 0
                notes.append(f"{free / GiB:.1f} GiB free is not enough for experts next to the model's "
                             f"{other / GiB:.1f} GiB of other weights: every expert on the CPU")
            else:
                given["kt_gpu_expert_budget"] = b
                notes.append(f"GPU expert budget {b / GiB:.2f} GiB = {free / GiB:.2f} GiB free - "
                             f"{other / GiB:.2f} GiB non-expert weights - KV/activation reserve")
    opts = KTOptions(**given)
    notes += validate(opts, info)
    if opts.kt_weight_path is None:
        notes.append("no --kt-weight-path: the CPU experts are quantised while SGLang loads the checkpoint "
                     "(convert once with `kt convert` for a faster start)")
    py, warn = _sglang_python(args.python)
    if warn:
        notes.append(warn)
    cmd = [py, "-m", "sglang.launch_server", "--model-path", args.model]
    by_dest = {f.dest: f for f in FLAGS}
    for dest, v in given.items():
        f = by_dest[dest]
        if f.kwargs.get("action") == "store_true":
            if v:
                cmd.append(f.name)
        elif v is not None:
            cmd += [f.name, ",".join(map(str, v)) if isinstance(v, tuple) else str(v)]
    extra = list(args.extra or [])
    for flag in ("--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"):
        if not any(a == flag or a.startswith(flag + "=") for a in extra):
            cmd += [flag, "disabled"]
    return cmd + extra, notes


def _run(args) -> int:
    args = parse_rest(args)
    cmd, notes = build_command(args)
    for n in notes:
        print(f"kt run: {n}", file=sys.stderr)
    print(shlex.join(cmd), flush=True)
    if args.dry_run:
        return 0
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130
