"""CPU feature detection: which kernel variant this process runs, decided once.

Variants, best first: amx, avx512_bf16, avx512_vnni, avx512, avx2. Detection reads llvmlite's
host feature string (what Numba compiles for), cross-checks it with /proc/cpuinfo where present,
and for amx asks Linux for the tile-data permission (arch_prctl). A forced variant
(KT_CPU_VARIANT) above what the host can run is a Python error, never a SIGILL.
"""
from __future__ import annotations

import ctypes
import logging
import threading
import warnings
from dataclasses import dataclass, field

from ..config import get_config

log = logging.getLogger("kt.isa")

VARIANTS = ("amx", "avx512_bf16", "avx512_vnni", "avx512", "avx2")

# LLVM feature names each variant needs (cumulative down the list is not assumed: each is explicit).
REQUIRED: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl"),
    "avx512_vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                    "avx512vnni"),
    "avx512_bf16": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl",
                    "avx512vnni", "avx512bf16"),
    "amx": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni",
            "avx512bf16", "amx-tile", "amx-int8", "amx-bf16"),
}

# /proc/cpuinfo spells some flags differently from LLVM.
_CPUINFO_NAMES = {
    "avx512vnni": "avx512_vnni", "avx512bf16": "avx512_bf16", "amx-tile": "amx_tile",
    "amx-int8": "amx_int8", "amx-bf16": "amx_bf16",
}

_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_arch_prctl = 158


class UnsupportedVariantError(RuntimeError):
    """A kernel variant was asked for that this CPU (or this process) cannot run."""


@dataclass(frozen=True)
class HostInfo:
    """What detection saw. ``features`` are LLVM feature names that are on."""

    cpu_name: str
    features: frozenset[str]
    cpuinfo_flags: frozenset[str] | None
    amx_permission: bool | None  # None: not asked (no AMX hardware)
    amx_error: str | None = None
    model_name: str = ""

    def has(self, feature: str) -> bool:
        if feature not in self.features:
            return False
        if self.cpuinfo_flags is not None:
            # The OS may hide features (a VM, a disabled xsave state): trust the stricter view.
            return _CPUINFO_NAMES.get(feature, feature) in self.cpuinfo_flags
        return True

    def missing(self, variant: str) -> list[str]:
        return [f for f in REQUIRED[variant] if not self.has(f)]

    def can_run(self, variant: str) -> bool:
        if self.missing(variant):
            return False
        if variant == "amx":
            return bool(self.amx_permission)
        return True


@dataclass(frozen=True)
class Selection:
    variant: str
    reason: str
    host: HostInfo
    warnings: tuple[str, ...] = field(default_factory=tuple)


def _read_cpuinfo() -> tuple[frozenset[str] | None, str]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None, ""
    flags: set[str] = set()
    model = ""
    for line in text.splitlines():
        if line.startswith("flags") and not flags:
            flags = set(line.split(":", 1)[1].split())
        elif line.startswith("model name") and not model:
            model = line.split(":", 1)[1].strip()
    return (frozenset(flags) if flags else None), model


def request_amx_permission() -> tuple[bool, str | None]:
    """Ask Linux for AMX tile-data permission for this process. Returns (granted, error)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(_SYS_arch_prctl, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
        if rc != 0:
            err = ctypes.get_errno()
            import os

            return False, f"arch_prctl(ARCH_REQ_XCOMP_PERM) failed: errno {err} ({os.strerror(err)})"
        mask = ctypes.c_uint64(0)
        rc = libc.syscall(_SYS_arch_prctl, _ARCH_GET_XCOMP_PERM, ctypes.byref(mask))
        if rc != 0 or not (mask.value >> _XFEATURE_XTILEDATA) & 1:
            return False, "arch_prctl(ARCH_GET_XCOMP_PERM) does not show XTILEDATA"
        return True, None
    except Exception as exc:  # not Linux, no libc, ...
        return False, f"arch_prctl unavailable: {exc}"


def probe_host() -> HostInfo:
    """Read the host's features (and ask for AMX permission when the hardware has AMX)."""
    import llvmlite.binding as llvm

    feats = frozenset(k for k, v in llvm.get_host_cpu_features().items() if v)
    cpu_name = llvm.get_host_cpu_name()
    flags, model = _read_cpuinfo()
    perm: bool | None = None
    err = None
    if {"amx-tile", "amx-int8", "amx-bf16"} <= feats:
        perm, err = request_amx_permission()
    return HostInfo(cpu_name, feats, flags, perm, err, model)


def select_variant(host: HostInfo, forced: str | None) -> Selection:
    """Pure decision: the variant to use on ``host``, honouring a forced one."""
    notes: list[str] = []
    if forced is not None:
        forced = forced.strip().lower()
        if forced not in VARIANTS:
            raise UnsupportedVariantError(
                f"KT_CPU_VARIANT={forced!r} is not a kt CPU variant; expected one of {list(VARIANTS)}"
            )
        missing = host.missing(forced)
        if missing:
            raise UnsupportedVariantError(
                f"KT_CPU_VARIANT={forced!r} needs CPU features {missing} that this CPU "
                f"({host.model_name or host.cpu_name}) lacks; it can run "
                f"{[v for v in VARIANTS if host.can_run(v)] or 'none of kt variants'}"
            )
        if forced == "amx" and not host.amx_permission:
            raise UnsupportedVariantError(
                f"KT_CPU_VARIANT='amx' but Linux refused the AMX tile permission: {host.amx_error}"
            )
        return Selection(forced, "forced by KT_CPU_VARIANT", host)
    for v in VARIANTS:
        if host.can_run(v):
            if v != "amx" and not host.missing("amx") and not host.amx_permission:
                notes.append(
                    f"CPU has AMX but the permission was refused ({host.amx_error}); using {v}"
                )
            return Selection(v, f"best variant the host supports ({host.cpu_name})", host,
                             tuple(notes))
    raise UnsupportedVariantError(
        f"this CPU ({host.model_name or host.cpu_name}) lacks AVX2/FMA/F16C; kt's CPU kernels "
        f"need at least {list(REQUIRED['avx2'])} (missing {host.missing('avx2')})"
    )


_lock = threading.Lock()
_selection: Selection | None = None


def detect(refresh: bool = False) -> Selection:
    """Detect once per process (and per KT_CPU_VARIANT value)."""
    global _selection
    forced = get_config().cpu_variant
    with _lock:
        if _selection is None or refresh or (
            forced != (_selection.variant if _selection.reason.startswith("forced") else None)
        ):
            host = _selection.host if (_selection is not None and not refresh) else probe_host()
            sel = select_variant(host, forced)
            for w in sel.warnings:
                warnings.warn(f"kt: {w}", RuntimeWarning, stacklevel=3)
            if get_config().debug:
                logging.basicConfig(level=logging.DEBUG)
                log.debug("kt ISA detection: host=%s features(avx512/amx)=%s amx_permission=%s "
                          "-> %s (%s)", host.cpu_name,
                          sorted(f for f in host.features if "avx512" in f or "amx" in f),
                          host.amx_permission, sel.variant, sel.reason)
            _selection = sel
        return _selection


def cpu_variant() -> str:
    """The CPU kernel variant in use: 'amx', 'avx512_bf16', 'avx512_vnni', 'avx512' or 'avx2'."""
    return detect().variant


def variant_rank(variant: str) -> int:
    """0 for the best variant; larger is lower."""
    return VARIANTS.index(variant)


def variants_at_or_below(variant: str) -> tuple[str, ...]:
    return VARIANTS[VARIANTS.index(variant):]


def runnable_variants() -> tuple[str, ...]:
    """Every variant this process can run (for tests and benchmarks)."""
    host = detect().host
    return tuple(v for v in VARIANTS if host.can_run(v))
