"""`ExpertStats`: how often each (layer, expert) is routed to, recorded cheaply while serving.

Legend: L layers, E experts per layer, T tokens, K top-k. A "token-slot" is one entry of a
router's ``topk_ids [T, K]``; id -1 means "no expert" and is not counted.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np

FORMAT = "kt.expert_stats"
FORMAT_VERSION = 1

__all__ = ["ExpertStats", "load_counts", "FORMAT", "FORMAT_VERSION"]


def _is_torch(x) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _check_counts(a, source: str) -> np.ndarray:
    """[L, E] float64 counts, finite and non-negative, or a ValueError saying what is wrong."""
    a = np.asarray(a)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
        raise ValueError(f"{source}: expected a numeric [L, E] table of counts, found dtype {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"{source}: expected counts of shape [L, E] (layers x experts), found shape {a.shape}")
    if a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{source}: counts table is empty, shape {a.shape}")
    a = a.astype(np.float64)
    if not np.isfinite(a).all():
        l, e = np.argwhere(~np.isfinite(a))[0]
        raise ValueError(f"{source}: count at layer {l}, expert {e} is {a[l, e]} (expected a finite number)")
    if (a < 0).any():
        l, e = np.argwhere(a < 0)[0]
        raise ValueError(f"{source}: negative count {a[l, e]} at layer {l}, expert {e}")
    return a


def _check_dim(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


class ExpertStats:
    """Routed token-slots per (layer, expert): ``counts [L, E]`` float64.

    weighted: add the router weight of each token-slot instead of 1.
    halflife_tokens: exponential moving average for online use: before a call with T tokens is
        added to a layer, that layer's counts are multiplied by ``0.5 ** (T / halflife_tokens)``,
        so a token's influence halves every ``halflife_tokens`` tokens. None = plain sums.

    ``record`` accepts numpy arrays and torch tensors. Tensors on an accelerator are accumulated
    there with ``index_add_`` into a device buffer (no host synchronisation; note that
    ``torch.bincount`` would synchronise, it reads the maximum id to size its output); they are
    copied to the host only when ``counts`` is read. Not meant to be shared by threads without
    the caller's own ordering; a lock keeps the buffers consistent regardless.
    """

    def __init__(self, num_layers: int, num_experts: int, *, weighted: bool = False,
                 halflife_tokens: float | None = None, model: str | None = None):
        self._L = _check_dim("num_layers", num_layers)
        self._E = _check_dim("num_experts", num_experts)
        if halflife_tokens is not None:
            if isinstance(halflife_tokens, bool) or not isinstance(halflife_tokens, (int, float, np.number)) \
                    or not np.isfinite(halflife_tokens) or halflife_tokens <= 0:
                raise ValueError(f"halflife_tokens must be a positive number or None, got {halflife_tokens!r}")
            halflife_tokens = float(halflife_tokens)
        if model is not None and not isinstance(model, str):
            raise TypeError(f"model must be a str or None, got {type(model).__name__}")
        self.weighted = bool(weighted)
        self.halflife_tokens = halflife_tokens
        self.model = model
        self._host = np.zeros((self._L, self._E), dtype=np.float64)
        self._tokens = np.zeros(self._L, dtype=np.int64)
        # device string -> torch float64 [L, E + 2]; column E counts id -1, column E+1 bad ids
        self._dev: dict = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ shape

    @property
    def num_layers(self) -> int:
        return self._L

    @property
    def num_experts(self) -> int:
        return self._E

    @property
    def shape(self) -> tuple[int, int]:
        return (self._L, self._E)

    @property
    def tokens(self) -> np.ndarray:
        """[L] int64: tokens recorded per layer (0 for imported tables, where it is unknown)."""
        return self._tokens.copy()

    # ------------------------------------------------------------------ recording

    def record(self, layer: int, topk_ids, topk_weights=None) -> None:
        """Add one router call of ``layer``: topk_ids [T, K] (or [T]) int, topk_weights [T, K] float.

        topk_weights is required when ``weighted`` and ignored otherwise. Ids must lie in
        [-1, E); -1 is skipped. numpy / CPU tensors are checked at once; ids on an accelerator
        are checked when ``counts`` is read (checking earlier would synchronise).
        """
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < self._L:
            raise ValueError(f"layer must be an int in [0, {self._L}), got {layer!r}")
        if self.weighted and topk_weights is None:
            raise ValueError("these statistics are weighted: record() needs topk_weights")
        w = topk_weights if self.weighted else None
        if _is_torch(topk_ids) and topk_ids.device.type != "cpu":
            self._record_torch(int(layer), topk_ids, w)
            return
        ids = topk_ids.numpy() if _is_torch(topk_ids) else np.asarray(topk_ids)
        if w is not None and _is_torch(w):
            w = w.detach().float().cpu().numpy()
        self._record_numpy(int(layer), ids, w)

    def _decay(self, layer: int, n_tokens: int) -> float:
        if self.halflife_tokens is None or n_tokens == 0:
            return 1.0
        return float(0.5 ** (n_tokens / self.halflife_tokens))

    def _check_ids_shape(self, shape, wshape) -> int:
        if len(shape) not in (1, 2):
            raise ValueError(f"topk_ids: expected shape [T, K] or [T], found {tuple(shape)}")
        if wshape is not None and tuple(wshape) != tuple(shape):
            raise ValueError(f"topk_weights shape {tuple(wshape)} != topk_ids shape {tuple(shape)}")
        return int(shape[0])

    def _record_numpy(self, layer: int, ids: np.ndarray, w) -> None:
        if not (np.issubdtype(ids.dtype, np.integer)):
            raise TypeError(f"topk_ids: expected an integer dtype, found {ids.dtype}")
        w = None if w is None else np.asarray(w)
        T = self._check_ids_shape(ids.shape, None if w is None else w.shape)
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < -1 or flat.max() >= self._E):
            bad = flat[(flat < -1) | (flat >= self._E)][0]
            raise ValueError(f"topk_ids: expert id {int(bad)} out of range [-1, {self._E}) at layer {layer}")
        keep = flat >= 0
        wk = None
        if w is not None:
            if not np.issubdtype(w.dtype, np.floating):
                raise TypeError(f"topk_weights: expected a float dtype, found {w.dtype}")
            wk = w.reshape(-1)[keep].astype(np.float64)
            if not np.isfinite(wk).all() or (wk < 0).any():
                raise ValueError("topk_weights: router weights must be finite and >= 0")
        add = np.bincount(flat[keep], weights=wk, minlength=self._E)
        with self._lock:
            f = self._decay(layer, T)
            if f != 1.0:
                self._host[layer] *= f
                for buf in self._dev.values():
                    buf[layer].mul_(f)
            self._host[layer] += add
            self._tokens[layer] += T

    def _record_torch(self, layer: int, ids, w) -> None:
        import torch

        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"topk_ids: expected an integer dtype, found {ids.dtype}")
        if w is not None and not _is_torch(w):
            w = np.asarray(w)
            if not np.issubdtype(w.dtype, np.floating):
                raise TypeError(f"topk_weights: expected a float dtype, found {w.dtype}")
            w = torch.from_numpy(np.ascontiguousarray(w, dtype=np.float64))
        T = self._check_ids_shape(ids.shape, None if w is None else w.shape)
        if w is not None and not w.is_floating_point():
            raise TypeError(f"topk_weights: expected a float dtype, found {w.dtype}")
        E = self._E
        idx = ids.reshape(-1).long()
        # map -1 to column E and anything else out of range to column E+1: no data-dependent sizes
        idx = torch.where((idx >= 0) & (idx < E), idx,
                          torch.where(idx == -1, torch.full_like(idx, E), torch.full_like(idx, E + 1)))
        src = (w.reshape(-1).to(device=idx.device, dtype=torch.float64) if w is not None
               else torch.ones(idx.shape, dtype=torch.float64, device=idx.device))
        key = str(ids.device)
        with self._lock:
            buf = self._dev.get(key)
            if buf is None:
                buf = self._dev[key] = torch.zeros((self._L, E + 2), dtype=torch.float64, device=ids.device)
            f = self._decay(layer, T)
            if f != 1.0:
                self._host[layer] *= f
                for b in self._dev.values():
                    b[layer].mul_(f)
            buf[layer].index_add_(0, idx, src)
            self._tokens[layer] += T

    # ------------------------------------------------------------------ reading

    @property
    def counts(self) -> np.ndarray:
        """[L, E] float64 (a copy). Reading it copies any device buffers to the host (a sync)."""
        with self._lock:
            out = self._host.copy()
            for key, buf in self._dev.items():
                b = buf.detach().cpu().numpy()
                if b[:, self._E + 1].any():
                    raise ValueError(f"topk_ids recorded on {key} held expert ids outside [-1, {self._E})")
                out += b[:, : self._E]
        if not np.isfinite(out).all():
            raise ValueError("recorded counts are not finite (NaN or inf router weights were recorded)")
        return out

    def frequencies(self) -> np.ndarray:
        """[L, E] float64: each layer's counts divided by the layer's total (zero rows stay zero)."""
        c = self.counts
        tot = c.sum(axis=1, keepdims=True)
        return np.divide(c, tot, out=np.zeros_like(c), where=tot > 0)

    def total(self) -> float:
        return float(self.counts.sum())

    def reset(self) -> None:
        with self._lock:
            self._host[:] = 0
            self._tokens[:] = 0
            for buf in self._dev.values():
                buf.zero_()

    def __repr__(self) -> str:
        mode = ("weighted " if self.weighted else "") + (f"EMA(halflife={self.halflife_tokens:g} tokens)"
                                                         if self.halflife_tokens else "sum")
        return f"ExpertStats(L={self._L}, E={self._E}, {mode}, tokens={int(self._tokens.max(initial=0))})"

    # ------------------------------------------------------------------ combining

    @classmethod
    def from_array(cls, counts, *, weighted: bool = False, model: str | None = None,
                   tokens=None, source: str = "counts") -> "ExpertStats":
        """From a plain [L, E] table of counts or frequencies (any non-negative numbers)."""
        if _is_torch(counts):
            counts = counts.detach().cpu().double().numpy()
        c = _check_counts(counts, source)
        s = cls(c.shape[0], c.shape[1], weighted=weighted, model=model)
        s._host[:] = c
        if tokens is not None:
            t = np.asarray(tokens, dtype=np.int64)
            if t.shape != (c.shape[0],) or (t < 0).any():
                raise ValueError(f"{source}: tokens must be {c.shape[0]} non-negative ints, found {t!r}")
            s._tokens[:] = t
        return s

    def merge(self, other: "ExpertStats") -> "ExpertStats":
        """A new host-side ExpertStats holding the sum of both (same shape and weighting)."""
        if not isinstance(other, ExpertStats):
            raise TypeError(f"merge: expected ExpertStats, got {type(other).__name__}")
        if other.shape != self.shape:
            raise ValueError(f"merge: shapes differ, [L, E] = {list(self.shape)} vs {list(other.shape)}")
        if other.weighted != self.weighted:
            raise ValueError("merge: cannot add router-weighted counts to unweighted counts")
        if self.model and other.model and self.model != other.model:
            raise ValueError(f"merge: statistics of different models ({self.model!r} vs {other.model!r})")
        out = ExpertStats.from_array(self.counts + other.counts, weighted=self.weighted,
                                     model=self.model or other.model, tokens=self._tokens + other._tokens)
        out.halflife_tokens = self.halflife_tokens
        return out

    __add__ = merge

    def check_model(self, num_layers: int, num_experts: int, source: str = "statistics") -> None:
        if (num_layers, num_experts) != self.shape:
            raise ValueError(f"{source} have [L, E] = {list(self.shape)}, but the model has "
                             f"num_layers={num_layers}, num_experts={num_experts}")

    # ------------------------------------------------------------------ files

    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, "model": self.model,
                "num_layers": self._L, "num_experts": self._E, "weighted": self.weighted,
                "halflife_tokens": self.halflife_tokens, "tokens": self._tokens.tolist(),
                "counts": self.counts.tolist()}

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``.npz`` (counts, tokens, meta as JSON) or ``.json`` (everything as JSON)."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix == ".json":
            path.write_text(json.dumps(self.to_dict()) + "\n")
        elif suffix == ".npz":
            d = self.to_dict()
            counts = np.asarray(d.pop("counts"), dtype=np.float64)
            tokens = np.asarray(d.pop("tokens"), dtype=np.int64)
            with open(path, "wb") as f:
                np.savez(f, counts=counts, tokens=tokens, meta=np.array(json.dumps(d)))
        else:
            raise ValueError(f"{path}: statistics are saved as .npz or .json, not {suffix or 'no suffix'!r}")
        return path

    @classmethod
    def _from_meta(cls, meta: dict, counts, tokens, source: str) -> "ExpertStats":
        if meta.get("format") != FORMAT:
            raise ValueError(f"{source}: not kt expert statistics (expected \"format\": \"{FORMAT}\")")
        if meta.get("version") != FORMAT_VERSION:
            raise ValueError(f"{source}: statistics format version {meta.get('version')!r} is not supported")
        c = _check_counts(counts, source)
        if c.shape != (meta.get("num_layers"), meta.get("num_experts")):
            raise ValueError(f"{source}: counts have shape {c.shape}, but the file says "
                             f"num_layers={meta.get('num_layers')}, num_experts={meta.get('num_experts')}")
        s = cls.from_array(c, weighted=bool(meta.get("weighted", False)), model=meta.get("model"),
                           tokens=tokens, source=source)
        hl = meta.get("halflife_tokens")
        s.halflife_tokens = None if hl is None else float(hl)
        return s

    @classmethod
    def load(cls, path: str | os.PathLike, *, num_layers: int | None = None, num_experts: int | None = None,
             trust_pickle: bool = False) -> "ExpertStats":
        """Read statistics from any supported file (see ``load_counts``) and check the model shape.

        kt files (.npz/.json written by ``save``) keep their metadata; anything else is imported as
        a plain [L, E] table (SGLang's ``logical_count [buffer, L, E]`` is summed over the buffer).
        """
        path = Path(path)
        stats = _load_kt_file(cls, path)
        if stats is None:
            stats = cls.from_array(load_counts(path, trust_pickle=trust_pickle), source=str(path))
        stats.check_model(num_layers if num_layers is not None else stats.num_layers,
                          num_experts if num_experts is not None else stats.num_experts,
                          source=f"statistics in {path}")
        return stats

    @classmethod
    def from_sglang(cls, path: str | os.PathLike, *, num_layers: int | None = None,
                    num_experts: int | None = None, trust_pickle: bool = False) -> "ExpertStats":
        """Import SGLang's expert-distribution dump (what ``--init-expert-location`` takes): a ``.pt``
        holding a dict (or an object) with ``logical_count [buffer, L, E]``; summed over the buffer."""
        path = Path(path)
        obj = _torch_load(path, trust_pickle)
        lc = obj.get("logical_count") if isinstance(obj, dict) else getattr(obj, "logical_count", None)
        if lc is None:
            keys = list(obj.keys()) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"{path}: no 'logical_count' in this file (found {keys})")
        stats = cls.from_array(_reduce_buffer(_to_numpy(lc, path), path), source=str(path))
        stats.check_model(num_layers if num_layers is not None else stats.num_layers,
                          num_experts if num_experts is not None else stats.num_experts,
                          source=f"statistics in {path}")
        return stats


# ---------------------------------------------------------------------- file import helpers

def _to_numpy(x, path) -> np.ndarray:
    if _is_torch(x):
        return x.detach().cpu().double().numpy()
    try:
        return np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{path}: expected a numeric array, found {type(x).__name__}") from None


def _reduce_buffer(a: np.ndarray, path) -> np.ndarray:
    """[buffer, L, E] -> [L, E] by summing the buffer axis; [L, E] passes through."""
    if a.ndim == 3:
        return a.sum(axis=0)
    if a.ndim == 2:
        return a
    raise ValueError(f"{path}: expected counts of shape [L, E] or [buffer, L, E], found shape {a.shape}")


def _torch_load(path: Path, trust_pickle: bool):
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    try:
        import torch
    except ImportError:
        raise ValueError(f"{path}: reading .pt files needs torch (pip install torch)") from None
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except Exception as exc:
        msg = str(exc)
        if not trust_pickle and "Unsupported global" in msg:
            raise ValueError(
                f"{path}: this .pt holds Python objects that torch's safe loader refuses; if you trust the "
                f"file, load it with trust_pickle=True (kt placement: --trust-pickle)") from None
        detail = msg.strip().splitlines()[-1] if msg.strip() else ""
        raise ValueError(f"{path}: cannot read as a torch file ({type(exc).__name__}: {detail[:200]})") from None


_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")  # a zip archive's first record (or an empty one)


def read_npz(path: Path) -> dict[str, np.ndarray]:
    """Every array of the .npz archive ``path``, read without unpickling anything.

    A file that is not a zip archive of plain .npy arrays (random bytes, a bare .npy, arrays of
    Python objects, a damaged archive) is a ValueError naming the file and what it holds.
    """
    import zipfile

    if not path.is_file():  # a FIFO would block open()
        raise ValueError(f"{path}: not a regular file (a .npz archive was expected)")
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror})") from None
    if head not in _ZIP_MAGIC:
        what = "a .npy array" if head == b"\x93NUM" else "other bytes"
        raise ValueError(f"{path}: not a .npz archive (a .npz is a zip of .npy arrays; this file "
                         f"holds {what})")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    except Exception as exc:  # zipfile, zlib, numpy header and dtype errors all mean "damaged"
        msg = str(exc)
        if "pickle" in msg or "Object arrays" in msg:
            why = "it holds arrays of Python objects, which kt does not unpickle"
        elif isinstance(exc, zipfile.BadZipFile):
            why = f"a damaged zip archive: {msg}"
        else:
            why = f"{type(exc).__name__}: {msg.splitlines()[0] if msg else 'unreadable'}"
        raise ValueError(f"{path}: not a readable .npz archive of numeric arrays ({why})") from None


def _read_json(path: Path):
    """A JSON statistics file's content, or a ValueError naming the file."""
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a statistics JSON (nested too deeply)") from None


def load_counts(path: str | os.PathLike, *, trust_pickle: bool = False) -> np.ndarray:
    """A plain [L, E] float64 table of counts from .npy, .npz, .json, .pt or .pth.

    .npz: the array named ``counts`` or ``logical_count``, or the only array. .json: a nested list,
    or an object with ``counts``/``logical_count``. .pt: a tensor, or a dict / object with
    ``logical_count`` (SGLang; [buffer, L, E] is summed over the buffer). Raises ValueError for a
    wrong shape, negative or non-finite counts.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".npy":
        try:
            a = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError):  # (numpy names pickles for any unknown bytes)
            raise ValueError(f"{path}: not a numeric .npy array file") from None
    elif suffix == ".npz":
        z = read_npz(path)
        names = [n for n in z if n != "meta"]
        for key in ("counts", "logical_count"):
            if key in z:
                a = z[key]
                break
        else:
            if len(names) != 1:
                raise ValueError(f"{path}: expected an array named 'counts' (found {list(z)})")
            a = z[names[0]]
    elif suffix == ".json":
        d = _read_json(path)
        if isinstance(d, dict):
            d = d.get("counts", d.get("logical_count"))
            if d is None:
                raise ValueError(f"{path}: expected a 'counts' field")
        a = _to_numpy(d, path)
    elif suffix in (".pt", ".pth"):
        obj = _torch_load(path, trust_pickle)
        if isinstance(obj, dict):
            obj = obj.get("logical_count", obj.get("counts"))
            if obj is None:
                raise ValueError(f"{path}: expected a tensor or a dict with 'logical_count'")
        elif not _is_torch(obj) and hasattr(obj, "logical_count"):
            obj = obj.logical_count
        a = _to_numpy(obj, path)
    else:
        raise ValueError(f"{path}: unknown statistics file type {suffix!r} "
                         f"(expected .npz, .npy, .json, .pt or .pth)")
    return _check_counts(_reduce_buffer(np.asarray(a), path), str(path))


def _load_kt_file(cls, path: Path):
    """A kt-format stats file (with metadata) or None when the file is something else."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        z = read_npz(path)
        if "meta" not in z:
            return None
        try:
            meta = json.loads(str(z["meta"]))
        except (json.JSONDecodeError, RecursionError):
            raise ValueError(f"{path}: corrupt metadata") from None
        if not isinstance(meta, dict):
            raise ValueError(f"{path}: corrupt metadata (not a JSON object)")
        if "counts" not in z:
            raise ValueError(f"{path}: kt statistics file without 'counts'")
        try:
            return cls._from_meta(meta, z["counts"], z.get("tokens"), str(path))
        except (TypeError, ValueError) as exc:  # a field of the wrong type in meta or tokens
            msg = str(exc)
            raise ValueError(msg if msg.startswith(str(path)) else f"{path}: {msg}") from None
    if suffix == ".json":
        d = _read_json(path)
        if isinstance(d, dict) and "format" in d:
            return cls._from_meta(d, d.get("counts"), d.get("tokens"), str(path))
    return None
