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


def _bm(gu_us, dn_us, gu_cand=(64, 128, 8, 8, 3, True), dn_cand=(128, 64, 8, 4, 4)):
    """One block_m's sweep results: best tiles and their (tma, flatten) rows."""
    return dict(gu=dict(cand=list(gu_cand), us=gu_us), dn=dict(cand=list(dn_cand), us=dn_us),
                gate_up_flags=_rows({(False, False): gu_us, (True, True): gu_us - 1}),
                down_flags=_rows({(False, False): dn_us, (True, False): dn_us + 5}))


def test_pick_pair_takes_each_kernels_best_row_block():
    from kt.gpu_ops import MoEConfig

    # gate+up is best with 64-row blocks, the down with 128: the pair pads slots to 128
    cfg, extra = bench_gpu.pick_pair(MoEConfig, {64: _bm(150.0, 118.0), 128: _bm(180.0, 100.0)})
    assert (cfg.block_m, cfg.down_block_m, cfg.align_m) == (64, 128, 128)
    # one tma for both kernels: without it 150 + 100 = 250, with it 149 + 105 = 254
    assert cfg.a8 and not cfg.tma and not cfg.flatten and not cfg.down_flatten
    assert cfg.for_down().block_m == 128 and cfg.down_block_n == 128
    same = extra["tuned_same_bm"]  # the best single block_m, compared too (timed at its own alignment)
    assert same.block_m == 64 and same.down_block_m is None
    # when one block_m is best for both, there is nothing extra
    cfg, extra = bench_gpu.pick_pair(MoEConfig, {64: _bm(150.0, 90.0), 128: _bm(180.0, 100.0)})
    assert cfg.block_m == 64 and cfg.down_block_m is None and extra == {}


def test_add_shape_parsing():
    import pytest

    assert bench_gpu.parse_shape("ds=256,8,7168,2048,64") == ("ds", dict(E=256, K=8, H=7168, I=2048, S=64))
    for bad in ("ds=1,2", "ds=4,8,1,1,1", "ds", "=1,1,1,1,1", "ds=0,1,1,1,1"):
        with pytest.raises(SystemExit):
            bench_gpu.parse_shape(bad)


def test_tuned_table_file_lays_the_tune_over_the_table_and_kt_reads_it(tmp_path, monkeypatch):
    from kt.gpu_ops.configs import MoEConfig, table_for_device  # (KT_GPU_TABLE is read per call)

    shipped = {"H64_I32_bf16": {"1": MoEConfig(block_m=16).to_dict(), "7": MoEConfig(block_m=32).to_dict()}}
    found = {"H64_I32_bf16": {"7": MoEConfig(block_m=64, a8=False).to_dict()},
             "H96_I48_int8": {"512": MoEConfig(block_m=64, a8=True, down_block_m=128).to_dict()}}
    for gpu, name in (("NVIDIA H100 80GB HBM3", "h100_tuned.json"), ("NVIDIA GeForce RTX 4090", "gpu_tuned.json")):
        path = bench_gpu.write_tuned_table(str(tmp_path), gpu, shipped, found)
        assert os.path.basename(path) == name
        monkeypatch.setenv("KT_GPU_TABLE", path)
        table, source = table_for_device(gpu)
        assert source == f"KT_GPU_TABLE={path}"
        assert table["H64_I32_bf16"]["1"]["block_m"] == 16  # kept from the table the GPU used
        assert table["H64_I32_bf16"]["7"]["block_m"] == 64  # the tune's entry wins
        assert MoEConfig.from_dict(table["H96_I48_int8"]["512"]) == MoEConfig(block_m=64, a8=True, down_block_m=128)
    assert shipped["H64_I32_bf16"]["7"]["block_m"] == 32  # the caller's table is not changed


def test_interleaved_rounds_take_the_least_minimum_and_the_median_median():
    order, times = [], {"a": iter([[3.0, 5.0, 4.0], [2.0, 9.0, 9.0], [6.0, 7.0, 8.0]]),
                        "b": iter([[1.0, 1.0, 1.0]] * 3)}

    def do_bench(fn, warmup, rep, return_mode):  # ms, as triton's; fn names the series
        order.append(fn)
        return next(times[fn])

    got = bench_gpu.interleaved_us(do_bench, {"a": "a", "b": "b"}, 3)
    assert order == ["a", "b"] * 3  # every round times every fn once
    assert got["a"] == (2000.0, 7000.0) and got["b"] == (1000.0, 1000.0)


def test_fractions_of_skipped_ceilings_read_nan():
    """--skip ceilings: the parts that report fractions of the ceilings get NaN, not a KeyError."""
    import math

    res = bench_gpu.Results(None)
    c = bench_gpu.ceilings_or_nan(res)
    assert math.isnan(1.0 / c["hbm_bytes_per_s"]) and math.isnan(1.0 / c["bf16_flops_per_s"])
    res.data["ceilings"] = dict(hbm_bytes_per_s=4e12, bf16_flops_per_s=7e14)
    assert bench_gpu.ceilings_or_nan(res)["hbm_bytes_per_s"] == 4e12
