"""benchmarks/bench_moe.py run as a user runs it, on a tiny layer: its rows, its floors, its
per-call overhead, and the kt-kernel baseline's subprocess (kt-kernel's extension needs an AMX
host with its wheel: here a stand-in interpreter answers for it through the same files)."""
import stat
import sys

import pytest

from kt.testing.bench import benchmarks_present, read_result, run_benchmark

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(not benchmarks_present(), reason="needs the repository's benchmarks/ folder")]

# Called as ``<python> _ktkernel.py --ktk ... --side ktkernel ... --out DIR``, as bench_moe calls
# kt-kernel's interpreter; writes DIR/ktkernel.json as _ktkernel.py does, bf16 failing.
FAKE_KTKERNEL = r'''#!{python}
import argparse, json, sys
from pathlib import Path
ap = argparse.ArgumentParser()
ap.add_argument("script")
for f in ("--ktk", "--side", "--threads", "--shape", "--T", "--schemes", "--budget-s", "--out"):
    ap.add_argument(f)
a = ap.parse_args()
if not a.script.endswith("_ktkernel.py") or a.side != "ktkernel" or a.shape != "16,2,256,128" or a.threads != "2":
    sys.exit("unexpected arguments: " + " ".join(sys.argv[1:]))
rows = [dict(scheme=s, T=int(t), ktkernel_min_ms=0.75 * int(t), ktkernel_med_ms=0.8 * int(t))
        for s in a.schemes.split(",") if s != "bf16" for t in a.T.split(",")]
errors = {"bf16": "Traceback ...\nRuntimeError: no BF16 here"} if "bf16" in a.schemes else {}
Path(a.out, "ktkernel.json").write_text(json.dumps(dict(rows=rows, errors=errors, ktkernel_variant="amx")))
'''

TINY = ["--add-shape", "tiny=16,2,256,128", "--shapes", "tiny", "--pool-gb", "0.005"]


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench_moe")
    fake = d / "fake_python"
    fake.write_text(FAKE_KTKERNEL.replace("{python}", sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    r = run_benchmark("bench_moe.py", *TINY, "--T", "1,8", "--threads", "1,2", "--schemes", "int8,bf16",
                      "--baseline", "kt-kernel", "--ktk", str(d), "--ktk-python", str(fake), "--out", str(d))
    assert r.returncode == 0, r.stderr[-3000:]
    return r, read_result(d, "moe")


def test_rows_cover_every_case_and_their_figures_agree(moe_run):
    from kt.cpu_ops.moe import CPUMoE
    from kt.testing import random_expert_weights

    r, res = moe_run
    g, u, d = random_expert_weights(16, 256, 128)
    per_expert_MB = {s: CPUMoE.from_tensors(g, u, d, scheme=s).expert_read_bytes() / 1e6 for s in ("int8", "bf16")}
    assert res["meta"]["benchmark"] == "moe" and res["meta"]["machine"] == "test"
    kt = {(x["scheme"], x["threads"], x["T"]): x for x in res["rows"] if x["impl"] == "kt"}
    assert set(kt) == {(s, t, T) for s in ("int8", "bf16") for t in (1, 2) for T in (1, 8)}
    E, K, H, I = 16, 2, 256, 128
    for (scheme, threads, T), x in kt.items():
        assert 0 < x["min_us"] <= x["median_us"]
        # the figures are the same measurement read three ways (weight_MB is rounded to 0.1 MB)
        assert x["GBps"] == pytest.approx(x["weight_MB"] * 1e6 / (x["min_us"] * 1e-6) / 1e9,
                                          rel=0.05 / x["weight_MB"] + 0.01)
        assert x["TOPS"] == pytest.approx(2.0 * T * K * 3 * H * I / (x["min_us"] * 1e-6) / 1e12, rel=0.02, abs=2e-3)
        assert x["frac_of_floor"] == pytest.approx(x["floor_us"] / x["min_us"], rel=0.02, abs=2e-3)
        # the bytes of the distinct experts a call touched, as the layer's kernels read them: a
        # T=1 call touches exactly K experts, a T=8 call between K and min(E, T*K)
        per_expert = per_expert_MB[scheme]
        lo, hi = (K, K) if T == 1 else (K, min(E, T * K))
        assert lo * per_expert - 0.05 <= x["weight_MB"] <= hi * per_expert + 0.05, (scheme, T, x["weight_MB"])
    over = [x for x in res["rows"] if x["impl"] == "kt-overhead"]
    assert len(over) == 4 and all(0 < x["masked_call_min_us"] <= x["masked_call_median_us"] for x in over)
    assert all(x["pool_handoff_us"]["min"] <= x["pool_handoff_us"]["median"] for x in over)
    assert set(res["bandwidth"]) >= {"1_thread_GBps", "2_thread_GBps"}
    assert "| kt | tiny | int8 |" in r.stdout  # the printed table


def test_ktkernel_rows_carry_kts_speedup_against_its_best_thread_count(moe_run):
    _, res = moe_run
    ktk = {(x["scheme"], x["T"]): x for x in res["rows"] if x["impl"] == "kt-kernel"}
    assert set(ktk) == {("int8", 1), ("int8", 8)}
    for (scheme, T), x in ktk.items():
        best = min((k for k in res["rows"] if k["impl"] == "kt" and k["scheme"] == scheme and k["T"] == T),
                   key=lambda k: k["min_us"])
        assert x["min_us"] == pytest.approx(750.0 * T) and x["threads"] == 2
        assert x["kt_speedup"] == round(750.0 * T / best["min_us"], 2)
        assert x["frac_of_floor"] == round(best["floor_us"] / (750.0 * T), 3)
    assert any("no BF16 here" in n for n in res["notes"])


def test_a_failed_baseline_is_a_note_not_a_failed_run(tmp_path):
    r = run_benchmark("bench_moe.py", *TINY, "--T", "1", "--threads", "1", "--schemes", "int8",
                      "--baseline", "kt-kernel", "--ktk", str(tmp_path / "nowhere"), "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    res = read_result(tmp_path, "moe")
    assert not [x for x in res["rows"] if x["impl"] == "kt-kernel"]
    (note,) = res["notes"]
    assert "kt-kernel baseline" in note and "kt_kernel" in note  # _ktkernel.py's own error, passed on


@pytest.mark.parametrize("spec, says", [("tiny=16,2,256", "four integers"), ("tiny=4,8,256,128", "K <= E"),
                                        ("=16,2,256,128", "a name")])
def test_a_bad_shape_is_refused(tmp_path, spec, says):
    r = run_benchmark("bench_moe.py", "--add-shape", spec, "--shapes", "tiny", "--out", str(tmp_path))
    assert r.returncode == 2 and says in r.stderr
    r = run_benchmark("bench_moe.py", "--shapes", "nosuchmodel", "--out", str(tmp_path))
    assert r.returncode == 2 and "unknown shape 'nosuchmodel'" in r.stderr
    assert not (tmp_path / "moe.json").exists()
