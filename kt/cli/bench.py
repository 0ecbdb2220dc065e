"""`kt bench`: how fast this machine runs one MoE layer's CPU experts, and `kt bench model`: a
whole real-shaped model with random weights, beside llama.cpp (quick checks a user can run; the
benchmark suite is in benchmarks/)."""
from __future__ import annotations

import statistics
import time

from ..config import parse_scheme_name

_SHAPES = {  # E, K, H, I
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "tiny": (16, 4, 256, 128),
}


def _layer(E, H, I, name, seed):
    """A random layer; ``name`` as ``kt.config.parse_scheme_name`` takes it ("int8x2": INT8
    with two-level activations)."""
    import numpy as np

    from ..cpu_ops.moe import CPUMoE

    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((E, I, H), dtype=np.float32) / np.float32(np.sqrt(H))
    up = rng.standard_normal((E, I, H), dtype=np.float32) / np.float32(np.sqrt(H))
    down = rng.standard_normal((E, H, I), dtype=np.float32) / np.float32(np.sqrt(I))
    scheme, acts = parse_scheme_name(name)
    return CPUMoE.from_tensors(gate, up, down, scheme=scheme, activations=acts)


def _run(args) -> int:
    import numpy as np
    from tqdm import tqdm

    from ..cpu_ops.runtime.pool import CpuPool

    if args.shape not in _SHAPES:
        raise ValueError(f"unknown shape {args.shape!r}; choose from {sorted(_SHAPES)}")
    E, K, H, I = _SHAPES[args.shape]
    Ts = [int(t) for t in args.tokens.split(",")]
    if any(t <= 0 for t in Ts):
        raise ValueError(f"--tokens must be positive integers, got {args.tokens!r}")
    pool = CpuPool(args.threads) if args.threads else None
    rng = np.random.default_rng(0)
    print(f"kt bench: {args.shape} (E={E} K={K} H={H} I={I}), {args.copies} weight copies "
          f"(cold weights when their total exceeds the caches), threads: "
          f"{pool.num_threads if pool else 'default pool'}")
    print(f"{'scheme':<7} {'T':>6} {'min ms':>9} {'median ms':>10} {'GB/s':>7} {'tok/s':>9}")
    schemes = args.schemes.split(",")
    for scheme in schemes:
        parse_scheme_name(scheme)  # a bad name fails here, before any layer is built
    for scheme in schemes:
        copies = [_layer(E, H, I, scheme, s) for s in tqdm(range(args.copies), leave=False,
                                                             desc=f"building {scheme} layers")]
        if pool is not None:
            for c in copies:
                c.use_pool(pool)
        per_expert = copies[0].nbytes / E
        for T in Ts:
            x = rng.standard_normal((T, H), dtype=np.float32)
            times, hit = [], []
            for r in range(args.reps + 1):
                ids = np.argsort(rng.random((T, E)), axis=1)[:, :K]
                w = rng.random((T, K), dtype=np.float32)
                t0 = time.perf_counter()
                copies[r % len(copies)](x, ids, w)
                if r:  # the first call compiles / warms up
                    times.append(time.perf_counter() - t0)
                    hit.append(len(np.unique(ids)))
            tmin = min(times)
            gbs = statistics.mean(hit) * per_expert / tmin / 1e9
            print(f"{scheme:<7} {T:>6} {tmin * 1e3:>9.3f} {statistics.median(times) * 1e3:>10.3f} "
                  f"{gbs:>7.1f} {T / tmin:>9.0f}")
            if args.profile:
                _print_profile(copies[0].profile(x, ids, w, repeats=args.reps))
    return 0


def _print_profile(p) -> None:
    """One line per driver phase: its share of the busy time and the time spent waiting at its
    barrier (both summed over the pool's threads, per call)."""
    parts = [f"{name} {100 * v['share']:.0f}% (wait {v['wait_ms']:.2f} ms)"
             for name, v in p["phases"].items() if v["busy_ms"] > 0 or v["wait_ms"] > 0]
    print(f"{'':<7} {'':>6}   phases over {p['threads']} threads: " + ", ".join(parts))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time one MoE layer's CPU experts on this machine",
                              description="Times kt.CPUMoE on a model shape with random weights and "
                                          "uniform routing; prints min/median ms, GB/s of expert "
                                          "weights touched and tokens/s. The full benchmarks, with "
                                          "rooflines and baselines, are in benchmarks/.")
    p.add_argument("--shape", default="qwen3-30b-a3b", help=f"one of {sorted(_SHAPES)}")
    p.add_argument("--schemes", default="int8,int4,bf16",
                   help="comma-separated: int8, int4, bf16, int8x2, int4x2 (x2: two-level "
                        "activations, more accurate)")
    p.add_argument("--tokens", default="1,32,512", help="comma-separated token counts T")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: kt's default pool)")
    p.add_argument("--copies", type=int, default=2, help="weight copies cycled through (default 2)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", action="store_true",
                   help="also print where each call's time goes, per phase of the MoE driver "
                        "(CPUMoE.profile: busy share and barrier wait, summed over threads)")
    p.set_defaults(func=_run)
    sub = p.add_subparsers(dest="what", metavar="{model}")
    m = sub.add_parser("model", help="a whole real-shaped model with random weights (and llama.cpp)",
                       description="Builds a real-shaped MoE model with random weights (a preset or a "
                                   "model directory's config.json; nothing is downloaded, the experts "
                                   "are generated in kt's format and never materialised), then times "
                                   "model.generate as `kt generate` runs it: build time, peak RSS, "
                                   "TTFT, prefill and decode tokens/s, and on the CPU the decode floor "
                                   "(weight bytes read per token / measured bandwidth). With "
                                   "--llama-bench, llama.cpp runs the same shape from a GGUF of random "
                                   "weights (Q8_0 for int8, Q4_0 for int4) on the same threads.")
    m.add_argument("model", nargs="?", default=None, help="a model directory (its config.json)")
    m.add_argument("--config", default=None, help="a preset shape instead of a directory: "
                                                 "qwen3-30b-a3b")
    m.add_argument("--layers", type=int, default=None, help="decoder layers to build (default: all)")
    m.add_argument("--scheme", default="int8", choices=("int8", "int4"), help="the experts' scheme")
    m.add_argument("--dense-scheme", default="auto", help="auto, torch, int8, int4 or bf16 "
                                                          "(see PatchConfig.dense_scheme)")
    m.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    m.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    m.add_argument("--decode", type=int, default=32, help="tokens to decode (default 32)")
    m.add_argument("--reps", type=int, default=3, help="timed runs; the median is reported")
    m.add_argument("--threads", type=int, default=None, help="CPU threads (default: kt's default pool)")
    m.add_argument("--llama-bench", default=None, metavar="PATH",
                   help="a llama-bench binary: run llama.cpp on the same shape and threads")
    m.add_argument("--gguf-dir", default=None, help="where the temporary GGUF goes (default: /tmp)")
    m.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=_run_model)


def _run_model(args) -> int:
    from ..hf.bench import bench_model, save, table

    if (args.model is None) == (args.config is None):
        raise ValueError("give a model directory or --config PRESET (one of them)")
    for name in ("prompt", "decode", "reps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    res = bench_model(args.model or args.config, layers=args.layers, scheme=args.scheme,
                      dense_scheme=args.dense_scheme, device=args.device, prompt=args.prompt,
                      decode=args.decode, reps=args.reps, threads=args.threads,
                      llama_bench=args.llama_bench, gguf_dir=args.gguf_dir, seed=args.seed)
    print(table(res))
    if args.json:
        save(res, args.json)
    return 0
