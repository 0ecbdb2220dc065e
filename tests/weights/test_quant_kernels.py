"""The one-pass quantise+pack kernels are bit-identical to reference.quantize + pack_quantized."""
from __future__ import annotations

import numpy as np
import pytest

from kt import reference as ref
from kt.config import QuantScheme
from kt.cpu_ops.packing import pack
from kt.weights._pack import (as_kernel_source, fill_padding_rows, packed_array_specs,
                              quantize_pack_into)

CASES = [(QuantScheme.INT8, 0), (QuantScheme.BF16, 0), (QuantScheme.INT4, 32),
         (QuantScheme.INT4, 64), (QuantScheme.INT4, 128)]


def _pack_with_kernels(src, scheme, g, split):
    """Pack src [N, D] as two row ranges (as gate and up are packed into one w13)."""
    n, d = src.shape
    specs = packed_array_specs(scheme, 1, n, d, g or 64)
    # garbage-filled outputs: the kernels must write every byte, padding included
    arrs = {k: np.frombuffer(np.random.default_rng(9).integers(0, 256, int(np.prod(s)) * dt.itemsize,
                                                               dtype=np.uint8).tobytes(),
                             dtype=dt).reshape(s).copy() for k, (s, dt) in specs.items()}
    bad = quantize_pack_into(scheme, g or 64, src[:split], 0, arrs["data"][0], arrs["scale"][0], arrs["wsum"][0])
    bad += quantize_pack_into(scheme, g or 64, src[split:], split, arrs["data"][0], arrs["scale"][0],
                              arrs["wsum"][0])
    fill_padding_rows(scheme, n, arrs["data"], arrs["scale"], arrs["wsum"])
    return arrs, bad


@pytest.mark.parametrize("scheme,g", CASES)
@pytest.mark.parametrize("n,d,split", [(32, 64, 16), (40, 100, 17), (7, 200, 3), (16, 384, 16)])
@pytest.mark.parametrize("src_kind", ["f32", "bf16"])
def test_bit_identical(scheme, g, n, d, split, src_kind):
    rng = np.random.default_rng(n * 1000 + d)
    w = (rng.standard_normal((n, d)) / np.sqrt(d)).astype(np.float32)
    w[1, :5] = 0.0
    w[2, :] = 0.0  # an all-zero row: scale 0, q 0
    if src_kind == "bf16":
        src = ref.f32_to_bf16_bits(w)
        w = ref.bf16_bits_to_f32(src)
    else:
        src = w
    arrs, bad = _pack_with_kernels(src, scheme, g, split)
    assert bad == 0
    want = pack(w, scheme, g or 64)
    for k in ("data", "scale", "wsum"):
        a, b = getattr(want, k), arrs[k][0]
        assert a.shape == b.shape, (k, a.shape, b.shape)
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8)), k


@pytest.mark.parametrize("src_kind", ["f32", "bf16"])
@pytest.mark.parametrize("scheme,g", CASES)
def test_non_finite_is_reported(scheme, g, src_kind):
    w = np.ones((16, 64), np.float32)
    w[3, 7] = np.nan
    w[5, 9] = -np.inf
    src = ref.f32_to_bf16_bits(w) if src_kind == "bf16" else w
    _, bad = _pack_with_kernels(src, scheme, g, 8)
    assert bad == 2


def test_as_kernel_source():
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 8).bfloat16()
    s = as_kernel_source(t)
    assert s.dtype == np.uint16
    np.testing.assert_array_equal(ref.bf16_bits_to_f32(s), t.float().numpy())
    assert as_kernel_source(np.ones((2, 2), np.float16)).dtype == np.float32
    with pytest.raises(TypeError, match="floating point"):
        as_kernel_source(np.ones((2, 2), np.int32))


@pytest.mark.subprocess
def test_import_compiles_nothing():
    import subprocess
    import sys

    code = ("import sys, kt, kt.weights; kt.load_experts; kt.convert; "
            "bad = [m for m in ('numba', 'torch', 'gguf', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
