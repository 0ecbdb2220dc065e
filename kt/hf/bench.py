"""``kt bench model``: a real-shaped MoE model with random weights, built offline without ever
materialising its experts, timed as ``kt generate`` runs it, beside llama.cpp on the same shape.

The model is the transformers model of the config (a preset such as ``qwen3-30b-a3b``, or a
model directory's ``config.json``), with ``--layers`` of its decoder layers. Its parameters are
created on the meta device; each MoE layer gets kt experts of random packed weights
(``kt.cpu_ops.random_weights``, at memcpy speed); then only the non-expert weights are made, at
random, on the device; on the CPU the dense linears go to kt's kernels (``PatchConfig.
dense_scheme``). Reported: build time, peak host RSS (and VRAM), time to first token, prefill and
decode tokens/s (``model.generate``, greedy, batch 1), and the CPU decode floor: bytes read per
token (dense weights + the routed experts a token uses + LM head) over the measured host read
bandwidth.
"""
from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ._compat import require_transformers
from ._patch import PatchConfig, PatchInfo, check_sites, find_experts
from .families import family_of

__all__ = ["PRESETS", "model_config", "build_random_model", "time_generate", "bench_model", "table"]

# the config.json values of released models (random weights at these shapes)
PRESETS = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]),
}


def model_config(source: str, layers: int | None = None):
    """The transformers config of a preset name or a model directory, with ``layers`` decoder
    layers (None: all)."""
    transformers = require_transformers()
    if source in PRESETS:
        kw = dict(PRESETS[source])
        cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    else:
        p = Path(source).expanduser()
        if not (p / "config.json").is_file():
            raise ValueError(f"{source!r} is neither a preset ({', '.join(PRESETS)}) nor a model "
                             "directory with a config.json")
        cfg = transformers.AutoConfig.from_pretrained(p, local_files_only=True)
    family_of(getattr(cfg, "model_type", None))
    if layers is not None:
        if not 1 <= layers <= cfg.num_hidden_layers:
            raise ValueError(f"--layers must be in [1, {cfg.num_hidden_layers}], got {layers}")
        cfg.num_hidden_layers = layers
        for key in ("layer_types", "mlp_only_layers"):
            v = getattr(cfg, key, None)
            if isinstance(v, list) and key == "layer_types":
                setattr(cfg, key, v[:layers])
    return cfg


def build_random_model(cfg, patch: PatchConfig, *, device: torch.device, seed: int = 0,
                       progress: bool = True):
    """The model of ``cfg`` with kt experts of random packed weights and random non-expert
    weights on ``device`` (see the module doc); ``patch`` says the scheme, pool, placement."""
    from tqdm import tqdm

    from ..cpu_ops.moe import CPUMoE
    from ..cpu_ops.random_weights import LinePool, random_packed
    from ._build import ExpertsBuilder
    from ._dense import dense_scheme_for, patch_dense
    from ._loader import params_on_meta
    from .tiny import init_random_weights

    transformers = require_transformers()
    if patch.scheme.value == "bf16" or patch.backend != "kt":
        raise ValueError("kt bench model generates INT8 or INT4 experts (backend 'kt')")
    with params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    sites = find_experts(model)
    e, h, i = check_sites(sites)
    builder = ExpertsBuilder(patch, num_layers=cfg.num_hidden_layers, last_layer=sites[-1].layer_idx,
                             num_experts=e, hidden=h, intermediate=i, device=device)
    lines = LinePool(max(1 << 16, h // 4 + 1, i // 4 + 1), seed)
    rng = np.random.default_rng(seed)
    for s in tqdm(sites, desc=f"kt: random experts ({patch.scheme.value})", unit="layer",
                  disable=not progress):
        w13 = random_packed(lines, e, 2 * i, h, patch.scheme, patch.group_size, rng)
        w2 = random_packed(lines, e, h, i, patch.scheme, patch.group_size, rng)
        cpu = CPUMoE(w13, w2, pool=builder.pool)
        setattr(s.parent, s.attr, builder.build(s.layer_idx, cpu=cpu))
    _materialise(model, device)  # only the non-expert parameters are left to make
    init_random_weights(model, seed)
    model.eval()
    dense = dense_scheme_for(patch.dense_scheme, patch.scheme, device, torch.bfloat16)
    n_dense = 0
    if dense is not None:
        n_dense, _ = patch_dense(model, dense, group_size=patch.group_size, pool=builder.pool,
                                 progress=progress)
    model.kt_patch = PatchInfo(patch, cfg.model_type, tuple(s.layer_idx for s in sites), e, h, i,
                               builder.backend_name, 0, dense, n_dense)
    return model


def _materialise(model, device) -> None:
    """Every parameter still on the meta device made (uninitialised) on ``device``, tied ones
    once; buffers (computed for real while building) moved there."""
    made: dict[int, torch.nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            new = made.get(id(p))
            if new is None:
                new = made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                       requires_grad=False)
            mod._parameters[name] = new
    model.to(device)


class _Timer:
    """A generate() streamer that only records when each new token arrived."""

    def __init__(self):
        self.times: list[float] = []
        self.seen_prompt = False

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times.append(time.perf_counter())

    def end(self):
        pass


@torch.no_grad()
def time_generate(model, prompt: int, decode: int, *, seed: int = 0) -> dict:
    """One greedy ``model.generate`` of ``decode`` tokens after ``prompt`` random token ids:
    {"ttft_s", "prefill_tok_s", "decode_tok_s"}."""
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), generator=g).to(dev)
    timer = _Timer()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=decode,
                   min_new_tokens=decode, do_sample=False, streamer=timer, pad_token_id=0)
    t = timer.times
    ttft = t[0] - t0
    return {"ttft_s": ttft, "prefill_tok_s": prompt / ttft,
            "decode_tok_s": (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 else 0.0}


def _read_bandwidth(threads: int, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a multi-threaded read of a buffer far larger than the caches (torch sum)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.ones(nbytes // 4, dtype=torch.float32)
        best = min(_timed(lambda: a.sum()) for _ in range(5))
        return nbytes / best
    finally:
        torch.set_num_threads(old)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _bytes_per_token(model) -> dict:
    """Weight bytes one decode step reads on the host: kt's dense linears (LM head apart), the
    routed experts a token uses, the LM head."""
    from ._dense import KTLinear
    from ._experts import KTExperts

    dense = head = experts = 0
    for name, m in model.named_modules():
        if isinstance(m, KTLinear):
            if name.endswith("lm_head"):
                head += m.lin.nbytes
            else:
                dense += m.lin.nbytes
        elif isinstance(m, KTExperts):
            cpu = getattr(m.moe, "cpu", m.moe)
            k = model.config.num_experts_per_tok
            experts += k * (cpu.w13.nbytes + cpu.w2.nbytes) // cpu.num_experts
    return {"dense": dense, "experts": experts, "lm_head": head, "total": dense + experts + head}


def bench_model(source: str, *, layers: int | None, scheme: str, dense_scheme: str = "auto",
                device: str = "cpu", prompt: int = 512, decode: int = 32, reps: int = 3,
                threads: int | None = None, llama_bench: str | None = None, gguf_dir: str | None = None,
                seed: int = 0, progress: bool = True, log=print) -> dict:
    """Build, time and (with ``llama_bench``) compare; returns the result dict (see ``table``)."""
    from ..cpu_ops import default_pool
    from .run import resolve_device

    cfg = model_config(source, layers)
    dev = resolve_device(device)
    pool = default_pool(threads)
    threads = pool.num_threads
    res = {"model": source, "layers": cfg.num_hidden_layers, "scheme": scheme, "device": str(dev),
           "prompt": prompt, "decode": decode, "reps": reps, "threads": threads}
    t0 = time.perf_counter()
    patch = PatchConfig(scheme=scheme, dense_scheme=dense_scheme, pool=pool)
    model = build_random_model(cfg, patch, device=dev, seed=seed, progress=progress)
    res["kt"] = kt = {"build_s": time.perf_counter() - t0, "dense_scheme": getattr(model.kt_patch.dense_scheme, "value", "torch")}
    if dev.type == "cpu":
        torch_threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one pool for the whole step: torch's ops run on the caller
    try:
        log(f"kt bench model: warm-up (first calls compile or load kt's kernels)")
        time_generate(model, min(prompt, 16), 2, seed=seed)
        runs = [time_generate(model, prompt, decode, seed=seed + r + 1) for r in range(reps)]
    finally:
        if dev.type == "cpu":
            torch.set_num_threads(torch_threads)
    for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
        vals = [r[key] for r in runs]
        kt[key] = statistics.median(vals)
        kt[key + "_best"] = min(vals) if key == "ttft_s" else max(vals)
    kt["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if dev.type == "cuda":
        kt["peak_vram_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:
        b = _bytes_per_token(model)
        bw = _read_bandwidth(threads)
        res["floor"] = {"bytes_per_token": b, "read_gb_s": bw / 1e9,
                        "decode_tok_s": bw / b["total"] if b["total"] else None}
        if b["total"]:
            kt["decode_of_floor"] = kt["decode_tok_s_best"] / (bw / b["total"])
    del model
    if llama_bench:
        res["llama.cpp"] = _llama(cfg, scheme, llama_bench, gguf_dir, prompt, decode, threads, reps,
                                  seed, progress, dev, log)
    return res


def _llama(cfg, scheme, binary, gguf_dir, prompt, decode, threads, reps, seed, progress, dev, log):
    import tempfile

    from ._llamacpp import GGUF_TYPES, run_llama_bench, write_random_gguf

    with tempfile.TemporaryDirectory(dir=gguf_dir) as tmp:
        path = Path(tmp) / f"random-{cfg.num_hidden_layers}L-{GGUF_TYPES[scheme]}.gguf"
        t0 = time.perf_counter()
        write_random_gguf(path, cfg, scheme, seed=seed, progress=progress)
        log(f"kt bench model: wrote {path.name} ({path.stat().st_size / 2**30:.2f} GiB) in "
            f"{time.perf_counter() - t0:.0f} s; running llama-bench")
        # CPU: no GPU offload at all; CUDA: every layer on the GPU but the experts
        extra = ("-ngl", "0") if dev.type == "cpu" else ("-ngl", "99", "-ot", "exps=CPU")
        out = run_llama_bench(binary, path, prompt=prompt, decode=decode, threads=threads,
                              reps=reps, extra=extra)
    out["type"] = GGUF_TYPES[scheme]
    return out


def table(res: dict) -> str:
    """The comparison as a Markdown table (kt, llama.cpp when run, and kt / llama.cpp)."""
    kt, ll = res["kt"], res.get("llama.cpp")
    head = (f"{res['model']}, {res['layers']} layers, experts {res['scheme']}, dense "
            f"{kt['dense_scheme']}, {res['device']}, {res['threads']} threads, prompt {res['prompt']}, "
            f"decode {res['decode']}, median of {res['reps']}")
    rows = ["| engine | weights | build s | peak RSS GiB | TTFT ms | prefill tok/s | decode tok/s |",
            "|---|---|---:|---:|---:|---:|---:|",
            f"| kt | {res['scheme']} | {kt['build_s']:.1f} | {kt['peak_rss_gib']:.2f} | "
            f"{kt['ttft_s'] * 1e3:.0f} | {kt['prefill_tok_s']:.1f} | {kt['decode_tok_s']:.2f} |"]
    if ll:
        rows.append(f"| llama.cpp | {ll['type']} | | | | {ll['prefill_tok_s']:.1f} | {ll['decode_tok_s']:.2f} |")
        rows.append(f"| kt / llama.cpp | | | | | {kt['prefill_tok_s'] / ll['prefill_tok_s']:.2f}x | "
                    f"{kt['decode_tok_s'] / ll['decode_tok_s']:.2f}x |")
    out = head + "\n\n" + "\n".join(rows)
    fl = res.get("floor")
    if fl and fl["decode_tok_s"]:
        b = fl["bytes_per_token"]
        out += (f"\n\nCPU decode floor: {b['total'] / 1e6:.0f} MB read per token (dense "
                f"{b['dense'] / 1e6:.0f}, routed experts {b['experts'] / 1e6:.0f}, LM head "
                f"{b['lm_head'] / 1e6:.0f}) at {fl['read_gb_s']:.1f} GB/s = {fl['decode_tok_s']:.2f} "
                f"tok/s; kt's best decode is {100 * kt['decode_of_floor']:.0f} % of it")
    return out


def save(res: dict, path) -> None:
    Path(path).write_text(json.dumps(res, indent=1) + "\n")
