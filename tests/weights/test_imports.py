"""No import circle inside kt.weights: module-level and function-level imports both count."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "kt" / "weights"


def _imports(path: Path) -> set[str]:
    """kt.weights modules that ``path`` imports anywhere in its body (``from . import x`` too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:  # from .mod import ... / from . import mod
                if node.module:
                    out.add(node.module.split(".")[0])
                else:
                    out.update(a.name for a in node.names)
            elif node.level == 0 and (node.module or "").startswith("kt.weights."):
                out.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("kt.weights."):
                    out.add(a.name.split(".")[2])
    return out


def test_no_import_cycle_in_kt_weights():
    mods = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"}
    graph = {m: sorted(_imports(PKG / f"{m}.py") & mods) for m in mods}
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(stack + [m, n])}")
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(mods):
        if m not in state:
            visit(m, [])
