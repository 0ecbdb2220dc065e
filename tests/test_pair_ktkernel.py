"""benchmarks/pair_ktkernel.py run as a user runs it: two real kt servers (``--peer kt``, the
method's own spread) alternated on a toy layer, and what happens when kt-kernel's extension is
missing (its real run needs an AMX host with kt-kernel's wheel)."""
import pytest

from kt.testing.bench import benchmarks_present, read_result, run_benchmark

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(not benchmarks_present(), reason="needs the repository's benchmarks/ folder")]

TOY = ["--shape", "8,2,64,32", "--copies", "2", "--threads", "1", "--gap-s", "0", "--block", "2"]


def test_kt_against_itself(tmp_path):
    r = run_benchmark("pair_ktkernel.py", "--peer", "kt", *TOY, "--schemes", "int8,int4", "--T", "1,4",
                      "--pairs", "3", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    res = read_result(tmp_path, "pair_kt_self")
    assert not (tmp_path / "pair_ktkernel.json").exists()  # a self-pair never stands in for kt-kernel's
    assert res["peer"] == "kt" and res["meta"]["benchmark"] == "pair_kt_self"
    assert [(x["scheme"], x["T"]) for x in res["rows"]] == [("int8", 1), ("int8", 4), ("int4", 1), ("int4", 4)]
    for x in res["rows"]:
        assert x["pairs"] == 3 and len(x["raw_ms"]) == 3
        kt_ms = [a for a, _ in x["raw_ms"]]
        peer_ms = [b for _, b in x["raw_ms"]]
        assert x["kt_min_ms"] == min(kt_ms) and x["peer_min_ms"] == min(peer_ms)
        # (raw_ms is rounded to 1 us: a few per cent of a toy call)
        assert x["speedup_of_minima"] == pytest.approx(min(peer_ms) / min(kt_ms), rel=0.05)
        assert x["speedup_pair_min"] <= x["speedup_pair_median"] <= x["speedup_pair_max"]
        assert 0 < min(kt_ms) and 0 < min(peer_ms)
    # how long each side's workers spin after a call (what --gap-s must cover), per side
    assert set(res["idle_cores"]) == {"kt", "kt (peer)"}
    assert "| int8 | 4 |" in r.stdout and "best of 2 calls" in r.stdout


def test_a_missing_ktkernel_extension_ends_the_run_with_its_reason(tmp_path):
    r = run_benchmark("pair_ktkernel.py", *TOY, "--ktk", str(tmp_path / "nowhere"), "--schemes", "int8",
                      "--T", "1", "--pairs", "1", "--out", str(tmp_path), timeout=300)
    assert r.returncode != 0
    assert "the kt-kernel server exited" in r.stderr
    assert "no kt_kernel/_kt_kernel_ext_amx" in r.stderr  # the server's own error, on the same stderr
    assert not (tmp_path / "pair_ktkernel.json").exists()
