"""The tuner's choices (benchmarks/bench_gpu.py --tune): which TMA / flattened-loop flags and
which pair of row blocks to ship, and the tuned table file that KT_GPU_TABLE reads.

The sweeps themselves need a GPU and live in the benchmark; what is decided from their timings is
pure and lives here, so that it is tested without one. A sweep row is ``{"cand": [...], "us": t}``
(or ``"error"`` instead of ``"us"`` for a candidate that failed).
"""
from __future__ import annotations

import json
import os

from .configs import MoEConfig, table_name

__all__ = ["pick_flags", "gu_config", "pick_pair", "write_tuned_table"]


def pick_flags(gate_up_rows, down_rows):
    """(tma, flatten, down_flatten, estimated us) from the two kernels' flag sweeps (rows of
    ``{"cand": [tma, flatten], "us": ...}``): one tma for both kernels (MoEConfig has one), the
    value whose best gate+up plus best down is least; (.., None) when either sweep has no time."""
    best = None
    for tma in (False, True):
        g = [r for r in gate_up_rows if "us" in r and r["cand"][0] == tma]
        d = [r for r in down_rows if "us" in r and r["cand"][0] == tma]
        if not (g and d):
            continue
        gb, db = min(g, key=lambda r: r["us"]), min(d, key=lambda r: r["us"])
        est = gb["us"] + db["us"]
        if best is None or est < best[3]:
            best = (tma, bool(gb["cand"][1]), bool(db["cand"][1]), est)
    return best if best is not None else (False, False, False, None)


def gu_config(bm: int, cand, **kw) -> MoEConfig:
    """The gate+up MoEConfig of a sweep candidate (block_n, block_k, group_m, num_warps, num_stages
    [, a8]) at block_m ``bm``; ``kw``: the other fields (the down kernel's, tma, flatten)."""
    return MoEConfig(bm, *cand[:5], a8=bool(cand[5]) if len(cand) > 5 else False, **kw)


def pick_pair(per_bm: dict) -> tuple[MoEConfig, dict]:
    """(config, {name: config}) from the per-block_m sweeps: the gate+up of one block_m and the down
    of another (each slot's rows are then padded to the larger, MoEConfig.down_block_m) whose flag
    sweeps' times sum least under one tma value; the extra dict holds the best pair of one block_m
    when that differs, so the whole-op comparison decides (each kernel was timed at its own
    alignment). ``per_bm``: {block_m: {"gu": best gate+up row, "dn": best down row (each
    ``{"cand": [...], "us": ...}``), "gate_up_flags": rows, "down_flags": rows}}."""
    def build(bg, bd):
        g, d = per_bm[bg]["gu"]["cand"], per_bm[bd]["dn"]["cand"]
        tma, gflat, dflat, est = pick_flags(per_bm[bg]["gate_up_flags"], per_bm[bd]["down_flags"])
        if est is None:  # the flag sweeps ran out of time: the plain tiles
            tma, gflat, dflat, est = False, False, False, per_bm[bg]["gu"]["us"] + per_bm[bd]["dn"]["us"]
        cfg = gu_config(bg, g, down_block_n=d[0], down_block_k=d[1], down_group_m=d[2],
                        down_num_warps=d[3], down_num_stages=d[4], tma=tma, flatten=gflat, down_flatten=dflat,
                        down_block_m=None if bd == bg else bd)
        return est, cfg

    pairs = {(bg, bd): build(bg, bd) for bg in per_bm for bd in per_bm}
    best = min(pairs, key=lambda p: pairs[p][0])
    same = min((p for p in pairs if p[0] == p[1]), key=lambda p: pairs[p][0])
    return pairs[best][1], ({} if same == best else {"tuned_same_bm": pairs[same][1]})


def write_tuned_table(out_dir, gpu_name: str, shipped: dict, found: dict) -> str:
    """The table a tune leaves: the one this GPU used (``shipped``) with the tuned entries
    (``found``, {shape key: {T: config}}) laid over it, written to out_dir/<gpu>_tuned.json (<gpu>
    from kt's table names, else "gpu"); use it with KT_GPU_TABLE=<file>, or ship it as
    kt/gpu_ops/configs/<name>.json. Returns the path."""
    merged = {k: dict(v) for k, v in shipped.items()}
    for k, v in found.items():
        merged.setdefault(k, {}).update(v)
    merged["_comment"] = (f"Tuned on an {gpu_name} by benchmarks/bench_gpu.py (S=32 slots for qwen3-30b-a3b, "
                          "S=4 for mixtral, --add-shape shapes as given); key H{H}_I{I}_{weight dtype}, then "
                          "T; entries with \"path\": \"direct\" are the direct path's (configs.takes_direct).")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{table_name(gpu_name) or 'gpu'}_tuned.json")
    with open(path, "w") as f:
        json.dump(merged, f, indent=1, sort_keys=True)
    return path
