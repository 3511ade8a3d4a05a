"""How ``shard_params`` cuts a model into units and materialises their shards.

A *unit* is a set of modules whose parameters are gathered and released
together; :func:`unit_names` chooses them (the ``units=`` policy: by
default the model's natural blocks, or :class:`MinUnitBytes` to cut by
size) and :func:`assign_units` places every parameter in one.
:class:`Materialiser` fills this rank's shards one module at a time, also
from a model built on the meta device. :class:`Intercept` runs a step's own
work around a module's call from outside the module: outside the region
that ``module.compile()`` compiled (see docs/compile.md).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerofn import alloc
from zerofn import tree as T
from zerofn.functional import Functional
from zerofn.reduction import bucket_rank
from zerofn.state import Bucket, Layout

__all__ = [
    "ROOT",
    "Intercept",
    "Materialiser",
    "MinUnitBytes",
    "Unit",
    "assign_units",
    "compiled",
    "compiles_children",
    "inside",
    "unit_buckets",
    "unit_names",
]

ROOT = ""
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)  # their children are a model's natural blocks


@dataclass(frozen=True)
class Unit:
    """A module whose parameters are gathered and released together (static)."""

    name: str  # module path; "" is the root (parameters in no other unit)
    buckets: tuple[int, ...]  # its trainable buckets (indices into layout.buckets)
    frozen: tuple[int, ...]  # its frozen buckets (indices into layout.frozen_buckets)


def unit_buckets(
    params: dict,
    world: int,
    labels: dict | None = None,
    apart: dict | None = None,
    cut: dict | None = None,
    replicate: str = "",
) -> tuple[Bucket, ...]:
    """One bucket per dtype (and optimizer label, and axis its parameters are cut along: ``apart``, see
    :class:`~zerofn.storage.ParamSplit`) for a unit's parameters, placed where they will be materialised."""
    if not params:
        return ()
    buckets = Layout.build(
        params, shards=world, bucket_bytes=1 << 62, labels=labels, apart=apart, cut=cut, replicate=replicate
    ).buckets
    return tuple(dataclasses.replace(b, device=str(materialise_device())) if b.device == "meta" else b for b in buckets)


# ---------------------------------------------------------------- choosing units


@dataclass(frozen=True)
class MinUnitBytes:
    """A ``units=`` policy by size: the finest cut whose units each hold at least ``min_bytes``.

    A module is a unit when its parameters (its submodules' included) take
    at least ``min_bytes`` and none of its children's do; units never nest,
    and parameters in no unit (small modules beside the units) form the
    root unit. A larger ``min_bytes`` gives fewer, larger gathers; a smaller
    one bounds memory more tightly (a step holds about ``prefetch + 2``
    units' full parameters and gradients at once). Use it for a model whose
    blocks sit in no ``nn.ModuleList``, ``nn.Sequential`` or ``nn.ModuleDict``.

    Example:
        >>> from torch import nn
        >>> from zerofn.transforms._units import MinUnitBytes, unit_names
        >>> model = nn.Sequential(nn.Linear(64, 64), nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)))
        >>> unit_names(model, MinUnitBytes(16 * 1024))  # each Linear holds 16,640 bytes
        ['0', '1.0', '1.1']
        >>> unit_names(model, MinUnitBytes(20 * 1024))  # '1' is the smallest module holding that much
        ['1']
    """

    min_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool) or self.min_bytes <= 0:
            raise ValueError(f"MinUnitBytes: min_bytes must be an int > 0 (parameter bytes), got {self.min_bytes!r}")

    def __call__(self, path: str, module: nn.Module) -> bool:
        return param_bytes(module) >= self.min_bytes and all(param_bytes(c) < self.min_bytes for c in module.children())


def param_bytes(module: nn.Module) -> int:
    """Bytes of a module's parameters, its submodules' included, each tensor counted once (meta ones too)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def unit_names(module: nn.Module, units: Any = None, where: str = "shard_params: units") -> list[str]:
    """Module paths of the units, in registration order, none inside another.

    ``units`` is ``shard_params``' option (``remat``'s ``blocks``): ``None``
    (the natural blocks, see :func:`natural_blocks`), a predicate ``(path,
    module) -> bool`` such as :class:`MinUnitBytes`, or a list of module
    paths. A policy (not a list) that leaves the whole model in one unit
    warns. ``where`` names the option in errors.
    """
    if units is None:
        out = natural_blocks(module)
    else:
        if callable(units):
            names = [n for n, m in module.named_modules() if n and units(n, m)]
        else:
            names = list(units)
            known = dict(module.named_modules())
            for n in names:
                if n not in known:
                    raise ValueError(f"{where} names {n!r}, which is not a submodule of the model")
        out = []
        for n in names:
            if any(inside(n, c) or inside(c, n) for c in out):
                raise ValueError(
                    f"{where} {n!r} and {[c for c in out if inside(n, c) or inside(c, n)][0]!r} "
                    "nest; a unit must not contain another. Name the outer or the inner modules, not both."
                )
            out.append(n)
    if not isinstance(units, (list, tuple)):  # a list is the user's explicit choice, [] included
        _warn_if_one_unit(module, out, units)
    return out


def natural_blocks(module: nn.Module) -> list[str]:
    """The default units: the blocks a model is built from, in registration order.

    The children of every outermost ``nn.ModuleList``, ``nn.Sequential`` or
    ``nn.ModuleDict`` (at any depth: a plain Sequential, Hugging Face's
    ``model.model.layers``, a ModuleDict of stages), skipping those without
    parameters. A child that holds more than half of the model's parameter
    bytes is no useful unit: it is cut in turn into its own children (so a
    Sequential whose one element is a ModuleList of blocks gives the
    blocks), unless it has none that hold parameters.

    Example:
        >>> from torch import nn
        >>> blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
        >>> natural_blocks(nn.Sequential(nn.Linear(4, 8), nn.ModuleList(blocks), nn.Linear(8, 2)))
        ['0', '1.0', '1.1', '1.2', '2']
    """
    total = param_bytes(module)
    sizes: dict[int, int] = {}

    def size(m: nn.Module) -> int:
        if id(m) not in sizes:
            sizes[id(m)] = param_bytes(m)
        return sizes[id(m)]

    chosen: set[int] = set()  # a block reached twice (shared between containers) is one unit

    def cut(m: nn.Module, path: str) -> list[str]:  # units covering m's children; m itself is not one
        out: list[str] = []
        for name, child in m.named_children():
            p = _join(path, name)
            if size(child) == 0 or id(child) in chosen:
                continue
            chosen.add(id(child))
            out += (cut(child, p) or [p]) if 2 * size(child) > total else [p]
        return out

    def find(m: nn.Module, path: str) -> list[str]:
        if isinstance(m, CONTAINERS):
            return cut(m, path)
        out: list[str] = []
        for name, child in m.named_children():
            out += find(child, _join(path, name))
        return out

    return find(module, ROOT) if total else []


def _warn_if_one_unit(module: nn.Module, names: list[str], units: Any) -> None:
    """Warn when the units leave the model whole although it has several modules with parameters."""
    owners = [m for m in module.modules() if next(m.parameters(recurse=False), None) is not None]
    if len(owners) < 2:
        return  # nothing to cut (a single Linear, say)
    every = {id(p) for p in module.parameters()}
    groups = [s for s in ({id(p) for p in module.get_submodule(n).parameters()} for n in names) if s]
    rest = every - set().union(*groups)
    if len(groups) + bool(rest) > 1:
        return
    if units is None:
        why = (
            "The default units= policy cuts at the children of nn.ModuleList, nn.Sequential and nn.ModuleDict "
            "containers, and this model has none that splits it."
        )
    elif isinstance(units, MinUnitBytes):
        why = f"{units!r} finds no finer cut into units of at least that many bytes; a smaller min_bytes cuts finer."
    else:
        why = f"units={units!r} chose {names or 'no module'}."
    warnings.warn(
        f"shard_params: the model ({type(module).__name__}, {param_bytes(module)} parameter bytes in "
        f"{len(owners)} modules) is one unit, gathered whole in every forward and backward, so ZeRO-3 saves "
        f"no parameter memory inside a step. {why} Pass units= to cut it: the module paths of its blocks "
        "(units=['encoder.0', 'encoder.1', ...]), a predicate (units=lambda path, module: isinstance(module, "
        "MyBlock)), or a size (units=MinUnitBytes(n), from zerofn.transforms.shard_params: each unit the "
        "smallest module holding at least n parameter bytes).",
        UserWarning,
        stacklevel=3,
    )


def inside(name: str, outer: str) -> bool:
    return name == outer or name.startswith(outer + ".")


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def assign_units(functional: Functional, named: dict, unit_names: list[str]) -> dict[str, str]:
    """parameter name -> unit; a parameter that two units share goes to the root.

    Units are found by module identity, so a module that appears twice (a
    shared block) is one unit whichever path reaches it.
    """
    module = functional.module
    unit_of_module: dict[int, str] = {}
    for path, m in module.named_modules():
        unit_of_module[id(m)] = max((u for u in unit_names if inside(path, u)), key=len, default=ROOT)

    def unit_for(pname: str) -> str:
        return unit_of_module[id(module.get_submodule(pname.rpartition(".")[0]))]

    out = {name: unit_for(name) for name in named}
    for alias, first in functional.tied.items():
        if first in out and unit_for(alias) != out[first]:
            out[first] = ROOT
    return out


# ---------------------------------------------------------------- calls from outside compiled regions

_ABSENT = object()


def compiled(module: nn.Module) -> bool:
    """Whether calling ``module`` runs the region ``module.compile()`` compiled (its ``_call_impl``: the
    module's hooks and forward, its submodules' calls)."""
    call = module.__dict__.get("_compiled_call_impl")
    while isinstance(call, Intercept):
        call = call.previous
    return call is not None and call is not _ABSENT


def compiles_children(module: nn.Module) -> bool:
    """Whether ``module`` is ``torch.compile(m)``'s wrapper, whose own call is not compiled but runs ``m``
    compiled (so its children run inside a compiled region)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # none can exist before dynamo is imported
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


class Intercept:
    """``around(call, args, kwargs)`` runs in place of ``module``'s call until :meth:`remove`.

    It takes the place of the module's compiled call (``module.compile()``'s, or the one an earlier
    Intercept installed; the module's own ``_call_impl`` when there is none), which ``nn.Module.__call__``
    runs before anything else: so ``around`` runs in eager code, outside the compiled region, and ``call``
    is the module's call as it was (its hooks and forward, compiled if they were). Nothing is left on the
    module after :meth:`remove`. Dynamo, tracing a compiled region that calls the module, does not see it:
    an Intercept acts on calls made from eager code.
    """

    def __init__(self, module: nn.Module, around: Any):
        self.module, self.around = module, around
        self.previous = module.__dict__.get("_compiled_call_impl", _ABSENT)
        self.call = self.previous if self.previous not in (None, _ABSENT) else module._call_impl
        module.__dict__["_compiled_call_impl"] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.around(self.call, args, kwargs)

    def remove(self) -> None:
        """Put the module's call back as it was (an Intercept installed after this one goes with it)."""
        if self.previous is _ABSENT:
            self.module.__dict__.pop("_compiled_call_impl", None)
        else:
            self.module.__dict__["_compiled_call_impl"] = self.previous


# ---------------------------------------------------------------- materialising shards


class Materialiser:
    """Fills this rank's shards, materialising one module's parameters at a time.

    A parameter on the meta device is initialised by, in this order of
    preference: ``init_fn(name, meta)`` when given; the model's own
    initialisation when the module sits in a Hugging Face model
    (``_init_weights(module)`` of the nearest enclosing ``PreTrainedModel``,
    as its ``initialize_weights()`` applies it); its module's
    ``reset_parameters()``. Modules are visited in the order that
    initialisation runs on the full model: registration order for
    ``reset_parameters`` (the order construction draws its random numbers),
    children before parents for a Hugging Face model (``initialize_weights``'
    order). So the shards equal those of the full model initialised that way
    with the same seed. Under a Hugging Face model, buffers left on the meta
    device (rotary frequencies) are initialised by ``_init_weights`` too and
    kept on the module, which a step needs whole.
    """

    def __init__(self, module: nn.Module, named: dict, init_fn: Any):
        self.module, self.named, self.init_fn = module, named, init_fn
        self.ready: dict[str, torch.Tensor] = {}
        self.hf = _hf_models(module)

    def fill(self, buckets: list[Bucket], rank: int, done: Any = None) -> list[torch.Tensor | None]:
        """This rank's shard of each bucket. ``done(i, shard)``: each shard is handed over as soon as its
        last parameter is in (and None returned in its place), allocated only when its first one is, so a
        model built on the meta device is never held whole: a bucket or two at a time. Inside
        :func:`zerofn.alloc.unfilled` a shard nothing was written to is handed over as None."""
        shards: list[torch.Tensor | None] = [None] * len(buckets)
        where: dict[str, tuple] = {}
        left = [len(b.slots) for b in buckets]

        def shard(i: int) -> torch.Tensor:
            if shards[i] is None:
                b = buckets[i]
                lo, hi = b.shard_range(bucket_rank(b, rank))
                shards[i] = alloc.zeros(hi - lo, dtype=b.dtype, device=device_of(self.named[b.slots[0].name]))
            return shards[i]

        for i, b in enumerate(buckets):
            lo, hi = b.shard_range(bucket_rank(b, rank))
            for s in b.slots:
                where[s.name] = (i, s, lo, hi)
            if done is None:
                shard(i)

        def copy(name: str) -> None:
            i, s, lo, hi = where.pop(name)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            full = self._full(name)
            if a < b:
                shard(i)[a - lo : b - lo].copy_(full.reshape(-1)[a - s.offset : b - s.offset])
            self.ready.pop(name, None)  # at most one module's parameters alive
            left[i] -= 1
            if done is not None and left[i] == 0:
                done(i, shard(i))
                shards[i] = None

        # Inside alloc.unfilled (a state built to be loaded into) the shards are allocated only and no
        # parameter is initialised, but for those of a Hugging Face module whose model's init also sets
        # buffers the module keeps (as below, rotary frequencies): it runs for them as always.
        filling = alloc.filling()
        for path, m in self._modules():
            if filling or (id(m) in self.hf and _has_meta_buffers(m)):
                for pname in [n for n, _ in m.named_parameters(recurse=False)]:  # init may swap them for a while
                    if _join(path, pname) in where:
                        copy(_join(path, pname))
                self.ready.clear()
            if id(m) in self.hf and next(m.parameters(recurse=False), None) is None:
                self._init_buffers(m)
        for name in list(where) if filling else ():  # any the module walk did not reach
            copy(name)
        if done is not None:
            for i, n in enumerate(left):  # not filled (a state to be loaded into): None, or what is in
                if n:
                    done(i, shards[i])
                    shards[i] = None
        return shards

    def _modules(self) -> Iterator[tuple[str, nn.Module]]:
        """(path, module) once each, in the order the model's initialisation visits them."""
        if not self.hf:
            yield from self.module.named_modules()
            return
        seen: set[int] = set()

        def post(m: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
            seen.add(id(m))
            for name, child in m.named_children():
                if id(child) not in seen:
                    yield from post(child, _join(path, name))
            yield path, m

        yield from post(self.module, ROOT)

    def _full(self, name: str) -> torch.Tensor:
        p = self.named[name]
        if p.device.type != "meta":
            return p.detach()
        owner_name = name.rpartition(".")[0]
        owner = self.module.get_submodule(owner_name)
        derive = getattr(owner, "zf_materialise", None)
        if derive is not None:
            # A layer whose parameters are computed from one it does not hold (quantize's parts from its
            # weight): it puts that one back for the while, and computes its own from the initial values.
            if name not in self.ready:
                self.ready.update(derive(owner_name, lambda: self._own_values(owner_name, owner)))
            return self.ready[name]
        t = self._from_init_fn(name, p)
        if t is not None:
            return t
        if name not in self.ready:
            self.ready.update(self._init_module(owner_name, owner, name))
        return self.ready[name]

    def _from_init_fn(self, name: str, meta: torch.Tensor) -> torch.Tensor | None:
        """``init_fn(name, meta)`` in ``meta``'s dtype; None without one, or where it returns None (the
        parameter is left to the module's own initialisation)."""
        if self.init_fn is None:
            return None
        t = self.init_fn(name, meta)
        if t is None:
            return None
        if not isinstance(t, torch.Tensor) or t.shape != meta.shape:
            raise ValueError(
                f"shard_params init_fn({name!r}, ...) returned {T.describe_leaf(t)}, expected a tensor of "
                f"shape {list(meta.shape)} (or None, to leave it to the module's own initialisation)"
            )
        return t.detach().to(meta.dtype)

    def _own_values(self, path: str, owner: nn.Module) -> dict[str, torch.Tensor]:
        """The initial values of ``owner``'s own meta parameters, by name: ``init_fn``'s where it gives one,
        the module's initialisation for the others."""
        meta = {_join(path, n): q for n, q in owner._parameters.items() if q is not None and q.device.type == "meta"}
        out = {n: t for n, q in meta.items() if (t := self._from_init_fn(n, q)) is not None}
        if len(out) < len(meta):
            out = {**self._init_module(path, owner, next(n for n in meta if n not in out), every=True), **out}
        return out

    def _init_module(self, path: str, owner: nn.Module, name: str, every: bool = False) -> dict[str, torch.Tensor]:
        """Materialise ``owner``'s own meta parameters, initialise them, return their values (those among
        the params; ``every``: all); the module gets its meta parameters back (the same objects, so ties
        hold)."""
        hf = self.hf.get(id(owner))
        params, buffers = _materialise(owner)
        keep: list[str] = []
        try:
            with torch.no_grad():
                if hf is not None:
                    hf._init_weights(owner)
                    if hasattr(owner, "reset_parameters") and any(_unset(owner._parameters[n]) for n in params):
                        owner.reset_parameters()  # the model's init skips this module type
                    keep = [b for b in buffers if not _unset(owner._buffers[b])]
                elif hasattr(owner, "reset_parameters"):
                    owner.reset_parameters()
                else:
                    raise ValueError(_no_init(name, path, owner, "has no reset_parameters()"))
            unset = [n for n in params if _unset(owner._parameters[n])]
            if unset:
                did = f"{type(hf).__name__}._init_weights" if hf is not None else "reset_parameters()"
                did += " and reset_parameters()" if hf is not None and hasattr(owner, "reset_parameters") else ""
                raise ValueError(_no_init(_join(path, unset[0]), path, owner, f"left it unset after {did}"))
            return {
                _join(path, n): owner._parameters[n].detach() for n in params if every or _join(path, n) in self.named
            }
        finally:
            _restore(owner, params, {b: v for b, v in buffers.items() if b not in keep})

    def _init_buffers(self, m: nn.Module) -> None:
        """A Hugging Face module that holds meta buffers and no parameters (rotary frequencies):
        its model's init fills them, and they stay (a buffer it leaves unset goes back to meta)."""
        _, buffers = _materialise(m)
        if not buffers:
            return
        with torch.no_grad():
            self.hf[id(m)]._init_weights(m)
        _restore(m, {}, {b: v for b, v in buffers.items() if _unset(m._buffers[b])})


def _hf_models(module: nn.Module) -> dict[int, nn.Module]:
    """id(submodule) -> the nearest Hugging Face ``PreTrainedModel`` enclosing it (itself included)."""
    base = getattr(sys.modules.get("transformers.modeling_utils"), "PreTrainedModel", None)
    out: dict[int, nn.Module] = {}
    if base is None:  # transformers not imported: no Hugging Face model here
        return out

    def walk(m: nn.Module, model: nn.Module | None) -> None:
        model = m if isinstance(m, base) else model
        if id(m) in out:
            return
        if model is not None:
            out[id(m)] = model
        for child in m.children():
            walk(child, model)

    walk(module, None)
    return out


def _materialise(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Put empty tensors on the materialise device in place of ``module``'s own meta parameters and
    buffers, NaN where floating (so what an init leaves unset shows); returns the meta originals."""
    device = materialise_device()
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for n, p in module._parameters.items():
        if p is not None and p.device.type == "meta":
            params[n] = p
            module._parameters[n] = nn.Parameter(_nan_like(p, device), requires_grad=p.requires_grad)
    for n, b in module._buffers.items():
        if b is not None and b.device.type == "meta":
            buffers[n] = b
            module._buffers[n] = _nan_like(b, device)
    return params, buffers


def _has_meta_buffers(module: nn.Module) -> bool:
    return any(b is not None and b.device.type == "meta" for b in module._buffers.values())


def _nan_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    return out.fill_(math.nan) if out.is_floating_point() or out.is_complex() else out


def _unset(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and bool(t.isnan().any())


def _restore(module: nn.Module, params: dict, buffers: dict) -> None:
    for n, p in params.items():
        module._parameters[n] = p
    for n, b in buffers.items():
        module._buffers[n] = b


def _no_init(name: str, path: str, owner: nn.Module, what: str) -> str:
    kind = type(owner).__name__
    return (
        f"shard_params.init: parameter {name!r} is on the meta device and its module {kind} "
        f"({path or 'the root'}) {what}, so nothing initialises it. Give {kind} a reset_parameters() (or, in a "
        "Hugging Face model, handle it in the model's _init_weights), or pass shard_params(step, init_fn=...), "
        "a function (name, meta_tensor) -> tensor called for every parameter on the meta device; one that "
        "tells weights from norm scales and biases: init_fn=lambda name, meta: torch.randn(meta.shape) * 0.02 "
        "if meta.dim() > 1 else torch.zeros(meta.shape) if name.endswith('bias') else torch.ones(meta.shape)"
    )


def device_of(p: torch.Tensor) -> torch.device:
    return materialise_device() if p.device.type == "meta" else p.device


def materialise_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
