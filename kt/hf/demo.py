"""`kt demo`: build a small random MoE model once, run it through kt, check it against transformers.

Steps (each shows progress when it takes more than a second):
1. build (first run only) a Qwen3-MoE-like random model + offline-trained tokenizer in HF format
   under ``<cache_dir>/demo``;
2. convert its experts to the kt weight format (first run only per scheme);
3. load it twice: plain transformers (fp32, the reference) and with the experts on kt
   (``load_model``: kt's experts from the weight directory, the checkpoint's never read);
4. compile kt's kernels for this CPU (first run only; cached on disk);
5. compare logits (KL, max |dlogit|, greedy tokens) on the prompt and two random ones;
6. generate with kt, streaming, and print decode tokens/s (transformers' too, for scale).
"""
from __future__ import annotations

import json
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["run_demo", "demo_model_dir", "DEMO_MODEL"]

# Bump when the demo model's recipe changes, so stale caches are rebuilt.
_RECIPE_VERSION = 1
DEMO_MODEL = dict(family="qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_layers=4,
                  num_experts=16, top_k=4, vocab_size=1024, seed=0)


@contextmanager
def _working(desc: str, out):
    """Show a step of unknown length: a ticking tqdm line on a terminal, else two plain lines."""
    import sys

    stream = out or sys.stdout
    t0 = time.perf_counter()
    if not (hasattr(stream, "isatty") and stream.isatty()):
        print(f"{desc} ...", file=stream, flush=True)
        yield None
        print(f"{desc}: done in {time.perf_counter() - t0:.1f} s", file=stream, flush=True)
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}", file=stream, leave=True)
    stop = threading.Event()

    def tick():
        while not stop.wait(0.5):
            bar.refresh()

    th = threading.Thread(target=tick, daemon=True)
    th.start()
    try:
        yield bar
    finally:
        stop.set()
        th.join()
        bar.refresh()
        bar.close()


def demo_model_dir(demo_dir: Path | None = None) -> Path:
    """Where the demo model lives: ``<demo_dir>/<name>``, demo_dir default ``<kt cache>/demo``."""
    if demo_dir is None:
        from ..config import get_config

        demo_dir = get_config().cache_dir / "demo"
    return Path(demo_dir) / f"{DEMO_MODEL['family']}-tiny-v{_RECIPE_VERSION}"


def _marker(d: Path) -> Path:
    return d / "kt_demo.json"


def build_demo_model(demo_dir: Path | None = None, *, rebuild: bool = False, out=None) -> Path:
    """The demo model's directory, built on first use (atomically: a temp dir, then renamed)."""
    from .tiny import save_tiny_model

    d = demo_model_dir(demo_dir)
    want = {"recipe": _RECIPE_VERSION, **DEMO_MODEL}
    if not rebuild and _marker(d).is_file():
        try:
            if json.loads(_marker(d).read_text()) == want:
                return d
        except (OSError, json.JSONDecodeError):
            pass
    tmp = d.with_name(d.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    with _working("building the demo model (first run only)", out):
        kw = dict(DEMO_MODEL)
        save_tiny_model(tmp, kw.pop("family"), seed=kw.pop("seed"), **kw)
        _marker(tmp).write_text(json.dumps(want, indent=1))
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    return d


def run_demo(*, scheme: str = "int8", prompt: str = "Once upon a time there was a processor",
             max_new_tokens: int = 32, threads: int | None = None, backend: str = "kt",
             rebuild: bool = False, demo_dir: Path | None = None, out=None) -> int:
    """Run the demo; prints as it goes. Returns 0 when kt agrees with transformers within the
    scheme's bound (``kt.hf.accuracy.KL_BOUNDS``; BF16 also needs identical greedy tokens)."""
    import sys
    import warnings

    from ..config import QuantScheme
    from ._compat import require_transformers
    from ._patch import PatchConfig
    from .accuracy import compare_models, kl_bound, random_prompts
    from .run import generate, load_model

    out = out or sys.stdout
    say = lambda s="": print(s, file=out, flush=True)  # noqa: E731
    transformers = require_transformers()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    sch = QuantScheme.parse(scheme)
    t_start = time.perf_counter()

    model_dir = build_demo_model(demo_dir, rebuild=rebuild, out=out)
    say(f"model: {model_dir}  ({DEMO_MODEL['num_layers']} layers, {DEMO_MODEL['num_experts']} experts "
        f"top-{DEMO_MODEL['top_k']}, hidden {DEMO_MODEL['hidden_size']}, random weights)")

    weight_path = None
    if backend == "kt":
        from ..weights import convert

        suffix = f"{sch.value}-g64" if sch is QuantScheme.INT4 else sch.value
        weight_path = model_dir.parent / f"{model_dir.name}.kt-{suffix}"
        convert(model_dir, weight_path, scheme=sch, group_size=64, progress=True)
        say(f"kt weights: {weight_path}")

    with _working("loading the model twice (transformers as the reference, and with kt experts)", out):
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, local_files_only=True).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore" if backend == "reference" else "default")
            # the kt model never holds the checkpoint's experts: kt's come from the weight directory
            kt_model, tok = load_model(model_dir, PatchConfig(scheme=sch, threads=threads,
                                                              weight_path=weight_path, backend=backend),
                                       device="cpu", dtype="fp32", progress=False)
    experts = kt_model.model.layers[0].mlp.experts
    info = kt_model.kt_load
    say(f"experts: {experts.moe!r}, from the {info.experts_from}; {len(info.tensors_read)} "
        f"non-expert tensors read from the checkpoint ({info.bytes_read / 1e6:.1f} MB) in "
        f"{info.seconds:.1f} s")

    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with _working("warming up kt (kernels compile on first use)", out), torch.no_grad():
        kt_model(ids)
        kt_model(ids[:, :1])

    prompts = [ids] + random_prompts(ref.config.vocab_size, n=2, length=24, seed=0)
    with _working("comparing kt with transformers", out):
        agree = compare_models(ref, kt_model, prompts, greedy_steps=16)
    bound = kl_bound(sch)
    ok = agree.mean_kl <= bound and (sch is not QuantScheme.BF16 or agree.greedy_identical)
    say(f"agreement with transformers ({sch.value} experts vs fp32 model): {agree}")
    say(f"  -> {'PASS' if ok else 'FAIL'} (mean KL bound for {sch.value}: {bound:g}"
        f"{', greedy tokens must match' if sch is QuantScheme.BF16 else ''})")

    say(f"\ngenerating {max_new_tokens} tokens with kt (random weights: the text is gibberish):")
    print(prompt, end="", file=out, flush=True)
    stats = generate(kt_model, tok, prompt, max_new_tokens=max_new_tokens,
                     echo=lambda t, end: print(t, end="\n" if end else "", file=out, flush=True))
    ref_stats = generate(ref, tok, prompt, max_new_tokens=max_new_tokens, echo=None)
    say(f"kt:           {stats}")
    say(f"transformers: {ref_stats}  (fp32, its own expert loop)")
    say(f"demo done in {time.perf_counter() - t_start:.1f} s")
    return 0 if ok else 1
