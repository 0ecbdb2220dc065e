"""Property-based tests (hypothesis) of the kt weight format's checks.

The properties, over mutations of small valid conversions (int8, int4, bf16; 2 layers, E=2,
H=64, I=32):

- manifest.json edited (fields replaced, deleted, added, swapped, bytes flipped): every layer
  either loads to exactly the original arrays or raises WeightFormatError, and ``verify`` finds no
  problem exactly when every layer the manifest lists loads;
- a layer file's header edited (dtypes, shapes, offsets, names, metadata, raw bytes) with the
  manifest's size and checksum recomputed to cover the edit: the same two properties;
- a layer file's bytes changed without covering the edit: that layer is refused, the other loads;
- one stored scale set to any float32 bit pattern (edit covered): refused naming the expert and
  row exactly when the value is not finite, else loaded with that value;
- the converter's scan: a checkpoint whose expert tensors are not exactly experts 0..E-1 of the
  configured E (any config key) is refused before anything is written, and a complete one
  converts.

Deterministic for CI: ``derandomize=True`` (examples derived from the test's own source), no
example database, no deadline, a fixed example budget per test (EXAMPLES below: 1610 in all, ~30 s on a 2-core host).
"""
from __future__ import annotations

import copy
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="the property tests need hypothesis (kt[test])")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kt.testing.checkpoints import (read_layer_header, refresh_manifest, small_checkpoint,  # noqa: E402
                                    tensor_span, write_layer_header)
from kt.weights import (NumaTopology, SourceError, WeightFormatError, convert,  # noqa: E402
                        load_experts, verify)
from kt.weights._format import layer_file_name, read_manifest  # noqa: E402

EXAMPLES = {"manifest": 500, "header": 500, "header_bytes": 200, "layer_bytes": 150,
            "scales": 200, "scan": 60}
SCHEMES = ("int8", "int4", "bf16")
LAYERS = (0, 1)
ONE_NODE = NumaTopology(((0,),))


def budget(name: str):
    return settings(max_examples=EXAMPLES[name], derandomize=True, database=None, deadline=None,
                    print_blob=False, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                             HealthCheck.too_slow,
                                                             HealthCheck.data_too_large])


def _snapshot(le):
    return ((le.scheme, le.group_size, le.E, le.H, le.I),
            tuple(np.array(a) for p in (le.w13, le.w2) for a in (p.data, p.scale, p.wsum)))


def _same(a, b) -> bool:
    return a[0] == b[0] and all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
                                for x, y in zip(a[1], b[1]))


class _Base(tuple):
    """(directories, reference snapshots, scratch dir); a short repr for hypothesis' reports."""

    def __repr__(self):
        return "base"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    src, _ = small_checkpoint(root, len(LAYERS), 2)
    dirs, refs = {}, {}
    for scheme in SCHEMES:
        dirs[scheme] = root / scheme
        convert(src, dirs[scheme], scheme, 32, progress=False, threads=1)
        refs[scheme] = {L: _snapshot(load_experts(dirs[scheme], L, topology=ONE_NODE)) for L in LAYERS}
    scratch = root / "scratch"
    scratch.mkdir()
    return _Base((dirs, refs, scratch))


def _copy(base, scheme) -> Path:
    d = Path(tempfile.mkdtemp(dir=base[2]))
    shutil.copytree(base[0][scheme], d / "o")
    return d / "o"


def _load(d, L):
    """The snapshot, or None for a WeightFormatError (anything else fails the test)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an int4 manifest without int4_scales loads with a warning
        try:
            return _snapshot(load_experts(d, L, topology=ONE_NODE))
        except WeightFormatError:
            return None


def check_outcome(d: Path, ref: dict) -> None:
    """Each original layer loads to its original arrays or is refused; verify reports nothing
    exactly when every layer the (possibly edited) manifest lists loads."""
    got = {L: _load(d, L) for L in ref}
    event(f"layers loaded: {sum(v is not None for v in got.values())} of {len(got)}")
    for L, snap in got.items():
        assert snap is None or _same(snap, ref[L]), f"layer {L} loaded to different arrays"
    problems = verify(d, raise_on_error=False)
    assert all(isinstance(p, str) and "\n" not in p for p in problems)
    try:
        listed = read_manifest(d)["layers"]
    except WeightFormatError:
        assert problems, "verify accepted a manifest the loader refuses"
        return
    loads = all((got[L] if L in got else _load(d, L)) is not None for L in listed)
    assert (not problems) == loads, (problems, {L: got.get(L) is not None for L in listed})
    shutil.rmtree(d.parent)


# ------------------------------------------------------------------ values and edits

LEAF = st.one_of(
    st.none(), st.booleans(),
    st.sampled_from([0, 1, -1, 2, 7, 8, 31, 32, 64, 128, 2**31, 2**32, 2**63, 2**64, 10**30]),
    st.integers(-300, 300), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "64", "int8", "int4", "bf16", "fp8", "ratio", "kt-moe-experts",
                     "layer_00000.safetensors", "layer_00001.safetensors", "../manifest.json",
                     "/etc/hostname", "xxh64x16MiB-sha256:" + "0" * 64, "md5:" + "0" * 64,
                     "crc32x16MiB-sha256:" + "f" * 64, "I8", "U8", "F32", "BF16", "0", "1"]),
    st.text(max_size=8))
JSON = st.recursive(LEAF, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c,
                                                                              max_size=3), max_leaves=5)


def _paths(obj, prefix=()):
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, prefix + (i,))
    return out


def _get(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _edit_json(data, obj):
    """One random edit of the JSON value ``obj`` (in place where possible); returns the result."""
    paths = _paths(obj)
    path = data.draw(st.sampled_from(paths), label="path")
    op = data.draw(st.sampled_from(["replace", "replace", "delete", "insert", "swap"]), label="op")
    if op == "swap" and len(paths) > 2:
        other = data.draw(st.sampled_from(paths), label="other")
        if path and other and not (path[:len(other)] == other or other[:len(path)] == path):
            a, b = _get(obj, path), _get(obj, other)
            _get(obj, path[:-1])[path[-1]] = b
            _get(obj, other[:-1])[other[-1]] = a
        return obj
    if not path:
        return data.draw(JSON, label="root") if op == "replace" else obj
    parent, key = _get(obj, path[:-1]), path[-1]
    if op == "delete":
        del parent[key]
    elif op == "insert":
        target = _get(obj, path)
        if isinstance(target, dict):
            target[data.draw(st.text(max_size=6), label="key")] = data.draw(JSON, label="value")
        elif isinstance(target, list):
            target.insert(data.draw(st.integers(0, len(target)), label="at"), data.draw(JSON, label="value"))
        else:
            parent[key] = [target, data.draw(JSON, label="value")]
    else:
        parent[key] = data.draw(JSON, label="value")
    return obj


def _flip_bytes(data, raw: bytes, lo: int, hi: int) -> bytes:
    raw = bytearray(raw)
    for i in data.draw(st.lists(st.integers(lo, hi - 1), min_size=1, max_size=3, unique=True),
                       label="at"):
        raw[i] ^= data.draw(st.integers(1, 255), label="xor")
    return bytes(raw)


# ------------------------------------------------------------------ properties

@budget("manifest")
@given(data=st.data())
def test_manifest_edits_load_the_same_or_are_refused(base, data):
    scheme = data.draw(st.sampled_from(SCHEMES), label="scheme")
    d = _copy(base, scheme)
    p = d / "manifest.json"
    if data.draw(st.booleans(), label="bytes"):
        raw = p.read_bytes()
        p.write_bytes(_flip_bytes(data, raw, 0, len(raw)))
    else:
        m = json.loads(p.read_text())
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            m = _edit_json(data, m)
        p.write_text(json.dumps(m))
    check_outcome(d, base[1][scheme])


def _header_edit(data, header):
    names = [k for k in header if k != "__metadata__"]
    kind = data.draw(st.sampled_from(["dtype", "shape", "offsets", "offsets_of", "meta", "rename",
                                      "duplicate", "delete", "json"]), label="kind")
    name = data.draw(st.sampled_from(names), label="tensor")
    info = header[name]
    def intact(entry):  # an earlier edit may have replaced it: then it is replaced again
        return (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2)

    if kind in ("dtype", "shape", "offsets", "offsets_of") and not intact(info):
        kind = "json"
    if kind == "offsets_of" and not all(intact(header[n]) for n in names):
        kind = "json"
    if kind == "dtype":
        info["dtype"] = data.draw(st.sampled_from(["I8", "U8", "I16", "U16", "BF16", "F16", "I32",
                                                   "U32", "F32", "F64", "I64", "BOOL", "F8_E4M3",
                                                   "Q4", ""]), label="dtype")
    elif kind == "shape":
        shape = list(info["shape"])
        i = data.draw(st.integers(0, len(shape)), label="dim")
        v = data.draw(st.sampled_from([0, 1, 2, -1, 2**32, 2**62, "4", None, 1.0]) |
                      st.integers(0, 300), label="size")
        if i == len(shape):
            shape.append(v)
        elif data.draw(st.booleans(), label="remove"):
            del shape[i]
        else:
            shape[i] = v
        info["shape"] = shape
    elif kind == "offsets":
        b0, b1 = info["data_offsets"]
        if not all(isinstance(v, int) for v in (b0, b1)):
            b0, b1 = 0, 0
        k = data.draw(st.sampled_from([1, -1, 4, 64, -64, 10**6]) | st.integers(-200, 200), label="by")
        which = data.draw(st.sampled_from(["both", "begin", "end", "reverse"]), label="which")
        info["data_offsets"] = {"both": [b0 + k, b1 + k], "begin": [b0 + k, b1],
                                "end": [b0, b1 + k], "reverse": [b1, b0]}[which]
    elif kind == "offsets_of":
        other = data.draw(st.sampled_from(names), label="other")
        info["data_offsets"], header[other]["data_offsets"] = (header[other]["data_offsets"],
                                                              info["data_offsets"])
    elif kind == "meta":
        meta = header.setdefault("__metadata__", {})
        key = data.draw(st.sampled_from(sorted(meta) + ["extra"]), label="key")
        if data.draw(st.booleans(), label="delete") and key in meta:
            del meta[key]
        else:
            meta[key] = data.draw(st.sampled_from(["0", "1", "2", "int8", "int4", "bf16", "32", "64",
                                                   "kt-moe-experts", ""]) | JSON, label="value")
    elif kind == "rename":
        header[data.draw(st.sampled_from(names + ["w13.datA", "w3.scale"]), label="to")] = header.pop(name)
    elif kind == "duplicate":
        header[data.draw(st.text(max_size=6), label="as")] = copy.deepcopy(info)
    elif kind == "delete":
        del header[name]
    else:
        header[name] = data.draw(JSON, label="info")


@budget("header")
@given(data=st.data())
def test_header_edits_load_the_same_or_are_refused(base, data):
    scheme = data.draw(st.sampled_from(SCHEMES), label="scheme")
    L = data.draw(st.sampled_from(LAYERS), label="layer")
    d = _copy(base, scheme)
    f = d / layer_file_name(L)
    header, _ = read_layer_header(f)
    for _ in range(data.draw(st.integers(1, 2), label="edits")):
        _header_edit(data, header)
    write_layer_header(f, header)
    refresh_manifest(d)
    check_outcome(d, base[1][scheme])


@budget("header_bytes")
@given(data=st.data())
def test_header_bytes_load_the_same_or_are_refused(base, data):
    scheme = data.draw(st.sampled_from(SCHEMES), label="scheme")
    L = data.draw(st.sampled_from(LAYERS), label="layer")
    d = _copy(base, scheme)
    f = d / layer_file_name(L)
    _, n = read_layer_header(f)
    raw = f.read_bytes()
    f.write_bytes(_flip_bytes(data, raw, 0, 8 + n))
    refresh_manifest(d)
    check_outcome(d, base[1][scheme])


@budget("layer_bytes")
@given(data=st.data())
def test_uncovered_byte_changes_are_refused(base, data):
    scheme = data.draw(st.sampled_from(SCHEMES), label="scheme")
    L = data.draw(st.sampled_from(LAYERS), label="layer")
    d = _copy(base, scheme)
    f = d / layer_file_name(L)
    raw = f.read_bytes()
    op = data.draw(st.sampled_from(["flip", "truncate", "append"]), label="op")
    if op == "flip":
        raw = _flip_bytes(data, raw, 0, len(raw))
    elif op == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label="to")]
    else:
        raw = raw + data.draw(st.binary(min_size=1, max_size=70), label="tail")
    f.write_bytes(raw)
    assert _load(d, L) is None, f"layer {L} loaded after an uncovered {op}"
    other = 1 - L
    assert _same(_load(d, other), base[1][scheme][other])
    problems = verify(d, raise_on_error=False)
    assert len(problems) == 1 and layer_file_name(L) in problems[0], problems
    shutil.rmtree(d.parent)


@budget("scales")
@given(data=st.data())
def test_a_non_finite_scale_is_refused_naming_expert_and_row(base, data):
    scheme = data.draw(st.sampled_from(["int8", "int4"]), label="scheme")
    L = data.draw(st.sampled_from(LAYERS), label="layer")
    pre = data.draw(st.sampled_from(["w13", "w2"]), label="tensor")
    d = _copy(base, scheme)
    f = d / layer_file_name(L)
    header, _ = read_layer_header(f)
    shape = tuple(header[f"{pre}.scale"]["shape"])
    flat = data.draw(st.integers(0, int(np.prod(shape)) - 1), label="index")
    bits = data.draw(st.sampled_from([0x7FC00000, 0x7F800000, 0xFF800000, 0x7F800001, 0xFFFFFFFF])
                     | st.integers(0, 2**32 - 1), label="bits")
    value = np.array([bits], np.uint32).view(np.float32)[0]
    b0, _ = tensor_span(f, f"{pre}.scale")
    mm = np.memmap(f, np.float32, "r+", offset=b0, shape=shape)
    idx = np.unravel_index(flat, shape)
    mm[idx] = value
    mm.flush()
    del mm
    refresh_manifest(d)
    problems = verify(d, raise_on_error=False)
    event("finite" if np.isfinite(value) else "not finite")
    if np.isfinite(value):
        le = load_experts(d, L, topology=ONE_NODE)
        got = getattr(le, pre).scale[idx]
        assert got.view(np.uint32) == np.uint32(bits) and problems == []
    else:
        e = int(idx[0])
        row = int(idx[1]) * 16 + int(idx[3]) if scheme == "int4" else int(idx[1])
        with pytest.raises(WeightFormatError, match=rf"{pre}\.scale of expert {e}, {pre} row {row}\b"):
            load_experts(d, L, topology=ONE_NODE)
        assert len(problems) == 1 and f"expert {e}, {pre} row {row}" in problems[0]
    shutil.rmtree(d.parent)


# ------------------------------------------------------------------ the converter's scan

_PROJ = ("gate_proj", "up_proj", "down_proj")
_H, _I, _E = 64, 32, 3


class _Tensors(dict):
    def __repr__(self):
        return "expert_tensors"


@pytest.fixture(scope="module")
def expert_tensors():
    rng = np.random.default_rng(7)
    return _Tensors({(L, e, p): (rng.standard_normal((_H, _I) if p == "down_proj" else (_I, _H)) / 8).astype(np.float32)
            for L in LAYERS for e in range(_E + 2) for p in _PROJ})


@budget("scan")
@given(data=st.data())
def test_the_scan_refuses_incomplete_expert_sets_before_writing(base, expert_tensors, data):
    from safetensors.numpy import save_file

    drop = data.draw(st.sets(st.tuples(st.sampled_from(LAYERS), st.integers(0, _E - 1),
                                       st.sampled_from(_PROJ)), max_size=3), label="drop")
    extra = data.draw(st.sets(st.tuples(st.sampled_from(LAYERS), st.integers(_E, _E + 1)), max_size=1),
                      label="extra")
    key = data.draw(st.sampled_from(["num_experts", "num_local_experts", "both"]), label="key")
    count = data.draw(st.sampled_from([_E, _E, _E, _E - 1, _E + 1]), label="count")
    root = Path(tempfile.mkdtemp(dir=base[2]))
    src = root / "src"
    src.mkdir()
    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": _H,
           "num_hidden_layers": len(LAYERS), "moe_intermediate_size": _I}
    for k in (("num_experts", "num_local_experts") if key == "both" else (key,)):
        cfg[k] = count
    (src / "config.json").write_text(json.dumps(cfg))
    tensors = {}
    for (L, e, p), w in expert_tensors.items():
        if (L, e, p) in drop or (e >= _E and (L, e) not in extra):
            continue
        tensors[f"model.layers.{L}.mlp.experts.{e}.{p}.weight"] = w
    save_file(tensors, src / "model.safetensors")
    out = root / "out"
    event("complete" if not drop and not extra and count == _E else "incomplete")
    if not drop and not extra and count == _E:
        m = convert(src, out, "int8", progress=False, threads=1)
        assert m["num_experts"] == _E and m["layers"] == list(LAYERS) and verify(out) == []
    else:
        with pytest.raises(SourceError):
            convert(src, out, "int8", progress=False, threads=1)
        assert not out.exists(), "the scan must refuse before anything is written"
    shutil.rmtree(root)
