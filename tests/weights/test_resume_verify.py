"""Interrupted conversions resume to a complete, verified output; corruption and bad input are
caught with errors that name the file."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kt.testing.checkpoints import layer_errors, small_checkpoint

from kt.weights import WeightFormatError, convert, load_experts, verify

N_LAYERS, N_E = 4, 4

KILLER = textwrap.dedent("""
    import os, signal, sys
    import kt.weights._convert as c
    from kt.weights import convert
    mode, src, out = sys.argv[1:4]
    if mode == "between":      # SIGKILL right after layer 1's file is in place
        cb = lambda L: os.kill(os.getpid(), signal.SIGKILL) if L == 1 else None
        convert(src, out, "int8", progress=False, threads=2, on_layer_done=cb)
    else:                      # SIGKILL in the middle of packing layer 2 (temp file half written)
        orig, calls = c.quantize_pack_into, [0]
        def wrapped(*a):
            calls[0] += 1
            if calls[0] == 2 * 3 * %(E)d + 5:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(*a)
        c.quantize_pack_into = wrapped
        convert(src, out, "int8", progress=False, threads=1)
    print("not killed")
""") % {"E": N_E}


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("src"), N_LAYERS, N_E)


def _kill_run(mode, src_dir, out):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", KILLER, mode, str(src_dir), str(out)],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stdout, r.stderr[-2000:])


@pytest.mark.subprocess
@pytest.mark.parametrize("mode", ["between", "mid_layer"])
def test_kill_and_resume(src, tmp_path, mode):
    src_dir, refs = src
    out = tmp_path / "o"
    _kill_run(mode, src_dir, out)
    assert not (out / "manifest.json").exists(), "an interrupted run must not look complete"
    partial = json.loads((out / "manifest.partial.json").read_text())
    assert sorted(partial["files"]) == ["0", "1"]
    if mode == "mid_layer":
        assert list(out.glob(".layer_00002.safetensors.tmp-*")), "expected the half-written temp file"
    with pytest.raises(WeightFormatError, match="rerun `kt convert` to resume"):
        load_experts(out, 0)
    kept = (out / "layer_00000.safetensors").stat()
    # a layer file that is not recorded (died between rename and bookkeeping) must be redone
    (out / "layer_00003.safetensors").write_bytes(b"garbage")
    m = convert(src_dir, out, "int8", progress=False)
    assert m["layers"] == list(range(N_LAYERS))
    after = (out / "layer_00000.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns), "finished layer redone"
    assert not (out / "manifest.partial.json").exists()
    assert not list(out.glob(".*tmp*"))
    assert verify(out) == []
    for L, (w13, w2) in refs.items():
        rel, diff, _ = layer_errors(out, L, w13, w2)
        assert diff == 0.0 and rel <= 0.03


def _flip_byte(path: Path, frac: float = 0.6) -> None:
    raw = bytearray(path.read_bytes())
    i = int(len(raw) * frac)
    raw[i] ^= 0x01
    path.write_bytes(bytes(raw))


@pytest.fixture()
def done(src, tmp_path):
    out = tmp_path / "o"
    convert(src[0], out, "int4", 32, progress=False)
    return out


def test_corruption_caught_and_repaired(src, done):
    f = done / "layer_00002.safetensors"
    _flip_byte(f)
    problems = verify(done, raise_on_error=False)
    assert len(problems) == 1 and "layer_00002.safetensors" in problems[0] and "checksum mismatch" in problems[0]
    with pytest.raises(WeightFormatError, match=r"layer_00002\.safetensors: checksum mismatch"):
        verify(done)
    with pytest.raises(WeightFormatError, match=r"layer_00002\.safetensors: checksum mismatch"):
        load_experts(done, 2)
    load_experts(done, 1)  # the other layers still load
    convert(src[0], done, "int4", 32, progress=False)  # rerun repairs the damaged layer
    assert verify(done) == []
    rel, diff, _ = layer_errors(done, 2, *src[1][2])
    assert diff == 0.0


def test_missing_and_truncated_layer_file(done):
    f = done / "layer_00001.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(WeightFormatError, match=r"layer_00001\.safetensors: \d+ bytes \(truncated or replaced\); expected \d+ bytes"):
        load_experts(done, 1)
    assert "layer_00001.safetensors" in verify(done, raise_on_error=False)[0]
    f.unlink()
    with pytest.raises(WeightFormatError, match=r"layer_00001\.safetensors: missing"):
        load_experts(done, 1)


def test_newer_format_version(done):
    p = done / "manifest.json"
    m = json.loads(p.read_text())
    m["format_version"] = 99
    p.write_text(json.dumps(m))
    with pytest.raises(WeightFormatError, match=r"manifest\.json: format version 99 was written by a newer kt"):
        load_experts(done, 0)
    with pytest.raises(WeightFormatError, match="newer kt"):
        verify(done)


def test_caller_expectations(done):
    with pytest.raises(WeightFormatError, match=r"manifest\.json: scheme is 'int4'; expected scheme 'int8' \(what the caller asks for\)"):
        load_experts(done, 0, scheme="int8")
    with pytest.raises(WeightFormatError, match=r"\(E, H, I\) is \(4, 64, 32\); expected \(E, H, I\) \(4, 64, 48\)"):
        load_experts(done, 0, shape=(4, 64, 48))
    with pytest.raises(WeightFormatError, match="group_size is 32; expected group_size 64"):
        load_experts(done, 0, group_size=64)
    with pytest.raises(WeightFormatError, match=r"layer 7 is not in this conversion; expected a layer of this conversion \(layers: \[0, 1, 2, 3\]\)"):
        load_experts(done, 7)
    from kt.config import MoEShape

    le = load_experts(done, 0, scheme="int4", shape=MoEShape(4, 2, 64, 32), group_size=32)
    assert le.group_size == 32 and le.w13.n == 64 and le.w2.d == 32
    with pytest.raises(WeightFormatError, match="not a directory"):
        load_experts(done / "nope", 0)


def test_output_dir_of_another_conversion(src, done):
    with pytest.raises(WeightFormatError, match=r"holds a different conversion \(differs in "
                       r"\['scheme', 'group_size', 'int4_scales'\]\);"):
        convert(src[0], done, "int8", progress=False)
    m = convert(src[0], done, "int8", progress=False, force=True)
    assert m["scheme"] == "int8" and verify(done) == []
    # an unchanged rerun of a complete conversion does nothing
    before = (done / "layer_00000.safetensors").stat().st_mtime_ns
    convert(src[0], done, "int8", progress=False)
    assert (done / "layer_00000.safetensors").stat().st_mtime_ns == before


def test_int4_conversion_from_before_ratio_scales(src, done):
    """An INT4 directory whose manifest predates the integer-ratio scales loads with a warning, a
    plain rerun says why it is refused, and --force re-converts it."""
    mpath = done / "manifest.json"
    m = json.loads(mpath.read_text())
    assert m["int4_scales"] == "ratio"
    del m["int4_scales"]
    mpath.write_text(json.dumps(m))
    with pytest.warns(UserWarning, match="converted before their group scales became integer ratios"):
        load_experts(done, 0)
    with pytest.raises(WeightFormatError, match=r"differs in \['int4_scales'\]\) \(it was converted "
                                                r"before INT4 scales became integer ratios"):
        convert(src[0], done, "int4", 32, progress=False)
    convert(src[0], done, "int4", 32, progress=False, force=True)
    assert json.loads(mpath.read_text())["int4_scales"] == "ratio" and verify(done) == []


def test_nan_in_source_fails_cleanly(tmp_path):
    from safetensors.torch import load_file, save_file

    src, _ = small_checkpoint(tmp_path, 2, N_E)
    sd = load_file(src / "model.safetensors")
    sd["model.layers.1.mlp.experts.2.up_proj.weight"][3, 5] = float("nan")
    save_file(sd, src / "model.safetensors")
    out = tmp_path / "o"
    with pytest.raises(ValueError, match="layer 1 expert 2: 1 rows/groups hold NaN or Inf"):
        convert(src, out, "int8", progress=False)
    assert sorted(p.name for p in out.iterdir()) == [".kt-convert.lock", "layer_00000.safetensors",
                                                     "manifest.partial.json"]


def test_concurrent_conversion_refused(src, tmp_path):
    import fcntl

    out = tmp_path / "o"
    out.mkdir()
    with open(out / ".kt-convert.lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        with pytest.raises(WeightFormatError, match="another kt convert is writing into this directory"):
            convert(src[0], out, "int8", progress=False)
    convert(src[0], out, "int8", progress=False)  # the lock is free again
    assert verify(out) == []
