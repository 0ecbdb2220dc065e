"""Execute the example notebooks (examples/*.ipynb) so they never rot.

The kernel is this test's own interpreter: a kernel spec pointing at ``sys.executable`` is
written to a temporary JUPYTER_PATH entry (nothing is installed in the user's Jupyter dirs), so
the notebooks see the same kt, torch and transformers as the tests.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="executing notebooks needs nbformat (kt[test])")
nbclient = pytest.importorskip("nbclient", reason="executing notebooks needs nbclient (kt[test])")
pytest.importorskip("ipykernel", reason="executing notebooks needs ipykernel (kt[test])")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
KERNEL = "kt-tests-python"
NOTEBOOKS = sorted(p.name for p in EXAMPLES.glob("*.ipynb"))


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory, monkeypatch_module):
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "kt tests", "language": "python"}))
    monkeypatch_module.setenv("JUPYTER_PATH", os.pathsep.join(
        [str(root)] + [p for p in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]))
    monkeypatch_module.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend draws PNGs
    # the notebooks import kt from this checkout even when it is not installed
    repo = str(EXAMPLES.parent)
    monkeypatch_module.setenv("PYTHONPATH", os.pathsep.join(
        [repo] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return root


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_every_example_is_listed():
    assert NOTEBOOKS == ["01_cpu_moe_layer.ipynb", "02_hf_model.ipynb", "03_placement.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, kernel_env, tmp_path):
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=180,
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - t0
    print(f"{name}: {elapsed:.1f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                 if "image/png" in o.get("data", {}))
    assert images >= 1, f"{name}: no figure was drawn"
