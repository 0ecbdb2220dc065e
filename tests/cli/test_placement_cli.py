"""`kt placement record | plan | show` through kt.cli.main.main."""
import json

import numpy as np
import pytest
import torch

from kt.cli.main import main
from kt.placement import ExpertStats, Placement


def test_record_synthetic_plan_show(tmp_path, capsys):
    stats = tmp_path / "s.npz"
    assert main(["placement", "record", "--synthetic", "--layers", "4", "--experts", "16", "--top-k", "2",
                 "--tokens", "500", "--seed", "3", "-o", str(stats)]) == 0
    s = ExpertStats.load(stats)
    assert s.shape == (4, 16) and s.total() == 4 * 500 * 2 and s.tokens.tolist() == [500] * 4
    pj = tmp_path / "p.json"
    assert main(["placement", "plan", "--stats", str(stats), "--budget", "25%", "-o", str(pj)]) == 0
    p = Placement.load(pj, num_layers=4, num_experts=16)
    assert p.num_gpu_experts() == 16
    top16 = np.argsort(-s.counts.reshape(-1), kind="stable")[:16]
    assert np.array_equal(np.flatnonzero(p.gpu_mask.reshape(-1)), np.sort(top16))
    capsys.readouterr()
    png = tmp_path / "h.png"
    assert main(["placement", "show", str(pj), "--stats", str(stats), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "GPU experts: 16 (25.0 % of all)" in out and "expected GPU hit rate" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["placement", "show", str(pj), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["gpu_experts"] == 16 and len(d["layers"]) == 4


def test_plan_bytes_budget_and_strategies(tmp_path, capsys):
    pj = tmp_path / "p.json"
    assert main(["placement", "plan", "--shape", "4", "8", "--budget", "100MiB", "--strategy", "uniform",
                 "--hidden", "256", "--intermediate", "128", "--dtype", "bf16", "--reserve", "64MiB",
                 "--name", "toy", "-o", str(pj)]) == 0
    p = Placement.load(pj)
    eb = 3 * 256 * 128 * 2
    assert p.expert_bytes == eb and p.num_gpu_experts() == min(32, (36 * 2**20) // eb) and p.model == "toy"
    assert main(["placement", "plan", "--shape", "4", "8", "--budget", "2/layer", "--strategy", "front-loading",
                 "--moe-layers", "1-2", "-o", str(pj)]) == 0
    assert Placement.load(pj).gpu_counts().tolist() == [0, 4, 0, 0]


def test_plan_errors_and_warnings(tmp_path, capsys):
    pj = tmp_path / "p.json"
    assert main(["placement", "plan", "--shape", "2", "4", "--budget", "1KiB", "--expert-bytes", "4096",
                 "-o", str(pj)]) == 2
    assert "smaller than one expert" in capsys.readouterr().err
    assert main(["placement", "plan", "--shape", "2", "4", "--budget", "5", "-o", str(pj)]) == 2
    assert "'frequency' needs activation statistics" in capsys.readouterr().err
    assert main(["placement", "plan", "--shape", "2", "4", "--budget", "50", "--strategy", "random",
                 "-o", str(pj)]) == 0
    assert "placing every expert on the GPU" in capsys.readouterr().err
    np.save(tmp_path / "neg.npy", np.array([[1.0, -1.0]]))
    assert main(["placement", "plan", "--stats", str(tmp_path / "neg.npy"), "--budget", "1", "-o", str(pj)]) == 2
    assert "negative count" in capsys.readouterr().err
    assert main(["placement", "plan", "--shape", "2", "4", "--budget", "1", "--strategy", "uniform",
                 "--moe-layers", "x", "-o", str(pj)]) == 2


def test_show_rejects_stats_of_another_model(tmp_path, capsys):
    pj = Placement.from_contiguous(2, 4, 1).save(tmp_path / "p.json")
    np.save(tmp_path / "c.npy", np.ones((3, 4)))
    assert main(["placement", "show", str(pj), "--stats", str(tmp_path / "c.npy")]) == 2
    assert "but the model has num_layers=2" in capsys.readouterr().err


def test_record_from_trace_files(tmp_path):
    rng = np.random.default_rng(5)
    ids = rng.integers(-1, 6, size=(3, 20, 2))
    w = rng.random((3, 20, 2)).astype(np.float32)
    np.savez(tmp_path / "t.npz", topk_ids=ids, topk_weights=w)
    torch.save({"topk_ids": torch.from_numpy(ids)}, tmp_path / "t.pt")
    out = tmp_path / "s.json"
    assert main(["placement", "record", "--trace", str(tmp_path / "t.npz"), "--weighted",
                 "--experts", "8", "-o", str(out)]) == 0
    s = ExpertStats.load(out)
    assert s.shape == (3, 8) and s.weighted
    ref = np.zeros((3, 8))
    for l in range(3):
        keep = ids[l] >= 0
        np.add.at(ref[l], ids[l][keep], w[l][keep].astype(np.float64))
    np.testing.assert_allclose(s.counts, ref, rtol=1e-12)
    assert main(["placement", "record", "--trace", str(tmp_path / "t.pt"), "-o", str(out)]) == 0
    assert ExpertStats.load(out).shape == (3, int(ids.max()) + 1)
    assert main(["placement", "record", "--trace", str(tmp_path / "t.pt"), "--weighted", "-o", str(out)]) == 2


def test_record_from_a_model(tmp_path, capsys):
    """Statistics recorded from a tiny HF model run over prompts (experts on kt) count every
    token-slot its router chose, in every MoE layer."""
    from kt.hf import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "m", "qwen3_moe", num_layers=2)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello world\n\nthe experts of a layer\n")
    out = tmp_path / "s.npz"
    assert main(["placement", "record", "--model", str(model_dir), "--prompts", str(prompts),
                 "--scheme", "bf16", "-o", str(out)]) == 0
    s = ExpertStats.load(out)
    assert s.shape == (2, 16)
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    n = sum(len(tok(p).input_ids) for p in ("hello world", "the experts of a layer"))
    assert (s.counts.sum(axis=1) == n * 4).all()  # top-4 in every layer
    assert "2 prompts" in capsys.readouterr().out
    assert main(["placement", "record", "--model", str(tmp_path / "nope"), "-o", str(out)]) == 2


def test_placement_without_action_prints_help(capsys):
    assert main(["placement"]) == 2
    assert "record" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["placement", "plan"])  # argparse: --budget and -o are required
