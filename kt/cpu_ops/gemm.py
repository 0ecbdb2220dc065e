"""CPU GEMM against a packed weight: y [M, N] = x [M, D] @ w[N, D]^T (check, allocate, launch).

``linear`` is the public entry point. The lower-level pieces are for callers that manage their own
buffers and threads: ``activation_buffers`` + ``prepare_activations`` fill the kernel's activation
operands, ``kernel_for`` resolves the registered kernel, ``launch`` runs it on the 16-row blocks
[nb0, nb1). Kernel arguments follow kt/cpu_ops/README.md; which kernel (and form) runs is the
registry's ``KernelSet``.
"""
from __future__ import annotations

import numpy as np

from ..config import QuantScheme
from ..reference import to_numpy_f32
from . import _align, isa, registry
from .packing import PackedWeight, int4_has_minus8
from .tiling import TileConfig, choose

__all__ = ["linear", "kernel_for", "activation_buffers", "prepare_activations", "launch"]


def _resolve_variant(variant: str | None) -> str:
    if variant is None:
        return isa.cpu_variant()
    if variant not in isa.VARIANTS:
        raise ValueError(f"variant must be one of {list(isa.VARIANTS)}, got {variant!r}")
    runnable = isa.runnable_variants()
    if variant not in runnable:
        raise isa.UnsupportedVariantError(
            f"variant {variant!r} cannot run on this CPU/process; runnable: {list(runnable)}")
    return variant


def kernel_for(op: str, scheme: QuantScheme | str, variant: str | None = None):
    """The jitted kernel registered for (op, scheme) at or below ``variant`` (default: the host's).

    Raises ValueError for an unknown op, UnsupportedVariantError for a variant this CPU cannot run.
    """
    if op not in ("gemv", "gemm"):
        raise ValueError(f"op must be 'gemv' or 'gemm', got {op!r}")
    return registry.kernel_set(scheme, _resolve_variant(variant)).kernel(op)


def _check_packed(packed) -> PackedWeight:
    if not isinstance(packed, PackedWeight):
        raise TypeError("packed must be a kt.cpu_ops.packing.PackedWeight, got "
                        f"{type(packed).__name__}")
    if packed.data.ndim != 4:
        raise ValueError(f"packed must be a single matrix (data.ndim == 4), got data.ndim="
                         f"{packed.data.ndim}; use packed.expert(e) for a stack")
    for name in ("data", "scale", "wsum"):
        a = getattr(packed, name)
        if not a.flags.c_contiguous:
            raise ValueError(f"packed.{name} must be C-contiguous")
    return packed


def activation_buffers(m: int, packed: PackedWeight) -> tuple[np.ndarray, ...]:
    """Empty activation operands for M tokens: (xq int8 [M, d_pad], xs fp32 [M]) for INT8/INT4,
    (xb uint16 [M, d_pad],) for BF16."""
    if packed.scheme is QuantScheme.BF16:
        return (_align.empty((m, packed.d_pad), np.uint16),)
    return _align.empty((m, packed.d_pad), np.int8), _align.empty(m, np.float32)


def prepare_activations(x: np.ndarray, packed: PackedWeight, bufs: tuple[np.ndarray, ...]) -> None:
    """Fill ``bufs`` (from ``activation_buffers``) from x fp32 [M, D] (C-contiguous rows)."""
    from .kernels.actquant import bf16_rows, quantize_rows

    if packed.scheme is QuantScheme.BF16:
        bf16_rows(x, bufs[0])
    else:
        quantize_rows(x, bufs[0], bufs[1])


def launch(kernel, packed: PackedWeight, bufs: tuple[np.ndarray, ...], out: np.ndarray,
           nb0: int = 0, nb1: int | None = None) -> None:
    """Run ``kernel`` on row blocks [nb0, nb1) (default all): overwrites out[:, 16*nb0 : 16*nb1]."""
    nb1 = packed.num_blocks if nb1 is None else nb1
    if not 0 <= nb0 <= nb1 <= packed.num_blocks:
        raise ValueError(f"block range [{nb0}, {nb1}) outside [0, {packed.num_blocks}]")
    if nb0 == nb1 or out.shape[0] == 0:
        return
    s = packed.scheme
    if s is QuantScheme.INT8:
        kernel(bufs[0], bufs[1], packed.data, packed.scale, packed.wsum, out, nb0, nb1)
    elif s is QuantScheme.INT4:
        kernel(bufs[0], bufs[1], packed.data, packed.scale, packed.group_size, out, nb0, nb1)
    else:
        kernel(bufs[0], packed.data, out, nb0, nb1)


def linear(x, packed: PackedWeight, variant: str | None = None, op: str | None = None,
           tile: TileConfig | None = None) -> np.ndarray:
    """y fp32 [M, N] = x [M, D] @ w^T for a packed w [N, D], on one thread.

    x: fp32 (or anything ``reference.to_numpy_f32`` takes: fp16/bf16 torch tensors, float numpy)
    [M, D]. Activations are quantised as the scheme's kernels see them (int8 per token or bf16),
    so the result equals ``reference.linear(act_roundtrip(x), dequantize(quantize(w)))`` up to
    the scheme's accumulation rounding. ``variant`` / ``op`` (or ``tile``) override the host
    variant and the gemv/gemm heuristic of ``tiling.choose``.
    """
    packed = _check_packed(packed)
    dt = str(getattr(x, "dtype", type(x).__name__))
    if "float" not in dt:  # float16/32/64, torch.bfloat16, ...
        raise TypeError(f"x must be a floating-point array or tensor [M, D], got dtype {dt}")
    x = to_numpy_f32(x)
    if x.ndim != 2 or x.shape[1] != packed.d:
        raise ValueError(f"x must be [M, D={packed.d}] to match the packed weight [N={packed.n}, "
                         f"D={packed.d}], got shape {tuple(x.shape)}")
    m = x.shape[0]
    if m == 0:
        return np.zeros((0, packed.n), np.float32)
    ks = registry.kernel_set(packed.scheme, _resolve_variant(variant))
    if tile is None:
        tile = choose(m, packed.n, packed.d, ks, op=op)
    # a large-M kernel not exact for a stored INT4 -8 has an exact form (packing.int4_has_minus8)
    minus8 = tile.op == "gemm" and ks.gemm_exact is not None and int4_has_minus8(packed)
    kernel = ks.linear_kernel(tile.op, minus8)
    bufs = activation_buffers(m, packed)
    prepare_activations(x, packed, bufs)
    out = _align.empty((m, packed.n_pad), np.float32)
    step = max(1, tile.n_blocks_per_task)
    for nb0 in range(0, packed.num_blocks, step):
        launch(kernel, packed, bufs, out, nb0, min(nb0 + step, packed.num_blocks))
    return out if packed.n == packed.n_pad else np.ascontiguousarray(out[:, :packed.n])
