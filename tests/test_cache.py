"""The kernel cache key covers every kernel source, the toolchain and the variant."""
import shutil

from kt.cpu_ops import cache


def test_editing_or_moving_any_kernel_source_changes_the_key(tmp_path):
    """The key hashes every .py under kt/cpu_ops, subfolders included, by relative path and
    content: editing a helper module (Numba's own cache would miss that), editing a file in a
    subfolder, and moving a file between folders each give a new key."""
    root = tmp_path / "cpu_ops"
    shutil.copytree(cache._KERNEL_DIR, root,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert [p.relative_to(root) for p in cache.kernel_source_files(root)] == \
        [p.relative_to(cache._KERNEL_DIR) for p in cache.kernel_source_files()]
    k0 = cache.cache_key("avx2", root)
    assert k0 == cache.cache_key("avx2", root) == cache.cache_key("avx2")
    target = root / "packing.py"
    target.write_text(target.read_text() + "\n# edited\n")
    k1 = cache.cache_key("avx2", root)
    assert k1 != k0
    assert cache.cache_key("avx512_bf16", root) != k1
    sub = root / "sub" / "deeper"
    sub.mkdir(parents=True)
    (sub / "mod.py").write_text("X = 1\n")
    k2 = cache.cache_key("avx2", root)
    assert k2 != k1
    (sub / "mod.py").write_text("X = 2\n")
    k3 = cache.cache_key("avx2", root)
    assert k3 != k2
    (root / "sub" / "mod.py").write_bytes((sub / "mod.py").read_bytes())  # moved up one folder
    (sub / "mod.py").unlink()
    assert cache.cache_key("avx2", root) not in (k0, k1, k2, k3)


def test_key_names_toolchain_and_variant():
    import numba

    k = cache.cache_key("avx2")
    assert f"numba{numba.__version__}" in k and "avx2" in k


def test_clear_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KT_CACHE_DIR", str(tmp_path))
    d = cache.kernel_cache_dir("avx2")
    d.mkdir(parents=True)
    (d / "x.nbi").write_bytes(b"1234")
    assert cache.cache_size_bytes() == 4
    import kt

    kt.clear_cache()
    assert cache.cache_size_bytes() == 0


def test_clear_stale_keeps_this_source(tmp_path, monkeypatch):
    """Only key directories of other kt sources are stale; the cache's size counts kernels only."""
    monkeypatch.setenv("KT_CACHE_DIR", str(tmp_path))
    mine = cache.kernel_cache_dir("avx2")
    other_variant = cache.kernel_cache_dir("avx512_bf16")
    old = mine.parent / (mine.name[: -16] + "0" * 16)  # the same key, another source hash
    for d, n in ((mine, 3), (other_variant, 5), (old, 7)):
        d.mkdir(parents=True)
        (d / "x.nbc").write_bytes(b"1" * n)
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "model.bin").write_bytes(b"1" * 100)  # not a kernel
    assert cache.cache_size_bytes() == 15
    assert cache.stale_kernel_dirs() == [old]
    cache.clear_cache(stale_only=True)
    assert not old.exists() and mine.exists() and other_variant.exists()
    assert cache.cache_size_bytes() == 8 and cache.stale_kernel_dirs() == []


def test_kernels_are_cached_under_the_kt_key(tmp_path):
    """A kernel module's @njit(cache=True) functions land in KT_CACHE_DIR/kernels/<key>/."""
    import os
    import subprocess
    import sys

    code = ("import numpy as np\n"
            "from kt.cpu_ops import cache\n"
            "from kt.cpu_ops.kernels.actquant import quantize_rows\n"
            "x = np.ones((2, 64), np.float32); xq = np.zeros((2, 64), np.int8); xs = np.zeros(2, np.float32)\n"
            "quantize_rows(x, xq, xs)\n"
            "print(cache.kernel_cache_dir())\n")
    env = dict(os.environ, KT_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    d = r.stdout.strip().splitlines()[-1]
    assert d.startswith(str(tmp_path))
    files = os.listdir(d)
    assert any(f.endswith(".nbi") for f in files) and any(f.endswith(".nbc") for f in files), files


_VECTOR_SCRIPT = """
import re, sys
import numpy as np
import llvmlite.binding as llvm
from numba.core import config
import kt.cpu_ops.moe  # installs the cache (and the vector width) before any compile
from kt.cpu_ops.driver import rows as drv
wide = bool(llvm.get_host_cpu_features().get("avx512f", False))
print("flag", "-prefer-256-bit" in (config.CPU_FEATURES or ""), "wide", wide)
gu = np.zeros((4, 64), np.float32)
hq = np.zeros((4, 64), np.int8)
drv._act_rows(gu, 0, 4, 32, 32, hq, np.zeros(4, np.float32), np.zeros(64, np.float32), False, 1, 0)
asm = next(iter(drv._act_rows.inspect_asm().values()))
print("zmm", len(re.findall(r"%zmm", asm)) > len(re.findall(r"%ymm", asm)))
"""


def test_vectoriser_gets_512_bit_registers_on_avx512_hosts(tmp_path):
    """On AVX-512 hosts kt's vectorised loops use zmm registers (LLVM's Intel server tuning would
    pick ymm); an explicit NUMBA_CPU_FEATURES is left alone."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, KT_CACHE_DIR=str(tmp_path / "c1"))
    env.pop("NUMBA_CPU_FEATURES", None)
    r = subprocess.run([sys.executable, "-c", _VECTOR_SCRIPT], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wide = "wide True" in r.stdout
    assert ("flag True" in r.stdout) == wide, r.stdout
    if wide:
        assert "zmm True" in r.stdout, r.stdout
    env = dict(env, KT_CACHE_DIR=str(tmp_path / "c2"), NUMBA_CPU_FEATURES="+avx2,+fma,+f16c")
    r = subprocess.run([sys.executable, "-c", _VECTOR_SCRIPT.replace("print(\"zmm\"", "0 and print(\"zmm\"")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "flag False" in r.stdout, r.stdout
