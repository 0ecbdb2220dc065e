"""The one table that maps (op, scheme, ISA variant) to kernels, and the kernel set of each.

Nothing else in kt branches on the CPU: callers ask ``kernel_set(scheme)`` (or ``lookup(op,
scheme)``) and get the best registered implementations at or below the variant in use, with every
special form they may run by name. Implementations are named by ``"module:attribute"`` strings
(``_kernel_table``) and imported only when loaded, so importing kt compiles nothing and a kernel
set of a variant this host cannot run can still be described (``kt doctor``, tiling).
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any

from ..config import QuantScheme
from . import isa
from ._kernel_table import KERNELS

__all__ = ["KernelImpl", "KernelSet", "kernel_set", "custom_kernel_set", "lookup", "candidates",
           "registered", "register", "CUSTOM_GEMV_MAX"]

# gemv_max of a layer built with kernels of its own and no variant named (the kernels' family is
# unknown; correctness does not depend on it)
CUSTOM_GEMV_MAX = 4


def _load(target: str) -> Any:
    mod, _, attr = target.partition(":")
    return getattr(importlib.import_module(mod), attr)


@dataclass(frozen=True)
class KernelImpl:
    """One registered kernel: ``target`` "module:attribute", the lowest ``variant`` it needs, its
    named ``forms`` (form -> target, see ``_kernel_table``) and facts about it."""

    op: str
    scheme: QuantScheme
    variant: str
    target: str  # "package.module:attribute"
    priority: int = 0
    gemv_max: int = 1
    reads_wsum: bool = False
    forms: tuple[tuple[str, str], ...] = ()

    def load(self) -> Any:
        return _load(self.target)

    def form(self, name: str) -> str | None:
        """The target of form ``name`` of this kernel, or None."""
        return dict(self.forms).get(name)

    @property
    def name(self) -> str:
        """"variant:attribute", e.g. "avx512_vnni:gemv_int4_pfl" (for reports)."""
        return f"{self.variant}:{self.target.partition(':')[2]}"


_TABLE: dict[tuple[str, QuantScheme], list[KernelImpl]] = {}
_sets: dict[tuple[QuantScheme, str], "KernelSet"] = {}  # kernel_set's, cleared by register
_lock = threading.Lock()


def register(op: str, scheme: QuantScheme, variant: str, target: str, priority: int = 0, *,
             gemv_max: int = 1, reads_wsum: bool = False, forms: dict[str, str] | None = None) -> None:
    """Add (or replace) the ``op`` kernel of ``scheme`` for ``variant``."""
    if op not in ("gemv", "gemm"):
        raise ValueError(f"op must be 'gemv' or 'gemm', got {op!r}")
    if variant not in isa.VARIANTS:
        raise ValueError(f"unknown variant {variant!r}")
    scheme = QuantScheme.parse(scheme)
    with _lock:
        impls = _TABLE.setdefault((op, scheme), [])
        impls[:] = [i for i in impls if i.variant != variant]
        impls.append(KernelImpl(op, scheme, variant, target, priority, gemv_max, reads_wsum,
                                tuple(sorted((forms or {}).items()))))
        _sets.clear()


for _op, _scheme, _variant, _target, _opts in KERNELS:
    register(_op, _scheme, _variant, _target, **_opts)


def registered(op: str | None = None) -> list[KernelImpl]:
    return [i for (o, _), impls in _TABLE.items() if op in (None, o) for i in impls]


def candidates(op: str, scheme: QuantScheme, variant: str | None = None) -> list[KernelImpl]:
    """Implementations usable under ``variant`` (default: the detected one), best first."""
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


@dataclass(frozen=True)
class KernelSet:
    """The kernels of one (scheme, variant), every form a caller may run, and the facts callers
    need about them. Build with ``kernel_set`` (registered kernels) or ``custom_kernel_set``.

    gemv / gemm: the small-M (decode) and large-M (prefill) contract kernels (one may stand in
    for the other where a scheme registers only one). family: the variant of the large-M kernel
    (the gemv may come from a lower ISA). gemv_max: largest M (rows per expert) that takes the
    gemv. reads_wsum: the kernels read the packed per-row sums. Forms (None where this set has
    none): gemv_tab / gemm_tab read INT4 ratio tables; gemm_exact is the large-M kernel exact for
    a stored INT4 -8; layer_gemm is the large-M kernel a MoE layer runs on its shared rows;
    layer_stream / tab_stream the same with non-temporal stores (large-chunk down GEMMs).
    """

    scheme: QuantScheme
    variant: str
    family: str
    gemv: KernelImpl | None
    gemm: KernelImpl | None
    gemv_max: int
    reads_wsum: bool
    gemv_tab: str | None = None
    gemm_tab: str | None = None
    gemm_exact: str | None = None
    layer_gemm: str | None = None
    layer_stream: str | None = None
    tab_stream: str | None = None
    custom: tuple | None = field(default=None, compare=False)  # (gemv, gemm) jitted, custom sets

    # -- loading

    def decode(self):
        """The small-M contract kernel (jitted)."""
        if self.custom is not None:
            return self.custom[0]
        return (self.gemv or self.gemm).load()

    def prefill(self):
        """The large-M contract kernel (jitted)."""
        if self.custom is not None:
            return self.custom[1]
        return (self.gemm or self.gemv).load()

    def kernel(self, op: str):
        """``decode()`` for "gemv", ``prefill()`` for "gemm"."""
        if op not in ("gemv", "gemm"):
            raise ValueError(f"op must be 'gemv' or 'gemm', got {op!r}")
        return self.decode() if op == "gemv" else self.prefill()

    def linear_kernel(self, op: str, minus8: bool = False):
        """The kernel ``gemm.linear`` runs for ``op``: the large-M exact form for an INT4 weight
        holding -8 where the contract kernel is not exact for it (``packing.int4_has_minus8``)."""
        if op == "gemm" and minus8 and self.gemm_exact is not None:
            return _load(self.gemm_exact)
        return self.kernel(op)

    def layer_forms(self, tables: bool, minus8: bool) -> "LayerForms":
        """The kernels a MoE layer runs. tables: it holds INT4 ratio tables (made only where
        ``gemv_tab`` exists and its scales are of the ratio form); minus8: its INT4 weights hold
        -8. Decode: the table form where there are tables. Prefill: the exact form for -8 (then
        ``warn_exact``: the faster table form is given up), else the table form, else the layer
        form of the large-M kernel; its non-temporal form where it has one."""
        decode = _load(self.gemv_tab) if tables and self.gemv_tab else self.decode()
        if minus8 and self.gemm_exact is not None:
            return LayerForms(decode, _load(self.gemm_exact), None, False, tables)
        if tables and self.gemm_tab is not None:
            return LayerForms(decode, _load(self.gemm_tab),
                              _load(self.tab_stream) if self.tab_stream else None, True, False)
        prefill = _load(self.layer_gemm) if self.layer_gemm else self.prefill()
        return LayerForms(decode, prefill, _load(self.layer_stream) if self.layer_stream else None,
                          False, False)

    def describe(self) -> str:
        """One line: the kernels and forms of this set (``kt doctor``)."""
        if self.custom is not None:
            return f"custom kernels, gemv up to {self.gemv_max} rows"
        parts = [f"decode {(self.gemv or self.gemm).name}", f"prefill {(self.gemm or self.gemv).name}"]
        for label, t in (("decode on tables", self.gemv_tab), ("prefill on tables", self.gemm_tab),
                         ("-8 exact", self.gemm_exact), ("layer prefill", self.layer_gemm),
                         ("streamed down", self.layer_stream or self.tab_stream)):
            if t:
                parts.append(f"{label} {t.partition(':')[2]}")
        parts.append(f"gemv up to {self.gemv_max} rows")
        if self.reads_wsum:
            parts.append("reads row sums")
        return ", ".join(parts)


@dataclass(frozen=True)
class LayerForms:
    """What ``KernelSet.layer_forms`` picked: decode and prefill kernels (jitted), the prefill's
    non-temporal form or None, whether the prefill reads the ratio tables, and whether it gave up
    the table form for the exact one (the layer warns)."""

    decode: Any
    prefill: Any
    prefill_stream: Any
    prefill_tables: bool
    warn_exact: bool


def kernel_set(scheme: QuantScheme | str, variant: str | None = None) -> KernelSet:
    """The registered kernels of ``scheme`` at or below ``variant`` (default: the host's), with
    their forms; nothing is imported or compiled until a kernel is loaded. NotImplementedError if
    no kernel of the scheme is registered there."""
    scheme = QuantScheme.parse(scheme)
    variant = variant or isa.cpu_variant()
    if variant not in isa.VARIANTS:
        raise ValueError(f"variant must be one of {list(isa.VARIANTS)}, got {variant!r}")
    key = (scheme, variant)
    ks = _sets.get(key)
    if ks is not None:
        return ks
    gemv = candidates("gemv", scheme, variant)
    gemm = candidates("gemm", scheme, variant)
    gemv, gemm = (gemv[0] if gemv else None), (gemm[0] if gemm else None)
    if gemv is None and gemm is None:
        raise NotImplementedError(
            f"no CPU GEMM kernel is registered for scheme {scheme.value} at or below variant "
            f"{variant!r}; registered: {[(i.op, i.scheme.value, i.variant) for i in registered()]}")
    big = gemm or gemv  # the gemv/gemm switch follows the large-M kernel's family
    ks = KernelSet(
        scheme, variant, big.variant, gemv, gemm, big.gemv_max,
        any(i is not None and i.reads_wsum for i in (gemv, gemm)),
        gemv_tab=gemv.form("tab") if gemv is not None else None,
        gemm_tab=big.form("tab"), gemm_exact=big.form("exact"), layer_gemm=big.form("layer"),
        layer_stream=big.form("layer_stream"),
        tab_stream=big.form("tab_stream"))
    _sets[key] = ks
    return ks


def custom_kernel_set(scheme: QuantScheme | str, gemv, gemm, variant: str | None = None) -> KernelSet:
    """A set of a caller's own (gemv, gemm) jitted kernels of the README contract (tests, tools):
    no forms; gemv_max is ``variant``'s registered one where a variant is named, else
    ``CUSTOM_GEMV_MAX``."""
    scheme = QuantScheme.parse(scheme)
    gmax = kernel_set(scheme, variant).gemv_max if variant is not None else CUSTOM_GEMV_MAX
    return KernelSet(scheme, variant or "custom", variant or "custom", None, None, gmax, False,
                     custom=(gemv, gemm))
