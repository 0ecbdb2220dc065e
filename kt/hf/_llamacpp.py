"""llama.cpp on the shape kt runs: a GGUF of random weights written block by block, and
``llama-bench`` run on it (the baseline of ``kt bench model``).

The GGUF holds a Qwen3-MoE model (llama.cpp's ``qwen3moe``) of the given config with random
quantised blocks (Q8_0 for kt's INT8, Q4_0 for INT4, BF16 for BF16) written straight to the file,
one tensor at a time, so no float matrix of the model is ever made. Norms are ones; the tokenizer
is "none" (llama-bench feeds token ids).
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np

__all__ = ["GGUF_TYPES", "write_random_gguf", "run_llama_bench"]

GGUF_TYPES = {"int8": "Q8_0", "int4": "Q4_0", "bf16": "BF16"}


def _blocks(rng, rows: tuple[int, ...], cols: int, qtype: str, fan_in: int) -> np.ndarray:
    """Random rows of ``cols`` weights in ``qtype`` (bytes, [*rows, bytes per row]); effective
    weights of std about 1/sqrt(fan_in)."""
    if qtype == "BF16":
        w = rng.standard_normal((*rows, cols), dtype=np.float32) / np.float32(np.sqrt(fan_in))
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(*rows, 2 * cols)
    nb = cols // 32
    if qtype == "Q8_0":  # fp16 scale + 32 int8
        qs = rng.integers(-127, 128, size=(*rows, nb, 32), dtype=np.int8).view(np.uint8)
        d = np.float16(np.sqrt(3.0) / 127 / np.sqrt(fan_in))
    else:  # Q4_0: fp16 scale + 16 bytes of two nibbles (q - 8)
        qs = rng.integers(0, 256, size=(*rows, nb, 16), dtype=np.uint8)
        d = np.float16(np.sqrt(3.0) / 8 / np.sqrt(fan_in))
    scale = np.full((*rows, nb, 1), d, np.float16).view(np.uint8)
    return np.concatenate([scale, qs], axis=-1).reshape(*rows, -1)


def write_random_gguf(path, cfg, scheme: str, *, seed: int = 0, progress: bool = True) -> Path:
    """Write a ``qwen3moe`` GGUF of transformers config ``cfg`` (a qwen3_moe config) with
    random weights in the type matching kt's ``scheme``; returns the path."""
    import gguf
    from tqdm import tqdm

    if getattr(cfg, "model_type", None) != "qwen3_moe":
        raise ValueError(f"the llama.cpp baseline writes Qwen3-MoE models; this config is "
                         f"{getattr(cfg, 'model_type', None)!r}")
    qtype = GGUF_TYPES[scheme]
    Q = getattr(gguf.GGMLQuantizationType, qtype)
    V, H, L = cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers
    E, I, NH, NKV = cfg.num_experts, cfg.moe_intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads
    HD = getattr(cfg, "head_dim", None) or H // NH
    if H % 32 or I % 32 or (NH * HD) % 32:
        raise ValueError("llama.cpp's block types need H, I and the attention width divisible by 32")
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(L)
    w.add_context_length(int(getattr(cfg, "max_position_embeddings", 4096)))
    w.add_embedding_length(H)
    w.add_feed_forward_length(int(getattr(cfg, "intermediate_size", I)))
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or 1e6))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_expert_count(E)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(I)
    w.add_tokenizer_model("none")
    w.add_vocab_size(V)  # read as the vocabulary size when there is no tokenizer
    # (name, rows, cols, fan_in) of every quantised tensor; (name, shape) of the fp32 ones
    quant, plain = [("token_embd.weight", (V,), H, 1), ("output.weight", (V,), H, H)], [("output_norm.weight", (H,))]
    for i in range(L):
        p = f"blk.{i}."
        plain += [(p + "attn_norm.weight", (H,)), (p + "ffn_norm.weight", (H,)),
                  (p + "attn_q_norm.weight", (HD,)), (p + "attn_k_norm.weight", (HD,)),
                  (p + "ffn_gate_inp.weight", (E, H))]
        quant += [(p + "attn_q.weight", (NH * HD,), H, H), (p + "attn_k.weight", (NKV * HD,), H, H),
                  (p + "attn_v.weight", (NKV * HD,), H, H), (p + "attn_output.weight", (H,), NH * HD, NH * HD),
                  (p + "ffn_gate_exps.weight", (E, I), H, H), (p + "ffn_up_exps.weight", (E, I), H, H),
                  (p + "ffn_down_exps.weight", (E, H), I, I)]
    bsize, tsize = gguf.GGML_QUANT_SIZES[Q]
    for name, rows, cols, _ in quant:
        w.add_tensor_info(name, (*rows, cols), np.dtype(np.float32),
                          int(np.prod(rows)) * cols // bsize * tsize, raw_dtype=Q)
    for name, shape in plain:
        w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, rows, cols, fan_in in tqdm(quant, desc=f"llama.cpp: GGUF {qtype}", unit="tensor",
                                         disable=not progress):
        w.write_tensor_data(_blocks(rng, rows, cols, qtype, fan_in))
    for name, shape in plain:
        if name.endswith("ffn_gate_inp.weight"):
            w.write_tensor_data(rng.standard_normal(shape, dtype=np.float32) * np.float32(2 / np.sqrt(H)))
        else:
            w.write_tensor_data(np.ones(shape, np.float32))
    w.close()
    return Path(path)


def run_llama_bench(binary, gguf_path, *, prompt: int, decode: int, threads: int, reps: int,
                    extra: tuple[str, ...] = (), timeout: float = 3600) -> dict:
    """Prefill and decode tokens/s of ``llama-bench`` on ``gguf_path``: {"prefill_tok_s",
    "decode_tok_s", "prefill_samples", "decode_samples", "command"}."""
    binary = Path(binary).expanduser()
    if not binary.is_file():
        raise FileNotFoundError(f"{binary}: no llama-bench binary there")
    cmd = [str(binary), "-m", str(gguf_path), "-p", str(prompt), "-n", str(decode), "-t", str(threads),
           "-r", str(reps), "-o", "json", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed (exit {r.returncode}): {r.stderr.strip()[-800:]}")
    out = {"command": " ".join(cmd)}
    for row in json.loads(r.stdout):
        key = "prefill" if row.get("n_prompt", 0) > 0 else "decode"
        out[f"{key}_tok_s"] = float(row["avg_ts"])
        out[f"{key}_samples"] = [float(v) for v in row.get("samples_ts", [])]
    return out
