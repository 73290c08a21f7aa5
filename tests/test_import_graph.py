"""No import circle inside `parity/` (issue 12: plugin -> replay -> plugin and replay <-> isolated were circles).

Every `import` statement counts, also those inside functions (a deferred import hides a circle from Python at
import time, not from the design). An edge goes to the module named, or to the submodule when `from pkg import sub`
names one; a package's `__init__` is not implied by importing one of its submodules (Python resolves that case).
"""

from __future__ import annotations

import ast
from pathlib import Path

import parity

PKG = Path(parity.__file__).resolve().parent


def module_graph(root: Path) -> dict[str, set[str]]:
    """{module: parity modules it imports} for every .py file under `root` (the `parity` package directory)."""
    mods = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        mods[".".join(parts)] = f
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        is_pkg = f.name == "__init__.py"
        out = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                out |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                    pkg = pkg[:len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    out.add(sub if sub in mods else base)
        out.discard(name)
        graph[name] = {m for m in out if m in mods}
    return graph


def import_cycles(root: Path) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), as sorted module lists."""
    graph = module_graph(root)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_in_parity():
    cycles = import_cycles(PKG)
    assert not cycles, f"import circles in parity/: {cycles}"


def test_detector_finds_a_cycle(tmp_path):
    """The detector itself: a deferred import closing a circle is found."""
    pkg = tmp_path / "parity"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from parity.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from parity import a\n")
    (pkg / "c.py").write_text("import parity.a\n")
    assert import_cycles(pkg) == [["parity.a", "parity.b"]]
