"""The one fp32 reference of every op kt computes: the spec that every kernel is tested against.

Legend: T tokens, E experts, K top-k, H hidden size, I expert intermediate size, G group size,
N output rows of a GEMM, D its reduction depth (H for gate/up, I for down).

Everything here is plain numpy, written as directly as possible. Quantised kernels are compared
with ``linear(quantize_act(x), dequantize(quantize(w)))`` so that tolerances can be tight:
integer schemes must match that to fp32 rounding of the epilogue, because their accumulation
is exact.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ACT_MODES, GROUP_SIZES, QuantScheme

__all__ = [
    "QuantizedWeight", "int4_ratio_scales", "INT4_RATIO_MAX",
    "to_numpy_f32",
    "bf16_round",
    "f32_to_bf16_bits",
    "bf16_bits_to_f32",
    "quantize",
    "dequantize",
    "quantize_act",
    "dequantize_act",
    "act_roundtrip",
    "linear",
    "silu",
    "moe_forward",
    "moe_forward_quantized",
    "relative_error",
]


# ----------------------------------------------------------------------------- conversions

def to_numpy_f32(a) -> np.ndarray:
    """Any torch tensor / numpy array (fp32, fp16, bf16, ints) -> contiguous fp32 numpy array."""
    if hasattr(a, "detach"):  # torch.Tensor, without importing torch here
        a = a.detach().to("cpu")
        if str(a.dtype) == "torch.bfloat16":
            a = a.float()
        a = a.numpy()
    return np.ascontiguousarray(np.asarray(a, dtype=np.float32))


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit patterns (uint16), round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    out = rounded.astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round fp32 values to the nearest bf16 value (returned as fp32)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(x))


# ----------------------------------------------------------------------------- weights

@dataclass(frozen=True)
class QuantizedWeight:
    """A quantised [N, D] weight matrix.

    q: INT8 int8 [N, D] in [-127, 127]; INT4 int8 [N, D] in [-7, 7]; BF16 fp32 [N, D] holding
       bf16-representable values.
    scale: INT8 fp32 [N]; INT4 fp32 [N, ceil(D / G)]; BF16 None.
    """

    scheme: QuantScheme
    q: np.ndarray
    scale: np.ndarray | None
    group_size: int | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)


def _safe_inv(scale: np.ndarray, qmax: float) -> np.ndarray:
    # amax / qmax is the scale; a zero row quantises to zeros with scale 0.
    with np.errstate(divide="ignore"):
        inv = np.where(scale > 0, np.float32(1.0) / scale, np.float32(0.0))
    return inv.astype(np.float32)


def quantize(w, scheme: QuantScheme | str, group_size: int = 64) -> QuantizedWeight:
    """Quantise a weight matrix w [N, D] (rows are output features, D the reduction depth)."""
    scheme = QuantScheme.parse(scheme)
    w = to_numpy_f32(w)
    if w.ndim != 2:
        raise ValueError(f"quantize expects a 2-D weight [N, D], got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError("quantize: weight contains NaN or Inf")
    n, d = w.shape
    if scheme is QuantScheme.BF16:
        return QuantizedWeight(scheme, bf16_round(w), None)
    if scheme is QuantScheme.INT8:
        amax = np.abs(w).max(axis=1) if d else np.zeros(n, np.float32)
        scale = (amax / np.float32(127.0)).astype(np.float32)
        q = np.clip(np.rint(w * _safe_inv(scale, 127)[:, None]), -127, 127).astype(np.int8)
        return QuantizedWeight(scheme, q, scale)
    if group_size not in GROUP_SIZES:
        raise ValueError(f"INT4 group_size must be one of {GROUP_SIZES}, got {group_size}")
    g = group_size
    ng = -(-d // g)
    wp = np.zeros((n, ng * g), np.float32)
    wp[:, :d] = w
    wg = wp.reshape(n, ng, g)
    scale = int4_ratio_scales((np.abs(wg).max(axis=2) / np.float32(7.0)).astype(np.float32))
    q = np.clip(np.rint(wg * _safe_inv(scale, 7)[:, :, None]), -7, 7).astype(np.int8)
    return QuantizedWeight(scheme, q.reshape(n, ng * g)[:, :d].copy(), scale, g)


INT4_RATIO_MAX = 18  # r * q with q in [-7, 7] stays in int8 (|r q| <= 126)
_RATIO_MANTISSA_MASK = np.uint32(0xFFFFFFE0)  # 19 significant bits: s_row * r (r < 32) is exact


def int4_ratio_scales(s0: np.ndarray) -> np.ndarray:
    """INT4 group scales of the form s_row * r_g (r_g an integer in [1, INT4_RATIO_MAX], 0 for an
    all-zero group), from the plain scales s0 = amax_g / 7 [N, ng].

    s_row = max_g(s0) / INT4_RATIO_MAX with the low 5 mantissa bits cleared (so s_row * r is
    exact in fp32 and max_g(scale) / INT4_RATIO_MAX gives s_row back exactly), r_g = rint(s0_g /
    s_row) clipped to [1, INT4_RATIO_MAX]. With such scales r_g * q fits in int8, so an INT4
    product over all groups is one exact int32 sum of x * (r_g q) scaled by s_row: the AMX prefill
    kernel runs it without a per-group flush. On Gaussian weights the weight error is 0.3 %
    larger than with s0 (0.1080 vs 0.1077 relative, N=1536, D=2048, G=64). A row whose s_row
    would be 0 (subnormal amax) keeps s0.
    """
    s0 = np.asarray(s0, np.float32)
    m = s0.max(axis=1) if s0.shape[1] else np.zeros(s0.shape[0], np.float32)
    srow = (m / np.float32(INT4_RATIO_MAX)).astype(np.float32)
    srow = (srow.view(np.uint32) & _RATIO_MANTISSA_MASK).view(np.float32)
    ok = srow > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.rint(s0 / np.where(ok, srow, np.float32(1.0))[:, None])
    r = np.where(s0 > 0, np.clip(r, 1, INT4_RATIO_MAX), 0).astype(np.float32)
    return np.where(ok[:, None], srow[:, None] * r, s0).astype(np.float32)


def dequantize(qw: QuantizedWeight) -> np.ndarray:
    """fp32 [N, D] values the quantised weight stands for."""
    if qw.scheme is QuantScheme.BF16:
        return qw.q.astype(np.float32)
    if qw.scheme is QuantScheme.INT8:
        return qw.q.astype(np.float32) * qw.scale[:, None]
    n, d = qw.q.shape
    g = qw.group_size
    ng = qw.scale.shape[1]
    qp = np.zeros((n, ng * g), np.float32)
    qp[:, :d] = qw.q
    return (qp.reshape(n, ng, g) * qw.scale[:, :, None]).reshape(n, ng * g)[:, :d]


# ----------------------------------------------------------------------------- activations

def quantize_act(x) -> tuple[np.ndarray, np.ndarray]:
    """Per-token symmetric int8: x [T, D] fp32 -> (xq int8 [T, D], xs fp32 [T]).

    xs = amax / 127 and xq = rint(x * (127 / amax)), in fp32 arithmetic exactly as the kernels
    do it (round half to even). An all-zero row gets xs = 0 and xq = 0.
    """
    x = to_numpy_f32(x)
    amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    amax = amax.astype(np.float32)
    xs = (amax / np.float32(127.0)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
        xq = np.clip(np.rint(x * inv[:, None]), -127, 127)
    xq = np.nan_to_num(xq, nan=0.0).astype(np.int8)
    return xq, xs


def dequantize_act(xq: np.ndarray, xs: np.ndarray) -> np.ndarray:
    return xq.astype(np.float32) * xs[:, None]


def quantize_act2(x) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Two-level per-token int8 ("int8x2" activations): x ~ xs1 * xq1 + xs2 * xq2.

    (xq1, xs1) = quantize_act(x); the residual r = x - xq1 * xs1 (fp32) is quantised the same
    way, (xq2, xs2) = quantize_act(r). About 15 bits per value: an int8 kernel applied to both
    rows and the two fp32 results summed computes x @ w^T with the weight error alone.
    """
    x = to_numpy_f32(x)
    q1, s1 = quantize_act(x)
    r = (x - q1.astype(np.float32) * s1[:, None]).astype(np.float32)
    q2, s2 = quantize_act(r)
    return q1, s1, q2, s2


def act_roundtrip(x, scheme: QuantScheme | str, activations: str = "int8") -> np.ndarray:
    """What the kernels of a scheme see of the activations: int8 per token (``activations``
    "int8", or two levels "int8x2", see ``quantize_act2``), or bf16 for BF16."""
    scheme = QuantScheme.parse(scheme)
    if scheme is QuantScheme.BF16:
        return bf16_round(to_numpy_f32(x))
    if activations == "int8x2":
        q1, s1, q2, s2 = quantize_act2(x)
        return (dequantize_act(q1, s1).astype(np.float64)
                + dequantize_act(q2, s2).astype(np.float64))
    if activations != "int8":
        raise ValueError(f"activations must be one of {ACT_MODES}, got {activations!r}")
    return dequantize_act(*quantize_act(x))


# ----------------------------------------------------------------------------- ops

def linear(x, w) -> np.ndarray:
    """y [T, N] = x [T, D] @ w[N, D]^T, accumulated in fp64, returned as fp32."""
    x = to_numpy_f32(x).astype(np.float64)
    w = to_numpy_f32(w).astype(np.float64)
    return (x @ w.T).astype(np.float32)


def silu(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore"):
        return (x / (np.float32(1.0) + np.exp(-x))).astype(np.float32)


def _check_routing(x, topk_ids, topk_weights, num_experts):
    ids = np.asarray(topk_ids.cpu() if hasattr(topk_ids, "cpu") else topk_ids).astype(np.int64)
    tw = to_numpy_f32(topk_weights)
    if ids.shape != tw.shape or ids.ndim != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {ids.shape} / topk_weights {tw.shape} do not match x {x.shape}")
    if ids.size and (ids.max() >= num_experts or ids.min() < -1):
        raise ValueError(f"expert ids must be in [-1, {num_experts}), got [{ids.min()}, {ids.max()}]")
    return ids, tw


def _moe_combine(x, topk_ids, topk_weights, num_experts, skip_mask, expert_fn) -> np.ndarray:
    """out[t] = sum_k w[t,k] * expert_fn(e, x[tokens of e]) over the experts not skipped."""
    ids, tw = _check_routing(x, topk_ids, topk_weights, num_experts)
    out = np.zeros(x.shape, np.float64)
    for e in range(num_experts):
        if skip_mask is not None and skip_mask[e]:
            continue
        tok, slot = np.nonzero(ids == e)
        if tok.size == 0:
            continue
        y = expert_fn(e, x[tok]).astype(np.float64)
        np.add.at(out, tok, y * tw[tok, slot][:, None])
    return out.astype(np.float32)


def moe_forward(x, topk_ids, topk_weights, w13, w2, skip_mask=None) -> np.ndarray:
    """The MoE expert computation in fp32 (fp64 accumulation).

    x [T, H]; topk_ids [T, K] (-1 = skip); topk_weights [T, K]; w13 [E, 2I, H] (gate rows first,
    then up rows); w2 [E, H, I]; skip_mask [E] bool (True = computed elsewhere, e.g. on the GPU).
    out[t] = sum_k w[t,k] * w2[e] @ (silu(gate_e x_t) * (up_e x_t)), e = topk_ids[t, k].
    """
    x = to_numpy_f32(x)
    w13 = to_numpy_f32(w13)
    w2 = to_numpy_f32(w2)
    inter = w13.shape[1] // 2

    def expert(e, xe):
        gu = linear(xe, w13[e])
        return linear(silu(gu[:, :inter]) * gu[:, inter:], w2[e])

    return _moe_combine(x, topk_ids, topk_weights, w13.shape[0], skip_mask, expert)


def moe_forward_quantized(x, topk_ids, topk_weights, q13, q2, skip_mask=None,
                          activations: str = "int8") -> np.ndarray:
    """The MoE forward exactly as a quantised kernel computes it.

    q13 / q2: lists of per-expert ``QuantizedWeight`` ([2I, H] and [H, I]). Activations are
    rounded as the scheme's kernels round them (int8 per token, two int8 levels for
    ``activations="int8x2"``, or bf16) before each GEMM.
    """
    x = to_numpy_f32(x)
    scheme = q13[0].scheme

    def expert(e, xe):
        inter = q13[e].shape[0] // 2
        gu = linear(act_roundtrip(xe, scheme, activations), dequantize(q13[e]))
        h = silu(gu[:, :inter]) * gu[:, inter:]
        return linear(act_roundtrip(h, scheme, activations), dequantize(q2[e]))

    return _moe_combine(x, topk_ids, topk_weights, len(q13), skip_mask, expert)


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| over all elements (fp64)."""
    out = to_numpy_f32(out).astype(np.float64)
    ref = to_numpy_f32(ref).astype(np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))
