"""kt's import graph: no circles, and arrows one way.

adapters (hf, sglang_hook, compat, cli) -> layer -> ops (cpu_ops, gpu_ops, placement, weights)
-> base (config, reference, ...); cpu_ops never imports weights. Every import counts, at module
level or inside a function (a lazy import is still an arrow). Read from the source with ``ast``,
so nothing is imported.
"""
import ast
from pathlib import Path

KT = Path(__file__).resolve().parents[1] / "kt"

# rank of each top-level part of kt: an import may point to the same rank or lower
RANKS = {"config": 0, "reference": 0, "_lazy": 0, "_version": 0, "_sysinfo": 0,
         "cpu_ops": 1, "gpu_ops": 1, "placement": 1, "weights": 1,
         "layer": 2,
         "hf": 3, "sglang_hook": 3, "compat": 3, "cli": 4, "testing": 5,
         "__init__": 6}  # kt/__init__.py: the public names, re-exported lazily from every part
FORBIDDEN = {("cpu_ops", "weights"), ("gpu_ops", "weights"), ("cpu_ops", "gpu_ops"),
             ("gpu_ops", "cpu_ops"), ("placement", "cpu_ops"), ("placement", "gpu_ops"),
             ("placement", "weights")}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in KT.rglob("*.py"):
        rel = p.relative_to(KT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """The kt modules ``name`` imports (``from pkg import sub`` counts as pkg.sub when sub is a
    module)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "kt")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "kt":
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in mods else mod)
    return {m for m in out if m in mods and m != name}


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph():
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _parents(mod: str) -> set[str]:
    """Packages whose __init__ runs when ``mod`` is imported (an import of kt.a.b runs kt.a)."""
    parts = mod.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def test_every_part_has_a_rank():
    assert {_part(m) for m in _graph()} <= set(RANKS), sorted({_part(m) for m in _graph()} - set(RANKS))


def test_arrows_point_one_way():
    bad = []
    for m, deps in _graph().items():
        a = _part(m)
        for d in deps:
            b = _part(d)
            if a == b:
                continue
            if RANKS[b] > RANKS[a] or (a, b) in FORBIDDEN:
                bad.append(f"{m} -> {d}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g = _graph()
    # an edge to kt.a.b also runs kt.a's __init__ first; packages are nodes of their own, and a
    # package's __init__ importing its own submodules is not a cycle unless the submodule leads
    # back out to something that imports the package
    index, low, on, stack, cycles = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    import sys

    sys.setrecursionlimit(10000)
    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_a_wrong_way_import(tmp_path):
    """The parser resolves relative imports: an arrow written with dots is found."""
    p = tmp_path / "x.py"
    p.write_text("from ..weights import load_experts\nfrom . import packing\n")
    mods = {"kt.cpu_ops.x": p, "kt.weights": p, "kt.cpu_ops.packing": p, "kt.cpu_ops": p}
    assert _imports("kt.cpu_ops.x", p, mods) == {"kt.weights", "kt.cpu_ops.packing"}
