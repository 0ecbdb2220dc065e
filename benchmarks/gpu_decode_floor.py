#!/usr/bin/env python3
"""How close any kernel can come to the HBM bandwidth at decode T (T <= 64), beside kt's fused_moe.

At decode sizes the GPU experts read a few to a few hundred MB, and a kernel's launch and first
memory round trips are a large part of that: this measures the floor a single- or two-launch
MoE kernel could reach for exactly the bytes fused_moe reads. For the shapes, slot maps and
routing of bench_gpu.py (bf16 and int8 weights, T in 1, 2, 7, 64), each
timed as a CUDA-graph replay with L2 flushed (triton's do_bench, as bench_gpu.py does), min and
median of interleaved rounds:
- empty: one launch of a kernel that does nothing: the timing method's own floor;
- read1: one kernel reading exactly the touched slots' weights (w13 and w2) with wide vector loads,
  each program summing its chunk: what a single-pass MoE kernel could do at best;
- read2: the same bytes in two dependent launches, w13's then w2's: the floor of any MoE whose down
  GEMM needs the whole intermediate h (two launches, or a grid-wide barrier);
- read1cvt (int8 weights): read1 with every byte converted to bf16, as the int8 GEMMs convert their
  weight tiles: whether the conversion alone keeps a kernel from the bandwidth;
- fused_moe: kt's op with the shipped config.
Fractions are of the HBM bandwidth measured in the same run (a 4 GiB device copy, read + written
bytes, as bench_gpu.py) and of a 4 GiB read by the read kernel.

    PYTHONPATH=. python3 benchmarks/gpu_decode_floor.py           (a GPU host)
    python3 benchmarks/gpu_decode_floor.py --dry-run --out /tmp/f     (interpreter: checks only)
Writes benchmarks/results/<machine>/gpu_decode_floor.json (see _results.py; a dry run only with --out).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _gpu_cases as B  # noqa: E402  (the shapes, weights, routing and graph capture of bench_gpu.py)
from _results import add_out_arguments, out_dir, write_result  # noqa: E402

CHUNKS = (1024, 4096)  # int32 words per program (4 KiB, 16 KiB)
DRY_CHUNKS = (128, 256)  # the dry run's tiny shape has 512-word slot regions


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def empty_kernel(out_ptr):
        pass

    @triton.jit
    def read_kernel(base_ptr, starts_ptr, out_ptr, CHUNK: tl.constexpr, CVT: tl.constexpr = False):
        """out[p] = sum of the CHUNK int32 words at starts[p]. CVT: base_ptr is the same bytes as
        int8, each converted to bf16 as the int8 GEMMs convert their weight tiles."""
        p = tl.program_id(0)
        start = tl.multiple_of(tl.load(starts_ptr + p), CHUNK)
        if CVT:
            v = tl.load(base_ptr + 4 * start + tl.arange(0, 4 * CHUNK)).to(tl.bfloat16)
            tl.store(out_ptr + p, tl.sum(v, 0).to(tl.int32))
        else:
            v = tl.load(base_ptr + start + tl.arange(0, CHUNK))
            tl.store(out_ptr + p, tl.sum(v, 0))

    return empty_kernel, read_kernel


def _starts(torch, slots, words_per_slot, chunk, dev):
    """int64 start offsets (in int32 words) of every chunk of the given slots' regions."""
    assert words_per_slot % chunk == 0, (words_per_slot, chunk)
    per = torch.arange(0, words_per_slot, chunk, dtype=torch.int64)
    return torch.cat([s * words_per_slot + per for s in slots]).to(dev)


def _ceilings(torch, do_bench, read_kernel, dev):
    """A 4 GiB device copy (read + written bytes per second) and a 4 GiB read by read_kernel."""
    n_bytes = 4 << 30
    src = torch.empty(n_bytes // 4, dtype=torch.int32, device=dev).random_(0, 1 << 20)
    dst = torch.empty_like(src)
    ms_copy = do_bench(lambda: dst.copy_(src), warmup=10, rep=100, return_mode="median")
    starts = torch.arange(0, src.numel(), 4096, dtype=torch.int64, device=dev)
    part = torch.empty(starts.numel(), dtype=torch.int32, device=dev)
    ms_read = do_bench(lambda: read_kernel[(starts.numel(),)](src, starts, part, CHUNK=4096, num_warps=8),
                       warmup=10, rep=100, return_mode="median")
    return dict(copy_bytes_per_s=2 * n_bytes / (ms_copy * 1e-3), read_bytes_per_s=n_bytes / (ms_read * 1e-3))


def _read_fns(torch, read_kernel, w13w, w2w, S, touched, chunks, dev, keep, cvt):
    """{name: fn} of the read kernels over the touched slots' words (see the module docstring); cvt
    (int8 weights): also read1cvt, the one-launch read with every byte converted to bf16."""
    n13, n2 = w13w.numel() // S, w2w.numel() // S
    fns = {}
    for chunk in chunks:
        s13 = _starts(torch, touched, n13, chunk, dev)
        s2 = _starts(torch, touched, n2, chunk, dev)
        # one launch: the touched slots' w13 and w2 words copied side by side
        flat = torch.cat([w13w.view(S, n13)[touched].reshape(-1), w2w.view(S, n2)[touched].reshape(-1)])
        st = torch.arange(0, flat.numel(), chunk, dtype=torch.int64, device=dev)
        parts = [torch.empty(v.numel(), dtype=torch.int32, device=dev) for v in (s13, s2, st, st)]
        keep += [s13, s2, flat, st, parts[3], *parts[:3]]  # the dry run reads the last three
        for nw in (4, 8):
            def two(s13=s13, s2=s2, parts=parts, chunk=chunk, nw=nw):
                read_kernel[(s13.numel(),)](w13w, s13, parts[0], CHUNK=chunk, num_warps=nw)
                read_kernel[(s2.numel(),)](w2w, s2, parts[1], CHUNK=chunk, num_warps=nw)

            def one(flat=flat, st=st, parts=parts, chunk=chunk, nw=nw):
                read_kernel[(st.numel(),)](flat, st, parts[2], CHUNK=chunk, num_warps=nw)

            def one_cvt(flat=flat, st=st, parts=parts, chunk=chunk, nw=nw):
                read_kernel[(st.numel(),)](flat.view(torch.int8), st, parts[3], CHUNK=chunk, CVT=True,
                                           num_warps=nw)

            fns[f"read1_c{chunk}_w{nw}"] = one
            fns[f"read2_c{chunk}_w{nw}"] = two
            if cvt:
                fns[f"read1cvt_c{chunk}_w{nw}"] = one_cvt
    return fns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_arguments(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU under the Triton interpreter, no timings (checks the flow)")
    a = ap.parse_args(argv)
    dry = a.dry_run
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from triton.testing import do_bench

    from kt import reference as R
    from kt.gpu_ops import fused_moe

    torch.backends.cuda.matmul.allow_tf32 = False

    empty_kernel, read_kernel = _kernels()
    dev = "cpu" if dry else "cuda"
    res = {"cases": []}
    res.update(dict(copy_bytes_per_s=1e12, read_bytes_per_s=1e12) if dry
               else _ceilings(torch, do_bench, read_kernel, dev))
    bw_copy, bw_read = res["copy_bytes_per_s"], res["read_bytes_per_s"]
    print(f"HBM: copy {bw_copy / 1e12:.2f} TB/s, read {bw_read / 1e12:.2f} TB/s", flush=True)
    sink = torch.zeros(1, dtype=torch.int32, device=dev)

    def capture(key, fn):
        if dry:
            return fn
        try:
            g, _ = B.graph_of(torch, fn)
            torch.cuda.synchronize()  # a fault shows here, named
        except Exception:
            print(f"capturing {key} failed", flush=True)
            raise
        return g.replay

    for name, sh in (B.DRY_SHAPES if dry else B.SHAPES).items():
        e2s = B.make_e2s(torch, sh, dev, 1)
        for dtype in ("bf16", "int8"):
            wts, (w13f, w2f) = B.make_weights(torch, sh, dtype, dev, 2)
            w13w = wts["w13"].reshape(-1).view(torch.int32)
            w2w = wts["w2"].reshape(-1).view(torch.int32)
            nwords = (w13w.numel() + w2w.numel()) // sh["S"]
            for t in ((1, 7) if dry else (1, 2, 7, 64)):
                gx = torch.Generator(device=dev).manual_seed(3 + t)
                x = torch.randn(t, sh["H"], device=dev, generator=gx).to(torch.bfloat16)
                ids, w = B.make_routing(torch, sh, t, e2s, dev, 4 + t)
                touched = B.touched_slots(B.gpu_slots(torch, ids, e2s))
                nbytes = 4 * len(touched) * nwords
                keep = []
                fns = {"empty": lambda: empty_kernel[(1,)](sink)}
                fns.update(_read_fns(torch, read_kernel, w13w, w2w, sh["S"], touched,
                                     DRY_CHUNKS if dry else CHUNKS, dev, keep, dtype == "int8"))
                fns["fused_moe"] = lambda: fused_moe(x, ids, w, e2s, **wts)
                if dry:  # the read kernels' (wrapping int32) sums against torch's, mod 2**32
                    for fn in fns.values():
                        fn()
                    want = torch.cat([w13w.view(sh["S"], -1)[touched].reshape(-1),
                                      w2w.view(sh["S"], -1)[touched].reshape(-1)]).to(torch.int64).sum()
                    p13, p2, pf = keep[-3:]  # the last chunk size's partial sums: read2's two, read1's

                    def total(*ps):
                        return sum(int(p.to(torch.int64).sum()) for p in ps) % (1 << 32)

                    assert total(p13, p2) == total(pf) == int(want) % (1 << 32), (name, dtype, t)
                reps = {k: capture(k, fn) for k, fn in fns.items()}
                stats = B.interleaved_us(do_bench, reps, a.rounds, dry, rep=60)
                # the op with the shipped config against the fp32 spec (TF32 off), as bench_gpu.py
                err = float(R.relative_error(fused_moe(x, ids, w, e2s, **wts), B.ref_gpu(torch, x, ids, w, e2s,
                                                                                       w13f, w2f)))
                case = dict(shape=name, dtype=dtype, T=t, touched_slots=len(touched), bytes=nbytes,
                            fused_moe_rel_err=err, fused_moe_correct=err <= 1e-2)
                for k, (mn, md) in stats.items():
                    case[k] = dict(min_us=round(mn, 2), median_us=round(md, 2),
                                   hbm_copy_frac=round(nbytes / (mn * 1e-6) / bw_copy, 3),
                                   hbm_read_frac=round(nbytes / (mn * 1e-6) / bw_read, 3))
                for kind in ("read1_", "read2_", "read1cvt_"):
                    names = [k for k in case if k.startswith(kind)]
                    if names:
                        case[f"{kind[:-1]}_best"] = min(names, key=lambda k: case[k]["min_us"])
                res["cases"].append(case)
                r1, r2, fm = case[case["read1_best"]], case[case["read2_best"]], case["fused_moe"]
                print(f"{name} {dtype} T={t}: {len(touched)} slots, {nbytes / 1e6:.1f} MB (bandwidth time "
                      f"{nbytes / bw_copy * 1e6:.1f} us): empty {case['empty']['min_us']:.1f} us, "
                      f"read1 {r1['min_us']:.1f} ({100 * r1['hbm_copy_frac']:.0f} %), "
                      f"read2 {r2['min_us']:.1f} ({100 * r2['hbm_copy_frac']:.0f} %), "
                      f"fused_moe {fm['min_us']:.1f} ({100 * fm['hbm_copy_frac']:.0f} %, rel err {err:.1e})"
                      + (f", read1 with the int8 -> bf16 conversion {case[case['read1cvt_best']]['min_us']:.1f}"
                         if "read1cvt_best" in case else ""), flush=True)
                del reps, fns, keep
            if not dry:
                torch.cuda.empty_cache()
    if not dry or a.out:
        print(f"wrote {write_result(out_dir(a), 'gpu_decode_floor', res, a.machine)}")
    bad = [c for c in res["cases"] if not c["fused_moe_correct"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
