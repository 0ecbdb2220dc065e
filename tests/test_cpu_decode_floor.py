"""benchmarks/cpu_decode_floor.py, decode_submit_probe.py and bw_methods.py on a tiny shape: they
run end to end, the read job reads exactly the bytes the layer's kernels read for the call's
experts, and the figures they write are the ones their rows describe (their real runs: the
device, RESULTS.md section 2)."""
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_moe  # noqa: E402
import bw_methods  # noqa: E402
import cpu_decode_floor as cdf  # noqa: E402
import decode_submit_probe  # noqa: E402


def test_decode_floor_tiny(tmp_path, monkeypatch):
    monkeypatch.setitem(bench_moe.SHAPES, "tiny", (16, 2, 256, 128))
    cdf.main(["--shape", "tiny", "--threads", "2", "--pool-gb", "0.01", "--rounds", "6",
              "--schemes", "int8,int4", "--variants", "i4l1_4k,gated", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cpu_decode_floor.json").read_text())["rows"]
    from kt.cpu_ops import isa

    # the prefetch variants swap an AMX host's decode kernel; elsewhere only the gated job is added
    i4 = [("int4", "i4l1_4k")] if isa.detect().variant == "amx" else []
    assert [(r["scheme"], r["variant"]) for r in rows] == [
        ("int8", "default"), ("int8", "gated"), ("int4", "default")] + i4 + [("int4", "gated")]
    for r in rows:
        assert r["rounds"] == 6 and 0 < r["call_min_ms"] <= r["call_median_ms"]
        assert 0 < r["read_span_min_ms"] <= r["read_span_median_ms"] and r["frac_of_floor_minima"] > 0


def test_decode_floor_sequences_and_call_parts(tmp_path, monkeypatch):
    """--sequence with the plain call's parts timed (stamped), the general path and the AVX-512
    decode GEMV beside it."""
    monkeypatch.setitem(bench_moe.SHAPES, "tiny", (16, 2, 256, 128))
    cdf.main(["--shape", "tiny", "--threads", "2", "--pool-gb", "0.01", "--rounds", "5",
              "--sequence", "3", "--schemes", "int8", "--variants", "stamped,general,avx512",
              "--x-bf16", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cpu_decode_floor.json").read_text())["rows"]
    from kt.cpu_ops import isa

    v512 = ["avx512"] if isa.detect().variant == "amx" else []  # swaps an AMX layer's GEMV
    assert [r["variant"] for r in rows] == ["default"] + v512 + ["stamped", "general"]
    st = rows[-2]
    # the job's span and the Python around it fit in the call (medians of different rounds
    # need not add up exactly, so within the call's median plus its spread)
    parts = [st[k] for k in ("us_to_first_entry_median", "us_job_median", "us_after_job_median")]
    assert all(p >= 0 for p in parts) and st["us_job_median"] > 0
    assert st["us_to_first_entry_median"] <= st["us_to_last_entry_median"]
    assert sum(parts) <= 2 * st["call_median_ms"] * 1e3


def test_decode_submit_probe_tiny(tmp_path, monkeypatch):
    monkeypatch.setitem(bench_moe.SHAPES, "tiny", (16, 2, 256, 128))
    decode_submit_probe.main(["--shape", "tiny", "--threads", "2", "--pool-gb", "0.01", "--rounds",
                              "3", "--sequence", "2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "decode_submit_probe.json").read_text())["rows"]
    assert [r["mode"] for r in rows[:-1]] == list(decode_submit_probe.MODES)
    for r in rows[:-1]:
        assert 0 < r["submit_median_us"] < r["total_median_us"] and sum(r["caller_cpus"].values()) == 3
    assert rows[-1]["pieces_us"]["masked call"] > 0


def test_read_job_reads_the_kernels_bytes():
    """The read covers read_arrays() of the experts asked for, and its span is measured."""
    from kt.cpu_ops.moe import CPUMoE
    from kt.cpu_ops.runtime.pool import CpuPool
    from kt.testing import random_expert_weights

    pool = CpuPool(2)
    try:
        g, u, d = random_expert_weights(8, 256, 128, seed=3)
        for scheme in ("int8", "int4", "bf16"):
            m = CPUMoE.from_tensors(g, u, d, scheme=scheme, pool=pool)
            segs = cdf.read_segments(m, [1, 6])
            assert sum(n for _, n in segs) == 2 * m.expert_read_bytes()
            assert all(a.ctypes.data == arr[e].ctypes.data for (a, _), (arr, e) in
                       zip(segs, [(arr, e) for e in (1, 6) for arr in m.read_arrays()]))
            res = np.zeros(pool.num_threads * cdf.RES_WORDS, np.int64)
            wall, span = cdf.timed_read(pool, segs, res)
            assert 0 < span <= wall
    finally:
        pool.shutdown()


def test_bw_methods_tiny(tmp_path):
    bw_methods.main(["--threads", "2", "--rounds", "1", "--gib", "0.05", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "bw_methods.json").read_text())["rows"]
    r = rows[0]
    assert r["per_piece_GBps"] > 0 and r["best_GBps"] == max(r[k] for k in r if k.startswith("pf"))
