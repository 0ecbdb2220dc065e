"""The registry: which kernel (and form) each (scheme, variant) runs, for every variant.

Kernel sets are described without importing their kernels, so the choices of variants this host
cannot run (AMX, AVX-512) are checked here too: ``_load`` is replaced by the identity, and the
forms come back as their "module:attribute" targets.
"""
import subprocess
import sys

import pytest

from kt.cpu_ops import isa, registry

A, V, H = "kt.cpu_ops.kernels.amx", "kt.cpu_ops.kernels.avx512", "kt.cpu_ops.kernels.avx2"


@pytest.fixture
def named(monkeypatch):
    monkeypatch.setattr(registry, "_load", lambda target: target)
    return registry.kernel_set


def _forms(ks, tables, minus8):
    f = ks.layer_forms(tables, minus8)
    return f.decode, f.prefill, f.prefill_stream, f.prefill_tables, f.warn_exact


def test_amx_sets(named):
    """AMX hosts: VNNI decode for INT8 / INT4 (priority 1), AMX decode for BF16 and AMX prefill
    everywhere; a MoE layer's INT8 prefill is the shared-output form, its INT4 prefill the table
    form where it has tables and the exact per-group form for a stored -8, each large-chunk down
    GEMM the non-temporal form of what the layer runs (none for the exact and contract INT4)."""
    i8, i4, b16 = named("int8", "amx"), named("int4", "amx"), named("bf16", "amx")
    assert (i8.family, i4.family, b16.family) == ("amx",) * 3
    assert i8.gemv_max == i4.gemv_max == b16.gemv_max == 4
    assert _forms(i8, False, False) == (f"{V}:gemv_int8", f"{A}.int8:gemm_int8_shared_out",
                                        f"{A}.int8:gemm_int8_stream_out", False, False)
    assert i8.reads_wsum  # (the VNNI decode kernel's +128 offset)
    assert _forms(i4, True, False) == (f"{V}:gemv_int4_tab", f"{A}.int4:gemm_int4_tab",
                                       f"{A}.int4:gemm_int4_tab_stream_out", True, False)
    assert _forms(i4, True, True) == (f"{V}:gemv_int4_tab", f"{A}.int4:gemm_int4_flush", None, False, True)
    assert _forms(i4, False, False) == (f"{V}:gemv_int4_pfl", f"{A}.int4:gemm_int4", None, False, False)
    assert _forms(i4, False, True) == (f"{V}:gemv_int4_pfl", f"{A}.int4:gemm_int4_flush", None, False, False)
    assert _forms(b16, False, False) == (f"{A}.bf16:gemv_bf16", f"{A}.bf16:gemm_bf16",
                                         f"{A}.bf16:gemm_bf16_stream_out", False, False)
    # gemm.linear runs the contract kernels, and the exact INT4 form for a -8
    assert i8.linear_kernel("gemm") == f"{A}.int8:gemm_int8"
    assert i4.linear_kernel("gemm", minus8=True) == f"{A}.int4:gemm_int4_flush"
    assert i4.linear_kernel("gemv", minus8=True) == f"{V}:gemv_int4_pfl"


@pytest.mark.parametrize("variant", ["avx512_bf16", "avx512_vnni"])
def test_avx512_sets(named, variant):
    """AVX-512 VNNI hosts: INT4 decode on ratio tables where the layer has them, prefill on the
    group scales (no table form, no exact form needed: the VNNI GEMM is exact for -8); BF16 needs
    AVX512_BF16, below it AVX2's."""
    i4 = named("int4", variant)
    assert i4.family == "avx512_vnni" and i4.gemv_max == 1 and not i4.reads_wsum
    for minus8 in (False, True):
        assert _forms(i4, True, minus8) == (f"{V}:gemv_int4_tab", f"{V}:gemm_int4", None, False, False)
    assert _forms(named("int8", variant), False, False)[:3] == (f"{V}:gemv_int8", f"{V}:gemm_int8", None)
    assert named("int8", variant).reads_wsum
    bf = named("bf16", variant)
    want = V if variant == "avx512_bf16" else H
    assert (bf.decode(), bf.prefill()) == (f"{want}:gemv_bf16", f"{want}:gemm_bf16")


@pytest.mark.parametrize("variant", ["avx512", "avx2"])
def test_avx2_sets(named, variant):
    for s in ("int8", "int4", "bf16"):
        ks = named(s, variant)
        assert ks.family == "avx2" and ks.gemv_max == 1 and not ks.reads_wsum
        assert _forms(ks, True, True) == (f"{H}:gemv_{s}", f"{H}:gemm_{s}", None, False, False)
        assert (ks.gemv_tab, ks.gemm_tab, ks.gemm_exact) == (None, None, None)


def test_real_sets_load_jitted_kernels():
    for v in isa.runnable_variants():
        for s in ("int8", "int4", "bf16"):
            ks = registry.kernel_set(s, v)
            assert ks is registry.kernel_set(s, v)  # one set per (scheme, variant)
            for k in (ks.decode(), ks.prefill()):
                assert hasattr(k, "py_func"), (s, v, k)
            assert ks.describe().startswith("decode ")


def test_custom_sets():
    def k(*a):
        return None

    ks = registry.custom_kernel_set("int8", k, k)
    assert ks.family == "custom" and ks.gemv_max == registry.CUSTOM_GEMV_MAX
    assert ks.decode() is k and ks.prefill() is k and not ks.reads_wsum
    f = ks.layer_forms(False, False)
    assert (f.decode, f.prefill, f.prefill_stream) == (k, k, None)
    assert registry.custom_kernel_set("int8", k, k, "amx").gemv_max == 4
    assert registry.custom_kernel_set("int8", k, k, "avx2").gemv_max == 1


def test_bad_requests():
    with pytest.raises(ValueError, match="variant must be one of"):
        registry.kernel_set("int8", "sse2")
    with pytest.raises(ValueError, match="unknown quantisation scheme"):
        registry.kernel_set("fp4", "avx2")
    with pytest.raises(ValueError, match="op must be"):
        registry.kernel_set("int8", "avx2").kernel("conv")


def test_kernel_table_does_not_import_the_registry():
    code = ("import sys, kt.cpu_ops._kernel_table as t; "
            "print(len(t.KERNELS), 'kt.cpu_ops.registry' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    n, imported = r.stdout.split()
    assert int(n) > 0 and imported == "False"
