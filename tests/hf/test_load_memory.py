"""The peak host memory of kt.hf.load_model against the formula in its docstring, measured in
fresh processes on a model whose bf16 experts (50 MB) are 36x its non-expert weights (1.4 MB).

Margin: 8 MiB above the formula, for the allocator and the Python objects of the model's
modules; the experts are 50 MB, so a load that materialised them would be far outside it.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _hf_models import require_kt_backend  # noqa: F401  (sets the transformers skip)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("_load_memory.py")
MARGIN = 8 << 20
MB = 1 << 20

pytestmark = pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(),
                                reason="peak RSS is read from Linux /proc (VmHWM, clear_refs)")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import kt.weights
    from kt.hf.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("mem")
    big = save_tiny_model(root / "big", "qwen3_moe", hidden_size=256, moe_intermediate_size=256,
                          num_layers=4, num_experts=32, top_k=4)
    kt.weights.convert(big, root / "big-int8", scheme="int8", progress=False)
    warm = save_tiny_model(root / "warm", "qwen3_moe", num_layers=2)
    return big, root / "big-int8", warm


def _measure(models, mode: str) -> dict:
    big, weights, warm = models
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(SCRIPT), str(big), "--mode", mode, "--weights", str(weights),
                        "--scheme", "int8", "--dtype", "bf16", "--warmup", str(warm)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    m["grew"] = m["peak"] - m["baseline"]
    print(f"{mode}: peak - baseline = {m['grew'] / MB:.1f} MB; W_ne {m['w_ne'] / MB:.1f}, "
          f"S_max {m['s_max'] / MB:.1f}, K {m['k'] / MB:.1f}, layer {m['layer_src'] / MB:.1f}, "
          f"experts bf16 {m['w_experts'] / MB:.1f} MB")
    return m


@pytest.mark.subprocess
def test_peak_memory_follows_the_formula(models):
    require_kt_backend()
    kt_dir, conv, old = (_measure(models, mode) for mode in ("kt-dir", "checkpoint", "old"))
    assert kt_dir["w_experts"] >= 30 * kt_dir["w_ne"]  # a model the formula can tell apart
    # a kt weight directory: the non-expert weights, and nothing of the experts at load
    assert kt_dir["grew"] <= kt_dir["w_ne"] + kt_dir["s_max"] + MARGIN, kt_dir
    assert kt_dir["grew"] < kt_dir["w_experts"] / 4, kt_dir
    # converting from the checkpoint: + the kt experts + one layer's source
    bound = conv["w_ne"] + conv["s_max"] + conv["k"] + conv["layer_src"] + MARGIN
    assert conv["grew"] <= bound, conv
    assert conv["grew"] >= 0.9 * conv["k"], conv  # the measurement sees the experts kt holds
    # the old path holds the whole checkpoint
    assert old["grew"] >= old["w_experts"], old
