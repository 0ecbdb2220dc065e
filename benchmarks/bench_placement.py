"""GPU hit rate of the placement strategies on skewed synthetic routing (no GPU needed).

The hit rate is the fraction of routed token-slots whose expert is on the GPU: the share of expert
work the GPU takes off the CPU. Routing is Zipf-like per layer (every layer has its own hot experts);
in the drifting case the hot experts are redrawn several times during the evaluation stream.

Static strategies are planned from a calibration trace (a separate sample); `dynamic` starts from the
uniform placement and re-places online with `DynamicPlacer`, scored causally (each step is scored with
the placement in force before the step is observed). `oracle` is frequency planned on the evaluation
trace itself: the best any static placement of this budget can do.

    python benchmarks/bench_placement.py            # writes benchmarks/results/<machine>/placement.json
    python benchmarks/bench_placement.py --quick    # smaller, for a smoke run (written only with --out)
"""
from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np

from kt.placement import (DynamicPlacer, ExpertStats, expert_nbytes, hit_rate, plan, zipf_routing)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import add_out_arguments, out_dir, write_result  # noqa: E402


def _stats(ids: np.ndarray, E: int) -> ExpertStats:
    s = ExpertStats(ids.shape[0], E)
    for l in range(ids.shape[0]):
        s.record(l, ids[l])
    return s


def run_dynamic(ids: np.ndarray, E: int, budget, *, step: int, every: int, drift: float, eb: int):
    """Online: per step of `step` tokens score with the current placement, then observe; poll."""
    L, T, _ = ids.shape
    dp = DynamicPlacer((L, E), budget, strategy="uniform", every_n_tokens=every, drift_threshold=drift,
                       expert_bytes=eb)
    hits = total = 0
    for t0 in range(0, T, step):
        for l in range(L):
            blk = ids[l, t0:t0 + step]
            hits += int(dp.placement.gpu_mask[l, blk].sum())
            total += blk.size
            dp.observe(l, blk)
        dp.poll()
    moves = sum(h["moves"] for h in dp.history)
    return hits / total, sum(h["replaced"] for h in dp.history), moves


def scenario(name, L, E, K, T_cal, T_eval, alpha, phases, budget, seed, *, step, every, drift, eb):
    cal = zipf_routing(L, E, K, T_cal * phases, alpha=alpha, phases=phases, seed=seed, sample_seed=seed + 1000)
    cal = cal[:, :T_cal]  # calibration sees only the first distribution (before any drift)
    ev = zipf_routing(L, E, K, T_eval, alpha=alpha, phases=phases, seed=seed, sample_seed=seed + 2000)
    cal_stats = _stats(cal, E)
    row = {"scenario": name, "L": L, "E": E, "K": K, "alpha": alpha, "phases": phases,
           "calibration_tokens": T_cal, "eval_tokens": T_eval, "budget": str(budget)}
    t = time.perf_counter()
    for strat in ("uniform", "front-loading", "random"):
        row[strat] = hit_rate(plan((L, E), budget, strat), ev)
    row["frequency"] = hit_rate(plan(cal_stats, budget, "frequency"), ev)
    row["oracle"] = hit_rate(plan(_stats(ev, E), budget, "frequency"), ev)
    row["dynamic"], row["dynamic_replacements"], row["dynamic_expert_copies"] = run_dynamic(
        ev, E, budget, step=step, every=every, drift=drift, eb=eb)
    row["dynamic_copy_GiB"] = row["dynamic_expert_copies"] * eb / 2**30
    # sensitivity: the same policy checking 4x less often
    row["dynamic_slow"] = run_dynamic(ev, E, budget, step=step, every=4 * every, drift=drift, eb=eb)[0]
    row["seconds"] = time.perf_counter() - t
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    add_out_arguments(ap)
    args = ap.parse_args(argv)
    # qwen3-30b-a3b-like: 48 MoE layers, 128 experts, top-8; bf16 experts of H2048 I768 (9 MiB)
    L, E, K = (8, 64, 8) if args.quick else (48, 128, 8)
    T_cal, T_eval = (2048, 8192) if args.quick else (8192, 32768)
    eb = expert_nbytes(2048, 768, "bf16")
    common = dict(step=16, every=256, drift=0.02, eb=eb)
    rows = []
    for alpha in (0.8, 1.0, 1.2):
        rows.append(scenario(f"stationary a={alpha}", L, E, K, T_cal, T_eval, alpha, 1, 0.25, 7, **common))
    rows.append(scenario("drifting a=1.0, 4 phases", L, E, K, T_cal, T_eval, 1.0, 4, 0.25, 11, **common))
    rows.append(scenario("drifting a=1.2, 8 phases", L, E, K, T_cal, T_eval, 1.2, 8, 0.25, 13, **common))
    meta = {"benchmark": "placement hit rate", "budget": "25 % of all experts",
            "host": platform.processor() or platform.machine(), "python": platform.python_version(),
            "numpy": np.__version__, "decode_step_tokens": common["step"],
            "dynamic": {"every_n_tokens": common["every"], "drift_threshold": common["drift"],
                        "start": "uniform", "halflife_tokens": 2 * common["every"], "hysteresis": 0.05},
            "expert_bytes": eb}
    if not args.quick or args.out:
        print(f"wrote {write_result(out_dir(args), 'placement', {'meta': meta, 'rows': rows}, args.machine)}")
    cols = ["uniform", "front-loading", "random", "frequency", "dynamic", "dynamic_slow", "oracle"]
    lines = [
        "# Placement: GPU hit rate at a 25 % budget (synthetic Zipf routing)",
        "",
        f"L={L} layers, E={E} experts, top-{K}; {T_cal} calibration tokens (before any drift), "
        f"{T_eval} evaluation tokens. Hit rate = share of routed token-slots served by GPU experts.",
        "`frequency` is planned on the calibration trace, `dynamic` starts uniform and re-places online "
        f"(every {common['every']} tokens if the EMA hit-rate gap > {common['drift']}), scored causally in "
        f"decode steps of {common['step']} tokens; `dynamic_slow` is the same policy checking every "
        f"{4 * common['every']} tokens; `oracle` = frequency planned on the evaluation trace itself.",
        "",
        "| scenario | " + " | ".join(cols) + " | dynamic re-placements | dynamic expert copies (GiB at 9 MiB each) |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    for r in rows:
        lines.append(f"| {r['scenario']} | " + " | ".join(f"{100 * r[c]:.1f} %" for c in cols)
                     + f" | {r['dynamic_replacements']} | {r['dynamic_expert_copies']} ({r['dynamic_copy_GiB']:.1f}) |")
    lines += ["", f"Generated by `python benchmarks/bench_placement.py{' --quick' if args.quick else ''}` "
              f"on {meta['host']} (numpy {np.__version__}); CPU-only, no timing involved."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
