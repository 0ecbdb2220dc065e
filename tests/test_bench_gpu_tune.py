"""benchmarks/bench_gpu.py's tuner: how it picks TMA and flattened loops from its flag sweeps
(the sweeps themselves need a GPU; bench_gpu.py --tune runs them on the device)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import bench_gpu  # noqa: E402


def _rows(times):
    return [{"cand": [tma, flat], "us": us} for (tma, flat), us in times.items()]


def test_one_tma_for_both_kernels_by_their_summed_best():
    gate_up = _rows({(False, False): 10.0, (True, False): 8.0, (True, True): 9.0})
    down = _rows({(False, False): 5.0, (True, False): 9.0, (True, True): 6.0})
    # without TMA 10 + 5 = 15; with TMA the best gate+up (not flattened) 8 + the best down
    # (flattened) 6 = 14
    assert bench_gpu.pick_flags(gate_up, down) == (True, False, True, 14.0)
    down[0]["us"] = 3.0  # now 10 + 3 = 13 wins without TMA
    assert bench_gpu.pick_flags(gate_up, down) == (False, False, False, 13.0)


def test_failed_or_missing_candidates():
    gate_up = _rows({(False, False): 10.0}) + [{"cand": [True, False], "error": "no TMA"}]
    down = _rows({(False, False): 5.0, (True, True): 1.0})
    assert bench_gpu.pick_flags(gate_up, down) == (False, False, False, 15.0)
    assert bench_gpu.pick_flags([], down)[3] is None
