"""Every error and warning message zerofn raises is documented in docs/troubleshooting.md.

The rule, applied to every ``.py`` file under ``zerofn/`` and ``transforms/``:

1. A *message site* is a call that builds an exception, anywhere (``raise
   ValueError(...)``, ``return CheckpointError(...)``, ``err = RankError(...)``),
   or a call of ``warnings.warn(...)``. An exception class is a built-in
   exception, any name ending in ``Error`` or ``Exception`` (such as
   ``argparse.ArgumentTypeError``), or a class defined in these files that
   derives from one (such as ``checkpoint._Late``). ``SystemExit`` counts: its
   message is what the command line prints.
2. Not counted: ``AssertionError`` (the comparisons of ``zerofn.testing`` and
   internal invariants), ``StopIteration``, ``GeneratorExit`` and
   ``KeyboardInterrupt``; re-raises (``raise``, ``raise err``, ``raise
   self.blame.died(...)``), which carry a message built at another site; and
   calls whose message is built at run time from variables only.
3. The message is the call's first positional argument that is a string: a
   literal, an f-string, a ``+`` concatenation, a ``%`` or ``.format``
   template, or the name of a module-level string constant in these files
   (``DONATED_HELP``). ``OSError(errno, message)`` therefore gives its message.
4. Its *literal runs* are the pieces of text between the formatted values.
   The *fragment* is the longest run, with whitespace collapsed, stripped of
   spaces and of the punctuation that ends a formatted value before it
   (``). ``, ``: ``), and cut to its first 60 characters. A message whose longest run is shorter
   than 12 characters (``f"{where}: {err}"``) has nothing stable to look up
   and is skipped.
5. Each fragment must appear in docs/troubleshooting.md, compared with
   whitespace collapsed on both sides (so a message may wrap across lines
   there) and ``\\|`` read as ``|``.

Adding a raise? Quote the message's start in docs/troubleshooting.md under its
topic (as a code span, with ``{name}`` where a value is filled in), and say
what it means and what to do; this test names the fragment it looks for.
"""

from __future__ import annotations

import ast
import builtins
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("zerofn", "transforms")
DOC = os.path.join(ROOT, "docs", "troubleshooting.md")
NOT_COUNTED = {"AssertionError", "StopIteration", "GeneratorExit", "KeyboardInterrupt"}
MIN_CHARS, MAX_CHARS = 12, 60


def _files() -> list[str]:
    out = []
    for top in SOURCES:
        for folder, _, names in os.walk(os.path.join(ROOT, top)):
            out += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
    return sorted(out)


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _exception_classes(trees: dict) -> set[str]:
    """Built-in exceptions and the classes these files derive from any exception class, at any depth."""
    known = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    classes = [node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    grew = True
    while grew:
        grew = False
        for c in classes:
            if c.name not in known and any(_is_exception(_name(b), known) for b in c.bases):
                known.add(c.name)
                grew = True
    return known


def _is_exception(name: str | None, known: set[str]) -> bool:
    return name is not None and (name in known or re.search(r"(Error|Exception)$", name) is not None)


def _constants(trees: dict) -> dict[str, ast.expr]:
    """Module-level ``NAME = "..."`` string constants of every file (a name defined twice is dropped)."""
    found: dict[str, list] = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if isinstance(t, ast.Name):
                        found.setdefault(t.id, []).append(node.value)
    return {k: v[0] for k, v in found.items() if len(v) == 1}


def _runs(node: ast.expr, constants: dict) -> list[str] | None:
    """The literal runs of a message expression (text between formatted values), or None if not a string."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for v in node.values:
            if isinstance(v, ast.Constant):
                out[-1] += v.value
            else:
                out.append("")
        return out
    if isinstance(node, ast.Name) and node.id in constants:
        return _runs(constants[node.id], {})
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _runs(node.left, constants)
        if left is None:
            return None
        right = _runs(node.right, constants)
        if right is None:  # "text " + ", ".join(names): the rest is filled in
            return left + [""]
        return left[:-1] + [left[-1] + right[0]] + right[1:]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        left = _runs(node.left, constants)
        return None if left is None else [p for s in left for p in re.split(r"%[-#0 +]*\d*(?:\.\d+)?[a-z]", s)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        left = _runs(node.func.value, constants)
        return None if left is None else [p for s in left for p in re.split(r"\{[^{}]*\}", s)]
    return None


def _fragment(runs: list[str]) -> str | None:
    run = max((" ".join(r.split()).lstrip(" .,;:)]}").rstrip() for r in runs), key=len)
    return run[:MAX_CHARS].rstrip() if len(run) >= MIN_CHARS else None


def messages() -> list[tuple[str, str]]:
    """``(file:line, fragment)`` for every message site the rule counts."""
    trees = {path: ast.parse(open(path).read(), path) for path in _files()}
    exceptions = _exception_classes(trees) - NOT_COUNTED
    constants = _constants(trees)
    out = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            warn = name == "warn" and isinstance(node.func, ast.Attribute) and _name(node.func.value) == "warnings"
            if not warn and (name in NOT_COUNTED or not _is_exception(name, exceptions)):
                continue
            for arg in node.args:
                runs = _runs(arg, constants)
                if runs is not None:
                    fragment = _fragment(runs)
                    if fragment:
                        out.append((f"{os.path.relpath(path, ROOT)}:{node.lineno}", fragment))
                    break
    return out


def _normalised(text: str) -> str:
    return " ".join(text.replace("\\|", "|").split())


def test_the_scan_finds_the_messages():
    found = messages()
    # A scan broken by a refactor (no files, no calls recognised) must not pass the test below vacuously.
    assert len(found) > 150, f"only {len(found)} message sites found under {SOURCES}"
    assert any(f.startswith("from_deepspeed: the config has no") for _, f in found)
    assert any("was donated to a step" in f for _, f in found)  # a module-level constant (DONATED_HELP)


def test_every_message_is_documented():
    doc = _normalised(open(DOC).read())
    missing = [(where, f) for where, f in messages() if f not in doc]
    assert not missing, (
        f"{len(missing)} error or warning message(s) are not in docs/troubleshooting.md. Quote each under its "
        "topic, with what it means and what to do (the rule is in this test's docstring):\n"
        + "\n".join(f"  {where}: {f!r}" for where, f in missing)
    )
