"""Convert a checkpoint's routed experts to the kt weight format, and verify a converted directory.

Streaming: one MoE layer at a time. The source is memory-mapped (page cache, not process memory).
The experts of a layer are spread over ``threads`` Python threads running ``nogil`` Numba kernels,
one expert per task: each thread quantises and packs its expert into its own buffers and
``pwrite``s them into the layer's temp file, which is renamed into place when complete.

Memory bound (anonymous memory; the page cache is the kernel's to reclaim): threads x (one
expert's packed w13 + w2, ~3 I H bytes for INT8, ~6 I H for BF16, plus row buffers); fp16, fp8
and GGUF sources add threads x 3 x I x H x 4 bytes of fp32 temporaries (DeepSeek-V3, I=2048,
H=7168, 2 threads: 0.35 GB). It never depends on the number of layers or experts.
"""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .._version import __version__
from ..config import GROUP_SIZES, QuantScheme
from ..cpu_ops.packing import padded_dims
from ._format import (FORMAT_NAME, FORMAT_VERSION, MANIFEST, PARTIAL, TENSORS, WeightFormatError,
                      CHECKSUM_ALGO, checksum_of_same_kind, default_threads, file_checksum,
                      layer_file_name, read_manifest)
from ._pack import fill_padding_rows, packed_array_specs, quantize_pack_into
from ._safetensors_io import SafetensorsFile, write_json_atomic, write_safetensors
from ._sources import SourceError, open_source

__all__ = ["convert", "verify", "parse_layers"]

LOCK = ".kt-convert.lock"


def parse_layers(spec: str | None) -> list[int] | None:
    """'0-3,7' -> [0, 1, 2, 3, 7]; None/'' -> None (all MoE layers)."""
    if spec is None or str(spec).strip() == "":
        return None
    out: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"--layers: cannot parse {part!r} in {spec!r} (expected e.g. '0-3,7')") from None
    return sorted(out)


def _layer_tensors(scheme: QuantScheme, e: int, h: int, i: int, g: int) -> dict:
    s13 = packed_array_specs(scheme, e, 2 * i, h, g)
    s2 = packed_array_specs(scheme, e, h, i, g)
    t = {f"w13.{k}": s13[k] for k in ("data", "scale", "wsum")}
    t.update({f"w2.{k}": s2[k] for k in ("data", "scale", "wsum")})
    return t


def _shape_meta(scheme, e, h, i, g) -> dict:
    n13, d13 = padded_dims(2 * i, h, scheme, g)
    n2, d2 = padded_dims(h, i, scheme, g)
    return {"w13": {"n": 2 * i, "d": h, "n_pad": n13, "d_pad": d13},
            "w2": {"n": h, "d": i, "n_pad": n2, "d_pad": d2}}


def _convert_layer(lx, scheme: QuantScheme, g: int, path: Path, pool: ThreadPoolExecutor,
                   fsync: bool) -> None:
    """Each task packs one expert into its thread's buffers (one expert's packed output, padding
    included, every byte written) and pwrites them to the expert's slice of each tensor."""
    E, H, I = lx.num_experts, lx.hidden, lx.inter
    tensors = _layer_tensors(scheme, E, H, I, g)
    meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION), "layer": str(lx.layer),
            "scheme": scheme.value, "group_size": str(g), "num_experts": str(E),
            "hidden_size": str(H), "intermediate_size": str(I)}
    local = threading.local()

    def buffers():
        b = getattr(local, "b", None)
        if b is None:  # [1, ...]: one expert, with the leading axis fill_padding_rows expects
            b = local.b = {k: np.empty((1,) + shp[1:], dt) for k, (shp, dt) in tensors.items()}
        return b

    def fill(sink):
        def one(e):
            b = buffers()
            gate, up, down = lx.matrices(e)
            w13 = (b["w13.data"][0], b["w13.scale"][0], b["w13.wsum"][0])
            w2 = (b["w2.data"][0], b["w2.scale"][0], b["w2.wsum"][0])
            bad = quantize_pack_into(scheme, g, gate, 0, *w13)
            bad += quantize_pack_into(scheme, g, up, I, *w13)
            bad += quantize_pack_into(scheme, g, down, 0, *w2)
            if bad:
                raise SourceError(f"layer {lx.layer} expert {e}: {bad} rows/groups hold NaN or Inf")
            fill_padding_rows(scheme, 2 * I, b["w13.data"], b["w13.scale"], b["w13.wsum"])
            fill_padding_rows(scheme, H, b["w2.data"], b["w2.scale"], b["w2.wsum"])
            for name, a in b.items():
                if a.nbytes:
                    sink.pwrite(name, e * a.nbytes, a)

        for fut in [pool.submit(one, e) for e in range(E)]:
            fut.result()

    write_safetensors(path, tensors, fill, meta, fsync=fsync)


def _params(src, scheme, g, layers) -> dict:
    p = {"scheme": scheme.value, "group_size": g, "num_experts": src.num_experts,
         "hidden_size": src.hidden, "intermediate_size": src.inter, "layers": layers,
         "source": src.identity()}
    if scheme is QuantScheme.INT4:
        p["int4_scales"] = INT4_SCALES
    return p


# INT4 group scales are integer ratios of a row scale (reference.int4_ratio_scales); conversions
# made before record no such field, load and run as before, and are refused for resuming.
INT4_SCALES = "ratio"
_KEYS = ("scheme", "group_size", "num_experts", "hidden_size", "intermediate_size", "layers", "source",
         "int4_scales")


def _key(d: dict, k: str):
    v = d.get(k)
    if k == "source" and isinstance(v, dict):  # a moved checkpoint is the same checkpoint
        v = {kk: vv for kk, vv in v.items() if kk != "path"}
    return v


def _same(a: dict, b: dict) -> bool:
    return all(_key(a, k) == _key(b, k) for k in _KEYS)


def convert(source, out_dir, scheme: QuantScheme | str = "int8", group_size: int = 64, *,
            layers=None, threads: int | None = None, progress: bool = True, force: bool = False,
            fsync: bool = False, on_layer_done=None) -> dict:
    """Convert the routed experts of ``source`` (HF checkpoint directory or .gguf) into ``out_dir``.

    scheme: int8 | int4 | bf16; group_size: G of INT4 (32/64/128; ignored otherwise).
    layers: MoE layer indices (list or '0-3,7'); default all. Resumes an interrupted run into the
    same ``out_dir`` (finished layer files whose checksum matches are kept). ``force`` replaces a
    different earlier conversion in ``out_dir``. ``on_layer_done(layer)`` is called after each
    layer file is in place. Returns the manifest (also written to ``out_dir/manifest.json``).
    """
    scheme = QuantScheme.parse(scheme)
    if scheme is QuantScheme.INT4:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"group_size for int4 must be one of {GROUP_SIZES}, got {group_size}")
        g = int(group_size)
    else:
        g = 0
    threads = int(threads or default_threads())
    if threads <= 0:
        raise ValueError(f"threads must be positive, got {threads}")
    src = open_source(source)
    try:
        want = parse_layers(layers) if isinstance(layers, str) else (
            sorted(set(int(x) for x in layers)) if layers is not None else None)
        if want is None:
            want = list(src.moe_layers)
        missing = [L for L in want if L not in src.moe_layers]
        if missing:
            raise ValueError(f"layers {missing} are not MoE layers of {source} "
                             f"(MoE layers: {src.moe_layers})")
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with _dir_lock(out):
            params = _params(src, scheme, g, want)
            done = _resume_state(out, params, force)
            if done is None:  # already complete and verified
                return read_manifest(out)
            _remove_stale_temps(out)
            files = dict(done)
            todo = [L for L in want if str(L) not in files]
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(want), initial=len(want) - len(todo), unit="layer",
                           desc=f"kt convert {scheme.value}", dynamic_ncols=True)
            t0 = time.perf_counter()
            nbytes = 0
            try:
                with ThreadPoolExecutor(threads) as pool:
                    for L in todo:
                        lx = src.layer(L)
                        got = (lx.num_experts, lx.hidden, lx.inter)
                        first = (src.num_experts, src.hidden, src.inter)
                        if got != first:
                            raise SourceError(f"{source}: layer {L} has (E, H, I) = {got}; layer "
                                              f"{src.moe_layers[0]} has {first}")
                        name = layer_file_name(L)
                        _convert_layer(lx, scheme, g, out / name, pool, fsync)
                        files[str(L)] = {"file": name, "bytes": (out / name).stat().st_size,
                                         "checksum": file_checksum(out / name, threads)}
                        write_json_atomic(out / PARTIAL, {**params, "files": files})
                        nbytes += lx.source_bytes
                        if bar is not None:
                            dt = max(time.perf_counter() - t0, 1e-9)
                            bar.set_postfix_str(f"{nbytes / dt / 1e9:.2f} GB/s", refresh=False)
                            bar.update(1)
                        if on_layer_done is not None:
                            on_layer_done(L)
            finally:
                if bar is not None:
                    bar.close()
            manifest = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION,
                        "kt_version": __version__, "scheme": scheme.value, "group_size": g,
                        "num_experts": src.num_experts, "hidden_size": src.hidden,
                        "intermediate_size": src.inter,
                        **_shape_meta(scheme, src.num_experts, src.hidden, src.inter, g),
                        **({"int4_scales": INT4_SCALES} if scheme is QuantScheme.INT4 else {}),
                        "layers": want, "architecture": src.architecture,
                        "model_type": src.model_type,
                        "source": params["source"], "checksum_algorithm": CHECKSUM_ALGO,
                        "files": {str(L): files[str(L)] for L in want}}
            write_json_atomic(out / MANIFEST, manifest)
            (out / PARTIAL).unlink(missing_ok=True)
            return manifest
    finally:
        src.close()


@contextlib.contextmanager
def _dir_lock(out: Path):
    """An exclusive flock on OUT_DIR/.kt-convert.lock for the whole run: a second conversion into
    the same directory fails at once instead of deleting the first one's temp files. The kernel
    drops the lock when the process dies, so a killed run never leaves it held."""
    import fcntl

    f = open(out / LOCK, "a+")
    try:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WeightFormatError(f"{out}: another kt convert is writing into this directory "
                                    f"(it holds {out / LOCK})") from None
        yield
    finally:
        f.close()


def _remove_stale_temps(out: Path) -> None:
    for p in out.glob(".layer_*.safetensors.tmp-*"):
        p.unlink(missing_ok=True)
    for p in out.glob(".manifest*.json.tmp-*"):
        p.unlink(missing_ok=True)


def _resume_state(out: Path, params: dict, force: bool):
    """Finished layers to keep ({layer: file entry}); None when ``out`` is already complete."""
    import json

    def own_files():
        return [out / MANIFEST, out / PARTIAL, *out.glob("layer_*.safetensors")]

    prev = None
    for name in (MANIFEST, PARTIAL):
        p = out / name
        if p.exists():
            try:
                prev = json.loads(p.read_text())
            except json.JSONDecodeError:
                prev = {}
            break
    if prev is None:
        if any(out.glob("layer_*.safetensors")) and not force:
            raise WeightFormatError(f"{out}: holds layer files but no manifest; pass force=True "
                                    "(--force) to overwrite, or pick an empty directory")
        if force:
            for p in own_files():
                p.unlink(missing_ok=True)
        return {}
    if not _same(prev, params):
        if not force:
            diff = [k for k in _KEYS if _key(prev, k) != _key(params, k)]
            why = (" (it was converted before INT4 scales became integer ratios: it still loads and "
                   "runs, and --force re-converts it for the faster AMX prefill)"
                   if diff == ["int4_scales"] else "")
            raise WeightFormatError(f"{out}: holds a different conversion (differs in {diff}){why}; "
                                    "pass force=True (--force) to replace it, or pick another directory")
        for p in own_files():
            p.unlink(missing_ok=True)
        return {}
    keep = {}
    for L, ent in (prev.get("files") or {}).items():
        p = out / ent.get("file", "")
        try:
            ok = (p.is_file() and p.stat().st_size == ent.get("bytes")
                  and checksum_of_same_kind(p, ent.get("checksum", "")) == ent.get("checksum"))
        except WeightFormatError:  # unknown checksum algorithm: redo the layer
            ok = False
        if ok:
            keep[L] = ent
    if (out / MANIFEST).exists():
        if len(keep) == len(params["layers"]):
            return None
        (out / MANIFEST).unlink()  # damaged: fall back to a resumable partial state
    return keep


def verify(out_dir, threads: int | None = None, *, raise_on_error: bool = True) -> list[str]:
    """Re-check every file of a kt weight directory against its manifest.

    Checks the manifest (format, version, fields), that every layer file exists with the
    recorded size and checksum, and that its header holds the six tensors with the shapes the
    manifest implies. Returns the list of problems (empty if all is well); raises
    ``WeightFormatError`` listing them when ``raise_on_error``.
    """
    out = Path(out_dir)
    m = read_manifest(out)
    problems: list[str] = []
    scheme = QuantScheme.parse(m["scheme"])
    tensors = _layer_tensors(scheme, m["num_experts"], m["hidden_size"], m["intermediate_size"],
                             m["group_size"] or 64)
    for L in m["layers"]:
        ent = m["files"].get(str(L))
        if ent is None:
            problems.append(f"{out / MANIFEST}: layer {L} has no file entry")
            continue
        p = out / ent["file"]
        if not p.is_file():
            problems.append(f"{p}: missing (layer {L})")
            continue
        size = p.stat().st_size
        if size != ent["bytes"]:
            problems.append(f"{p}: {size} bytes, manifest says {ent['bytes']} (truncated or replaced)")
            continue
        got = checksum_of_same_kind(p, ent["checksum"], threads)
        if got != ent["checksum"]:
            problems.append(f"{p}: checksum mismatch (file {got}, manifest {ent['checksum']}): "
                            "the file is corrupt; reconvert this layer")
            continue
        problems.extend(check_layer_header(p, tensors))
    if problems and raise_on_error:
        raise WeightFormatError(f"{out}: verification failed:\n  " + "\n  ".join(problems))
    return problems


def check_layer_header(path: Path, tensors: dict) -> list[str]:
    try:
        f = SafetensorsFile(path)
    except ValueError as exc:
        return [str(exc)]
    out = []
    for name in TENSORS:
        shape, dt = tensors[name]
        if name not in f:
            out.append(f"{path}: tensor {name!r} missing")
        elif f.shape(name) != tuple(shape) or f.get(name).dtype != np.dtype(dt):
            out.append(f"{path}: tensor {name!r} is {f.dtype(name)} {list(f.shape(name))}, expected "
                       f"{np.dtype(dt).name} {list(shape)}")
    return out

