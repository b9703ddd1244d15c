"""The import graph of `kite/`: no cycles (module level or inside functions), imports point down the
layers of ARCHITECTURE.md, and nothing outside `kite/upcycle/` reaches past its public face.

Imports are read from the source with `ast`, every ``import`` statement wherever it stands
(functions, ``if TYPE_CHECKING:`` blocks, try/except), so an import deferred into a function cannot
hide a loop. ``from a.b import c`` is an edge to the module ``a.b.c`` when there is one, else to
``a.b``; importing a submodule does not count as importing its parents' ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# ARCHITECTURE.md: cli → serve, bench, tune → store, yoco → upcycle → runtime, model → kernels, config
# (data/ at the bottom beside config). Top-level modules of kite/ (errors, paths, atomic ...) sit
# at the bottom too, but buildinfo, which reports the native runtime (kernels), beside model. A package may import from its own rank or any lower one, never a higher one.
RANK = {"cli": 6, "serve": 5, "bench": 5, "tune": 5, "store": 4, "yoco": 4, "upcycle": 3, "runtime": 2,
        "model": 2, "buildinfo": 2, "kernels": 1}


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "kite").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(name: str) -> str:
    path = MODULES[name]
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _resolve(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def imports_of(name: str) -> set[str]:
    """The kite modules `name` imports anywhere in its source."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package(name).split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                found.add(f"{mod}.{alias.name}" if f"{mod}.{alias.name}" in MODULES else mod)
    return {r for r in (_resolve(t) for t in found if t.split(".")[0] == "kite") if r and r != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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


def test_no_module_of_kite_takes_part_in_an_import_cycle():
    assert _cycles(GRAPH) == []


def test_the_cycle_finder_sees_imports_inside_functions(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = "def f():\n    from kite.upcycle.format.container import StateFile\n"
    tree = ast.parse(src)
    assert any(isinstance(n, ast.ImportFrom) for n in ast.walk(tree))


def _rank(module: str) -> int:
    parts = module.split(".")
    return RANK.get(parts[1], 0) if len(parts) > 1 else 0


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _rank(n) > 0 or n.count(".") == 1))
def test_imports_point_down_the_layers(name):
    up = sorted(t for t in GRAPH[name] if _rank(t) > _rank(name))
    assert not up, f"{name} (layer {_rank(name)}) imports from a higher layer: {up}"


def test_code_outside_upcycle_imports_only_its_public_face():
    """`kite.upcycle` (its __init__) is the one way in; its subpackages `codec` and `format` are
    public names of that face too. Private modules stay inside."""
    allowed = {"kite.upcycle", "kite.upcycle.codec", "kite.upcycle.format"}
    bad = {name: sorted(t for t in targets if t.startswith("kite.upcycle") and t not in allowed)
           for name, targets in GRAPH.items() if not name.startswith("kite.upcycle")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_every_imported_kite_module_exists():
    missing = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            missing += [f"{name}: {m}" for m in mods if m.split(".")[0] == "kite" and m not in MODULES]
    assert missing == []


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def test_no_private_name_crosses_a_package_line():
    """`from x import _name` and `module._name` only within one package (kite/ and benchmarks/)."""
    bad = []
    files = {**MODULES, **{f"benchmarks.{p.stem}": p for p in (ROOT / "benchmarks").glob("*.py")}}
    for name, path in files.items():
        pkg = _package(name) if name in MODULES else "benchmarks"
        bound: dict[str, str] = {}   # local name -> the kite module it is bound to
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kite"):
                for alias in node.names:
                    target = _resolve(node.module)
                    if _private(alias.name) and target and _package(target) != pkg:
                        bad.append(f"{name}: from {node.module} import {alias.name}")
                    if f"{node.module}.{alias.name}" in MODULES:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and _package(bound[node.value.id]) != pkg):
                bad.append(f"{name}: {node.value.id}.{node.attr}")
    assert bad == []
