"""The ``kt`` command. Each subcommand lives in its own module with ``add_parser(subparsers)``.

Exit status: 0 done; 1 the command ran and its answer is "no" (``kt convert --verify`` found
problems, ``kt doctor`` cannot run the experts here, ``kt demo`` disagrees with transformers);
2 bad input: a usage error (argparse) or any error raised while a command runs, printed as one
line ``kt COMMAND: error: ...`` on stderr, with the Python traceback only when ``KT_DEBUG=1``;
130 interrupted.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand modules, in the order `kt --help` lists them
_COMMANDS = ["doctor", "demo", "generate", "convert", "placement", "bench", "run"]

# what a command's own checks raise; anything else is named by its type (likely a bug in kt)
_EXPECTED = (ValueError, OSError, RuntimeError, NotImplementedError, ImportError)


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="kt", description="kt: CPU-GPU hybrid Mixture-of-Experts inference",
        epilog="Errors print one line; KT_DEBUG=1 adds the Python traceback.")
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


def _debug() -> bool:
    try:
        from ..config import get_config

        return get_config().debug
    except Exception:  # a malformed KT_* variable is reported by the command itself
        return False


def error_line(exc: BaseException) -> str:
    """The one line ``kt`` prints for ``exc``: its message with line breaks folded, prefixed
    with the exception type unless it is one of the errors kt's checks raise."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    msg = "; ".join(lines) or type(exc).__name__
    if not isinstance(exc, _EXPECTED):
        msg = f"{type(exc).__name__}: {msg} (KT_DEBUG=1 shows where)"
    return msg


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
    except Exception as exc:
        if _debug():
            import traceback

            traceback.print_exc()
        print(f"kt {args.command}: error: {error_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
