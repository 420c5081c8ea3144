"""The documentation covers the public API, and the notebooks are committed executed and listed in the docs.

Cheap, CPU-only checks on files. Building the site (`mkdocs build --strict`) and executing the notebooks
(`python3 notebooks/run.py`) are separate CI steps.
"""

import importlib
import inspect
import json
import pathlib
import pkgutil
import re
import types

import pytest


ROOT = pathlib.Path(__file__).resolve().parent.parent
API_DIR = ROOT / "docs" / "api"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _public_modules() -> list[str]:
    import attnlib

    subs = [m.name for m in pkgutil.iter_modules(attnlib.__path__) if not m.name.startswith("_")]
    return ["attnlib"] + [f"attnlib.{name}" for name in sorted(subs)]


def _public_names() -> list[str]:
    names = []
    for module_name in _public_modules():
        module = importlib.import_module(module_name)
        exported = getattr(module, "__all__", None)
        if exported is None:
            exported = [n for n in vars(module) if not n.startswith("_")]
        for name in exported:
            obj = getattr(module, name)
            if isinstance(obj, types.ModuleType):  # submodules and imported helpers (e.g. importlib)
                continue
            names.append(f"{module_name}.{name}")
    return names


def _documented() -> set[str]:
    entries = set()
    for page in API_DIR.glob("*.md"):
        entries.update(re.findall(r"^:::\s+(\S+)\s*$", page.read_text(), flags=re.MULTILINE))
    return entries


def test_public_modules_found():
    modules = _public_modules()
    assert {"attnlib", "attnlib.equinox", "attnlib.haiku", "attnlib.flax"} <= set(modules)


@pytest.mark.parametrize("name", _public_names())
def test_every_public_name_has_an_api_entry(name):
    assert name in _documented(), (
        f"`{name}` is public but has no `::: {name}` entry under docs/api/. Add one (mkdocs build --strict "
        f"then renders its docstring)."
    )


def test_every_api_entry_resolves():
    for entry in sorted(_documented()):
        module_name, _, attr = entry.rpartition(".")
        obj = getattr(importlib.import_module(module_name), attr)
        assert inspect.getdoc(obj), f"`{entry}` has no docstring"


def test_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    assert "01_quickstart.ipynb" in names and len(names) >= 6, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_committed_executed(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert code, f"{path.name} has no code cells"
    unexecuted = [i for i, c in enumerate(code) if c.get("execution_count") is None]
    assert not unexecuted, (
        f"{path.name}: code cells {unexecuted} have no outputs; run `python3 notebooks/run.py --write`"
    )
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name} was not executed top to bottom: {counts}"
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name} has error outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_in_docs_nav(path):
    assert f"notebooks/{path.name}" in (ROOT / "mkdocs.yml").read_text(), f"{path.name} is not in mkdocs.yml nav"


def _snippet_pages() -> list[pathlib.Path]:
    return sorted(p for p in (ROOT / "docs").glob("*.md") if "```python" in p.read_text())


def test_the_haiku_snippet_of_the_layers_page_runs_on_its_own(tmp_path, monkeypatch):
    """A reader who only uses Haiku pastes only its block."""
    import jax

    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "layers.md").read_text(), re.S)
    (block,) = [b for b in blocks if b.startswith("import haiku")]
    with jax.numpy_dtype_promotion("standard"):
        exec(compile(block, "layers.md, the Haiku block", "exec"), {})


@pytest.mark.parametrize("page", _snippet_pages(), ids=lambda p: p.name)
def test_every_python_snippet_in_the_docs_runs(page, tmp_path, monkeypatch):
    """The `python` blocks of a page run top to bottom in one namespace, as a reader pasting them in order would
    (signature sketches are fenced as `text`). They run in a scratch directory (one writes a checkpoint)."""
    import jax

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
    with jax.numpy_dtype_promotion("standard"):  # the docs use JAX's defaults, not the suite's strict promotion
        for i, block in enumerate(blocks):
            exec(compile(block, f"{page.name}, python block {i}", "exec"), namespace)
