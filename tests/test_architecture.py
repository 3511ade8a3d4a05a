"""The house by layers: every module sits in one layer, imports only go down, and nothing below a
transform knows it by name.

    front-ends, tools   zerofn.deepspeed, zerofn.launch, zerofn.plan, zerofn.bench, metrics, memory, testing
    persistence         zerofn.checkpoint
    transforms          zerofn.transforms
    core                step and its parts, state, functional, collectives, mesh, optim, roles, keys, placement
    leaves              tree, _io, _safetensors

``zerofn/__init__.py`` is the public facade: it may import any layer, and no module below the tools
imports it. See docs/design.md ("The house by layers").
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import re

import pytest
import torch
import zerofn.transforms

import zerofn

ROOT = pathlib.Path(zerofn.__file__).parent
TRANSFORMS_DIR = pathlib.Path(zerofn.transforms.__file__).parent

LAYERS = {  # bottom first
    "leaves": ("zerofn.tree", "zerofn._io", "zerofn._safetensors", "zerofn.counters", "zerofn.alloc"),
    "core": (
        "zerofn.step",
        "zerofn.reduction",
        "zerofn.storage",
        "zerofn.precision",
        "zerofn.extension",
        "zerofn.state",
        "zerofn.functional",
        "zerofn.closure",
        "zerofn.collectives",
        "zerofn.mesh",
        "zerofn.optim",
        "zerofn.roles",
        "zerofn.keys",
        "zerofn.placement",
        "zerofn.sharding",
        "zerofn.losses",
        "zerofn.moe",
        "zerofn.tiling",
    ),
    "transforms": ("zerofn.transforms",),
    "persistence": ("zerofn.checkpoint",),
    "tools": (
        "zerofn.deepspeed",
        "zerofn.launch",
        "zerofn.plan",
        "zerofn.bench",
        "zerofn.metrics",
        "zerofn.generation",
        "zerofn.memory",
        "zerofn.testing",
        "zerofn.__main__",
    ),
}
RANK = {layer: i for i, layer in enumerate(LAYERS)}
FACADE = "zerofn"


def _modules() -> dict[str, pathlib.Path]:
    """Every module of the installed package: dotted name -> file."""
    out = {}
    for base, prefix in ((ROOT, "zerofn"), (TRANSFORMS_DIR, "zerofn.transforms")):
        for p in sorted(base.rglob("*.py")):
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = p
    return out


MODULES = _modules()


def layer_of(module: str) -> str | None:
    """The layer a module belongs to (its longest listed prefix); None for the facade."""
    best = None
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (layer, prefix)
    return best[0] if best else None


def _resolve(name: str) -> str:
    """The zerofn module an import names (a name imported from a package may be a submodule)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _type_checking_only(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return ids


def imports_of(module: str, typing: bool = False) -> set[str]:
    """The zerofn modules ``module`` imports (at any depth of its code; typing-only imports excepted
    unless ``typing``)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    skip = set() if typing else _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # a submodule where the name is one, else the module the name is defined in
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        out |= {_resolve(n) for n in names if n == FACADE or n.startswith(FACADE + ".")}
    out.discard(module)
    return out


def test_every_module_is_in_a_layer():
    unplaced = [m for m in MODULES if m != FACADE and layer_of(m) is None]
    assert unplaced == [], f"modules in no layer (add them to LAYERS and to docs/design.md): {unplaced}"
    assert {"zerofn.step", "zerofn.checkpoint", "zerofn.transforms.amp", "zerofn._io"} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != FACADE))
def test_imports_go_only_down(module):
    mine = RANK[layer_of(module)]
    wrong = []
    for target in sorted(imports_of(module)):
        if target == FACADE:
            if mine < RANK["tools"]:
                wrong.append(f"{target} (the facade: import the module that defines the name)")
        elif RANK[layer_of(target)] > mine:
            wrong.append(f"{target} ({layer_of(target)})")
    assert wrong == [], f"{module} ({layer_of(module)}) imports from above its layer: {wrong}"


def test_no_import_cycle():
    graph = {m: imports_of(m) - {FACADE} for m in MODULES if m != FACADE}
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycles.append(path[path.index(n) :] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_no_two_modules_import_each_other():
    """Not even for type annotations alone (``if TYPE_CHECKING:``): two modules that need each other's
    names are one module, or share a third that both import."""
    graph = {m: imports_of(m, typing=True) - {FACADE} for m in MODULES if m != FACADE}
    pairs = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))
    assert pairs == [], f"modules that import each other: {pairs}"


def _module_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to a zerofn module (``from zerofn import collectives as C``, ``import zerofn.x as y``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerofn"):
            out |= {a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in MODULES}
        elif isinstance(node, ast.Import):
            out |= {a.asname for a in node.names if a.asname and a.name.startswith("zerofn")}
    return out


def test_no_private_name_crosses_modules():
    """``from m import _x`` or ``m._x`` (a private name of another module) nowhere; a private module only
    from its own package."""
    wrong = []
    for module, path in MODULES.items():
        package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        aliases = _module_aliases(tree)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                wrong.append(f"{module}: {node.value.id}.{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("zerofn"):
                wrong += [f"{module}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
                private = [p for p in node.module.split(".") if p.startswith("_") and p != "__main__"]
                if private:
                    owner = node.module.rsplit(".", 1)[0]
                    if not (package == owner or package.startswith(owner + ".")) and layer_of(node.module) != "leaves":
                        wrong.append(f"{module}: imports the private module {node.module}")
    assert wrong == []


# ---------------------------------------------------------------- words: the core names no transform


def _transform_words() -> tuple[set[str], set[str]]:
    """Every transform's name (its piece of a step's name, and its module), and every quantity a
    transform's state declares (``zerofn.roles``), found by building states the way users do."""
    import tempfile

    from zerofn.transforms import amp, offload, remat, shard_params

    import zerofn as zf
    from zerofn import roles
    from zerofn import tree as T

    names = {
        m.split(".")[-1] for m in MODULES if m.startswith("zerofn.transforms.") and not m.split(".")[-1].startswith("_")
    }
    names |= {n for n in zerofn.transforms.__all__} | {"deepspeed", "from_deepspeed"}
    quantities: set[str] = set()
    with tempfile.TemporaryDirectory() as d:
        apply = zf.functional(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
        base = zf.train_step(lambda p, b: apply(p, b).square().mean(), zf.optim.adamw(1e-3))
        steps = [
            amp(base),
            offload(base, overlap=False),
            offload(base, delay=1),
            offload(shard_params(base), params=True, overlap=False),
            offload(amp(base), "nvme", path=d),
            remat(base),
        ]
        for step in steps:
            for piece in [e.name for e in step.extensions] + [
                step.reduction.name,
                step.storage.name,
                step.precision.name,
            ]:
                if piece:
                    names.add(piece)
            state = step.init(apply.params, keep_module=True)
            todo = [state.opt_state]
            while todo:
                for node in T.tree_leaves(todo.pop(), is_leaf=lambda x: roles.parts_of(x) is not None):
                    for part in roles.parts_of(node) or ():
                        if isinstance(part, roles.Quantity):
                            quantities.add(part.name)
                        else:
                            todo.append(part.tree)
    return names, quantities


TRANSFORM_NAMES, QUANTITY_NAMES = _transform_words()
BELOW_TRANSFORMS = sorted(m for m in MODULES if m != FACADE and RANK[layer_of(m)] < RANK["transforms"])
PERSISTENCE = sorted(m for m in MODULES if layer_of(m) == "persistence")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (prose may speak of transforms)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def words_in_code(source: str, names: set[str], quantities: set[str]) -> list[str]:
    """Transform names in identifiers, strings and imports; quantity names as strings (they are keys)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    by_name = re.compile(r"\b(" + "|".join(map(re.escape, sorted(names))) + r")\b")
    by_key = re.compile(r"^(" + "|".join(map(re.escape, sorted(quantities))) + r")$") if quantities else None
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if by_key is not None and by_key.match(text):
                found.append(f"line {node.lineno}: the quantity {text!r}")
        elif isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            text = " ".join([getattr(node, "module", None) or ""] + [a.name for a in node.names])
            if re.search(r"zerofn(\.| )transforms\b", text):
                found.append(f"line {node.lineno}: imports {text}")
        else:
            continue
        found += [f"line {node.lineno}: {m}" for m in by_name.findall(text)]
    return found


def test_the_word_lists_are_complete():
    assert {"shard_optimizer", "shard_grads", "shard_params", "amp", "offload", "remat", "deepspeed"} <= TRANSFORM_NAMES
    assert {"master", "pending"} <= QUANTITY_NAMES  # amp's fp32 masters, offload's delayed update


@pytest.mark.parametrize("module", BELOW_TRANSFORMS + PERSISTENCE)
def test_below_and_above_the_transforms_no_module_names_one(module):
    assert words_in_code(MODULES[module].read_text(), TRANSFORM_NAMES, QUANTITY_NAMES) == []


def test_the_check_sees_a_transform_named_in_code():
    names, quantities = {"amp", "shard_grads"}, {"master"}
    assert words_in_code('x = "amp"\n', names, quantities) == ["line 1: amp"]
    assert words_in_code("if step.uses_amplifier: pass\n", names, quantities) == []  # a longer word is not the name
    assert words_in_code("from zerofn.transforms import shard_grads\n", names, quantities) != []
    assert words_in_code("import zerofn.transforms\n", names, quantities) == ["line 1: imports  zerofn.transforms"]
    assert words_in_code('k = "master"\n', names, quantities) == ["line 1: the quantity 'master'"]
    assert words_in_code("full_params(state, master=True)\n", names, quantities) == []  # an argument, not a key
    assert words_in_code("from zerofn.optim.transforms import scale\n", names, quantities) == []
    assert words_in_code('"""Speaks of amp in prose."""\n', names, quantities) == []


def test_the_layer_check_sees_an_upward_import(tmp_path):
    assert layer_of("zerofn.checkpoint._load") == "persistence"
    assert layer_of("zerofn.transforms.offload._nvme") == "transforms"
    assert RANK[layer_of("zerofn.checkpoint")] > RANK[layer_of("zerofn.transforms.amp")] > RANK[layer_of("zerofn.step")]


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists its packages one by one: a folder made a package and left out of the list is
    missing from every wheel (an editable install still finds it, so no other test would notice)."""
    line = re.search(r"^packages = \[(.*)\]$", (ROOT.parent / "pyproject.toml").read_text(), re.M)
    listed = set(re.findall(r'"([\w.]+)"', line.group(1)))
    found = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert found <= listed, (
        f"packages missing from pyproject.toml's [tool.setuptools] packages: {sorted(found - listed)}"
    )


def test_no_test_folder_shadows_a_package():
    """tests/ is on sys.path while the tests run, so a folder there is a namespace package of its name:
    one named after a package zerofn may import (tests/deepspeed) makes find_spec find the folder, and
    code that asks whether that package is installed is told it is."""
    tests = ROOT.parent / "tests"  # each folder holding a test module is on sys.path too (pytest's prepend mode)
    folders = {d.name for d in tests.rglob("*") if d.is_dir()}
    imported = {"deepspeed", "torch", "transformers", "peft", "zerofn", "optree", "einops", "safetensors", "chex"}
    assert not folders & imported, folders & imported
    spec = importlib.util.find_spec("deepspeed")
    assert spec is None or spec.origin is not None, spec  # a namespace package: a folder, not DeepSpeed


def test_importing_zerofn_leaves_the_heavy_torch_packages_for_when_they_are_used():
    """Every rank and example starts by importing zerofn: ``torch.distributed.pipelining`` (dynamo and DTensor
    with it, 1.5 s on a CI core) is imported by the pipeline's first step, not by ``import zerofn``."""
    import subprocess
    import sys

    code = "import sys, zerofn, zerofn.transforms; print(sorted(m for m in sys.modules if m.startswith(HEAVY)))"
    heavy = ("torch.distributed.pipelining", "torch._dynamo", "torch.distributed.tensor")
    out = subprocess.run(
        [sys.executable, "-c", f"HEAVY = {heavy!r}; {code}"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
