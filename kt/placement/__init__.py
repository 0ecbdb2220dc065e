"""kt.placement: which experts run on the GPU (hot) and which on the CPU (cold).

A `Placement` is data (a GPU slot per (layer, expert)), never a rule on expert ids. `ExpertStats`
records routing; `plan` turns statistics, a budget and a strategy into a placement;
`DynamicPlacer` decides when to re-place while serving. numpy only (torch is read lazily when
statistics come as tensors or .pt files; matplotlib only for `render_heatmap`).
"""
from __future__ import annotations

from ._dynamic import DynamicPlacer, expected_hit_rate, hit_rate, replace_keeping_slots
from ._placement import Placement
from ._planner import Budget, expert_nbytes, parse_bytes, plan, resolve_budget
from ._stats import ExpertStats, load_counts
from ._strategies import (STRATEGIES, frequency_mask, front_loading_mask, random_mask, strategy_function,
                          uniform_mask)
from ._synthetic import zipf_routing


def render_heatmap(*args, **kwargs):
    """Draw the layers x experts heatmap to a PNG (matplotlib, imported on call). See _heatmap."""
    from ._heatmap import render_heatmap as _render

    return _render(*args, **kwargs)


__all__ = [
    "Placement",
    "ExpertStats",
    "load_counts",
    "Budget",
    "plan",
    "resolve_budget",
    "parse_bytes",
    "expert_nbytes",
    "STRATEGIES",
    "strategy_function",
    "uniform_mask",
    "frequency_mask",
    "front_loading_mask",
    "random_mask",
    "DynamicPlacer",
    "replace_keeping_slots",
    "hit_rate",
    "expected_hit_rate",
    "zipf_routing",
    "render_heatmap",
]
