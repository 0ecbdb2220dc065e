"""The kt weight format: manifest, file names, checksums, version checks.

A converted model is a directory::

    manifest.json                 format version, scheme, G, E/H/I, layers, source, checksums
    layer_00001.safetensors       one file per MoE layer (L = the model's layer index)
    ...

Each layer file holds six tensors (leading E axis; layout of ``kt/cpu_ops/packing.py``):
``w13.data``, ``w13.scale``, ``w13.wsum`` (gate rows then up rows, [E, 2I, H] packed) and
``w2.data``, ``w2.scale``, ``w2.wsum`` ([E, H, I] packed). See docs/weight-format.md.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..config import QuantScheme

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "WeightFormatError", "layer_file_name",
           "file_checksum", "read_manifest", "CHECKSUM_ALGO"]

FORMAT_NAME = "kt-moe-experts"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL = "manifest.partial.json"
CHECKSUM_ALGO = "xxh64x16MiB-sha256"
CHECKSUM_ALGOS = ("xxh64x16MiB-sha256", "crc32x16MiB-sha256")
_CHUNK = 16 << 20
TENSORS = ("w13.data", "w13.scale", "w13.wsum", "w2.data", "w2.scale", "w2.wsum")


class WeightFormatError(ValueError):
    """A kt weight directory or file that is missing, corrupt, or not what the caller expects."""


def layer_file_name(layer: int) -> str:
    return f"layer_{layer:05d}.safetensors"


def default_threads() -> int:
    from ..config import get_config

    n = get_config().num_threads
    if n:
        return n
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def _chunk_digest(algorithm: str):
    if algorithm == "xxh64x16MiB-sha256":
        from ._hash_kernels import xxh64

        return lambda chunk: struct.pack(">Q", int(xxh64(chunk)))
    if algorithm == "crc32x16MiB-sha256":
        return lambda chunk: struct.pack(">I", zlib.crc32(chunk))
    raise WeightFormatError(f"unknown checksum algorithm {algorithm!r} (this kt knows "
                            f"{list(CHECKSUM_ALGOS)})")


def file_checksum(path: str | Path, threads: int | None = None,
                  algorithm: str = CHECKSUM_ALGO) -> str:
    """``<algorithm>:<hex>``. ``xxh64x16MiB-sha256`` (the default): the file is cut into 16 MiB
    chunks, each hashed with XXH64 (seed 0; Numba, nogil, chunks on ``threads`` threads), the
    8-byte big-endian digests concatenated and hashed with sha256. Any changed byte changes it;
    ~14 GB/s per core here, so checking a file runs near memory bandwidth.
    (``crc32x16MiB-sha256``: the same with zlib CRC-32 per chunk, 4-byte digests; ~3.7 GB/s.)"""
    path = Path(path)
    digest = _chunk_digest(algorithm)
    size = path.stat().st_size
    if size == 0:
        parts = []
    else:
        mm = np.memmap(path, dtype=np.uint8, mode="r")
        starts = range(0, size, _CHUNK)
        n = min(threads or default_threads(), len(starts))
        fn = lambda s: digest(mm[s: s + _CHUNK])  # noqa: E731
        if n <= 1:
            parts = [fn(s) for s in starts]
        else:
            with ThreadPoolExecutor(n) as ex:
                parts = list(ex.map(fn, starts))
        del mm
    return f"{algorithm}:{hashlib.sha256(b''.join(parts)).hexdigest()}"


def checksum_of_same_kind(path: str | Path, recorded: str, threads: int | None = None) -> str:
    """The file's checksum computed with the algorithm named in ``recorded``."""
    algorithm = str(recorded).split(":", 1)[0]
    return file_checksum(path, threads, algorithm)


def read_manifest(out_dir: str | Path) -> dict:
    """Parse and check ``manifest.json`` of a kt weight directory (version, fields)."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST
    if not out_dir.is_dir():
        raise WeightFormatError(f"{out_dir}: not a directory (expected a kt weight directory)")
    if not path.exists():
        hint = (" (a conversion was started here but has not finished: rerun `kt convert` to "
                "resume it)") if (out_dir / PARTIAL).exists() else ""
        raise WeightFormatError(f"{path}: missing; not a complete kt weight directory{hint}")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WeightFormatError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        found = m.get("format") if isinstance(m, dict) else None
        raise WeightFormatError(f"{path}: not a kt weight manifest (format={found!r}, "
                                f"expected {FORMAT_NAME!r})")
    v = m.get("format_version")
    if not isinstance(v, int):
        raise WeightFormatError(f"{path}: format_version missing or not an integer ({v!r})")
    if v > FORMAT_VERSION:
        raise WeightFormatError(f"{path}: format version {v} was written by a newer kt; this kt "
                                f"reads versions up to {FORMAT_VERSION}: upgrade kt")
    for key in ("scheme", "group_size", "num_experts", "hidden_size", "intermediate_size",
                "layers", "files"):
        if key not in m:
            raise WeightFormatError(f"{path}: field {key!r} missing")
    try:
        QuantScheme.parse(m["scheme"])
    except ValueError as exc:
        raise WeightFormatError(f"{path}: {exc}") from None
    return m
