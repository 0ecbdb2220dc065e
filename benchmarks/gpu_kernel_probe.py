#!/usr/bin/env python3
"""What the compiler made of the fused-MoE kernels: for each kernel and config, the instruction mix
of its PTX (tensor-core MMA flavour, async copies, vector loads) and its registers and spills.

Device:  PYTHONPATH=. python3 benchmarks/gpu_kernel_probe.py --out $OUT   (writes kernel_probe.json)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kt.gpu_ops import MoEConfig, fused_moe  # noqa: E402
from kt.gpu_ops import moe as M  # noqa: E402

PATTERNS = {"wgmma": r"wgmma\.mma_async", "mma_sync": r"\bmma\.sync", "cp_async": r"cp\.async\.(ca|cg)",
            "tma": r"cp\.async\.bulk", "ld_v4": r"ld\.global[.\w]*\.v4", "ld_scalar_b16": r"ld\.global[.\w]*\.b16",
            "st_v4": r"st\.global[.\w]*\.v4"}


def inspect(compiled) -> dict:
    ptx = compiled.asm.get("ptx", "")
    row = {k: len(re.findall(p, ptx)) for k, p in PATTERNS.items()}
    for attr in ("n_regs", "n_spills"):
        row[attr] = getattr(compiled, attr, None)
    md = getattr(compiled, "metadata", None)
    row["shared"] = getattr(md, "shared", None)
    row["num_warps"] = getattr(md, "num_warps", None)
    row["num_stages"] = getattr(md, "num_stages", None)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    dev = "cuda"
    S, H, I, E, K, T = 32, 2048, 768, 128, 8, 4096
    g = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(S, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(S, H, I, device=dev, generator=g) / I ** 0.5).to(torch.bfloat16)
    e2s = torch.full((E,), -1, dtype=torch.int32, device=dev)
    e2s[torch.randperm(E, device=dev)[:S]] = torch.arange(S, dtype=torch.int32, device=dev)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)])
    w = torch.rand(T, K, device=dev)
    rows = []
    kern = M._kernels()
    for cfg in (MoEConfig(128, 128, 64, 8, 8, 4), MoEConfig(64, 64, 64, 8, 4, 4), MoEConfig(128, 64, 64, 8, 4, 3)):
        fused_moe(x, ids, w, e2s, w13, w2, config=cfg)
        torch.cuda.synchronize()
        for name in ("gate_up_kernel", "down_kernel"):
            fn = getattr(kern, name)
            caches = [c[0] for c in getattr(fn, "device_caches", {}).values() if isinstance(c, tuple)]
            for compiled in [v for c in caches if isinstance(c, dict) for v in c.values()]:
                r = dict(kernel=name, config=cfg.to_dict(), **inspect(compiled))
                if r not in rows:
                    rows.append(r)
    seen = set()
    for r in rows:
        k = json.dumps(r, sort_keys=True)
        if k in seen:
            continue
        seen.add(k)
        print(json.dumps(r), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "kernel_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
