"""DenseLinear (a packed linear run on the pool) against kt.reference and the one-thread
``gemm.linear``.

The pool splits the 16-row blocks over its threads; each block's outputs come from one kernel
call of the same op, so the result is bit-identical to ``gemm.linear`` (which runs the same
kernels on one thread), and within the tolerances of tests/cpu_ops/test_gemm.py of the fp64
reference: INT8 atol = 4u*S, INT4 (ng + 4)u*S, BF16 D*u*S, rtol 1e-5 (S = |x_rt| @ |w_dq|^T,
u = 2^-24).
"""
import numpy as np
import pytest
import torch

from kt.config import QuantScheme
from kt.cpu_ops import gemm, isa, packing
from kt.cpu_ops.dense import DenseLinear
from kt.testing import assert_close, assert_exact

from test_gemm import _atol, _reference

SHAPES = [(1, 1408, 2048, 64), (3, 100, 200, 128), (1, 48, 72, 32), (37, 530, 256, 64), (130, 16, 64, 32)]


@pytest.mark.parametrize("variant", isa.runnable_variants())
@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_matches_reference_and_one_thread_linear(pool, variant, scheme):
    rng = np.random.default_rng(abs(hash((variant, scheme.value))) % 2**32)
    for m, n, d, g in SHAPES:
        x = rng.standard_normal((m, d), dtype=np.float32)
        w = rng.standard_normal((n, d), dtype=np.float32) / np.float32(np.sqrt(d))
        p = packing.pack(w, scheme, g)
        lin = DenseLinear(p, pool=pool, variant=variant)
        y = lin(x)
        assert y.shape == (m, n) and y.dtype == np.float32
        r, s = _reference(x, w, scheme, g)
        assert_close(r, y, rtol=1e-5, atol=_atol(scheme, s, d, g), what=f"{scheme.value} {m}x{n}x{d}")
        assert_exact(gemm.linear(x, p, variant=variant), y, what=f"{scheme.value} {m}x{n}x{d} vs linear")


def test_torch_in_torch_out(pool):
    w = torch.randn(96, 64) / 8
    lin = DenseLinear.from_tensor(w, "bf16", pool=pool)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    y = lin(x)
    assert y.dtype == torch.bfloat16 and y.shape == (4, 96)
    want = gemm.linear(x, packing.pack(w, "bf16"))
    assert_close(want, y.float().numpy(), rtol=2 ** -8, atol=0, what="bf16 out")
    assert lin(x[:0]).shape == (0, 96)


def test_bad_input_is_refused_before_the_pool_runs(pool):
    lin = DenseLinear.from_tensor(torch.randn(32, 64), "int8", pool=pool)
    with pytest.raises(ValueError, match=r"\[M, D=64\]"):
        lin(torch.randn(2, 65))
    with pytest.raises(ValueError, match=r"\[M, D=64\]"):
        lin(torch.randn(64))
    with pytest.raises(TypeError, match="floating-point"):
        lin(torch.ones(2, 64, dtype=torch.int64))
    with pytest.raises(TypeError, match="single packed matrix"):
        DenseLinear(packing.pack_experts(np.ones((2, 16, 64), np.float32), "int8"))
    assert lin(torch.randn(2, 64)).shape == (2, 32)  # the pool is still usable
