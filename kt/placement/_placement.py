"""`Placement`: which (layer, expert) lives in which GPU slot. Data, never a rule on expert ids.

Legend: L layers, E experts per layer. A layer's GPU buffer holds ``n_slots[l]`` experts; an
expert on the GPU occupies one slot, an expert on the CPU has slot -1.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "kt.placement"
FORMAT_VERSION = 1

__all__ = ["Placement", "FORMAT", "FORMAT_VERSION"]


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.setflags(write=False)
    return a


def _as_2d(name: str, value, dtype) -> np.ndarray:
    try:
        a = np.asarray(value)
    except Exception as exc:  # e.g. ragged lists
        raise TypeError(f"{name}: expected an [L, E] array, got {type(value).__name__} ({exc})") from None
    if a.ndim != 2:
        raise ValueError(f"{name}: expected an [L, E] array, found shape {a.shape}")
    if dtype is bool:
        if a.dtype != np.bool_:
            raise TypeError(f"{name}: expected dtype bool, found {a.dtype}")
        return a
    if not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"{name}: expected an integer dtype, found {a.dtype}")
    return a.astype(np.int32)


@dataclass(frozen=True, eq=False)
class Placement:
    """Which experts are on the GPU, and in which slot of their layer's GPU buffer.

    gpu_mask: [L, E] bool, True = the expert runs on the GPU.
    gpu_slot: [L, E] int32, the expert's slot in its layer's GPU buffer, -1 = CPU.
    n_slots: [L] int, slots of each layer's GPU buffer (default: the layer's GPU expert count).
    expert_bytes: bytes one expert takes on the GPU (gate+up+down in the GPU dtype), for accounting.
    model: optional identity of the model the placement was made for (checked on load).

    Invariants (checked at construction): ``gpu_mask == (gpu_slot >= 0)``; in each layer the used
    slots are unique and in ``[0, n_slots[l])``. Arrays are stored as read-only copies.
    """

    gpu_mask: np.ndarray
    gpu_slot: np.ndarray
    n_slots: np.ndarray | None = None
    expert_bytes: int | None = None
    model: str | None = field(default=None)

    def __post_init__(self):
        mask = _as_2d("gpu_mask", self.gpu_mask, bool)
        slot = _as_2d("gpu_slot", self.gpu_slot, int)
        if mask.shape != slot.shape:
            raise ValueError(f"gpu_mask shape {mask.shape} != gpu_slot shape {slot.shape}")
        L, E = slot.shape
        if L < 1 or E < 1:
            raise ValueError(f"a placement needs at least one layer and one expert, found [L, E] = {slot.shape}")
        if (slot < -1).any():
            l, e = np.argwhere(slot < -1)[0]
            raise ValueError(f"gpu_slot[{l}, {e}] = {slot[l, e]}: expected -1 (CPU) or a slot index >= 0")
        if not np.array_equal(mask, slot >= 0):
            l, e = np.argwhere(mask != (slot >= 0))[0]
            raise ValueError(
                f"gpu_mask and gpu_slot disagree at layer {l}, expert {e}: "
                f"gpu_mask={bool(mask[l, e])} but gpu_slot={int(slot[l, e])}")
        counts = mask.sum(axis=1)
        if self.n_slots is None:
            n_slots = counts.astype(np.int64)
        else:
            n_slots = np.asarray(self.n_slots)
            if n_slots.ndim == 0:
                n_slots = np.full(L, int(n_slots), dtype=np.int64)
            if n_slots.shape != (L,) or not np.issubdtype(n_slots.dtype, np.integer):
                raise ValueError(f"n_slots: expected {L} integers (one per layer), found {n_slots!r}")
            n_slots = n_slots.astype(np.int64)
            if (n_slots < 0).any() or (n_slots > E).any():
                raise ValueError(f"n_slots must lie in [0, E={E}], found {n_slots.tolist()}")
        for l in range(L):
            used = slot[l][slot[l] >= 0]
            if used.size and used.max() >= n_slots[l]:
                raise ValueError(
                    f"layer {l}: slot {int(used.max())} used but the layer has n_slots={int(n_slots[l])}")
            if np.unique(used).size != used.size:
                vals, c = np.unique(used, return_counts=True)
                raise ValueError(f"layer {l}: slot {int(vals[c > 1][0])} holds more than one expert")
        if self.expert_bytes is not None:
            if isinstance(self.expert_bytes, bool) or not isinstance(self.expert_bytes, (int, np.integer)) \
                    or self.expert_bytes <= 0:
                raise ValueError(f"expert_bytes must be a positive int, got {self.expert_bytes!r}")
            object.__setattr__(self, "expert_bytes", int(self.expert_bytes))
        if self.model is not None and not isinstance(self.model, str):
            raise TypeError(f"model must be a str or None, got {type(self.model).__name__}")
        object.__setattr__(self, "gpu_mask", _frozen(mask))
        object.__setattr__(self, "gpu_slot", _frozen(slot))
        object.__setattr__(self, "n_slots", _frozen(n_slots))

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_slots(cls, gpu_slot, *, n_slots=None, expert_bytes=None, model=None) -> "Placement":
        """From gpu_slot [L, E] alone (the mask is ``gpu_slot >= 0``)."""
        slot = _as_2d("gpu_slot", gpu_slot, int)
        return cls(slot >= 0, slot, n_slots=n_slots, expert_bytes=expert_bytes, model=model)

    @classmethod
    def from_mask(cls, gpu_mask, *, n_slots=None, expert_bytes=None, model=None) -> "Placement":
        """From gpu_mask [L, E] bool; slots are assigned in expert order (lowest id -> slot 0)."""
        mask = _as_2d("gpu_mask", gpu_mask, bool)
        slot = np.where(mask, np.cumsum(mask, axis=1) - 1, -1).astype(np.int32)
        return cls(mask, slot, n_slots=n_slots, expert_bytes=expert_bytes, model=model)

    @classmethod
    def all_cpu(cls, num_layers: int, num_experts: int, **kw) -> "Placement":
        _check_dims(num_layers, num_experts)
        return cls.from_mask(np.zeros((num_layers, num_experts), dtype=bool), **kw)

    @classmethod
    def all_gpu(cls, num_layers: int, num_experts: int, **kw) -> "Placement":
        _check_dims(num_layers, num_experts)
        return cls.from_mask(np.ones((num_layers, num_experts), dtype=bool), **kw)

    @classmethod
    def from_contiguous(cls, num_layers: int, num_experts: int, num_gpu_experts: int, **kw) -> "Placement":
        """kt-kernel's / upstream SGLang's ``num_gpu_experts=n``: experts [0, n) of every layer on the GPU.

        This constructor is the only place in kt where that convention exists.
        """
        _check_dims(num_layers, num_experts)
        n = num_gpu_experts
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= num_experts:
            raise ValueError(f"num_gpu_experts must be an int in [0, {num_experts}], got {n!r}")
        mask = np.zeros((num_layers, num_experts), dtype=bool)
        mask[:, :n] = True
        return cls.from_mask(mask, **kw)

    # ------------------------------------------------------------------ queries

    @property
    def num_layers(self) -> int:
        return int(self.gpu_slot.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.gpu_slot.shape[1])

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_layers, self.num_experts)

    def _layer(self, layer: int) -> int:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        return int(layer)

    def row(self, layer: int) -> np.ndarray:
        """gpu_slot[layer]: [E] int32 (read-only), -1 = CPU. What one MoE layer needs."""
        return self.gpu_slot[self._layer(layer)]

    def num_gpu_experts(self, layer: int | None = None) -> int:
        """GPU experts of one layer, or of all layers when ``layer`` is None."""
        if layer is None:
            return int(self.gpu_mask.sum())
        return int(self.gpu_mask[self._layer(layer)].sum())

    def gpu_counts(self) -> np.ndarray:
        """[L] GPU experts per layer."""
        return self.gpu_mask.sum(axis=1)

    def experts_in_slots(self, layer: int) -> np.ndarray:
        """[n_slots[layer]] int: the expert held by each slot, -1 for an empty slot."""
        l = self._layer(layer)
        out = np.full(int(self.n_slots[l]), -1, dtype=np.int64)
        e = np.flatnonzero(self.gpu_slot[l] >= 0)
        out[self.gpu_slot[l, e]] = e
        return out

    # ------------------------------------------------------------------ accounting

    @property
    def total_slots(self) -> int:
        return int(self.n_slots.sum())

    def gpu_bytes(self, expert_bytes: int | None = None) -> int:
        """Bytes of all GPU slot buffers: ``sum(n_slots) * expert_bytes`` (bytes per slot = per expert)."""
        eb = self.expert_bytes if expert_bytes is None else int(expert_bytes)
        if eb is None:
            raise ValueError("gpu_bytes: this placement has no expert_bytes; pass expert_bytes=")
        return self.total_slots * eb

    # ------------------------------------------------------------------ comparison and checks

    def check_model(self, num_layers: int, num_experts: int, model: str | None = None) -> None:
        """Raise ValueError unless this placement was made for a model of this shape (and name)."""
        if (num_layers, num_experts) != self.shape:
            raise ValueError(
                f"placement is for [L, E] = {list(self.shape)} (model {self.model!r}), but the model has "
                f"num_layers={num_layers}, num_experts={num_experts}")
        if model is not None and self.model is not None and model != self.model:
            raise ValueError(f"placement was made for model {self.model!r}, not {model!r}")

    def moves(self, new: "Placement") -> list[tuple[int, int, int, int]]:
        """Slot writes that turn this placement into ``new``: [(layer, slot, old_expert, new_expert)].

        old_expert is -1 for a slot that was empty. Experts that keep their slot are not listed;
        an expert that changes slot within a layer is listed as a write to its new slot.
        """
        if new.shape != self.shape:
            raise ValueError(f"moves: shapes differ, {self.shape} vs {new.shape}")
        out = []
        for l in range(self.num_layers):
            old_s, new_s = self.experts_in_slots(l), new.experts_in_slots(l)
            n = max(old_s.size, new_s.size)
            old_s = np.pad(old_s, (0, n - old_s.size), constant_values=-1)
            new_s = np.pad(new_s, (0, n - new_s.size), constant_values=-1)
            for s in np.flatnonzero((old_s != new_s) & (new_s >= 0)):
                out.append((l, int(s), int(old_s[s]), int(new_s[s])))
        return out

    def __eq__(self, other) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (np.array_equal(self.gpu_slot, other.gpu_slot) and np.array_equal(self.n_slots, other.n_slots)
                and self.expert_bytes == other.expert_bytes and self.model == other.model)

    def __hash__(self) -> int:
        return hash((self.gpu_slot.tobytes(), self.gpu_slot.shape, self.n_slots.tobytes(),
                     self.expert_bytes, self.model))

    def __repr__(self) -> str:
        c = self.gpu_counts()
        return (f"Placement(L={self.num_layers}, E={self.num_experts}, gpu_experts={int(c.sum())} "
                f"[per layer {int(c.min())}..{int(c.max())}], model={self.model!r})")

    # ------------------------------------------------------------------ files

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model": self.model,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "expert_bytes": self.expert_bytes,
            "n_slots": self.n_slots.tolist(),
            "gpu_slot": self.gpu_slot.tolist(),
        }

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "placement") -> "Placement":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"{source}: not a kt placement (expected \"format\": \"{FORMAT}\")")
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"{source}: placement format version {d.get('version')!r} "
                             f"is not supported (this kt reads version {FORMAT_VERSION})")
        for key in ("num_layers", "num_experts", "gpu_slot", "n_slots"):
            if key not in d:
                raise ValueError(f"{source}: missing field {key!r}")
        try:
            slot = np.array(d["gpu_slot"], dtype=np.int64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}: gpu_slot is not an [L, E] integer table ({exc})") from None
        if slot.shape != (d["num_layers"], d["num_experts"]):
            raise ValueError(f"{source}: gpu_slot has shape {slot.shape}, but the file says "
                             f"num_layers={d['num_layers']}, num_experts={d['num_experts']}")
        try:
            return cls.from_slots(slot, n_slots=np.array(d["n_slots"], dtype=np.int64),
                                  expert_bytes=d.get("expert_bytes"), model=d.get("model"))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{source}: {exc}") from None

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON (one row of gpu_slot per line, so diffs stay readable)."""
        path = Path(path)
        d = self.to_dict()
        rows = d.pop("gpu_slot")
        lines = [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in d.items()]
        body = ",\n".join("  " + json.dumps(r) for r in rows)
        path.write_text("{\n" + "\n".join(lines) + f"\n \"gpu_slot\": [\n{body}\n ]\n}}\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, num_layers: int | None = None, num_experts: int | None = None,
             model: str | None = None) -> "Placement":
        """Read a placement JSON; with num_layers/num_experts (and model) given, check it fits the model."""
        path = Path(path)
        if not path.is_file():  # (a FIFO or a device would block the read, a directory fail it)
            what = "no such file" if not path.exists() else "not a regular file"
            raise ValueError(f"{path}: {what} (expected a placement JSON written by `kt placement plan`)")
        try:
            d = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else f"not valid JSON: {exc}"
            raise ValueError(f"{path}: not a placement JSON ({why})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: not a placement JSON (the top level is a {type(d).__name__}, "
                             "expected an object)")
        try:
            p = cls.from_dict(d, source=str(path))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{path}: not a placement JSON ({type(exc).__name__}: {exc})") from None
        if num_layers is not None or num_experts is not None:
            p.check_model(num_layers if num_layers is not None else p.num_layers,
                          num_experts if num_experts is not None else p.num_experts, model)
        elif model is not None:
            p.check_model(p.num_layers, p.num_experts, model)
        return p


def _check_dims(num_layers, num_experts) -> None:
    for name, v in (("num_layers", num_layers), ("num_experts", num_experts)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
