"""`kt generate MODEL_DIR --prompt ...` and `kt chat MODEL_DIR`: a HF MoE model with kt experts."""
from __future__ import annotations

import argparse
import sys

from ..config import ACT_MODES


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR", help="a local Hugging Face model directory")
    p.add_argument("--scheme", default="int8", choices=["bf16", "int8", "int4"],
                   help="how the CPU experts are stored and computed (default: int8)")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                   help="INT4 group size G (default: 64)")
    p.add_argument("--activations", default="int8", choices=list(ACT_MODES),
                   help="int8 / int4 experts: per-token int8 activations (default) or two int8 "
                        "levels (more accurate, about 2x the prefill compute)")
    p.add_argument("--weights", metavar="KT_DIR", default=None,
                   help="a kt weight directory (`kt convert`) to load the experts from, instead of "
                        "converting the model's own weights at start-up")
    p.add_argument("--placement", metavar="FILE", default=None,
                   help="a saved kt Placement putting some experts on the GPU (needs a GPU)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the experts")
    p.add_argument("--device", default="auto",
                   help="where the non-expert weights run: auto (GPU if any), cpu, cuda")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (bf16), bf16, fp16, fp32")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--backend", default="kt", choices=["kt", "reference"],
                   help="reference = kt's numpy spec (slow; for debugging)")
    p.add_argument("--no-kt", action="store_true",
                   help="run plain transformers (no kt), for comparison")


def _load(args):
    from ..hf._patch import PatchConfig
    from ..hf.run import _check_model_dir, load_model

    _check_model_dir(args.model_dir)

    patch = None
    if not args.no_kt:
        placement = None
        if args.placement:
            from ..placement import Placement

            placement = Placement.load(args.placement)
        acts = args.activations if args.scheme != "bf16" else "int8"
        patch = PatchConfig(scheme=args.scheme, group_size=args.group_size, threads=args.threads,
                            weight_path=args.weights, placement=placement, backend=args.backend,
                            activations=acts)
    print(f"loading {args.model_dir} ({'transformers only' if patch is None else f'experts on kt, {args.scheme}'})",
          file=sys.stderr, flush=True)
    return load_model(args.model_dir, patch, device=args.device, dtype=args.dtype)


def _run_generate(args) -> int:
    from ..hf.run import generate

    prompt = args.prompt
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt:
        raise ValueError("--prompt is empty")
    model, tok = _load(args)
    print(prompt, end="", flush=True)
    stats = generate(model, tok, prompt, max_new_tokens=args.max_new_tokens or 64,
                     temperature=args.temperature, top_p=args.top_p)
    print(f"[{stats}]", file=sys.stderr)
    return 0


def _run_chat(args) -> int:
    from ..hf.run import chat

    model, tok = _load(args)
    chat(model, tok, max_new_tokens=args.max_new_tokens or 256, temperature=args.temperature,
         top_p=args.top_p)
    return 0


def add_parser(subparsers) -> None:
    g = subparsers.add_parser("generate", help="generate text from a HF MoE model, experts on kt",
                              description="Load MODEL_DIR (non-expert weights on the GPU if there is "
                                          "one), run its routed experts through kt, generate after "
                                          "--prompt and print decode tokens/s.")
    _common(g)
    g.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    g.set_defaults(func=_run_generate)

    c = subparsers.add_parser("chat", help="chat with a HF MoE model, experts on kt",
                              description="Interactive chat (one turn per line, streamed replies, the "
                                          "model's chat template; /exit quits, /reset forgets).")
    _common(c)
    c.set_defaults(func=_run_chat)
