"""benchmarks/cpu_decode_floor.py run as a user runs it, on a tiny layer: the read beside each
call covers exactly the bytes the layer's kernels read for the call's experts, and the figures
it writes are the ones its rows describe (its real run: a 16-core host, RESULTS.md)."""
import pytest

from kt.testing.bench import benchmarks_present, read_result, run_benchmark

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(not benchmarks_present(), reason="needs the repository's benchmarks/ folder")]

TINY = ["--add-shape", "tiny=16,2,256,128", "--shape", "tiny", "--threads", "2", "--pool-gb", "0.01"]


def _per_expert_bytes(scheme):
    from kt.cpu_ops.moe import CPUMoE
    from kt.testing import random_expert_weights

    g, u, d = random_expert_weights(16, 256, 128)
    return CPUMoE.from_tensors(g, u, d, scheme=scheme).expert_read_bytes()


def test_plain_and_gated_calls_beside_a_read_of_their_bytes(tmp_path):
    r = run_benchmark("cpu_decode_floor.py", *TINY, "--rounds", "6", "--schemes", "int8,int4",
                      "--variants", "gated", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    res = read_result(tmp_path, "cpu_decode_floor")
    assert res["dims_EKHI"] == [16, 2, 256, 128]
    rows = res["rows"]
    assert [(x["scheme"], x["variant"]) for x in rows] == [
        ("int8", "default"), ("int8", "gated"), ("int4", "default"), ("int4", "gated")]
    for x in rows:
        assert x["rounds"] == 6 and 0 < x["call_min_ms"] <= x["call_median_ms"]
        assert 0 < x["read_span_min_ms"] <= x["read_span_median_ms"] <= x["read_wall_median_ms"]
        # a T=1 call of top-2 touches two experts; the read covers what the kernels read of them
        assert x["experts_per_call_median"] == 2
        assert x["expert_read_bytes"] == _per_expert_bytes(x["scheme"])
        assert x["MB_per_call"] == round(2 * x["expert_read_bytes"] / 1e6, 2)
        # (the script rounds the fraction to 3 decimals and the times to 4)
        assert x["frac_of_floor_minima"] == pytest.approx(x["read_span_min_ms"] / x["call_min_ms"], rel=0.01,
                                                          abs=6e-4)
        assert x["read_GBps_median"] > 0


def test_sequences_and_refused_arguments(tmp_path):
    r = run_benchmark("cpu_decode_floor.py", *TINY, "--rounds", "4", "--schemes", "bf16", "--sequence", "3",
                      "--x-bf16", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    (x,) = read_result(tmp_path, "cpu_decode_floor")["rows"]
    assert x["sequence"] == 3 and x["scheme"] == "bf16" and x["call_min_ms"] > 0
    for bad, says in ((["--sequence", "0"], "at least 1"), (["--variants", "stamped"], "unknown --variants"),
                      (["--pool-gb", "0.0001"], "at least 3 are needed")):
        r = run_benchmark("cpu_decode_floor.py", *TINY, "--schemes", "int8", "--out", str(tmp_path / "x"), *bad)
        assert r.returncode != 0 and says in r.stderr, (bad, r.stderr[-500:])
