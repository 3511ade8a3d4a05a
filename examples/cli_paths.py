"""The examples' command-line paths, checked before any work: each failure is a usage error (exit
status 2, no traceback) that says what was wrong and what to create or pass.

Standard library only, so a script can check its paths before it imports torch.

- :func:`existing_dir`, :func:`existing_file`: something to read, which must be there;
- :func:`output_file`: a file to write, whose directory must exist;
- :func:`output_dir`: a directory to write to, made here when missing if its parent exists.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["existing_dir", "existing_file", "output_dir", "output_file"]


def _parent(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


def _existing(p: argparse.ArgumentParser, flag: str, path: str | None, hint: str, kind: str) -> None:
    """``path`` (None: not given) must be an existing ``kind`` ("directory" or "file")."""
    if path is None:
        return
    is_kind, is_other = (os.path.isdir, os.path.isfile) if kind == "directory" else (os.path.isfile, os.path.isdir)
    other = "file" if kind == "directory" else "directory"
    if is_other(path):
        p.error(f"{flag} {path} is a {other}, not a {kind}; {hint}")
    if not is_kind(path):
        p.error(f"{flag} {path}: no such {kind}; {hint}")


def existing_dir(p: argparse.ArgumentParser, flag: str, path: str | None, hint: str) -> None:
    """``path`` (None: not given) must be a directory; ``hint`` says what to do instead."""
    _existing(p, flag, path, hint, "directory")


def existing_file(p: argparse.ArgumentParser, flag: str, path: str | None, hint: str) -> None:
    """``path`` (None: not given) must be a file; ``hint`` says what to pass instead."""
    _existing(p, flag, path, hint, "file")


def output_file(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """``path`` (None: not given) is a file to write: not a directory, and its directory must exist."""
    if path is None:
        return
    if os.path.isdir(path):
        p.error(f"{flag} {path} is a directory; pass the name of a file to write")
    parent = _parent(path)
    if not os.path.isdir(parent):
        p.error(
            f"{flag} {path}: the directory it goes in, {parent}, does not exist; create it (mkdir -p {parent}) "
            "or pass a file in an existing directory"
        )


def output_dir(p: argparse.ArgumentParser, flag: str, path: str | None) -> None:
    """``path`` (None: not given) is a directory to write to: made here if missing and its parent exists."""
    if path is None:
        return
    if os.path.exists(path) and not os.path.isdir(path):
        p.error(f"{flag} {path} is a file, not a directory; pass a directory (it is created when missing)")
    if os.path.isdir(path):
        return
    parent = _parent(path)
    if not os.path.isdir(parent):
        p.error(
            f"{flag} {path}: neither it nor its parent {parent} exists; create the parent (mkdir -p {parent}), "
            f"and {os.path.basename(os.path.abspath(path))} is created in it, or pass a directory that exists"
        )
    os.makedirs(path, exist_ok=True)
