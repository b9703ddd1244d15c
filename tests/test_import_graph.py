"""The import graph of `kite/` and `benchmarks/`: no cycles between modules or between packages,
imports point down the layers, Upcycle's subpackages in their order, and nothing outside a
package's face reaches past it (by an import or by an attribute chain).

Imports are read from the source with `ast`, every ``import`` statement wherever it stands
(functions, ``if TYPE_CHECKING:`` blocks, try/except), so an import deferred into a function cannot
hide a loop. ``from a.b import c`` is an edge to the module ``a.b.c`` when there is one, else to
``a.b``; importing a submodule does not count as importing its parents' ``__init__``.

Every rule is by package (a module added to a package follows its package's rule), and every
checker takes a tree or a graph, so the tests below plant each kind of violation in a temporary
copy of `kite/` or in a graph built in memory and see the checker fail on it.
"""

from __future__ import annotations

import ast
import functools
import shutil
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The layers (docs/architecture.md): cli -> serve, bench, tune, integrations -> store, yoco -> upcycle -> runtime,
# model -> kernels -> the bottom. A package may import from its own rank or any lower one, never a
# higher one. At the bottom (rank 0, beside config, errors, paths and the other top-level modules)
# sits `data`: the synthetic contracts and pairs import nothing above them. buildinfo reports the
# native runtime (kernels), so it sits beside model. `testing` (test support for tests/ and
# benchmarks/) imports nothing above model, and no product module imports it.
RANK = {"cli": 6, "integrations": 5, "serve": 5, "bench": 5, "tune": 5, "store": 4, "yoco": 4, "upcycle": 3, "runtime": 2,
        "model": 2, "buildinfo": 2, "testing": 2, "kernels": 1, "data": 0, "config": 0}
TEST_SUPPORT = "kite.testing"

# Upcycle's own order, lowest first: a module may import from its own level or a lower one. A name
# is a subpackage or a top module of kite/upcycle/; TOP stands for every top module not named (and
# any new subpackage until it is placed here); FACE is kite/upcycle/__init__.py, which nothing
# inside imports. `rope` (RoPE arithmetic, imports nothing of Upcycle) sits under the codec because
# the attention probe and the loads rotate keys with it.
TOP, FACE = "<top modules>", "<face>"
UPCYCLE_ORDER = [["format"], ["rope"], ["codec"], ["load", "tagging"], [TOP], ["train", "study"], [FACE]]

# A package's face: the modules code outside the package may import (and reach by attribute).
# Upcycle's subpackages `codec`, `format` and `study` are public names of its face (tools that work on the
# codec, the container or the quality studies), their modules are not.
FACES = {"kite.upcycle": {"kite.upcycle", "kite.upcycle.codec", "kite.upcycle.format", "kite.upcycle.study"}}

# Benchmarks that reach past a face, each with why the face does not offer what it needs:
# (benchmark file name, private module) -> reason.
BENCHMARK_EXCEPTIONS = {
    ("regenerator_quality.py", "kite.upcycle.train.run"):
        "compares the training run's calibration (fit_regenerator) with other fits without running "
        "the whole training",
    ("train_report_answers.py", "kite.upcycle.train.adapter"):
        "times the training report's batched greedy answers (train.report) on its examples "
        "(train.adapter.Example) against one-at-a-time decoding",
    ("train_report_answers.py", "kite.upcycle.train.report"):
        "times the training report's batched greedy answers against one-at-a-time decoding",
    ("gpu_speed.py", "kite.upcycle.load"):
        "times each stage of a load apart (stage_state, load_staged, rebuild_layer) and clears the "
        "load's caches between runs (forget_verified, forget_tables)",
}


class Tree:
    """The Python modules of one copy of the repository (`kite/` and `benchmarks/`) and what they import."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: dict[str, Path] = {}
        for path in (root / "kite").rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            self.modules[".".join(parts)] = path
        self.benchmarks = {f"benchmarks.{p.stem}": p for p in sorted((root / "benchmarks").glob("*.py"))}
        self.graph = {name: self.imports_of(name) for name in self.modules}
        self.bench_graph = {name: self.imports_of(name) for name in self.benchmarks}

    def path(self, name: str) -> Path:
        return self.modules.get(name) or self.benchmarks[name]

    def package(self, name: str) -> str:
        if name in self.benchmarks:
            return "benchmarks"
        return name if self.modules[name].name == "__init__.py" else name.rpartition(".")[0]

    def resolve(self, target: str) -> str | None:
        while target and target not in self.modules:
            target = target.rpartition(".")[0]
        return target or None

    def absolute(self, name: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = self.package(name).split(".")
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def imports_of(self, name: str) -> set[str]:
        """The kite modules `name` imports anywhere in its source."""
        tree = ast.parse(self.path(name).read_text(), filename=str(self.path(name)))
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = self.absolute(name, node)
                for alias in node.names:
                    found.add(f"{mod}.{alias.name}" if f"{mod}.{alias.name}" in self.modules else mod)
        return {r for r in (self.resolve(t) for t in found if t.split(".")[0] == "kite") if r and r != name}

    def reached_modules(self, name: str) -> set[str]:
        """The kite modules `name` reaches through attribute chains on names bound by its imports:
        ``import kite.upcycle`` then ``kite.upcycle.codec.layer.fit_layer`` reaches
        ``kite.upcycle.codec.layer``; ``from kite import upcycle`` then ``upcycle.train.run.X``
        reaches ``kite.upcycle.train.run``. A chain reaches the longest module its dotted path names."""
        tree = ast.parse(self.path(name).read_text())
        bound: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] != "kite":
                        continue
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        bound[alias.name.split(".")[0]] = alias.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom):
                mod = self.absolute(name, node)
                for alias in node.names:
                    if f"{mod}.{alias.name}" in self.modules:
                        bound[alias.asname or alias.name] = f"{mod}.{alias.name}"
        reached: set[str] = set()
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or id(node) in inner:   # whole chains only
                continue
            attrs = []
            v: ast.expr = node
            while isinstance(v, ast.Attribute):
                attrs.append(v.attr)
                v = v.value
            if isinstance(v, ast.Name) and v.id in bound:
                target = self.resolve(".".join([bound[v.id], *reversed(attrs)]))
                if target:
                    reached.add(target)
        return reached


@functools.cache
def repo_tree() -> Tree:
    """The repository's tree, parsed when a test first asks (not at collection, in every worker)."""
    return Tree(ROOT)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles between packages and subpackages: at each depth, every module is taken as the package
    (or module) its first `depth` name parts name, and that collapsed graph must have no cycle.
    kite.upcycle.load -> kite.upcycle.train -> kite.upcycle.load is one even when no module of
    the three takes part in a module cycle."""
    found: list[list[str]] = []
    for depth in range(2, max(n.count(".") for n in graph) + 2):
        collapsed: dict[str, set[str]] = defaultdict(set)
        for name, targets in graph.items():
            a = ".".join(name.split(".")[:depth])
            collapsed[a].update(b for b in (".".join(t.split(".")[:depth]) for t in targets) if b != a)
        found += [c for c in _cycles(collapsed) if c not in found]
    return found


def _rank(module: str) -> int:
    parts = module.split(".")
    return RANK.get(parts[1], 0) if len(parts) > 1 else 0


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports that point up the layers, and product modules that import the test support."""
    bad = []
    for name, targets in sorted(graph.items()):
        bad += [f"{name} (layer {_rank(name)}) imports {t} (layer {_rank(t)})"
                for t in sorted(targets) if _rank(t) > _rank(name)]
        if not (name + ".").startswith(TEST_SUPPORT + "."):
            bad += [f"{name} imports the test support {t}" for t in sorted(targets)
                    if (t + ".").startswith(TEST_SUPPORT + ".")]
    return bad


def _upcycle_level(module: str) -> tuple[int, str]:
    parts = module.split(".")
    unit = FACE if len(parts) == 2 else parts[2]
    for level, names in enumerate(UPCYCLE_ORDER):
        if unit in names:
            return level, unit
    return next(i for i, names in enumerate(UPCYCLE_ORDER) if TOP in names), unit


def upcycle_order_violations(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside kite/upcycle/ that point up UPCYCLE_ORDER."""
    bad = []
    for name, targets in sorted(graph.items()):
        if not (name + ".").startswith("kite.upcycle."):
            continue
        level, unit = _upcycle_level(name)
        for t in sorted(targets):
            if (t + ".").startswith("kite.upcycle.") and _upcycle_level(t)[0] > level:
                bad.append(f"{name} ({unit}) imports {t} ({_upcycle_level(t)[1]}), above it in UPCYCLE_ORDER")
    return bad


def face_violations(importer: str, targets: set[str], exceptions: dict | None = None, file: str = "") -> list[str]:
    """Targets inside a package with a face, past that face, from outside the package."""
    bad = []
    for package, face in FACES.items():
        if (importer + ".").startswith(package + "."):
            continue
        for t in sorted(targets):
            if (t + ".").startswith(package + ".") and t not in face and (file, t) not in (exceptions or {}):
                bad.append(f"{importer}: {t} (past the face of {package})")
    return bad


def test_no_module_of_kite_takes_part_in_an_import_cycle():
    assert _cycles(repo_tree().graph) == []


def test_no_package_or_subpackage_of_kite_takes_part_in_an_import_cycle():
    assert package_cycles(repo_tree().graph) == []


def test_the_cycle_finder_sees_a_package_cycle_that_no_module_cycle_shows():
    # planted in memory: a new module of format/ imports the codec, whose modules import format/
    planted = {**repo_tree().graph, "kite.upcycle.format.planted": {"kite.upcycle.codec"}}
    assert _cycles(planted) == []
    assert ["kite.upcycle.codec", "kite.upcycle.format"] in package_cycles(planted)
    # and between top-level packages: data (the bottom) importing serve, which reaches data
    serve, data = _first("kite.serve"), _first("kite.data")
    planted = {**repo_tree().graph, "kite.data.planted": {serve}, serve: repo_tree().graph[serve] | {data}}
    assert any("kite.data" in c and "kite.serve" in c for c in package_cycles(planted))
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _first(package: str) -> str:
    """A module of `package` as it is today (the planted tests name no file that may go)."""
    return sorted(n for n in repo_tree().graph if n.startswith(package + "."))[0]


def test_imports_point_down_the_layers():
    assert layer_violations(repo_tree().graph) == []


def _copy_of_kite(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "kite", tmp_path / "kite", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    (tmp_path / "benchmarks").mkdir()
    return tmp_path


def test_the_layer_check_fails_on_data_importing_serve(tmp_path):
    """Planted in a copy of kite/: kite/data (the bottom) imports a serve module, inside a function."""
    root = _copy_of_kite(tmp_path)
    serve, data = _first("kite.serve"), _first("kite.data")
    with open(root / repo_tree().path(data).relative_to(ROOT), "a") as f:
        f.write(f"\n\ndef _planted():\n    import {serve}\n    return {serve}\n")
    bad = layer_violations(Tree(root).graph)
    assert bad == [f"{data} (layer 0) imports {serve} (layer {RANK['serve']})"]


def test_the_layer_check_fails_on_a_product_module_importing_the_test_support():
    planted = {**repo_tree().graph, "kite.runtime.planted": {f"{TEST_SUPPORT}.launchers"}, f"{TEST_SUPPORT}.launchers": set()}
    assert layer_violations(planted) == [f"kite.runtime.planted imports the test support {TEST_SUPPORT}.launchers"]


def test_upcycle_subpackages_import_down_their_order():
    assert upcycle_order_violations(repo_tree().graph) == []
    # every subpackage of kite/upcycle/ is placed in the order (a new one must be)
    subpackages = {n.split(".")[2] for n, p in repo_tree().modules.items()
                   if n.count(".") == 2 and n.startswith("kite.upcycle.") and p.name == "__init__.py"}
    placed = {u for names in UPCYCLE_ORDER for u in names}
    assert subpackages <= placed, f"place {sorted(subpackages - placed)} in UPCYCLE_ORDER"


def test_the_upcycle_order_fails_on_a_load_importing_the_training_run():
    planted = {**repo_tree().graph, "kite.upcycle.load.planted": {"kite.upcycle.train.run"},
               "kite.upcycle.codec.planted": {"kite.upcycle.compress"}}
    assert upcycle_order_violations(planted) == [
        "kite.upcycle.codec.planted (codec) imports kite.upcycle.compress (compress), above it in UPCYCLE_ORDER",
        "kite.upcycle.load.planted (load) imports kite.upcycle.train.run (train), above it in UPCYCLE_ORDER"]


def test_code_outside_upcycle_imports_only_its_public_face():
    bad = [v for name, targets in repo_tree().graph.items() for v in face_violations(name, targets)]
    assert bad == []


def test_benchmarks_import_only_public_faces():
    bad = [v for name, targets in repo_tree().bench_graph.items()
           for v in face_violations(name, targets, BENCHMARK_EXCEPTIONS, repo_tree().path(name).name)]
    assert bad == []


def test_no_attribute_chain_reaches_past_a_face():
    bad = [v for name in [*repo_tree().modules, *repo_tree().benchmarks]
           for v in face_violations(name, repo_tree().reached_modules(name), BENCHMARK_EXCEPTIONS, repo_tree().path(name).name)]
    assert bad == []


def test_the_attribute_chain_check_fails_on_chains_past_the_face(tmp_path):
    """Planted in a copy: a benchmark and a serve module that reach private modules of Upcycle by
    attribute chains, next to uses of the face that pass."""
    root = _copy_of_kite(tmp_path)
    (root / "benchmarks" / "planted.py").write_text(
        "import kite.upcycle\nfrom kite import upcycle\nfrom kite.upcycle import codec\n\n"
        "a = kite.upcycle.codec.layer.fit_layer\n"
        "b = upcycle.train.run.train_upcycle\n"
        "c = codec.settings.settings_for\n"
        "ok = (kite.upcycle.load_prefix, upcycle.codec.Regenerator, codec.settings_for, kite.upcycle.format.StateFile)\n")
    serve = _first("kite.serve")
    with open(root / repo_tree().path(serve).relative_to(ROOT), "a") as f:
        f.write("\n\ndef _planted():\n    import kite.upcycle as up\n    return up.load.staging.stage_state\n")
    tree = Tree(root)
    bench = face_violations("benchmarks.planted", tree.reached_modules("benchmarks.planted"), BENCHMARK_EXCEPTIONS,
                            "planted.py")
    assert bench == ["benchmarks.planted: kite.upcycle.codec.layer (past the face of kite.upcycle)",
                     "benchmarks.planted: kite.upcycle.codec.settings (past the face of kite.upcycle)",
                     "benchmarks.planted: kite.upcycle.train.run (past the face of kite.upcycle)"]
    assert face_violations(serve, tree.reached_modules(serve)) == [
        f"{serve}: kite.upcycle.load.staging (past the face of kite.upcycle)"]


def test_the_face_check_fails_on_a_benchmark_importing_a_private_module(tmp_path):
    root = _copy_of_kite(tmp_path)
    (root / "benchmarks" / "planted.py").write_text(
        "from kite.upcycle.codec.layer import fit_layer\nfrom kite.upcycle import load_prefix\n")
    tree = Tree(root)
    assert face_violations("benchmarks.planted", tree.bench_graph["benchmarks.planted"], BENCHMARK_EXCEPTIONS,
                           "planted.py") == ["benchmarks.planted: kite.upcycle.codec.layer (past the face of kite.upcycle)"]


def test_every_imported_kite_module_exists():
    missing = []
    for name, path in repo_tree().modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            missing += [f"{name}: {m}" for m in mods if m.split(".")[0] == "kite" and m not in repo_tree().modules]
    assert missing == []


def _private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def test_no_private_name_crosses_a_package_line():
    """`from x import _name` and `module._name` only within one package (kite/ and benchmarks/)."""
    bad = []
    for name in [*repo_tree().modules, *repo_tree().benchmarks]:
        pkg = repo_tree().package(name)
        bound: dict[str, str] = {}   # local name -> the kite module it is bound to
        tree = ast.parse(repo_tree().path(name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kite"):
                for alias in node.names:
                    target = repo_tree().resolve(node.module)
                    if _private(alias.name) and target and repo_tree().package(target) != pkg:
                        bad.append(f"{name}: from {node.module} import {alias.name}")
                    if f"{node.module}.{alias.name}" in repo_tree().modules:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in repo_tree().modules and alias.asname:
                        bound[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in bound and repo_tree().package(bound[node.value.id]) != pkg):
                bad.append(f"{name}: {node.value.id}.{node.attr}")
    assert bad == []
