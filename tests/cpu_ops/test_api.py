"""kt.cpu_ops's public surface: a few names with __all__, resolved at first access, so importing
the package compiles (and imports) nothing heavy; the rooms import one way."""
import subprocess
import sys

import kt.cpu_ops as co

PUBLIC = {"CPUMoE", "NumaMoE", "CpuPool", "default_pool", "MoEHandle", "GatedHandle", "GateResult",
          "MoETuning", "linear", "PackedWeight", "pack", "pack_experts", "unpack", "cpu_variant",
          "runnable_variants", "UnsupportedVariantError"}


def _fresh(code):
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_public_names_resolve():
    assert set(co.__all__) == PUBLIC and PUBLIC <= set(dir(co))
    from kt.cpu_ops.moe import CPUMoE
    from kt.cpu_ops.runtime.pool import default_pool

    assert co.CPUMoE is CPUMoE and co.default_pool is default_pool
    assert co.MoETuning().chunk_tokens == 2048


def test_importing_cpu_ops_imports_nothing_heavy():
    got = _fresh("import sys, kt.cpu_ops; "
                 "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite', 'torch') "
                 "or m.startswith('kt.cpu_ops.')))")
    assert got == "[]", got


def test_rooms_import_one_way():
    """The kernels import no runtime, driver or API module; the runtime no driver or API module;
    the driver no API module; nothing in kt.cpu_ops imports kt.weights (checked on the sources)."""
    import ast
    from pathlib import Path

    root = Path(co.__file__).parent

    def imported(path):
        pkg = path.relative_to(root.parent.parent).with_suffix("").parts[:-1]
        out = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom):
                base = list(pkg[: len(pkg) - (n.level - 1)]) if n.level else []
                mod = ".".join(base + ([n.module] if n.module else []))
                out |= {mod} | {f"{mod}.{a.name}" for a in n.names}
            elif isinstance(n, ast.Import):
                out |= {a.name for a in n.names}
        return out

    api = ("kt.cpu_ops.moe", "kt.cpu_ops.numa", "kt.cpu_ops.gemm", "kt.cpu_ops._moe")
    for path in root.rglob("*.py"):
        room = path.relative_to(root).parts[0]
        mods = imported(path)
        assert not any(m.startswith("kt.weights") for m in mods), path
        banned = {"kernels": ("kt.cpu_ops.runtime", "kt.cpu_ops.driver") + api,
                  "runtime": ("kt.cpu_ops.driver", "kt.cpu_ops.kernels") + api,
                  "driver": api}.get(room, ())
        assert not any(m.startswith(banned) for m in mods), (path, sorted(m for m in mods if m.startswith(banned)))
