"""Griffe extension for zerofn's API pages (loaded by mkdocs.yml).

1. The folder ``transforms/`` is documented as ``zerofn.transforms``.
   pyproject.toml installs it as that subpackage (``package-dir``). Python's
   import system follows the mapping (the editable install's finder; a wheel
   puts the folder inside ``zerofn/``), but griffe reads packages from the
   file system and looks for ``zerofn/transforms/``, which the repository
   does not have. Once griffe has loaded ``zerofn``, this extension loads
   ``transforms/`` (for griffe a top-level package beside ``zerofn/``) and
   moves it under ``zerofn`` as its member ``transforms``: every object then
   has its installed path (``zerofn.transforms.amp.amp``) and the transforms'
   imports of ``zerofn.transforms.*`` resolve.
2. zerofn's docstrings head their doctests ``Example:``, which the Google
   parser reads as an admonition of Markdown text (where ``x["w"][0]`` looks
   like a reference link); renamed ``Examples:`` they render as code.
3. Sphinx roles in the docstrings (``:class:`Step```, ``:func:`~x.y```)
   become plain code spans, which Markdown renders; without this the role's
   name shows as text.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj|const):`~?([^`]+)`")


class ZerofnDocs(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if pkg.name != "zerofn":
            return
        if "transforms" not in pkg.members:
            loader.load("transforms", try_relative_path=False)
            pkg.set_member("transforms", loader.modules_collection.members.pop("transforms"))
        _docstrings(pkg)


def _docstrings(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = _ROLE.sub(r"`\1`", _EXAMPLE.sub(r"\1Examples:", obj.docstring.value))
    for member in obj.members.values():
        if not member.is_alias:
            _docstrings(member)
