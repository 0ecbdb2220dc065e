"""The CPU pool the CPUMoE and driver tests share (two threads, short spins)."""
import pytest

from kt.cpu_ops.runtime.pool import CpuPool


@pytest.fixture(scope="module")
def pool():
    p = CpuPool(2, spin_us=200)
    yield p
    p.shutdown()
