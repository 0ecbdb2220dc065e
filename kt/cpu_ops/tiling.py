"""Tiling heuristics for the CPU GEMM kernels: pure functions of the problem shape.

Nothing here touches data. ``choose`` decides gemv vs gemm and how the N blocks are split into
tasks (for threads); ``gemm_m_chunk`` is the token-chunk size the ``gemm`` kernels use internally
(callable from jitted code too, so kernels and callers agree). Every choice can be overridden per
call through ``TileConfig`` fields passed to ``gemm.linear``.
"""
from __future__ import annotations

from dataclasses import dataclass

from numba.extending import register_jitable

from ..config import QuantScheme

__all__ = ["TileConfig", "choose", "gemm_m_chunk", "gemv_max_m", "ACT_CHUNK_BYTES"]
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


def gemv_max_m(scheme: QuantScheme | str, variant: str) -> int:
    """Largest M for which ``gemv`` beats ``gemm`` (measured: 1536 x 2048, one thread, Zen 4).

    gemv streams one weight block at a time and loops over the tokens inside it (lines re-read
    from L1/L2 for the next token); gemm's 4-token tile reads each line once per 4 tokens but
    computes padding tokens when M < 4. AVX-512: gemv wins only at M = 1 (INT4 was up to 2 until
    the gemm kernels prefetched their next block group: cold, M=2 gemm 77 us vs gemv 107). AVX2
    kernels (also what the avx512 variant and BF16 below avx512_bf16 run): INT8 up to 3, BF16 up
    to 2, INT4 1. AMX: its own kernels, 4.
    """
    scheme = QuantScheme.parse(scheme)
    if variant == "amx":
        return 4
    avx2_kernels = variant in ("avx2", "avx512") or (
        scheme is QuantScheme.BF16 and variant != "avx512_bf16")
    if avx2_kernels:
        return {QuantScheme.INT8: 3, QuantScheme.INT4: 1, QuantScheme.BF16: 2}[scheme]
    return 1


@dataclass(frozen=True)
class TileConfig:
    """op: "gemv" or "gemm"; n_blocks_per_task: 16-row blocks per kernel launch (thread task)."""

    op: str
    n_blocks_per_task: int


def choose(m: int, n: int, d: int, scheme: QuantScheme | str, variant: str,
           threads: int = 1, op: str | None = None) -> TileConfig:
    """Pick the kernel op and the N split for an [M, D] x [N, D]^T product.

    gemv for M <= ``gemv_max_m(scheme, variant)``, gemm above. The N blocks
    are split into about 4 tasks per thread, each a multiple of 4 blocks (the kernels' block
    group), so threads stay balanced without splitting a group.
    """
    scheme = QuantScheme.parse(scheme)
    if m < 1 or n < 1 or d < 1:
        raise ValueError(f"tiling needs positive M, N, D; got M={m}, N={n}, D={d}")
    if op is None:
        op = "gemv" if m <= gemv_max_m(scheme, variant) else "gemm"
    elif op not in ("gemv", "gemm"):
        raise ValueError(f"op must be 'gemv' or 'gemm', got {op!r}")
    nb = -(-n // 16)
    tasks = max(1, 4 * max(threads, 1)) if threads > 1 else 1
    per = -(-nb // tasks)
    per = max(4, -(-per // 4) * 4)
    return TileConfig(op, min(per, nb))
