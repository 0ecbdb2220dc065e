"""One layer file of a kt weight directory: the checks the loader and ``verify`` share.

Legend: E experts, H hidden size, I expert intermediate size, G group size, L layer index.

In order, each stopping at the first failure that makes the next meaningless: the file is a
regular file of the size the manifest records; its checksum matches (when asked: it reads every
byte); its safetensors header passes the safetensors rules (``_safetensors_io``); the data starts
64-byte aligned; it holds exactly the six tensors with the dtypes and shapes that the manifest's
scheme, G, E, H and I give, stored in kt's order (so two tensors of equal size cannot trade
places); its ``__metadata__`` names the same format, version, layer, scheme, G, E, H and I as the
manifest (so a file renamed or swapped into another layer's place is refused); and every stored
scale is finite (a NaN or Inf scale would turn its rows' output into NaN; the scales are 4 bytes
per row for INT8, 4/H of w13's data, and 4 bytes per G weights for INT4, 8/G of the data).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..config import QuantScheme
from ..cpu_ops.packing import BLOCK_N
from ._files import open_regular
from ._format import (CHECKSUM_ALGOS, FORMAT_NAME, FORMAT_VERSION, MANIFEST, TENSORS, WeightFormatError,
                      checksum_of_same_kind)
from ._pack import packed_array_specs
from ._safetensors_io import ALIGN, SafetensorsError, SafetensorsFile, st_dtype_name

__all__ = ["layer_tensors", "layer_metadata", "layer_problems", "open_layer"]

_SCALE_CHUNK = 16 << 20  # bytes of scales checked per pass (bounds the temporaries)


def layer_tensors(scheme: QuantScheme, e: int, h: int, i: int, g: int) -> dict:
    """{tensor name: (shape, numpy dtype)} of a layer file, in storage order. g: G (INT4)."""
    s13 = packed_array_specs(scheme, e, 2 * i, h, g or 64)
    s2 = packed_array_specs(scheme, e, h, i, g or 64)
    t = {f"w13.{k}": s13[k] for k in ("data", "scale", "wsum")}
    t.update({f"w2.{k}": s2[k] for k in ("data", "scale", "wsum")})
    return t


def layer_metadata(scheme: QuantScheme, layer: int, e: int, h: int, i: int, g: int) -> dict:
    """The ``__metadata__`` of layer ``layer``'s file (all strings, as safetensors requires)."""
    return {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "layer": str(layer),
            "scheme": scheme.value, "group_size": str(g), "num_experts": str(e),
            "hidden_size": str(h), "intermediate_size": str(i)}


def _of_manifest(m: dict):
    return (QuantScheme(m["scheme"]), m["num_experts"], m["hidden_size"], m["intermediate_size"],
            m["group_size"])


def _header_problems(path: Path, f: SafetensorsFile, m: dict, layer: int) -> list:
    sch, E, H, I, g = _of_manifest(m)
    out = []
    if f.data_start % ALIGN:
        out.append(WeightFormatError(path, f"tensor data starting at a multiple of {ALIGN} bytes "
                                     "(as kt writes it)", f"data at byte {f.data_start}"))
    want = layer_tensors(sch, E, H, I, g)
    names = set(f.keys())
    offset = 0
    for name in TENSORS:
        shape, dt = want[name]
        span = [offset, offset + int(np.prod(shape)) * dt.itemsize]
        offset = span[1]
        if name not in names:
            out.append(WeightFormatError(path, f"tensor {name!r}", f"tensor {name!r} missing"))
            continue
        st = st_dtype_name(dt)
        if f.dtype(name) != st or f.shape(name) != tuple(shape):
            out.append(WeightFormatError(path, f"tensor {name!r} of {st} {list(shape)}",
                                         f"tensor {name!r} is {f.dtype(name)} {list(f.shape(name))}"))
        elif f.header[name]["data_offsets"] != span:  # kt's order: a swap of equal-sized tensors
            out.append(WeightFormatError(path, f"tensor {name!r} at data bytes {span[0]}..{span[1]} "
                                         f"(the order {list(TENSORS)})", "tensor "
                                         f"{name!r} at {f.header[name]['data_offsets']}"))
    extra = sorted(names - set(TENSORS))
    if extra:
        out.append(WeightFormatError(path, f"only the tensors {list(TENSORS)}",
                                     f"also {extra[:4]}{' ...' if len(extra) > 4 else ''}"))
    meta = f.metadata
    for key, val in layer_metadata(sch, layer, E, H, I, g).items():
        got = meta.get(key)
        if key == "format_version" and got is not None and got.isdigit() and 1 <= int(got) <= FORMAT_VERSION:
            continue
        if got != val:
            what = "missing" if got is None else f"{got!r}"
            out.append(WeightFormatError(path, f"__metadata__ {key} {val!r} (as {MANIFEST} says "
                                         f"for layer {layer})", f"__metadata__ {key} {what}"))
    return out


def _row_name(pre: str, row: int, n: int) -> str:
    if row >= n:
        return f"{pre} padding row {row}"
    if pre == "w13":
        half = n // 2
        return f"w13 row {row} (gate row {row})" if row < half else f"w13 row {row} (up row {row - half})"
    return f"w2 row {row}"


def _scale_problems(path: Path, arrays: dict, m: dict) -> list:
    sch, E, H, I, _ = _of_manifest(m)
    out = []
    for pre, n in (("w13", 2 * I), ("w2", H)):
        s = arrays[f"{pre}.scale"]
        if s.size == 0:
            continue
        step = max(1, _SCALE_CHUNK // max(1, s[0].nbytes))  # experts per pass: bounded temporaries
        first = next((e0 for e0 in range(0, s.shape[0], step)
                      if not np.isfinite(s[e0:e0 + step]).all()), None)
        if first is None:
            continue
        loc = np.argwhere(~np.isfinite(s[first:first + step]))[0]
        idx = (first + int(loc[0]),) + tuple(int(v) for v in loc[1:])
        total = int(sum(int((~np.isfinite(s[e0:e0 + step])).sum())
                        for e0 in range(first, s.shape[0], step)))
        if sch is QuantScheme.INT4:  # [E, NB, D/G, 16]
            e, row, where = idx[0], idx[1] * BLOCK_N + idx[3], f", group {idx[2]}"
        else:  # [E, n_pad]
            e, row, where = idx[0], idx[1], ""
        out.append(WeightFormatError(
            path, "finite scales", f"{pre}.scale of expert {e}, {_row_name(pre, row, n)}{where} is "
            f"{float(s[idx])} ({total} non-finite scales in {pre}.scale)",
            "the file was damaged or written by another tool; reconvert it"))
    return out


def _check(out_dir: Path, m: dict, layer: int, verify: bool, threads, problems: list):
    """The arrays of layer ``layer`` when every check passes; problems are appended."""
    ent = m["files"][str(layer)]
    path = Path(out_dir) / ent["file"]
    try:
        f = open_regular(path, WeightFormatError)
    except FileNotFoundError:
        problems.append(WeightFormatError(path, f"layer {layer}'s file, listed in {MANIFEST}",
                                          "missing"))
        return None
    except WeightFormatError as exc:
        problems.append(exc)
        return None
    try:
        size = os.fstat(f.fileno()).st_size
        if size != ent["bytes"]:
            problems.append(WeightFormatError(
                path, f"{ent['bytes']} bytes (the size {MANIFEST} records)",
                f"{size} bytes (truncated or replaced)", "reconvert it"))
            return None
        if verify:
            try:
                got = checksum_of_same_kind(path, ent["checksum"], threads, f)
            except WeightFormatError as exc:  # an algorithm this kt does not know
                problems.append(WeightFormatError(path, f"a checksum algorithm in "
                                                  f"{list(CHECKSUM_ALGOS)}", str(exc)))
                return None
            if got != ent["checksum"]:
                problems.append(WeightFormatError(
                    path, f"checksum {ent['checksum']} (recorded in {MANIFEST})",
                    f"checksum mismatch (the file's is {got})", "the file is corrupt; reconvert it"))
                return None
        try:
            st = SafetensorsFile(path, f)
        except SafetensorsError as exc:
            problems.append(WeightFormatError(exc.path, exc.expected, exc.found)
                            if exc.path is not None else WeightFormatError(str(exc)))
            return None
        bad = _header_problems(path, st, m, layer)
        if bad:
            problems.extend(bad)
            return None
        arrays = {name: st.get(name) for name in TENSORS}
        bad = _scale_problems(path, arrays, m)
        if bad:
            problems.extend(bad)
            return None
        return arrays
    finally:
        f.close()  # the mapping keeps its own reference to the file


def layer_problems(out_dir, m: dict, layer: int, threads: int | None = None) -> list:
    """Every problem of layer ``layer``'s file (checksum included); ``m``: a checked manifest."""
    problems: list = []
    _check(Path(out_dir), m, layer, True, threads, problems)
    return problems


def open_layer(out_dir, m: dict, layer: int, *, verify: bool = True,
               threads: int | None = None) -> dict:
    """{tensor name: read-only view of the mapped file} of layer ``layer`` after the checks (the
    checksum when ``verify``); the first problem raises ``WeightFormatError``."""
    problems: list = []
    arrays = _check(Path(out_dir), m, layer, verify, threads, problems)
    if problems:
        raise problems[0]
    return arrays
