"""The on-disk cache of compiled kernels, keyed on everything that changes machine code.

Numba's own cache keys a function on its own file only, so editing an ``@intrinsic`` in another
module would run stale machine code. kt's jitted functions (every one defined anywhere under
``kt/cpu_ops``, subfolders included) use a cache locator whose directory name and source stamp
hash *all* of kt's kernel sources (every ``.py`` under ``kt/cpu_ops``, by path relative to it and
content, so a moved file changes the key as an edited one does), together with the numba and
llvmlite versions, the host CPU and the selected variant. ``install()`` must run before the
``@njit(cache=True)`` decorators of a kernel module execute.
"""
from __future__ import annotations

import hashlib
import shutil
import sys
from pathlib import Path

from ..config import get_config

_KERNEL_DIR = Path(__file__).resolve().parent


def kernel_source_files(root: Path | None = None) -> list[Path]:
    """Every ``.py`` file under ``root`` (default: kt/cpu_ops), subfolders included, sorted."""
    return sorted((root or _KERNEL_DIR).rglob("*.py"))


def source_hash(root: Path | None = None) -> str:
    """sha256 over the paths (relative to ``root``, default kt/cpu_ops) and contents of every
    kernel source under it."""
    root = Path(root) if root is not None else _KERNEL_DIR
    h = hashlib.sha256()
    for p in kernel_source_files(root):
        h.update(p.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def cache_key(variant: str | None = None, root: Path | None = None) -> str:
    import llvmlite
    import numba
    import llvmlite.binding as llvm

    if variant is None:
        from .isa import cpu_variant

        variant = cpu_variant()
    parts = [f"numba{numba.__version__}", f"llvmlite{llvmlite.__version__}",
             f"py{sys.version_info.major}{sys.version_info.minor}", llvm.get_host_cpu_name(),
             variant, source_hash(root)[:16]]
    return "-".join(parts)


def cache_root() -> Path:
    return get_config().cache_dir


def kernel_cache_dir(variant: str | None = None) -> Path:
    return cache_root() / "kernels" / cache_key(variant)


def _bytes_under(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file()) if d.exists() else 0


def cache_size_bytes() -> int:
    """Bytes of compiled kernels under the cache root (every key; not the root's other
    contents, such as ``kt demo``'s model or the SGLang environment of ``kt run``)."""
    return _bytes_under(cache_root() / "kernels")


def stale_kernel_dirs() -> list[Path]:
    """The kernel key directories compiled from other kt kernel sources than this one's (an
    older or newer kt): nothing here will read them again. Keys of this source for another
    toolchain, CPU or variant are not stale (another environment may use them)."""
    d = cache_root() / "kernels"
    if not d.exists():
        return []
    mine = source_hash()[:16]
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.endswith("-" + mine))


def clear_cache(stale_only: bool = False) -> None:
    """Remove every compiled kernel kt cached (the next call recompiles), or with ``stale_only``
    only those compiled from other kt sources (``stale_kernel_dirs``), which a kt upgrade (or
    editing kt's kernels) leaves behind, some 10 MiB per variant each."""
    d = cache_root() / "kernels"
    if not stale_only:
        if d.exists():
            shutil.rmtree(d)
        return
    for p in stale_kernel_dirs():
        shutil.rmtree(p, ignore_errors=True)


_installed = False


def prefer_512_bit_vectors() -> bool:
    """Let LLVM's loop vectoriser use 512-bit registers on AVX-512 hosts; True if it now may.

    LLVM tunes Intel server cores (Skylake-SP to Emerald Rapids) to prefer 256-bit vectors, so
    the loops kt leaves to the vectoriser (activations, quantisation, combine, scaling passes)
    ran on ymm registers there, half the width the explicit kernels use (AMD Zen 4 already got
    zmm). This appends ``-prefer-256-bit`` to the host's features in Numba's target. Nothing
    changes where ``NUMBA_CPU_FEATURES`` was set (tests that compile for another CPU set it), on
    hosts without AVX-512, or once Numba has built its target machine (kt imported after other
    jitted code ran: those loops then stay 256-bit wide, correct either way). Numba's cache keys
    on the feature string, so entries compiled without the change are not reused."""
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return "-prefer-256-bit" in config.CPU_FEATURES
    import llvmlite.binding as llvm
    from numba.core.codegen import get_host_cpu_features

    try:
        wide = bool(llvm.get_host_cpu_features().get("avx512f", False))
    except RuntimeError:
        return False
    if not wide or not config.ENABLE_AVX:
        return False
    config.CPU_FEATURES = get_host_cpu_features() + ",-prefer-256-bit"
    return True


def install() -> None:
    """Register kt's cache locator with Numba (idempotent); on AVX-512 hosts also let the loop
    vectoriser use zmm registers (``prefer_512_bit_vectors``)."""
    global _installed
    if _installed:
        return
    prefer_512_bit_vectors()
    from numba.core import caching

    class KtCacheLocator(caching._CacheLocator):
        """Caches functions defined anywhere under kt/cpu_ops under the complete kt kernel key."""

        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._key = cache_key()
            self._path = str(cache_root() / "kernels" / self._key)

        def get_cache_path(self):
            return self._path

        def get_source_stamp(self):
            return self._key

        def get_disambiguator(self):
            # the file's path below kt/cpu_ops: two files of one name in different folders
            # (kernels/avx2.py, kernels/amx/...) never share an index
            rel = Path(self._py_file).resolve().relative_to(_KERNEL_DIR).with_suffix("")
            return f"{'.'.join(rel.parts)}.{self._lineno}"

        @classmethod
        def from_function(cls, py_func, py_file):
            try:
                if _KERNEL_DIR not in Path(py_file).resolve().parents:
                    return None
                self = cls(py_func, py_file)
                self.ensure_cache_path()
            except OSError:
                return None  # unwritable cache dir: compile without caching
            return self

    # numba < 0.61 names the class _CacheImpl, later versions CacheImpl
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    impl._locator_classes.insert(0, KtCacheLocator)
    _installed = True
