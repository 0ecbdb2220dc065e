"""The GPU tuner's choices (kt.gpu_ops.tuning, what benchmarks/bench_gpu.py --tune decides from its
sweeps): which TMA / flattened-loop flags and which row blocks to ship, and the table file it
leaves for KT_GPU_TABLE. The sweeps themselves need a GPU; the choices are pure."""
import os

from kt.gpu_ops import MoEConfig
from kt.gpu_ops.tuning import gu_config, pick_flags, pick_pair, write_tuned_table


def _rows(times):
    return [{"cand": [tma, flat], "us": us} for (tma, flat), us in times.items()]


def test_one_tma_for_both_kernels_by_their_summed_best():
    gate_up = _rows({(False, False): 10.0, (True, False): 8.0, (True, True): 9.0})
    down = _rows({(False, False): 5.0, (True, False): 9.0, (True, True): 6.0})
    # without TMA 10 + 5 = 15; with TMA the best gate+up (not flattened) 8 + the best down
    # (flattened) 6 = 14
    assert pick_flags(gate_up, down) == (True, False, True, 14.0)
    down[0]["us"] = 3.0  # now 10 + 3 = 13 wins without TMA
    assert pick_flags(gate_up, down) == (False, False, False, 13.0)


def test_failed_or_missing_candidates():
    gate_up = _rows({(False, False): 10.0}) + [{"cand": [True, False], "error": "no TMA"}]
    down = _rows({(False, False): 5.0, (True, True): 1.0})
    assert pick_flags(gate_up, down) == (False, False, False, 15.0)
    assert pick_flags([], down)[3] is None


def _bm(gu_us, dn_us, gu_cand=(64, 128, 8, 8, 3, True), dn_cand=(128, 64, 8, 4, 4)):
    """One block_m's sweep results: best tiles and their (tma, flatten) rows."""
    return dict(gu=dict(cand=list(gu_cand), us=gu_us), dn=dict(cand=list(dn_cand), us=dn_us),
                gate_up_flags=_rows({(False, False): gu_us, (True, True): gu_us - 1}),
                down_flags=_rows({(False, False): dn_us, (True, False): dn_us + 5}))


def test_pick_pair_takes_each_kernels_best_row_block():
    # gate+up is best with 64-row blocks, the down with 128: the pair pads slots to 128
    cfg, extra = pick_pair({64: _bm(150.0, 118.0), 128: _bm(180.0, 100.0)})
    assert (cfg.block_m, cfg.down_block_m, cfg.align_m) == (64, 128, 128)
    # one tma for both kernels: without it 150 + 100 = 250, with it 149 + 105 = 254
    assert cfg.a8 and not cfg.tma and not cfg.flatten and not cfg.down_flatten
    assert cfg.for_down().block_m == 128 and cfg.down_block_n == 128
    same = extra["tuned_same_bm"]  # the best single block_m, compared too (timed at its own alignment)
    assert same.block_m == 64 and same.down_block_m is None
    # when one block_m is best for both, there is nothing extra
    cfg, extra = pick_pair({64: _bm(150.0, 90.0), 128: _bm(180.0, 100.0)})
    assert cfg.block_m == 64 and cfg.down_block_m is None and extra == {}


def test_pick_pair_without_flag_timings_keeps_the_plain_tiles():
    per = _bm(150.0, 90.0)
    per["gate_up_flags"] = [{"cand": [True, True], "error": "timed out"}]
    cfg, _ = pick_pair({64: per})
    assert not cfg.tma and not cfg.flatten and not cfg.down_flatten


def test_gu_config_reads_a_sweep_candidate():
    cfg = gu_config(32, (64, 128, 8, 4, 3), down_block_n=256)
    assert (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages) == (32, 64, 128, 8, 4, 3)
    assert not cfg.a8 and cfg.down_block_n == 256
    assert gu_config(64, (64, 128, 8, 4, 3, True)).a8


def test_tuned_table_file_lays_the_tune_over_the_table_and_kt_reads_it(tmp_path, monkeypatch):
    from kt.gpu_ops.configs import table_for_device  # (KT_GPU_TABLE is read per call)

    shipped = {"H64_I32_bf16": {"1": MoEConfig(block_m=16).to_dict(), "7": MoEConfig(block_m=32).to_dict()}}
    found = {"H64_I32_bf16": {"7": MoEConfig(block_m=64, a8=False).to_dict()},
             "H96_I48_int8": {"512": MoEConfig(block_m=64, a8=True, down_block_m=128).to_dict()}}
    for gpu, name in (("NVIDIA H100 80GB HBM3", "h100_tuned.json"), ("NVIDIA GeForce RTX 4090", "gpu_tuned.json")):
        path = write_tuned_table(str(tmp_path / "tables"), gpu, shipped, found)
        assert os.path.basename(path) == name
        monkeypatch.setenv("KT_GPU_TABLE", path)
        table, source = table_for_device(gpu)
        assert source == f"KT_GPU_TABLE={path}"
        assert table["H64_I32_bf16"]["1"]["block_m"] == 16  # kept from the table the GPU used
        assert table["H64_I32_bf16"]["7"]["block_m"] == 64  # the tune's entry wins
        assert MoEConfig.from_dict(table["H96_I48_int8"]["512"]) == MoEConfig(block_m=64, a8=True, down_block_m=128)
    assert shipped["H64_I32_bf16"]["7"]["block_m"] == 32  # the caller's table is not changed
