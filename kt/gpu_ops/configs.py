"""Launch configs of the fused-MoE kernels: a frozen dataclass, a pure heuristic, and tuned JSON tables.

Two paths (see kt/gpu_ops/moe.py): the sorted path (`MoEConfig`: token-slots sorted by slot into row
blocks, grouped GEMMs, a combine) and, for few token-slots (`takes_direct`: N = T*K <= DIRECT_MAX_N, or
T <= DIRECT_MAX_T), the direct path (`DirectConfig`: two launches, no sorting, the combine folded into
the down GEMM).

A tuned table (kt/gpu_ops/configs/<gpu>.json, written by benchmarks/bench_gpu.py) maps a shape key
``"H{H}_I{I}_{wdtype}"`` to ``{"<T>": {config fields}}`` (a direct-path entry has ``"path": "direct"``);
`pick_config` uses the entry of the call's path whose T is the nearest at or above the call's T (else the
largest), and the heuristic when there is none.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path

__all__ = ["MoEConfig", "DirectConfig", "DIRECT_MAX_N", "DIRECT_MAX_T", "takes_direct", "pick_config",
           "config_from_dict", "shape_key", "table_name", "load_table", "table_for_device"]

# Token-slots (T*K) up to which the direct path is the default. H200 (bench_gpu.py --tune, whole
# op): at T=1 it beat the sorted path (qwen3 bf16 20.9 vs 26.8 us, int8 20.5 vs 24.7, mixtral 110 vs
# 119); at T=7 it lost (qwen3 bf16 63 vs 47 us, mixtral 410 vs 345): its down GEMV re-reads an
# expert's rows for every token that uses it.
DIRECT_MAX_N = 8
# Tokens up to which the direct path is the default whatever K is. At T=2 a slot's rows are read at
# most twice. H200, whole op, sorted vs direct: qwen3 T=2 bf16 29.6 vs 24.5 us, int8 32.8 vs 21.2;
# at T=4 the sorted path wins (bf16 47.2 vs 51.6, int8 41.3 vs 43.0), and at T=7 for mixtral too
# (337 vs 366) (docs/decisions.md; git show lab-archive:benchmarks/gpu_decode_path_probe.py).
DIRECT_MAX_T = 2


def takes_direct(num_tokens: int, top_k: int) -> bool:
    """Whether a call of T tokens with top-k K takes the direct path by default (pick_config)."""
    return num_tokens * top_k <= DIRECT_MAX_N or num_tokens <= DIRECT_MAX_T

_TABLE_DIR = Path(__file__).with_name("configs")


def _pow2(v: int) -> bool:
    return isinstance(v, int) and v > 0 and (v & (v - 1)) == 0


def _check_pow2(cls, obj, names, low):
    for f in names:
        v = getattr(obj, f)
        if not _pow2(v) or v < low:
            raise ValueError(f"{cls}.{f} must be a power of two >= {low}, got {v!r}")


def _check_launch(cls, warps, stages, wname="num_warps", sname="num_stages"):
    if not _pow2(warps) or warps > 16:
        raise ValueError(f"{cls}.{wname} must be 1, 2, 4, 8 or 16, got {warps!r}")
    if not isinstance(stages, int) or not 1 <= stages <= 8:
        raise ValueError(f"{cls}.{sname} must be in [1, 8], got {stages!r}")


@dataclass(frozen=True)
class MoEConfig:
    """Sorted path: tile sizes and launch parameters of the gate+up and the down kernel.

    block_m rows of sorted token-slots per program, block_n output columns, block_k reduction depth per
    step; group_m row blocks walk the columns together (L2 reuse of weight tiles); num_warps /
    num_stages as in Triton. The down_* fields, when set, replace the matching field for the down
    kernel only (its K = I is often short and its N = H wide, so its best tiles differ). Each slot's
    rows are padded to ``align_m`` = the larger of block_m and down_block_m (powers of two, so the
    smaller divides it), which both kernels share.

    tma: load the weight tiles through TMA descriptors (Hopper and later, weights contiguous with
    16-byte aligned rows; elsewhere the kernels keep pointer loads). flatten / down_flatten: flatten
    the persistent tile loop with the k loop, so each program loads its next tile while this one's
    epilogue runs; such a kernel runs one program per SM. On the H200 (qwen3 T=4096, docs/decisions.md;
    git show lab-archive:benchmarks/gpu_prefill_probe.py): TMA took gate+up from 138 to 124 us; TMA, a
    flattened loop and bf16 y (fused_moe's choice for bf16 outputs) took the down GEMM from 91 to 67.

    a8 (int8 weights only; fused_moe refuses it otherwise): the gate+up GEMM takes x as two int8
    levels per token (``act_quant2``: about 15 bits of each row, where bf16 keeps 8 of each value)
    and runs on the int8 tensor cores, exact int32 sums, instead of converting every int8 weight
    tile to the compute dtype in the loop. Two int8 products cost what one bf16 product does, and
    the weight tiles go straight from memory to the tensor cores.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int | None = None
    down_block_k: int | None = None
    down_group_m: int | None = None
    down_num_warps: int | None = None
    down_num_stages: int | None = None
    tma: bool = False
    flatten: bool = False
    down_flatten: bool | None = None
    a8: bool = False
    down_block_m: int | None = None  # last: configs are also built positionally

    def __post_init__(self):
        for f in ("tma", "flatten", "down_flatten", "a8"):
            v = getattr(self, f)
            if not (isinstance(v, bool) or (v is None and f == "down_flatten")):
                raise ValueError(f"MoEConfig.{f} must be a bool, got {v!r}")
        _check_pow2("MoEConfig", self, ("block_m", "block_n", "block_k"), 16)
        _check_pow2("MoEConfig", self, [f for f in ("down_block_m", "down_block_n", "down_block_k")
                                        if getattr(self, f) is not None], 16)
        for f in ("group_m", "down_group_m"):
            v = getattr(self, f)
            if (v is not None or f == "group_m") and (not isinstance(v, int) or v < 1):
                raise ValueError(f"MoEConfig.{f} must be a positive int, got {v!r}")
        _check_launch("MoEConfig", self.num_warps, self.num_stages)
        if self.down_num_warps is not None or self.down_num_stages is not None:
            _check_launch("MoEConfig", self.num_warps if self.down_num_warps is None else self.down_num_warps,
                          self.num_stages if self.down_num_stages is None else self.down_num_stages,
                          "down_num_warps", "down_num_stages")

    @property
    def align_m(self) -> int:
        """Rows each slot's token-slots are padded to (shared by both kernels)."""
        return max(self.block_m, self.down_block_m or self.block_m)

    def for_down(self) -> "MoEConfig":
        """The config the down kernel runs with (down_* fields applied)."""
        own = {}
        for f in ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "flatten"):
            v = getattr(self, "down_" + f)
            own[f] = getattr(self, f) if v is None else v
        return MoEConfig(tma=self.tma, **own)

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        return cls(**_known_fields(cls, d))

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None and not (k == "a8" and not v)}


@dataclass(frozen=True)
class DirectConfig:
    """Direct path (few token-slots): launch parameters of its two kernels.

    gate+up: gate_up "scan" (one program per (slot, block_n columns of gate and of up), the slot's
    rows as one tensor-core tile; block_n >= 16) or "pairs" (one GEMV program per (token-slot,
    block_n columns)); block_k reduction depth per step, num_warps / num_stages (for "pairs": how
    many k steps the pipelined loop keeps in flight, 1 = none). down: one program per (token,
    down_block_n columns of H), reading down_block_k of I per step, down_num_warps, down_num_stages
    (as the pairs' num_stages).
    """

    gate_up: str = "scan"
    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3
    down_block_n: int = 16
    down_block_k: int = 1024
    down_num_warps: int = 4
    down_num_stages: int = 1

    def __post_init__(self):
        if self.gate_up not in ("scan", "pairs"):
            raise ValueError(f"DirectConfig.gate_up must be 'scan' or 'pairs', got {self.gate_up!r}")
        _check_pow2("DirectConfig", self, ("block_k", "down_block_k"), 16)
        _check_pow2("DirectConfig", self, ("block_n",), 16 if self.gate_up == "scan" else 1)
        _check_pow2("DirectConfig", self, ("down_block_n",), 1)
        _check_launch("DirectConfig", self.num_warps, self.num_stages)
        _check_launch("DirectConfig", self.down_num_warps, self.down_num_stages, "down_num_warps", "down_num_stages")

    @classmethod
    def from_dict(cls, d: dict) -> "DirectConfig":
        d = dict(d)
        if d.pop("path", "direct") != "direct":
            raise ValueError(f"DirectConfig.from_dict: not a direct-path entry: {d}")
        return cls(**_known_fields(cls, d))

    def to_dict(self) -> dict:
        return {"path": "direct", **asdict(self)}


def _known_fields(cls, d: dict) -> dict:
    names = {f.name for f in fields(cls)}
    unknown = set(d) - names
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}; expected a subset of {sorted(names)}")
    return d


def config_from_dict(d: dict) -> "MoEConfig | DirectConfig":
    """A table entry or a saved config: a DirectConfig if it says ``"path": "direct"``, else a MoEConfig."""
    if not isinstance(d, dict):
        raise ValueError(f"config_from_dict: expected a dict, got {type(d).__name__}")
    return DirectConfig.from_dict(d) if d.get("path") == "direct" else MoEConfig.from_dict(d)


def shape_key(hidden: int, inter: int, weight_dtype: str) -> str:
    """Key of a tuned table: ``H{H}_I{I}_{wdtype}`` with wdtype 'bf16', 'fp16', 'fp32' or 'int8'."""
    return f"H{hidden}_I{inter}_{weight_dtype}"


def _heuristic(num_tokens: int, top_k: int, num_slots: int, hidden: int, inter: int,
               weight_dtype: str) -> MoEConfig:
    # Rows per active slot decide the regime. Few rows: the kernels stream weights (memory bound), so
    # use the smallest row block and narrow column blocks, to have enough programs in flight to pull
    # HBM bandwidth. Many rows: large tiles for tensor-core efficiency.
    # The winners of the H200 sweep (benchmarks/results/h200-xeon16/gpu.json) shaped these defaults.
    rows_per_slot = num_tokens * top_k / max(1, min(num_slots, num_tokens * top_k))
    bk = 128 if weight_dtype == "int8" else 64
    if rows_per_slot <= 2:
        return MoEConfig(block_m=16, block_n=32, block_k=256, group_m=1, num_warps=4, num_stages=3)
    if rows_per_slot <= 16:
        return MoEConfig(block_m=16, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if rows_per_slot <= 64:
        return MoEConfig(block_m=32, block_n=64, block_k=bk, group_m=4, num_warps=4, num_stages=4)
    if weight_dtype == "int8":
        # two-level int8 activations on the int8 tensor cores: on the H200 (bench_gpu.py --tune)
        # they won every int8 case with this many rows (qwen3 / mixtral, T=512 / 4096),
        # by 10-30 % of the whole op, with these gate+up tiles
        return MoEConfig(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3, a8=True,
                         down_block_n=128, down_block_k=64, down_num_warps=4, down_num_stages=4)
    if rows_per_slot <= 256:
        return MoEConfig(block_m=64, block_n=64, block_k=bk, group_m=8, num_warps=4, num_stages=4)
    return MoEConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)


def _direct_heuristic(hidden: int, inter: int) -> DirectConfig:
    # Memory bound: narrow GEMV column blocks for many programs in flight, k loops pipelined (three
    # steps in flight: on the H200 at mixtral T=1 gate+up 59 -> 49 us int8, 73 -> 68 bf16; down
    # 37 -> 31 int8); down reads a whole I row per step when I is short (one load per expert). The
    # H200 sweep's winners at T=1 (bench_gpu.py --tune) shaped these.
    down_k = min(1024, max(16, 1 << (max(inter, 1) - 1).bit_length()))
    return DirectConfig(gate_up="pairs", block_n=4, block_k=1024, num_warps=4, num_stages=3, down_block_n=2,
                        down_block_k=down_k, down_num_warps=2, down_num_stages=3)


def pick_config(num_tokens: int, top_k: int, num_slots: int, hidden: int, inter: int,
                weight_dtype: str, table: dict | None = None) -> "MoEConfig | DirectConfig":
    """The launch config for one call (pure: same arguments, same answer): a DirectConfig when
    ``takes_direct(T, K)`` (T*K <= DIRECT_MAX_N or T <= DIRECT_MAX_T), else a MoEConfig.

    num_tokens T, top_k K, num_slots S (GPU experts), hidden H, inter I, weight_dtype 'bf16' /
    'fp16' / 'fp32' / 'int8'; table: a loaded tuned table (see `load_table`) or None.
    """
    for name, v in (("num_tokens", num_tokens), ("top_k", top_k), ("num_slots", num_slots),
                    ("hidden", hidden), ("inter", inter)):
        if not isinstance(v, int) or v < 0:
            raise ValueError(f"pick_config: {name} must be a non-negative int, got {v!r}")
    if weight_dtype not in ("bf16", "fp16", "fp32", "int8"):
        raise ValueError(f"pick_config: weight_dtype must be 'bf16', 'fp16', 'fp32' or 'int8', got {weight_dtype!r}")
    direct = takes_direct(num_tokens, top_k)
    entries = {t: e for t, e in ((table or {}).get(shape_key(hidden, inter, weight_dtype)) or {}).items()
               if (e.get("path") == "direct") == direct}
    if entries:
        ts = sorted(int(t) for t in entries)
        at_or_above = [t for t in ts if t >= num_tokens]
        t = at_or_above[0] if at_or_above else ts[-1]
        return config_from_dict(entries[str(t)])
    if direct:
        return _direct_heuristic(hidden, inter)
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
    return _read_table(path)


def _read_table(path: Path) -> dict:
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object of shape keys, found {type(data).__name__}")
    table = {k: v for k, v in data.items() if not k.startswith("_")}
    for key, entries in table.items():  # every entry must make a valid config: fail here, not mid-run
        if not isinstance(entries, dict):
            raise ValueError(f"{path}: {key} must map T to configs, found {type(entries).__name__}")
        for t, entry in entries.items():
            try:
                int(t)
                config_from_dict(entry)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: {key} T={t}: {e}") from None
    return table


def table_for_device(device_name: str) -> tuple[dict, str]:
    """(table, where it came from) for a GPU by name: the file KT_GPU_TABLE names (a table
    ``benchmarks/bench_gpu.py --tune`` wrote for this GPU), else the packaged table for the GPU
    (``table_name``), else {} and the heuristic."""
    from ..config import get_config

    path = get_config().gpu_table
    if path is not None:
        if not path.is_file():
            raise ValueError(f"KT_GPU_TABLE={path}: no such file")
        return _read_table(path), f"KT_GPU_TABLE={path}"
    name = table_name(device_name)
    table = load_table(name)
    return (table, f"packaged {name}.json") if table else ({}, "none (the heuristic)")
