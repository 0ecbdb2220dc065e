"""kt: run the experts of large Mixture-of-Experts models across a CPU and a GPU at once.

Importing kt compiles nothing and changes nothing; kernels are compiled (or loaded from the
cache) at first use. Heavy submodules are imported lazily on attribute access.
"""
from __future__ import annotations

from ._lazy import lazy_getattr
from ._version import __version__
from .config import KTConfig, MoEShape, QuantScheme

# public name -> "module:attribute" (imported on first access)
_LAZY = {
    "cpu_variant": "kt.cpu_ops.isa:cpu_variant",
    "clear_cache": "kt.cpu_ops.cache:clear_cache",
    "UnsupportedVariantError": "kt.cpu_ops.isa:UnsupportedVariantError",
    "CpuPool": "kt.cpu_ops.runtime.pool:CpuPool",
    "CPUMoE": "kt.cpu_ops.moe:CPUMoE",
    "NumaMoE": "kt.cpu_ops.numa:NumaMoE",
    "KTMoEWrapper": "kt.compat:KTMoEWrapper",
    "HybridMoE": "kt.layer:HybridMoE",
    "Placement": "kt.placement:Placement",
    "ExpertStats": "kt.placement:ExpertStats",
    "load_experts": "kt.weights:load_experts",
    "convert": "kt.weights:convert",
    "patch_model": "kt.hf:patch_model",
}

__all__ = ["__version__", "KTConfig", "MoEShape", "QuantScheme", "__cpu_variant__", *_LAZY]


_resolve = lazy_getattr("kt", globals(), _LAZY)


def __getattr__(name: str):
    if name == "__cpu_variant__":  # not cached: KT_CPU_VARIANT may change between calls
        from .cpu_ops.isa import cpu_variant

        return cpu_variant()
    return _resolve(name)


def __dir__():
    return sorted(set(globals()) | set(__all__))
