"""`kt demo`, the README's main job: one command, from nothing to a checked, timed run."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="kt demo needs transformers (pip install 'kt[hf]')")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_demo_from_nothing(tmp_path):
    """A fresh demo directory: builds the model, converts, compares, generates; exit 0 = within
    the INT8 bound. Run as a user would (a new process); kernels use the shared kt cache."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "kt.cli", "demo", "--dir", str(tmp_path), "--max-new-tokens", "8"],
                       capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    print(r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "building the demo model" in out
    # the kt model comes through load_model: kt experts from the weight directory, only the
    # non-expert tensors of the checkpoint read
    assert "from the kt weight directory; 39 non-expert tensors read from the checkpoint" in out
    assert "PASS" in out and "greedy 16/16 tokens identical" in out
    assert "decode" in out and "tok/s" in out
    from kt.hf.demo import build_demo_model, demo_model_dir

    model_dir = demo_model_dir(tmp_path)
    assert (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file()
    assert (tmp_path / f"{model_dir.name}.kt-int8" / "manifest.json").is_file()

    # a second run reuses the built model
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert build_demo_model(tmp_path) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_demo_rejects_bad_arguments(capsys):
    from kt.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["demo", "--scheme", "fp4"])
    assert exc.value.code == 2
    assert "invalid choice: 'fp4'" in capsys.readouterr().err
