"""The one table that maps (op, scheme, ISA variant) to a kernel implementation.

Nothing else in kt branches on the CPU: callers ask ``lookup(op, scheme)`` and get the best
registered implementation at or below the variant in use. Implementations are named by
``"module:attribute"`` strings and imported lazily, so importing kt compiles nothing.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from ..config import QuantScheme
from . import isa


@dataclass(frozen=True)
class KernelImpl:
    op: str
    scheme: QuantScheme
    variant: str
    target: str  # "package.module:attribute"
    priority: int = 0

    def load(self) -> Any:
        mod, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(mod), attr)


_TABLE: dict[tuple[str, QuantScheme], list[KernelImpl]] = {}


def register(op: str, scheme: QuantScheme, variant: str, target: str, priority: int = 0) -> None:
    if variant not in isa.VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    impls = _TABLE.setdefault((op, scheme), [])
    impls[:] = [i for i in impls if i.variant != variant]
    impls.append(KernelImpl(op, scheme, variant, target, priority))


def registered(op: str | None = None) -> list[KernelImpl]:
    _ensure_builtin()
    return [i for (o, _), impls in _TABLE.items() if op in (None, o) for i in impls]


def candidates(op: str, scheme: QuantScheme, variant: str | None = None) -> list[KernelImpl]:
    """Implementations usable under ``variant`` (default: the detected one), best first."""
    _ensure_builtin()
    scheme = QuantScheme.parse(scheme)
    variant = variant or isa.cpu_variant()
    allowed = isa.variants_at_or_below(variant)
    impls = [i for i in _TABLE.get((op, scheme), []) if i.variant in allowed]
    # A higher priority wins over a better variant: an entry may be measured faster than the
    # kernels of a newer ISA for its op (see _kernel_table.py).
    return sorted(impls, key=lambda i: (-i.priority, isa.variant_rank(i.variant)))


def lookup(op: str, scheme: QuantScheme | str, variant: str | None = None) -> KernelImpl:
    c = candidates(op, QuantScheme.parse(scheme), variant)
    if not c:
        raise NotImplementedError(
            f"no kt kernel for op={op!r} scheme={QuantScheme.parse(scheme).value} at or below "
            f"variant {variant or isa.cpu_variant()!r}")
    return c[0]


_builtin_done = False


def _ensure_builtin() -> None:
    global _builtin_done
    if not _builtin_done:
        _builtin_done = True
        from . import _kernel_table  # noqa: F401  (registers the built-in kernels)
