"""Side-by-side CUDA-graph timings of fused_moe configs on qwen3-30b-a3b shapes (H200).

For each (T, weight dtype): the config before session 8's TMA / flattened-loop switches ("old"), the
same with weight tiles through TMA descriptors ("tma"), with the down loop flattened too
("tma+dflat"), and the default (the tuned table's entry). 32 GPU slots as bench_gpu.py, L2 flushed
before every replay, rounds interleaved; min and median us per config, written to JSON.
Device:  PYTHONPATH=. python3 benchmarks/gpu_config_ab.py --out $OUT
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kt.gpu_ops import fused_moe  # noqa: E402
from kt.gpu_ops.configs import MoEConfig  # noqa: E402

E, K, H, I, S = 128, 8, 2048, 768, 32
# the configs the tuned table held before session 8 (sorted path, per T and weight dtype)
OLD = {(4096, "bf16"): ((128, 128, 64, 8, 8, 4), dict(down_block_n=256, down_block_k=64, down_group_m=8,
                                                      down_num_warps=8, down_num_stages=3)),
       (4096, "int8"): ((128, 64, 64, 8, 4, 4), dict(down_block_n=128, down_block_k=64, down_group_m=8,
                                                     down_num_warps=4, down_num_stages=4)),
       (512, "bf16"): ((64, 32, 64, 8, 4, 4), dict(down_block_n=128, down_block_k=64, down_group_m=8,
                                                   down_num_warps=8, down_num_stages=4))}


def case(T, wd, rounds):
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)])
    w = torch.rand(T, K, device="cuda")
    e2s = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    e2s[:S] = torch.arange(S, dtype=torch.int32, device="cuda")
    kw = {}
    if wd == "int8":
        w13 = torch.randint(-127, 128, (S, 2 * I, H), device="cuda", dtype=torch.int8)
        w2 = torch.randint(-127, 128, (S, H, I), device="cuda", dtype=torch.int8)
        kw = dict(w13_scale=torch.rand(S, 2 * I, device="cuda") / (127 * H ** 0.5),
                  w2_scale=torch.rand(S, H, device="cuda") / (127 * I ** 0.5))
    else:
        w13 = (torch.randn(S, 2 * I, H, device="cuda") / H ** 0.5).bfloat16()
        w2 = (torch.randn(S, H, I, device="cuda") / I ** 0.5).bfloat16()
    base, down = OLD[(T, wd)]
    cf = {"old": MoEConfig(*base, **down), "tma": MoEConfig(*base, tma=True, **down),
          "tma+dflat": MoEConfig(*base, tma=True, down_flatten=True, **down), "default": None}
    ref = fused_moe(x, ids, w, e2s, w13, w2, config=cf["old"], **kw).float()
    graphs, diff = {}, {}
    for n, c in cf.items():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                o = fused_moe(x, ids, w, e2s, w13, w2, config=c, **kw)
        torch.cuda.current_stream().wait_stream(s)
        diff[n] = float((o.float() - ref).norm() / ref.norm())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fused_moe(x, ids, w, e2s, w13, w2, config=c, **kw)
        graphs[n] = g
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    res = {n: [] for n in cf}
    for _ in range(rounds):
        for n, g in graphs.items():
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            res[n].append(a.elapsed_time(b) * 1e3)
    rows = []
    for n, v in res.items():
        rows.append(dict(T=T, weights=wd, config=n, min_us=min(v), med_us=statistics.median(v),
                         rel_diff_vs_old=diff[n]))
        print(f"T={T} {wd} {n:10s} min {min(v):7.1f} us  med {statistics.median(v):7.1f}  "
              f"diff vs old {diff[n]:.1e}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--cases", default="4096:bf16,4096:int8,512:bf16")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for c in a.cases.split(","):
        t, wd = c.split(":")
        rows += case(int(t), wd, a.rounds)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "gpu_config_ab.json").write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
