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

The expert count E comes from ``config.json`` (Qwen: ``num_experts`` or, as transformers 5 writes
it, ``num_local_experts``; Mixtral: ``num_local_experts``; DeepSeek: ``n_routed_experts``), and
every MoE layer must hold exactly experts 0..E-1 with all three projections: a layer with an
expert missing or an id beyond E is refused, naming the ids, when the layer is scanned (before
the converter writes anything).

Tensor dtypes: bf16 and fp32 are read in place from the mapping; fp16 is widened per expert; fp8
e4m3 with ``weight_scale_inv`` block scales (``quantization_config.weight_block_size``, default
128 x 128) is dequantised per expert.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ._files import read_regular
from ._safetensors_io import SafetensorsError, SafetensorsFile
from ._source_base import LayerExperts, SourceError, check_expert_ids

__all__ = ["SourceError", "open_source", "HFSource", "LayerExperts", "FAMILIES"]

_CONFIG_LIMIT = 16 << 20   # bytes of config.json / the shard index kt reads at most
_INDEX_LIMIT = 256 << 20


@dataclass(frozen=True)
class Family:
    block: str                     # module holding the experts: "mlp" or "block_sparse_moe"
    names: tuple[str, str, str]    # gate, up, down projection names
    experts_keys: tuple[str, ...]  # config keys that may hold E (all present ones must agree)
    inter_key: str                 # config key with I
    sparse: str                    # which layers are MoE layers: "qwen", "all" or "deepseek"


_QWEN = Family("mlp", ("gate_proj", "up_proj", "down_proj"), ("num_experts", "num_local_experts"),
               "moe_intermediate_size", "qwen")
_DS = Family("mlp", ("gate_proj", "up_proj", "down_proj"), ("n_routed_experts",),
             "moe_intermediate_size", "deepseek")
FAMILIES: dict[str, Family] = {
    "qwen2_moe": _QWEN,
    "qwen3_moe": _QWEN,
    "mixtral": Family("block_sparse_moe", ("w1", "w3", "w2"), ("num_local_experts", "num_experts"),
                      "intermediate_size", "all"),
    "deepseek_v2": _DS,
    "deepseek_v3": _DS,
    "kimi_k2": _DS,
    "olmoe": Family("mlp", ("gate_proj", "up_proj", "down_proj"), ("num_experts",), "intermediate_size",
                    "all"),
}

_FP8_DTYPES = ("F8_E4M3",)
_WEIGHT_DTYPES = ("BF16", "F32", "F16", "F64") + _FP8_DTYPES
_SCALE_DTYPES = ("F32", "BF16", "F16")


def open_source(path: str | Path):
    """An HF checkpoint directory (config.json + safetensors) or a ``.gguf`` file."""
    path = Path(path)
    if path.is_file() and (path.suffix == ".gguf" or _is_gguf(path)):
        from ._gguf import GGUFSource

        return GGUFSource(path)
    if path.is_dir():
        return HFSource(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint (expected a Hugging Face model "
                                "directory with config.json, or a .gguf file)")
    raise SourceError(path, "a model directory or a GGUF file", "neither")


def _is_gguf(path: Path) -> bool:
    from ._files import open_regular

    with open_regular(path, SourceError) as f:
        return f.read(4) == b"GGUF"


def _read_json(path: Path, limit: int):
    """(the parsed JSON, its bytes) of a regular file of at most ``limit`` bytes."""
    raw = read_regular(path, limit, SourceError)
    try:
        return json.loads(raw.decode("utf-8")), raw
    except UnicodeDecodeError as exc:
        raise SourceError(path, "UTF-8 JSON", f"bytes that are not UTF-8 ({exc.reason} at byte "
                          f"{exc.start})") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise SourceError(path, "valid JSON", f"not valid JSON ({exc})") from None


class HFSource:
    """A Hugging Face safetensors checkpoint (single file, several, or indexed shards)."""

    kind = "hf"

    def __init__(self, model_dir: Path):
        self.root = Path(model_dir)
        cfg_path = self.root / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path}: missing (a Hugging Face checkpoint needs config.json)")
        cfg, raw = _read_json(cfg_path, _CONFIG_LIMIT)
        if not isinstance(cfg, dict):
            raise SourceError(cfg_path, "a JSON object (a Hugging Face model config)",
                              f"a JSON {type(cfg).__name__}")
        self._config_sha256 = hashlib.sha256(raw).hexdigest()
        self.config = cfg
        self.model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        self.architecture = archs[0] if isinstance(archs, list) and archs else None
        fam = FAMILIES.get(self.model_type) if isinstance(self.model_type, str) else None
        if fam is None:
            raise SourceError(
                f"{cfg_path}: unknown architecture {self.architecture!r} (model_type "
                f"{self.model_type!r}); kt convert supports model_type {sorted(FAMILIES)}")
        self.family = fam
        self._open: dict[str, SafetensorsFile] = {}
        self._files = self._tensor_files()
        self._index_tensors()

    # ------------------------------------------------------------------ config
    def _cfg_int(self, key: str, default=None, minimum: int = 0):
        v = self.config.get(key, default)
        if v is None:
            return None
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise SourceError(self.root / "config.json", f"{key} to be an integer >= {minimum}",
                              f"{key} = {v!r}")
        return v

    def configured_experts(self) -> tuple[int, str]:
        """(E, the config key that gives it)."""
        keys = self.family.experts_keys
        given = [(k, self._cfg_int(k, minimum=1)) for k in keys if self.config.get(k) is not None]
        if not given:
            raise SourceError(self.root / "config.json", f"the routed expert count in "
                              f"{' or '.join(keys)}", "none of these fields")
        if len({v for _, v in given}) > 1:
            raise SourceError(self.root / "config.json", "one routed expert count",
                              " and ".join(f"{k} = {v}" for k, v in given))
        return given[0][1], given[0][0]

    def expected_moe_layers(self) -> list[int] | None:
        """The layers config.json makes MoE layers (None when it gives no layer count)."""
        n = self._cfg_int("num_hidden_layers")
        if n is None:
            return None
        rule = self.family.sparse
        if rule == "all":
            return list(range(n))
        if rule == "qwen":
            step = self._cfg_int("decoder_sparse_step", 1, minimum=1)
            dense = self.config.get("mlp_only_layers") or []
            if not isinstance(dense, list):
                raise SourceError(self.root / "config.json", "mlp_only_layers to be a list",
                                  f"mlp_only_layers = {dense!r}")
            return [L for L in range(n) if L not in dense and (L + 1) % step == 0]
        first = self._cfg_int("first_k_dense_replace", 0)
        freq = self._cfg_int("moe_layer_freq", 1, minimum=1)
        return [L for L in range(first, n) if L % freq == 0]

    # ------------------------------------------------------------------ discovery
    def _tensor_files(self) -> dict[str, list[str]]:
        """file name -> tensor names in it."""
        index = self.root / "model.safetensors.index.json"
        if index.exists():
            wm, _ = _read_json(index, _INDEX_LIMIT)
            wm = wm.get("weight_map") if isinstance(wm, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in wm.items()):
                raise SourceError(index, "an object with a 'weight_map' of tensor name -> file name",
                                  "a malformed index")
            files: dict[str, list[str]] = {}
            for name, fname in wm.items():
                p = Path(fname)
                if p.is_absolute() or ".." in p.parts or not p.parts:
                    raise SourceError(index, "shard file names inside the checkpoint directory",
                                      f"{fname!r} (for {name!r})")
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
                raise (SourceError(str(exc)) if exc.path is None else
                       SourceError(exc.path, exc.expected, exc.found)) from None
            self._open[fname] = f
        return f

    def _entry(self, ref):
        """(SafetensorsFile, tensor name) of an indexed tensor, checked to be in its file."""
        fname, name = ref
        f = self._file(fname)
        if name not in f:
            raise SourceError(self.root / fname, f"tensor {name!r} (model.safetensors.index.json "
                              "lists it in this file)", "no such tensor in the file")
        return f, name

    def _index_tensors(self) -> None:
        fam = self.family
        gate_n, up_n, down_n = fam.names
        blk = re.escape(fam.block)
        per = re.compile(rf"^(?P<pre>.*?)layers\.(?P<L>\d+)\.{blk}\.experts\.(?P<e>\d+)\."
                         rf"(?P<p>{gate_n}|{up_n}|{down_n})\.(?P<kind>weight|weight_scale_inv)$")
        fused = re.compile(rf"^(?P<pre>.*?)layers\.(?P<L>\d+)\.{blk}\.experts\."
                           rf"(?P<p>gate_up_proj|down_proj)(?:\.weight)?$")
        n_layers = self._cfg_int("num_hidden_layers")
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
        both = sorted(set(self.per_expert) & set(self.fused))
        if both:
            raise SourceError(self.root, "each layer's experts either per expert or fused",
                              f"layer {both[0]} holds both per-expert and fused expert tensors")
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
            want = self._cfg_int(key)
            if want is not None and want != got:
                raise SourceError(f"{self.root}: layer {L} experts have {key} = {got} but "
                                  f"config.json says {want}")

    def identity(self) -> dict:
        files = [{"name": f, "bytes": (self.root / f).stat().st_size} for f in sorted(self._files)]
        return {"kind": "hf", "path": str(self.root.resolve()),
                "config_sha256": self._config_sha256, "files": files}

    # ------------------------------------------------------------------ one layer
    def _fp8_block(self) -> tuple[int, int]:
        q = self.config.get("quantization_config") or {}
        b = (q.get("weight_block_size") if isinstance(q, dict) else None) or [128, 128]
        if (not isinstance(b, list) or len(b) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in b)):
            raise SourceError(self.root / "config.json", "quantization_config.weight_block_size "
                              "to be two positive integers", f"{b!r}")
        return int(b[0]), int(b[1])

    def _tensor(self, ref):
        f, name = self._entry(ref)
        return f.get(name), f.dtype(name)

    def layer(self, L: int) -> LayerExperts:
        """Layer L's experts, after checking every tensor's presence, dtype and shape (headers
        only: no tensor data is read here)."""
        if L in self.fused:
            return self._fused_layer(L)
        if L not in self.per_expert:
            raise SourceError(f"{self.root}: layer {L} has no routed experts "
                              f"(MoE layers: {self.moe_layers})")
        entries = self.per_expert[L]
        gate_n, up_n, down_n = self.family.names
        E, key = self.configured_experts()
        check_expert_ids(self.root, L, {e for (e, _, _) in entries}, E, key)
        for e in range(E):
            for p in self.family.names:
                if (e, p, "weight") not in entries:
                    raise SourceError(f"{self.root}: layer {L} expert {e}: tensor '{p}.weight' missing")
        g0, _ = self._tensor(entries[(0, gate_n, "weight")])
        if g0.ndim != 2:
            raise SourceError(self.root, "2-D expert matrices", f"layer {L} expert 0 {gate_n} of "
                              f"shape {list(g0.shape)}")
        I, H = (int(s) for s in g0.shape)
        self._check_config(L, H, I)
        block = self._fp8_block()
        total = 0
        for e in range(E):
            for p, shp in ((gate_n, (I, H)), (up_n, (I, H)), (down_n, (H, I))):
                f, name = self._entry(entries[(e, p, "weight")])
                where = self.root / entries[(e, p, "weight")][0]
                if f.shape(name) != shp:
                    raise SourceError(f"{where}: {name} has shape {list(f.shape(name))}, "
                                      f"expected {list(shp)} (E={E}, H={H}, I={I})")
                dt = f.dtype(name)
                if dt not in _WEIGHT_DTYPES:
                    raise SourceError(where, f"expert weights stored as one of {list(_WEIGHT_DTYPES)}",
                                      f"{name} stored as {dt}")
                if dt in _FP8_DTYPES:
                    self._check_fp8_scale(entries, e, p, name, shp, block)
                total += f.get(name).nbytes

        def get(e):
            return tuple(self._matrix(entries, e, p, block) for p in (gate_n, up_n, down_n))

        return LayerExperts(L, E, H, I, total, get)

    def _check_fp8_scale(self, entries, e, p, name, shp, block) -> None:
        ref = entries.get((e, p, "weight_scale_inv"))
        if ref is None:
            raise SourceError(f"{self.root / entries[(e, p, 'weight')][0]}: {name} is fp8 but "
                              f"{name}_scale_inv is missing")
        f, sname = self._entry(ref)
        want = [-(-shp[0] // block[0]), -(-shp[1] // block[1])]
        if list(f.shape(sname)) != want or f.dtype(sname) not in _SCALE_DTYPES:
            raise SourceError(self.root / ref[0], f"{sname} of shape {want} ({block[0]}x{block[1]} "
                              f"blocks of a {list(shp)} weight), dtype one of {list(_SCALE_DTYPES)}",
                              f"{f.dtype(sname)} {list(f.shape(sname))}")

    def _matrix(self, entries, e, p, block):
        from ._pack import as_kernel_source

        w, dt = self._tensor(entries[(e, p, "weight")])
        if dt in _FP8_DTYPES:
            from ._quant_kernels import fp8_e4m3_block_dequant

            s, sdt = self._tensor(entries[(e, p, "weight_scale_inv")])
            s = np.asarray(s, np.float32) if sdt == "F32" else _to_f32(s, sdt)
            out = np.empty(w.shape, np.float32)
            fp8_e4m3_block_dequant(w, s, block[0], block[1], out)
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
        H = self._cfg_int("hidden_size") or 0
        if gu.ndim != 3 or dn.ndim != 3:
            raise SourceError(f"{self.root}: layer {L}: fused expert tensors must be 3-D, got "
                              f"{list(gu.shape)} and {list(dn.shape)}")
        E = gu.shape[0]
        n_cfg, key = self.configured_experts()
        check_expert_ids(self.root, L, range(E), n_cfg, key)
        if gu.shape[2] == H and gu.shape[1] % 2 == 0 and gu.shape[1]:
            I = gu.shape[1] // 2
        elif gu.shape[1] == H and gu.shape[2] % 2 == 0 and gu.shape[2]:
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
