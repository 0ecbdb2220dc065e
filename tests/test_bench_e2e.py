"""The end-to-end model (kt.testing.e2e_model) and benchmarks/bench_e2e.py --dry-run.

The device run (a GPU host) cannot be tested here; the dry run is the same code path (weights made
in the packed layout, calibration, frequency placement planning, TTFT, decode, floor and overlap
measurements, long prefill, correctness vs the bf16 reference, JSON/markdown/plots, the budget,
the watchdog) with every expert on the CPU, run as a subprocess; the tests check that the numbers
it writes are complete and plausible.
"""
import numpy as np
import pytest

from kt import reference as ref
from kt.config import QuantScheme
from kt.cpu_ops import registry
from kt.cpu_ops.packing import unpack
from kt.testing.bench import benchmarks_present, read_result, run_benchmark
from kt.testing.e2e_model import (TINY, DecodeState, DenseWeights, KVCache, LinePool, Model, TorchExperts,
                                  make_expert_sets, random_packed)

HOST_KERNELS = all(registry.candidates("gemv", QuantScheme.parse(s)) for s in ("int8", "int4"))
needs_kernels = pytest.mark.skipif(not HOST_KERNELS, reason="no kt CPU kernels registered for this host's ISA")
needs_script = pytest.mark.skipif(not benchmarks_present(), reason="needs the repository's benchmarks/ folder")


@pytest.mark.parametrize("scheme", [QuantScheme.INT8, QuantScheme.INT4])
def test_random_packed_is_a_valid_packed_weight(scheme):
    """The generated weights unpack to in-range values whose row sums are the stored wsum, and
    q * scale has std ~ 1/sqrt(D) (checked to 5 %: 3 experts x 64 x 128 samples)."""
    rng = np.random.default_rng(3)
    p = random_packed(LinePool(4096, 0), 3, 64, 128, scheme, 64, rng)
    for e in range(3):
        u = unpack(p.expert(e))
        lo, hi = (-127, 127) if scheme is QuantScheme.INT8 else (-7, 7)  # INT4 as kt's quantiser writes it
        assert u.q.min() >= lo and u.q.max() <= hi
        if scheme is QuantScheme.INT8:
            np.testing.assert_array_equal(u.q.astype(np.int32).sum(axis=1), p.wsum[e])
        w = ref.dequantize(u)
        assert abs(w.std() * np.sqrt(128) - 1.0) < 0.05
    assert not np.array_equal(unpack(p.expert(0)).q, unpack(p.expert(1)).q)
    with pytest.raises(ValueError, match="multiple of"):
        random_packed(LinePool(4096, 0), 1, 64, 96, scheme, 64, rng)


@needs_kernels
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_generated_weights_run_through_cpumoe_as_the_reference(scheme):
    """CPUMoE on the generated packed weights (bf16 in and out, as the stream bridge calls it) vs
    kt.reference on the same quantised weights: the only difference is the bf16 rounding of the
    output (2^-9 relative per element), so the bound is 3e-3 (observed 1.6e-3..1.8e-3)."""
    import torch

    from kt.cpu_ops.moe import CPUMoE
    from kt.cpu_ops.packing import int4_has_minus8, int4_ratio_table

    w13, w2 = make_expert_sets(TINY, QuantScheme.parse(scheme), 1, seed=0, pool_lines=4096)[0]
    moe = CPUMoE(w13, w2)
    # the arrays as a converted layer holds them: on 64-byte lines (the layer keeps them, no
    # copies), INT4 values in [-7, 7] and group scales of the ratio form (the AMX ratio kernels)
    assert moe.w13.data is w13.data and moe.w2.scale is w2.scale
    if scheme == "int4":
        assert not int4_has_minus8(w13) and not int4_has_minus8(w2)
        assert int4_ratio_table(w13.scale) is not None and int4_ratio_table(w2.scale) is not None
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, TINY.hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(TINY.num_experts, generator=g)[:2] for _ in range(9)])
    w = torch.rand(9, 2, generator=g)
    q13 = [unpack(w13.expert(e)) for e in range(TINY.num_experts)]
    q2 = [unpack(w2.expert(e)) for e in range(TINY.num_experts)]
    exp = ref.moe_forward_quantized(x.float(), ids, w, q13, q2)
    assert ref.relative_error(moe(x, ids, w).float(), exp) < 3e-3


def test_decode_step_matches_prefill():
    """The decode step (static KV cache, position mask, grouped-query trick, RoPE at a device-side
    position) gives the logits a full prefill gives for the same tokens, batch 1 and 3. Both run in
    bf16 through two layers with different attention code, so they agree to bf16 rounding: observed
    <= 7e-3 relative, bound 1.5e-2 (a wrong position or head mapping gives O(1))."""
    import torch

    torch.manual_seed(0)
    cfg = TINY
    sets = make_expert_sets(cfg, QuantScheme.INT8, 2, seed=0, pool_lines=4096)
    model = Model(cfg, DenseWeights(cfg, "cpu"), "cpu", 64)
    model.experts = TorchExperts(sets, [0, 1])
    toks = torch.randint(0, cfg.vocab, (3, 13))
    for b in (1, 3):
        cache = KVCache.empty(cfg, b, 32, "cpu")
        model.prefill(toks[:b, :9], cache)
        st = DecodeState.make(cache, toks[:b, 9], 9, toks[:b, 10:13].T.contiguous())
        st.logits = torch.zeros(b, cfg.vocab)
        for j in range(3):
            model.decode_step(st)
            full = model.prefill(toks[:b, :10 + j])
            assert ref.relative_error(st.logits, full) < 1.5e-2, (b, j)
            assert torch.equal(st.out_tokens[j], full.argmax(-1))
        assert int(st.pos) == 12


def _dry(tmp_path, *args, timeout=900):
    return run_benchmark("bench_e2e.py", "--dry-run", "--out", str(tmp_path), *args, timeout=timeout)


@needs_script
@pytest.mark.subprocess
def test_config_names_are_checked_before_anything_runs(tmp_path):
    for bad in ("gpu25_int8_zipf_d1", "gpu0_int8_uniform_d0", "gpu25_fp8_skewed_d0"):
        r = _dry(tmp_path, "--configs", bad)
        assert r.returncode == 2 and "error:" in r.stderr and bad in r.stderr, r.stderr[-800:]
        assert "Traceback" not in r.stderr
    assert not (tmp_path / "e2e.json").exists()


@needs_kernels
@needs_script
@pytest.mark.subprocess
def test_dry_run_end_to_end(tmp_path):
    out, report = tmp_path / "e2e", tmp_path / "report"
    configs = "gpu100_bf16_uniform,cpu0_int8_uniform_d0,gpu25_int8_skewed_d0,gpu25_int8_skewed_d1,cpu0_int4_uniform_d0"
    r = _dry(out, "--report-dir", str(report), "--configs", configs, "--budget-s", "600",
             "--prefill-configs", "cpu0_int8_uniform_d0,gpu100_bf16_uniform", "--min-step-s", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    for f in ("e2e.md", "e2e_decode.png", "e2e_prefill.png"):
        assert (report / f).stat().st_size > 0, f
    on_disk = read_result(out, "e2e")
    assert on_disk["meta"]["benchmark"] == "e2e" and on_disk["meta"]["dry_run"] is True
    assert [e["name"] for e in on_disk["configs"]] == configs.split(",")
    by = {e["name"]: e for e in on_disk["configs"]}
    for e in on_disk["configs"]:
        assert e["status"] in ("ok", "partial"), (e["name"], e.get("error"))
        for b in ("1", "8"):
            d = e["decode"][b]
            assert d["steps"] >= 1 and d["tok_s"] > 0 and d["cuda_graph"] is False
        assert e["ttft_s"] > 0
    # placement was planned from the calibration statistics (not applied: no GPU)
    g = by["gpu25_int8_skewed_d0"]
    assert g["gpu_experts"] == int(0.25 * 2 * 8) and g["placement_applied"] is False
    assert 0.25 <= g["gpu_hit_share_calibration"] <= 1.0
    cal = on_disk["calibration"]
    assert set(cal) == {"uniform", "skewed", "skew_fit"}
    # the skewed router was fitted to a Zipf(1) popularity: the top 2 of 8 experts take
    # H(2)/H(8) = 55 % of token-slots (64 slots here, 7 bisection steps: within 0.1)
    assert abs(cal["skew_fit"]["target_top25pct_share"] - 1.5 / (1 + 1 / 2 + 1 / 3 + 1 / 4 + 1 / 5 + 1 / 6 + 1 / 7 + 1 / 8)) < 1e-9
    assert abs(cal["skewed"]["top25pct_experts_share"] - cal["skew_fit"]["target_top25pct_share"]) < 0.1
    assert cal["uniform"]["top25pct_experts_share"] < cal["skewed"]["top25pct_experts_share"]
    # correctness vs the bf16 reference on the same weights: int8 activations cost little
    c = g["correctness"]
    assert c["positions"] == 8 and c["rel_err_mean"] < 0.05 and c["top1_agree"] >= 0.75, c
    assert isinstance(by["cpu0_int4_uniform_d0"]["correctness"], str)
    # floor and overlap were measured on the hybrid configurations
    fl = by["cpu0_int8_uniform_d0"]["decode"]["1"]["floor"]
    assert fl["cpu_expert_bytes_per_step"] > 0 and fl["ratio_to_floor_cpu_moe"] > 0
    assert by["cpu0_int8_uniform_d0"]["decode"]["8"]["overlap_layer0"]["cpu_alone_ms"] > 0
    assert "48_off" in by["cpu0_int8_uniform_d0"]["prefill"]
    assert "48_off" in by["gpu100_bf16_uniform"]["prefill"]
    assert "gpu25_int8_skewed_d0" in (report / "e2e.md").read_text()
    # the table and plots are redrawn from the JSON alone
    again = tmp_path / "replot"
    r = run_benchmark("bench_e2e.py", "--replot", str(out / "e2e.json"), "--report-dir", str(again))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (again / "e2e.md").read_text() == (report / "e2e.md").read_text()
    assert (again / "e2e_decode.png").stat().st_size > 0


@needs_kernels
@needs_script
@pytest.mark.subprocess
def test_placement_without_the_all_gpu_run_calibrates_on_the_cpu(tmp_path):
    """No gpu100 run to record statistics with: the calibration (and the skew fit) run with every
    expert on the CPU, and the placement is planned from them."""
    r = _dry(tmp_path, "--configs", "gpu50_int8_skewed_d0", "--decode-batches", "1", "--prefill-configs", "",
             "--min-step-s", "0", "--skip-overlap")
    assert r.returncode == 0, r.stderr[-3000:]
    data = read_result(tmp_path, "e2e")
    (e,) = data["configs"]
    assert e["status"] == "ok", e.get("error")
    assert data["calibration"]["skewed"]["experts_backend"] == "hybrid"
    assert data["calibration"]["skew_fit"]["experts_backend"] == "hybrid"
    assert e["gpu_experts"] == 8 and e["correctness"].startswith("n/a")


@needs_script
@pytest.mark.subprocess
def test_budget_skips_and_records(tmp_path):
    """A budget that is used up at once: every configuration is recorded as skipped, files written."""
    r = _dry(tmp_path, "--configs", "cpu0_int8_uniform_d0,gpu25_int8_skewed_d1", "--budget-s", "0")
    assert r.returncode == 0, r.stderr[-3000:]
    on_disk = read_result(tmp_path, "e2e")
    assert [e["status"] for e in on_disk["configs"]] == ["skipped", "skipped"]
    assert all("budget" in e["reason"] for e in on_disk["configs"])


@needs_script
@pytest.mark.subprocess
def test_watchdog_ends_an_overlong_run_with_its_results_written(tmp_path):
    """Past --hard-limit-s (counted from process start) the watchdog writes the results, says why
    and ends the process with exit code 3: a run stuck where Python cannot interrupt it still
    leaves its figures."""
    r = _dry(tmp_path, "--hard-limit-s", "1", "--budget-s", "600", "--configs", "cpu0_int8_uniform_d0",
             timeout=300)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "hard limit 1 s reached; results written, exiting" in r.stdout
    assert "hard limit" in read_result(tmp_path, "e2e")["meta"]["ended_by_watchdog"]
