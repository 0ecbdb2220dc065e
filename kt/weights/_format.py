"""The kt weight format: manifest, file names, checksums, and the one check of ``manifest.json``.

A converted model is a directory::

    manifest.json                 format version, scheme, G, E/H/I, layers, source, checksums
    layer_00001.safetensors       one file per MoE layer (L = the model's layer index)
    ...

Each layer file holds six tensors (leading E axis; layout of ``kt/cpu_ops/packing.py``):
``w13.data``, ``w13.scale``, ``w13.wsum`` (gate rows then up rows, [E, 2I, H] packed) and
``w2.data``, ``w2.scale``, ``w2.wsum`` ([E, H, I] packed). See docs/weight-format.md.

``manifest_problems`` is the schema of ``manifest.json``; the loader (``read_manifest``, which
raises the first problem) and ``kt convert --verify`` (which lists them all) both use it, so a
directory verify accepts is one the loader accepts.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..config import GROUP_SIZES, QuantScheme
from ._files import FileFormatError, open_regular

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "WeightFormatError", "layer_file_name",
           "file_checksum", "read_manifest", "manifest_problems", "CHECKSUM_ALGO"]

FORMAT_NAME = "kt-moe-experts"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PARTIAL = "manifest.partial.json"
CHECKSUM_ALGO = "xxh64x16MiB-sha256"
CHECKSUM_ALGOS = ("xxh64x16MiB-sha256", "crc32x16MiB-sha256")
_CHUNK = 16 << 20
TENSORS = ("w13.data", "w13.scale", "w13.wsum", "w2.data", "w2.scale", "w2.wsum")
MAX_DIM = 1 << 20        # bound on E, H, I and layer indices a manifest may give
_MANIFEST_LIMIT = 64 << 20
_CHECKSUM = re.compile(r"^(?P<algo>[A-Za-z0-9_-]+):(?P<hex>[0-9a-f]{64})$")


class WeightFormatError(FileFormatError):
    """A kt weight directory or file that is missing, corrupt, or not what the caller expects.

    ``WeightFormatError(path, expected, found)``: ``.path`` names the file, ``.expected`` what a
    valid one holds, ``.found`` what this one holds (a ``ValueError``).
    """


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
                  algorithm: str = CHECKSUM_ALGO, f=None) -> str:
    """``<algorithm>:<hex>``. ``xxh64x16MiB-sha256`` (the default): the file is cut into 16 MiB
    chunks, each hashed with XXH64 (seed 0; Numba, nogil, chunks on ``threads`` threads), the
    8-byte big-endian digests concatenated and hashed with sha256. Any changed byte changes it;
    ~14 GB/s per core here, so checking a file runs near memory bandwidth.
    (``crc32x16MiB-sha256``: the same with zlib CRC-32 per chunk, 4-byte digests; ~3.7 GB/s.)
    ``f``: the file already open (else ``path`` is opened; it must be a regular file)."""
    path = Path(path)
    digest = _chunk_digest(algorithm)
    own = f is None
    if own:
        f = open_regular(path, WeightFormatError)
    try:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            parts = []
        else:
            mm = np.memmap(f, dtype=np.uint8, mode="r", shape=(size,))
            starts = range(0, size, _CHUNK)
            n = min(threads or default_threads(), len(starts))
            fn = lambda s: digest(mm[s: s + _CHUNK])  # noqa: E731
            if n <= 1:
                parts = [fn(s) for s in starts]
            else:
                with ThreadPoolExecutor(n) as ex:
                    parts = list(ex.map(fn, starts))
            del mm
    finally:
        if own:
            f.close()
    return f"{algorithm}:{hashlib.sha256(b''.join(parts)).hexdigest()}"


def checksum_of_same_kind(path: str | Path, recorded: str, threads: int | None = None,
                          f=None) -> str:
    """The file's checksum computed with the algorithm named in ``recorded``."""
    algorithm = str(recorded).split(":", 1)[0]
    return file_checksum(path, threads, algorithm, f)


# ---------------------------------------------------------------------------- manifest schema

class _Missing:
    def __repr__(self):
        return "missing"


_MISSING = _Missing()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _show(v) -> str:
    text = json.dumps(v) if isinstance(v, (dict, list, str, int, float, bool, type(None))) else repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def shape_meta(scheme: QuantScheme, e: int, h: int, i: int, g: int) -> dict:
    """The manifest's ``w13`` / ``w2`` entries: logical and padded dims of each packed matrix."""
    from ..cpu_ops.packing import padded_dims

    n13, d13 = padded_dims(2 * i, h, scheme, g or 64)
    n2, d2 = padded_dims(h, i, scheme, g or 64)
    return {"w13": {"n": 2 * i, "d": h, "n_pad": n13, "d_pad": d13},
            "w2": {"n": h, "d": i, "n_pad": n2, "d_pad": d2}}


def manifest_problems(m, path: str | Path) -> list[WeightFormatError]:
    """Every way the parsed ``manifest.json`` ``m`` differs from the schema (empty: valid).

    A manifest that is not a kt manifest, or is of a newer format version, gives that one problem
    only (the rest of its fields mean nothing to this kt).
    """
    path = Path(path)
    out: list[WeightFormatError] = []

    def bad(field, expected, value, hint=""):
        found = f"{field} missing" if value is _MISSING else f"{field} = {_show(value)}"
        out.append(WeightFormatError(path, f"{field} to be {expected}", found, hint))

    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        found = m.get("format", _MISSING) if isinstance(m, dict) else m
        return [WeightFormatError(path, f"format = {FORMAT_NAME!r} (a kt weight manifest)",
                                  "not a kt weight manifest (format = "
                                  f"{'missing' if found is _MISSING else _show(found)})")]
    v = m.get("format_version", _MISSING)
    if not _is_int(v) or v < 1:
        bad("format_version", "a positive integer", v)
        return out
    if v > FORMAT_VERSION:
        return [WeightFormatError(path, f"a format version up to {FORMAT_VERSION}, which this kt "
                                  "reads", f"format version {v} was written by a newer kt",
                                  "upgrade kt")]
    scheme = None
    s = m.get("scheme", _MISSING)
    if isinstance(s, str) and s in {q.value for q in QuantScheme}:
        scheme = QuantScheme(s)
    else:
        bad("scheme", f"one of {[q.value for q in QuantScheme]}", s)
    g = m.get("group_size", _MISSING)
    if scheme is QuantScheme.INT4 and not (_is_int(g) and g in GROUP_SIZES):
        bad("group_size", f"one of {list(GROUP_SIZES)} for int4", g)
    elif scheme not in (None, QuantScheme.INT4) and not (_is_int(g) and g == 0):
        bad("group_size", f"0 for {scheme.value}", g)
    dims = {}
    for key in ("num_experts", "hidden_size", "intermediate_size"):
        val = m.get(key, _MISSING)
        if _is_int(val) and 1 <= val <= MAX_DIM:
            dims[key] = val
        else:
            bad(key, f"an integer in [1, {MAX_DIM}]", val)
    if scheme is not None and len(dims) == 3 and not out:
        want = shape_meta(scheme, dims["num_experts"], dims["hidden_size"],
                          dims["intermediate_size"], g)
        for key in ("w13", "w2"):
            if m.get(key, _MISSING) != want[key]:
                bad(key, f"{_show(want[key])} (from scheme, G, H, I)", m.get(key, _MISSING))
    i4 = m.get("int4_scales", _MISSING)
    if i4 is not _MISSING and not (scheme is QuantScheme.INT4 and i4 == "ratio"):
        bad("int4_scales", "absent, or \"ratio\" for int4", i4)
    algo = m.get("checksum_algorithm", _MISSING)
    if algo is not _MISSING and algo not in CHECKSUM_ALGOS:
        bad("checksum_algorithm", f"one of {list(CHECKSUM_ALGOS)}", algo)
    for key in ("kt_version", "architecture", "model_type"):
        val = m.get(key)
        if val is not None and not isinstance(val, str):
            bad(key, "a string or null", val)
    if m.get("source") is not None and not isinstance(m["source"], dict):
        bad("source", "an object", m["source"])
    layers = m.get("layers", _MISSING)
    if (not isinstance(layers, list) or not layers
            or not all(_is_int(L) and 0 <= L < MAX_DIM for L in layers)
            or len(set(layers)) != len(layers)):
        bad("layers", f"a non-empty list of distinct layer indices in [0, {MAX_DIM})", layers)
        layers = None
    files = m.get("files", _MISSING)
    if not isinstance(files, dict):
        bad("files", "an object {layer: entry}", files)
    elif layers is not None:
        extra = sorted(set(files) - {str(L) for L in layers})
        if extra:
            bad("files", "entries for the layers in 'layers' only", f"entries for {extra}")
        for L in layers:
            _entry_problems(files.get(str(L), _MISSING), L, bad)
    return out


def entry_ok(ent, L: int) -> bool:
    """Whether ``ent`` is a well-formed ``files`` entry for layer L."""
    found = []
    _entry_problems(ent, L, lambda *a: found.append(a))
    return not found


def _entry_problems(ent, L: int, bad) -> None:
    where = f"files[\"{L}\"]"
    if ent is _MISSING or not isinstance(ent, dict):
        bad(where, "an object {file, bytes, checksum}", ent)
        return
    name = layer_file_name(L)
    if ent.get("file", _MISSING) != name:
        bad(f"{where}.file", _show(name), ent.get("file", _MISSING))
    n = ent.get("bytes", _MISSING)
    if not (_is_int(n) and 8 <= n < 1 << 50):
        bad(f"{where}.bytes", "the file's size in bytes (an integer >= 8)", n)
    c = ent.get("checksum", _MISSING)
    mm = _CHECKSUM.match(c) if isinstance(c, str) else None
    if mm is None:
        bad(f"{where}.checksum", "'<algorithm>:<64 hex digits>'", c)
    elif mm["algo"] not in CHECKSUM_ALGOS:
        bad(f"{where}.checksum", f"an algorithm in {list(CHECKSUM_ALGOS)}", c)


def read_json_file(path: Path, limit: int = _MANIFEST_LIMIT):
    """(the parsed JSON, None) of a regular file of at most ``limit`` bytes, or (None, the
    WeightFormatError saying why not); a missing file raises FileNotFoundError."""
    try:
        with open_regular(path, WeightFormatError) as f:
            raw = f.read(limit + 1)
    except WeightFormatError as exc:
        return None, exc
    if len(raw) > limit:
        return None, WeightFormatError(path, f"a JSON file of at most {limit} bytes", "a larger file")
    try:
        return json.loads(raw.decode("utf-8")), None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, WeightFormatError(path, "valid UTF-8 JSON", f"not valid JSON ({exc})")


def load_manifest(out_dir: str | Path) -> tuple[dict | None, list[WeightFormatError]]:
    """(the manifest, its problems) of a kt weight directory; the manifest is None when it cannot
    be read at all. Opens only a regular file of at most 64 MiB."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST
    if not out_dir.is_dir():
        found = "not a directory" if not out_dir.exists() else "a file, not a directory"
        return None, [WeightFormatError(out_dir, "a kt weight directory", found)]
    try:
        m, problem = read_json_file(path)
    except FileNotFoundError:
        hint = ("a conversion was started here but has not finished: rerun `kt convert` to "
                "resume it") if (out_dir / PARTIAL).exists() else ""
        return None, [WeightFormatError(path, "the manifest kt convert writes when it finishes",
                                        "missing; not a complete kt weight directory", hint)]
    if problem is not None:
        return None, [problem]
    return m, manifest_problems(m, path)


def read_manifest(out_dir: str | Path) -> dict:
    """The checked ``manifest.json`` of a kt weight directory; the first problem is raised as a
    ``WeightFormatError``."""
    m, problems = load_manifest(out_dir)
    if problems:
        raise problems[0]
    return m
