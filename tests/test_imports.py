"""The import graph, read from the source (function-level imports included): no cycles between modules,
and no arrow pointing up the layers that docs/design.md names."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The folders of the one import package `kvjax` (pyproject.toml installs the last three as subpackages).
PACKAGES = {"kvjax": "kvjax", "architectures": "kvjax.architectures", "training": "kvjax.training"}
PACKAGES["pallas_kernels"] = "kvjax.pallas_kernels"
# Layers, lowest first: a module may import its own layer and those below it (a module's layer is the
# longest that names it). The commands sit on top of everything and nothing in the library imports them.
LAYERS = ("kvjax.pallas_kernels", "kvjax", "kvjax.architectures", "kvjax.training", "kvjax.commands")


def _module_name(path: Path) -> str:
    folder, *parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join([PACKAGES[folder], *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for folder in PACKAGES for p in (ROOT / folder).rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports anywhere in its file (`from a import b` counts a.b when b is
    a module, else a)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _layer(module: str) -> int:
    matches = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    return LAYERS.index(max(matches, key=len))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_no_module_imports_a_layer_above_its_own(graph):
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if _layer(b) > _layer(a))
    assert not upward, "imports pointing up the layers (docs/design.md):\n" + "\n".join(upward)


def test_no_import_cycles(graph):
    # A package's __init__ importing its own modules is how it exports them, not a cycle.
    edges = {a: {b for b in targets if not a.startswith(b + ".")} for a, targets in graph.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_graph_is_read_correctly(graph):
    """The checks above can fail: the reader sees module-level and function-level imports."""
    assert "kvjax.errors" in graph["kvjax.compress.policy"]
    assert "kvjax.training.trainer" in graph["kvjax.commands.train"]
    assert _layer("kvjax.commands.train") > _layer("kvjax.training.trainer") > _layer("kvjax.cache")
    assert _layer("kvjax.pallas_kernels.backend") < _layer("kvjax.cache")


def test_one_import_package_whose_folders_pyproject_installs():
    """Every package folder is listed in pyproject.toml (a missing one would be left out of the wheel)
    and no module imports a folder by its own top-level name (which would load it twice, or clash
    with another project's `training` in site-packages)."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == {_module_name(p) for folder in PACKAGES for p in (ROOT / folder).rglob("__init__.py")}
    bare = sorted(
        f"{path.relative_to(ROOT)}: {target}"
        for path in [*ROOT.glob("[!.]*/**/*.py")]
        if ".venv" not in path.parts
        for target in _bare_imports(path)
    )
    assert not bare, bare


def _bare_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
        found |= {n for n in names if n.split(".")[0] in ("training", "architectures", "pallas_kernels")}
    return found


@pytest.mark.parametrize("module", ["kvjax.page_pool", "kvjax.scheduler"])
def test_the_serving_host_side_imports_no_jax(module):
    """The page pool and the scheduler are host bookkeeping (plain data in, a plan out): no jax, flax or
    project module that computes on the device."""
    tree = ast.parse(_modules()[module].read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {n for n in names if n.split(".")[0] in ("jax", "flax")}, names
    assert {n for n in names if n.startswith("kvjax.")} <= {"kvjax.config", "kvjax.page_pool"}, names
