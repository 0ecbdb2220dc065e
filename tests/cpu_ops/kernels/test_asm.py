"""The kernels compile to the instructions their variant promises (checked in the assembly).

- VNNI kernels contain vpdpbusd, AVX512_BF16 kernels vdpbf16ps (compiled here, for the host).
- AVX2 kernels compiled for a Haswell target (NUMBA_CPU_NAME / NUMBA_CPU_FEATURES with every
  AVX-512 feature off, in a subprocess with its own KT_CACHE_DIR so the normal cache never holds
  Haswell code) use no zmm/AVX-512 register and still compute the right answer, i.e. they run on an
  AVX2-only CPU.
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import njit

from kt.cpu_ops import isa

HASWELL_FEATURES = ",".join(
    ["+64bit", "+cmov", "+cx8", "+cx16", "+mmx", "+sse", "+sse2", "+sse3", "+ssse3", "+sse4.1",
     "+sse4.2", "+popcnt", "+avx", "+avx2", "+fma", "+f16c", "+bmi", "+bmi2", "+lzcnt", "+movbe",
     "+xsave", "+fsgsbase", "+rdrnd", "+pclmul", "+aes"]
    + ["-" + f for f in ("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "avx512vnni",
                         "avx512bf16", "avx512ifma", "avx512vbmi", "avx512vbmi2", "avx512bitalg",
                         "avx512vpopcntdq", "avx512fp16", "avxvnni", "amx-tile", "amx-int8",
                         "amx-bf16", "evex512")])


def _asm(kernel, args):
    """Assembly of a fresh (uncached) compile of ``kernel`` for ``args``' types."""
    fresh = njit(nogil=True)(kernel.py_func)
    fresh(*args)
    return fresh.inspect_asm(fresh.signatures[0])


def _int_args(scheme):
    from kt.cpu_ops import gemm, packing

    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 128), dtype=np.float32)
    p = packing.pack(rng.standard_normal((48, 128), dtype=np.float32), scheme, 64)
    bufs = gemm.activation_buffers(5, p)
    gemm.prepare_activations(x, p, bufs)
    out = np.zeros((5, p.n_pad), np.float32)
    if scheme == "int8":
        return (bufs[0], bufs[1], p.data, p.scale, p.wsum, out, 0, p.num_blocks)
    if scheme == "int4":
        return (bufs[0], bufs[1], p.data, p.scale, p.group_size, out, 0, p.num_blocks)
    return (bufs[0], p.data, out, 0, p.num_blocks)


@pytest.mark.skipif("avx512_vnni" not in isa.runnable_variants(),
                    reason="host cannot run AVX-512 VNNI")
@pytest.mark.parametrize("name", ["gemv_int8", "gemm_int8", "gemv_int4", "gemm_int4", "gemv_int4_pfl"])
def test_vnni_kernels_use_vpdpbusd(name):
    from kt.cpu_ops.kernels import avx512 as k

    asm = _asm(getattr(k, name), _int_args(name.split("_")[1]))
    assert "vpdpbusd" in asm and "zmm" in asm
    assert ("prefetcht0" in asm) == name.endswith("_pfl"), name
    # the gemm kernels prefetch the next block group into L2 (_simd.pf_next)
    assert ("prefetcht1" in asm) == name.startswith("gemm"), name


@pytest.mark.skipif("avx512_bf16" not in isa.runnable_variants(),
                    reason="host cannot run AVX512_BF16")
@pytest.mark.parametrize("name", ["gemv_bf16", "gemm_bf16"])
def test_bf16_kernels_use_vdpbf16ps(name):
    from kt.cpu_ops.kernels import avx512 as k

    asm = _asm(getattr(k, name), _int_args("bf16"))
    assert "vdpbf16ps" in asm
    assert ("prefetcht1" in asm) == name.startswith("gemm"), name


_HASWELL_SCRIPT = textwrap.dedent("""
    import re
    import numpy as np
    from numba import njit
    from kt import reference as ref
    from kt.cpu_ops import gemm, packing
    from kt.cpu_ops.kernels import avx2 as k

    rng = np.random.default_rng(1)
    m, n, d = 6, 40, 200
    x = rng.standard_normal((m, d), dtype=np.float32)
    w = rng.standard_normal((n, d), dtype=np.float32)
    for scheme in ("int8", "int4", "bf16"):
        p = packing.pack(w, scheme, 64)
        want = ref.linear(ref.act_roundtrip(x, scheme), ref.dequantize(ref.quantize(w, scheme, 64)))
        for op in ("gemv", "gemm"):
            kern = getattr(k, f"{op}_{scheme}")
            bufs = gemm.activation_buffers(m, p)
            gemm.prepare_activations(x, p, bufs)
            out = np.full((m, p.n_pad), np.nan, np.float32)
            gemm.launch(kern, p, bufs, out)
            err = np.abs(out[:, :n] - want).max() / np.abs(want).max()
            assert err < 1e-5, (scheme, op, err)
            asm = kern.inspect_asm(kern.signatures[0])
            assert "vpmaddubsw" in asm or "vfmadd" in asm, (scheme, op)
            bad = sorted(set(re.findall(r"%zmm\\d+|%ymm(?:1[6-9]|2\\d|3[01])|%k[1-7]\\b", asm)))
            assert not bad, (scheme, op, bad[:5])
            # the gemm kernels prefetch the next weight block into L2 (_simd.pf_next)
            assert ("prefetcht1" in asm) == (op == "gemm"), (scheme, op)
            # the INT4 gemv prefetches every line 4 KB ahead
            assert ("prefetcht0" in asm) == ((scheme, op) == ("int4", "gemv")), (scheme, op)
            print("ok", scheme, op)
""")


def test_avx2_kernels_compile_and_run_for_haswell(tmp_path):
    env = dict(os.environ, NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=HASWELL_FEATURES,
               KT_CACHE_DIR=str(tmp_path / "haswell-cache"))
    env.pop("KT_CPU_VARIANT", None)
    r = subprocess.run([sys.executable, "-c", _HASWELL_SCRIPT], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("ok ") == 6, r.stdout
