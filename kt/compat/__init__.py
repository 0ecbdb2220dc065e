"""kt.compat: other libraries' APIs over kt's layer. ``KTMoEWrapper`` is kt-kernel's."""
from __future__ import annotations

from .._lazy import lazy_getattr

_LAZY = {
    "KTMoEWrapper": "kt.compat.ktkernel:KTMoEWrapper",
    "METHODS": "kt.compat._args:METHODS",
    "UNSUPPORTED_METHODS": "kt.compat._args:UNSUPPORTED_METHODS",
}

__all__ = sorted(_LAZY)

__getattr__ = lazy_getattr("kt.compat", globals(), _LAZY)


def __dir__():
    return sorted(set(globals()) | set(__all__))
