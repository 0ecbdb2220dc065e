"""`kt run`: the SGLang command built from kt's defaults (no SGLang needed: --dry-run prints it, and a
stand-in `sglang.launch_server` module checks that the command is really run)."""
from __future__ import annotations

import json
import shlex
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from kt.cli import run as kt_run
from kt.cli.main import main
from kt.sglang_hook._flags import _numa_node_ids, default_threads

E, H, I, L = 8, 64, 32, 2
GiB = 2**30


@pytest.fixture()
def tiny_model(tmp_path):
    """A local MoE model directory: qwen3_moe config, bf16-sized expert and dense tensors."""
    d = tmp_path / "tiny-moe"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": L,
        "num_experts": E, "num_experts_per_tok": 2, "hidden_size": H, "moe_intermediate_size": I,
        "torch_dtype": "bfloat16"}))
    t = {"model.embed_tokens.weight": np.zeros((1000, H), np.float16)}
    for layer in range(L):
        for e in range(E):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            t[f"{p}.gate_proj.weight"] = np.zeros((I, H), np.float16)
            t[f"{p}.up_proj.weight"] = np.zeros((I, H), np.float16)
            t[f"{p}.down_proj.weight"] = np.zeros((H, I), np.float16)
    save_file(t, str(d / "model.safetensors"))
    w = tmp_path / "kt-int8"
    w.mkdir()
    (w / "manifest.json").write_text(json.dumps({"scheme": "int8", "num_experts": E, "hidden_size": H,
                                                 "intermediate_size": I, "layers": list(range(L))}))
    return d, w


def _printed(capsys):
    out, err = capsys.readouterr()
    lines = [l for l in out.splitlines() if l.strip()]
    assert len(lines) == 1, out
    return shlex.split(lines[0]), err


def test_dry_run_prints_the_launch_command(tiny_model, capsys):
    d, w = tiny_model
    rc = main(["run", str(d), "--dry-run", "--vram", "8GiB", "--kt-weight-path", str(w), "--kt-method", "AMXINT8",
               "--python", "/opt/sg/bin/python", "--", "--port", "31000", "--tp-size", "1"])
    assert rc == 0
    cmd, err = _printed(capsys)
    total = (d / "model.safetensors").stat().st_size
    experts = L * E * 3 * H * I * 2
    budget = 8 * GiB - (total - experts) - 2 * GiB  # the reserve: max(20% of 8 GiB, 2 GiB)
    assert budget == kt_run.gpu_expert_budget(8 * GiB, total - experts)
    assert cmd == ["/opt/sg/bin/python", "-m", "sglang.launch_server", "--model-path", str(d),
                   "--kt-weight-path", str(w), "--kt-method", "AMXINT8",
                   "--kt-cpuinfer", str(default_threads()),
                   "--kt-threadpool-count", str(max(1, len(_numa_node_ids()))),
                   "--kt-gpu-expert-budget", str(budget),
                   "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
                   "--port", "31000", "--tp-size", "1"]
    assert "GPU expert budget" in err


def test_given_flags_replace_the_defaults_wherever_they_stand(tiny_model, capsys):
    d, w = tiny_model
    placement = d.parent / "p.json"
    from kt.placement import Placement

    Placement.from_contiguous(L, E, 2).save(placement)
    rc = main(["run", "--kt-cpuinfer", "7", str(d), "--dry-run", "--kt-threadpool-count", "3",
               "--kt-placement", str(placement), "--kt-max-deferred-experts-per-token", "1",
               "--kt-gpu-prefill-token-threshold", "auto", "--kt-numa-nodes", "0", "--python", "py",
               "--kt-enable-dynamic-expert-update", "--", "--cuda-graph-backend-decode=disabled"])
    assert rc == 0
    cmd, err = _printed(capsys)
    assert cmd[:5] == ["py", "-m", "sglang.launch_server", "--model-path", str(d)]
    args = cmd[5:]
    assert args[args.index("--kt-cpuinfer") + 1] == "7" and args[args.index("--kt-threadpool-count") + 1] == "3"
    assert args[args.index("--kt-placement") + 1] == str(placement)
    assert args[args.index("--kt-gpu-prefill-token-threshold") + 1] == "auto"
    assert args[args.index("--kt-numa-nodes") + 1] == "0"
    assert "--kt-enable-dynamic-expert-update" in args
    assert "--kt-gpu-expert-budget" not in args and "--kt-num-gpu-experts" not in args
    # the user's own graph setting is kept, not doubled
    assert args.count("--cuda-graph-backend-decode=disabled") == 1 and "--cuda-graph-backend-decode" not in args
    assert args[args.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    assert "quantised while SGLang loads" in err  # no --kt-weight-path


def test_no_gpu_puts_every_expert_on_the_cpu(tiny_model, capsys, monkeypatch):
    d, _ = tiny_model
    monkeypatch.setattr(kt_run, "free_vram", lambda: None)
    assert main(["run", str(d), "--dry-run", "--python", "py"]) == 0
    cmd, err = _printed(capsys)
    assert cmd[cmd.index("--kt-num-gpu-experts") + 1] == "0"
    assert "no GPU memory found" in err


def test_free_vram_from_the_gpu_sets_the_budget(tiny_model, capsys, monkeypatch):
    d, w = tiny_model
    monkeypatch.setattr(kt_run, "free_vram", lambda: 24 * GiB)
    assert main(["run", str(d), "--dry-run", "--python", "py", "--kt-weight-path", str(w)]) == 0
    cmd, _ = _printed(capsys)
    total = (d / "model.safetensors").stat().st_size
    assert int(cmd[cmd.index("--kt-gpu-expert-budget") + 1]) == kt_run.gpu_expert_budget(
        24 * GiB, total - L * E * 3 * H * I * 2)


def test_budget_arithmetic():
    assert kt_run.gpu_expert_budget(80 * GiB, 10 * GiB) == 80 * GiB - 10 * GiB - 16 * GiB
    assert kt_run.gpu_expert_budget(4 * GiB, 3 * GiB) == 0
    assert kt_run.gpu_expert_budget(10 * GiB, 0, reserve_fraction=0.5, min_reserve=0) == 5 * GiB


@pytest.mark.parametrize("argv, msg", [
    (["run", "--dry-run"], "needs a MODEL"),
    (["run", "M", "--dry-run", "--port", "3"], "SGLang's own arguments go after `--`"),
    (["run", "M", "--dry-run", "--kt-num-gpu-experts", "2", "--kt-gpu-experts-ratio", "0.5"],
     "only one GPU-expert budget"),
    (["run", "M", "--dry-run", "--kt-method", "AMXINT3"], "--kt-method 'AMXINT3' is not known"),
    (["run", "M", "--dry-run", "--kt-weight-path", "/nonexistent/kt"], "no such directory"),
])
def test_errors(argv, msg, capsys):
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


def test_mismatched_weight_directory_is_refused(tiny_model, capsys):
    d, w = tiny_model
    (w / "manifest.json").write_text(json.dumps({"scheme": "int8", "num_experts": 16, "hidden_size": H,
                                                 "intermediate_size": I, "layers": [0, 1]}))
    assert main(["run", str(d), "--dry-run", "--kt-weight-path", str(w), "--kt-num-gpu-experts", "1"]) == 2
    assert "converted from another model" in capsys.readouterr().err


def test_run_executes_the_command(tiny_model, tmp_path, capsys, monkeypatch):
    """Without --dry-run the printed command is run and its exit status returned (a stand-in
    sglang.launch_server records its arguments)."""
    d, w = tiny_model
    fake = tmp_path / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    record = tmp_path / "argv.json"
    (fake / "sglang" / "launch_server.py").write_text(
        "import json, sys\n"
        f"json.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
        "sys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(fake))
    rc = main(["run", str(d), "--python", sys.executable, "--kt-weight-path", str(w), "--kt-num-gpu-experts", "2",
               "--", "--port", "31001"])
    assert rc == 3
    cmd, _ = _printed(capsys)
    assert json.loads(record.read_text()) == cmd[3:]
    assert cmd[-2:] == ["--port", "31001"]
