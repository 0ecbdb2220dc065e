"""kt.hf.run and the `kt generate` / `kt chat` commands on a saved tiny model (in-process)."""
from __future__ import annotations

import io
import sys

import pytest

from _hf_models import require_kt_backend  # noqa: F401  (sets the transformers skip)

from kt.cli.main import main
from kt.hf.tiny import save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("run") / "m", "deepseek_v3", seed=0)


def test_load_generate_stream_and_timing(model_dir):
    require_kt_backend()
    from kt.hf.run import generate, load_model

    model, tok = load_model(model_dir, device="cpu", dtype="fp32", progress=False)
    assert model.kt_patch.backend == "cpu" and model.kt_patch.config.scheme.value == "bf16"
    pieces = []
    stats = generate(model, tok, "The quick brown fox", max_new_tokens=12,
                     echo=lambda t, end: pieces.append(t))
    assert stats.new_tokens == 12 and len(stats.token_ids) == 12
    assert stats.decode_tok_s > 0 and stats.prefill_s > 0
    assert "".join(pieces) == tok.decode(stats.token_ids, skip_special_tokens=True)


def test_generate_cli(model_dir, capsys):
    require_kt_backend()
    rc = main(["generate", str(model_dir), "--prompt", "Hello there", "--max-new-tokens", "6",
               "--scheme", "int4", "--device", "cpu", "--dtype", "fp32"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert out.out.startswith("Hello there")
    assert "decode" in out.err and "tok/s" in out.err


def test_chat_cli_fed_stdin(model_dir, capsys, monkeypatch):
    """Two turns (the second sees the first through the chat template), then /exit."""
    require_kt_backend()
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi there\nwhat is a processor?\n/exit\nnever read\n"))
    rc = main(["chat", str(model_dir), "--max-new-tokens", "5", "--scheme", "int8", "--device", "cpu",
               "--dtype", "fp32", "--activations", "int8x2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "chat template" in out
    assert out.count("assistant: ") == 2
    assert out.count("decode") == 2 and "tok/s]" in out
    replies = [line for line in out.splitlines() if line.startswith("assistant: ")]
    assert all(len(r) > len("assistant: ") for r in replies), out


@pytest.mark.parametrize("args, match", [
    (["generate", "/nonexistent/model", "--prompt", "x"], "no such directory"),
    (["generate", "{tmp}", "--prompt", "x"], "not a Hugging Face model directory"),
    (["chat", "{model}", "--weights", "{tmp}"], "not a complete kt weight directory"),
])
def test_cli_bad_input(model_dir, tmp_path, capsys, args, match):
    args = [a.format(tmp=tmp_path, model=model_dir) for a in args]
    monkey_in = io.StringIO("")
    old, sys.stdin = sys.stdin, monkey_in
    try:
        rc = main(args)
    finally:
        sys.stdin = old
    err = capsys.readouterr().err
    assert rc == 2 and match in err, err
