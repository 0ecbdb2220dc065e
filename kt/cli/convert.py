"""``kt convert``: HF safetensors / GGUF experts -> the kt weight format; ``--verify`` re-checks one."""
from __future__ import annotations

import argparse
import sys


def run(args: argparse.Namespace) -> int:
    from ..weights import convert, verify

    if args.verify:
        if args.source is not None or args.output is not None:
            raise ValueError("--verify takes only the converted directory: kt convert --verify OUT_DIR")
        problems = verify(args.verify, threads=args.threads, raise_on_error=False)
        if problems:  # one line each, then the count; exit 1
            for p in problems:
                print(f"FAILED: {p}", file=sys.stderr)
            print(f"{args.verify}: {len(problems)} problem(s)", file=sys.stderr)
            return 1
        from ..weights._format import read_manifest

        m = read_manifest(args.verify)
        print(f"{args.verify}: OK ({len(m['layers'])} layers, scheme {m['scheme']}, "
              f"E={m['num_experts']} H={m['hidden_size']} I={m['intermediate_size']})")
        return 0
    if args.source is None or args.output is None:
        raise ValueError("usage: kt convert MODEL_DIR_OR_GGUF -o OUT_DIR --scheme int8|int4|bf16 "
                         "(or kt convert --verify OUT_DIR)")
    m = convert(args.source, args.output, args.scheme, args.group_size, layers=args.layers,
                threads=args.threads, progress=not args.quiet, force=args.force, fsync=args.fsync)
    print(f"{args.output}: {len(m['layers'])} MoE layers, scheme {m['scheme']}"
          + (f" G={m['group_size']}" if m["group_size"] else "")
          + f", E={m['num_experts']} H={m['hidden_size']} I={m['intermediate_size']}")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert a checkpoint's MoE experts to the kt weight format",
        description="Convert the routed experts of a Hugging Face checkpoint (bf16/fp16/fp32/fp8 "
                    "safetensors) or a GGUF file into kt's packed, quantised format. An interrupted "
                    "run resumes when rerun with the same arguments.")
    p.add_argument("source", nargs="?", metavar="MODEL_DIR_OR_GGUF",
                   help="Hugging Face model directory (config.json + safetensors) or a .gguf file")
    p.add_argument("-o", "--output", metavar="OUT_DIR", help="output directory")
    p.add_argument("--scheme", default="int8", choices=["int8", "int4", "bf16"],
                   help="quantisation scheme (default int8)")
    p.add_argument("--group-size", type=int, default=64, choices=[32, 64, 128],
                   help="INT4 group size G along the reduction dimension (default 64)")
    p.add_argument("--layers", metavar="SPEC", help="MoE layers to convert, e.g. '0-3,7' (default all)")
    p.add_argument("--threads", type=int, default=None, help="worker threads (default: all CPUs)")
    p.add_argument("--force", action="store_true",
                   help="replace a different conversion already in OUT_DIR")
    p.add_argument("--fsync", action="store_true",
                   help="fsync each layer file before renaming it (durable against power loss)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--verify", metavar="OUT_DIR",
                   help="re-check a converted directory as the loader does (manifest, headers, "
                        "layer metadata, finite scales) plus every file's checksum; one line per "
                        "problem, exit status 1 if there is any")
    p.set_defaults(func=run)
