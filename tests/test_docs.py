"""Every docstring example in the package runs and prints what it says."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import zerofn.transforms

import zerofn


def _raise(name):
    # walk_packages imports each subpackage to list its modules; without this
    # it would silently skip a subpackage whose import fails with ImportError.
    raise ImportError(f"could not import package {name} to list its modules")


def _walk(package):
    """``package`` and every module and subpackage below it, at any depth."""
    return {package.__name__} | {
        m.name for m in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=_raise)
    }


# zerofn.transforms lives in the top-level folder transforms/ (see
# pyproject.toml), so it is walked on its own; the set keeps a module found by
# both walks (as in a wheel install, where it sits inside zerofn/) once.
MODULES = sorted(_walk(zerofn) | _walk(zerofn.transforms))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} docstring examples failed"
