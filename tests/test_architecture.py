"""The core (zerofn/) imports no transform and names none in its code: transforms are new modules."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

import zerofn

CORE = pathlib.Path(zerofn.__file__).parent
TRANSFORMS = ("shard_optimizer", "shard_grads", "shard_params", "amp", "offload")
NAMED = re.compile(r"\b(" + "|".join(TRANSFORMS) + r")\b")
TOOLS = {"bench"}  # the benchmark harness uses the transforms as a user does, like examples/


def _core_files() -> list[pathlib.Path]:
    return sorted(p for p in CORE.rglob("*.py") if not {"transforms", *TOOLS} & set(p.relative_to(CORE).parts))


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may speak of transforms)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def _names_in_code(source: str) -> list[str]:
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            text = " ".join([getattr(node, "module", None) or ""] + [a.name for a in node.names])
        else:
            continue
        found += [f"line {node.lineno}: {m}" for m in NAMED.findall(text)]
        if isinstance(node, (ast.Import, ast.ImportFrom)) and re.search(r"zerofn(\.| )transforms\b", text):
            found.append(f"line {node.lineno}: imports {text}")
    return found


def test_the_core_files_are_found():
    names = {p.name for p in _core_files()}
    assert {"step.py", "state.py", "reduction.py", "storage.py", "precision.py", "extension.py"} <= names
    assert "amp.py" not in names


@pytest.mark.parametrize("path", _core_files(), ids=lambda p: str(p.relative_to(CORE)))
def test_core_names_no_transform(path):
    assert _names_in_code(path.read_text()) == []


def test_the_check_sees_a_transform_named_in_code():
    assert _names_in_code('x = "amp"\n') == ["line 1: amp"]
    assert _names_in_code("if step.uses_offload: pass\n") == []  # a longer word is not the name
    assert _names_in_code("from zerofn.transforms import shard_grads\n") != []
    assert _names_in_code("import zerofn.transforms\n") == ["line 1: imports  zerofn.transforms"]
    assert _names_in_code("from zerofn import transforms\n") == ["line 1: imports zerofn transforms"]
    assert _names_in_code("from zerofn.optim.transforms import scale\n") == []
    assert _names_in_code('"""Speaks of amp in prose."""\n') == []
