"""No import circle under orca_jax/: two modules that import each other cannot be read, tested or
changed one at a time, and one that loads half-initialised fails at a distance. The test reads every
module's imports from its source (ast, nothing is imported) and fails naming each circle.

What counts as an import of module M:
- a module-level `import` or `from ... import` (also inside `if`, `try` and class bodies, and under
  `if TYPE_CHECKING:`: an import for types only still says that M depends on the other module, and
  a circle through one is a design circle, hidden);
- not one inside a function: it runs at call time, when every module is loaded, so it makes no
  circle at load time (the lazy imports of optional packages and of jax-heavy modules are such);
- importing `a.b.c` also runs the packages `a` and `a.b` (their __init__.py) first, unless M lives
  inside them (a package is loaded before its own modules).
"""

import ast
from pathlib import Path

from orca_jax.config import REPO_ROOT


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of `package` (a folder under `root`) by dotted name; a package by its own name."""
    names = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _top_level_imports(body: list[ast.stmt]):
    """The import statements that run when the module loads (see the module docstring)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        else:  # if / try / with / class bodies run at load time
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    yield from _top_level_imports(child.body if isinstance(child, ast.ExceptHandler) else [child])


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Each module of `package` -> the modules of `package` that loading it loads first."""
    modules = module_names(root, package)
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                here = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(here[:len(here) - node.level + 1] + ([base] if base else []))
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
        deps = set()
        for target in targets:
            parts = target.split(".")
            deps.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1 + is_package)}
        graph[name] = {d for d in deps if d in modules and d not in own_packages and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) for each group of modules that import each other."""
    found, placed = [], set()
    for start in sorted(graph):
        if start in placed:
            continue
        # Breadth first from `start`: the shortest way back to it, if any.
        parents, frontier = {start: None}, [start]
        while frontier and start not in {d for m in frontier for d in graph[m]}:
            following = []
            for module in frontier:
                for dep in sorted(graph[module] - parents.keys()):
                    parents[dep] = module
                    following.append(dep)
            frontier = following
        if not frontier:
            continue
        last = next(m for m in frontier if start in graph[m])
        circle = [start]
        while last is not None and last != start:
            circle.insert(1, last)
            last = parents[last]
        placed.update(circle)
        found.append(circle + [start])
    return found


def test_no_import_circle_under_orca_jax():
    found = circles(import_graph(REPO_ROOT, "orca_jax"))
    assert not found, "import circles (module-level imports, see this test's docstring):\n" + "\n".join(
        " -> ".join(circle) for circle in found)


def write_package(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_reader_finds_circles_and_only_load_time_ones(tmp_path):
    """The rules above on a package made here: each case could be misread either way."""
    write_package(tmp_path, {
        "pkg/__init__.py": "",
        # a <-> b, b's half only for types: a circle
        "pkg/a.py": "from pkg.b import B\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n",
        # c -> d at load time, d -> c inside a function: no circle
        "pkg/c.py": "import pkg.d\n",
        "pkg/d.py": "def f():\n    from pkg import c\n",
        # e <-> f through a relative import inside try: a circle
        "pkg/e.py": "try:\n    from . import f\nexcept ImportError:\n    pass\n",
        "pkg/f.py": "from .e import E\n",
        # a subpackage whose __init__ loads its module, which imports a sibling: no circle (the
        # package is loading already), but g importing the subpackage from outside does load it
        "pkg/sub/__init__.py": "from pkg.sub.x import X\n",
        "pkg/sub/x.py": "from pkg.sub.y import Y\n",
        "pkg/sub/y.py": "",
        "pkg/g.py": "from pkg.sub.y import Y\n",
    })
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.g"] == {"pkg.sub", "pkg.sub.y"}
    assert graph["pkg.sub.x"] == {"pkg.sub.y"}
    assert sorted(circles(graph)) == [["pkg.a", "pkg.b", "pkg.a"], ["pkg.e", "pkg.f", "pkg.e"]]
