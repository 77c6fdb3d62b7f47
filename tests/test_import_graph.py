"""No import cycle between ``llds_jax`` modules, counting imports inside functions too.

A function-local import can hide a cycle: Python only resolves it when the function runs,
so the cycle never fails at import time, but the two modules still depend on each other
and neither can be read or moved alone. The rule is therefore the honest one: the graph
of every ``import`` statement in every module (module level, inside functions, under
``if TYPE_CHECKING``) must be acyclic. Lazy imports for start-up cost stay allowed as long
as they point "down" the graph. ``importlib.import_module`` strings (``main.MODES``) are
not statements and are not counted.

Above acyclicity, the packages are layered (:data:`LAYERS`): an import never runs back up, so the
config assembly (``llds_jax.config``) sits below every mode (``eval``, ``plan``, ``lab``, ``app``)
that reads it, and each mode can be read without the ones above it.

Edges go to the module named: ``from llds_jax.train import loop`` is an edge to
``llds_jax.train.loop`` (a submodule), ``from llds_jax.rl.config import validate`` to
``llds_jax.rl.config``. Importing a submodule also runs its package's ``__init__``, but
that implicit edge is not counted: packages that re-export their submodules would
otherwise all be cycles by construction.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "llds_jax"
ROOT = PACKAGE_DIR.name


def module_files() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def import_edges(module: str, path: Path, known: set[str]) -> dict[str, int]:
    """{imported llds_jax module: line of the first import statement naming it}."""
    edges: dict[str, int] = {}
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = (_resolve_relative(module, path.name == "__init__.py", node.level, node.module)
                      if node.level else node.module or "")
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                targets.append(submodule if submodule in known else source)
        for target in targets:
            if target.split(".")[0] != ROOT:
                continue
            while target not in known and "." in target:  # `import llds_jax.a.b.attr`-style names
                target = target.rsplit(".", 1)[0]
            if target != module and target in known:
                edges.setdefault(target, node.lineno)
    return edges


def import_graph() -> dict[str, dict[str, int]]:
    files = module_files()
    known = set(files)
    return {module: import_edges(module, path, known) for module, path in files.items()}


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_closed_path(graph, set(component)) for component in components]


def _closed_path(graph: dict[str, dict[str, int]], component: set[str]) -> list[str]:
    """One cycle through the component's first module, by breadth-first search back to it."""
    start = min(component)
    parents = {start: None}
    frontier = [start]
    while frontier:
        nxt_frontier = []
        for node in frontier:
            for nxt in graph[node]:
                if nxt == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if nxt in component and nxt not in parents:
                    parents[nxt] = node
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    return sorted(component)


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    files = module_files()
    hops = [f"{a} -> {b} ({files[a].relative_to(PACKAGE_DIR.parent)}:{graph[a][b]})"
            for a, b in zip(cycle, cycle[1:])]
    return "\n    ".join(hops)


def test_llds_jax_imports_form_no_cycle_even_counting_function_local_imports():
    graph = import_graph()
    assert len(graph) > 50, f"only {len(graph)} modules found under {PACKAGE_DIR}"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles between llds_jax modules:\n  " + "\n  ".join(
        describe(cycle, graph) for cycle in cycles)


# Packages (and top-level modules) from the bottom up. A module imports its own layer or lower ones;
# a section's declaration (``llds_jax.<package>.config``: defaults and checks) may also be imported by
# the config assembly, which composes every section, wherever its package sits.
LAYERS = (
    ("errors", "utils", "parallel", "rl", "diagnostics"),
    ("models",),
    ("sampling", "retrieval"),
    ("data", "rollout"),
    ("train",),
    ("config",),
    ("eval", "plan"),
    ("lab", "app"),
    ("main", ""),  # "": the package's own __init__
)
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def layer_of(module: str) -> int:
    parts = module.split(".")
    package = parts[1] if len(parts) > 1 else ""
    if package not in RANK:
        raise KeyError(f"{module}: package {package!r} has no layer in LAYERS; add it where it belongs")
    return RANK[package]


def upward_imports(graph: dict[str, dict[str, int]], files: dict[str, Path] | None = None) -> list[str]:
    files = files or module_files()
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            rank = layer_of(target)
            if module == f"{ROOT}.config" and len(target.split(".")) == 3 and target.endswith(".config"):
                rank = min(rank, RANK["config"])  # the assembly reads a section's declaration
            if rank > layer_of(module):
                found.append(f"{module} -> {target} ({files[module].relative_to(PACKAGE_DIR.parent)}:{line})")
    return found


def test_no_import_runs_back_up_the_layers():
    """Before: ``plan.run`` and ``eval.run`` imported ``app.config``, above them (``app.run`` drives both)."""
    upward = upward_imports(import_graph())
    assert not upward, "imports that run back up the layers:\n  " + "\n  ".join(upward)


def test_the_layer_check_sees_an_upward_import():
    """The edge this check removed (plan.run -> app.config) is reported; the assembly reading a section is not."""
    files = {"llds_jax.plan.run": Path("llds_jax/plan/run.py"), "llds_jax.config": Path("llds_jax/config.py")}
    graph = {"llds_jax.plan.run": {"llds_jax.app.config": 53}, "llds_jax.config": {"llds_jax.plan.config": 37}}
    assert upward_imports(graph, {k: PACKAGE_DIR.parent / v for k, v in files.items()}) == ["llds_jax.plan.run -> llds_jax.app.config (llds_jax/plan/run.py:53)"]


def test_the_checker_sees_a_cycle_hidden_in_a_function_local_import(tmp_path):
    """The rule this file enforces, on a two-module package: a lazy import still closes the cycle."""
    package = tmp_path / ROOT
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from llds_jax.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from llds_jax import a  # noqa: PLC0415\n    return a\n")
    known = {ROOT, f"{ROOT}.a", f"{ROOT}.b"}
    graph = {name: import_edges(name, package / (name.split(".")[-1] + ".py"), known)
             for name in (f"{ROOT}.a", f"{ROOT}.b")}
    assert graph == {f"{ROOT}.a": {f"{ROOT}.b": 1}, f"{ROOT}.b": {f"{ROOT}.a": 2}}
    assert find_cycles(graph) == [[f"{ROOT}.a", f"{ROOT}.b", f"{ROOT}.a"]]


@pytest.mark.parametrize("statement, expected", [
    ("from llds_jax.train import loop", "llds_jax.train.loop"),
    ("from llds_jax.rl.config import validate", "llds_jax.rl.config"),
    ("import llds_jax.rl.config", "llds_jax.rl.config"),
    ("from . import config", "llds_jax.rl.config"),
    ("from .config import validate", "llds_jax.rl.config"),
    ("from ..train import loop", "llds_jax.train.loop"),
])
def test_edges_name_the_module_an_import_statement_runs(tmp_path, statement, expected):
    path = tmp_path / "llds.py"
    path.write_text(f"def f():\n    {statement}\n")
    known = set(module_files())
    assert import_edges("llds_jax.rl.llds", path, known) == {expected: 2}
