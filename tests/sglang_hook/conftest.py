"""The SGLang virtual environment the plugin tests drive through subprocesses.

SGLang (0.5.23, ~11 GB with its CUDA torch) never goes into the test environment itself. It lives in
a cached virtual environment, by default ``~/.cache/kt/venvs/sglang-0.5.23`` (``KT_SGLANG_VENV``
overrides the path). The first run creates it (python -m venv, pip install sglang==0.5.23 and kt's
own dependencies: ~9 minutes, progress printed); later runs reuse it and only make sure this
checkout of kt is installed there (editable, no dependencies: that is what makes kt's
``sglang.srt.plugins`` entry point visible to SGLang). A file lock keeps parallel runs from building
it twice. When the install fails, the tests FAIL with the pip log tail: they are never skipped.
"""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SGLANG_VERSION = "0.5.23"
VENV = Path(os.environ.get("KT_SGLANG_VENV", f"~/.cache/kt/venvs/sglang-{SGLANG_VERSION}")).expanduser()
KT_DEPS = ["numba>=0.60", "llvmlite>=0.43", "safetensors>=0.4", "tqdm>=4.60"]

# what the venv must answer, without importing sglang (that alone takes ~12 s)
_PROBE = r"""
import importlib.metadata as m, importlib.util as u, json, sys
out = {"sglang": None, "missing": [], "kt_entry": None, "kt_path": None}
try:
    out["sglang"] = m.version("sglang")
except m.PackageNotFoundError:
    pass
out["pins"] = {}
for n in ("numpy", "torch"):
    try:
        out["pins"][n] = m.version(n)
    except m.PackageNotFoundError:
        pass
out["missing"] = [n for n in ("torch", "numba", "llvmlite", "safetensors", "tqdm", "numpy")
                  if u.find_spec(n) is None]
for ep in m.entry_points(group="sglang.srt.plugins"):
    if ep.name == "kt":
        out["kt_entry"] = ep.value
try:
    d = m.distribution("kt")
    txt = d.read_text("direct_url.json")
    out["kt_path"] = json.loads(txt).get("url") if txt else None
except m.PackageNotFoundError:
    pass
print(json.dumps(out))
"""


def _say(msg: str) -> None:
    print(f"[kt sglang venv] {msg}", file=sys.__stderr__, flush=True)


def _probe(py: Path) -> dict | None:
    if not py.exists():
        return None
    try:
        r = subprocess.run([str(py), "-c", _PROBE], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def _run_logged(cmd: list[str], log: Path, what: str, timeout: float, *, fail: bool = True) -> int:
    _say(f"{what}: {' '.join(cmd)} (log: {log})")
    t0 = time.time()
    with open(log, "a") as f:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last = 0.0
        for line in p.stdout:
            f.write(line)
            if time.time() - last > 20 or line.startswith(("Successfully", "ERROR")):
                _say(f"  {time.time() - t0:5.0f}s {line.rstrip()[:150]}")
                last = time.time()
            if time.time() - t0 > timeout:
                p.kill()
                break
        rc = p.wait()
    if rc != 0 and fail:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        pytest.fail(f"creating the SGLang test environment failed at '{what}' (exit {rc}); "
                    f"log {log}:\n{tail}", pytrace=False)
    return rc


def _create(py: Path) -> None:
    VENV.parent.mkdir(parents=True, exist_ok=True)
    log = VENV.parent / f"sglang-{SGLANG_VERSION}-install.log"
    log.write_text("")
    _say(f"creating {VENV} with sglang=={SGLANG_VERSION} (one time, ~9 minutes, ~11 GB)")
    base = getattr(sys, "_base_executable", sys.executable)
    _run_logged([base, "-m", "venv", str(VENV)], log, "python -m venv", 300)
    pip = [str(py), "-m", "pip", "install", "--progress-bar", "off"]
    _run_logged(pip + [f"sglang=={SGLANG_VERSION}"], log, "pip install sglang", 3600)
    _install_kt_deps(py, log)


def _install_kt_deps(py: Path, log: Path) -> None:
    """kt's own dependencies, resolved against the numpy and torch SGLang brought (pinned: never
    upgraded or downgraded here)."""
    info = _probe(py) or {"pins": {}}
    constraints = VENV / "kt-constraints.txt"
    constraints.write_text("".join(f"{n}=={v}\n" for n, v in info.get("pins", {}).items()))
    _run_logged([str(py), "-m", "pip", "install", "--progress-bar", "off", "-c", str(constraints), *KT_DEPS],
                log, "pip install kt's dependencies", 900)


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """Path of the SGLang venv's python, with this checkout of kt installed in it (editable)."""
    py = VENV / "bin" / "python"
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / f".sglang-{SGLANG_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        info = _probe(py)
        if info is None or info["sglang"] is None:
            _create(py)
            info = _probe(py)
        if info is None or info["sglang"] != SGLANG_VERSION:
            pytest.fail(f"{VENV}: expected sglang {SGLANG_VERSION}, found {info and info['sglang']}; "
                        f"remove the directory to rebuild it", pytrace=False)
        if info["missing"]:
            _install_kt_deps(py, VENV.parent / f"sglang-{SGLANG_VERSION}-install.log")
        want = REPO.as_uri()
        if info["kt_entry"] != "kt.sglang_hook:plugin" or (info["kt_path"] or "").rstrip("/") != want:
            log = VENV.parent / f"sglang-{SGLANG_VERSION}-install.log"
            pip_e = [str(py), "-m", "pip", "install", "--no-deps", "-q", "-e", str(REPO)]
            # the venv's setuptools builds kt offline in seconds; an isolated build is the fallback
            if _run_logged(pip_e + ["--no-build-isolation"], log, "pip install -e kt", 600, fail=False):
                _run_logged(pip_e, log, "pip install -e kt (isolated build)", 600)
            info = _probe(py)
            if info is None or info["kt_entry"] != "kt.sglang_hook:plugin":
                pytest.fail(f"kt's entry point is not visible in {VENV} after installing {REPO}", pytrace=False)
    return py


def sglang_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="session")
def sglang_results(sglang_python, tmp_path_factory):
    """Run the in-venv checks and ``python -m sglang.launch_server --help`` side by side (each pays
    SGLang's import once). Returns (check results dict, help text, stderr of the checks)."""
    work = tmp_path_factory.mktemp("sglang_checks")
    env = sglang_env()
    checks = subprocess.Popen([str(sglang_python), str(Path(__file__).with_name("_sglang_checks.py")),
                               str(work)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env, cwd=str(work))
    helper = subprocess.Popen([str(sglang_python), "-m", "sglang.launch_server", "--help"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=str(work))
    out, err = checks.communicate(timeout=900)
    hout, herr = helper.communicate(timeout=300)
    lines = [l for l in out.splitlines() if l.startswith("KT_CHECKS_JSON ")]
    if not lines:
        pytest.fail(f"the in-venv checks printed no result (exit {checks.returncode}):\n{out[-3000:]}\n"
                    f"{err[-6000:]}", pytrace=False)
    results = json.loads(lines[-1].split(" ", 1)[1])
    if helper.returncode != 0:
        pytest.fail(f"python -m sglang.launch_server --help failed (exit {helper.returncode}):\n"
                    f"{herr[-4000:]}", pytrace=False)
    return results, hout, err
