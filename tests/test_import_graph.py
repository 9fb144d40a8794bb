"""The import graph of the service and the measuring code: no circles, each folder imports only
the floors below it, and the engines never import Ray.

The graph is read from the source with :mod:`ast`, not by importing: every ``import`` and
``from ... import`` statement, at module level or inside a function or class, resolved to the
module it loads of the packages in :data:`FLOORS`. Imports under ``if TYPE_CHECKING:`` run only
for type checkers and are left out. ``from package import name`` counts as an import of
``package.name`` when that is a module, else of ``package``; a package's ``__init__`` that
Python runs on the way to a submodule is not counted (every submodule would otherwise import its
own package).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "serve_app"
# Each folder by floor: a module imports modules of its own folder or of a lower floor only.
# The service at the bottom; what every measuring run stands on (the app served locally, ports
# and processes); Locust; the benchmarks and the soak, side by side (neither imports the
# other); the fleet scenarios, which reuse the benchmarks' arrivals; the commands on top.
FLOORS = {"serve_app": 0, "harness": 1, "loadtest": 2, "bench": 3, "soak": 3, "fleet": 4,
          "scripts": 5}


def module_names(root: Path = ROOT, package: str | Sequence[str] = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` (or of each of several): dotted name -> file."""
    if not isinstance(package, str):
        return {name: path for one in package for name, path in module_names(root, one).items()}
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return ((isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
            or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements anywhere in ``tree`` but the bodies of ``if TYPE_CHECKING:``."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch runs
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def imported_names(path: Path, module: str) -> list[tuple[str, ...]]:
    """What ``module`` (at ``path``) imports: per imported name, the absolute dotted names it may
    be, most specific first (``from a import b`` is ``a.b`` if that is a module, else ``a``)."""
    is_package = path.name == "__init__.py"
    # Relative imports count from the module's package (a package's own name for __init__).
    here = module.split(".") if is_package else module.split(".")[:-1]
    names: list[tuple[str, ...]] = []
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend((alias.name,) for alias in node.names)
            continue
        if node.level:
            base = ".".join(here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names.extend((f"{base}.{alias.name}", base) if alias.name != "*" else (base,)
                     for alias in node.names)
    return names


def _resolve(candidates: tuple[str, ...], modules: dict[str, Path]) -> str | None:
    """The package module a name loads: the first candidate, or longest dotted prefix of one,
    that is a module (None outside the package)."""
    for name in candidates:
        if name in modules:
            return name
    parts = candidates[-1].split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) or None


def import_graph(root: Path = ROOT, package: str | Sequence[str] = PACKAGE
                 ) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` (or of several) it imports."""
    modules = module_names(root, package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = {_resolve(candidates, modules) for candidates in imported_names(path, module)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None (depth-first, deterministic order)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component that has one, each as a path."""
    cycles = []
    remaining = {node: set(targets) for node, targets in graph.items()}
    while True:
        cycle = find_cycle(remaining)
        if cycle is None:
            return cycles
        cycles.append(cycle)
        remaining[cycle[-2]].discard(cycle[-1])  # break this one and look for the next


def test_no_import_cycles():
    cycles = all_cycles(import_graph(ROOT, list(FLOORS)))
    assert not cycles, f"import cycles in {', '.join(FLOORS)}:\n" + "\n".join(
        " -> ".join(cycle) for cycle in cycles)


def test_each_folder_imports_only_its_own_and_lower_floors():
    upward = sorted(f"{module} -> {target}"
                    for module, targets in import_graph(ROOT, list(FLOORS)).items()
                    for target in targets
                    if (here := module.split(".")[0]) != (there := target.split(".")[0])
                    and FLOORS[there] >= FLOORS[here])
    assert not upward, "imports of a folder on the same or a higher floor:\n" + "\n".join(upward)


def test_every_python_folder_has_a_floor():
    folders = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    assert folders - {"tests", "examples"} == set(FLOORS)


def test_engines_never_import_ray():
    engines = f"{PACKAGE}.engines"
    offenders = sorted({
        module for module, path in module_names().items()
        if module == engines or module.startswith(engines + ".")
        for candidates in imported_names(path, module)
        if any(name == "ray" or name.startswith("ray.") for name in candidates)})
    assert not offenders, f"modules under {engines} import ray: {offenders}"


def test_the_graph_sees_relative_function_level_and_type_checking_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from .b import thing\n")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.c import C\n"
        "def f():\n    from .sub import b\n")
    (package / "sub" / "b.py").write_text("import pkg.c\nthing = 1\n")
    (package / "c.py").write_text("from pkg import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
