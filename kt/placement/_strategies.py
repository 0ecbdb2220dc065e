"""The four placement strategies kt-kernel users know, as pure functions returning a GPU mask.

Each takes the total number of GPU experts ``n`` (already capped at L*E by the planner), the
shape, optional counts [L, E] and a seed, and returns gpu_mask [L, E] bool with exactly n True.
"""
from __future__ import annotations

import numpy as np

__all__ = ["uniform_mask", "frequency_mask", "front_loading_mask", "random_mask", "STRATEGIES",
           "strategy_function"]


def _check(n: int, num_layers: int, num_experts: int) -> None:
    if not 0 <= n <= num_layers * num_experts:
        raise ValueError(f"number of GPU experts must be in [0, {num_layers * num_experts}], got {n}")


def uniform_mask(n: int, num_layers: int, num_experts: int, counts=None, seed: int = 42) -> np.ndarray:
    """The same number of GPU experts in every layer (n // L, the first n % L layers one more),
    with ids spread evenly over [0, E): layer with k experts takes ``floor(i * E / k)``, i < k.

    Ignores statistics. (kt-kernel takes ids [0, k); spreading avoids tying the choice to low ids,
    which some routers favour or disfavour systematically. ``Placement.from_contiguous`` gives
    kt-kernel's exact layout.)
    """
    _check(n, num_layers, num_experts)
    mask = np.zeros((num_layers, num_experts), dtype=bool)
    per, rem = divmod(n, num_layers)
    for l in range(num_layers):
        k = per + (1 if l < rem else 0)
        if k:
            mask[l, (np.arange(k) * num_experts) // k] = True
    return mask


def frequency_mask(n: int, num_layers: int, num_experts: int, counts=None, seed: int = 42) -> np.ndarray:
    """The n (layer, expert) pairs with the highest counts over the whole model (layers may get
    very different numbers of GPU experts). Ties go to the earlier layer, then the lower id."""
    _check(n, num_layers, num_experts)
    if counts is None:
        raise ValueError("strategy 'frequency' needs activation statistics (counts [L, E]); "
                         "record them or pass a stats file")
    c = np.asarray(counts, dtype=np.float64)
    if c.shape != (num_layers, num_experts):
        raise ValueError(f"counts shape {c.shape} != [L, E] = {(num_layers, num_experts)}")
    order = np.argsort(-c.reshape(-1), kind="stable")[:n]
    mask = np.zeros(num_layers * num_experts, dtype=bool)
    mask[order] = True
    return mask.reshape(num_layers, num_experts)


def front_loading_mask(n: int, num_layers: int, num_experts: int, counts=None, seed: int = 42) -> np.ndarray:
    """Fill the earliest layers first: layer 0 gets all its experts (in id order), then layer 1...
    Ignores statistics."""
    _check(n, num_layers, num_experts)
    mask = np.zeros(num_layers * num_experts, dtype=bool)
    mask[:n] = True
    return mask.reshape(num_layers, num_experts)


def random_mask(n: int, num_layers: int, num_experts: int, counts=None, seed: int = 42) -> np.ndarray:
    """n (layer, expert) pairs drawn uniformly without replacement, reproducibly from ``seed``
    (numpy's PCG64; kt-kernel's default seed is 42, its generator is torch's). Ignores statistics."""
    _check(n, num_layers, num_experts)
    rng = np.random.default_rng(seed)
    mask = np.zeros(num_layers * num_experts, dtype=bool)
    mask[rng.permutation(num_layers * num_experts)[:n]] = True
    return mask.reshape(num_layers, num_experts)


STRATEGIES = {
    "uniform": uniform_mask,
    "frequency": frequency_mask,
    "front-loading": front_loading_mask,
    "random": random_mask,
}


def strategy_function(name: str):
    """The mask function of a strategy name (``front_loading`` is accepted for ``front-loading``)."""
    key = str(name).strip().lower().replace("_", "-")
    fn = STRATEGIES.get(key)
    if fn is None:
        raise ValueError(f"unknown placement strategy {name!r}; expected one of {list(STRATEGIES)}")
    return fn
