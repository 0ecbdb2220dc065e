import json
import sys

import pytest

from kt.cli.main import main


def test_bench_tiny(capsys):
    assert main(["bench", "--shape", "tiny", "--tokens", "1,4", "--schemes", "int8,int8x2",
                 "--reps", "2", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for scheme in ("int8", "int8x2"):
        rows = [line.split() for line in out.splitlines() if line.startswith(scheme + " ")]
        assert [r[1] for r in rows] == ["1", "4"], out
        assert all(float(r[2]) > 0 and float(r[5]) > 0 for r in rows)


def test_bench_bad_input(capsys):
    assert main(["bench", "--shape", "nope"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["bench", "--shape", "tiny", "--tokens", "0"]) == 2
    assert main(["bench", "--shape", "tiny", "--schemes", "fp4"]) == 2
    assert "unknown quantisation scheme" in capsys.readouterr().err


def test_bench_profile(capsys):
    assert main(["bench", "--shape", "tiny", "--tokens", "64", "--schemes", "int8", "--reps", "2",
                 "--threads", "1", "--profile"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "phases over 1 threads" in ln)
    shares = {p.split()[0]: float(p.split()[1].rstrip("%")) for p in line.split(": ", 1)[1].split(", ")}
    assert {"gate_up", "down"} <= set(shares) and abs(sum(shares.values()) - 100) <= len(shares)


_FAKE_LLAMA_BENCH = '''#!{python}
"""Stands in for llama-bench: reads the GGUF it is given, records what it holds, prints JSON."""
import json, sys
import gguf
args = sys.argv[1:]
r = gguf.GGUFReader(args[args.index("-m") + 1])
seen = {{t.name: [t.tensor_type.name, [int(x) for x in t.shape]] for t in r.tensors}}
fields = {{k: (f.parts[f.data[0]].tolist() if f.data else None) for k, f in r.fields.items()}}
json.dump({{"args": args, "tensors": seen, "vocab": fields.get("qwen3moe.vocab_size"),
           "experts": fields.get("qwen3moe.expert_count")}}, open("{record}", "w"))
print(json.dumps([{{"n_prompt": 4, "n_gen": 0, "avg_ts": 100.0, "samples_ts": [100.0]}},
                  {{"n_prompt": 0, "n_gen": 3, "avg_ts": 10.0, "samples_ts": [10.0]}}]))
'''


@pytest.mark.parametrize("scheme,qtype", [("int8", "Q8_0"), ("int4", "Q4_0")])
def test_bench_model_beside_llama_cpp(tmp_path, capsys, scheme, qtype):
    """A tiny Qwen3-MoE directory: kt's row, llama.cpp's row from the GGUF kt wrote (read back
    by the stand-in binary: every tensor of the shape, in the type of the scheme), the ratio."""
    pytest.importorskip("transformers")

    from kt.hf.tiny import save_tiny_model

    d = save_tiny_model(tmp_path / "m", "qwen3_moe")
    record = tmp_path / "seen.json"
    fake = tmp_path / "llama-bench"
    fake.write_text(_FAKE_LLAMA_BENCH.format(python=sys.executable, record=record))
    fake.chmod(0o755)
    out_json = tmp_path / "r.json"
    assert main(["bench", "model", str(d), "--layers", "1", "--scheme", scheme, "--prompt", "4",
                 "--decode", "3", "--reps", "1", "--threads", "1", "--llama-bench", str(fake),
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "| kt |" in out and f"| llama.cpp | {qtype} |" in out and "kt / llama.cpp" in out
    res = json.loads(out_json.read_text())
    assert res["layers"] == 1 and res["kt"]["decode_tok_s"] > 0 and res["kt"]["prefill_tok_s"] > 0
    assert res["floor"]["bytes_per_token"]["experts"] > 0 and res["llama.cpp"]["decode_tok_s"] == 10.0
    seen = json.loads(record.read_text())
    assert seen["args"][seen["args"].index("-ngl") + 1] == "0" and "-t" in seen["args"]
    t = seen["tensors"]
    cfg = json.loads((d / "config.json").read_text())
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    assert t["blk.0.ffn_gate_exps.weight"] == [qtype, [H, I, E]]  # ggml order: fastest dim first
    assert t["blk.0.ffn_down_exps.weight"] == [qtype, [I, H, E]]
    assert t["output.weight"][0] == qtype and t["blk.0.attn_norm.weight"][0] == "F32"
    assert len([n for n in t if n.startswith("blk.")]) == 12 and "blk.1.attn_q.weight" not in t
    assert seen["vocab"] == [cfg["vocab_size"]] and seen["experts"] == [E]


def test_bench_model_bad_input(tmp_path, capsys):
    assert main(["bench", "model"]) == 2
    assert "model directory or --config" in capsys.readouterr().err
    assert main(["bench", "model", str(tmp_path)]) == 2
    assert "neither a preset" in capsys.readouterr().err
    assert main(["bench", "model", "--config", "qwen3-30b-a3b", "--layers", "0"]) == 2
    assert "--layers must be in [1, 48]" in capsys.readouterr().err
