"""The one packed weight layout that the AMX, AVX-512 and AVX2 kernels read directly.

A weight matrix w [N, D] (N output rows, D reduction depth) is stored in blocks of 16 output rows.
N is padded to ``n_pad`` (a multiple of 16) and D to ``d_pad`` (a multiple of 64, and of G for
INT4) with zeros. Within a block, the order is the "VNNI" order: consecutive k values of one row
sit next to each other, 16 rows side by side, so one 64-byte line holds 16 rows x (64 bytes / 16).

INT8  data  int8   [NB, d_pad/4, 16, 4]   data[b, j, r, i] = q[16b + r, 4j + i]
      scale fp32   [n_pad]                one scale per output row
      wsum  int32  [n_pad]                sum_k q[n, k] (for the unsigned-activation VNNI trick)
INT4  data  uint8  [NB, d_pad/8, 16, 4]   low nibble  = q[16b + r, 8j + i] + 8
                                          high nibble = q[16b + r, 8j + 4 + i] + 8
      scale fp32   [NB, d_pad/G, 16]      one scale per (row, group of G along D)
                                          (kt's quantiser writes q in [-7, 7]; a nibble of 0,
                                          q = -8, runs exactly, but on AMX not on the ratio
                                          kernels: ``int4_has_minus8``)
BF16  data  uint16 [NB, d_pad/2, 16, 2]   data[b, j, r, i] = bf16(w[16b + r, 2j + i])

INT4 ratio table (``int4_ratio_table``, made at load by layers whose kernels read it): the group
scales as s_row * r_g (``reference.int4_ratio_scales``), fp32 [1, rows, 16] per matrix: the s_row
of every block (16 fp32 each), then every (block, group)'s 16 ratios r_g as int8.

One 64-byte line is: INT8 one "k4 row" (16 rows x 4 k), the B operand of ``vpdpbusd`` and one of
the 16 rows of an AMX ``tdpbssd`` B tile; INT4 two k4 rows (low then high nibbles); BF16 one
"k2 row" (16 rows x 2 k), the B operand of ``vdpbf16ps`` / ``tdpbf16ps``.

Stacks of experts add a leading E axis to every array (``pack_experts``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import GROUP_SIZES, QuantScheme
from .. import reference as ref
from . import _align

__all__ = ["PackedWeight", "pack", "unpack", "pack_quantized", "aligned_packed", "padded_dims", "pack_experts",
           "int4_ratio_table", "int4_table_rows", "int4_has_minus8", "BLOCK_N", "D_ALIGN"]

BLOCK_N = 16
D_ALIGN = 64


def padded_dims(n: int, d: int, scheme: QuantScheme, group_size: int = 64) -> tuple[int, int]:
    """(n_pad, d_pad) for an [N, D] weight under ``scheme``."""
    if n <= 0 or d <= 0:
        raise ValueError(f"weight dims must be positive, got N={n}, D={d}")
    align = D_ALIGN
    if scheme is QuantScheme.INT4:
        if group_size not in GROUP_SIZES:
            raise ValueError(f"INT4 group_size must be one of {GROUP_SIZES}, got {group_size}")
        align = max(D_ALIGN, group_size)
    n_pad = -(-n // BLOCK_N) * BLOCK_N
    d_pad = -(-d // align) * align
    return n_pad, d_pad


@dataclass(frozen=True)
class PackedWeight:
    """A packed [N, D] weight (or a stack of E of them when ``data.ndim == 5``)."""

    scheme: QuantScheme
    n: int
    d: int
    n_pad: int
    d_pad: int
    group_size: int
    data: np.ndarray
    scale: np.ndarray
    wsum: np.ndarray

    @property
    def num_blocks(self) -> int:
        return self.n_pad // BLOCK_N

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale.nbytes + self.wsum.nbytes)

    def expert(self, e: int) -> "PackedWeight":
        if self.data.ndim != 5:
            raise ValueError("expert() needs a stacked PackedWeight (from pack_experts)")
        return PackedWeight(self.scheme, self.n, self.d, self.n_pad, self.d_pad, self.group_size,
                            self.data[e], self.scale[e], self.wsum[e])


def _to_lines(q: np.ndarray, n_pad: int, d_pad: int, per: int, dtype) -> np.ndarray:
    """[N, D] -> zero-padded [NB, d_pad/per, 16, per] in the VNNI order."""
    n, d = q.shape
    full = np.zeros((n_pad, d_pad), dtype)
    full[:n, :d] = q
    return _align.aligned(
        full.reshape(n_pad // BLOCK_N, BLOCK_N, d_pad // per, per).transpose(0, 2, 1, 3))


def _from_lines(data: np.ndarray, n: int, d: int) -> np.ndarray:
    nb, lines, rows, per = data.shape
    return data.transpose(0, 2, 1, 3).reshape(nb * rows, lines * per)[:n, :d]


def pack_quantized(qw: ref.QuantizedWeight, group_size: int = 64) -> PackedWeight:
    """Pack an already-quantised weight (from ``reference.quantize``)."""
    n, d = qw.shape
    scheme = qw.scheme
    g = qw.group_size or group_size
    n_pad, d_pad = padded_dims(n, d, scheme, g)
    empty_i = np.zeros(0, np.int32)
    if scheme is QuantScheme.INT8:
        data = _to_lines(qw.q, n_pad, d_pad, 4, np.int8)
        scale = _align.zeros(n_pad, np.float32)
        scale[:n] = qw.scale
        wsum = _align.zeros(n_pad, np.int32)
        wsum[:n] = qw.q.astype(np.int32).sum(axis=1)
        return PackedWeight(scheme, n, d, n_pad, d_pad, 0, data, scale, wsum)
    if scheme is QuantScheme.INT4:
        nib = _to_lines((qw.q.astype(np.int16) + 8).astype(np.uint8), n_pad, d_pad, 4, np.uint8)
        if n_pad > n or d_pad > d:  # padding must hold q = 0, i.e. nibble 8
            mask = _to_lines(np.ones((n, d), np.uint8), n_pad, d_pad, 4, np.uint8)
            nib = np.where(mask == 1, nib, np.uint8(8))
        # nib is [NB, d_pad/4, 16, 4]; k4 rows 2j and 2j+1 share a byte.
        data = _align.aligned((nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8))
        ng = d_pad // g
        sc = np.zeros((n_pad, ng), np.float32)
        sc[:n, : qw.scale.shape[1]] = qw.scale
        scale = _align.aligned(sc.reshape(n_pad // BLOCK_N, BLOCK_N, ng).transpose(0, 2, 1))
        return PackedWeight(scheme, n, d, n_pad, d_pad, g, data, scale, empty_i)
    bits = ref.f32_to_bf16_bits(qw.q)
    data = _to_lines(bits, n_pad, d_pad, 2, np.uint16)
    return PackedWeight(scheme, n, d, n_pad, d_pad, 0, data, np.zeros(0, np.float32), empty_i)


def aligned_packed(p: PackedWeight) -> PackedWeight:
    """``p`` itself when its arrays are C-contiguous and start at 64-byte boundaries, else a copy
    that does (see ``_align``: the kernels read 64-byte rows)."""
    arrs = [_align.aligned(a) for a in (p.data, p.scale, p.wsum)]
    if all(a is b for a, b in zip(arrs, (p.data, p.scale, p.wsum))):
        return p
    return PackedWeight(p.scheme, p.n, p.d, p.n_pad, p.d_pad, p.group_size, *arrs)


def pack(w, scheme: QuantScheme | str, group_size: int = 64) -> PackedWeight:
    """Quantise (per ``reference.quantize``) and pack a weight w [N, D]."""
    scheme = QuantScheme.parse(scheme)
    return pack_quantized(ref.quantize(w, scheme, group_size), group_size)


def unpack(p: PackedWeight) -> ref.QuantizedWeight:
    """The inverse of ``pack_quantized`` (single matrix): unpack(pack(w)) == quantize(w)."""
    if p.data.ndim != 4:
        raise ValueError("unpack expects a single packed matrix; use .expert(e) on a stack")
    n, d = p.n, p.d
    if p.scheme is QuantScheme.INT8:
        return ref.QuantizedWeight(p.scheme, _from_lines(p.data, n, d).copy(), p.scale[:n].copy())
    if p.scheme is QuantScheme.INT4:
        lo = (p.data & 0x0F).astype(np.int8) - 8
        hi = (p.data >> 4).astype(np.int8) - 8
        nb, half, rows, per = p.data.shape
        nib = np.empty((nb, half * 2, rows, per), np.int8)
        nib[:, 0::2] = lo
        nib[:, 1::2] = hi
        q = _from_lines(nib, n, d).copy()
        ng_real = -(-d // p.group_size)
        sc = p.scale.transpose(0, 2, 1).reshape(p.n_pad, -1)[:n, :ng_real].copy()
        return ref.QuantizedWeight(p.scheme, q, sc, p.group_size)
    vals = ref.bf16_bits_to_f32(_from_lines(p.data, n, d))
    return ref.QuantizedWeight(p.scheme, vals.copy(), None)


def pack_experts(w, scheme: QuantScheme | str, group_size: int = 64) -> PackedWeight:
    """Pack a stack of expert weights w [E, N, D] into one PackedWeight with a leading E axis."""
    scheme = QuantScheme.parse(scheme)
    shape = tuple(w.shape)
    if len(shape) != 3:
        raise ValueError(f"pack_experts expects [E, N, D], got shape {shape}")
    parts = [pack(w[e], scheme, group_size) for e in range(shape[0])]
    p0 = parts[0]
    return PackedWeight(scheme, p0.n, p0.d, p0.n_pad, p0.d_pad, p0.group_size,
                        *(np.stack(arrs, out=_align.empty((len(arrs),) + arrs[0].shape, arrs[0].dtype))
                          for arrs in zip(*((p.data, p.scale, p.wsum) for p in parts))))


def int4_has_minus8(p: PackedWeight) -> bool:
    """Whether an INT4 weight (or stack) holds the value -8 (a nibble of 0). The format can store
    it, but kt's quantiser writes [-7, 7] (``reference.QuantizedWeight``), and the AMX INT4 ratio
    kernels form r_g * q in int8, which -8 leaves for r_g >= 17: callers that would run them take
    the per-group kernel for such a weight (``CPUMoE``, ``gemm.linear``). One pass over the values
    (~6 GB/s on one dev core), remembered on the object."""
    if p.scheme is not QuantScheme.INT4:
        return False
    known = p.__dict__.get("_has_minus8")
    if known is None:
        from .kernels.scan import any_zero_nibble

        known = bool(any_zero_nibble(np.ascontiguousarray(p.data).reshape(-1).view(np.uint64)))
        object.__setattr__(p, "_has_minus8", known)  # a frozen dataclass: a cache, not a field
    return known


def int4_table_rows(nb: int, ng: int) -> int:
    """Rows of 16 fp32 words in one matrix's INT4 ratio table: nb of s_row, then nb * ng * 16
    bytes of ratios."""
    return nb + -(-nb * ng // 4)


def int4_ratio_table(scale: np.ndarray) -> np.ndarray | None:
    """The INT4 ratio tables of stacked group scales [E, NB, ng, 16] -> fp32 [E, 1, rows, 16]
    (see the module docstring), or None if a scale is not s_row * r_g with r_g an integer in
    [0, ``reference.INT4_RATIO_MAX``]. The arithmetic is the AMX kernels' own ratio maker's
    (``kernels.amx.int4._int4_ratios``), in fp32: s_row = max_g(scale) / INT4_RATIO_MAX, r_g =
    rint(scale * (1 / s_row)), each checked exact; so the kernels that read a table compute what
    the ones that make the ratios at every call do."""
    e, nb, ng, _ = scale.shape
    f32 = np.float32
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        sr = (scale.max(axis=2) / f32(ref.INT4_RATIO_MAX)).astype(f32)          # [E, NB, 16]
        inv = np.where(sr > 0, f32(1.0) / np.where(sr > 0, sr, f32(1.0)), f32(0.0)).astype(f32)
        r = np.rint((scale * inv[:, :, None, :]).astype(f32))
        ok = (r * sr[:, :, None, :] == scale) & (r >= 0) & (r <= ref.INT4_RATIO_MAX)
    if not ok.all():
        return None
    tab = _align.zeros((e, 1, int4_table_rows(nb, ng), BLOCK_N), np.float32)
    flat = tab.reshape(e, -1)
    flat[:, :nb * 16] = sr.reshape(e, -1)
    flat[:, nb * 16:].view(np.int8)[:, :nb * ng * 16] = r.astype(np.int8).reshape(e, -1)
    return tab
