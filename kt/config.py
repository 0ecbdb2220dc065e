"""Typed, frozen configuration. This module is the only place in kt that reads the environment.

Environment variables (all optional):

- ``KT_CPU_VARIANT`` (alias ``KT_KERNEL_CPU_VARIANT``): force a CPU kernel variant
  (``amx``, ``avx512_bf16``, ``avx512_vnni``, ``avx512``, ``avx2``).
- ``KT_CACHE_DIR``: where compiled kernels are cached (default ``~/.cache/kt``).
- ``KT_DEBUG=1``: log ISA detection and kernel selection; ``kt`` commands print an error's traceback.
- ``KT_NUM_THREADS``: threads of the default CPU pool (default: the CPUs this process may use).
- ``KT_GPU_TABLE``: a tuned launch-config table for the GPU kernels (a JSON file as
  ``benchmarks/bench_gpu.py --tune`` writes), used instead of the packaged one for this GPU.
"""
from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path


class QuantScheme(enum.Enum):
    """How CPU expert weights are stored and multiplied.

    INT8: symmetric int8 weights, one fp32 scale per output row; int8 activations per token.
    INT4: symmetric int4 weights, one fp32 scale per group of G consecutive K elements;
          int8 activations per token.
    BF16: bf16 weights and activations, fp32 accumulation.
    """

    INT8 = "int8"
    INT4 = "int4"
    BF16 = "bf16"

    @classmethod
    def parse(cls, value: "QuantScheme | str") -> "QuantScheme":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            for s in cls:
                if s.value == key:
                    return s
        raise ValueError(
            f"unknown quantisation scheme {value!r}; expected one of {[s.value for s in cls]}"
        )


GROUP_SIZES = (32, 64, 128)

# How the integer schemes quantise activations: "int8" one int8 level per token (the default),
# "int8x2" two levels (value and residual, reference.quantize_act2). BF16 takes bf16 activations.
ACT_MODES = ("int8", "int8x2")


def check_activations(mode, scheme: QuantScheme, what: str = "activations") -> str:
    """``mode`` if it is an activation mode ``scheme`` takes, else a ValueError naming ``what``."""
    if mode not in ACT_MODES:
        raise ValueError(f"{what} must be one of {ACT_MODES}, got {mode!r}")
    if mode != "int8" and scheme is QuantScheme.BF16:
        raise ValueError(f"{what}={mode!r} applies to the int8 and int4 schemes; bf16 experts "
                         "take bf16 activations")
    return mode


def parse_scheme_name(name: str) -> tuple[QuantScheme, str]:
    """A scheme name as the benchmarks and ``kt bench`` take it -> (scheme, activations):
    "int8", "int4", "bf16", or "int8x2" / "int4x2" for two-level activations."""
    base, acts = (name[:-2], "int8x2") if name.strip().lower().endswith("x2") else (name, "int8")
    scheme = QuantScheme.parse(base)
    return scheme, check_activations(acts, scheme, f"scheme {name!r}: activations")


@dataclass(frozen=True)
class MoEShape:
    """E experts, K top-k, H hidden size, I expert intermediate size."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int

    def __post_init__(self):
        for name in ("num_experts", "top_k", "hidden", "intermediate"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"MoEShape.{name} must be a positive int, got {v!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")


def _env(name: str, default: str | None = None) -> str | None:
    v = os.environ.get(name)
    return default if v is None or v.strip() == "" else v.strip()


@dataclass(frozen=True)
class KTConfig:
    """Process-level settings read once from the environment."""

    cpu_variant: str | None = None
    cache_dir: Path = Path.home() / ".cache" / "kt"
    debug: bool = False
    num_threads: int | None = None
    gpu_table: Path | None = None

    @classmethod
    def from_env(cls) -> "KTConfig":
        variant = _env("KT_CPU_VARIANT") or _env("KT_KERNEL_CPU_VARIANT")
        xdg = _env("XDG_CACHE_HOME")
        default_cache = Path(xdg) / "kt" if xdg else Path.home() / ".cache" / "kt"
        cache = Path(_env("KT_CACHE_DIR") or default_cache).expanduser()
        debug = (_env("KT_DEBUG", "0") or "0").lower() not in ("0", "false", "no", "off")
        threads = _env("KT_NUM_THREADS")
        n = None
        if threads is not None:
            try:
                n = int(threads)
            except ValueError:
                raise ValueError(f"KT_NUM_THREADS must be an integer, got {threads!r}") from None
            if n <= 0:
                raise ValueError(f"KT_NUM_THREADS must be positive, got {n}")
        table = _env("KT_GPU_TABLE")
        return cls(cpu_variant=variant.lower() if variant else None, cache_dir=cache,
                   debug=debug, num_threads=n, gpu_table=Path(table).expanduser() if table else None)


def get_config() -> KTConfig:
    """The current configuration (re-read each call, so tests can change the environment)."""
    return KTConfig.from_env()
