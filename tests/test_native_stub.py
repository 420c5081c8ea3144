"""The native extension from Python: `attnlib/_attnlib_ffi.pyi` declares exactly the functions the built extension
exports (when it is built), and a source tree that hides an installed extension is named as the reason."""

import ast
import pathlib

import pytest


def test_stub_lists_every_function_of_the_extension():
    module = pytest.importorskip("attnlib._attnlib_ffi", reason="the native extension is not built here")
    stub = pathlib.Path(__file__).parent.parent / "attnlib" / "_attnlib_ffi.pyi"
    declared = {node.name for node in ast.parse(stub.read_text()).body if isinstance(node, ast.FunctionDef)}
    exported = {name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))}
    differences = {"missing from the stub": exported - declared, "not in the module": declared - exported}
    assert declared == exported, differences


class _Distribution:
    """An installed attnlib as `importlib.metadata` describes it: its files, located under `root`."""

    def __init__(self, root, files):
        self.root, self.files = root, [pathlib.PurePosixPath(f) for f in files]

    def locate_file(self, file):
        return self.root / file


def test_a_source_tree_hiding_the_installed_extension_is_named(tmp_path, monkeypatch):
    """`python -m attnlib` in a clone after `pip install .` imports the clone (the working directory comes first on
    `sys.path`), which has no compiled extension: the reason says so and where the installed one is, rather than
    "not built"."""
    import importlib.metadata

    from attnlib._src.backends.cudnn import ffi

    site = tmp_path / "site-packages"
    (site / "attnlib").mkdir(parents=True)
    extension = site / "attnlib" / "_attnlib_ffi.cpython-312-x86_64-linux-gnu.so"
    extension.write_bytes(b"")
    files = ["attnlib/__init__.py", "attnlib/_attnlib_ffi.cpython-312-x86_64-linux-gnu.so"]
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: _Distribution(site, files))
    assert ffi.shadowed_extension() == extension.resolve()
    extension.unlink()  # listed but gone: nothing to point at
    assert ffi.shadowed_extension() is None

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)  # a source tree never installed
    assert ffi.shadowed_extension() is None


def test_the_reason_names_the_hidden_extension(tmp_path, monkeypatch):
    import builtins

    from attnlib._src.backends.cudnn import ffi

    real_import = builtins.__import__

    def no_extension(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "attnlib" and fromlist and "_attnlib_ffi" in fromlist:
            raise ImportError("cannot import name '_attnlib_ffi' from 'attnlib'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_extension)
    monkeypatch.setattr(ffi, "shadowed_extension", lambda: tmp_path / "_attnlib_ffi.so")
    module, reason = ffi._load.__wrapped__()
    assert module is None and "hides the installed copy" in reason and str(tmp_path) in reason
    monkeypatch.setattr(ffi, "shadowed_extension", lambda: None)
    module, reason = ffi._load.__wrapped__()
    assert module is None and "is not built" in reason
