"""Configuration names, the targets it checks, the markdown table and the plots of bench_e2e.py.

Pure functions of the results document (``e2e.json``); matplotlib is imported only to draw.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import numpy as np

JSON_NAME, MD_NAME = "e2e.json", "e2e.md"
PLOT_DECODE, PLOT_PREFILL = "e2e_decode.png", "e2e_prefill.png"


@dataclass(frozen=True)
class RunConfig:
    name: str
    gpu_pct: int  # % of all experts on the GPU (100 = the all-GPU backend)
    scheme: str  # CPU scheme (int8/int4), "bf16" for the all-GPU backend
    routing: str  # "uniform" | "skewed"
    deferred: int

    @property
    def all_gpu(self) -> bool:
        return self.gpu_pct == 100


def parse_config(name: str) -> RunConfig:
    m = re.fullmatch(r"gpu100_bf16_(uniform|skewed)", name)
    if m:
        return RunConfig(name, 100, "bf16", m.group(1), 0)
    m = re.fullmatch(r"(?:cpu0|gpu(\d{1,2}))_(int8|int4)_(uniform|skewed)_d(\d)", name)
    if not m:
        raise ValueError(f"unknown configuration {name!r}; expected gpu100_bf16_<routing>, "
                         "cpu0_<int8|int4>_<routing>_d<d> or gpu<pct>_<int8|int4>_<routing>_d<d> "
                         "with routing uniform or skewed, e.g. gpu25_int8_skewed_d1")
    pct = int(m.group(1) or 0)
    if m.group(1) is not None and not 1 <= pct <= 99:
        raise ValueError(f"{name}: the GPU share must be 1..99 % (gpu100_bf16_* is the all-GPU run)")
    return RunConfig(name, pct, m.group(2), m.group(3), int(m.group(4)))


def fmt(v, spec=".1f", none="-"):
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return none
    return format(v, spec)


def _decode_cell(e, b):
    return fmt(e.get("decode", {}).get(str(b), {}).get("tok_s"))


def checks(data: dict) -> dict:
    """The targets, computed from whatever configurations ran (None where one is missing)."""
    by = {e["name"]: e for e in data["configs"] if e.get("status") in ("ok", "partial")}
    out = {}
    for routing in ("uniform", "skewed"):
        e = by.get(f"cpu0_int8_{routing}_d0")
        fl = (e or {}).get("decode", {}).get("1", {}).get("floor")
        if fl:
            out[f"decode_floor_cpu0_int8_{routing}_b1"] = dict(
                ratio_to_floor_membw=fl["ratio_to_floor_membw"], ratio_to_floor_cpu_moe=fl["ratio_to_floor_cpu_moe"],
                target="<= 1.25", met_membw=fl["ratio_to_floor_membw"] <= 1.25,
                met_cpu_moe=fl["ratio_to_floor_cpu_moe"] <= 1.25)
    for name, e in by.items():
        rc = parse_config(name)
        if rc.all_gpu or rc.gpu_pct == 0 or rc.deferred:
            continue
        base = by.get(f"cpu0_{rc.scheme}_{rc.routing}_d0")
        if base is None:
            continue
        row = dict(gpu_expert_share=e.get("gpu_expert_share"), gpu_hit_share_prompt=e.get("gpu_hit_share_prompt"),
                   target="speedup - 1 >= gpu_expert_share")
        for b in data["meta"].get("args", {}).get("decode_batches", [1, 8]):
            d = e.get("decode", {}).get(str(b), {}).get("tok_s")
            d0 = base.get("decode", {}).get(str(b), {}).get("tok_s")
            if d and d0:
                sp = d / d0
                row[f"speedup_b{b}"] = sp
                row[f"met_b{b}"] = sp - 1 >= (e.get("gpu_expert_share") or 0)
        out[f"placement_{name}_vs_cpu0"] = row
    for name, e in by.items():
        pre = e.get("prefill", {})
        for key, r in pre.items():
            t, mode = key.split("_")
            if mode == "on" and f"{t}_off" in pre:
                sp = pre[f"{t}_off"]["seconds"] / r["seconds"]
                out[f"layerwise_{name}_{t}"] = dict(speedup=sp, target=">= 3 at 8192 tokens",
                                                    met=sp >= 3 if int(t) >= 8192 else None)
    e = by.get("gpu25_int8_skewed_d0")
    if e is not None and isinstance(e.get("correctness"), dict):
        c = e["correctness"]
        out["correctness_gpu25_int8_skewed_d0"] = {k: c[k] for k in ("kl_mean", "kl_max", "rel_err_mean",
                                                                     "rel_err_max", "top1_agree")}
        c2 = e.get("correctness_int8x2")
        if isinstance(c2, dict):
            out["correctness_gpu25_int8_skewed_d0_int8x2"] = {
                k: c2[k] for k in ("kl_mean", "kl_max", "rel_err_mean", "rel_err_max", "top1_agree")}
    sens = data.get("correctness_reference", {}).get("bf16_rounding_sensitivity")
    if isinstance(sens, dict) and isinstance(sens.get("skewed"), dict):
        out["correctness_yardstick_all_gpu_int8_exact_vs_bf16_skewed"] = {
            k: sens["skewed"][k] for k in ("kl_mean", "kl_max", "rel_err_mean", "rel_err_max", "top1_agree")}
    return out


def markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [f"# kt end to end: {meta.get('model', {}).get('name', '?')}"
             f"{' (DRY RUN: tiny model on CPU tensors)' if meta.get('dry_run') else ''}", ""]
    lines.append(f"Device: {meta.get('device')}; CPU threads: {meta.get('threads')}; host read bandwidth "
                 f"{fmt(meta.get('host_read_GBps'))} GB/s; prompt {meta.get('args', {}).get('prompt_tokens')} "
                 f"tokens, up to {meta.get('args', {}).get('new_tokens')} new tokens; weight sets: "
                 f"{meta.get('weight_sets')}.")
    lines.append("")
    batches = meta.get("args", {}).get("decode_batches", [1, 8])
    pre_keys = []
    for e in data["configs"]:
        for k in e.get("prefill", {}):
            if k not in pre_keys:
                pre_keys.append(k)
    pre_keys.sort(key=lambda k: (int(k.split("_")[0]), k.split("_")[1] == "on"))
    head = (["config", "routing", "GPU experts", "d"] + [f"decode b={b} tok/s" for b in batches]
            + ["TTFT ms"] + [f"prefill {k.replace('_', ' lw ')} tok/s" for k in pre_keys]
            + ["floor ratio b=1 (membw / cpu-moe)", "GPU hit (prompt)", "logits KL / rel err", "VRAM GiB",
               "RSS GiB", "status"])
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for e in data["configs"]:
        fl = e.get("decode", {}).get("1", {}).get("floor")
        floor = f"{fl['ratio_to_floor_membw']:.2f} / {fl['ratio_to_floor_cpu_moe']:.2f}" if fl else "-"
        corr = e.get("correctness")
        corr_s = (f"{corr['kl_mean']:.2e} / {corr['rel_err_mean']:.2e}" if isinstance(corr, dict) else "-")
        c2 = e.get("correctness_int8x2")
        if isinstance(c2, dict):
            corr_s += f" (int8x2: {c2['kl_mean']:.2e} / {c2['rel_err_mean']:.2e})"
        share = e.get("gpu_expert_share")
        row = ([e["name"], e.get("routing", ""), fmt(None if share is None else 100 * share, ".0f") + " %"
                if share is not None else "-", str(e.get("deferred", ""))]
               + [_decode_cell(e, b) for b in batches]
               + [fmt(None if e.get("ttft_s") is None else 1e3 * e["ttft_s"])]
               + [fmt(e.get("prefill", {}).get(k, {}).get("tok_s"), ".0f") for k in pre_keys]
               + [floor, fmt(None if e.get("gpu_hit_share_prompt") is None else 100 * e["gpu_hit_share_prompt"],
                             ".1f") + (" %" if e.get("gpu_hit_share_prompt") is not None else ""),
                  corr_s, fmt(e.get("vram_peak_gib"), ".1f"), fmt(e.get("rss_gib"), ".1f"),
                  e.get("status", "")])
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    fit = data.get("calibration", {}).get("skew_fit", {})
    lines.append("uniform = the model's own router on random weights; skewed = the same plus a per-layer "
                 "bias fitted so that expert popularity follows a Zipf law (alpha %s: the top 25 %% of "
                 "experts take %s of token-slots). GPU experts = share of all L*E experts on the GPU (frequency "
                 "placement from the calibration run). floor ratio = decode step time / (CPU expert bytes "
                 "touched / host read bandwidth + GPU-only step time), and / (CPU MoE alone + GPU-only step "
                 "time). See docs/performance.md." % (meta.get("args", {}).get("zipf_alpha"),
                                                   fmt(None if "target_top25pct_share" not in fit
                                                       else 100 * fit["target_top25pct_share"], ".0f") + " %"))
    chk = checks(data)
    if chk:
        lines += ["", "Targets, as measured:", ""]
        for k, v in chk.items():
            lines.append(f"- {k}: " + ", ".join(f"{kk}={fmt(vv, '.3g') if isinstance(vv, float) else vv}"
                                               for kk, vv in v.items()))
    lines.append("")
    for e in data["configs"]:
        if e.get("status") in ("error", "skipped") or e.get("skipped"):
            why = e.get("reason") or "; ".join(e.get("skipped", [])) or (e.get("error") or "").strip().splitlines()[-1:]
            lines.append(f"- {e['name']}: {e.get('status')}: {why}")
    return "\n".join(lines) + "\n"


def _log_axis(ax, values) -> None:
    """Log x axis (the all-GPU rows are an order of magnitude beyond the CPU ones), starting at the
    decade below the smallest value so every bar starts from the same place."""
    if values:
        ax.set_xscale("log")
        ax.set_xlim(left=10 ** math.floor(math.log10(min(values))), right=max(values) * 2)


def make_plots(data: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [e for e in data["configs"] if e.get("decode")]
    batches = data["meta"].get("args", {}).get("decode_batches", [1, 8])
    if rows:
        fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) * len(batches) + 1.5))
        names = [e["name"] for e in rows]
        y = np.arange(len(rows))
        hgt = 0.8 / len(batches)
        lows = []
        for i, b in enumerate(batches):
            vals = [e["decode"].get(str(b), {}).get("tok_s") or 0.0 for e in rows]
            lows += [v for v in vals if v > 0]
            ax.barh(y + i * hgt, vals, height=hgt, label=f"batch {b}")
            for yy, v in zip(y + i * hgt, vals):
                if v:
                    ax.text(v, yy, f" {v:.1f}", va="center", fontsize=7)
        ax.set_yticks(y + hgt * (len(batches) - 1) / 2, names, fontsize=8)
        ax.invert_yaxis()
        _log_axis(ax, lows)
        ax.set_xlabel("decode tokens/s (all rows of the batch; log scale)")
        ax.set_title(f"decode, {data['meta'].get('model', {}).get('name')}"
                     f"{' (dry run)' if data['meta'].get('dry_run') else ''}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, PLOT_DECODE), dpi=110)
        plt.close(fig)
    rows = [e for e in data["configs"] if e.get("prefill")]
    if rows:
        keys = sorted({k for e in rows for k in e["prefill"]},
                      key=lambda k: (int(k.split("_")[0]), k.split("_")[1] == "on"))
        fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) * len(keys) + 1.5))
        y = np.arange(len(rows))
        hgt = 0.8 / len(keys)
        lows = []
        for i, k in enumerate(keys):
            vals = [e["prefill"].get(k, {}).get("tok_s") or 0.0 for e in rows]
            lows += [v for v in vals if v > 0]
            t, mode = k.split("_")
            ax.barh(y + i * hgt, vals, height=hgt, label=f"{t} tokens, layer-wise {mode}")
            for yy, v in zip(y + i * hgt, vals):
                if v:
                    ax.text(v, yy, f" {v:.0f}", va="center", fontsize=7)
        ax.set_yticks(y + hgt * (len(keys) - 1) / 2, [e["name"] for e in rows], fontsize=8)
        ax.invert_yaxis()
        _log_axis(ax, lows)
        ax.set_xlabel("prefill tokens/s (batch 1, first token included; log scale)")
        ax.set_title("prefill" + (" (dry run)" if data["meta"].get("dry_run") else ""))
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, PLOT_PREFILL), dpi=110)
        plt.close(fig)
