"""Launch configs of the fused-MoE kernels: a frozen dataclass, a pure heuristic, and tuned JSON tables.

A tuned table (kt/gpu_ops/configs/<gpu>.json, written by benchmarks/bench_gpu.py) maps a shape key
``"H{H}_I{I}_{wdtype}"`` to ``{"<T>": {config fields}}``; `pick_config` uses the entry whose T is the
nearest at or above the call's T (else the largest), and the heuristic when the shape has no entry.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

__all__ = ["MoEConfig", "pick_config", "shape_key", "table_name", "load_table"]

_TABLE_DIR = Path(__file__).with_name("configs")


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and (v & (v - 1)) == 0


@dataclass(frozen=True)
class MoEConfig:
    """Tile sizes and launch parameters, shared by the gate+up and the down kernel.

    block_m rows of sorted token-slots per program (also the alignment of each slot's rows),
    block_n output columns, block_k reduction depth per step; group_m row blocks walk the columns
    together (L2 reuse of weight tiles); num_warps / num_stages as in Triton.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for f in ("block_m", "block_n", "block_k"):
            v = getattr(self, f)
            if not _pow2(v) or v < 16:
                raise ValueError(f"MoEConfig.{f} must be a power of two >= 16, got {v!r}")
        if not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"MoEConfig.group_m must be a positive int, got {self.group_m!r}")
        if not _pow2(self.num_warps) or self.num_warps > 16:
            raise ValueError(f"MoEConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
        if not isinstance(self.num_stages, int) or not 1 <= self.num_stages <= 8:
            raise ValueError(f"MoEConfig.num_stages must be in [1, 8], got {self.num_stages!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"MoEConfig: unknown fields {sorted(unknown)}; expected a subset of {sorted(names)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)


def shape_key(hidden: int, inter: int, weight_dtype: str) -> str:
    """Key of a tuned table: ``H{H}_I{I}_{wdtype}`` with wdtype 'bf16', 'fp16', 'fp32' or 'int8'."""
    return f"H{hidden}_I{inter}_{weight_dtype}"


def _heuristic(num_tokens: int, top_k: int, num_slots: int, hidden: int, inter: int,
               weight_dtype: str) -> MoEConfig:
    # Rows per active slot decide the regime. Few rows: the kernels stream weights (memory bound), so
    # use the smallest row block and narrow column blocks, to have enough programs in flight to pull
    # HBM bandwidth. Many rows: large tiles for tensor-core efficiency.
    # The winners of the H200 sweep (benchmarks/results/gpu.json) shaped these defaults.
    rows_per_slot = num_tokens * top_k / max(1, min(num_slots, num_tokens * top_k))
    bk = 128 if weight_dtype == "int8" else 64
    if rows_per_slot <= 2:
        return MoEConfig(block_m=16, block_n=32, block_k=256, group_m=1, num_warps=4, num_stages=3)
    if rows_per_slot <= 16:
        return MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if rows_per_slot <= 64:
        return MoEConfig(block_m=32, block_n=64, block_k=bk, group_m=4, num_warps=4, num_stages=4)
    if rows_per_slot <= 256:
        return MoEConfig(block_m=64, block_n=64, block_k=bk, group_m=8, num_warps=4, num_stages=4)
    return MoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)


def pick_config(num_tokens: int, top_k: int, num_slots: int, hidden: int, inter: int,
                weight_dtype: str, table: dict | None = None) -> MoEConfig:
    """The launch config for one call (pure: same arguments, same answer).

    num_tokens T, top_k K, num_slots S (GPU experts), hidden H, inter I, weight_dtype 'bf16' /
    'fp16' / 'fp32' / 'int8'; table: a loaded tuned table (see `load_table`) or None.
    """
    for name, v in (("num_tokens", num_tokens), ("top_k", top_k), ("num_slots", num_slots),
                    ("hidden", hidden), ("inter", inter)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"pick_config: {name} must be a non-negative int, got {v!r}")
    if weight_dtype not in ("bf16", "fp16", "fp32", "int8"):
        raise ValueError(f"pick_config: weight_dtype must be 'bf16', 'fp16', 'fp32' or 'int8', got {weight_dtype!r}")
    entries = (table or {}).get(shape_key(hidden, inter, weight_dtype))
    if entries:
        ts = sorted(int(t) for t in entries)
        at_or_above = [t for t in ts if t >= num_tokens]
        t = at_or_above[0] if at_or_above else ts[-1]
        return MoEConfig.from_dict(entries[str(t)])
    return _heuristic(num_tokens, top_k, num_slots, hidden, inter, weight_dtype)


def table_name(device_name: str) -> str | None:
    """Which tuned table fits a GPU, from its name as torch reports it (e.g. 'NVIDIA H200')."""
    name = device_name.upper()
    for key in ("H200", "H100", "H20", "A100", "L40S", "B200"):
        if key in name:
            return key.lower()
    return None


@lru_cache(maxsize=None)
def load_table(name: str | None) -> dict:
    """The tuned table kt/gpu_ops/configs/<name>.json, or {} if there is none."""
    if not name:
        return {}
    path = _TABLE_DIR / f"{name}.json"
    if not path.is_file():
        return {}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of shape keys, found {type(data).__name__}")
    return {k: v for k, v in data.items() if not k.startswith("_")}
