#!/usr/bin/env python3
"""A workload for Nsight Compute: one ``fused_moe`` call per weight dtype at one shape and T, with
the table's config, after a warm-up (so that compiles and autotuning are not profiled), and nothing
else on the GPU. For locating what holds a kernel back (issue 6: the int8 down GEMM at qwen3 T=4096
takes 97 us against bf16's 86, and neither a8 nor swapped operands helped; session 13).

On the device (ncu reads the hardware counters on Firecracker machines, not on gVisor ones: see the
device tool's KINDS.md; leave the clocks alone):

    ncu --clock-control none --kernel-name regex:'down_kernel|gate_up_kernel' --launch-skip 4 \\
        --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section InstructionStats --csv \\
        python3 benchmarks/gpu_ncu_workload.py > $OUT/ncu_down.csv

(Every dtype is called once to warm up, then once more: with the default two dtypes, --launch-skip 4
skips the warm-up's four GEMM launches and the next four are int8's and bf16's gate+up and down; with
``--dtypes int8`` it is --launch-skip 2 --launch-count 2, since a skip of 4 leaves nothing to profile.
Stall reasons: ``--metrics regex:'smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio'``.
Session 14's runs: results/ncu_s14_run1_qwen3_T4096.csv, ncu_s14_run3_int8_stalls.csv.)

    python3 benchmarks/gpu_ncu_workload.py --dry-run       (the interpreter, tiny shape: runs only)
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="qwen3-30b-a3b")
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--dtypes", default="int8,bf16", help="comma list of weight dtypes, profiled in this order")
    ap.add_argument("--dry-run", action="store_true", help="tiny shape under the Triton interpreter")
    a = ap.parse_args(argv)
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import bench_gpu as B
    from kt.gpu_ops import fused_moe

    dev = "cpu" if a.dry_run else "cuda"
    sh = B.DRY_SHAPES["tiny"] if a.dry_run else B.SHAPES[a.shape]
    t = min(a.T, 33) if a.dry_run else a.T
    e2s = B.make_e2s(torch, sh, dev, 1)
    x = torch.randn(t, sh["H"], device=dev, generator=torch.Generator(device=dev).manual_seed(7)).to(torch.bfloat16)
    ids, w = B.make_routing(torch, sh, t, e2s, dev, 4 + t)
    weights = {wname: B.make_weights(torch, sh, wname, dev, 2)[0] for wname in a.dtypes.split(",")}
    for rnd in ("warm-up", "profiled"):  # every dtype warmed up first, then each called once more
        for wname, wts in weights.items():
            out = fused_moe(x, ids, w, e2s, **wts)
            if dev == "cuda":
                torch.cuda.synchronize()
            print(f"{rnd}: {a.shape if not a.dry_run else 'tiny'} {wname} T={t}: out {tuple(out.shape)}, "
                  f"finite {bool(torch.isfinite(out).all())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
