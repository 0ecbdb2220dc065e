"""`kt convert` and `kt convert --verify` from the command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kt.cli.main import main
from kt.testing.checkpoints import small_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return small_checkpoint(tmp_path_factory.mktemp("cli"), 3, 4)[0]


def test_convert_and_verify(src, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["convert", str(src), "-o", str(out), "--scheme", "int4", "--group-size", "32",
                 "--layers", "0,2", "-q"]) == 0
    assert "2 MoE layers, scheme int4 G=32, E=4 H=64 I=32" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text())
    assert m["layers"] == [0, 2] and m["group_size"] == 32
    assert main(["convert", "--verify", str(out)]) == 0
    assert "OK (2 layers" in capsys.readouterr().out
    f = out / "layer_00002.safetensors"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x80
    f.write_bytes(bytes(raw))
    assert main(["convert", "--verify", str(out)]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "layer_00002.safetensors" in err and "checksum mismatch" in err


def test_cli_errors(src, tmp_path, capsys):
    assert main(["convert", str(tmp_path / "missing"), "-o", str(tmp_path / "o"), "-q"]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert main(["convert", str(src)]) == 2
    assert "usage: kt convert" in capsys.readouterr().err
    assert main(["convert", str(src), "-o", str(tmp_path / "o"), "--layers", "1-x", "-q"]) == 2
    assert "--layers: cannot parse '1-x'" in capsys.readouterr().err
    assert main(["convert", "--verify", str(tmp_path)]) == 1
    assert "manifest.json: missing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["convert", str(src), "-o", str(tmp_path / "o"), "--scheme", "fp4"])


@pytest.mark.subprocess
def test_kt_command_progress_bar(src, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "kt.cli", "convert", str(src), "-o", str(tmp_path / "o"),
                        "--scheme", "int8", "--threads", "2"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "layer/s" in r.stderr and "GB/s" in r.stderr and "3/3" in r.stderr, r.stderr
