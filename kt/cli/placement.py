"""`kt placement`: record activation statistics, plan a placement, show one (with a heatmap)."""
from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

_DEFAULT_PROMPTS = [
    "Explain how a mixture-of-experts language model decides which experts to use.",
    "Write a short story about a lighthouse keeper who finds a map.",
    "def quicksort(xs):",
    "List three differences between CPUs and GPUs.",
]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "placement", help="expert placement: record statistics, plan, show",
        description="Decide which experts run on the GPU (hot) and which on the CPU (cold).")
    sub = p.add_subparsers(dest="placement_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    r = sub.add_parser("record", help="record activation statistics (from a routing trace or synthetic)",
                       description="Write activation statistics [L, E] (.npz or .json). Sources: a routing "
                                   "trace file (--trace: topk_ids [L, T, K] in .npz/.npy/.pt), or synthetic "
                                   "Zipf routing (--synthetic), or a Hugging Face MoE model run over "
                                   "prompts (--model, needs kt[hf]; its experts run on kt, its router "
                                   "as the model defines it).")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", metavar="FILE", help="routing trace: topk_ids [L, T, K] (.npz key "
                     "'topk_ids', optional 'topk_weights'; .npy; .pt tensor or dict)")
    src.add_argument("--synthetic", action="store_true", help="generate Zipf-like routing")
    src.add_argument("--model", metavar="PATH", help="a local HF MoE model directory to run over prompts")
    r.add_argument("--prompts", metavar="FILE", help="--model: one prompt per line (default: a few built-in)")
    r.add_argument("--max-new-tokens", type=int, default=0,
                   help="--model: also generate this many tokens per prompt (decode routing)")
    r.add_argument("--scheme", default="int8", choices=["bf16", "int8", "int4"],
                   help="--model: how kt stores the experts while recording (default int8)")
    r.add_argument("-o", "--output", required=True, metavar="FILE", help="statistics file (.npz or .json)")
    r.add_argument("--weighted", action="store_true", help="weight each token-slot by its router weight")
    r.add_argument("--layers", type=int, default=24, help="synthetic: layers L (default 24)")
    r.add_argument("--experts", type=int, default=None,
                   help="experts E (synthetic default 64; for a trace default: largest id + 1)")
    r.add_argument("--top-k", type=int, default=8, help="synthetic: top-k K (default 8)")
    r.add_argument("--tokens", type=int, default=4096, help="synthetic: tokens T (default 4096)")
    r.add_argument("--alpha", type=float, default=1.0, help="synthetic: Zipf exponent (default 1.0)")
    r.add_argument("--phases", type=int, default=1, help="synthetic: spans with new hot experts (default 1)")
    r.add_argument("--seed", type=int, default=0, help="synthetic: seed (default 0)")
    r.add_argument("--name", default=None, help="model name stored with the statistics")
    r.add_argument("--trust-pickle", action="store_true", help="allow .pt files holding Python objects")
    r.set_defaults(func=_record)

    q = sub.add_parser("plan", help="plan a placement from statistics and a budget",
                       description="Write a placement JSON for a budget and a strategy.")
    shape = q.add_mutually_exclusive_group(required=True)
    shape.add_argument("--stats", metavar="FILE",
                       help="statistics: kt .npz/.json, SGLang expert-distribution .pt, or an [L, E] array")
    shape.add_argument("--shape", nargs=2, type=int, metavar=("L", "E"),
                       help="layers and experts, for strategies that need no statistics")
    q.add_argument("--budget", required=True,
                   help="'24GiB' (VRAM; needs --expert-bytes or --hidden/--intermediate), '25%%' or 0.25 "
                        "(ratio of all experts), '8/layer', or a total count like 96")
    q.add_argument("--strategy", default="frequency",
                   choices=["frequency", "uniform", "front-loading", "random"], help="default: frequency")
    q.add_argument("--expert-bytes", type=int, metavar="N", help="GPU bytes of one expert")
    q.add_argument("--hidden", type=int, metavar="H", help="hidden size (to compute expert bytes)")
    q.add_argument("--intermediate", type=int, metavar="I", help="expert intermediate size")
    q.add_argument("--dtype", default="bf16", help="GPU dtype of experts: bf16 fp16 fp32 fp8 int8 int4")
    q.add_argument("--reserve", default="0", metavar="BYTES",
                   help="bytes kept free out of a byte budget (KV cache), e.g. 4GiB")
    q.add_argument("--moe-layers", metavar="LIST", help="layers that have experts, e.g. 3-60 (default all)")
    q.add_argument("--seed", type=int, default=42, help="seed of the random strategy (default 42)")
    q.add_argument("--name", default=None, help="model name stored in the placement")
    q.add_argument("--trust-pickle", action="store_true", help="allow .pt files holding Python objects")
    q.add_argument("-o", "--output", required=True, metavar="FILE", help="placement JSON to write")
    q.set_defaults(func=_plan)

    s = sub.add_parser("show", help="summary table of a placement, optionally a heatmap PNG")
    s.add_argument("placement", help="placement JSON")
    s.add_argument("--stats", metavar="FILE", help="statistics for hit rates and the heatmap")
    s.add_argument("--png", metavar="OUT", help="write a heatmap (layers x experts) to this PNG")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")
    s.add_argument("--trust-pickle", action="store_true", help="allow .pt files holding Python objects")
    s.set_defaults(func=_show)


# ---------------------------------------------------------------------------- record

def _load_trace(path: Path, trust_pickle: bool):
    """topk_ids [L, T, K] int and topk_weights [L, T, K] float or None."""
    import numpy as np

    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    suffix = path.suffix.lower()
    ids = w = None
    if suffix == ".npy":
        ids = np.load(path, allow_pickle=False)
    elif suffix == ".npz":
        from kt.placement._stats import read_npz

        z = read_npz(path)
        if "topk_ids" not in z:
            raise ValueError(f"{path}: expected an array named 'topk_ids' (found {list(z)})")
        ids, w = z["topk_ids"], z.get("topk_weights")
    elif suffix in (".pt", ".pth"):
        from kt.placement._stats import _torch_load

        obj = _torch_load(path, trust_pickle)
        if isinstance(obj, dict):
            if "topk_ids" not in obj:
                raise ValueError(f"{path}: expected a tensor or a dict with 'topk_ids' (found {list(obj)})")
            ids, w = obj["topk_ids"], obj.get("topk_weights")
        else:
            ids = obj
        ids = ids.numpy() if hasattr(ids, "numpy") else np.asarray(ids)
        w = w.float().numpy() if hasattr(w, "numpy") else (None if w is None else np.asarray(w))
    else:
        raise ValueError(f"{path}: a routing trace is .npz, .npy or .pt, not {suffix!r}")
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{path}: topk_ids must be integers of shape [L, T, K], found {ids.dtype} {ids.shape}")
    if w is not None and w.shape != ids.shape:
        raise ValueError(f"{path}: topk_weights shape {w.shape} != topk_ids shape {ids.shape}")
    return ids, w


def _record_model(args) -> int:
    import torch

    from kt.hf import PatchConfig
    from kt.hf.run import load_model
    from kt.hf.stats import moe_layers, record_routing
    from kt.placement import ExpertStats

    if args.prompts:
        lines = Path(args.prompts).read_text().splitlines()
        prompts = [p for p in (line.strip() for line in lines) if p]
        if not prompts:
            raise ValueError(f"{args.prompts}: no prompts (one per line)")
    else:
        prompts = _DEFAULT_PROMPTS
    model, tok = load_model(args.model, PatchConfig(scheme=args.scheme), device="cpu")
    layers = moe_layers(model)
    num_layers = int(model.config.num_hidden_layers)
    experts = next(m for _, m in model.named_modules() if hasattr(m, "num_experts")
                   and type(m).__name__ == "KTExperts").num_experts
    stats = ExpertStats(num_layers, experts, weighted=args.weighted,
                        model=args.name or Path(args.model).name)
    n_tok = 0
    with torch.no_grad(), record_routing(model, stats):
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            if args.max_new_tokens > 0:
                out = model.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
                n_tok += out.shape[1]
            else:
                model(ids)
                n_tok += ids.shape[1]
    out = stats.save(args.output)
    print(f"recorded {len(prompts)} prompts ({n_tok} tokens) over {len(layers)} MoE layers of "
          f"{num_layers}, {experts} experts -> {out}")
    return 0


def _record(args) -> int:
    import numpy as np

    from kt.placement import ExpertStats, zipf_routing

    if args.model:
        return _record_model(args)
    if args.prompts:
        raise ValueError("--prompts goes with --model")
    if args.synthetic:
        E = args.experts or 64
        ids, w = zipf_routing(args.layers, E, args.top_k, args.tokens, alpha=args.alpha,
                              phases=args.phases, seed=args.seed, return_weights=True)
        name = args.name or f"synthetic-zipf-a{args.alpha:g}"
    else:
        ids, w = _load_trace(Path(args.trace), args.trust_pickle)
        if args.weighted and w is None:
            raise ValueError(f"{args.trace}: --weighted needs 'topk_weights' in the trace")
        name = args.name
        if ids.size and ids.min() < -1:
            raise ValueError(f"{args.trace}: expert ids below -1 in topk_ids")
        E = args.experts if args.experts else (max(int(ids.max()) + 1, 1) if ids.size else 1)
    stats = ExpertStats(ids.shape[0], E, weighted=args.weighted, model=name)
    for l in range(ids.shape[0]):
        stats.record(l, ids[l], None if w is None else w[l])
    out = stats.save(args.output)
    c = stats.counts
    print(f"recorded {ids.shape[1]} tokens x top-{ids.shape[2]} over {ids.shape[0]} layers, {E} experts "
          f"({'router-weighted' if args.weighted else 'token-slot counts'}) -> {out}")
    top = np.sort(c / np.maximum(c.sum(axis=1, keepdims=True), 1e-300), axis=1)[:, ::-1]
    k = max(1, E // 4)
    print(f"share of traffic on each layer's hottest 25 % of experts: mean {100 * top[:, :k].sum(1).mean():.1f} %")
    return 0


# ---------------------------------------------------------------------------- plan

def _parse_layers(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        a, sep, b = part.partition("-")
        try:
            lo, hi = int(a), int(b) if sep else int(a)
        except ValueError:
            raise ValueError(f"--moe-layers: cannot read {part!r} (expected e.g. 3-60 or 0,2,4)") from None
        if hi < lo:
            raise ValueError(f"--moe-layers: empty range {part!r}")
        out.extend(range(lo, hi + 1))
    if not out:
        raise ValueError("--moe-layers: no layers given")
    return out


def _plan(args) -> int:
    from kt.placement import ExpertStats, expected_hit_rate, expert_nbytes, plan

    if args.stats:
        src = ExpertStats.load(args.stats, trust_pickle=args.trust_pickle)
    else:
        src = (args.shape[0], args.shape[1])
    eb = args.expert_bytes
    if eb is None and (args.hidden or args.intermediate):
        if not (args.hidden and args.intermediate):
            raise ValueError("give both --hidden and --intermediate (or --expert-bytes)")
        eb = expert_nbytes(args.hidden, args.intermediate, args.dtype)
    layers = _parse_layers(args.moe_layers) if args.moe_layers else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p = plan(src, args.budget, args.strategy, expert_bytes=eb, reserve_bytes=args.reserve,
                 seed=args.seed, moe_layers=layers, model=args.name)
    for wmsg in caught:
        print(f"kt placement plan: warning: {wmsg.message}", file=sys.stderr)
    p.save(args.output)
    c = p.gpu_counts()
    msg = (f"{args.strategy}: {p.num_gpu_experts()} of {p.num_layers * p.num_experts} experts on the GPU "
           f"(per layer {int(c.min())}..{int(c.max())})")
    if eb:
        msg += f", {p.gpu_bytes() / 2**30:.2f} GiB of GPU slots"
    if isinstance(src, ExpertStats):
        msg += f", expected hit rate {100 * expected_hit_rate(p, src):.1f} %"
    print(f"{msg} -> {args.output}")
    return 0


# ---------------------------------------------------------------------------- show

def _summary(p, counts) -> dict:
    from kt.placement import expected_hit_rate

    c = p.gpu_counts()
    d = {"model": p.model, "num_layers": p.num_layers, "num_experts": p.num_experts,
         "gpu_experts": p.num_gpu_experts(), "gpu_fraction": p.num_gpu_experts() / (p.num_layers * p.num_experts),
         "per_layer_min": int(c.min()), "per_layer_max": int(c.max()), "expert_bytes": p.expert_bytes,
         "gpu_bytes": p.gpu_bytes() if p.expert_bytes else None, "layers": []}
    if counts is not None:
        d["expected_hit_rate"] = expected_hit_rate(p, counts)
    for l in range(p.num_layers):
        row = {"layer": l, "gpu_experts": int(c[l]), "slots": int(p.n_slots[l]),
               "experts": [int(e) for e in p.experts_in_slots(l) if e >= 0]}
        if counts is not None:
            tot = counts[l].sum()
            row["hit_rate"] = float((counts[l] * p.gpu_mask[l]).sum() / tot) if tot > 0 else None
        d["layers"].append(row)
    return d


def _show(args) -> int:
    from kt.placement import ExpertStats, Placement, render_heatmap

    p = Placement.load(args.placement)
    counts = None
    if args.stats:
        stats = ExpertStats.load(args.stats, num_layers=p.num_layers, num_experts=p.num_experts,
                                 trust_pickle=args.trust_pickle)
        counts = stats.counts
    d = _summary(p, counts)
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        print(f"placement {args.placement}: model {p.model or '-'}, L={p.num_layers}, E={p.num_experts}")
        print(f"GPU experts: {d['gpu_experts']} ({100 * d['gpu_fraction']:.1f} % of all), "
              f"per layer {d['per_layer_min']}..{d['per_layer_max']}")
        if p.expert_bytes:
            print(f"GPU slot memory: {p.total_slots} slots x {p.expert_bytes} B = {p.gpu_bytes() / 2**30:.3f} GiB")
        if counts is not None:
            print(f"expected GPU hit rate on {args.stats}: {100 * d['expected_hit_rate']:.1f} %")
        hdr = "layer  gpu  slots" + ("  hit %" if counts is not None else "") + "  GPU experts (by slot)"
        print(hdr)
        for row in d["layers"]:
            ex = row["experts"]
            ex_s = " ".join(map(str, ex[:16])) + (f" ... (+{len(ex) - 16})" if len(ex) > 16 else "")
            hit = "" if counts is None else (f"  {100 * row['hit_rate']:5.1f}" if row["hit_rate"] is not None
                                             else "      -")
            print(f"{row['layer']:5d}  {row['gpu_experts']:3d}  {row['slots']:5d}{hit}  {ex_s}")
    if args.png:
        out = render_heatmap(p, args.png, counts)
        print(f"heatmap -> {out}", file=sys.stderr if args.json else sys.stdout)
    return 0
