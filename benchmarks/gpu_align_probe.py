#!/usr/bin/env python3
"""The slot alignment at decode sizes: one program with atomics (``align_small_kernel``, kt's path
for N <= 1024 until session 16) against one without (``align_onehot_kernel``) at 1, 2, 4 and 8
warps, alone and inside ``fused_moe``; for one device call.

The sorted path runs four launches at decode T > 1 (alignment, gate+up, down, combine). At qwen3
int8 T=64 the two GEMMs took 52 of the op's 67 us (Nsight Compute, session 15) and the alignment
alone ~10 us in a graph (session 13): its one program zeroes counters, counts with atomics, reads
them back behind a barrier, then places every token-slot with a returning atomic, so most of its
time is serial round trips to L2. The one-hot kernel keeps counts and ranks in registers.

Every variant's layout is checked against the others (same rows in use, the same token-slots in
each slot's blocks), and each op's output against the other alignment's, bit for bit (a row's dot
products do not depend on the other rows of its tile), and against the fp32 reference. Timings are
CUDA-graph replays with L2 flushed (triton's do_bench), min / median of interleaved rounds; the op
as a fraction of the HBM copy bandwidth for the touched slots' weights, as gpu_decode_floor.py.

    PYTHONPATH=. python3 benchmarks/gpu_align_probe.py --out $OUT       (~1 min on the H200)
    python3 benchmarks/gpu_align_probe.py --dry-run                      (interpreter: checks only)
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_gpu as B  # noqa: E402  (shapes, weights, routing, graph capture, ceilings)
from _results import write_json  # noqa: E402
from gpu_a8_probe import _align_layout, probe_setup  # noqa: E402

WARPS = (1, 2, 4, 8)
# (label, (E, K, GPU slots), T, rows per block)
ALIGN_CASES = ([("qwen3-30b-a3b", (128, 8, 32), t, 16) for t in (2, 7, 16, 64, 128)]
               + [("qwen3-30b-a3b", (128, 8, 32), 64, 32)]
               + [("qwen3-30b-a3b-all-gpu", (128, 8, 128), t, 16) for t in (2, 7, 32)]
               + [("mixtral-8x7b", (8, 2, 4), t, bm) for t, bm in ((7, 16), (64, 16), (512, 64))])
ALIGN_DRY_CASES = [("tiny", (8, 2, 4), 33, 16), ("tiny", (20, 3, 17), 9, 32)]
OP_T = (7, 64)  # the decode T that take the sorted path (T * K > DIRECT_MAX_N)
OP_WARPS = (2, 4)


def _paths(M):
    """(name, context forcing that alignment) for every variant."""
    out = [("one_program", lambda: M._forced_align("one_program"))]
    for w in WARPS:
        def ctx(w=w):
            import contextlib

            stack = contextlib.ExitStack()
            stack.enter_context(M._forced_align("onehot"))
            stack.enter_context(M._overriding(_ALIGN_ONEHOT_WARPS=w))
            return stack
        out.append((f"onehot_w{w}", ctx))
    return out


def main(argv=None):
    a, do_bench, dev, ceilings = probe_setup(__doc__, argv)
    dry = a.dry_run
    import torch

    from kt import reference as R
    from kt.gpu_ops import fused_moe
    from kt.gpu_ops import moe as M

    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"align": [], "op": [], "ceilings": ceilings}
    paths = dict(_paths(M))

    def replay(fn):
        if dry:
            return fn
        g, _ = B.graph_of(torch, fn)
        torch.cuda.synchronize()
        return g.replay

    for label, (e, k, ns), t, bm in (ALIGN_DRY_CASES if dry else ALIGN_CASES):
        sh = dict(E=e, K=k, S=ns)
        e2s = B.make_e2s(torch, sh, dev, 3)
        ids, _ = B.make_routing(torch, sh, t, e2s, dev, 5 + t)
        n = ids.numel()
        case = dict(shape=label, E=e, K=k, S=ns, T=t, N=n, block_m=bm, variants={})
        graphs, ref = {}, None
        for name, ctx in paths.items():
            with ctx():  # (the path is fixed when the graph is captured)
                lay = _align_layout(torch, M.align_by_slot(ids, e2s, ns, bm), n, bm)
                ref = ref or lay
                assert lay == ref, (label, t, name)
                graphs[name] = replay(lambda: M.align_by_slot(ids, e2s, ns, bm))
        for name, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry).items():
            case["variants"][name] = dict(min_us=mn, median_us=md)
        res["align"].append(case)
        print(f"align {label} T={t} N={n} S={ns} block_m={bm}: " + ", ".join(
            f"{k_} {v['min_us']:.1f}" for k_, v in case["variants"].items()) + " us", flush=True)
        del graphs

    bw = None if dry else ceilings["hbm_bytes_per_s"]
    op_paths = ["one_program"] + [f"onehot_w{w}" for w in OP_WARPS]
    for name, sh in (B.DRY_SHAPES if dry else B.SHAPES).items():
        e2s = B.make_e2s(torch, sh, dev, 1)  # (the seeds of gpu_decode_floor.py)
        for dtype in ("bf16", "int8"):
            wts, (w13f, w2f) = B.make_weights(torch, sh, dtype, dev, 2)
            per_slot = sum(wts[n_].numel() * wts[n_].element_size() for n_ in ("w13", "w2")) // sh["S"]
            for t in ((9,) if dry else OP_T):
                gx = torch.Generator(device=dev).manual_seed(3 + t)
                x = torch.randn(t, sh["H"], device=dev, generator=gx).to(torch.bfloat16)
                ids, w = B.make_routing(torch, sh, t, e2s, dev, 4 + t)
                slots = torch.where(ids >= 0, e2s[ids.clamp(min=0)], -1)
                nbytes = per_slot * len(set(int(s) for s in slots.flatten().tolist() if s >= 0))
                ref = B.ref_gpu(torch, x, ids, w, e2s, w13f, w2f)
                case = dict(shape=name, dtype=dtype, T=t, bytes=nbytes, variants={})
                graphs, first = {}, None
                for p in op_paths:
                    with paths[p]():
                        out = fused_moe(x, ids, w, e2s, **wts)
                        first = out if first is None else first
                        assert torch.equal(out, first), (name, dtype, t, p, "differs from", op_paths[0])
                        graphs[p] = replay(lambda: fused_moe(x, ids, w, e2s, **wts))
                case["rel_err"] = float(R.relative_error(first, ref))
                assert case["rel_err"] <= 1e-2, case
                for p, (mn, md) in B.interleaved_us(do_bench, graphs, a.rounds, dry, rep=60).items():
                    v = dict(min_us=mn, median_us=md)
                    if not dry:
                        v["hbm_frac"] = nbytes / (mn * 1e-6) / bw
                    case["variants"][p] = v
                res["op"].append(case)
                print(f"fused_moe {name} {dtype} T={t} ({nbytes / 1e6:.1f} MB, rel err {case['rel_err']:.1e}): "
                      + ", ".join(f"{p} {v['min_us']:.1f} us" + (f" ({100 * v['hbm_frac']:.1f} %)" if not dry else "")
                                  for p, v in case["variants"].items()), flush=True)
                del graphs
            del wts
            if not dry:
                torch.cuda.empty_cache()
    print(f"wrote {write_json(a.out, 'gpu_align_probe.json', res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
