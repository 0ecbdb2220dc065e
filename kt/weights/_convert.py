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
import operator
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .._version import __version__
from ..config import GROUP_SIZES, QuantScheme
from ._format import (CHECKSUM_ALGO, FORMAT_NAME, FORMAT_VERSION, MANIFEST, PARTIAL,
                      WeightFormatError, default_threads, entry_ok, file_checksum, layer_file_name,
                      load_manifest, read_json_file, read_manifest, shape_meta)
from ._layer_file import layer_metadata, layer_problems, layer_tensors
from ._pack import fill_padding_rows, quantize_pack_into
from ._safetensors_io import write_json_atomic, write_safetensors
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


def _convert_layer(lx, scheme: QuantScheme, g: int, path: Path, pool: ThreadPoolExecutor,
                   fsync: bool) -> None:
    """Each task packs one expert into its thread's buffers (one expert's packed output, padding
    included, every byte written) and pwrites them to the expert's slice of each tensor."""
    E, H, I = lx.num_experts, lx.hidden, lx.inter
    tensors = layer_tensors(scheme, E, H, I, g)
    meta = layer_metadata(scheme, lx.layer, E, H, I, g)
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
        want = _wanted_layers(src, layers, source)
        lxs = _scan(src, want, source)  # every layer is checked before anything is written
        out = _output_dir(out_dir)
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
                        lx = lxs[L]
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
                        **shape_meta(scheme, src.num_experts, src.hidden, src.inter, g),
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


def _wanted_layers(src, layers, source) -> list[int]:
    """The layers to convert: ``layers`` (list or '0-3,7'), default every MoE layer; a layer
    config.json makes a MoE layer but the checkpoint holds no experts for is refused."""
    if layers is None or isinstance(layers, str):
        want = parse_layers(layers)
    else:
        try:
            want = sorted({operator.index(x) for x in layers})
        except TypeError:
            raise ValueError(f"layers must be layer indices or a string like '0-3,7', got "
                             f"{layers!r}") from None
    expected = getattr(src, "expected_moe_layers", lambda: None)()
    if want is None:
        want = sorted(set(src.moe_layers) | set(expected or ()))
    absent = [L for L in want if L not in src.moe_layers]
    should = [L for L in absent if expected and L in expected]
    if should:
        raise SourceError(source, "expert tensors for every MoE layer config.json describes "
                          f"({len(expected)} layers)", f"no expert tensors for layers {should}")
    if absent:
        raise ValueError(f"layers {absent} are not MoE layers of {source} "
                         f"(MoE layers: {src.moe_layers})")
    return want


def _scan(src, want: list[int], source) -> dict:
    """{L: LayerExperts} of every layer to convert: the readers check each layer's expert set,
    dtypes and shapes from the headers, and all layers must have the same (E, H, I)."""
    first = (src.num_experts, src.hidden, src.inter)
    out = {}
    for L in want:
        lx = src.layer(L)
        got = (lx.num_experts, lx.hidden, lx.inter)
        if got != first:
            raise SourceError(source, f"(E, H, I) = {first} in every layer (as in layer "
                              f"{src.moe_layers[0]})", f"layer {L} has (E, H, I) = {got}")
        out[L] = lx
    return out


def _output_dir(out_dir) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise WeightFormatError(out, "a directory to write the conversion into (or a path to "
                                "create one)", "an existing file that is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise WeightFormatError(out, "a directory kt can create", f"cannot create it "
                                f"({exc.strerror})") from None
    return out


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
            raise WeightFormatError(out, "no other kt convert writing into this directory",
                                    f"another kt convert is writing into this directory (it "
                                    f"holds {out / LOCK})") from None
        yield
    finally:
        f.close()


def _remove_stale_temps(out: Path) -> None:
    for p in out.glob(".layer_*.safetensors.tmp-*"):
        p.unlink(missing_ok=True)
    for p in out.glob(".manifest*.json.tmp-*"):
        p.unlink(missing_ok=True)


def _resume_state(out: Path, params: dict, force: bool):
    """Finished layers to keep ({layer: file entry}); None when ``out`` is already complete.

    A layer is kept when its file passes every check the loader makes (``layer_problems``,
    checksum included) against the recorded entry; anything unreadable is redone."""
    def own_files():
        return [out / MANIFEST, out / PARTIAL, *out.glob("layer_*.safetensors")]

    prev = None
    for name in (MANIFEST, PARTIAL):
        p = out / name
        if p.exists() or p.is_symlink():
            try:
                prev, _ = read_json_file(p)
            except FileNotFoundError:  # a dangling symlink
                prev = None
            if not isinstance(prev, dict):
                prev = {}
            break
    if prev is None:
        if any(out.glob("layer_*.safetensors")) and not force:
            raise WeightFormatError(out, "an empty directory, or one kt convert wrote (with a "
                                    "manifest)", "layer files but no manifest",
                                    "pass force=True (--force) to overwrite, or pick an empty "
                                    "directory")
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
            raise WeightFormatError(out, "an empty directory or the same conversion (to resume "
                                    "it)", f"holds a different conversion (differs in {diff}){why}",
                                    "pass force=True (--force) to replace it, or pick another "
                                    "directory")
        for p in own_files():
            p.unlink(missing_ok=True)
        return {}
    files = prev.get("files")
    keep = {}
    for L in params["layers"]:
        ent = files.get(str(L)) if isinstance(files, dict) else None
        if not entry_ok(ent, L):
            continue
        if not layer_problems(out, {**params, "files": {str(L): ent}}, L):
            keep[str(L)] = ent
    if (out / MANIFEST).exists() or (out / MANIFEST).is_symlink():
        if len(keep) == len(params["layers"]) and not load_manifest(out)[1]:
            return None
        (out / MANIFEST).unlink()  # damaged: fall back to a resumable partial state
    return keep


def verify(out_dir, threads: int | None = None, *, raise_on_error: bool = True) -> list[str]:
    """Re-check every file of a kt weight directory: what ``load_experts`` checks, for every
    layer, plus every file's checksum.

    The manifest schema (``_format.manifest_problems``: fields, types, ranges, one entry per
    layer) and, per layer file, its size, checksum, safetensors header, tensor names, dtypes and
    shapes, ``__metadata__`` (format, version, layer, scheme, G, E, H, I) and finite scales
    (``_layer_file``). Returns one line per problem (empty if all is well); raises
    ``WeightFormatError`` listing them when ``raise_on_error``.
    """
    out = Path(out_dir)
    m, problems = load_manifest(out)
    if not problems:
        for L in m["layers"]:
            problems.extend(layer_problems(out, m, L, threads))
    lines = [" ".join(str(p).split()) for p in problems]
    if lines and raise_on_error:
        raise WeightFormatError(f"{out}: verification failed:\n  " + "\n  ".join(lines))
    return lines
