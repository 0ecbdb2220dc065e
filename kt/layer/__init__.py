"""kt.layer: the one MoE layer (``HybridMoE``) and what it is made of.

``HybridMoE`` owns a layer's CPU part (a ``kt.CPUMoE``), its hot experts on the GPU (kt's own, or
the caller's: SGLang's GPU method, kt-kernel-style callers), deferred experts, layer-wise GPU
prefill, dynamic re-placement, the stream bridge that orders the CPU part on a CUDA stream, and
the decode graphs it captures itself. The adapters (``kt.hf``, ``kt.sglang_hook``, ``kt.compat``)
translate arguments and layouts and call it.

Importing this package imports torch only.
"""
from __future__ import annotations

from .._lazy import lazy_getattr

_LAZY = {
    "HybridMoE": "kt.layer._hybrid:HybridMoE",
    "Call": "kt.layer._hybrid:Call",
    "DeferredChain": "kt.layer._deferral:DeferredChain",
    "split_deferred": "kt.layer._deferral:split_deferred",
    "PrefillCostModel": "kt.layer._prefill:PrefillCostModel",
    "DynamicReplacement": "kt.layer._replacement:DynamicReplacement",
    "GraphRunner": "kt.layer._stream_bridge:GraphRunner",
    "layer_pool": "kt.layer._pools:layer_pool",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr("kt.layer", globals(), _LAZY)


def __dir__():
    return sorted(set(globals()) | set(__all__))
