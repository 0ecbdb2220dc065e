"""ISA detection: the real host, and simulated hosts injected as feature sets."""
import subprocess
import sys

import pytest

import kt
from kt.cpu_ops import isa

SPR = frozenset(isa.REQUIRED["amx"])  # a Sapphire Rapids-like host
ZEN4 = frozenset(isa.REQUIRED["avx512_bf16"])
HASWELL = frozenset(isa.REQUIRED["avx2"])


def host(features, perm=None, err=None):
    return isa.HostInfo("test-cpu", frozenset(features), None, perm, err, "Test CPU")


def test_real_host_variant_is_runnable():
    v = kt.cpu_variant()
    assert v in isa.VARIANTS
    assert v == kt.__cpu_variant__
    assert v in isa.runnable_variants()
    # kt needs AVX2 at least; which variant above it the host runs is the host's business (the
    # suite runs on AVX2-only, AVX-512 and AMX machines alike)
    assert isa.variant_rank(v) <= isa.variant_rank("avx2")
    assert isa.runnable_variants()[-1] == "avx2"


@pytest.mark.parametrize("features,perm,expected", [
    (SPR, True, "amx"),
    (ZEN4, None, "avx512_bf16"),
    (frozenset(isa.REQUIRED["avx512_vnni"]), None, "avx512_vnni"),
    (frozenset(isa.REQUIRED["avx512"]), None, "avx512"),
    (HASWELL, None, "avx2"),
])
def test_best_variant(features, perm, expected):
    assert isa.select_variant(host(features, perm), None).variant == expected


def test_amx_permission_refused_falls_back_with_warning():
    sel = isa.select_variant(host(SPR, False, "errno 95"), None)
    assert sel.variant == "avx512_bf16"
    assert sel.warnings and "permission" in sel.warnings[0]
    with pytest.raises(isa.UnsupportedVariantError, match="refused the AMX tile permission"):
        isa.select_variant(host(SPR, False, "errno 95"), "amx")


def test_forced_variants():
    assert isa.select_variant(host(SPR, True), "avx2").variant == "avx2"
    assert isa.select_variant(host(SPR, True), "AVX512_VNNI").variant == "avx512_vnni"
    with pytest.raises(isa.UnsupportedVariantError, match="not a kt CPU variant"):
        isa.select_variant(host(SPR, True), "nonsense")
    with pytest.raises(isa.UnsupportedVariantError, match=r"avx512f.*lacks"):
        isa.select_variant(host(HASWELL), "avx512")
    with pytest.raises(isa.UnsupportedVariantError, match="amx-tile"):
        isa.select_variant(host(ZEN4), "amx")


def test_host_without_avx2_is_a_clear_error():
    with pytest.raises(isa.UnsupportedVariantError, match="lacks AVX2"):
        isa.select_variant(host({"sse4.2"}), None)


def test_cpuinfo_can_veto_llvm_features():
    h = isa.HostInfo("x", SPR, frozenset({"avx2", "fma", "f16c"}), True, None, "VM")
    assert isa.select_variant(h, None).variant == "avx2"


def _run(code, **env):
    import os

    e = dict(os.environ)
    e.pop("KT_CPU_VARIANT", None)
    e.pop("KT_KERNEL_CPU_VARIANT", None)
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e)


def test_env_forcing_in_a_fresh_process():
    r = _run("import kt; print(kt.cpu_variant())", KT_CPU_VARIANT="avx2")
    assert r.returncode == 0 and r.stdout.strip() == "avx2", r.stderr
    r = _run("import kt; print(kt.cpu_variant())", KT_KERNEL_CPU_VARIANT="avx2")
    assert r.stdout.strip() == "avx2", r.stderr
    r = _run("import kt; print(kt.cpu_variant())", KT_CPU_VARIANT="nonsense")
    assert r.returncode == 1 and "UnsupportedVariantError" in r.stderr
    assert "nonsense" in r.stderr


def test_forcing_a_variant_above_the_host_is_a_python_error():
    above = [v for v in isa.VARIANTS if v not in isa.runnable_variants()]
    if not above:
        pytest.skip("this host runs every variant; the simulated-host tests cover this case")
    r = _run("import kt; print(kt.cpu_variant())", KT_CPU_VARIANT=above[0])
    assert r.returncode == 1, r.stdout
    assert "UnsupportedVariantError" in r.stderr and "lacks" in r.stderr


def test_import_kt_compiles_nothing():
    r = _run("import sys, kt; print(kt.__version__); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in "
             "('numba', 'llvmlite', 'torch', 'triton', 'transformers')))")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_debug_logging(capfd):
    r = _run("import kt; kt.cpu_variant()", KT_DEBUG="1")
    assert "kt ISA detection" in r.stderr


def test_registry_prefers_the_measured_faster_decode_kernels_on_amx_hosts():
    """On AMX hosts INT8/INT4 decode (gemv) uses the VNNI kernels (measured faster on the device;
    INT4's with the every-line software prefetch), BF16 decode and every
    large-M GEMM use AMX; lower hosts fall back by variant."""
    from kt.cpu_ops import registry

    pick = {(op, s): registry.lookup(op, s, "amx").variant
            for op in ("gemv", "gemm") for s in ("int8", "int4", "bf16")}
    assert pick[("gemv", "int8")] == "avx512_vnni"
    for v in ("amx", "avx512_vnni"):
        assert registry.lookup("gemv", "int4", v).target == "kt.cpu_ops.kernels.avx512:gemv_int4_pfl"
    assert pick[("gemv", "bf16")] == "amx"
    assert all(pick[("gemm", s)] == "amx" for s in ("int8", "int4", "bf16"))
    assert registry.lookup("gemv", "int8", "avx2").variant == "avx2"
    assert registry.lookup("gemm", "bf16", "avx512_vnni").variant == "avx2"
