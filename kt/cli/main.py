"""The ``kt`` command. Each subcommand lives in its own module with ``add_parser(subparsers)``."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand modules, in the order `kt --help` lists them
_COMMANDS = ["doctor", "demo", "generate", "convert", "placement", "bench", "run"]


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="kt", description="kt: CPU-GPU hybrid Mixture-of-Experts inference")
    parser.add_argument("--version", action="version", version=f"kt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            mod = importlib.import_module(f"kt.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"kt.cli.{name}":
                continue  # not built yet
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `kt placement show ... | head`
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except (ValueError, FileNotFoundError, RuntimeError, NotImplementedError) as exc:
        print(f"kt {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
