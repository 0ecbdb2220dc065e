"""Shared helpers of the kt.hf tests: tiny models (built once per test run) and the kt backend."""
from __future__ import annotations

import copy
import functools

import pytest

transformers = pytest.importorskip("transformers", reason="kt.hf tests need transformers (pip install 'kt[hf]')")


@functools.lru_cache(maxsize=None)
def _tiny(family: str, seed: int):
    from kt.hf.tiny import build_tiny_model

    return build_tiny_model(family, seed=seed)


def tiny_model(family: str, seed: int = 0):
    """A fresh copy of the test run's tiny random ``family`` model (fp32, eval)."""
    return copy.deepcopy(_tiny(family, seed))


@functools.lru_cache(maxsize=None)
def kt_backend_available() -> str | None:
    """None when kt.CPUMoE runs on this host, else why not (printed in the skip reason)."""
    try:
        import numpy as np

        from kt.cpu_ops.moe import CPUMoE

        g = np.zeros((2, 32, 64), np.float32)
        CPUMoE.from_tensors(g, g, np.zeros((2, 64, 32), np.float32), scheme="int8")
        return None
    except (ImportError, NotImplementedError) as exc:
        return f"kt.CPUMoE cannot run on this host: {exc}"


def require_kt_backend():
    why = kt_backend_available()
    if why:
        pytest.skip(why)
