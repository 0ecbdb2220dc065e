"""Loading a Hugging Face MoE checkpoint with kt experts, never materialising its experts.

1. The model is built from config.json with every parameter on the meta device (no memory);
   buffers (RoPE frequencies, router biases) are small and built for real, as the model's own
   code computes them.
2. Each MoE layer's experts module is replaced by a ``KTExperts``: from a kt weight directory
   (memory-mapped), or converted from the checkpoint's expert tensors one layer at a time with
   kt's converter kernels (the layer's source pages are unmapped before the next layer).
3. Only then are the remaining (non-expert) tensors read from the safetensors files, each
   straight into a tensor on the model's device; FP8 block-scaled weights are dequantised to
   the model dtype as they are read.

Everything that can be checked without reading weights (architecture, missing or misshapen
tensors, the kt weight directory, the placement) is checked before step 2. See docs/hf.md
for the peak host memory and how it was measured.

Legend: E experts, H hidden size, I expert intermediate size, L layers.
"""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..config import QuantScheme
from ._checkpoint import Checkpoint, TensorRef, open_expert_source
from ._compat import require_transformers
from ._dense import dense_scheme_for, patch_dense
from ._patch import PatchConfig, PatchInfo, check_sites, find_experts, reference_warning
from .families import family_of

__all__ = ["LoadInfo", "load_checkpoint", "params_on_meta"]


@dataclass
class LoadInfo:
    """What ``load_model`` read; stored on the model as ``model.kt_load``.

    experts_from: "kt weight directory" or "checkpoint" (converted at load).
    tensors_read: names of the checkpoint tensors read (non-expert ones only, FP8 scales too).
    bytes_read: their stored size. skipped: checkpoint tensors the model has no place for
    (e.g. DeepSeek-V3's multi-token-prediction layer), not read.
    """

    experts_from: str
    tensors_read: list[str] = field(default_factory=list)
    bytes_read: int = 0
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0


@contextlib.contextmanager
def params_on_meta():
    """Create every nn.Parameter on the meta device while the context is open; buffers stay
    where the code puts them (so RoPE frequencies are computed for real)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _renamer(model, family_block: str):
    """Checkpoint tensor name -> model parameter name, as transformers renames them on load
    (e.g. Mixtral's ``block_sparse_moe`` -> ``mlp``); only renamings, no fusing converters."""
    rules = []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        rules = [t for t in get_model_conversion_mapping(model)
                 if isinstance(t, WeightRenaming) and not isinstance(t, WeightConverter)]
    except (ImportError, AttributeError, TypeError):  # an older transformers 5: the family's block
        pass

    def rename(key: str) -> str:
        for r in rules:
            key, _ = r.rename_source_key(key)
        if not rules and family_block != "mlp":
            key = key.replace(f".{family_block}.", ".mlp.")
        return key

    return rename


def _targets(model, skip: tuple[str, ...]) -> list[tuple[str, list[str], torch.Tensor]]:
    """(name, aliases, tensor) of every parameter and persistent buffer to fill, except those
    under the modules ``skip`` (the experts, which kt replaces); a tied parameter appears once
    with all its names."""
    by_id: dict[int, tuple[str, list[str], torch.Tensor]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if name.startswith(skip):
            continue
        ent = by_id.setdefault(id(p), (name, [], p))
        ent[1].append(name)
    non_persistent = set()
    for mod_name, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{mod_name}.{b}" if mod_name else b)
    for name, b in model.named_buffers(remove_duplicate=False):
        if name not in non_persistent and not name.startswith(skip):
            ent = by_id.setdefault(id(b), (name, [], b))
            ent[1].append(name)
    return list(by_id.values())


def _plan(model, ckpt: Checkpoint, rename, skip: tuple[str, ...]
          ) -> tuple[list[tuple[list[str], torch.Tensor, TensorRef]], list[str]]:
    """Which checkpoint tensor fills which model tensor (those under ``skip`` excepted), and the
    checkpoint's non-expert tensors left over; SourceError for a missing or misshapen one,
    before anything is read."""
    from ..weights import SourceError

    base = getattr(model, "base_model_prefix", "") or ""
    wanted: dict[str, str] = {}  # model name -> checkpoint name
    for ck in ckpt.tensors:
        wanted.setdefault(rename(ck), ck)
    plan, missing = [], []
    for name, aliases, t in _targets(model, skip):
        ck = next((wanted[a] for a in aliases if a in wanted), None)
        if ck is None and base:
            ck = next((wanted[a[len(base) + 1:]] for a in aliases
                       if a.startswith(base + ".") and a[len(base) + 1:] in wanted), None)
        if ck is None:
            missing.append(name)
            continue
        ref = ckpt.tensors[ck]
        ckpt.check_readable(ref, tuple(t.shape))
        plan.append((aliases, t, ref))
    if missing:
        files = ", ".join(sorted(ckpt.files))
        raise SourceError(f"{ckpt.root}: the checkpoint has no tensor for {len(missing)} of the "
                          f"model's weights, e.g. {missing[:3]} (looked in {files})")
    used = {ref.name for _, _, ref in plan}
    return plan, sorted(set(ckpt.tensors) - used)


def _set_tensor(model, names: list[str], value: torch.Tensor, old: torch.Tensor) -> None:
    """Put ``value`` in place of ``old`` under each of ``names`` (tied weights stay one object)."""
    if isinstance(old, nn.Parameter):
        value = nn.Parameter(value, requires_grad=old.requires_grad)
    for name in names:
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        if isinstance(old, nn.Parameter):
            setattr(mod, attr, value)
        else:
            mod._buffers[attr] = value


def _pack_layer(lx, scheme: QuantScheme, group_size: int, executor):
    """One layer's experts quantised and packed into w13 [E, 2I, H] / w2 [E, H, I] stacks with
    the converter's kernels, one expert per task (no [E, ...] fp32 copy)."""
    from ..cpu_ops import _align
    from ..weights import SourceError
    from ..weights._pack import fill_padding_rows, packed_array_specs, quantize_pack_into, stack_view

    E, H, I = lx.num_experts, lx.hidden, lx.inter
    g = group_size if scheme is QuantScheme.INT4 else 64
    a13 = {k: _align.empty(*v) for k, v in packed_array_specs(scheme, E, 2 * I, H, g).items()}
    a2 = {k: _align.empty(*v) for k, v in packed_array_specs(scheme, E, H, I, g).items()}

    def one(e):
        gate, up, down = lx.matrices(e)
        w13 = (a13["data"][e], a13["scale"][e], a13["wsum"][e])
        w2 = (a2["data"][e], a2["scale"][e], a2["wsum"][e])
        bad = quantize_pack_into(scheme, g, gate, 0, *w13)
        bad += quantize_pack_into(scheme, g, up, I, *w13)
        bad += quantize_pack_into(scheme, g, down, 0, *w2)
        if bad:
            raise SourceError(f"layer {lx.layer} expert {e}: {bad} rows/groups hold NaN or Inf")

    for fut in [executor.submit(one, e) for e in range(E)]:
        fut.result()
    fill_padding_rows(scheme, 2 * I, a13["data"], a13["scale"], a13["wsum"])
    fill_padding_rows(scheme, H, a2["data"], a2["scale"], a2["wsum"])
    return (stack_view(scheme, 2 * I, H, g, a13["data"], a13["scale"], a13["wsum"]),
            stack_view(scheme, H, I, g, a2["data"], a2["scale"], a2["wsum"]))


def _dense_layer(lx):
    """gate, up [E, I, H] and down [E, H, I] fp32 of one source layer (reference backend)."""
    mats = [[_as_f32(m) for m in lx.matrices(e)] for e in range(lx.num_experts)]
    return tuple(np.stack([m[k] for m in mats]) for k in range(3))


def _as_f32(m: np.ndarray) -> np.ndarray:
    return (m.astype(np.uint32) << 16).view(np.float32) if m.dtype == np.uint16 else m


def _skeleton(transformers, cfg, dtype: torch.dtype):
    with params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def load_checkpoint(path: Path, patch: PatchConfig, *, device: torch.device, dtype: torch.dtype,
                    progress: bool = True):
    """The model of the HF directory ``path`` with its experts on kt (see the module doc)."""
    from tqdm import tqdm

    from ..weights import SourceError
    from ._build import ExpertsBuilder

    transformers = require_transformers()
    t0 = time.perf_counter()
    cfg = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    model_type = getattr(cfg, "model_type", None)
    family_of(model_type)
    if getattr(cfg, "quantization_config", None) is not None:
        quant = cfg.quantization_config
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if str(method) != "fp8":
            raise SourceError(f"{path / 'config.json'}: quantization_config {method!r}; kt.hf loads "
                              "bf16/fp16/fp32 and FP8 block-scaled checkpoints")
        # the model is built unquantised: FP8 non-expert weights are dequantised as they are read
        try:
            delattr(cfg, "quantization_config")
        except AttributeError:
            cfg.quantization_config = None
    num_layers = int(getattr(cfg, "num_hidden_layers"))
    ckpt = Checkpoint(path, model_type, num_layers)

    model = _skeleton(transformers, cfg, dtype)
    model.config._name_or_path = str(path)
    sites = find_experts(model)
    e, h, i = check_sites(sites)
    layers = [s.layer_idx for s in sites]
    plan, skipped = _plan(model, ckpt, _renamer(model, _block_of(model_type)),
                          tuple(f"{s.name}." for s in sites))

    loader = None
    if patch.weight_path is not None:
        from ._weights import WeightDirLoader

        loader = WeightDirLoader(patch.weight_path, patch, layers, model_type=model_type,
                                 num_experts=e, hidden=h, intermediate=i, model_dir=path,
                                 check_files=ckpt.files)
    else:
        missing = [L for L in layers if L not in ckpt.experts]
        if missing:
            raise SourceError(f"{path}: the checkpoint has no routed-expert tensors for layers "
                              f"{missing} (the model's MoE layers are {layers})")
    builder = ExpertsBuilder(patch, num_layers=num_layers, last_layer=layers[-1], num_experts=e,
                             hidden=h, intermediate=i, device=device)
    info = LoadInfo("kt weight directory" if loader is not None else "checkpoint", skipped=skipped)

    src = None if loader is not None else open_expert_source(path, ckpt.config)
    threads = patch.threads
    if threads is None:
        from ..weights._format import default_threads

        threads = default_threads()
    try:
        with ThreadPoolExecutor(threads) as executor:
            for s in tqdm(sites, desc=f"kt: experts -> {patch.scheme.value}", unit="layer",
                          disable=not progress):
                new = _layer_experts(builder, s.layer_idx, loader, src, patch, executor, (e, h, i))
                setattr(s.parent, s.attr, new)
                if src is not None:
                    src.close()  # unmap this layer's source pages before the next layer's
    finally:
        if src is not None:
            src.close()

    for aliases, old, ref in tqdm(plan, desc=f"kt: weights -> {device.type}", unit="tensor",
                                  disable=not progress):
        dest = torch.empty(tuple(old.shape), dtype=old.dtype, device=device)
        ckpt.read_into(ref, dest)
        _set_tensor(model, aliases, dest, old)
        info.tensors_read.append(ref.name)
        info.bytes_read += ref.nbytes
        scale = ckpt.scale_of(ref.name) if ref.dtype == "F8_E4M3" else None
        if scale is not None:
            info.tensors_read.append(scale.name)
            info.bytes_read += scale.nbytes
    left = [n for n, p in list(model.named_parameters()) + list(model.named_buffers())
            if p.device.type == "meta"]
    if left:
        raise SourceError(f"{path}: no weights were loaded for {left[:3]} (of {len(left)})")
    model.to(device)  # the buffers built on the CPU
    gen = path / "generation_config.json"
    if gen.is_file():
        model.generation_config = transformers.GenerationConfig.from_pretrained(path, local_files_only=True)
    model.eval()
    dense = dense_scheme_for(patch.dense_scheme, patch.scheme, device, dtype) if patch.backend == "kt" else None
    n_dense = 0
    if dense is not None:
        n_dense, _ = patch_dense(model, dense, group_size=patch.group_size, pool=builder.pool,
                                 progress=progress)
    model.kt_patch = PatchInfo(patch, model_type, tuple(layers), e, h, i, builder.backend_name, 0,
                               dense, n_dense)
    info.seconds = time.perf_counter() - t0
    model.kt_load = info
    reference_warning(patch, stacklevel=4)
    return model


def _block_of(model_type: str) -> str:
    from ._checkpoint import source_family

    return source_family(model_type).block


def _layer_experts(builder, layer: int, loader, src, patch: PatchConfig, executor, ehi):
    """The KTExperts of one layer, from the kt weight directory or the checkpoint."""
    from ..weights import SourceError

    if loader is not None:
        if patch.backend == "reference":
            return builder.build(layer, dense=loader.dequantized(layer))
        return builder.build(layer, cpu=loader.cpu_moe(builder.cpu_class(), layer, builder.pool))
    lx = src.layer(layer)
    if (lx.num_experts, lx.hidden, lx.inter) != ehi:
        raise SourceError(f"{src.root}: layer {layer} experts are (E, H, I) = "
                          f"{(lx.num_experts, lx.hidden, lx.inter)}, but the model (config.json) "
                          f"has {ehi}")
    if patch.backend == "reference":
        return builder.build(layer, dense=_dense_layer(lx))
    w13, w2 = _pack_layer(lx, patch.scheme, patch.group_size, executor)
    cpu = builder.cpu_class()(w13, w2, pool=builder.pool)
    return builder.build(layer, cpu=cpu)
