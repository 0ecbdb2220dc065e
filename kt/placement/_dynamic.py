"""Dynamic re-placement policy (the numpy half): watch routing, decide when a new placement pays.

The layer that owns the GPU buffers applies the decision (copying experts into slots); this
module only decides, and it keeps each layer's slot count fixed so buffers never change size.
Legend: L layers, E experts, T tokens, K top-k.
"""
from __future__ import annotations

import numpy as np

from ._placement import Placement
from ._planner import plan
from ._stats import ExpertStats, _is_torch

__all__ = ["DynamicPlacer", "hit_rate", "expected_hit_rate", "replace_keeping_slots"]


def hit_rate(placement: Placement, topk_ids_per_layer) -> float:
    """Fraction of routed token-slots (ids >= 0) whose expert is on the GPU.

    topk_ids_per_layer: [L, T, K] array, a sequence of L arrays [T, K] (numpy or torch), or a
    dict {layer: [T, K]} for some layers. Returns nan when nothing was routed.
    """
    if isinstance(topk_ids_per_layer, dict):
        items = list(topk_ids_per_layer.items())
    else:
        seq = list(topk_ids_per_layer)
        if len(seq) != placement.num_layers:
            raise ValueError(f"hit_rate: expected ids for {placement.num_layers} layers, got {len(seq)}")
        items = list(enumerate(seq))
    hits = total = 0
    E = placement.num_experts
    for layer, ids in items:
        if _is_torch(ids):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"hit_rate: layer {layer} ids must be integers, found {ids.dtype}")
        flat = ids.reshape(-1)
        if flat.size and (flat.min() < -1 or flat.max() >= E):
            raise ValueError(f"hit_rate: layer {layer} has expert ids outside [-1, {E})")
        flat = flat[flat >= 0]
        total += flat.size
        hits += int(placement.gpu_mask[placement._layer(layer), flat].sum())
    return hits / total if total else float("nan")


def expected_hit_rate(placement: Placement, counts) -> float:
    """Hit rate the placement would have on traffic distributed like ``counts`` [L, E]
    (ExpertStats or array): sum of GPU counts / sum of all counts. nan when counts are all zero."""
    c = counts.counts if isinstance(counts, ExpertStats) else np.asarray(counts, dtype=np.float64)
    if c.shape != placement.shape:
        raise ValueError(f"expected_hit_rate: counts shape {c.shape} != placement shape {placement.shape}")
    tot = c.sum()
    return float((c * placement.gpu_mask).sum() / tot) if tot > 0 else float("nan")


def replace_keeping_slots(current: Placement, scores, *, hysteresis: float = 0.0) -> Placement:
    """Per layer, the ``n_slots[l]`` experts with the highest scores, where experts already on the
    GPU keep their slot and newcomers take the freed slots (lowest slot first).

    scores: [L, E] non-negative (e.g. EMA counts). hysteresis h: an incumbent's score counts as
    ``score * (1 + h)``, so an expert is only displaced by one clearly hotter (less churn).
    """
    s = np.asarray(scores, dtype=np.float64)
    if s.shape != current.shape:
        raise ValueError(f"scores shape {s.shape} != placement shape {current.shape}")
    L, E = current.shape
    slot = np.full((L, E), -1, dtype=np.int32)
    for l in range(L):
        cap = int(current.n_slots[l])
        if cap == 0:
            continue
        inc = current.gpu_mask[l]
        eff = s[l] * np.where(inc, 1.0 + hysteresis, 1.0)
        # highest score first; ties: incumbents first, then lower id
        order = np.lexsort((np.arange(E), ~inc, -eff))
        chosen = order[:cap]
        keep = chosen[inc[chosen]]
        slot[l, keep] = current.gpu_slot[l, keep]
        free = np.setdiff1d(np.arange(cap), slot[l, keep])
        new = np.sort(chosen[~inc[chosen]])
        slot[l, new] = free[: new.size]
    return Placement(slot >= 0, slot, n_slots=current.n_slots, expert_bytes=current.expert_bytes,
                     model=current.model)


class DynamicPlacer:
    """Decides when to re-place experts while serving, from an exponential moving average of routing.

    Feed it every router call with ``observe(layer, topk_ids)``; call ``poll()`` once per forward
    step. Every ``every_n_tokens`` tokens it compares, on the EMA statistics, the hit rate of the
    current placement with that of the best placement of the same per-layer slot counts; when the
    gap ("drift") exceeds ``drift_threshold`` it returns the new placement (and adopts it),
    otherwise None. Experts that stay hot keep their slots (see ``replace_keeping_slots``), so the
    caller copies only ``old.moves(new)``.

    stats_or_shape, budget, strategy, expert_bytes, reserve_bytes, moe_layers, seed: make the
        initial placement with ``plan`` (``strategy='uniform'`` when only a shape is given);
        or pass ``initial=`` to start from a given placement (its slot counts are kept).
    halflife_tokens: EMA half-life (default ``2 * every_n_tokens``).
    hysteresis: an incumbent expert is displaced only by one ``(1 + hysteresis)`` times hotter.
    """

    def __init__(self, stats_or_shape, budget=None, *, initial: Placement | None = None,
                 strategy: str | None = None, every_n_tokens: int = 256, drift_threshold: float = 0.02,
                 halflife_tokens: float | None = None, hysteresis: float = 0.05, weighted: bool = False,
                 expert_bytes: int | None = None, reserve_bytes: int | str = 0, moe_layers=None,
                 seed: int = 42):
        if isinstance(every_n_tokens, bool) or not isinstance(every_n_tokens, (int, np.integer)) \
                or every_n_tokens < 1:
            raise ValueError(f"every_n_tokens must be a positive int, got {every_n_tokens!r}")
        if not (isinstance(drift_threshold, (int, float)) and 0 <= drift_threshold < 1):
            raise ValueError(f"drift_threshold must be in [0, 1), got {drift_threshold!r}")
        if not (isinstance(hysteresis, (int, float)) and hysteresis >= 0):
            raise ValueError(f"hysteresis must be >= 0, got {hysteresis!r}")
        if initial is not None:
            if not isinstance(initial, Placement):
                raise TypeError(f"initial must be a Placement, got {type(initial).__name__}")
            shape = stats_or_shape.shape if hasattr(stats_or_shape, "shape") else tuple(stats_or_shape)
            if tuple(shape) != initial.shape:
                raise ValueError(f"initial placement shape {initial.shape} != statistics shape {tuple(shape)}")
            self.placement = initial
        else:
            if budget is None:
                raise ValueError("DynamicPlacer needs a budget or an initial placement")
            has_stats = not (isinstance(stats_or_shape, tuple) and len(stats_or_shape) == 2)
            self.placement = plan(stats_or_shape, budget, strategy or ("frequency" if has_stats else "uniform"),
                                  expert_bytes=expert_bytes, reserve_bytes=reserve_bytes, seed=seed,
                                  moe_layers=moe_layers)
        L, E = self.placement.shape
        self.every_n_tokens = int(every_n_tokens)
        self.drift_threshold = float(drift_threshold)
        self.hysteresis = float(hysteresis)
        self.stats = ExpertStats(L, E, weighted=weighted,
                                 halflife_tokens=halflife_tokens or 2.0 * self.every_n_tokens,
                                 model=self.placement.model)
        self._last_check = 0
        self.history: list[dict] = []

    def observe(self, layer: int, topk_ids, topk_weights=None) -> None:
        """Record one router call (numpy or torch, any device; see ExpertStats.record)."""
        self.stats.record(layer, topk_ids, topk_weights)

    @property
    def tokens_seen(self) -> int:
        return int(self.stats.tokens.max())

    def adopt(self, placement: Placement) -> None:
        """Tell the policy the owner now runs ``placement`` (same shape and slot counts)."""
        if placement.shape != self.placement.shape or not np.array_equal(placement.n_slots, self.placement.n_slots):
            raise ValueError("adopt: the placement must keep the shape and per-layer slot counts")
        self.placement = placement

    def poll(self, force: bool = False) -> Placement | None:
        """A new placement when one is due and worth it, else None. Reads the statistics (a host
        sync for device tensors) only once per ``every_n_tokens`` tokens."""
        clock = self.tokens_seen
        if not force and clock - self._last_check < self.every_n_tokens:
            return None
        self._last_check = clock
        counts = self.stats.counts
        if counts.sum() <= 0:
            return None
        cand = replace_keeping_slots(self.placement, counts, hysteresis=self.hysteresis)
        cur_hit = expected_hit_rate(self.placement, counts)
        new_hit = expected_hit_rate(cand, counts)
        drift = new_hit - cur_hit
        moved = len(self.placement.moves(cand))
        replaced = drift > self.drift_threshold and moved > 0
        self.history.append({"tokens": clock, "hit_rate": cur_hit, "best_hit_rate": new_hit,
                             "drift": drift, "moves": moved if replaced else 0, "replaced": replaced})
        if not replaced:
            return None
        self.placement = cand
        return cand
