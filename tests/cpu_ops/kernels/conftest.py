"""Fixtures of the AMX kernel tests: ``K`` the real kernels (skipped where AMX cannot run), ``EK``
the kernels on the tile unit model (runs everywhere)."""
import pytest

from kt.cpu_ops import isa

from _amx_model import amx_kernels, emulated_kernels

AMX_SKIP = "host has no AMX (runs on the device machine: benchmarks/device_amx.py)"


def amx_runnable() -> bool:
    return "amx" in isa.runnable_variants()


@pytest.fixture(scope="module")
def K():
    if not amx_runnable():
        pytest.skip(AMX_SKIP)
    return amx_kernels()


@pytest.fixture
def EK(monkeypatch):
    return emulated_kernels(monkeypatch)
