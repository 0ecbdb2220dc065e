"""A Hugging Face checkpoint seen through its safetensors headers: which tensors are routed
experts, and reading the others straight into their destination tensors.

Nothing here reads tensor data until asked: opening a ``Checkpoint`` parses the headers only
(names, dtypes, shapes, offsets), so a model can be planned, and refused with a clear error,
before any weight is touched. ``read_into`` reads one tensor with ``pread`` into the
destination's own memory when it is a CPU tensor of the stored dtype, else through a staging
copy of that one tensor; FP8 e4m3 tensors with block scales (``weight_scale_inv``, DeepSeek-V3
style) are dequantised on the way.

Legend: E experts, H hidden size, I expert intermediate size, L layer index.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..weights._safetensors_io import SafetensorsError, read_header
from ..weights._sources import FAMILIES as SOURCE_FAMILIES
from ..weights._sources import Family as SourceFamily
from ..weights._sources import HFSource, SourceError

__all__ = ["Checkpoint", "TensorRef", "pread_into", "open_expert_source", "source_family"]

_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
                 "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                 "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_FP8 = "F8_E4M3"
_SCALE_SUFFIX = "_scale_inv"  # FP8 block scales: "<weight name>_scale_inv"


def source_family(model_type: str) -> SourceFamily:
    """Where a family's checkpoint keeps its routed experts (block, projection names)."""
    fam = SOURCE_FAMILIES.get(model_type)
    if fam is None:
        raise SourceError(f"kt does not know the checkpoint layout of model_type {model_type!r}")
    return fam


def open_expert_source(root: Path, config: dict) -> HFSource:
    """kt.weights' reader of the checkpoint's routed experts (``.layer(L).matrices(e)``)."""
    source_family(config.get("model_type"))
    return HFSource(root)


def pread_into(path: Path, offset: int, buf: memoryview) -> None:
    """Read ``len(buf)`` bytes of ``path`` from ``offset`` into ``buf``: the one place the loader
    reads tensor data of a checkpoint (tests wrap it to see what was read)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        done, n = 0, buf.nbytes
        while done < n:
            k = os.preadv(fd, [buf[done:]], offset + done)
            if k <= 0:
                raise SourceError(f"{path}: file ended {n - done} bytes early reading at offset "
                                  f"{offset + done} (truncated?)")
            done += k
    finally:
        os.close(fd)


@dataclass(frozen=True)
class TensorRef:
    """One stored tensor: file, name, safetensors dtype, shape, absolute byte offset, size."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def where(self) -> str:
        return f"{self.file}: tensor {self.name!r}"


class Checkpoint:
    """The tensors of a HF checkpoint directory (one file, several, or indexed shards).

    experts: {L: names of the routed-expert tensors of layer L} (never read through here).
    tensors: {name: TensorRef} of everything else, FP8 scales excepted (``scale_of``).
    files: {file name: size in bytes}.
    """

    def __init__(self, root, model_type: str, num_layers: int | None = None):
        self.root = Path(root)
        cfg_path = self.root / "config.json"
        try:
            self.config = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SourceError(f"{cfg_path}: cannot read it ({exc})") from None
        fam = source_family(model_type)
        names = "|".join(re.escape(n) for n in fam.names)
        self._expert_re = re.compile(
            rf"layers\.(\d+)\.{re.escape(fam.block)}\.experts\."
            rf"(?:\d+\.(?:{names})\.(?:weight|weight_scale_inv)|(?:gate_up_proj|down_proj)(?:\.weight)?)$")
        self.files: dict[str, int] = {}
        self.tensors: dict[str, TensorRef] = {}
        self.experts: dict[int, list[str]] = {}
        self._scales: dict[str, TensorRef] = {}
        for fname in self._file_names():
            self._index_file(fname, num_layers)
        q = self.config.get("quantization_config") or {}
        block = q.get("weight_block_size") or [128, 128]
        self.fp8_block = (int(block[0]), int(block[1]))

    # ------------------------------------------------------------------ discovery
    def _file_names(self) -> list[str]:
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
                names = sorted(set(wm.values()))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise SourceError(f"{index}: malformed index ({exc})") from None
            for n in names:
                if not (self.root / n).is_file():
                    raise SourceError(f"{self.root / n}: shard listed in {index.name} is missing")
            return names
        names = sorted(p.name for p in self.root.glob("*.safetensors"))
        if not names:
            raise SourceError(f"{self.root}: no *.safetensors files (and no "
                              "model.safetensors.index.json)")
        return names

    def _index_file(self, fname: str, num_layers: int | None) -> None:
        path = self.root / fname
        try:
            header, _meta, data_start, size = read_header(path)
        except SafetensorsError as exc:
            raise SourceError(str(exc)) from None
        self.files[fname] = size
        for name, info in header.items():
            m = self._expert_re.search(name)
            if m is not None:
                L = int(m.group(1))
                if num_layers is None or L < num_layers:  # beyond: e.g. DeepSeek-V3's MTP layer
                    self.experts.setdefault(L, []).append(name)
                continue
            b0, b1 = (int(v) for v in info["data_offsets"])
            ref = TensorRef(path, name, info["dtype"], tuple(int(s) for s in info["shape"]),
                            data_start + b0, b1 - b0)
            table = self._scales if name.endswith(_SCALE_SUFFIX) else self.tensors
            other = table.get(name)
            if other is not None:
                raise SourceError(f"{self.root}: tensor {name!r} is stored twice ({other.file.name} "
                                  f"and {fname})")
            table[name] = ref

    def scale_of(self, name: str) -> TensorRef | None:
        return self._scales.get(name + _SCALE_SUFFIX)

    def expert_names(self) -> set[str]:
        return {n for names in self.experts.values() for n in names}

    # ------------------------------------------------------------------ reading
    def check_readable(self, ref: TensorRef, shape: tuple[int, ...]) -> None:
        """SourceError naming the file and tensor unless ``read_into`` can fill a ``shape``."""
        if ref.shape != tuple(shape):
            raise SourceError(f"{ref.where()} has shape {list(ref.shape)}, but the model "
                              f"(config.json) expects {list(shape)}")
        if ref.dtype == _FP8:
            s = self.scale_of(ref.name)
            if s is None:
                raise SourceError(f"{ref.where()} is fp8 e4m3 but {ref.name}{_SCALE_SUFFIX} (its "
                                  "block scales) is missing")
            bn, bd = self.fp8_block
            want = (-(-ref.shape[0] // bn), -(-ref.shape[1] // bd)) if len(ref.shape) == 2 else None
            if want is None or s.shape != want or s.dtype not in ("F32", "BF16"):
                raise SourceError(f"{s.where()} is {s.dtype} {list(s.shape)}; expected F32 "
                                  f"{list(want) if want else '[?, ?]'} ({bn}x{bd} block scales "
                                  f"of a {list(ref.shape)} weight)")
        elif ref.dtype not in _TORCH_DTYPES:
            raise SourceError(f"{ref.where()} has dtype {ref.dtype}, which kt.hf cannot load")

    def read_into(self, ref: TensorRef, dest: torch.Tensor) -> None:
        """Fill ``dest`` (any device, any dtype torch converts to) with the tensor ``ref``."""
        self.check_readable(ref, tuple(dest.shape))
        if ref.dtype == _FP8:
            dest.copy_(torch.from_numpy(self._dequant_fp8(ref)))
            return
        src_dtype = _TORCH_DTYPES[ref.dtype]
        if dest.device.type == "cpu" and dest.dtype == src_dtype and dest.is_contiguous():
            self._read_bytes(ref, dest)
            return
        staging = torch.empty(ref.shape, dtype=src_dtype)
        self._read_bytes(ref, staging)
        dest.copy_(staging)

    @staticmethod
    def _read_bytes(ref: TensorRef, t: torch.Tensor) -> None:
        if ref.nbytes:
            pread_into(ref.file, ref.offset, memoryview(t.view(-1).view(torch.uint8).numpy()))

    def _dequant_fp8(self, ref: TensorRef) -> np.ndarray:
        """[N, D] fp32 = e4m3 values x their block's scale (kt's converter kernel)."""
        from ..weights._quant_kernels import fp8_e4m3_block_dequant

        s_ref = self.scale_of(ref.name)
        w = np.empty(ref.shape, np.uint8)
        pread_into(ref.file, ref.offset, memoryview(w).cast("B"))
        s = torch.empty(s_ref.shape, dtype=_TORCH_DTYPES[s_ref.dtype])
        self._read_bytes(s_ref, s)
        out = np.empty(ref.shape, np.float32)
        fp8_e4m3_block_dequant(w, s.float().numpy(), self.fp8_block[0], self.fp8_block[1], out)
        return out
