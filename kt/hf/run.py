"""Load a Hugging Face MoE model directory with its experts on kt, generate, chat, time it."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ._compat import require_transformers
from ._patch import PatchConfig
from .families import family_of

__all__ = ["load_model", "generate", "chat", "GenerationStats", "resolve_device", "resolve_dtype"]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """"auto" -> the GPU if torch sees one, else the CPU."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch sees no CUDA GPU")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None = "auto") -> torch.dtype:
    """"auto" -> bf16 (what MoE checkpoints are released in); or bf16 / fp16 / fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _check_model_dir(model_dir) -> Path:
    p = Path(model_dir).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such directory (expected a Hugging Face model directory)")
    if not p.is_dir() or not (p / "config.json").is_file():
        raise ValueError(f"{p}: not a Hugging Face model directory (no config.json)")
    return p


def load_model(model_dir, patch: PatchConfig | None = PatchConfig(), *, device="auto",
               dtype="auto", progress: bool = True):
    """(model, tokenizer) from a local HF directory, with the experts on kt; the checkpoint's
    experts are never materialised.

    The model is built with its parameters on the meta device; each MoE layer gets its kt
    experts first, from ``patch.weight_path`` (a kt weight directory, memory-mapped) or
    converted from the checkpoint's expert tensors one layer at a time; then only the
    non-expert tensors are read from the safetensors files, straight to ``device`` ("auto": the
    GPU if there is one). FP8 block-scaled checkpoints (``weight_scale_inv``) are dequantised to
    ``dtype`` as they are read. ``patch=None`` loads plain transformers (``from_pretrained``).

    Peak host memory while loading (docs/hf.md; measured in tests/hf/test_load_memory.py)::

        peak - baseline <= W_ne + S_max + X (+ a few MB of allocator slack)

    W_ne: the non-expert weights in ``dtype`` (0 on the host when ``device`` is a GPU);
    S_max: one staging copy of the largest non-expert tensor, needed only when its stored dtype
    differs from ``dtype`` or it goes to a GPU (FP8: its bytes + 4 bytes per element);
    X: with a kt weight directory, ~0 at load (its files are mapped; the pages the experts use
    become resident as they run, as shared, reclaimable page cache); converting from the
    checkpoint, K + one layer's expert bytes as stored (mapped while that layer converts),
    K being the kt experts of every layer in the scheme (INT8 ~ 3 E I H bytes per layer, INT4
    ~ half that, BF16 ~ twice), which stay in memory as the model's experts.
    The old path (``from_pretrained`` then ``patch_model``) holds W_ne + W_experts(dtype) with the
    checkpoint file mapped besides: about twice the checkpoint (measured on a 2.6 GB checkpoint:
    5.2 GB, where this loader took 0.35 GB with a kt weight directory and 1.8 GB converting).

    Errors before any weight is read: an unknown architecture, a checkpoint missing a
    non-expert tensor or holding one of the wrong shape (SourceError naming the file and
    tensor), a kt weight directory for another model (WeightFormatError naming its manifest).
    """
    transformers = require_transformers()
    path = _check_model_dir(model_dir)
    cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype)
    if patch is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dt, local_files_only=True)
        model.eval().to(dev)
    else:
        family_of(getattr(cfg, "model_type", None))  # fail before reading anything else
        from ._loader import load_checkpoint

        model = load_checkpoint(path, patch, device=dev, dtype=dt, progress=progress)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model, tokenizer


@dataclass
class GenerationStats:
    """Timings of one generate call (batch 1). decode_tok_s excludes the prefill."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    token_ids: list = field(default_factory=list)

    @property
    def decode_tok_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.new_tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    def __str__(self) -> str:
        return (f"{self.new_tokens} tokens; prefill {self.prompt_tokens} tokens in "
                f"{self.prefill_s * 1e3:.0f} ms ({self.prefill_tok_s:.1f} tok/s), decode "
                f"{self.decode_tok_s:.1f} tok/s")


def _streamer(tokenizer, stats: GenerationStats, t0: float, echo, skip_special: bool):
    """A TextStreamer that also records when each token arrived."""
    from transformers import TextStreamer

    class _Timed(TextStreamer):
        def __init__(self):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=skip_special)
            self.first = None
            self.last = None
            self.seen_prompt = False

        def put(self, value):
            if not self.seen_prompt:  # generate() sends the prompt first
                self.seen_prompt = True
                return super().put(value)
            now = time.perf_counter()
            if self.first is None:
                self.first = now
            self.last = now
            stats.token_ids.extend(int(v) for v in value.reshape(-1).tolist())
            if echo:
                return super().put(value)
            return None

        def on_finalized_text(self, text: str, stream_end: bool = False):
            if echo:
                echo(text, stream_end)

    return _Timed()


def _print_text(text: str, stream_end: bool) -> None:
    print(text, end="" if not stream_end else "\n", flush=True)


@torch.no_grad()
def generate(model, tokenizer, prompt, *, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, echo=_print_text, min_new_tokens: int = 0,
             skip_special_tokens: bool = True) -> GenerationStats:
    """Generate after ``prompt`` (text, or token ids [1, S]) and stream the text to ``echo``.

    temperature 0 = greedy. ``echo(text, stream_end)`` receives the decoded pieces (None: quiet).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    dev = next(model.parameters()).device
    if isinstance(prompt, str):
        enc = tokenizer(prompt, return_tensors="pt")
        ids = enc["input_ids"]
    else:
        ids = torch.as_tensor(prompt)
        ids = ids[None] if ids.ndim == 1 else ids
    if ids.shape[-1] == 0:
        raise ValueError("the prompt is empty (no tokens)")
    ids = ids.to(dev)
    stats = GenerationStats(prompt_tokens=int(ids.shape[-1]))
    t0 = time.perf_counter()
    streamer = _streamer(tokenizer, stats, t0, echo, skip_special_tokens)
    gen_kw = dict(do_sample=False) if temperature <= 0 else dict(do_sample=True, temperature=temperature,
                                                                  top_p=top_p)
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                   min_new_tokens=min_new_tokens, streamer=streamer, pad_token_id=pad, **gen_kw)
    stats.new_tokens = len(stats.token_ids)
    if streamer.first is not None:
        stats.prefill_s = streamer.first - t0
        stats.decode_s = streamer.last - streamer.first
    return stats


def _chat_ids(tokenizer, messages):
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)
        return enc["input_ids"]
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return tokenizer(text, return_tensors="pt")["input_ids"]


def chat(model, tokenizer, *, max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
         stdin=None, out=None) -> int:
    """Interactive chat on ``stdin``: one user turn per line, replies streamed to ``out``.

    ``/exit`` (or end of input) ends, ``/reset`` forgets the conversation. Uses the tokenizer's
    chat template when it has one. Prints tokens/s after each reply. Returns the turn count.
    """
    stdin = stdin or sys.stdin
    out = out or sys.stdout
    interactive = hasattr(stdin, "isatty") and stdin.isatty()
    messages: list[dict] = []
    turns = 0

    def echo(text, end):
        out.write(text + ("\n" if end else ""))
        out.flush()

    template = "chat template" if getattr(tokenizer, "chat_template", None) else "plain 'User:' prompts"
    out.write(f"kt chat ({template}); /exit to quit, /reset to start over\n")
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages.clear()
            out.write("(conversation cleared)\n")
            continue
        messages.append({"role": "user", "content": text})
        ids = _chat_ids(tokenizer, messages)
        out.write("assistant: ")
        stats = generate(model, tokenizer, ids, max_new_tokens=max_new_tokens, temperature=temperature,
                         top_p=top_p, echo=echo)
        reply = tokenizer.decode(stats.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        out.write(f"[{stats}]\n")
        out.flush()
        turns += 1
    return turns
