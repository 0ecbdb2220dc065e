"""What the loader, ``verify`` and the converter refuse: one test per kind of bad input.

Incomplete expert sets in a source checkpoint, directories the loader refuses (which verify must
refuse too), safetensors headers whose tensors overlap or whose sizes overflow, non-finite
stored scales, malformed manifests, and files that are not regular files. Each refusal is a
``WeightFormatError`` / ``SourceError`` naming the file, never another exception or a hang.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading

import numpy as np
import pytest

from kt.testing.checkpoints import (read_layer_header, refresh_manifest, small_checkpoint,
                                    tensor_span, write_layer_header)
from kt.weights import SourceError, WeightFormatError, convert, load_experts, verify

N_E = 4


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    src, _ = small_checkpoint(root, 2, N_E)
    dirs = {}
    for scheme in ("int8", "int4"):
        dirs[scheme] = root / scheme
        convert(src, dirs[scheme], scheme, 32, progress=False, threads=1)
    return src, dirs


@pytest.fixture
def done(base, tmp_path):
    """A fresh copy of an INT8 conversion (2 layers, E=4, H=64, I=32)."""
    out = tmp_path / "o"
    shutil.copytree(base[1]["int8"], out)
    return out


def _edit_manifest(out, fn):
    p = out / "manifest.json"
    m = json.loads(p.read_text())
    fn(m)
    p.write_text(json.dumps(m))


# ------------------------------------------------------------------ source checkpoints

def _drop_tensors(src, keep):
    from safetensors.torch import load_file, save_file

    f = src / "model.safetensors"
    sd = load_file(f)
    save_file({k: v for k, v in sd.items() if keep(k)}, f)


def _set_config(src, **kw):
    cfg = json.loads((src / "config.json").read_text())
    for k, v in kw.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (src / "config.json").write_text(json.dumps(cfg))


def test_missing_last_expert_refused_with_num_local_experts(tmp_path):
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts: a checkpoint missing
    expert E-1 of every layer is refused naming the layer and the id, and nothing is written."""
    src, _ = small_checkpoint(tmp_path, 2, N_E)
    _set_config(src, num_experts=None, num_local_experts=N_E)
    _drop_tensors(src, lambda k: f".experts.{N_E - 1}." not in k)
    out = tmp_path / "o"
    with pytest.raises(SourceError, match=rf"layer 0: missing expert ids \[{N_E - 1}\] \(1\); "
                                          rf"expected experts 0..{N_E - 1} \(num_local_experts = {N_E}\)"):
        convert(src, out, "int8", progress=False)
    assert not out.exists(), "a refused checkpoint must leave nothing behind"


def test_kt_tiny_model_missing_an_expert_is_refused(tmp_path):
    pytest.importorskip("transformers", reason="kt's tiny model builder needs transformers")
    from safetensors.torch import load_file, save_file

    from kt.hf import save_tiny_model

    src = save_tiny_model(tmp_path / "m", "qwen3_moe", num_layers=2)
    n_e = json.loads((src / "config.json").read_text())["num_local_experts"]
    f = next(src.glob("*.safetensors"))
    sd = load_file(f)
    save_file({k: v for k, v in sd.items() if f".mlp.experts.{n_e - 1}." not in k}, f,
              metadata={"format": "pt"})
    with pytest.raises(SourceError, match=rf"layer 0: missing expert ids \[{n_e - 1}\]"):
        convert(src, tmp_path / "o", "int8", progress=False)
    assert not (tmp_path / "o").exists()


def test_extra_expert_ids_named(tmp_path):
    src, _ = small_checkpoint(tmp_path, 1, N_E)
    _set_config(src, num_experts=N_E - 1)
    with pytest.raises(SourceError, match=rf"unexpected expert ids \[{N_E - 1}\]"):
        convert(src, tmp_path / "o", "int8", progress=False)


def test_disagreeing_or_absent_expert_counts_refused(tmp_path):
    src, _ = small_checkpoint(tmp_path, 1, N_E)
    _set_config(src, num_experts=N_E, num_local_experts=N_E + 4)
    with pytest.raises(SourceError, match=rf"num_experts = {N_E} and num_local_experts = {N_E + 4}"):
        convert(src, tmp_path / "o", "int8", progress=False)
    _set_config(src, num_experts=None, num_local_experts=None)
    with pytest.raises(SourceError, match="routed expert count in num_experts or num_local_experts"):
        convert(src, tmp_path / "o", "int8", progress=False)


def test_a_moe_layer_without_experts_is_refused(tmp_path):
    src, _ = small_checkpoint(tmp_path, 3, N_E)
    _drop_tensors(src, lambda k: "layers.1." not in k)
    with pytest.raises(SourceError, match=r"no expert tensors for layers \[1\]"):
        convert(src, tmp_path / "o", "int8", progress=False)
    assert not (tmp_path / "o").exists()


def test_fused_expert_count_checked(tmp_path):
    from kt.testing.checkpoints import fused_checkpoint

    src, _ = fused_checkpoint(tmp_path)
    _set_config(src, num_experts=9)
    with pytest.raises(SourceError, match=r"layer 0: missing expert ids \[8\]"):
        convert(src, tmp_path / "o", "int8", progress=False)


def test_config_that_is_not_an_object_or_not_utf8(tmp_path):
    src, _ = small_checkpoint(tmp_path, 1, N_E)
    (src / "config.json").write_text("[1, 2]")
    with pytest.raises(SourceError, match=r"config\.json: a JSON list; expected a JSON object"):
        convert(src, tmp_path / "o", "int8", progress=False)
    (src / "config.json").write_bytes(b'{"model_type": "\xff"}')
    with pytest.raises(SourceError, match=r"config\.json: bytes that are not UTF-8"):
        convert(src, tmp_path / "o", "int8", progress=False)


def test_overlapping_source_tensors_refused(tmp_path):
    """Two expert matrices pointing at the same bytes would convert to silently wrong weights."""
    src, _ = small_checkpoint(tmp_path, 1, N_E)
    f = src / "model.safetensors"
    header, _ = read_layer_header(f)
    a, b = "model.layers.0.mlp.experts.0.gate_proj.weight", "model.layers.0.mlp.experts.1.gate_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    write_layer_header(f, header)
    with pytest.raises(SourceError, match="overlaps the tensor before it"):
        convert(src, tmp_path / "o", "int8", progress=False)


def test_output_path_that_is_a_file(tmp_path):
    src, _ = small_checkpoint(tmp_path, 1, N_E)
    (tmp_path / "f").write_text("x")
    with pytest.raises(WeightFormatError, match="an existing file that is not a directory"):
        convert(src, tmp_path / "f", "int8", progress=False)


# ------------------------------------------------------------------ verify checks what the loader checks

def test_swapped_layer_files_refused_by_verify(done):
    a, b = done / "layer_00000.safetensors", done / "layer_00001.safetensors"
    tmp = done / "t"
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)
    refresh_manifest(done)
    problems = verify(done, raise_on_error=False)
    assert len(problems) == 2 and all("__metadata__ layer" in p for p in problems), problems
    with pytest.raises(WeightFormatError, match=r"layer_00000\.safetensors: __metadata__ layer '1'; "
                                                r"expected __metadata__ layer '0'"):
        load_experts(done, 0)


@pytest.mark.parametrize("edit", ["changed", "removed"])
def test_edited_layer_field_refused_by_verify(done, edit):
    f = done / "layer_00001.safetensors"
    header, _ = read_layer_header(f)
    if edit == "changed":
        header["__metadata__"]["layer"] = "0"
    else:
        del header["__metadata__"]["layer"]
    write_layer_header(f, header)
    refresh_manifest(done)
    problems = verify(done, raise_on_error=False)
    assert len(problems) == 1 and "layer_00001.safetensors" in problems[0], problems
    with pytest.raises(WeightFormatError, match="__metadata__ layer"):
        load_experts(done, 1)


def test_swapped_equal_sized_tensors_refused(done):
    """INT8 scale (f32) and wsum (i32) have the same size: trading their offsets keeps every size
    right, and only kt's fixed order refuses it."""
    f = done / "layer_00000.safetensors"
    header, _ = read_layer_header(f)
    h = header
    h["w13.scale"]["data_offsets"], h["w13.wsum"]["data_offsets"] = (h["w13.wsum"]["data_offsets"],
                                                                     h["w13.scale"]["data_offsets"])
    write_layer_header(f, header)
    refresh_manifest(done)
    with pytest.raises(WeightFormatError, match=r"tensor 'w13.scale' at data bytes"):
        load_experts(done, 0)
    assert verify(done, raise_on_error=False)


# ------------------------------------------------------------------ headers validated like safetensors

def test_overlapping_layer_tensors_refused(done):
    f = done / "layer_00000.safetensors"
    header, _ = read_layer_header(f)
    b0 = header["w13.data"]["data_offsets"][0]
    n = header["w2.scale"]["data_offsets"][1] - header["w2.scale"]["data_offsets"][0]
    header["w2.scale"]["data_offsets"] = [b0, b0 + n]  # w2's scales read from w13's int8 data
    write_layer_header(f, header)
    refresh_manifest(done)
    with pytest.raises(WeightFormatError, match="overlaps the tensor before it"):
        load_experts(done, 0)
    assert any("overlaps" in p for p in verify(done, raise_on_error=False))


def test_overflowing_shape_refused(tmp_path, base):
    """[2**32, 2**32] int32 elements wrap to 0 bytes in int64 arithmetic; Python integers do not."""
    from kt.weights._safetensors_io import SafetensorsError, SafetensorsFile

    p = tmp_path / "x.safetensors"
    text = json.dumps({"a": {"dtype": "I32", "shape": [2**32, 2**32], "data_offsets": [0, 0]}}).encode()
    text += b" " * ((-(8 + len(text))) % 64)
    p.write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(SafetensorsError, match=r"tensor 'a' to span 73786976294838206464 bytes"):
        SafetensorsFile(p)
    out = tmp_path / "o"
    shutil.copytree(base[1]["int4"], out)  # INT4's wsum tensors hold 0 bytes
    f = out / "layer_00000.safetensors"
    header, _ = read_layer_header(f)
    header["w13.wsum"]["shape"] = [2**32, 2**32]
    write_layer_header(f, header)
    refresh_manifest(out)
    with pytest.raises(WeightFormatError, match="w13.wsum"):
        load_experts(out, 0)
    assert verify(out, raise_on_error=False)


# ------------------------------------------------------------------ non-finite scales

@pytest.mark.parametrize("scheme, index, value, match", [
    ("int8", (1, 5), np.nan, r"w13\.scale of expert 1, w13 row 5 \(gate row 5\) is nan"),
    ("int8", (3, 40), np.inf, r"w13\.scale of expert 3, w13 row 40 \(up row 8\) is inf"),
    ("int4", (2, 1, 0, 3), -np.inf, r"w13\.scale of expert 2, w13 row 19 \(gate row 19\), group 0 is -inf"),
])
def test_non_finite_scale_refused(base, tmp_path, scheme, index, value, match):
    out = tmp_path / "o"
    shutil.copytree(base[1][scheme], out)
    f = out / "layer_00001.safetensors"
    b0, b1 = tensor_span(f, "w13.scale")
    header, _ = read_layer_header(f)
    shape = header["w13.scale"]["shape"]
    mm = np.memmap(f, np.float32, "r+", offset=b0, shape=tuple(shape))
    mm[index] = value
    mm.flush()
    del mm
    refresh_manifest(out)
    with pytest.raises(WeightFormatError, match=match):
        load_experts(out, 1)
    with pytest.raises(WeightFormatError, match=match):
        load_experts(out, 1, verify=False)
    load_experts(out, 0)  # the other layer is fine
    problems = verify(out, raise_on_error=False)
    assert len(problems) == 1 and "layer_00001" in problems[0]


def test_non_finite_scales_found_in_any_pass(base, tmp_path, monkeypatch):
    """The scales are checked a few experts at a time; one expert per pass finds the same."""
    from kt.weights import _layer_file

    monkeypatch.setattr(_layer_file, "_SCALE_CHUNK", 1)
    out = tmp_path / "o"
    shutil.copytree(base[1]["int8"], out)
    f = out / "layer_00000.safetensors"
    b0, _ = tensor_span(f, "w2.scale")
    mm = np.memmap(f, np.float32, "r+", offset=b0, shape=(N_E, 64))
    mm[2, 7] = mm[3, 1] = np.nan
    mm.flush()
    del mm
    refresh_manifest(out)
    with pytest.raises(WeightFormatError, match=r"w2\.scale of expert 2, w2 row 7 is nan \(2 non-finite"):
        load_experts(out, 0)


# ------------------------------------------------------------------ malformed manifests

def _set(path, value):
    def fn(m):
        obj = m
        for k in path[:-1]:
            obj = obj[k]
        if value is KeyError:
            del obj[path[-1]]
        else:
            obj[path[-1]] = value
    return fn


@pytest.mark.parametrize("edit, match", [
    (_set(("files", "0"), 5), r'files\["0"\] = 5; expected files\["0"\] to be an object'),
    (_set(("files", "0", "checksum"), KeyError), r'files\["0"\]\.checksum missing'),
    (_set(("files", "0", "file"), None), r'files\["0"\]\.file = null; expected files\["0"\]\.file to '
                                         r'be "layer_00000\.safetensors"'),
    (_set(("files",), []), r"files = \[\]; expected files to be an object"),
    (_set(("intermediate_size",), "64"), r'intermediate_size = "64"; expected intermediate_size to be an '
                                         r"integer in \[1, 1048576\]"),
    (_set(("intermediate_size",), 0), r"intermediate_size = 0"),
    (_set(("files", "1", "checksum"), "md5:" + "0" * 64), r"an algorithm in \['xxh64x16MiB-sha256'"),
    (_set(("layers",), [0, 0, 1]), r"layers = \[0, 0, 1\]; expected layers to be a non-empty list of "
                                   r"distinct"),
    (_set(("format_version",), True), r"format_version = true"),
    (_set(("group_size",), 64), r"group_size = 64; expected group_size to be 0 for int8"),
])
def test_malformed_manifest_is_a_weight_format_error(done, edit, match, capsys):
    from kt.cli.main import main

    _edit_manifest(done, edit)
    problems = verify(done, raise_on_error=False)
    assert problems and any(re.search(match, p) for p in problems), problems
    for verify_checksum in (True, False):
        with pytest.raises(WeightFormatError, match=match):
            load_experts(done, 0, verify=verify_checksum)
    capsys.readouterr()
    assert main(["convert", "--verify", str(done)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == len(problems) + 1 and all(e.startswith("FAILED: ") for e in err[:-1]), err


def test_manifest_that_is_a_fifo_does_not_hang(done):
    (done / "manifest.json").unlink()
    os.mkfifo(done / "manifest.json")
    result = []

    def load():
        try:
            load_experts(done, 0)
        except Exception as exc:  # noqa: BLE001 - the test looks at what it is
            result.append(exc)

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # unblock the open() so the thread ends, then fail
        with open(done / "manifest.json", "w"):
            pass
        t.join(20)
        pytest.fail("load_experts blocked on a FIFO manifest.json")
    assert isinstance(result[0], WeightFormatError) and "a FIFO; expected a regular file" in str(result[0])
    assert verify(done, raise_on_error=False) == [str(result[0])]


def test_layer_file_that_is_a_fifo_or_a_symlink_loop(done):
    f = done / "layer_00000.safetensors"
    f.unlink()
    os.mkfifo(f)
    with pytest.raises(WeightFormatError, match="a FIFO; expected a regular file"):
        load_experts(done, 0)
    f.unlink()
    f.symlink_to(f)
    with pytest.raises(WeightFormatError, match=r"cannot open it \(Too many levels of symbolic links\)"):
        load_experts(done, 0)
    assert len(verify(done, raise_on_error=False)) == 1


def test_random_npz_to_placement_plan_names_the_file(tmp_path, capsys):
    from kt.cli.main import main

    p = tmp_path / "stats.npz"
    p.write_bytes(np.random.default_rng(0).bytes(2000))
    rc = main(["placement", "plan", "--stats", str(p), "--budget", "1", "-o", str(tmp_path / "x.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(p) in err[0] and "not a .npz archive" in err[0], err
    assert "pickle" not in err[0] and rc == 2
    np.savez(p, counts=np.array([[{"a": 1}]], dtype=object))
    rc = main(["placement", "plan", "--stats", str(p), "--budget", "1", "-o", str(tmp_path / "x.json")])
    err = capsys.readouterr().err
    assert "arrays of Python objects, which kt does not unpickle" in err and "allow_pickle" not in err
    assert rc == 2
