"""The planner: a budget (experts per layer, total experts, a ratio, or bytes of VRAM) and a
strategy -> a `Placement`. Pure arithmetic on numpy; nothing here touches a GPU.

Legend: L layers, E experts per layer, H hidden size, I expert intermediate size, G group size.
"""
from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass

import numpy as np

from ._placement import Placement
from ._stats import ExpertStats, _check_counts
from ._strategies import strategy_function

__all__ = ["Budget", "parse_bytes", "expert_nbytes", "plan", "resolve_budget"]

_UNITS = {"": 1, "b": 1,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'24GiB' -> 25769803776. Units: B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB and the bare
    K/M/G/T (powers of 1024), case-insensitive. An int is returned as is."""
    if isinstance(text, bool):
        raise TypeError("a byte size must be an int or a string like '24GiB', got a bool")
    if isinstance(text, (int, np.integer)):
        if text < 0:
            raise ValueError(f"a byte size must be >= 0, got {text}")
        return int(text)
    if not isinstance(text, str):
        raise TypeError(f"a byte size must be an int or a string like '24GiB', got {type(text).__name__}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte size (examples: '24GiB', '512MiB', '1.5GB', '1000000')")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class Budget:
    """How many experts may go to the GPU. kind: 'per_layer' | 'total' | 'ratio' | 'bytes'."""

    kind: str
    value: float

    def __post_init__(self):
        if self.kind not in ("per_layer", "total", "ratio", "bytes"):
            raise ValueError(f"Budget.kind must be per_layer, total, ratio or bytes, got {self.kind!r}")
        v = self.value
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not math.isfinite(v):
            raise ValueError(f"Budget value must be a finite number, got {v!r}")
        if self.kind == "ratio":
            if not 0 < v <= 1:
                raise ValueError(f"a ratio budget must be in (0, 1], got {v}")
        elif v < 0 or v != int(v):
            raise ValueError(f"a {self.kind} budget must be a non-negative integer, got {v}")

    @classmethod
    def per_layer(cls, n: int) -> "Budget":
        return cls("per_layer", n)

    @classmethod
    def total(cls, n: int) -> "Budget":
        return cls("total", n)

    @classmethod
    def ratio(cls, r: float) -> "Budget":
        return cls("ratio", r)

    @classmethod
    def bytes(cls, n: int | str) -> "Budget":
        return cls("bytes", parse_bytes(n))

    @classmethod
    def parse(cls, value) -> "Budget":
        """A Budget from: a Budget; an int (total experts); a float in (0, 1] (ratio of all experts);
        or a string: '24GiB' / '512MB' (bytes), '25%' or '0.25' (ratio), '8/layer' (per layer),
        '96' (total)."""
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise TypeError("budget: expected a count, ratio, byte size or Budget, got a bool")
        if isinstance(value, (int, np.integer)):
            return cls.total(int(value))
        if isinstance(value, (float, np.floating)):
            return cls.ratio(float(value))
        if not isinstance(value, str):
            raise TypeError(f"budget: expected a count, ratio, byte size or Budget, got {type(value).__name__}")
        s = value.strip().lower().replace(" ", "")
        m = re.fullmatch(r"([0-9]+)(?:/layer|perlayer|/l)", s)
        if m:
            return cls.per_layer(int(m.group(1)))
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)%", s)
        if m:
            return cls.ratio(float(m.group(1)) / 100)
        if re.fullmatch(r"[0-9]+", s):
            return cls.total(int(s))
        if re.fullmatch(r"[0-9]*\.[0-9]+", s):
            return cls.ratio(float(s))
        try:
            return cls.bytes(parse_bytes(s))
        except ValueError:
            raise ValueError(f"cannot read budget {value!r}; examples: '24GiB' (VRAM), '25%' or 0.25 "
                             f"(ratio of all experts), '8/layer' (per layer), 96 (total experts)") from None


_DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2, "fp32": 4, "float32": 4}


def expert_nbytes(hidden: int, intermediate: int, dtype: str = "bf16", *, group_size: int = 128) -> int:
    """GPU bytes of one expert (gate and up [I, H] each, down [H, I]) in a GPU dtype.

    bf16/fp16/fp32: 3*H*I elements. fp8: e4m3 bytes plus fp32 scales per 128x128 block (DeepSeek
    style). int8: bytes plus one fp32 scale per output row. int4: half a byte per weight plus one
    fp32 scale per group of G along the reduction axis.
    """
    for name, v in (("hidden", hidden), ("intermediate", intermediate), ("group_size", group_size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    H, I = int(hidden), int(intermediate)
    d = str(dtype).lower()
    if d in _DTYPE_BYTES:
        return 3 * H * I * _DTYPE_BYTES[d]
    if d in ("fp8", "fp8_e4m3", "e4m3"):
        blocks = 2 * math.ceil(I / 128) * math.ceil(H / 128) + math.ceil(H / 128) * math.ceil(I / 128)
        return 3 * H * I + 4 * blocks
    if d == "int8":
        return 3 * H * I + 4 * (2 * I + H)
    if d == "int4":
        return (3 * H * I + 1) // 2 + 4 * (2 * I * math.ceil(H / group_size) + H * math.ceil(I / group_size))
    raise ValueError(f"unknown GPU dtype {dtype!r}; expected bf16, fp16, fp32, fp8, int8 or int4")


def _shape_and_counts(stats_or_shape):
    """(L, E, counts or None, model or None) from ExpertStats, a [L, E] array, or an (L, E) pair."""
    if isinstance(stats_or_shape, ExpertStats):
        return stats_or_shape.num_layers, stats_or_shape.num_experts, stats_or_shape.counts, stats_or_shape.model
    if isinstance(stats_or_shape, tuple) and len(stats_or_shape) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in stats_or_shape):
        L, E = (int(v) for v in stats_or_shape)
        if L < 1 or E < 1:
            raise ValueError(f"shape (L, E) must be positive, got {stats_or_shape}")
        return L, E, None, None
    if isinstance(stats_or_shape, (np.ndarray, list)) or hasattr(stats_or_shape, "shape"):
        src = stats_or_shape
        if type(src).__module__.split(".")[0] == "torch":
            src = src.detach().cpu().double().numpy()
        c = _check_counts(src, "statistics")
        return c.shape[0], c.shape[1], c, None
    raise TypeError("plan: expected ExpertStats, a [L, E] counts array, or an (L, E) shape; "
                    f"got {type(stats_or_shape).__name__}")


def resolve_budget(budget, num_layers: int, num_experts: int, *, expert_bytes: int | None = None,
                   reserve_bytes: int | str = 0) -> int:
    """Total number of GPU experts a budget allows over ``num_layers`` MoE layers of E experts.

    Not capped at L*E (the planner warns and caps). Raises ValueError for a byte budget that holds
    less than one expert or a ratio that rounds to zero experts.
    """
    b = Budget.parse(budget)
    reserve = parse_bytes(reserve_bytes)
    if reserve and b.kind != "bytes":
        raise ValueError("reserve_bytes applies to a byte budget (e.g. '24GiB'), "
                         f"not to a {b.kind} budget")
    all_experts = num_layers * num_experts
    if b.kind == "per_layer":
        return int(b.value) * num_layers
    if b.kind == "total":
        return int(b.value)
    if b.kind == "ratio":
        n = int(math.floor(b.value * all_experts + 1e-9))
        if n == 0:
            raise ValueError(f"ratio budget {b.value:g} of {all_experts} experts is less than one expert")
        return n
    if expert_bytes is None:
        raise ValueError("a byte budget needs expert_bytes (the GPU size of one expert; see expert_nbytes)")
    if isinstance(expert_bytes, bool) or not isinstance(expert_bytes, (int, np.integer)) or expert_bytes <= 0:
        raise ValueError(f"expert_bytes must be a positive int, got {expert_bytes!r}")
    avail = int(b.value) - reserve
    if avail < expert_bytes:
        raise ValueError(
            f"budget of {_fmt_bytes(int(b.value))}"
            + (f" minus {_fmt_bytes(reserve)} reserved" if reserve else "")
            + f" is smaller than one expert ({_fmt_bytes(int(expert_bytes))})")
    return avail // int(expert_bytes)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def plan(stats_or_shape, budget, strategy: str = "frequency", *, expert_bytes: int | None = None,
         reserve_bytes: int | str = 0, seed: int = 42, moe_layers=None, model: str | None = None) -> Placement:
    """A placement for a budget and a strategy.

    stats_or_shape: ExpertStats, counts [L, E], or (L, E) when the strategy needs no statistics.
    budget: see ``Budget.parse`` ('24GiB', '25%', 0.25, '8/layer', 96, or a Budget).
    expert_bytes: GPU bytes of one expert (needed for a byte budget; stored for accounting).
    reserve_bytes: bytes kept free out of a byte budget (KV cache, activations).
    moe_layers: indices of the layers that have experts (default: all); the others get none and
        do not count toward per-layer or ratio budgets (e.g. DeepSeek's first dense layers).
    A budget larger than all experts warns and puts every expert on the GPU.
    """
    L, E, counts, stats_model = _shape_and_counts(stats_or_shape)
    fn = strategy_function(strategy)
    if moe_layers is None:
        layers = np.arange(L)
    else:
        layers = np.unique(np.asarray(list(moe_layers), dtype=np.int64))
        if layers.size == 0 or layers.min() < 0 or layers.max() >= L:
            raise ValueError(f"moe_layers must be a non-empty list of layer indices in [0, {L}), got {moe_layers!r}")
    Lm = int(layers.size)
    n = resolve_budget(budget, Lm, E, expert_bytes=expert_bytes, reserve_bytes=reserve_bytes)
    if n > Lm * E:
        warnings.warn(f"GPU budget allows {n} experts but the model has only {Lm * E} "
                      f"({Lm} MoE layers x {E}); placing every expert on the GPU", stacklevel=2)
        n = Lm * E
    sub_counts = None if counts is None else counts[layers]
    sub = fn(n, Lm, E, counts=sub_counts, seed=seed)
    mask = np.zeros((L, E), dtype=bool)
    mask[layers] = sub
    return Placement.from_mask(mask, expert_bytes=expert_bytes, model=model or stats_model)
