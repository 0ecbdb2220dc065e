"""Tiny source checkpoints for the tests of kt.weights and of everything that loads converted
experts, built offline (no downloads): ``from kt.testing.checkpoints import small_checkpoint``.

HF families via transformers ``from_config`` + ``save_pretrained``, expert weights re-drawn with
std 1/sqrt(fan_in) (what trained layers look like); a synthetic fp8 block-scaled checkpoint and a
fused-experts checkpoint written directly as safetensors; a GGUF written with gguf's GGUFWriter.
Each builder returns the reference fp32 expert weights {layer: (w13 [E, 2I, H], w2 [E, H, I])}.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

H = 64
I_MOE = 32
E = 8


def _configs():
    import transformers as tf

    common = dict(vocab_size=32, hidden_size=H, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64)
    return {
        "qwen2_moe": tf.Qwen2MoeConfig(**common, intermediate_size=64, moe_intermediate_size=I_MOE,
                                       shared_expert_intermediate_size=32, num_hidden_layers=2,
                                       num_experts=E, num_experts_per_tok=2),
        "qwen3_moe": tf.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=I_MOE,
                                       num_hidden_layers=2, num_experts=E, num_experts_per_tok=2,
                                       head_dim=32),
        "mixtral": tf.MixtralConfig(**common, intermediate_size=48, num_hidden_layers=2,
                                    num_local_experts=4, num_experts_per_tok=2),
        "deepseek_v2": tf.DeepseekV2Config(
            vocab_size=32, hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=64, moe_intermediate_size=I_MOE, num_hidden_layers=3,
            n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=64),
        "deepseek_v3": tf.DeepseekV3Config(
            vocab_size=32, hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=64, moe_intermediate_size=I_MOE, num_hidden_layers=3,
            n_routed_experts=E, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
            kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_group=1, topk_group=1, max_position_embeddings=64),
    }


_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


def expert_names(family: str):
    return _NAMES.get(family, ("mlp", "gate_proj", "up_proj", "down_proj"))


def hf_checkpoint(root: Path, family: str, dtype: str = "float32", max_shard_size=None):
    """save_pretrained a tiny random model; returns (dir, {layer: (w13, w2)} fp32 references)."""
    import torch
    import transformers as tf

    cfg = _configs()[family]
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(sorted(_configs()).index(family) + 11)  # differ per family
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    model = model.to(getattr(torch, dtype))
    out = root / f"{family}-{dtype}{'-sharded' if max_shard_size else ''}"
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kw)
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(out.glob("*.safetensors")):
        sd.update(load_file(f))
    blk, gn, un, dn = expert_names(family)
    refs = {}
    n_e = cfg.num_local_experts if family == "mixtral" else (
        cfg.num_experts if "qwen" in family else cfg.n_routed_experts)
    for L in range(cfg.num_hidden_layers):
        key = f"model.layers.{L}.{blk}.experts.0.{gn}.weight"
        if key not in sd:
            continue
        g = [sd[f"model.layers.{L}.{blk}.experts.{e}.{gn}.weight"].float().numpy() for e in range(n_e)]
        u = [sd[f"model.layers.{L}.{blk}.experts.{e}.{un}.weight"].float().numpy() for e in range(n_e)]
        d = [sd[f"model.layers.{L}.{blk}.experts.{e}.{dn}.weight"].float().numpy() for e in range(n_e)]
        refs[L] = (np.concatenate([np.stack(g), np.stack(u)], axis=1), np.stack(d))
    return out, refs


def _write_config(out: Path, model_type: str, arch: str, n_layers: int, **extra):
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": [arch], "model_type": model_type, "hidden_size": H,
           "num_hidden_layers": n_layers}
    cfg.update(extra)
    (out / "config.json").write_text(json.dumps(cfg))


def fused_checkpoint(root: Path, transposed: bool = False):
    """Qwen3-MoE with transformers-5 fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    (or [E, H, 2I] / [E, I, H] when ``transposed``), bf16. I = 48 so that 2I != H (the
    transposed form is told apart by shape)."""
    import torch
    from safetensors.torch import save_file

    out = root / f"fused{'-t' if transposed else ''}"
    inter = 48
    _write_config(out, "qwen3_moe", "Qwen3MoeForCausalLM", 2, num_experts=E,
                  moe_intermediate_size=inter)
    gen = torch.Generator().manual_seed(2)
    tensors, refs = {}, {}
    for L in range(2):
        w13 = (torch.randn(E, 2 * inter, H, generator=gen) / H ** 0.5).bfloat16()
        w2 = (torch.randn(E, H, inter, generator=gen) / inter ** 0.5).bfloat16()
        refs[L] = (w13.float().numpy(), w2.float().numpy())
        if transposed:
            w13, w2 = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
        tensors[f"model.layers.{L}.mlp.experts.gate_up_proj"] = w13
        tensors[f"model.layers.{L}.mlp.experts.down_proj"] = w2
        tensors[f"model.layers.{L}.mlp.gate.weight"] = torch.zeros(E, H).bfloat16()
    save_file(tensors, out / "model.safetensors")
    return out, refs


def fp8_checkpoint(root: Path, block: int = 32):
    """DeepSeek-V3-style fp8 e4m3 experts with ``weight_scale_inv`` block scales (block x block;
    H=64, I=48 so blocks are ragged at the edges), sharded in two files with an index."""
    import torch
    from safetensors.torch import save_file

    out = root / "fp8"
    inter = 48
    _write_config(out, "deepseek_v3", "DeepseekV3ForCausalLM", 2, n_routed_experts=4,
                  moe_intermediate_size=inter, first_k_dense_replace=0,
                  quantization_config={"quant_method": "fp8", "fmt": "e4m3",
                                       "weight_block_size": [block, block]})
    gen = torch.Generator().manual_seed(3)
    refs, weight_map = {}, {}
    for L in range(2):
        tensors = {}
        g, u, d = [], [], []
        for e in range(4):
            for proj, (n, k), acc in (("gate_proj", (inter, H), g), ("up_proj", (inter, H), u),
                                      ("down_proj", (H, inter), d)):
                w = torch.randn(n, k, generator=gen) / k ** 0.5
                nb, kb = -(-n // block), -(-k // block)
                s = torch.rand(nb, kb, generator=gen) * 0.02 + 0.01  # dequant multiplier
                # quantise block-wise so the fp8 values are in range
                sfull = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
                q = (w / sfull).to(torch.float8_e4m3fn)
                acc.append((q.float() * sfull).numpy())
                name = f"model.layers.{L}.mlp.experts.{e}.{proj}"
                tensors[f"{name}.weight"] = q
                tensors[f"{name}.weight_scale_inv"] = s
        fname = f"model-{L + 1:05d}-of-00002.safetensors"
        save_file(tensors, out / fname)
        weight_map.update({k: fname for k in tensors})
        refs[L] = (np.concatenate([np.stack(g), np.stack(u)], axis=1), np.stack(d))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out, refs


# ------------------------------------------------------------------------------------------- GGUF

_KQ_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _random_kquant(rng, qt_name: str, n_rows: int, k: int, n_e: int) -> np.ndarray:
    """Random but valid K-quant blocks (uint8 [E, N, bytes/row]): random quants and sub-scales,
    with the fp16 super-block scales set to small finite values. gguf cannot quantise K-quants,
    so the test's reference is gguf's own dequantisation of these bytes."""
    nbytes = _KQ_BYTES[qt_name]
    nblk = k // 256
    raw = rng.integers(0, 256, size=(n_e, n_rows, nblk, nbytes), dtype=np.uint8)
    d = (rng.random((n_e, n_rows, nblk)) * 0.004 + 0.001).astype(np.float16)
    if qt_name == "Q6_K":
        raw[..., 208:210] = d.view(np.uint8).reshape(n_e, n_rows, nblk, 2)
    else:
        dmin = (rng.random((n_e, n_rows, nblk)) * 0.004).astype(np.float16)
        raw[..., 0:2] = d.view(np.uint8).reshape(n_e, n_rows, nblk, 2)
        raw[..., 2:4] = dmin.view(np.uint8).reshape(n_e, n_rows, nblk, 2)
    return raw.reshape(n_e, n_rows, nblk * nbytes)


def gguf_file(root: Path, hidden: int = 256, inter: int = 256, n_e: int = 4):
    """A qwen3moe GGUF with expert types per layer:
    0: F32 / F16 / BF16, 1: Q8_0 / Q4_0 / Q8_0, 2: Q4_K / Q5_K / Q6_K (gate / up / down)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(4)
    path = root / "tiny-qwen3moe.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_block_count(3)
    w.add_expert_count(n_e)
    w.add_expert_used_count(2)
    types = [("F32", "F16", "BF16"), ("Q8_0", "Q4_0", "Q8_0"), ("Q4_K", "Q5_K", "Q6_K")]
    refs = {}
    for L, tys in enumerate(types):
        mats = []
        for proj, ty, (n, k) in zip(("gate", "up", "down"), tys,
                                    ((inter, hidden), (inter, hidden), (hidden, inter))):
            qt = getattr(T, ty)
            if ty in _KQ_BYTES:
                raw = _random_kquant(rng, ty, n, k, n_e)
            else:
                f = (rng.standard_normal((n_e, n, k)) / np.sqrt(k)).astype(np.float32)
                raw = f if ty == "F32" else (f.astype(np.float16) if ty == "F16"
                                             else gguf.quants.quantize(f, qt))
            if ty in ("F32", "F16"):
                w.add_tensor(f"blk.{L}.ffn_{proj}_exps.weight", raw)
            else:
                w.add_tensor(f"blk.{L}.ffn_{proj}_exps.weight", raw, raw_dtype=qt)
            ref = (np.asarray(raw, np.float32) if ty in ("F32", "F16")
                   else np.stack([gguf.quants.dequantize(raw[e], qt) for e in range(n_e)]))
            mats.append(ref.astype(np.float32))
        refs[L] = (np.concatenate(mats[:2], axis=1), mats[2])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, refs


# ------------------------------------------------------------------------------------- accuracy

def layer_errors(out_dir, layer, w13, w2, seed=0, tokens=32, top_k=2):
    """(relative error vs fp32 on the source weights, max |diff| vs the reference-quantised path).

    Both run kt.reference.moe_forward_quantized: once with the weights unpacked from the loaded
    files, once with reference.quantize applied to the source weights: they must agree exactly.
    """
    from kt import reference as ref
    from kt.cpu_ops.packing import unpack
    from kt.weights import load_experts

    le = load_experts(out_dir, layer)
    n_e = w13.shape[0]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, w13.shape[2])).astype(np.float32)
    ids = np.stack([rng.choice(n_e, top_k, replace=False) for _ in range(tokens)])
    tw = rng.random((tokens, top_k)).astype(np.float32)
    fp32 = ref.moe_forward(x, ids, tw, w13, w2)
    q13 = [unpack(le.w13.expert(e)) for e in range(n_e)]
    q2 = [unpack(le.w2.expert(e)) for e in range(n_e)]
    out = ref.moe_forward_quantized(x, ids, tw, q13, q2)
    g = le.group_size or 64
    r13 = [ref.quantize(w13[e], le.scheme, g) for e in range(n_e)]
    r2 = [ref.quantize(w2[e], le.scheme, g) for e in range(n_e)]
    spec = ref.moe_forward_quantized(x, ids, tw, r13, r2)
    return ref.relative_error(out, fp32), float(np.abs(out - spec).max()), le


def small_checkpoint(root: Path, n_layers: int = 4, n_e: int = 4, hidden: int = 64, inter: int = 32):
    """A Qwen3-MoE-named bf16 checkpoint written directly (no transformers), for resume tests."""
    import torch
    from safetensors.torch import save_file

    out = root / "small"
    _write_config(out, "qwen3_moe", "Qwen3MoeForCausalLM", n_layers, num_experts=n_e,
                  moe_intermediate_size=inter, hidden_size=hidden)
    gen = torch.Generator().manual_seed(5)
    tensors, refs = {}, {}
    for L in range(n_layers):
        g = (torch.randn(n_e, inter, hidden, generator=gen) / hidden ** 0.5).bfloat16()
        u = (torch.randn(n_e, inter, hidden, generator=gen) / hidden ** 0.5).bfloat16()
        d = (torch.randn(n_e, hidden, inter, generator=gen) / inter ** 0.5).bfloat16()
        for e in range(n_e):
            pre = f"model.layers.{L}.mlp.experts.{e}"
            tensors[f"{pre}.gate_proj.weight"] = g[e].clone()
            tensors[f"{pre}.up_proj.weight"] = u[e].clone()
            tensors[f"{pre}.down_proj.weight"] = d[e].clone()
        refs[L] = (torch.cat([g, u], 1).float().numpy(), d.float().numpy())
    save_file(tensors, out / "model.safetensors")
    return out, refs


# --------------------------------------------------------------- damaging a converted directory

def read_layer_header(path) -> tuple[dict, int]:
    """(the parsed safetensors header of a layer file, __metadata__ included; its length N)."""
    import struct

    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), n


def write_layer_header(path, header, raw_header: bytes | None = None) -> None:
    """Replace the header of a safetensors file, keeping its data bytes. ``header``: a dict
    (serialised), or ``raw_header`` bytes as they are. A header that fits is padded with spaces to
    the old length (the data stays where it was); a longer one moves the data behind it, to the
    next 64-byte boundary."""
    import struct

    path = Path(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    data = raw[8 + n:]
    text = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    if len(text) <= n:
        text += b" " * (n - len(text))
    else:
        text += b" " * ((-(8 + len(text))) % 64)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def refresh_manifest(out_dir) -> dict:
    """Recompute every layer file's size and checksum in ``manifest.json`` (what an attacker who
    edits a file and covers the edit would do); entries that are not well-formed are left alone.
    Returns the manifest written."""
    from kt.weights._format import file_checksum

    mpath = Path(out_dir) / "manifest.json"
    m = json.loads(mpath.read_text())
    files = m.get("files") if isinstance(m, dict) else None
    for ent in files.values() if isinstance(files, dict) else ():
        if not isinstance(ent, dict) or not isinstance(ent.get("file"), str):
            continue
        p = Path(out_dir) / ent["file"]
        if p.is_file():
            ent["bytes"] = p.stat().st_size
            algo = str(ent.get("checksum", "xxh64x16MiB-sha256")).split(":", 1)[0]
            try:
                ent["checksum"] = file_checksum(p, 1, algo)
            except ValueError:
                pass
    mpath.write_text(json.dumps(m))
    return m


def tensor_span(path, name: str) -> tuple[int, int]:
    """[begin, end) file offsets of tensor ``name``'s bytes in a safetensors file."""
    header, n = read_layer_header(path)
    b0, b1 = header[name]["data_offsets"]
    return 8 + n + b0, 8 + n + b1
