"""Peak host memory of loading a HF MoE checkpoint, measured in a fresh process.

    python tests/hf/_load_memory.py MODEL_DIR --mode {kt-dir,checkpoint,old} [--weights KT_DIR]
        [--scheme int8] [--dtype bf16] [--warmup SMALL_MODEL_DIR]

Prints one JSON line: the resident set before loading (``baseline``, after a warm-up load of
``--warmup`` so imports and kernel compilation are behind), the peak during the load
(``peak``, Linux VmHWM reset with /proc/self/clear_refs just before), and the terms of the
formula in ``kt.hf.load_model``'s docstring computed from the loaded model: ``w_ne`` (non-expert
weights in the model dtype), ``s_max`` (staging of the largest non-expert tensor), ``k`` (the kt
experts in anonymous memory), ``layer_src`` (one layer's expert bytes as stored) and
``w_experts`` (the experts in the model dtype, what the old path holds). Used by
tests/hf/test_load_memory.py; docs/hf.md shows its numbers.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def _status_kb(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _load(args, model_dir):
    import torch

    from kt.hf import PatchConfig, patch_model
    from kt.hf.run import load_model, resolve_dtype

    if args.mode == "old":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=resolve_dtype(args.dtype),
                                                     local_files_only=True).eval()
        with torch.no_grad():
            patch_model(model, PatchConfig(scheme=args.scheme, threads=1), progress=False)
        return model
    weights = args.weights if args.mode == "kt-dir" else None
    model, _ = load_model(model_dir, PatchConfig(scheme=args.scheme, weight_path=weights, threads=1),
                          device="cpu", dtype=args.dtype, progress=False)
    return model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--mode", choices=["kt-dir", "checkpoint", "old"], required=True)
    p.add_argument("--weights", default=None)
    p.add_argument("--scheme", default="int8")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--warmup", default=None)
    args = p.parse_args(argv)
    import gc

    import torch

    from kt.hf._checkpoint import Checkpoint
    from kt.hf._experts import KTExperts

    if args.warmup:  # imports, kernel compilation and first-use allocations of both paths
        for mode in ("old", "checkpoint"):
            _load(argparse.Namespace(**{**vars(args), "mode": mode, "weights": None}), args.warmup)
            gc.collect()
    baseline = _status_kb("VmRSS") * 1024
    _reset_peak()
    model = _load(args, args.model_dir)
    peak = _status_kb("VmHWM") * 1024

    ckpt = Checkpoint(args.model_dir, model.config.model_type, model.config.num_hidden_layers)
    seen, w_ne, s_max = set(), 0, 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            w_ne += t.numel() * t.element_size()
    dt = next(model.parameters()).dtype
    for ref in ckpt.tensors.values():
        stored = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(ref.dtype)
        if stored != dt:
            s_max = max(s_max, ref.nbytes)
    experts = [m for m in model.modules() if isinstance(m, KTExperts)]
    k = sum(int(m.moe.nbytes) for m in experts)
    e, h, i = experts[0].num_experts, experts[0].hidden_dim, experts[0].intermediate_dim
    layer_src = max(sum(ckpt_bytes for ckpt_bytes in _expert_bytes(ckpt, L)) for L in ckpt.experts)
    w_experts = len(experts) * e * 3 * h * i * torch.tensor([], dtype=dt).element_size()
    out = {"mode": args.mode, "scheme": args.scheme, "dtype": args.dtype, "baseline": baseline,
           "peak": peak, "w_ne": w_ne, "s_max": s_max, "k": k, "layer_src": layer_src,
           "w_experts": w_experts}
    print(json.dumps(out))
    return out


def _expert_bytes(ckpt, layer: int):
    """Stored bytes of layer ``layer``'s routed-expert tensors (from the headers)."""
    from kt.weights._safetensors_io import read_header

    names = set(ckpt.experts[layer])
    for fname in ckpt.files:
        header, _, _, _ = read_header(Path(ckpt.root) / fname)
        for name, info in header.items():
            if name in names:
                b0, b1 = info["data_offsets"]
                yield int(b1) - int(b0)


if __name__ == "__main__":
    main()
