"""The house rules of `docs/architecture.md`, read from the source: every module says its one job in a docstring, no
module imports run in a circle, no module rebinds its own globals at run time (no `global` switches).

Imports are read with `ast`, without importing anything; only imports at module level count for circles (an import
inside a function runs after every module has loaded).
"""

import ast
import pathlib

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent / "attnlib"


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imported(module: str, path: pathlib.Path, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The attnlib modules an import statement loads (a name imported from a package counts as its submodule when
    there is one, else as the package)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
        source = ".".join(base + ([node.module] if node.module else []))
        names = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source for alias in node.names]
    found = set()
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)
    return found


def _module_level_imports() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = set().union(*(_imported(module, path, node) for node in tree.body
                                      if isinstance(node, (ast.Import, ast.ImportFrom))))  # fmt: skip
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    circles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                circles.append(stack[stack.index(target) :] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return circles


def test_the_package_is_found():
    assert "attnlib" in MODULES and "attnlib._src.backends.cudnn.row_fill" in MODULES
    assert len(MODULES) > 40


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_opens_with_a_docstring(module):
    docstring = ast.get_docstring(ast.parse(MODULES[module].read_text()))
    assert docstring and docstring.splitlines()[0].strip(), f"{module} has no one-line docstring of its job"


def test_no_import_circle():
    assert _circles(_module_level_imports()) == []


def test_the_circle_finder_finds_one():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_rebinds_its_globals():
    offenders = [f"{module}: global {', '.join(node.names)}" for module, path in MODULES.items()
                 for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Global)]  # fmt: skip
    assert offenders == []
