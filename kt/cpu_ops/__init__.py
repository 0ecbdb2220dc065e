"""CPU experts: ISA detection and the kernel registry, the packed layout, the JIT kernels (one file
per ISA family), the ISA-agnostic MoE driver and the thread pool.

Importing this package compiles nothing; kernels compile (or load from the cache) at first call.
"""
from .isa import UnsupportedVariantError, cpu_variant, runnable_variants
from .packing import PackedWeight, pack, pack_experts, unpack

__all__ = ["cpu_variant", "runnable_variants", "UnsupportedVariantError", "PackedWeight", "pack",
           "pack_experts", "unpack"]
