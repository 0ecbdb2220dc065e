"""CPU experts, by layer: the Python API (``CPUMoE``, ``NumaMoE``, ``linear``, ``MoETuning``),
ISA detection and the kernel registry (``isa``, ``registry``), the packed layout (``packing``),
the native runtime (``runtime/``: the pool, atomics, the job descriptor), the ISA-agnostic MoE
driver (``driver/``) and the per-ISA JIT kernels (``kernels/``).

Importing this package imports none of them and compiles nothing; the names below resolve at
first access, and kernels compile (or load from the cache) at first call.
"""
from __future__ import annotations

from .._lazy import lazy_getattr

# public name -> "module:attribute" (imported on first access)
_TARGETS = {
    "CPUMoE": "kt.cpu_ops.moe:CPUMoE",
    "NumaMoE": "kt.cpu_ops.numa:NumaMoE",
    "CpuPool": "kt.cpu_ops.runtime.pool:CpuPool",
    "default_pool": "kt.cpu_ops.runtime.pool:default_pool",
    "MoEHandle": "kt.cpu_ops._moe_handles:MoEHandle",
    "GatedHandle": "kt.cpu_ops._moe_handles:GatedHandle",
    "GateResult": "kt.cpu_ops._moe_handles:GateResult",
    "MoETuning": "kt.cpu_ops.tuning:MoETuning",
    "linear": "kt.cpu_ops.gemm:linear",
    "PackedWeight": "kt.cpu_ops.packing:PackedWeight",
    "pack": "kt.cpu_ops.packing:pack",
    "pack_experts": "kt.cpu_ops.packing:pack_experts",
    "unpack": "kt.cpu_ops.packing:unpack",
    "cpu_variant": "kt.cpu_ops.isa:cpu_variant",
    "runnable_variants": "kt.cpu_ops.isa:runnable_variants",
    "UnsupportedVariantError": "kt.cpu_ops.isa:UnsupportedVariantError",
}

__all__ = list(_TARGETS)

__getattr__ = lazy_getattr(__name__, globals(), _TARGETS)


def __dir__():
    return sorted(set(globals()) | set(__all__))
