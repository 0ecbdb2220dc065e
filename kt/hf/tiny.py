"""Tiny random-weight MoE models in Hugging Face format, built offline (tests, the demo, notebooks).

The weights are random but scaled like a trained network (std 1/sqrt(fan_in), a peaked output
distribution, decisive routers), so that an error in the expert computation shows up in the
logits instead of vanishing into a near-uniform softmax. The tokenizer is a byte-level BPE
trained on a short built-in text with the `tokenizers` package, so nothing is downloaded.
"""
from __future__ import annotations

import math
from pathlib import Path

from ._compat import require_tokenizers, require_transformers
from .families import family_of

__all__ = ["tiny_config", "build_tiny_model", "init_random_weights", "train_tokenizer",
           "save_tiny_model", "CHAT_TEMPLATE", "SAMPLE_TEXT"]

# ChatML, which Qwen models use; the demo's tokenizer carries it so `kt chat` has a template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SAMPLE_TEXT = """\
A mixture of experts layer holds many small feed-forward networks, the experts, and a router that
sends each token to a few of them. Only the chosen experts run, so a model can hold far more
parameters than it computes with for any one token. The experts of a large model do not fit in
the memory of one graphics card, but they fit in the memory of the host, and a modern processor
multiplies matrices quickly when its vector units are kept busy.
The router scores every expert for every token, keeps the best few, and weights their outputs.
Some models add shared experts that every token uses, or group the experts and first choose the
groups. The weights of the experts can be stored in eight or four bits with a scale per row or per
group, which saves memory and time because decoding one token reads every weight once.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. How
vexingly quick daft zebras jump! The five boxing wizards jump quickly. Sphinx of black quartz,
judge my vow. One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
Hello! How are you today? I am fine, thank you. What would you like to talk about? Tell me a
story about a small processor that learned to multiply very large matrices very quickly.
Once upon a time there was a processor with sixteen cores, and each core had a tile unit that
could multiply whole blocks of numbers at once. It worked together with a graphics card: the
card ran the experts that every token wanted, and the processor ran all the others.
"""


def tiny_config(family: str = "qwen3_moe", *, vocab_size: int = 512, hidden_size: int = 128,
                moe_intermediate_size: int = 64, num_layers: int | None = None, num_experts: int | None = None,
                top_k: int | None = None, **overrides):
    """A transformers config for a tiny model of ``family`` (a model_type in kt.hf.FAMILIES).

    H = hidden_size, I = moe_intermediate_size, L = num_layers; L, E and K default to the family's
    tiny values (2 layers, 3 for DeepSeek whose first layer is dense; 16 experts top-4, Mixtral 8
    top-2). ``overrides`` are passed to the config as they are.
    """
    transformers = require_transformers()
    fam = family_of(family)
    kw = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
              moe_intermediate_size=moe_intermediate_size, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
              tie_word_embeddings=False, initializer_range=0.02)
    kw.update(fam.tiny)
    if num_layers is not None:
        kw["num_hidden_layers"] = num_layers
    if family == "mixtral":  # Mixtral has no separate expert size: its experts use intermediate_size
        kw["intermediate_size"] = moe_intermediate_size
    if num_experts is not None:
        key = next(k for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in fam.tiny)
        kw[key] = num_experts
    if top_k is not None:
        kw["num_experts_per_tok"] = top_k
    kw.update(overrides)
    return transformers.AutoConfig.for_model(family, **kw)


def init_random_weights(model, seed: int = 0) -> None:
    """Re-initialise every parameter of ``model`` in place, deterministically from ``seed``.

    2-D weights [out, in] ~ N(0, 1/in); embeddings ~ N(0, 1); the output head ~ N(0, 4/H), so
    the next-token distribution is peaked (entropy ~3-4 nats on random prompts, not ~log V);
    softmax routers ~ N(0, 4/H), so routing is decisive (sigmoid routers N(0, 1/H)); fused experts gate_up [E, 2I, H] ~ N(0, 1/H),
    down [E, H, I] ~ N(0, 1/I). Projections that write into the residual stream (o_proj,
    down_proj) are scaled by 1/sqrt(2L) as in GPT-2's initialisation, so no single layer
    dominates the stream; routed experts' down_proj also by 1/routed_scaling_factor. Norms 1; biases and the DeepSeek score-correction bias small random
    values (so they are exercised).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    layers = int(getattr(cfg, "num_hidden_layers", 1))
    resid = 1.0 / math.sqrt(2.0 * layers)
    # DeepSeek-V3 scores experts with a sigmoid, which saturates (and ties) beyond |z| ~ 3:
    # its router gets logits of std 1, softmax routers std 2.
    router_std = 1.0 if getattr(cfg, "model_type", "") == "deepseek_v3" else 2.0
    # routed_scaling_factor multiplies the routed experts' output; trained experts absorb it,
    # so the random ones are scaled down by it to keep each layer's update the same size.
    routed_scale = 1.0 / float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0)

    def normal(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = tuple(p.shape)
            writes_residual = name.endswith(("o_proj.weight", "down_proj.weight", "down_proj"))
            if p.ndim == 3:  # fused experts
                std = resid * routed_scale if writes_residual else 1.0
                w = normal(shape, std / math.sqrt(shape[2]))
            elif p.ndim == 2 and "embed_tokens" in name:
                w = normal(shape, 1.0)
            elif p.ndim == 2 and "lm_head" in name:
                w = normal(shape, 2.0 / math.sqrt(shape[1]))
            elif p.ndim == 2 and name.endswith("mlp.gate.weight"):
                w = normal(shape, router_std / math.sqrt(shape[1]))
            elif p.ndim == 2:
                w = normal(shape, (resid if writes_residual else 1.0) / math.sqrt(shape[1]))
            elif "norm" in name:
                w = torch.ones(shape)
            else:
                w = normal(shape, 0.02)
            p.copy_(w.to(p.dtype))
        for name, b in sorted(model.named_buffers(), key=lambda kv: kv[0]):
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(tuple(b.shape), 0.05).to(b.dtype))


def build_tiny_model(family: str = "qwen3_moe", *, seed: int = 0, dtype=None, **config_kw):
    """A tiny random ``*ForCausalLM`` of ``family`` in eval mode (fp32 unless ``dtype``)."""
    import torch

    transformers = require_transformers()
    cfg = tiny_config(family, **config_kw)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    init_random_weights(model, seed)
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def train_tokenizer(text: str | None = None, vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained offline on ``text`` (default: built-in).

    Carries the ChatML special tokens and chat template, eos = ``<|im_end|>``.
    """
    tokenizers = require_tokenizers()
    transformers = require_transformers()
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS) + 1:
        raise ValueError(f"vocab_size must be > {256 + len(SPECIAL_TOKENS)} (byte alphabet + special "
                         f"tokens), got {vocab_size}")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    lines = (text or SAMPLE_TEXT).splitlines()
    tok.train_from_iterator(lines * 4, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(out_dir, family: str = "qwen3_moe", *, seed: int = 0, save_dtype=None,
                    vocab_size: int = 512, **config_kw) -> Path:
    """Build a tokenizer and a tiny random model of ``family`` and save both to ``out_dir``.

    Weights are saved in ``save_dtype`` (default bf16, as released checkpoints are). Returns
    the directory, loadable with ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer``.
    """
    import torch

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size=vocab_size)
    n_vocab = len(tokenizer)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    model = build_tiny_model(family, seed=seed, vocab_size=n_vocab,
                             bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                             pad_token_id=ids["<|endoftext|>"], **config_kw)
    # A random model would stop at a random point; with the special tokens' output rows zeroed
    # (logit 0 against others of std 2) it never stops early under greedy decoding.
    with torch.no_grad():
        for t in ids.values():
            model.lm_head.weight[t].zero_()
    model = model.to(save_dtype or torch.bfloat16)
    model.generation_config.eos_token_id = ids["<|im_end|>"]
    model.generation_config.pad_token_id = ids["<|endoftext|>"]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
