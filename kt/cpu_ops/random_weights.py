"""Random packed weights at memcpy speed: expert stacks for benchmarks and real-shaped models
with random weights (``kt bench model``, benchmarks/bench_e2e.py), never made as float matrices.

Each 16-row block of a packed matrix is a window of lines copied from one random pool of int8
lines, so generation runs at memcpy speed and the per-row sums (``wsum``) come from prefix sums of
the pool instead of a pass over the weights.
"""
from __future__ import annotations

import math

import numpy as np

from ..config import QuantScheme
from ..reference import int4_ratio_scales
from . import _align
from .packing import BLOCK_N, PackedWeight, padded_dims

__all__ = ["LinePool", "random_packed"]

_LINE_ROWS, _LINE_K = BLOCK_N, 4  # one 64-byte packed line: 16 rows x 4 bytes
_STD_INT8 = math.sqrt((255 ** 2 - 1) / 12)  # std of integers uniform in [-127, 127]
_STD_INT4 = math.sqrt((15 ** 2 - 1) / 12)  # std of integers uniform in [-7, 7]


class LinePool:
    """Random 64-byte lines ([lines, 16, 4] int8 in [-127, 127]) and their per-row prefix sums, and
    as many INT4 lines (bytes of two nibbles in [1, 15], i.e. q in [-7, 7], as kt's quantiser
    writes them: a nibble of 0, q = -8, would send AMX prefill to the per-group kernel).

    prefix[m, r] = sum over lines < m of sum_i line[r, i]; a window of lines [o, o + J) has row sums
    prefix[o + J] - prefix[o] (the INT8 ``wsum`` of a 16-row block made of that window).
    """

    def __init__(self, lines: int, seed: int):
        rng = np.random.default_rng(seed)
        self.int8 = rng.integers(-127, 128, size=(lines, _LINE_ROWS, _LINE_K), dtype=np.int8)
        nib = rng.integers(1, 16, size=(2, lines, _LINE_ROWS, _LINE_K), dtype=np.uint8)
        self.int4 = nib[0] | (nib[1] << 4)
        self.prefix = np.zeros((lines + 1, _LINE_ROWS), np.int64)
        np.cumsum(self.int8.sum(axis=2, dtype=np.int32), axis=0, out=self.prefix[1:])

    @property
    def lines(self) -> int:
        return self.int8.shape[0]


def random_packed(pool: LinePool, e: int, n: int, d: int, scheme: QuantScheme, group_size: int,
                  rng: np.random.Generator) -> PackedWeight:
    """A stacked PackedWeight [E, N, D] of random quantised values with sane scales.

    Effective weights (q * scale) have std about 1/sqrt(D) (what trained layers look like), so
    activations keep their size through gate/up and down. N and D must need no padding
    (N % 16 == 0, D % 64 == 0 and D % G == 0 for INT4): padded lines would have to hold zeros.
    """
    n_pad, d_pad = padded_dims(n, d, scheme, group_size)
    if (n_pad, d_pad) != (n, d):
        align = max(64, group_size) if scheme is QuantScheme.INT4 else 64
        raise ValueError(f"random_packed needs N a multiple of 16 and D a multiple of {align} "
                         f"(no padding), got N={n}, D={d}")
    nb = n // BLOCK_N
    if scheme is QuantScheme.INT8:
        j = d // 4
        data = _align.empty((e, nb, j, _LINE_ROWS, _LINE_K), np.int8)
        wsum = _align.empty((e, n), np.int32)
        src = pool.int8
    elif scheme is QuantScheme.INT4:
        j = d // 8
        data = _align.empty((e, nb, j, _LINE_ROWS, _LINE_K), np.uint8)
        wsum = _align.zeros((e, 0), np.int32)
        src = pool.int4
    else:
        raise ValueError(f"random_packed makes INT8 or INT4 weights, not {scheme.value}")
    if j > pool.lines:
        raise ValueError(f"line pool of {pool.lines} lines is smaller than one block ({j} lines)")
    starts = rng.integers(0, pool.lines - j + 1, size=(e, nb))
    import torch

    # one gather of 64-byte lines for the whole stack: torch's index_select runs on all of torch's
    # CPU threads with the GIL released (numpy's take would run on one)
    idx = torch.from_numpy((starts[:, :, None] + np.arange(j)).reshape(-1))
    torch.index_select(torch.from_numpy(src.reshape(src.shape[0], -1)), 0, idx,
                       out=torch.from_numpy(data.reshape(-1, _LINE_ROWS * _LINE_K)))
    del idx
    if scheme is QuantScheme.INT8:
        wsum[:] = (pool.prefix[starts + j] - pool.prefix[starts]).reshape(e, n)
    if scheme is QuantScheme.INT8:
        scale = _align.aligned(
            (rng.uniform(0.9, 1.1, size=(e, n)) / (_STD_INT8 * math.sqrt(d))).astype(np.float32))
        return PackedWeight(scheme, n, d, n, d, 0, data, scale, wsum)
    ng = d // group_size
    s0 = (rng.uniform(0.9, 1.1, size=(e, nb, BLOCK_N, ng)) / (_STD_INT4 * math.sqrt(d))).astype(np.float32)
    # the quantiser's form s_row * r_g (what converted weights hold and the AMX ratio kernels need)
    ratio = int4_ratio_scales(s0.reshape(-1, ng)).reshape(e, nb, BLOCK_N, ng)
    scale = _align.aligned(np.ascontiguousarray(ratio.transpose(0, 1, 3, 2)))
    # every array on a 64-byte line, as CPUMoE needs them: a layer then holds these arrays rather
    # than its own aligned copies (which doubled the weights' memory: 27 GB more for INT8)
    return PackedWeight(scheme, n, d, n, d, group_size, data, scale, wsum)
