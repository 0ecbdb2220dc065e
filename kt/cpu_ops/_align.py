"""Buffers that start at a 64-byte (cache-line) boundary, for Python and for jitted code.

The kernels read and write 64-byte rows: an AMX tile row, a zmm register, a 16-float output row.
NumPy's and Numba's allocators start small and medium arrays 16 or 32 bytes past a line boundary,
so every such row then straddles two lines: twice the L1/L2 accesses per tile load and split
stores. On the device (Emerald Rapids, ``benchmarks/amx_panel_probe.py``) 64-byte
aligned weights, packed activations and outputs made the INT8 AMX GEMM 1.25-1.5x faster on one
core and on all 16 (qwen3 gate+up and down shapes, warm and cold weights).

Jitted code allocates its scratch with ``kernels._simd.empty_line``. Row strides are the callers'
business: the packed layouts and the MoE workspaces have rows of a multiple of 64 bytes (d_pad is
a multiple of 64 elements, n_pad of 16 fp32), so aligning the start aligns every row.
"""
from __future__ import annotations

import numpy as np

LINE = 64

__all__ = ["LINE", "empty", "zeros", "copy", "is_aligned", "aligned"]


def empty(shape, dtype) -> np.ndarray:
    """np.empty(shape, dtype) starting at a 64-byte boundary (the base buffer is 64 bytes longer)."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(int(s) for s in shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    buf = np.empty(nbytes + LINE, np.uint8)
    o = -buf.ctypes.data % LINE
    return buf[o:o + nbytes].view(dtype).reshape(shape)


def zeros(shape, dtype) -> np.ndarray:
    """np.zeros(shape, dtype) starting at a 64-byte boundary."""
    a = empty(shape, dtype)
    a[...] = 0
    return a


def copy(a: np.ndarray, dtype=None) -> np.ndarray:
    """A C-contiguous copy of ``a`` (converted to ``dtype`` if given) starting at a 64-byte boundary."""
    b = empty(a.shape, a.dtype if dtype is None else dtype)
    b[...] = a
    return b


def is_aligned(a: np.ndarray) -> bool:
    return a.ctypes.data % LINE == 0


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` itself when it is C-contiguous and starts at a line boundary, else an aligned copy
    (a read-only mapping stays a mapping when it is aligned)."""
    if a.flags.c_contiguous and (a.size == 0 or is_aligned(a)):
        return a
    return copy(a)

