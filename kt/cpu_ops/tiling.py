"""Tiling heuristics for the CPU GEMM kernels: pure functions of the problem shape.

Nothing here touches data or asks which CPU this is. ``choose`` decides gemv vs gemm (below the
kernel set's ``gemv_max``, see ``registry.KernelSet``) and how the N blocks are split into tasks
(for threads); ``gemm_m_chunk`` is the token-chunk size the AVX ``gemm`` kernels use internally
(callable from jitted code too, so kernels and callers agree). Every choice can be overridden per
call through ``TileConfig`` fields passed to ``gemm.linear``.

Where gemv stops paying (measured: 1536 x 2048, one thread, Zen 4): gemv streams one weight block
at a time and loops over the tokens inside it (lines re-read from L1/L2 for the next token);
gemm's token tile reads each line once per tile but computes padding tokens when M is below the
tile. Since the gemm kernels prefetch their next weight group (``_simd.pf_next``), gemm wins from
M = 2 on AVX-512 and AVX2 alike (cold, M=2, gemm vs gemv: AVX-512 INT8 122 vs 151 us, INT4 77 vs
107, BF16 225 vs 283; AVX2 INT8 179 vs 199, INT4 66 vs 141, BF16 248 vs 357), so their sets have
``gemv_max`` 1; AMX's kernels register 4.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

from numba.extending import register_jitable

if TYPE_CHECKING:
    from .registry import KernelSet

__all__ = ["TileConfig", "choose", "gemm_m_chunk", "ACT_CHUNK_BYTES"]
# Activation rows of one gemm M chunk are kept within this many bytes so they stay in L2 (1-2 MiB
# per core on the targets) next to the weight group (4 blocks x 16 rows x D) being swept.
ACT_CHUNK_BYTES = 256 * 1024


@register_jitable
def gemm_m_chunk(m: int, row_bytes: int) -> int:
    """Tokens per M chunk of a gemm kernel: a multiple of 4, >= 4, <= ~ACT_CHUNK_BYTES of rows."""
    mc = (ACT_CHUNK_BYTES // max(row_bytes, 1)) // 4 * 4
    if mc < 4:
        mc = 4
    if mc > m:
        mc = max(m, 1)
    return mc


@dataclass(frozen=True)
class TileConfig:
    """op: "gemv" or "gemm"; n_blocks_per_task: 16-row blocks per kernel launch (thread task)."""

    op: str
    n_blocks_per_task: int


def choose(m: int, n: int, d: int, kernels: "KernelSet", threads: int = 1,
           op: str | None = None) -> TileConfig:
    """Pick the kernel op and the N split for an [M, D] x [N, D]^T product run by ``kernels``
    (a ``registry.KernelSet``).

    gemv for M <= ``kernels.gemv_max``, gemm above. The N blocks are split into about 4 tasks
    per thread, each a multiple of 4 blocks (the kernels' block group), so threads stay balanced
    without splitting a group.
    """
    if m < 1 or n < 1 or d < 1:
        raise ValueError(f"tiling needs positive M, N, D; got M={m}, N={n}, D={d}")
    if op is None:
        op = "gemv" if m <= kernels.gemv_max else "gemm"
    elif op not in ("gemv", "gemm"):
        raise ValueError(f"op must be 'gemv' or 'gemm', got {op!r}")
    nb = -(-n // 16)
    tasks = max(1, 4 * max(threads, 1)) if threads > 1 else 1
    per = -(-nb // tasks)
    per = max(4, -(-per // 4) * 4)
    return TileConfig(op, min(per, nb))
