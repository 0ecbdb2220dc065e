"""GPU copies of experts, made from the CPU's packed weights (the CPU keeps the authoritative copy).

Building hot-expert weights from the CPU's packed layout, rather than from the checkpoint, means the
GPU and the CPU compute with the same quantised values: an expert's output does not depend on where
it runs, up to accumulation order. The unpacking runs on the GPU (the packed bytes are copied over
as they are), so a swap moves only quantised bytes through PCIe.
"""
from __future__ import annotations

import numpy as np
import torch

from .config import QuantScheme
from .cpu_ops.packing import PackedWeight

__all__ = ["packed_to_device", "GPU_WEIGHT_DTYPES"]

GPU_WEIGHT_DTYPES = ("bf16", "int8")


def _unlines(data: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """[S, NB, lines, 16, per] -> [S, n, d] (the inverse of packing's VNNI order)."""
    s, nb, lines, rows, per = data.shape
    return data.permute(0, 1, 3, 2, 4).reshape(s, nb * rows, lines * per)[:, :n, :d]


def packed_to_device(p: PackedWeight, experts, device, dtype: str = "bf16"):
    """Weights of ``experts`` (a list of expert ids) from a stacked PackedWeight onto ``device``.

    Returns (w [S, N, D], scale [S, N] fp32 or None): bf16 values, or int8 values with per-row
    scales (only for the INT8 scheme, whose scales are per row).
    """
    if dtype not in GPU_WEIGHT_DTYPES:
        raise ValueError(f"GPU expert dtype must be one of {GPU_WEIGHT_DTYPES}, got {dtype!r}")
    idx = np.asarray(list(experts), dtype=np.int64)
    n, d = p.n, p.d
    if idx.size == 0:
        wdt = torch.int8 if dtype == "int8" else torch.bfloat16
        scale = torch.zeros((0, n), dtype=torch.float32, device=device) if dtype == "int8" else None
        return torch.zeros((0, n, d), dtype=wdt, device=device), scale
    data = torch.from_numpy(np.ascontiguousarray(p.data[idx])).to(device, non_blocking=False)
    if p.scheme is QuantScheme.INT8:
        q = _unlines(data, n, d)
        scale = torch.from_numpy(np.ascontiguousarray(p.scale[idx][:, :n])).to(device)
        if dtype == "int8":
            return q.contiguous(), scale.contiguous()
        return (q.float() * scale[:, :, None]).to(torch.bfloat16).contiguous(), None
    if dtype == "int8":
        raise ValueError(f"int8 GPU experts need the INT8 CPU scheme (per-row scales), "
                         f"the CPU weights are {p.scheme.value}")
    if p.scheme is QuantScheme.BF16:
        bits = _unlines(data.view(torch.int16), n, d)
        return bits.view(torch.bfloat16).contiguous(), None
    # INT4: byte lines hold k4-rows 2j (low nibble) and 2j+1 (high nibble)
    lo = (data & 0x0F).to(torch.int8) - 8
    hi = (data >> 4).to(torch.int8) - 8
    s, nb, half, rows, per = data.shape
    nib = torch.stack([lo, hi], dim=3).reshape(s, nb, half * 2, rows, per)
    q = _unlines(nib, p.n_pad, p.d_pad).float()
    g = p.group_size
    sc = torch.from_numpy(np.ascontiguousarray(p.scale[idx])).to(device)  # [S, NB, ng, 16]
    sc = sc.permute(0, 1, 3, 2).reshape(s, p.n_pad, -1)  # [S, n_pad, ng]
    w = (q.reshape(s, p.n_pad, -1, g) * sc[:, :, :, None]).reshape(s, p.n_pad, p.d_pad)
    return w[:, :n, :d].to(torch.bfloat16).contiguous(), None
