"""Reading safetensors files as memory-mapped numpy views (no copies) and writing them atomically.

The format: 8 bytes little-endian u64 header length N, N bytes of JSON header (may end in spaces),
then the data; ``data_offsets`` are relative to the start of the data. kt pads its own headers
so that the data starts at a 64-byte-aligned file offset; every tensor kt writes has a byte size
that is a multiple of 64, so every tensor starts 64-byte aligned in the file, and (the mapping
being page aligned) in memory.

A header is checked before any tensor is read, with the rules of the safetensors library: the
header is a JSON object with no repeated names; ``__metadata__``, if present, maps strings to
strings; each tensor has a known dtype, a shape of non-negative integers and two data offsets
0 <= begin <= end whose difference is exactly dtype size x the shape's product (Python integers:
no overflow); and the tensors, sorted by offset, tile the data section exactly: no overlap, no
gap, nothing past the end of the file and nothing after the last tensor.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from ._files import FileFormatError, open_regular

__all__ = ["SafetensorsFile", "SafetensorsError", "read_header", "write_safetensors", "DTYPES",
           "ALIGN"]

ALIGN = 64
_MAX_HEADER = 100 << 20

# safetensors dtype name -> numpy dtype of the stored element (bf16 as uint16 bits, fp8 as uint8)
DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NP_TO_ST = {np.dtype("<f4"): "F32", np.dtype("i1"): "I8", np.dtype("u1"): "U8",
             np.dtype("<u2"): "U16", np.dtype("<i4"): "I32", np.dtype("<i8"): "I64",
             np.dtype("<f2"): "F16", np.dtype("<f8"): "F64"}


class SafetensorsError(FileFormatError):
    """A safetensors file that cannot be parsed: ``.path``, ``.expected``, ``.found``."""


def st_dtype_name(dt) -> str:
    """The safetensors dtype name kt writes for numpy dtype ``dt`` (uint16 is stored as U16)."""
    return _NP_TO_ST[np.dtype(dt)]


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _no_repeats(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            raise ValueError(f"the name {k!r} appears twice")
        d[k] = v
    return d


def _parse(path: Path, text: bytes, data_len: int) -> tuple[dict, dict]:
    """(tensors {name: {"dtype", "shape", "data_offsets"}}, metadata) of a checked header."""
    def bad(expected, found):
        return SafetensorsError(path, expected, found)

    try:
        header = json.loads(text.decode("utf-8"), object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad("a JSON object as the safetensors header",
                  f"safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise bad("a JSON object as the safetensors header", f"a JSON {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("__metadata__ to map strings to strings", f"__metadata__ = {meta!r:.200}")
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"tensor {name!r} to be an object", f"{info!r:.200}")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dt, str) or dt not in DTYPES:
            raise bad(f"tensor {name!r} to have a dtype in {sorted(DTYPES)}", f"dtype {dt!r:.60}")
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise bad(f"tensor {name!r} to have a shape of non-negative integers",
                      f"shape {shape!r:.200}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(v) for v in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise bad(f"tensor {name!r} to have data_offsets [begin, end], 0 <= begin <= end",
                      f"data_offsets {offs!r:.200}")
        nbytes = math.prod(shape) * DTYPES[dt].itemsize
        if offs[1] - offs[0] != nbytes:
            raise bad(f"tensor {name!r} to span {nbytes} bytes ({dt} {shape})",
                      f"data_offsets {offs[0]}..{offs[1]} ({offs[1] - offs[0]} bytes)")
        spans.append((offs[0], offs[1], name))
    end = 0
    for b0, b1, name in sorted(spans):
        if b0 != end:
            what = "overlaps the tensor before it" if b0 < end else f"leaves a gap {end}..{b0}"
            raise bad("tensors that tile the data section (no overlap, no gap)",
                      f"tensor {name!r} at data bytes {b0}..{b1} {what}")
        end = b1
    if end > data_len:
        name = max(spans)[2]
        raise bad(f"a file holding all {end} data bytes the header describes",
                  f"truncated: tensor {name!r} ends at data byte {end} but the file holds "
                  f"{data_len} data bytes")
    if end < data_len:
        raise bad(f"{end} data bytes (what the header describes)",
                  f"{data_len - end} bytes after the last tensor")
    return header, meta


def read_header(path: str | Path, f=None) -> tuple[dict, dict, int, int]:
    """(tensors {name: {"dtype", "shape", "data_offsets"}}, metadata, data start, file size),
    checked as the module doc says. ``f``: the file already open (else ``path`` is opened)."""
    path = Path(path)
    own = f is None
    if own:
        f = open_regular(path, SafetensorsError)
    try:
        size = os.fstat(f.fileno()).st_size
        f.seek(0)
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(path, "a safetensors file (8-byte header length first)",
                                   f"truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER or 8 + n > size:
            raise SafetensorsError(path, f"a header length of at most {min(_MAX_HEADER, size - 8)} "
                                   "bytes", f"bad safetensors header length {n} for a file of "
                                   f"{size} bytes (truncated or not a safetensors file)")
        text = f.read(n)
    finally:
        if own:
            f.close()
    tensors, meta = _parse(path, text, size - 8 - n)
    return tensors, meta, 8 + n, size


class SafetensorsFile:
    """A safetensors file mapped read-only; ``get(name)`` returns a numpy view into the mapping.

    bf16 tensors come back as uint16 bit patterns, fp8 as uint8 (the caller knows ``dtype(name)``).
    ``f``: the file already open (its descriptor is mapped; else ``path`` is opened).
    """

    def __init__(self, path: str | Path, f=None):
        self.path = Path(path)
        self._f = f if f is not None else open_regular(self.path, SafetensorsError)
        try:
            self.header, self.metadata, self.data_start, self.size = read_header(self.path, self._f)
        except BaseException:
            self._f.close()
            raise
        self._map = None

    def keys(self) -> list[str]:
        return list(self.header)

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def dtype(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    @property
    def mapping(self) -> np.ndarray:
        if self._map is None:
            if self._f is None:
                raise ValueError(f"{self.path}: read after close()")
            self._map = np.memmap(self._f, dtype=np.uint8, mode="r", shape=(self.size,))
        return self._map

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy view of the mapping (no copy)."""
        try:
            info = self.header[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor named {name!r}") from None
        dt = DTYPES[info["dtype"]]
        b0, b1 = info["data_offsets"]
        shape = tuple(info["shape"])
        raw = self.mapping[self.data_start + b0: self.data_start + b1]
        if (self.data_start + b0) % dt.itemsize:  # unaligned element start: numpy needs a copy
            return np.frombuffer(raw.tobytes(), dtype=dt).reshape(shape)
        return raw.view(dt).reshape(shape)

    def close(self) -> None:
        self._map = None
        if self._f is not None:
            self._f.close()
            self._f = None


class _Sink:
    """What ``write_safetensors`` hands its ``fill`` callback.

    ``pwrite(name, byte_offset, array)``: write ``array``'s bytes at ``byte_offset`` within
    tensor ``name`` (os.pwrite: no page faults on a mapping, drops the GIL, thread-safe).
    ``arrays``: writable np.memmap views of every tensor (zero-filled), made on first use.
    """

    def __init__(self, fd: int, path: Path, data_start: int, entries: dict, tensors: dict):
        self.fd, self._path, self._start = fd, path, data_start
        self._entries, self._tensors = entries, tensors
        self._arrays = None
        self._mm = None

    def pwrite(self, name: str, byte_offset: int, array: np.ndarray) -> None:
        b0, b1 = self._entries[name]["data_offsets"]
        mv = memoryview(np.ascontiguousarray(array)).cast("B")
        if byte_offset < 0 or b0 + byte_offset + mv.nbytes > b1:
            raise ValueError(f"pwrite of {mv.nbytes} bytes at {byte_offset} overruns tensor {name!r}")
        pos = self._start + b0 + byte_offset
        while mv.nbytes:
            k = os.pwrite(self.fd, mv, pos)
            mv, pos = mv[k:], pos + k

    @property
    def arrays(self) -> dict:
        if self._arrays is None:
            self._arrays = {}
            total = self._start + max((e["data_offsets"][1] for e in self._entries.values()), default=0)
            if total > self._start:
                self._mm = np.memmap(self._path, dtype=np.uint8, mode="r+", shape=(total,))
            for name, (shape, dt) in self._tensors.items():
                b0, b1 = self._entries[name]["data_offsets"]
                raw = self._mm[self._start + b0: self._start + b1] if b1 > b0 else None
                self._arrays[name] = (raw.view(np.dtype(dt)).reshape(shape) if raw is not None
                                      else np.zeros(shape, dt))
        return self._arrays

    def close(self) -> None:
        if self._mm is not None:
            self._mm.flush()
        self._arrays = self._mm = None


def write_safetensors(path: str | Path, tensors: dict[str, tuple[tuple[int, ...], np.dtype]],
                      fill, metadata: dict[str, str] | None = None, fsync: bool = False,
                      st_dtypes: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically: temp file in the same folder, (fsync,) rename.

    Without ``fsync`` the rename is atomic against a killed process but not against a power
    loss; kt's converter re-checks every finished file's checksum when it resumes, so a torn
    file after a crash is found and rewritten.

    tensors: name -> (shape, numpy dtype), in storage order. ``fill(sink)`` writes the data
    through ``sink.pwrite(name, byte_offset, array)`` (from any number of threads) or the
    memory-mapped views ``sink.arrays``; so the whole output never sits in anonymous memory.
    The file is zero-filled first. Nothing at ``path`` changes unless everything succeeded.
    st_dtypes: safetensors dtype names overriding the default for some tensors (e.g. "BF16" for
    uint16 bit patterns).
    """
    path = Path(path)
    entries = {}
    off = 0
    for name, (shape, dt) in tensors.items():
        dt = np.dtype(dt)
        nbytes = math.prod(int(s) for s in shape) * dt.itemsize
        st = (st_dtypes or {}).get(name) or _NP_TO_ST[dt]
        if DTYPES[st].itemsize != dt.itemsize:
            raise ValueError(f"st_dtypes[{name!r}] = {st} does not fit numpy dtype {dt}")
        entries[name] = {"dtype": st, "shape": [int(s) for s in shape],
                         "data_offsets": [off, off + nbytes]}
        off += nbytes
    header = {"__metadata__": dict(metadata or {}), **entries}
    text = json.dumps(header, separators=(",", ":")).encode()
    n = len(text)
    n += (-(8 + n)) % ALIGN  # pad with spaces so the data starts 64-byte aligned
    text = text + b" " * (n - len(text))
    total = 8 + n + off
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w+b") as f:
            f.write(struct.pack("<Q", n))
            f.write(text)
            f.truncate(total)
            f.flush()
            sink = _Sink(f.fileno(), tmp, 8 + n, entries, tensors)
            try:
                fill(sink)
            finally:
                sink.close()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
        raise


def write_json_atomic(path: str | Path, obj) -> None:
    """json.dump to a temp file, fsync, rename: readers see the old or the new file, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
