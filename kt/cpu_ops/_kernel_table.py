"""Built-in kernel registrations: (op, scheme, variant) -> "module:attribute".

Ops (the contract each kernel module implements is in kt/cpu_ops/README.md):
  gemv  small-M GEMM (decode), gemm  large-M tiled GEMM (prefill).
"""
from ..config import QuantScheme as S
from .registry import register

_M = "kt.cpu_ops"

# Filled in as kernel families land.
