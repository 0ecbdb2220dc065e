"""Recording a model's routing into kt.placement.ExpertStats (for planning a placement)."""
from __future__ import annotations

import re
from contextlib import contextmanager

from ._experts import KTExperts

__all__ = ["record_routing", "moe_layers"]

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _experts_modules(model):
    """(layer index, experts module) of a patched or unpatched supported model."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, KTExperts):
            found.append((mod.layer_idx, mod))
        elif getattr(mod, "gate_up_proj", None) is not None and getattr(mod.gate_up_proj, "ndim", 0) == 3:
            m = _LAYER_RE.search(name)
            if m:
                found.append((int(m.group(1)), mod))
    if not found:
        raise ValueError("the model has no MoE experts modules to record (is it a supported MoE model?)")
    return sorted(found, key=lambda lm: lm[0])


def moe_layers(model) -> list[int]:
    """Indices of the decoder layers that have routed experts."""
    return [layer for layer, _ in _experts_modules(model)]


@contextmanager
def record_routing(model, stats):
    """Within the block, every experts call of ``model`` adds its (topk_ids [T, K],
    topk_weights [T, K]) to ``stats`` (a kt.placement.ExpertStats [L, E], L = decoder layers)."""
    handles = []
    try:
        for layer, mod in _experts_modules(model):
            def hook(_mod, args, _layer=layer):
                stats.record(_layer, args[1], args[2])

            handles.append(mod.register_forward_pre_hook(hook))
        yield stats
    finally:
        for h in handles:
            h.remove()
