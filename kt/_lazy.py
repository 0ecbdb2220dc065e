"""Lazy attributes for package ``__init__`` modules: names resolve to "module:attribute" targets
at first access, so importing a package imports none of its heavy submodules."""
from __future__ import annotations

import importlib


def lazy_getattr(module_name: str, namespace: dict, targets: dict[str, str]):
    """A module-level ``__getattr__`` resolving ``targets`` and caching them in ``namespace``."""

    def __getattr__(name: str):
        target = targets.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        mod, _, attr = target.partition(":")
        value = getattr(importlib.import_module(mod), attr)
        namespace[name] = value
        return value

    return __getattr__
