"""benchmarks/bench_gpu.py and gpu_decode_floor.py --dry-run: the same flow as on a GPU host, on
tiny shapes under the Triton interpreter (correctness only: no timings), run as a user runs them."""
import pytest

from kt.testing.bench import benchmarks_present, read_result, run_benchmark

pytest.importorskip("triton", reason="the GPU benchmarks need triton (kt[test] installs it)")
pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(not benchmarks_present(), reason="needs the repository's benchmarks/ folder")]


def test_bench_gpu_dry_run_checks_fused_moe_against_both_references(tmp_path):
    r = run_benchmark("bench_gpu.py", "--dry-run", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    res = read_result(tmp_path, "gpu")
    cases = res["correctness"]
    assert {(c["dtype"], c["T"]) for c in cases} == {(d, t) for d in ("bf16", "int8") for t in (1, 7, 33)}
    for c in cases:
        assert c["correct"] and c["finite"], c
        assert c["rel_err_vs_fp32_gpu_ref"] < 1e-2
        assert c["rel_err_vs_kt_reference_subset"] < 1e-2  # the fp32 GPU reference agrees with kt.reference
        assert c["gpu_ref_vs_kt_reference"] < 1e-5
    assert res["errors"] == [] and "dry run: 6 cases, 0 failed" in r.stdout


def test_bench_gpu_refuses_a_bad_shape_before_any_work(tmp_path):
    for spec in ("ds=1,2", "ds=4,8,1,1,1", "=1,1,1,1,1", "ds=0,1,1,1,1"):
        r = run_benchmark("bench_gpu.py", "--dry-run", "--add-shape", spec, "--out", str(tmp_path))
        assert r.returncode != 0 and "--add-shape" in r.stderr, (spec, r.stderr[-500:])
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.slow
def test_gpu_decode_floor_dry_run_reads_exactly_the_touched_weights(tmp_path):
    """The read kernels' sums equal torch's over the touched slots' weights (checked inside the
    script, which fails otherwise), and fused_moe matches the fp32 reference in every case."""
    r = run_benchmark("gpu_decode_floor.py", "--dry-run", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    cases = read_result(tmp_path, "gpu_decode_floor")["cases"]
    assert {(c["dtype"], c["T"]) for c in cases} == {(d, t) for d in ("bf16", "int8") for t in (1, 7)}
    for c in cases:
        assert c["fused_moe_correct"] and c["bytes"] > 0 and c["touched_slots"] >= 1
        assert "read1_best" in c and "read2_best" in c and ("read1cvt_best" in c) == (c["dtype"] == "int8")
