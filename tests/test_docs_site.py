"""The documentation site builds with ``mkdocs build --strict``, every page is in its nav, and the API
reference is generated from the docstrings.

Strict mode turns every warning into a failure: a link to a missing page or
anchor, an absolute link, a docstring griffe cannot load. The build reads the
source statically (it imports nothing), so it takes a few seconds.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import re
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return out


def _config() -> dict:
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        return yaml.safe_load(f)


def _nav_pages(nav) -> set[str]:
    if isinstance(nav, str):
        return {nav}
    if isinstance(nav, list):
        return set().union(*(_nav_pages(item) for item in nav))
    if isinstance(nav, dict):
        return set().union(*(_nav_pages(v) for v in nav.values()))
    return set()


def _patterns(text: str | None) -> list[str]:
    """mkdocs' gitignore-style ``exclude_docs`` / ``not_in_nav`` lines as fnmatch patterns (enough for ours)."""
    out = []
    for line in (text or "").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            line = line.lstrip("/")
            out.append(line + "*" if line.endswith("/") else line)
    return out


def _doc_pages() -> list[str]:
    pages = []
    for folder, _, names in os.walk(DOCS):
        pages += [
            os.path.relpath(os.path.join(folder, n), DOCS).replace(os.sep, "/") for n in names if n.endswith(".md")
        ]
    return sorted(pages)


def test_the_strict_build_passes(site):
    assert (site / "index.html").exists()


def test_every_page_is_in_the_nav():
    config = _config()
    in_nav = _nav_pages(config["nav"])
    left_out = _patterns(config.get("exclude_docs")) + _patterns(config.get("not_in_nav"))
    pages = _doc_pages()
    missing = [p for p in pages if p not in in_nav and not any(fnmatch.fnmatch(p, pat) for pat in left_out)]
    assert not missing, (
        f"pages in docs/ but not in mkdocs.yml's nav (add them, or list them under not_in_nav): {missing}"
    )
    gone = sorted(p for p in in_nav if p not in pages)
    assert not gone, f"mkdocs.yml's nav names pages that docs/ does not have: {gone}"


def test_the_api_reference_is_generated(site):
    html = (site / "api" / "zerofn" / "index.html").read_text()
    for name in (
        "zerofn.train_step",
        "zerofn.Step",
        "zerofn.TrainState",
        "zerofn.functional.functional",
        "zerofn.spawn",
    ):
        assert f'id="{name}"' in html, f"{name} is missing from the API page"
    html = (site / "api" / "transforms" / "index.html").read_text()
    for name in ("shard_optimizer", "shard_grads", "shard_params", "amp", "offload", "remat"):
        assert f'id="zerofn.transforms.{name}.{name}"' in html, f"zerofn.transforms.{name} is missing from the API page"
    # Docstring examples render as code, not as Markdown text.
    assert "&gt;&gt;&gt;" in html or '<span class="gp">&gt;&gt;&gt;</span>' in html
    html = (site / "api" / "deepspeed" / "index.html").read_text()
    assert 'id="zerofn.deepspeed.from_deepspeed"' in html


def test_the_docs_name_no_folder_outside_the_repository():
    for page in _doc_pages():
        text = open(os.path.join(DOCS, page)).read()
        assert "../shared" not in text and not re.search(r"\]\((\.\./)+\.\./", text), page


def _deepspeed_keys() -> set[str]:
    """The keys zerofn/deepspeed/_keys.py names in its tables (warned, refused, aliased, quietly done anyway)."""
    tree = ast.parse(open(os.path.join(ROOT, "zerofn", "deepspeed", "_keys.py")).read())
    tables = {"TOP_IGNORED", "TOP_ERRORS", "ZERO_ANYWAY", "ZERO_IGNORED", "ZERO_ALIASES", "AUTO_HINTS"}
    tables |= {"ZERO_BLOCK_ERRORS", "COMPRESSION_TECHNIQUES", "PRECISION_IGNORED"}
    keys = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in tables for t in node.targets):
            keys |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return keys


def test_every_deepspeed_key_is_in_the_migration_table():
    text = open(os.path.join(DOCS, "migrating", "deepspeed.md")).read()
    keys = _deepspeed_keys()
    assert len(keys) > 50
    missing = sorted(k for k in keys if f"`{k}`" not in text and f"`zero_optimization.{k}`" not in text)
    assert not missing, (
        f"keys zerofn/deepspeed/_keys.py handles but docs/migrating/deepspeed.md does not list: {missing}"
    )
