"""Fixtures of the AMX kernel tests: ``K`` the real kernels (skipped where AMX cannot run), ``EK``
the kernels on the tile unit model (runs everywhere)."""
import pytest

from _amx_model import AMX_SKIP, amx_kernels, amx_runnable, emulated_kernels


@pytest.fixture(scope="module")
def K():
    if not amx_runnable():
        pytest.skip(AMX_SKIP)
    return amx_kernels()


@pytest.fixture
def EK(monkeypatch):
    return emulated_kernels(monkeypatch)
