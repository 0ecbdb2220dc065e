"""Bad input to any ``kt`` subcommand: exit status 2 and one line ``kt CMD: error: ...`` on
stderr, never a Python traceback (``KT_DEBUG=1`` adds it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kt.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "afile").write_text("x")
    (d / "list_cfg").mkdir()
    (d / "list_cfg" / "config.json").write_text("[1, 2]")
    (d / "bin_cfg").mkdir()
    (d / "bin_cfg" / "config.json").write_bytes(b"\xff\xfe{")
    (d / "rnd.npz").write_bytes(np.random.default_rng(1).bytes(700))
    (d / "bad.json").write_text('{"x": ')
    meta = {"format": "kt.expert_stats", "version": 1, "num_layers": 2, "num_experts": 3,
            "model": ["not", "a", "name"]}
    np.savez(d / "badmeta.npz", counts=np.ones((2, 3)), meta=np.array(json.dumps(meta)))
    return d


CASES = [
    (["convert", "{d}/nope", "-o", "{d}/o", "-q"], "no such checkpoint"),
    (["convert", "{d}/list_cfg", "-o", "{d}/o", "-q"], "a JSON list; expected a JSON object"),
    (["convert", "{d}/bin_cfg", "-o", "{d}/o", "-q"], "not UTF-8"),
    (["convert", "{d}/afile", "-o", "{d}/o", "-q"], "expected a model directory or a GGUF file"),
    (["convert", "{d}/list_cfg"], "usage: kt convert"),
    (["convert", "--verify", "{d}/o", "{d}/list_cfg"], "--verify takes only the converted directory"),
    (["placement", "plan", "--stats", "{d}/rnd.npz", "--budget", "1", "-o", "{d}/p.json"],
     "rnd.npz: not a .npz archive"),
    (["placement", "plan", "--stats", "{d}/bad.json", "--budget", "1", "-o", "{d}/p.json"],
     "bad.json: not valid JSON"),
    (["placement", "plan", "--stats", "{d}/badmeta.npz", "--budget", "1", "-o", "{d}/p.json"],
     "badmeta.npz: model must be a str or None"),
    (["placement", "plan", "--stats", "{d}/missing.npz", "--budget", "1", "-o", "{d}/p.json"],
     "no such file"),
    (["placement", "record", "--trace", "{d}/rnd.npz", "-o", "{d}/s.npz"], "rnd.npz: not a .npz archive"),
    (["placement", "record", "--synthetic", "--layers", "2", "-o", "{d}/afile/s.npz"], "Not a directory"),
    (["placement", "show", "{d}/bad.json"], "bad.json"),
    (["generate", "{d}/nope", "--prompt", "x"], "no such directory"),
    (["run", "--dry-run"], "needs a MODEL"),
    (["bench", "--shape", "nope"], "unknown shape 'nope'"),
]


@pytest.mark.parametrize("argv, match", CASES, ids=[" ".join(c[0][:2]) + f" {i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_exit_2(files, capsys, argv, match, monkeypatch):
    monkeypatch.delenv("KT_DEBUG", raising=False)
    argv = [a.format(d=files) for a in argv]
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert len(lines) == 1 and lines[0].startswith(f"kt {argv[0]}: error: "), err
    assert match in lines[0] and "Traceback" not in err, err


def test_verify_failure_is_exit_1_one_line_per_problem(files, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"format": "kt-moe-experts", "format_version": 1}))
    assert main(["convert", "--verify", str(out)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    # scheme, num_experts, hidden_size, intermediate_size, layers, files: six lines, then the count
    assert len(lines) == 7 and all(x.startswith("FAILED: ") for x in lines[:-1]), lines
    assert lines[-1] == f"{out}: 6 problem(s)"


def test_an_unexpected_exception_is_named_by_its_type(monkeypatch, capsys):
    import kt.cli.bench as bench

    def boom(args):
        raise KeyError("w13.data")

    monkeypatch.setattr(bench, "_run", boom)
    monkeypatch.delenv("KT_DEBUG", raising=False)
    assert main(["bench"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kt bench: error: KeyError: 'w13.data' (KT_DEBUG=1 shows where)"]


@pytest.mark.subprocess
@pytest.mark.parametrize("debug", [False, True])
def test_kt_debug_shows_the_traceback(tmp_path, debug):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("KT_DEBUG", None)
    if debug:
        env["KT_DEBUG"] = "1"
    r = subprocess.run([sys.executable, "-m", "kt.cli", "convert", str(tmp_path / "nope"), "-o",
                        str(tmp_path / "o"), "-q"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("kt convert: error: ")
    assert ("Traceback (most recent call last)" in r.stderr) == debug, r.stderr


def _npz_payloads():
    from hypothesis import strategies as st

    def zipped(member: bytes, name: str) -> bytes:
        import io
        import zipfile

        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr(name, member)
        return buf.getvalue()

    npy_head = st.binary(max_size=40).map(lambda b: b"\x93NUMPY\x01\x00" + b)
    return st.one_of(
        st.binary(max_size=300),
        st.binary(max_size=300).map(lambda b: b"PK\x03\x04" + b),
        st.tuples(st.one_of(st.binary(max_size=200), npy_head),
                  st.sampled_from(["counts.npy", "meta.npy", "x.npy", "counts"])).map(lambda t: zipped(*t)),
    )


def test_random_npz_statistics_never_print_a_traceback(tmp_path, capsys, monkeypatch):
    """60 derandomized examples: random bytes, a zip signature then noise, and zips of a random
    member (noise, or a .npy magic with a random header)."""
    pytest.importorskip("hypothesis", reason="the property tests need hypothesis (kt[test])")
    from hypothesis import HealthCheck, given, settings

    monkeypatch.delenv("KT_DEBUG", raising=False)
    p = tmp_path / "s.npz"

    @settings(max_examples=60, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(payload=_npz_payloads())
    def run(payload):
        p.write_bytes(payload)
        rc = main(["placement", "plan", "--stats", str(p), "--budget", "1", "-o", str(tmp_path / "x.json")])
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("kt placement: error: "), err
        assert str(p) in lines[0] and "Traceback" not in err and "allow_pickle" not in err, err

    run()
