"""GGUF source: ``blk.{L}.ffn_{gate,up,down}_exps.weight`` through the ``gguf`` package.

GGUF stores a [E, N, D] expert stack with ne = (D, N, E); the reader hands it back as a numpy
array [E, N, D] (unquantised types) or [E, N, bytes per row] (block-quantised types). Each expert
is dequantised on its own with ``gguf.quants.dequantize`` (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K,
Q6_K, and whatever else that function supports), so memory stays bounded by one expert's fp32
matrices per worker thread. The fused ``ffn_gate_up_exps`` form is read too (gate rows first).
When the file records ``{arch}.expert_count``, every layer's stacks must hold exactly that many
experts.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np

from ._source_base import LayerExperts, SourceError, check_expert_ids

__all__ = ["GGUFSource", "SUPPORTED_TYPES"]

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K")
_NAME = re.compile(r"^blk\.(?P<L>\d+)\.ffn_(?P<p>gate|up|down|gate_up)_exps\.weight$")


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install 'kt[hf]'") from None
    return gguf


class GGUFSource:
    kind = "gguf"

    def __init__(self, path: Path):
        gguf = _gguf()
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as exc:  # the reader raises ValueError/struct.error/... on bad files
            raise SourceError(f"{self.path}: not a readable GGUF file "
                              f"({type(exc).__name__}: {exc})") from None
        arch_field = self.reader.fields.get("general.architecture")
        self.architecture = str(arch_field.contents()) if arch_field is not None else None
        self.model_type = self.architecture
        self.tensors: dict[int, dict] = {}
        for t in self.reader.tensors:
            m = _NAME.match(t.name)
            if m:
                self.tensors.setdefault(int(m["L"]), {})[m["p"]] = t
        self.moe_layers = sorted(self.tensors)
        count = self.reader.fields.get(f"{self.architecture}.expert_count")
        self.configured = None
        if count is not None:
            try:
                self.configured = int(count.contents())
            except (TypeError, ValueError):
                raise SourceError(self.path, f"{self.architecture}.expert_count to be an integer",
                                  f"{count.contents()!r}") from None
        if not self.moe_layers:
            raise SourceError(f"{self.path}: GGUF (architecture {self.architecture!r}) has no expert "
                              "tensors 'blk.{L}.ffn_{gate,up,down}_exps.weight'")
        first = self.layer(self.moe_layers[0])
        self.num_experts, self.hidden, self.inter = first.num_experts, first.hidden, first.inter

    def identity(self) -> dict:
        st = self.path.stat()
        with open(self.path, "rb") as f:
            head = hashlib.sha256(f.read(1 << 20)).hexdigest()
        return {"kind": "gguf", "path": str(self.path.resolve()), "architecture": self.architecture,
                "files": [{"name": self.path.name, "bytes": st.st_size}], "head_sha256": head}

    def _qtype(self, t):
        """The tensor's quantisation type, checked to be one gguf can dequantise."""
        gguf = _gguf()
        qt = gguf.GGMLQuantizationType(t.tensor_type)
        if qt.name not in SUPPORTED_TYPES:
            # gguf may still dequantise it; accept anything its dequantize knows, name it if not
            try:
                gguf.quants.dequantize(np.asarray(t.data[(0,) * (t.data.ndim - 1)]), qt)
            except NotImplementedError:
                raise SourceError(f"{self.path}: {t.name} has type {qt.name}, which gguf cannot "
                                  f"dequantise; supported: {list(SUPPORTED_TYPES)}") from None
        return qt

    def layer(self, L: int) -> LayerExperts:
        gguf = _gguf()
        ent = self.tensors.get(L)
        if ent is None:
            raise SourceError(f"{self.path}: layer {L} has no expert tensors (MoE layers: {self.moe_layers})")
        fused = "gate_up" in ent
        need = ("gate_up", "down") if fused else ("gate", "up", "down")
        for p in need:
            if p not in ent:
                raise SourceError(f"{self.path}: blk.{L}.ffn_{p}_exps.weight missing")
        # logical shapes from ne (ne[0] = D, ne[1] = N, ne[2] = E)
        shapes = {p: tuple(int(v) for v in ent[p].shape[::-1]) for p in need}
        for p, shp in shapes.items():
            if len(shp) != 3:
                raise SourceError(f"{self.path}: blk.{L}.ffn_{p}_exps.weight is not 3-D ({list(shp)})")
        E, H, I = shapes["down"]
        if fused:
            ok = shapes["gate_up"] == (E, 2 * I, H)
        else:
            ok = shapes["gate"] == (E, I, H) and shapes["up"] == (E, I, H)
        if not ok:
            raise SourceError(f"{self.path}: layer {L} expert shapes {shapes} do not fit "
                              f"down [E, H, I] = [{E}, {H}, {I}]")
        if self.configured is not None:
            check_expert_ids(self.path, L, range(E), self.configured,
                             f"{self.architecture}.expert_count")
        qts = {p: self._qtype(ent[p]) for p in need}
        total = sum(int(ent[p].n_bytes) for p in need)

        def one(p, e, r0=None, r1=None):
            qt = qts[p]
            raw = ent[p].data[e]
            if r0 is not None:
                raw = raw[r0:r1]
            if qt.name == "F32":
                return np.asarray(raw, np.float32)
            if qt.name == "BF16":  # the reader returns BF16 rows as raw bytes or uint16
                return np.ascontiguousarray(raw).view(np.uint16).reshape(raw.shape[0], -1)
            return np.ascontiguousarray(gguf.quants.dequantize(np.asarray(raw), qt), np.float32)

        from ._pack import as_kernel_source

        def get(e):
            if fused:
                mats = one("gate_up", e, 0, I), one("gate_up", e, I, 2 * I), one("down", e)
            else:
                mats = one("gate", e), one("up", e), one("down", e)
            return tuple(as_kernel_source(m) for m in mats)

        return LayerExperts(L, E, H, I, total, get)

    def close(self) -> None:
        self.reader = None
