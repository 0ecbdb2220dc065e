"""Test helpers shared by kt's tests and benchmarks.

``kt.testing.checkpoints`` builds tiny source checkpoints (HF families, fp8, fused, GGUF) and edits
converted directories; it is not imported here (its builders import torch, transformers, gguf).
"""
from __future__ import annotations

import numpy as np

from ..reference import to_numpy_f32

__all__ = ["assert_close", "assert_exact", "random_expert_weights"]


def assert_close(ref, out, *, rtol: float = 1e-5, atol: float = 0.0, what: str = "") -> None:
    """Elementwise |out - ref| <= atol + rtol * |ref|; on failure, say where and by how much."""
    r = to_numpy_f32(ref).astype(np.float64)
    o = to_numpy_f32(out).astype(np.float64)
    if r.shape != o.shape:
        raise AssertionError(f"{what}: shape {o.shape} != reference shape {r.shape}")
    nan_r, nan_o = np.isnan(r), np.isnan(o)
    if not np.array_equal(nan_r, nan_o):
        idx = np.argwhere(nan_r != nan_o)[0]
        raise AssertionError(f"{what}: NaN mismatch at {tuple(idx)}: ref={r[tuple(idx)]} out={o[tuple(idx)]}")
    ok = ~nan_r
    err = np.abs(o - r)
    bound = atol + rtol * np.abs(r)
    bad = (err > bound) & ok
    if bad.any():
        n_bad = int(bad.sum())
        worst = np.unravel_index(np.argmax(np.where(ok, err - bound, -np.inf)), r.shape)
        rel = err[worst] / max(abs(r[worst]), 1e-30)
        raise AssertionError(
            f"{what}: {n_bad} of {r.size} elements out of tolerance (rtol={rtol}, atol={atol}); "
            f"worst at {tuple(int(i) for i in worst)}: ref={r[worst]:.8g} out={o[worst]:.8g} "
            f"abs err={err[worst]:.3g} rel err={rel:.3g}")


def assert_exact(ref, out, what: str = "") -> None:
    assert_close(ref, out, rtol=0.0, atol=0.0, what=what)


def random_expert_weights(num_experts: int, hidden: int, intermediate: int, seed: int = 0,
                          dtype=np.float32):
    """gate, up [E, I, H] and down [E, H, I] with std 1/sqrt(fan_in) (what real layers look like)."""
    rng = np.random.default_rng(seed)
    gate = rng.standard_normal((num_experts, intermediate, hidden), dtype=np.float32) / np.sqrt(hidden)
    up = rng.standard_normal((num_experts, intermediate, hidden), dtype=np.float32) / np.sqrt(hidden)
    down = rng.standard_normal((num_experts, hidden, intermediate), dtype=np.float32) / np.sqrt(intermediate)
    return gate.astype(dtype), up.astype(dtype), down.astype(dtype)
