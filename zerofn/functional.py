"""``zf.functional(module)``: a pure ``apply(params, *args)`` over any nn.Module.

Like ``torch.func.functional_call``, but correct for a module that appears
twice in the model (see ``Functional.call_with``).

Example:
    >>> import torch, zerofn as zf
    >>> model = torch.nn.Linear(3, 2)
    >>> apply = zf.functional(model)
    >>> sorted(apply.params)
    ['bias', 'weight']
    >>> apply(apply.params, torch.ones(1, 3)).shape
    torch.Size([1, 2])
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Any, Mapping

import torch

__all__ = ["Functional", "functional"]

# A step that holds parameters sharded (shard_params) sets this while loss_fn
# runs: apply then hands the call to it, which gathers parameters unit by unit.
ACTIVE_RUN: contextvars.ContextVar = contextvars.ContextVar("zerofn_active_run", default=None)

_OWNERS: dict[int, weakref.ref] = {}


def owner_of(params: Any) -> "Functional | None":
    """The Functional whose ``.params`` is ``params`` (the very object), if any."""
    ref = _OWNERS.get(id(params))
    f = ref() if ref is not None else None
    return f if f is not None and f.params is params else None


class Functional:
    """A module's forward as a function of a parameter dict.

    Attributes:
        module: the wrapped nn.Module (its buffers are used as they are).
        params: dict name -> tensor keyed like ``module.named_parameters()``:
            detached copies that keep each parameter's ``requires_grad``
            flag (``False`` marks a frozen parameter: no gradient, no
            optimizer state). A tied parameter appears once, under its
            first name.
        tied: dict alias name -> first name, for parameters shared under
            several names.
    """

    def __init__(self, module: torch.nn.Module):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(
                f"zf.functional expects a torch.nn.Module, got {type(module).__name__}. "
                "Wrap your model: apply = zf.functional(model)."
            )
        self.module = module
        self.params: dict[str, torch.Tensor] = {
            name: p.detach().clone().requires_grad_(p.requires_grad)
            for name, p in module.named_parameters()
        }
        first: dict[int, str] = {}
        self.tied: dict[str, str] = {}
        # Every (module, attribute) that holds a parameter, once, with the name of
        # the parameter it holds: a module used twice, or a weight tied between two
        # modules, is swapped exactly once per place.
        self._slots: dict[tuple[int, str], tuple[torch.nn.Module, str, str]] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            key = id(p)
            if key in first and first[key] != name:
                self.tied[name] = first[key]
            first.setdefault(key, name)
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            self._slots.setdefault((id(owner), attr), (owner, attr, first[key]))
        _OWNERS[id(self.params)] = weakref.ref(self)

    def __call__(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward with ``params`` in place of its parameters."""
        run = ACTIVE_RUN.get()
        if run is not None and run.module is self.module:
            return run(self, params, args, kwargs)
        return self.call_with(params, args, kwargs)

    def call_with(self, params: Mapping[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """The module's forward with ``params`` swapped in (restored afterwards, even on error).

        ``torch.func.functional_call`` loses a module's own parameters when the
        module appears twice in the tree (it saves the already swapped tensor
        the second time); swapping each (module, attribute) place once avoids it.
        """
        missing = [name for _, _, name in self._slots.values() if name not in params]
        if missing:
            raise KeyError(
                f"apply(params, ...): params lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}; pass the "
                "dict apply.params (or a tree with the same names)"
            )
        saved = []
        try:
            for owner, attr, name in self._slots.values():
                saved.append((owner, attr, owner._parameters[attr]))
                owner._parameters[attr] = params[name]
            return self.module(*args, **kwargs)
        finally:
            for owner, attr, original in saved:
                owner._parameters[attr] = original

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.params.values())
        return f"functional({type(self.module).__name__}, {len(self.params)} params, {n:,} elements)"


def functional(module: torch.nn.Module) -> Functional:
    """Return ``apply(params, *args, **kwargs)``, the module's forward as a pure function.

    Args:
        module: any ``torch.nn.Module``.

    Returns:
        A :class:`Functional`: callable as ``apply(params, *args, **kwargs)``
        (each parameter swapped in place of the module's own for the call;
        buffers come from the module), with
        ``apply.params`` the initial parameter dict and ``apply.module``.

    Raises:
        TypeError: ``module`` is not an nn.Module.
    """
    return Functional(module)
