"""How ``shard_params`` cuts a model into units and materialises their shards.

A *unit* is a set of modules whose parameters are gathered and released
together; :func:`unit_names` chooses them (the ``units=`` policy) and
:func:`assign_units` places every parameter in one. :class:`Materialiser`
fills this rank's shards one module at a time, also from a model built on
the meta device.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from zerofn import tree as T
from zerofn.functional import Functional
from zerofn.state import Bucket, Layout

__all__ = ["ROOT", "Materialiser", "Unit", "assign_units", "inside", "unit_buckets", "unit_names"]

ROOT = ""


@dataclass(frozen=True)
class Unit:
    """A module whose parameters are gathered and released together (static)."""

    name: str  # module path; "" is the root (parameters in no other unit)
    buckets: tuple[int, ...]  # its trainable buckets (indices into layout.buckets)
    frozen: tuple[int, ...]  # its frozen buckets (indices into layout.frozen_buckets)


def unit_buckets(params: dict, world: int) -> tuple[Bucket, ...]:
    """One bucket per dtype for a unit's parameters, placed where they will be materialised."""
    if not params:
        return ()
    buckets = Layout.build(params, shards=world, bucket_bytes=1 << 62).buckets
    return tuple(
        dataclasses.replace(b, device=str(materialise_device())) if b.device == "meta" else b for b in buckets
    )


def unit_names(module: nn.Module, units: Any) -> list[str]:
    """Module paths of the units, in registration order, none inside another."""
    if units is None:
        chosen = []
        for name, m in module.named_modules():
            if isinstance(m, nn.ModuleList) and not any(inside(name, c) for c in chosen):
                chosen.extend(f"{name}.{k}" if name else k for k, _ in m.named_children())
        return chosen
    if callable(units):
        names = [n for n, m in module.named_modules() if n and units(n, m)]
    else:
        names = list(units)
        known = dict(module.named_modules())
        for n in names:
            if n not in known:
                raise ValueError(f"shard_params: units names {n!r}, which is not a submodule of the model")
    out: list[str] = []
    for n in names:
        if any(inside(n, c) or inside(c, n) for c in out):
            raise ValueError(
                f"shard_params: units {n!r} and {[c for c in out if inside(n, c) or inside(c, n)][0]!r} "
                "nest; a unit must not contain another. Name the outer or the inner modules, not both."
            )
        out.append(n)
    return out


def inside(name: str, outer: str) -> bool:
    return name == outer or name.startswith(outer + ".")


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


class Materialiser:
    """Fills this rank's shards, materialising one module's parameters at a time.

    Parameters are visited in registration order, so a model built on the meta
    device draws its random numbers in the order its construction would
    have, and the shards equal those of the full model built with the same
    seed.
    """

    def __init__(self, module: nn.Module, named: dict, init_fn: Any):
        self.module, self.named, self.init_fn = module, named, init_fn
        self.ready: dict[str, torch.Tensor] = {}

    def fill(self, buckets: list[Bucket], rank: int) -> list[torch.Tensor]:
        shards = []
        where: dict[str, tuple] = {}
        for i, b in enumerate(buckets):
            lo, hi = b.shard_range(rank)
            device = device_of(self.named[b.slots[0].name])
            shards.append(torch.zeros(hi - lo, dtype=b.dtype, device=device))
            for s in b.slots:
                where[s.name] = (i, s, lo, hi)
        order = [n for n, _ in self.module.named_parameters()]  # registration order (not sorted keys)
        for name in order + [n for n in where if n not in set(order)]:
            if name not in where:
                continue
            i, s, lo, hi = where[name]
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            full = self._full(name)
            if a < b:
                shards[i][a - lo : b - lo].copy_(full.reshape(-1)[a - s.offset : b - s.offset])
            self.ready.pop(name, None)  # at most one module's parameters alive
            del full
        return shards

    def _full(self, name: str) -> torch.Tensor:
        p = self.named[name]
        if p.device.type != "meta":
            return p.detach()
        if name in self.ready:
            return self.ready[name]
        if self.init_fn is not None:
            t = self.init_fn(name, p)
            if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                raise ValueError(
                    f"shard_params init_fn({name!r}, ...) returned {T.describe_leaf(t)}, expected a tensor of "
                    f"shape {list(p.shape)}"
                )
            return t.detach().to(p.dtype)
        owner_name, _, _ = name.rpartition(".")
        owner = self.module.get_submodule(owner_name)
        if not hasattr(owner, "reset_parameters"):
            raise ValueError(
                f"shard_params.init: parameter {name!r} is on the meta device and its module "
                f"{type(owner).__name__} ({owner_name or 'the root'}) has no reset_parameters(). Pass "
                "shard_params(step, init_fn=lambda name, meta: torch.randn(meta.shape) * 0.02), or give the "
                "module a reset_parameters()."
            )
        # Materialise this module's own parameters only, initialise them, keep their values, drop them.
        owner.to_empty(device=materialise_device(), recurse=False)
        owner.reset_parameters()
        with torch.no_grad():
            for pname, param in owner.named_parameters(recurse=False):
                full_name = f"{owner_name}.{pname}" if owner_name else pname
                if full_name in self.named:
                    self.ready[full_name] = param.detach().clone()
        owner.to_empty(device="meta", recurse=False)
        return self.ready[name]


def device_of(p: torch.Tensor) -> torch.device:
    return materialise_device() if p.device.type == "meta" else p.device


def materialise_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
