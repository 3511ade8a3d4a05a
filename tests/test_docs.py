"""Every docstring example in the package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import zerofn
import zerofn.transforms

MODULES = sorted(
    {m.name for m in pkgutil.iter_modules(zerofn.__path__, "zerofn.")}
    | {m.name for m in pkgutil.iter_modules(zerofn.transforms.__path__, "zerofn.transforms.")}
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring examples failed"
