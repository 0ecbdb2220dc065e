"""`kt demo`: the one-command tour (build a tiny MoE model, run it on kt, check it, time it)."""
from __future__ import annotations


def _run(args) -> int:
    from ..hf.demo import run_demo

    return run_demo(scheme=args.scheme, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                    threads=args.threads, backend=args.backend, rebuild=args.rebuild,
                    demo_dir=args.dir)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="build a tiny random MoE model, run it through kt, compare with transformers",
        description="Builds (once, into the kt cache dir) a small random-weight Qwen3-MoE-like model "
                    "with an offline-trained tokenizer, converts its experts to the kt format, checks "
                    "kt's logits against unpatched transformers (KL, max |dlogit|, greedy tokens) and "
                    "prints decode tokens/s. Exit status 1 if the agreement is outside the scheme's "
                    "bound.")
    p.add_argument("--scheme", default="int8", choices=["bf16", "int8", "int4"],
                   help="how kt stores and computes the experts (default: int8)")
    p.add_argument("--prompt", default="Once upon a time there was a processor")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the experts")
    p.add_argument("--backend", default="kt", choices=["kt", "reference"],
                   help="reference = kt's numpy spec instead of its kernels (slow; debugging)")
    p.add_argument("--rebuild", action="store_true", help="rebuild the demo model")
    p.add_argument("--dir", default=None, metavar="DIR",
                   help="where the demo model and its kt weights go (default: <kt cache dir>/demo)")
    p.set_defaults(func=_run)
