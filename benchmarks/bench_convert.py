"""Conversion and load throughput of kt.weights for a qwen3-30b-a3b-shaped MoE layer.

Source: one bf16 safetensors file holding one MoE layer (E=128 experts, H=2048, I=768, per-expert
``mlp.experts.{e}.{gate,up,down}_proj.weight`` tensors: 1.21 GB), in the page cache (read once
before timing). Conversion is file to file: mapped source -> quantise + pack (Numba, nogil, one
expert per thread) -> memory-mapped temp file -> checksum -> rename, manifest written; no fsync
(the writes end in the page cache). GB/s counts bf16 source bytes per second.

Load: ``kt.weights.load_experts`` of the converted layer with its page cache warm, three ways:
``verify=False`` (mmap + header checks only: no page is touched), ``verify=False`` followed by
one read pass over every byte (an OR-reduction over uint64 words), and the default
``verify=True`` (the checksum reads every byte). GB/s counts converted-file bytes.

    python benchmarks/bench_convert.py              # writes benchmarks/results/<machine>/convert.json
    python benchmarks/bench_convert.py --quick      # E=16, for a smoke run (written only with --out)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import add_out_arguments, out_dir, write_result  # noqa: E402


def make_source(root: Path, E: int, H: int, I: int) -> Path:
    """A qwen3_moe checkpoint directory with one MoE layer of random bf16 experts."""
    from kt import reference as ref
    from kt.weights._safetensors_io import write_safetensors

    src = root / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
        "num_hidden_layers": 1, "num_experts": E, "moe_intermediate_size": I}))
    rng = np.random.default_rng(0)
    tensors = {}
    for e in range(E):
        for p, shp in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors[f"model.layers.0.mlp.experts.{e}.{p}.weight"] = (shp, np.dtype(np.uint16))

    def fill(sink):
        for name, v in sink.arrays.items():
            w = rng.standard_normal(v.shape, dtype=np.float32) / np.sqrt(v.shape[1])
            v[...] = ref.f32_to_bf16_bits(w)

    write_safetensors(src / "model.safetensors", tensors, fill,
                      st_dtypes={k: "BF16" for k in tensors})
    return src


def read_all(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def touch(le) -> int:
    acc = 0
    for p in (le.w13, le.w2):
        for a in (p.data, p.scale, p.wsum):
            if a.size:
                flat = a.reshape(-1).view(np.uint8)
                n8 = flat.size // 8 * 8
                acc ^= int(np.bitwise_or.reduce(flat[:n8].view(np.uint64)))
    return acc


def best_of(fn, reps: int, cpu: bool = False, setup=None):
    """min wall seconds over reps (and, with cpu=True, min process CPU seconds: all threads)."""
    ts, cs = [], []
    for _ in range(reps):
        if setup is not None:
            setup()
        c = time.process_time()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        cs.append(time.process_time() - c)
    return (min(ts), min(cs)) if cpu else min(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    add_out_arguments(ap)
    args = ap.parse_args(argv)
    from kt.weights import convert, load_experts
    from kt.weights._format import file_checksum

    E, H, I = (16 if args.quick else 128), 2048, 768
    root = Path(tempfile.mkdtemp(prefix="kt-bench-convert-"))
    rows = []
    try:
        src = make_source(root, E, H, I)
        src_bytes = (src / "model.safetensors").stat().st_size
        read_all(src / "model.safetensors")
        # compile the kernels outside the timing (cached on disk after the first run)
        convert(src, root / "warm", "int4", 64, threads=args.threads, progress=False)
        convert(src, root / "warm8", "int8", threads=args.threads, progress=False, force=True)
        convert(src, root / "warmb", "bf16", threads=args.threads, progress=False, force=True)
        for scheme, g in (("int8", 0), ("int4", 64), ("bf16", 0)):
            out = root / f"out-{scheme}"

            def run():
                convert(src, out, scheme, g or 64, threads=args.threads, progress=False)

            t_conv, c_conv = best_of(run, args.reps, cpu=True,
                                     setup=lambda: shutil.rmtree(out, ignore_errors=True))
            f = out / "layer_00000.safetensors"
            out_bytes = f.stat().st_size
            t_ck = best_of(lambda: file_checksum(f, args.threads), args.reps)
            t_map = best_of(lambda: load_experts(out, 0, verify=False), args.reps)
            t_touch = best_of(lambda: touch(load_experts(out, 0, verify=False)), args.reps)
            t_ver, c_ver = best_of(lambda: load_experts(out, 0), args.reps, cpu=True)
            rows.append({
                "scheme": scheme + (f" G={g}" if g else ""), "E": E, "H": H, "I": I,
                "threads": args.threads, "source_bytes": src_bytes, "output_bytes": out_bytes,
                "convert_s": t_conv, "convert_GBps_bf16_in": src_bytes / t_conv / 1e9,
                "layers_per_s": 1 / t_conv,
                "convert_cpu_s": c_conv, "convert_GBps_per_cpu_second": src_bytes / c_conv / 1e9,
                "checksum_GBps": out_bytes / t_ck / 1e9,
                "load_mmap_only_ms": t_map * 1e3,
                "load_touch_GBps": out_bytes / t_touch / 1e9,
                "load_verify_GBps": out_bytes / t_ver / 1e9,
                "load_verify_GBps_per_cpu_second": out_bytes / c_ver / 1e9,
            })
            print(json.dumps(rows[-1]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    meta = {"cpu": platform.processor() or platform.machine(), "cpus": len(os.sched_getaffinity(0)),
            "load_average_1min_at_end": os.getloadavg()[0],
            "note": f"best of {args.reps}; page cache warm; no fsync", "quick": args.quick}
    if not args.quick or args.out:
        print(f"wrote {write_result(out_dir(args), 'convert', {'meta': meta, 'rows': rows}, args.machine)}")
    lines = [f"# kt convert: qwen3-30b-a3b-shaped layer (E={E}, H={H}, I={I}), bf16 safetensors -> kt",
             "", f"{meta['note']}; {args.threads} threads; 1-minute load average at the end "
             f"{meta['load_average_1min_at_end']:.1f} on {meta['cpus']} CPUs.", "",
             "| scheme | bf16 in | out | convert (wall) | GB/s (bf16 in, wall) | layers/s | CPU s (all threads) | "
             "GB/s per CPU-second | checksum GB/s | load, mmap only | load + touch every page | "
             "load with verify (default) | verify GB/s per CPU-second |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['source_bytes'] / 1e9:.2f} GB | {r['output_bytes'] / 1e9:.2f} GB | "
                     f"{r['convert_s']:.3f} s | {r['convert_GBps_bf16_in']:.2f} | {r['layers_per_s']:.2f} | "
                     f"{r['convert_cpu_s']:.3f} | {r['convert_GBps_per_cpu_second']:.2f} | "
                     f"{r['checksum_GBps']:.1f} | {r['load_mmap_only_ms']:.2f} ms | "
                     f"{r['load_touch_GBps']:.1f} GB/s | {r['load_verify_GBps']:.1f} GB/s | "
                     f"{r['load_verify_GBps_per_cpu_second']:.1f} |")
    lines += ["", "GB/s per CPU-second = bf16 bytes / (process CPU time of all threads): what one "
              "uncontended core converts; wall-clock figures depend on how busy the shared machine was.",
              "", "Targets: convert >= 1.5 GB/s of bf16 input on 2 cores (kt-kernel's online "
              "conversion ~1.2 GB/s with 2 threads); load >= 5 GB/s (page cache warm)."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
