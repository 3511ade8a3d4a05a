"""``zf.functional(module)``: a pure ``apply(params, *args)`` over any nn.Module.

Like ``torch.func.functional_call``, but correct for a module that appears
twice in the model (see ``Functional.call_with``), and aware of a step:

- ``apply.params`` are the module's own parameters, not copies. A step's
  ``init`` takes them over (:meth:`Functional.adopt`): afterwards the
  module holds no parameter storage of its own, so the state is the only
  copy (ZeRO's memory table holds for the whole program, not only for the
  state).
- Inside a step's forward and backward (:data:`BINDING`), the parameters a
  call swaps in stay in place until backward is over, so activation
  checkpointing inside the model (``torch.utils.checkpoint``, reentrant or
  not, Hugging Face's ``gradient_checkpointing_enable()``) recomputes with
  the step's parameters and sends their gradients to the step.
- Parameters may still be arriving when a forward starts (a step's publish
  in flight, :class:`PendingParams`): each module's parameter dict then
  waits for a parameter's bucket when the module's code first reads it.

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
import functools
import sys
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import optree
import torch
import torch.utils._pytree

from zerofn.tree import NAMESPACE

__all__ = ["ACTIVE_RUN", "ADOPTED_HELP", "BINDING", "Functional", "PendingParams", "functional"]

# A step sets this to an ExitStack for the span of its forward and backward:
# parameters swapped in during that span are restored only when it closes.
BINDING: contextvars.ContextVar = contextvars.ContextVar("zerofn_binding", default=None)

ADOPTED_HELP = """\
{what}: the module's parameters are held by a zerofn TrainState (step.init
took them over, so that the state is the only copy; this module now holds
placeholders on the meta device). Inside loss_fn, call apply with the params
the step passes to loss_fn. Elsewhere, run the model through the step, or
read the parameters from the state:

    out = step.apply(state, *args)           # evaluation, generation (gathers shards if sharded)
    params = step.full_params(state)         # a new dict name -> tensor

To build another state, pass the parameters a state holds:
other_step.init(step.full_params(state, requires_grad=True)). To keep the module's own
parameters as well (a second copy beside the state), build the state with
step.init(apply.params, keep_module=True).
"""

# A step that holds parameters sharded (shard_params) sets this while loss_fn
# runs: apply then hands the call to it, which gathers parameters unit by unit.
ACTIVE_RUN: contextvars.ContextVar = contextvars.ContextVar("zerofn_active_run", default=None)

_OWNERS: dict[int, weakref.ref] = {}


class _ReadWaits(dict):
    """A dict that calls ``on_read(key)`` before it hands out a value (``None``: before every value):
    ``[]``, ``get``, ``values``, ``items``, and ``dict(...)`` or ``{**d}`` (which go through ``[]``)."""

    def __init__(self, values: Mapping, on_read: Callable[[str | None], None]):
        super().__init__(values)
        self.on_read = on_read

    def __getitem__(self, key: str):
        self.on_read(key)
        return dict.__getitem__(self, key)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def values(self):
        self.on_read(None)
        return dict.values(self)

    def items(self):
        self.on_read(None)
        return dict.items(self)

    def __iter__(self):  # defined so that dict(d) and {**d} read values through __getitem__
        return dict.__iter__(self)

    def __reduce__(self):  # copies and pickles hold a plain dict
        return (dict, (dict(self.items()),))


class PendingParams(_ReadWaits):
    """A params dict (name -> tensor) some of whose values are still arriving.

    ``on_read(name)`` waits until parameter ``name``'s values are whole
    (``on_read(None)``: every parameter's); reading a value through the dict
    calls it. A :class:`Functional` called with one swaps the tensors in
    without waiting (:meth:`peek`) and lets each module wait when its code
    reads a parameter, so whatever is still arriving overlaps the forward of
    what came first.
    """

    def peek(self, name: str) -> torch.Tensor:
        """The tensor, without waiting for its values."""
        return dict.__getitem__(self, name)


def _flatten_pending(p: PendingParams):
    keys = list(dict.keys(p))
    return [p[k] for k in keys], keys, keys


# Seen through like the dict it stands for (the values read wait); rebuilt as a plain dict.
optree.register_pytree_node(
    PendingParams, _flatten_pending, lambda keys, values: dict(zip(keys, values)), namespace=NAMESPACE
)
torch.utils._pytree.register_pytree_node(
    PendingParams, lambda p: _flatten_pending(p)[:2], lambda values, keys: dict(zip(keys, values))
)


def owner_of(params: Any) -> Functional | None:
    """The Functional whose ``.params`` is ``params`` (the very object), if any."""
    ref = _OWNERS.get(id(params))
    f = ref() if ref is not None else None
    return f if f is not None and f.params is params else None


class Functional:
    """A module's forward as a function of a parameter dict.

    Attributes:
        module: the wrapped nn.Module (its buffers are used as they are).
        params: dict name -> parameter keyed like ``module.named_parameters()``:
            the module's own parameters (``requires_grad=False`` marks a
            frozen one: no gradient, no optimizer state). A tied parameter
            appears once, under its first name. After a step's ``init`` has
            adopted them, the placeholders that stand in their place.
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
        self.params: dict[str, torch.Tensor] = dict(module.named_parameters())
        # Every (module, attribute) that holds a parameter, once, with the name of
        # the parameter it holds: a module used twice, or a weight tied between two
        # modules, is swapped exactly once per place. The same for buffers
        # (BatchNorm's running statistics, ...), which a step binds from its state.
        self._slots, self.tied = _places(module, module.named_parameters(remove_duplicate=False))
        self._buffer_slots, _ = _places(module, module.named_buffers(remove_duplicate=False))
        self._current: Any = None  # the params now swapped in, if any
        self._adopted = False  # the module holds meta placeholders (see adopt)
        self._guards: list = []
        self._watching = False
        self._early: list[str] = []  # parameters read by compiled code: waited for before the call
        _OWNERS[id(self.params)] = weakref.ref(self)

    def __call__(self, params: Mapping[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        """Run the module's forward with ``params`` in place of its parameters."""
        run = ACTIVE_RUN.get()
        if run is not None and run.module is self.module:
            return run(self, params, args, kwargs)
        return self.call_with(params, args, kwargs)

    def call_with(self, params: Mapping[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """The module's forward with ``params`` swapped in, restored afterwards (even on error).

        Inside a step's forward and backward (``BINDING`` set) the swap is
        restored only when the step's backward is over, so a recompute in
        backward (activation checkpointing) sees the same tensors.
        ``torch.func.functional_call`` loses a module's own parameters when the
        module appears twice in the tree (it saves the already swapped tensor
        the second time); swapping each (module, attribute) place once avoids it.
        """
        binding = BINDING.get()
        if binding is not None:
            if self._current is not params:
                binding.callback(self._swap(params))
            return self.module(*args, **kwargs)
        restore = self._swap(params)
        try:
            return self.module(*args, **kwargs)
        finally:
            restore()

    def _swap(self, params: Mapping[str, torch.Tensor]) -> Callable[[], None]:
        """Put ``params`` in the module's parameter places; returns what puts the previous ones back."""
        if self._adopted and params is self.params:
            raise RuntimeError(ADOPTED_HELP.format(what="apply(apply.params, ...)"))
        missing = [name for _, _, name in self._slots.values() if name not in params]
        if missing:
            raise KeyError(
                f"apply(params, ...): params lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}; pass the "
                "dict apply.params (or a tree with the same names)"
            )
        previous = self._current
        unwatch = self._watch() if isinstance(params, PendingParams) else None
        put_back = _put(self._slots, "_parameters", params)
        self._current = params
        if unwatch is not None:
            for name in self._early:  # read by compiled code: whole before the call
                params.on_read(name)

        def restore() -> None:
            put_back()
            if unwatch is not None:
                unwatch()
            self._current = previous

        return restore

    def _watch(self) -> Callable[[], None]:
        """For one call with a :class:`PendingParams`: make each module that holds parameters call
        :meth:`_on_read` before its code reads one; returns what puts the modules' own dicts back."""
        if self._watching:
            return lambda: None
        names: dict[int, dict[str, str]] = {}
        owners: dict[int, torch.nn.Module] = {}
        for owner, attr, name in self._slots.values():
            names.setdefault(id(owner), {})[attr] = name
            owners[id(owner)] = owner
        # A module whose code runs compiled (module.compile(), torch.compile's wrapper) reads its parameters in
        # compiled code, where dynamo would trace the wait (and recompile whenever what is in flight differs):
        # its parameters are waited for here, before the call, and its dict stays as it is.
        compiled = _compiled_code(self.module)
        owners = {key: owner for key, owner in owners.items() if key not in compiled}
        own = {key: owner._parameters for key, owner in owners.items()}
        for key, owner in owners.items():  # writes during the call go to the stand-in, the module's dict stays
            owner._parameters = _ReadWaits(own[key], functools.partial(self._on_read, names[key]))
        self._watching = True
        self._early = [name for key in compiled if key in names for name in names[key].values()]

        def unwatch() -> None:
            for key, owner in owners.items():
                owner._parameters = own[key]
            self._watching = False

        return unwatch

    def _on_read(self, names: dict[str, str], attr: str | None) -> None:
        current = self._current
        if isinstance(current, PendingParams):
            current.on_read(None if attr is None else names.get(attr))

    def owner(self, name: str) -> torch.nn.Module | None:
        """The module that holds parameter ``name`` (None for a name the module does not have)."""
        try:
            return self.module.get_submodule(name.rpartition(".")[0])
        except AttributeError:
            return None

    def state_dict_of(self, params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor]) -> dict:
        """A ``module.state_dict()``-shaped dict of ``params`` (by first name) and ``buffers``.

        Every name the module's own ``state_dict`` has: a tied parameter under
        each of its names, persistent buffers only, in the module's order.
        """
        live = {n: b for n, b in self.module.named_buffers(remove_duplicate=False)}
        return {
            name: params[held] if kind == "param" else buffers.get(held, live.get(name))
            for name, kind, held in self.state_dict_names()
        }

    def state_dict_names(self) -> tuple[tuple[str, str, str], ...]:
        """``(state_dict name, "param" or "buffer", the name the params or buffers dict holds it under)``
        for every entry of the module's ``state_dict``, in its order (tied parameters and shared
        buffers under each of their names; persistent buffers only)."""
        out: list[tuple[str, str, str]] = []
        first_buffer = {(id(o), a): n for o, a, n in self._buffer_slots.values()}
        for prefix, m in self.module.named_modules(remove_duplicate=False):
            dot = f"{prefix}." if prefix else ""
            for attr, p in m._parameters.items():
                if p is not None:
                    out.append((dot + attr, "param", self.tied.get(dot + attr, dot + attr)))
            for attr, b in m._buffers.items():
                if b is not None and attr not in m._non_persistent_buffers_set:
                    out.append((dot + attr, "buffer", first_buffer.get((id(m), attr), dot + attr)))
        return tuple(dict.fromkeys(out))

    def buffers(self) -> dict[str, torch.Tensor]:
        """The module's buffers by name (a buffer shared under several names once), meta ones left out."""
        out: dict[str, torch.Tensor] = {}
        for owner, attr, name in self._buffer_slots.values():
            b = owner._buffers[attr]
            if b is not None and b.device.type != "meta":
                out.setdefault(name, b)
        return out

    def bind_buffers(self, buffers: Mapping[str, torch.Tensor]) -> Callable[[], None]:
        """Put ``buffers`` (a state's) in the module's buffer places; returns what puts the module's back."""
        return _put(self._buffer_slots, "_buffers", buffers)

    def refresh(self) -> None:
        """Read the module's parameter places again, after a transform changed which parameters its modules
        hold (``quantize`` holds a frozen weight as its quantized parts); ``params`` is updated in place."""
        self._slots, self.tied = _places(self.module, self.module.named_parameters(remove_duplicate=False))
        fresh = dict(self.module.named_parameters())
        self.params.clear()
        self.params.update(fresh)

    # ---------------------------------------------------------- ownership

    @property
    def adopted(self) -> bool:
        """True once a state holds the parameters and the module has placeholders (see :meth:`adopt`)."""
        return self._adopted

    def adopt(self, views: Mapping[str, torch.Tensor]) -> None:
        """Let a state own the parameters: the module keeps no storage of its own.

        A parameter named in ``views`` shares that tensor's storage (the
        state's buffer, so the module reads the state's current values);
        every other one becomes a placeholder on the meta device, and calling
        the module or its ``state_dict()`` outside a step raises
        :data:`ADOPTED_HELP`.
        """
        placeholders: dict[str, torch.nn.Parameter] = {}
        for owner, attr, name in self._slots.values():
            p = owner._parameters[attr]
            if name in views:
                if p.data_ptr() != views[name].data_ptr():
                    p.data = views[name]
                continue
            if name not in placeholders:
                placeholders[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
                )
            owner._parameters[attr] = placeholders[name]
        self.params.update(placeholders)
        if placeholders and not self._adopted:
            self._adopted = True
            self._guards = [
                self.module.register_forward_pre_hook(self._guard("calling the module")),
                self.module.register_state_dict_pre_hook(self._guard("module.state_dict()")),
            ]

    def _guard(self, what: str) -> Callable:
        def check(module, *args) -> None:
            if self._current is None and ACTIVE_RUN.get() is None:
                raise RuntimeError(ADOPTED_HELP.format(what=what))

        return check

    def __repr__(self) -> str:
        n = sum(p.numel() for p in self.params.values())
        return f"functional({type(self.module).__name__}, {len(self.params)} params, {n:,} elements)"


def _compiled_code(module: torch.nn.Module) -> set[int]:
    """ids of the modules whose code runs compiled: a module compiled with ``module.compile()`` and every module
    under it, every module under ``torch.compile``'s wrapper. A call put in front of a module's compiled call
    (a step's, which keeps the one it replaced as ``previous``) is looked through."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # nothing is compiled before dynamo is imported
    out: set[int] = set()

    def walk(m: torch.nn.Module, inside: bool) -> None:
        call = m.__dict__.get("_compiled_call_impl")
        while call is not None and hasattr(call, "previous"):
            call = call.previous
        inside = inside or callable(call)
        if inside:
            out.add(id(m))
        for child in m.children():
            walk(child, inside or (dynamo is not None and isinstance(m, dynamo.OptimizedModule)))

    walk(module, False)
    return out


def _places(module: torch.nn.Module, named) -> tuple[dict, dict[str, str]]:
    """Each (module, attribute) place of ``named`` (name, tensor) pairs once, with the first name of the
    tensor it holds; and alias name -> first name for tensors held under several names."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    places: dict[tuple[int, str], tuple[torch.nn.Module, str, str]] = {}
    for name, t in named:
        if id(t) in first and first[id(t)] != name:
            aliases[name] = first[id(t)]
        first.setdefault(id(t), name)
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        places.setdefault((id(owner), attr), (owner, attr, first[id(t)]))
    return places, aliases


def _put(places: dict, store: str, values: Mapping[str, torch.Tensor]) -> Callable[[], None]:
    """Put ``values`` (by name) in ``places`` of each owner's ``store`` dict; returns what puts the old ones back."""
    saved = []
    read = values.peek if isinstance(values, PendingParams) else values.__getitem__  # swapping in is no read
    for owner, attr, name in places.values():
        if name in values:
            held = getattr(owner, store)
            saved.append((owner, attr, dict.__getitem__(held, attr)))
            held[attr] = read(name)

    def restore() -> None:
        for owner, attr, original in saved:
            getattr(owner, store)[attr] = original

    return restore


def functional(module: torch.nn.Module) -> Functional:
    """Return ``apply(params, *args, **kwargs)``, the module's forward as a pure function.

    Args:
        module: any ``torch.nn.Module``.

    Returns:
        A :class:`Functional`: callable as ``apply(params, *args, **kwargs)``
        (each parameter swapped in place of the module's own for the call;
        buffers come from the module), with ``apply.params`` the module's
        own parameters (which ``step.init`` takes over) and ``apply.module``.

    Raises:
        TypeError: ``module`` is not an nn.Module.
    """
    return Functional(module)
