"""Wrappers around the quantise-and-pack kernels: shapes of the stored arrays, checks, launch.

Legend: E experts, N output rows, D reduction depth, G group size (INT4), NB = n_pad / 16.
"""
from __future__ import annotations

import numpy as np

from ..config import QuantScheme
from ..cpu_ops.packing import BLOCK_N, PackedWeight, padded_dims

__all__ = ["packed_array_specs", "quantize_pack_into", "fill_padding_rows", "as_kernel_source"]


def packed_array_specs(scheme: QuantScheme, e: int, n: int, d: int, group_size: int
                       ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes of the stacked arrays of E packed [N, D] weights: data, scale, wsum."""
    n_pad, d_pad = padded_dims(n, d, scheme, group_size)
    nb = n_pad // BLOCK_N
    if scheme is QuantScheme.INT8:
        return {"data": ((e, nb, d_pad // 4, BLOCK_N, 4), np.dtype(np.int8)),
                "scale": ((e, n_pad), np.dtype(np.float32)),
                "wsum": ((e, n_pad), np.dtype(np.int32))}
    if scheme is QuantScheme.INT4:
        return {"data": ((e, nb, d_pad // 8, BLOCK_N, 4), np.dtype(np.uint8)),
                "scale": ((e, nb, d_pad // group_size, BLOCK_N), np.dtype(np.float32)),
                "wsum": ((e, 0), np.dtype(np.int32))}
    return {"data": ((e, nb, d_pad // 2, BLOCK_N, 2), np.dtype(np.uint16)),
            "scale": ((e, 0), np.dtype(np.float32)),
            "wsum": ((e, 0), np.dtype(np.int32))}


def as_kernel_source(w) -> np.ndarray:
    """A 2-D weight as the kernels read it: a read-only uint16 (bf16 bits) or float32 array.

    numpy float16/float64 are converted to float32 (a copy of one matrix); torch tensors too.
    Always read-only (mapped files are), so each kernel compiles for one flavour per dtype.
    """
    if hasattr(w, "detach"):
        import torch

        w = w.detach().cpu()
        if w.dtype == torch.bfloat16:
            w = w.contiguous().view(torch.int16).numpy().view(np.uint16)
        else:
            w = w.float().numpy()
    w = np.asarray(w)
    if w.dtype != np.uint16 and w.dtype != np.float32:
        if w.dtype.kind != "f":
            raise TypeError(f"expert weight must be floating point (or uint16 bf16 bits), got {w.dtype}")
        w = w.astype(np.float32)
    if w.flags.writeable:
        w = w.view()
        w.flags.writeable = False
    return w


def quantize_pack_into(scheme: QuantScheme, group_size: int, src: np.ndarray, row0: int,
                       data: np.ndarray, scale: np.ndarray, wsum: np.ndarray) -> int:
    """Quantise src [N, D] into rows row0.. of ONE expert's packed arrays; returns #non-finite."""
    from . import _quant_kernels as qk

    if src.ndim != 2:
        raise ValueError(f"expert matrix must be 2-D [N, D], got shape {src.shape}")
    if src.dtype != np.uint16 and src.dtype != np.float32:
        raise TypeError(f"kernel source must be uint16 (bf16 bits) or float32, got {src.dtype}")
    # the kernels store whole 4-byte groups: view the last axis as one uint32
    data32 = data.view(np.uint32).reshape(data.shape[:-1])
    if scheme is QuantScheme.INT8:
        return int(qk.quant_pack_int8(src, row0, data32, scale, wsum))
    if scheme is QuantScheme.INT4:
        return int(qk.quant_pack_int4(src, row0, group_size, data32, scale))
    return int(qk.quant_pack_bf16(src, row0, data32))


def fill_padding_rows(scheme: QuantScheme, n: int, data: np.ndarray, scale: np.ndarray,
                      wsum: np.ndarray) -> None:
    """Set rows n .. n_pad of a stack (leading E axis) to what ``pack_quantized`` stores there."""
    n_pad = data.shape[1] * BLOCK_N
    for row in range(n, n_pad):
        b, r = divmod(row, BLOCK_N)
        data[:, b, :, r, :] = 8 | (8 << 4) if scheme is QuantScheme.INT4 else 0
        if scheme is QuantScheme.INT8:
            scale[:, row] = 0
            wsum[:, row] = 0
        elif scheme is QuantScheme.INT4:
            scale[:, b, :, r] = 0


def stack_view(scheme: QuantScheme, n: int, d: int, group_size: int, data, scale, wsum
               ) -> PackedWeight:
    """Wrap stacked arrays (leading E axis) as a PackedWeight without copying."""
    n_pad, d_pad = padded_dims(n, d, scheme, group_size)
    g = group_size if scheme is QuantScheme.INT4 else 0
    return PackedWeight(scheme, n, d, n_pad, d_pad, g, data, scale, wsum)
