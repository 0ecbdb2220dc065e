"""Running the repository's benchmark scripts (benchmarks/*.py) from tests, as subprocesses.

The scripts are not part of the package: tests run them the way a user does, on tiny shapes, with
this checkout's kt first on PYTHONPATH, and read the JSON they write.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "benchmarks"

__all__ = ["BENCHMARKS", "REPO", "benchmarks_present", "read_result", "run_benchmark"]


def benchmarks_present() -> bool:
    """Whether this kt is a checkout with its benchmarks/ folder (not an installed wheel)."""
    return (BENCHMARKS / "_results.py").is_file()


def run_benchmark(script: str, *args: str, timeout: float = 900, env: dict | None = None,
                  python: str | None = None) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> args...`` from the repository root; stdout and stderr captured
    as text. The caller checks ``returncode`` (a failure's stderr says why)."""
    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    full_env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1",
                    KT_BENCH_MACHINE="test")
    full_env.update(env or {})
    return subprocess.run([python or sys.executable, str(BENCHMARKS / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env=full_env)


def read_result(folder, name: str) -> dict:
    """The JSON document a benchmark wrote to ``folder/<name>.json``."""
    return json.loads(Path(folder, f"{name}.json").read_text())
