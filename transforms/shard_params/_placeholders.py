"""Placeholders: the tensors that stand for parameters living sharded, so that a read of one outside its
unit (in ``loss_fn``, or by another unit's code) gathers it. :class:`Placeholder` is one such tensor;
:class:`StandIns` holds a step's placeholders and puts them, or the unit's leaves while the unit's own
modules run, in the model's places."""

from __future__ import annotations

from typing import Any

import torch
from zerofn.transforms.shard_params._unit import LiveUnit

from zerofn import tree as T
from zerofn.functional import Functional

_METADATA = {  # what a placeholder answers itself, with no gather
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.layout.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.element_size,
    torch.Tensor.is_floating_point,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}


# Differentiating with respect to a placeholder (torch.autograd.grad(loss, params["w"]) in loss_fn, a penalty on a
# parameter's gradient) differentiates with respect to the parameter's leaf: every use of the parameter, in its
# unit or through a gathered copy read outside it, leads back to that leaf in the graph.
_DIFFERENTIATE = {torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward}


class Placeholder(torch.Tensor):
    """A parameter that lives sharded (a meta tensor of its shape and dtype): computing with it gathers
    the parameter (the runner's ``outside``) and computes with that copy. ``loss_fn`` receives these, and
    the model's modules show them but while their own unit runs.

    ``ins``, the :class:`StandIns` it is one of, answers ``leaves`` (each parameter's leaf) and ``live(name)``,
    the running step's runner: ``outside(name)`` (a gathered copy of it) and ``refuse_write(name, op)`` (raises).
    """

    @staticmethod
    def __new__(cls, like: torch.Tensor, ins: StandIns, name: str, meta: torch.Tensor):
        # meta: a meta tensor of like's shape and dtype (kept across steps, see StandIns), which this aliases
        out = torch.Tensor._make_subclass(cls, meta, False)
        out._ins, out._name, out._where = ins, name, like.device
        return out

    # Where the parameter lives when gathered, so that code placing new tensors by a parameter's device
    # (a model's own ``self.device``) places them right.
    device = property(lambda self: self._where)
    is_meta = property(lambda self: False)
    is_cuda = property(lambda self: self._where.type == "cuda")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _DIFFERENTIATE:  # a gradient with respect to a parameter: its leaf, which the graph holds
            args, kwargs = torch.utils._pytree.tree_map(
                lambda a: a._ins.leaves[a._name] if isinstance(a, Placeholder) else a, (args, kwargs)
            )
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if (name.endswith("_") and not name.endswith("__")) or "out" in kwargs or name in ("__setitem__", "set_"):
            held = next(a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, Placeholder))
            held._ins.live(held._name).refuse_write(held._name, name)
        args, kwargs = torch.utils._pytree.tree_map(
            lambda a: a._ins.live(a._name).outside(a._name) if isinstance(a, Placeholder) else a, (args, kwargs)
        )
        return func(*args, **kwargs)


class StandIns:
    """The placeholders, one per parameter, and each unit's places in the model (module, attribute), which
    hold the unit's leaves while it is gathered and placeholders otherwise, so that a read from outside the
    unit gathers it. Made once per model and set of leaves (kept with them across steps, as the leaves are),
    and bound to each step's runner in turn (:meth:`bind`)."""

    def __init__(self, functional: Functional, leaves: dict, unit_of: dict[str, int], units: int):
        """``unit_of``: parameter name -> the index of its unit, of ``units``."""
        self.functional = functional  # the model it stands in for
        self.leaves = leaves
        self.runner: Any = None  # the running step's (see bind)
        self.places: dict[int, list] = {i: [] for i in range(units)}
        for owner, attr, name in functional._slots.values():
            if name in unit_of:
                self.places[unit_of[name]].append((owner, attr, name))
        self.placeholders = {
            n: Placeholder(t, self, n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in leaves.items()
        }
        # what the model's places get for a call: the placeholders, and the module's own (meta) ones for the
        # parameters this state does not hold (a pipeline's other stages, whose modules do not run here)
        rest = {n: t for n, t in functional.params.items() if n not in self.placeholders}
        self.every = {**rest, **self.placeholders} if rest else self.placeholders
        self.swapped = self.every  # this step's: with what the step lends (see Runner.lend)
        self.params: Any = None  # the params tree loss_fn receives, once built (see tree)

    def bind(self, runner: Any) -> None:
        """Serve ``runner``'s step: a placeholder computed with goes to it, until :meth:`unbind`."""
        self.runner, self.swapped = runner, self.every

    def unbind(self) -> None:
        self.runner, self.swapped = None, self.every

    def live(self, name: str) -> Any:
        """The runner of the step under way, for a computation with placeholder ``name``."""
        if self.runner is None:
            raise RuntimeError(
                f"shard_params: parameter {name!r} (a placeholder loss_fn received) was used after its step ended; "
                "the parameters live sharded across the ranks. Read them with step.full_params(state)."
            )
        return self.runner

    def tree(self, treedef: Any, names: tuple) -> Any:
        """The placeholders as the params tree (built once): what ``loss_fn`` receives, for ``apply`` to
        recognise."""
        if self.params is None:
            self.params = T.tree_unflatten(treedef, [self.placeholders[n] for n in names])
        return self.params

    def show(self, unit: LiveUnit, inside: bool) -> None:
        """Put the unit's leaves (while its own modules run) or placeholders (otherwise) in its places in the
        model."""
        held = self.leaves if inside else self.placeholders
        for owner, attr, name in self.places[unit.index]:
            owner._parameters[attr] = held[name]
