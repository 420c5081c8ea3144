"""`attnlib/_attnlib_ffi.pyi` declares exactly the functions the built extension exports (when it is built)."""

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
