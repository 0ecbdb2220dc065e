"""Source checkpoints: find the routed-expert tensors of each MoE layer of a Hugging Face checkpoint.

Legend: E experts, H hidden size, I expert intermediate size, L layer index.

Supported families (detected from ``config.json``'s ``model_type``):

- Qwen2-MoE / Qwen3-MoE: ``model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight``
  (the shared expert ``mlp.shared_expert`` is not a routed expert and is skipped);
- Mixtral: ``model.layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` (w1 gate, w3 up);
- DeepSeek-V2 / V3 (and Kimi-K2, same layout): ``model.layers.{L}.mlp.experts.{e}.*``; dense layers
  (``first_k_dense_replace``) have no experts and ``mlp.shared_experts`` is skipped; layers at or
  beyond ``num_hidden_layers`` (the multi-token-prediction layer of V3) are skipped;
- fused forms (transformers 5): ``...experts.gate_up_proj`` [E, 2I, H] (gate rows first) and
  ``...experts.down_proj`` [E, H, I]; the transposed [E, H, 2I] / [E, I, H] forms are detected by
  shape (when H == 2I the [E, 2I, H] reading is taken).

Tensor dtypes: bf16 and fp32 are read in place from the mapping; fp16 is widened per expert; fp8
e4m3 with ``weight_scale_inv`` block scales (``quantization_config.weight_block_size``, default
128 x 128) is dequantised per expert.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ._safetensors_io import SafetensorsError, SafetensorsFile

__all__ = ["SourceError", "open_source", "HFSource", "LayerExperts", "FAMILIES"]


class SourceError(ValueError):
    """A source checkpoint that cannot be converted (the message names the file/architecture)."""


@dataclass(frozen=True)
class Family:
    block: str                 # module holding the experts: "mlp" or "block_sparse_moe"
    names: tuple[str, str, str]  # gate, up, down projection names
    experts_key: str           # config key with E
    inter_key: str             # config key with I


_QWEN = Family("mlp", ("gate_proj", "up_proj", "down_proj"), "num_experts", "moe_intermediate_size")
_DS = Family("mlp", ("gate_proj", "up_proj", "down_proj"), "n_routed_experts", "moe_intermediate_size")
FAMILIES: dict[str, Family] = {
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "mixtral": Family("block_sparse_moe", ("w1", "w3", "w2"), "num_local_experts", "intermediate_size"),
    "deepseek_v2": _DS,
    "deepseek_v3": _DS,
    "kimi_k2": _DS,
}


@dataclass
class LayerExperts:
    """The routed experts of one MoE layer: per-expert matrices as kernel sources.

    ``matrices(e)`` returns (gate [I, H], up [I, H], down [H, I]), each a uint16 (bf16 bits) or
    float32 array: views of the mapped file where the stored dtype allows, else a per-expert
    fp32 temporary (fp16, fp8, GGUF quantised types).
    """

    layer: int
    num_experts: int
    hidden: int
    inter: int
    source_bytes: int
    _get: object = field(repr=False)

    def matrices(self, e: int):
        return self._get(e)


def _sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def open_source(path: str | Path):
    """An HF checkpoint directory (config.json + safetensors) or a ``.gguf`` file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf" or (path.is_file() and _is_gguf(path)):
        from ._gguf import GGUFSource

        return GGUFSource(path)
    if path.is_dir():
        return HFSource(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint (expected a Hugging Face model "
                                "directory with config.json, or a .gguf file)")
    raise SourceError(f"{path}: not a model directory or a GGUF file")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


_FP8_DTYPES = ("F8_E4M3",)


class HFSource:
    """A Hugging Face safetensors checkpoint (single file, several, or indexed shards)."""

    kind = "hf"

    def __init__(self, model_dir: Path):
        self.root = Path(model_dir)
        cfg_path = self.root / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path}: missing (a Hugging Face checkpoint needs config.json)")
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as exc:
            raise SourceError(f"{cfg_path}: not valid JSON ({exc})") from None
        self.config = cfg
        self.model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        self.architecture = archs[0] if archs else None
        fam = FAMILIES.get(self.model_type)
        if fam is None:
            raise SourceError(
                f"{cfg_path}: unknown architecture {self.architecture!r} (model_type "
                f"{self.model_type!r}); kt convert supports model_type {sorted(FAMILIES)}")
        self.family = fam
        self._open: dict[str, SafetensorsFile] = {}
        self._files = self._tensor_files()
        self._index_tensors()

    # ------------------------------------------------------------------ discovery
    def _tensor_files(self) -> dict[str, list[str]]:
        """file name -> tensor names in it."""
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise SourceError(f"{index}: malformed index ({exc})") from None
            files: dict[str, list[str]] = {}
            for name, fname in wm.items():
                files.setdefault(fname, []).append(name)
            for fname in files:
                if not (self.root / fname).exists():
                    raise FileNotFoundError(f"{self.root / fname}: shard listed in {index.name} is missing")
            return files
        shards = sorted(p.name for p in self.root.glob("*.safetensors"))
        if not shards:
            raise SourceError(f"{self.root}: no *.safetensors files (and no model.safetensors.index.json)")
        return {f: self._file(f).keys() for f in shards}

    def _file(self, fname: str) -> SafetensorsFile:
        f = self._open.get(fname)
        if f is None:
            try:
                f = SafetensorsFile(self.root / fname)
            except SafetensorsError as exc:
                raise SourceError(str(exc)) from None
            self._open[fname] = f
        return f

    def _index_tensors(self) -> None:
        fam = self.family
        gate_n, up_n, down_n = fam.names
        blk = re.escape(fam.block)
        per = re.compile(rf"^(?P<pre>.*?)layers\.(?P<L>\d+)\.{blk}\.experts\.(?P<e>\d+)\."
                         rf"(?P<p>{gate_n}|{up_n}|{down_n})\.(?P<kind>weight|weight_scale_inv)$")
        fused = re.compile(rf"^(?P<pre>.*?)layers\.(?P<L>\d+)\.{blk}\.experts\."
                           rf"(?P<p>gate_up_proj|down_proj)(?:\.weight)?$")
        n_layers = self.config.get("num_hidden_layers")
        self.per_expert: dict[int, dict] = {}   # L -> {(e, proj, kind): (file, name)}
        self.fused: dict[int, dict] = {}        # L -> {proj: (file, name)}
        prefixes: dict[int, str] = {}
        self.skipped_layers: list[int] = []
        for fname, names in self._files.items():
            for name in names:
                m = per.match(name)
                mf = None if m else fused.match(name)
                mm = m or mf
                if mm is None:
                    continue
                L = int(mm["L"])
                if n_layers is not None and L >= n_layers:
                    if L not in self.skipped_layers:
                        self.skipped_layers.append(L)
                    continue
                if prefixes.setdefault(L, mm["pre"]) != mm["pre"]:
                    raise SourceError(f"{self.root}: experts of layer {L} appear under two prefixes "
                                      f"{prefixes[L]!r} and {mm['pre']!r}")
                if m:
                    self.per_expert.setdefault(L, {})[(int(m["e"]), m["p"], m["kind"])] = (fname, name)
                else:
                    self.fused.setdefault(L, {})[mf["p"]] = (fname, name)
        self.moe_layers = sorted(set(self.per_expert) | set(self.fused))
        if not self.moe_layers:
            raise SourceError(
                f"{self.root}: checkpoint has no routed-expert tensors (architecture "
                f"{self.architecture!r}; looked for '...layers.{{L}}.{fam.block}.experts.{{e}}."
                f"{{{gate_n},{up_n},{down_n}}}.weight' and fused '...experts.gate_up_proj')")
        first = self.layer(self.moe_layers[0])
        self.hidden, self.num_experts, self.inter = first.hidden, first.num_experts, first.inter

    def _check_config(self, L: int, H: int, I: int) -> None:
        for key, got in (("hidden_size", H), (self.family.inter_key, I)):
            want = self.config.get(key)
            if want is not None and int(want) != got:
                raise SourceError(f"{self.root}: layer {L} experts have {key} = {got} but "
                                  f"config.json says {want}")

    def identity(self) -> dict:
        files = [{"name": f, "bytes": (self.root / f).stat().st_size} for f in sorted(self._files)]
        return {"kind": "hf", "path": str(self.root.resolve()),
                "config_sha256": _sha256_file(self.root / "config.json"), "files": files}

    # ------------------------------------------------------------------ one layer
    def _fp8_block(self) -> tuple[int, int]:
        q = self.config.get("quantization_config") or {}
        b = q.get("weight_block_size") or [128, 128]
        return int(b[0]), int(b[1])

    def _tensor(self, ref):
        fname, name = ref
        f = self._file(fname)
        return f.get(name), f.dtype(name)

    def layer(self, L: int) -> LayerExperts:
        if L in self.fused:
            return self._fused_layer(L)
        if L not in self.per_expert:
            raise SourceError(f"{self.root}: layer {L} has no routed experts "
                              f"(MoE layers: {self.moe_layers})")
        entries = self.per_expert[L]
        gate_n, up_n, down_n = self.family.names
        experts = sorted({e for (e, _, kind) in entries if kind == "weight"})
        E = len(experts)
        if experts != list(range(E)):
            raise SourceError(f"{self.root}: layer {L}: expert ids {experts[:8]}... are not 0..{E - 1}")
        want_e = self.config.get(self.family.experts_key)
        if want_e is not None and int(want_e) != E:
            raise SourceError(f"{self.root}: layer {L} has {E} experts but config.json "
                              f"{self.family.experts_key} = {want_e}")
        for e in experts:
            for p in self.family.names:
                if (e, p, "weight") not in entries:
                    raise SourceError(f"{self.root}: layer {L} expert {e}: tensor '{p}.weight' missing")
        g0, dt = self._tensor(entries[(0, gate_n, "weight")])
        I, H = (int(s) for s in g0.shape)
        self._check_config(L, H, I)
        total = 0
        for e in experts:
            for p, shp in ((gate_n, (I, H)), (up_n, (I, H)), (down_n, (H, I))):
                fname, name = entries[(e, p, "weight")]
                f = self._file(fname)
                if f.shape(name) != shp:
                    raise SourceError(f"{self.root / fname}: {name} has shape {list(f.shape(name))}, "
                                      f"expected {list(shp)} (E={E}, H={H}, I={I})")
                if f.dtype(name) in _FP8_DTYPES and (e, p, "weight_scale_inv") not in entries:
                    raise SourceError(f"{self.root / fname}: {name} is fp8 but "
                                      f"{name}_scale_inv is missing")
                total += f.get(name).nbytes
        block = self._fp8_block()

        def get(e):
            return tuple(self._matrix(entries, e, p, block) for p in (gate_n, up_n, down_n))

        return LayerExperts(L, E, H, I, total, get)

    def _matrix(self, entries, e, p, block):
        from ._pack import as_kernel_source

        w, dt = self._tensor(entries[(e, p, "weight")])
        if dt in _FP8_DTYPES:
            from ._quant_kernels import fp8_e4m3_block_dequant

            s, sdt = self._tensor(entries[(e, p, "weight_scale_inv")])
            s = np.asarray(s, np.float32) if sdt == "F32" else _to_f32(s, sdt)
            n, d = w.shape
            bn, bd = block
            if s.shape != (-(-n // bn), -(-d // bd)):
                raise SourceError(f"{self.root}: {entries[(e, p, 'weight')][1]}_scale_inv has shape "
                                  f"{list(s.shape)}, expected {[-(-n // bn), -(-d // bd)]} for "
                                  f"{bn}x{bd} blocks of a [{n}, {d}] weight")
            out = np.empty((n, d), np.float32)
            fp8_e4m3_block_dequant(w, s, bn, bd, out)
            return as_kernel_source(out)
        return as_kernel_source(_to_f32(w, dt) if dt not in ("BF16", "F32", "F16", "F64") else w)

    def _fused_layer(self, L: int) -> LayerExperts:
        ent = self.fused[L]
        for p in ("gate_up_proj", "down_proj"):
            if p not in ent:
                raise SourceError(f"{self.root}: layer {L}: fused experts tensor '{p}' missing")
        gu, gdt = self._tensor(ent["gate_up_proj"])
        dn, ddt = self._tensor(ent["down_proj"])
        for (fname, name), dt in ((ent["gate_up_proj"], gdt), (ent["down_proj"], ddt)):
            if dt not in ("BF16", "F32", "F16"):
                raise SourceError(f"{self.root / fname}: {name} has dtype {dt}; fused expert tensors "
                                  "must be bf16, fp16 or fp32")
        H = int(self.config.get("hidden_size") or 0)
        if gu.ndim != 3 or dn.ndim != 3:
            raise SourceError(f"{self.root}: layer {L}: fused expert tensors must be 3-D, got "
                              f"{list(gu.shape)} and {list(dn.shape)}")
        E = gu.shape[0]
        if gu.shape[2] == H and gu.shape[1] % 2 == 0:
            I = gu.shape[1] // 2
        elif gu.shape[1] == H and gu.shape[2] % 2 == 0:
            gu = gu.transpose(0, 2, 1)  # [E, H, 2I] -> [E, 2I, H] view
            I = gu.shape[1] // 2
        else:
            raise SourceError(f"{self.root / ent['gate_up_proj'][0]}: {ent['gate_up_proj'][1]} has "
                              f"shape {list(gu.shape)}; expected [E, 2I, H] or [E, H, 2I] with H={H}")
        if dn.shape == (E, I, H) and I != H:
            dn = dn.transpose(0, 2, 1)
        if dn.shape != (E, H, I):
            raise SourceError(f"{self.root / ent['down_proj'][0]}: {ent['down_proj'][1]} has shape "
                              f"{list(dn.shape)}; expected [{E}, {H}, {I}] (E, H, I)")
        self._check_config(L, H, I)
        from ._pack import as_kernel_source

        def get(e):
            return (as_kernel_source(gu[e, :I]), as_kernel_source(gu[e, I:]), as_kernel_source(dn[e]))

        return LayerExperts(L, E, H, I, gu.nbytes + dn.nbytes, get)

    def close(self) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()


def _to_f32(a: np.ndarray, dt: str) -> np.ndarray:
    if dt == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dt in ("F32", "F16", "F64"):
        return np.asarray(a, np.float32)
    raise SourceError(f"unsupported tensor dtype {dt} for expert weights")
