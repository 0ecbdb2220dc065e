"""Synthetic skewed routing for tests, benchmarks and `kt placement record --synthetic`.

Legend: L layers, T tokens, K top-k, E experts.
"""
from __future__ import annotations

import numpy as np

__all__ = ["zipf_routing"]


def zipf_routing(num_layers: int, num_experts: int, top_k: int, num_tokens: int, *, alpha: float = 1.0,
                 phases: int = 1, seed: int = 0, sample_seed: int | None = None,
                 return_weights: bool = False):
    """Zipf-like routing: in each layer expert popularity follows ``1 / rank**alpha`` over a random
    ranking of the experts (so every layer has different hot experts); each token picks K distinct
    experts (Gumbel top-k). With ``phases > 1`` the tokens are cut into that many equal spans and
    every span draws new rankings: the hot set drifts over time.

    seed fixes the rankings, sample_seed (default: derived from seed) the tokens drawn from them:
    two calls with the same seed and different sample_seed give two samples of one distribution
    (a calibration set and an evaluation set).

    Returns topk_ids [L, T, K] int64 (each token's experts, most likely first), and with
    ``return_weights`` also router weights [L, T, K] float32 (the picked probabilities, normalised).
    """
    for name, v in (("num_layers", num_layers), ("num_experts", num_experts), ("top_k", top_k),
                    ("num_tokens", num_tokens), ("phases", phases)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if top_k > num_experts:
        raise ValueError(f"top_k={top_k} exceeds num_experts={num_experts}")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha!r}")
    rank_rng = np.random.default_rng(seed)
    rng = np.random.default_rng([seed, 1] if sample_seed is None else [sample_seed, 2])
    L, E, K, T = num_layers, num_experts, top_k, num_tokens
    logp_rank = -alpha * np.log(np.arange(1, E + 1, dtype=np.float64))
    logp_rank -= np.log(np.exp(logp_rank).sum())
    ids = np.empty((L, T, K), dtype=np.int64)
    wts = np.empty((L, T, K), dtype=np.float32)
    bounds = np.linspace(0, T, phases + 1).astype(np.int64)
    for p in range(phases):
        t0, t1 = bounds[p], bounds[p + 1]
        for l in range(L):
            logp = np.empty(E)
            logp[rank_rng.permutation(E)] = logp_rank
            g = logp + rng.gumbel(size=(t1 - t0, E))
            top = np.argpartition(-g, K - 1, axis=1)[:, :K]
            order = np.argsort(-np.take_along_axis(g, top, axis=1), axis=1)
            top = np.take_along_axis(top, order, axis=1)
            ids[l, t0:t1] = top
            pk = np.exp(logp[top])
            wts[l, t0:t1] = pk / pk.sum(axis=1, keepdims=True)
    return (ids, wts) if return_weights else ids
