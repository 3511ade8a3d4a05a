"""The core of ``zerofn.optim``: types, composition and applying updates.

:class:`GradientTransformation`, the state NamedTuples of the primitives, the
type aliases, :func:`chain`, :func:`apply_updates` and :func:`update_params`,
plus ``foreach_groups``, the device/dtype bucketing every multi-tensor kernel call
goes through.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from zerofn import tree as T
from zerofn.optim._checks import Schedule, check_same, flat
from zerofn.optim.view import ParamView
from zerofn.tree import Tree, tree_map

Params = Tree
Updates = Tree
OptState = Any
ScalarOrSchedule = float | Schedule


class GradientTransformation(NamedTuple):
    """An optimizer as a pair of functions.

    ``init(params) -> state`` builds the state; ``update(updates, state,
    params=None, **extra) -> (updates, state)`` transforms the updates,
    donating (consuming) ``updates`` and ``state``.
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    # Optional fast path: update_in_place(grads, state, params, **extra) -> state
    # updates params in place, equal to update() followed by apply_updates()
    # (for example one fused kernel for all of AdamW). See update_params().
    update_in_place: Callable[..., OptState] | None = None
    # Optional: start_update(state, params, previous) -> a PendingUpdate, for an update that starts before
    # the gradients are all known (each handed over as it is final); see PendingUpdate. ``previous()``
    # waits for work still writing ``state`` (an update launched by the step before).
    start_update: Callable[..., PendingUpdate] | None = None
    # Optional: bind(view) -> the same transformation for the leaves a ParamView describes (which
    # parameters each leaf holds); a step binds its optimizer once per layout. See zerofn.optim.view.
    bind: Callable[[ParamView], GradientTransformation] | None = None
    # Optional: partition(view) -> name -> a hashable label per parameter: parameters of different labels
    # must be in different leaves (a step keeps them in different buckets). Masks and groups declare it.
    partition: Callable[[ParamView], dict] | None = None
    # True when update() reads across a parameter's elements (LAMB's norms, Muon's whole matrices: sums or
    # gathers over its pieces, collectives where shards cut it): it must see whole buckets (never sub-groups
    # of one) and run on the step's thread, in the step's order of collectives (offload updates in the step).
    communicates: bool = False
    # True when update_in_place (or start_update's commit) takes ``found_inf=``, a 0-dim float tensor on the
    # device (1: skip this update), and leaves the state and parameters exactly as they were where it is 1
    # without reading it on the host (fused Adam's kernel skips on the device). A step whose optimizer
    # masks so decides on the device whether an update applies; for any other, update_params reads it.
    masks: bool = False


class PendingUpdate(abc.ABC):
    """An update started before its gradients were all known: what ``start_update`` returns.

    The step that runs the optimizer calls ``grad(key, g)`` for every
    bucket, each as soon as its gradient is final (averaged and unscaled,
    during backward); ``g`` is the pending update's to keep or copy (the
    step drops it on return). Then it calls exactly one of
    ``commit(**extra)``, which ends the update and returns the new state
    (``extra`` as ``update`` gets it: the global ``grad_norm``), or
    ``cancel()``, which leaves the state and parameters as they were before
    ``start_update`` (a skipped step, an error in backward). Work started
    on a ``grad`` must not change what anyone can read until ``commit``.
    """

    @abc.abstractmethod
    def grad(self, key: str, grad: torch.Tensor) -> None:
        """Bucket ``key``'s final gradient."""

    @abc.abstractmethod
    def commit(self, **extra: Any) -> OptState:
        """End the update: the new state."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Leave the state and parameters as they were before ``start_update``."""


class PendingNorm:
    """A global gradient norm that is not known yet: the ``grad_norm`` an update gets when it runs
    ahead of the end of backward (a speculative update; see :class:`PendingUpdate`).

    A transform that reads ``grad_norm`` and acts only when it is large
    (clipping) calls :meth:`assume_below` with a function telling, from the
    true norm, whether its result is as if it had not acted, and then does
    not act; the speculation is kept only if every such function says so
    once the norm is known (:meth:`holds`). Any other use (as a number)
    raises :class:`TypeError`, and the update that tried is run again once
    the norm is known.
    """

    def __init__(self) -> None:
        self.checks: list[Callable[[float], bool]] = []

    def assume_below(self, unchanged: Callable[[float], bool]) -> None:
        self.checks.append(unchanged)

    def holds(self, norm: float) -> bool:
        """Whether every assumption made holds for the true ``norm``."""
        return all(check(norm) for check in self.checks)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "grad_norm is not known yet (an update started during backward); a transform that reads it "
            "must handle zerofn.optim.PendingNorm (see clip_by_global_norm), or the update waits for the norm"
        )

    __float__ = __int__ = __index__ = __bool__ = __array__ = _refuse
    __add__ = __radd__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __sub__ = __rsub__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse


class EmptyState(NamedTuple):
    """The state of a stateless transform: no leaves."""


ScaleState = EmptyState
AddDecayedWeightsState = EmptyState
ClipByGlobalNormState = EmptyState


class ScaleByScheduleState(NamedTuple):
    """``count``: int64 0-dim CPU tensor, the number of updates so far."""

    count: torch.Tensor


class ScaleByAdamState(NamedTuple):
    """``count``: int64 0-dim CPU step count; ``mu``, ``nu``: first and second moments."""

    count: torch.Tensor
    mu: Tree
    nu: Tree


class TraceState(NamedTuple):
    """``trace``: the momentum buffer, one tensor per parameter."""

    trace: Tree


def foreach_groups(*columns: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
    """Split parallel lists of tensors into groups sharing device and dtype in every list.

    foreach kernels only take their fast path when a list is homogeneous.
    """
    n = len(columns[0])
    if n == 0:
        return []
    keys = [tuple((c[i].device, c[i].dtype) for c in columns) for i in range(n)]
    first = keys[0]
    if all(k == first for k in keys):
        return [tuple(columns)]
    buckets: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        buckets.setdefault(k, []).append(i)
    return [tuple([c[i] for i in idx] for c in columns) for idx in buckets.values()]


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Compose transforms left to right; the state is a tuple of their states.

    Args:
        *transforms: ``GradientTransformation`` s applied in order.

    Returns:
        A ``GradientTransformation`` whose ``update`` passes ``params`` and every
        extra keyword to each member.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.scale(-0.1))
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> u, state = opt.update({"w": torch.tensor([3.0, 4.0])}, state)
        >>> [round(x, 4) for x in u["w"].tolist()]
        [-0.06, -0.08]
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"chain: argument {i} is {type(t).__name__}, not a GradientTransformation. "
                f"Pass transforms such as optim.scale_by_adam(), not functions or classes "
                f"(did you forget to call it?)."
            )
    transforms = tuple(transforms)

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None, **extra):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            got = f"a {type(state).__name__}" + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            raise ValueError(
                f"chain.update: expected a tuple of {len(transforms)} states (one per "
                f"transform), got {got}. Build the state with this chain's init(params)."
            )
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    binder = bind_all(transforms, chain)
    part = partition_all(transforms)
    talks = any(t.communicates for t in transforms)
    last = transforms[-1] if transforms else None
    # it masks when every member does (those that keep no state run either way)
    masks = bool(transforms) and all(t.masks for t in transforms)
    if last is None or last.update_in_place is None:
        return GradientTransformation(init, update, bind=binder, partition=part, communicates=talks, masks=masks)

    def update_in_place(grads, state, params, **extra):
        # The members before the last transform the gradients; the last one
        # (e.g. a fused AdamW) turns them into parameter updates in place.
        head = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params, **extra)
            head.append(s)
        return tuple(head) + (last.update_in_place(grads, state[-1], params, **extra),)

    return GradientTransformation(
        init, update, update_in_place, bind=binder, partition=part, communicates=talks, masks=masks
    )


def bind(optimizer: GradientTransformation, view: ParamView) -> GradientTransformation:
    """``optimizer`` for the leaves ``view`` describes: its ``bind(view)``, or itself when it has none
    (it treats every element alike)."""
    return optimizer.bind(view) if optimizer.bind is not None else optimizer


def labels(optimizer: GradientTransformation, view: ParamView) -> dict | None:
    """name -> the label of each parameter under ``optimizer``'s masks and groups (None: it has none)."""
    return optimizer.partition(view) if optimizer.partition is not None else None


def bind_all(members: tuple, rebuild: Callable) -> Callable | None:
    """A ``bind`` for a transformation made of ``members``: ``rebuild`` of each member bound (None when no
    member binds)."""
    if not any(m.bind is not None for m in members):
        return None
    return lambda view: rebuild(*(bind(m, view) for m in members))


def partition_all(members: tuple) -> Callable | None:
    """A ``partition`` for a transformation made of ``members``: each parameter's labels under every member
    that has one, as a tuple (None when none has)."""
    parts = [m for m in members if m.partition is not None]
    if not parts:
        return None

    def partition(view: ParamView) -> dict:
        each = [m.partition(view) for m in parts]
        return {n: tuple(e[n] for e in each) for n in view.names}

    return partition


@torch.no_grad()
def apply_updates(params: Params, updates: Updates) -> Params:
    """Add ``updates`` to ``params`` in place and return ``params``.

    Args:
        params: a pytree of tensors, modified in place.
        updates: a pytree of tensors with the same structure and shapes.

    Returns:
        ``params`` (the same tree and tensors).

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> p = {"w": torch.ones(2)}
        >>> optim.apply_updates(p, {"w": torch.full((2,), -0.5)})["w"].tolist()
        [0.5, 0.5]
    """
    where = "apply_updates"
    p, p_spec = flat(where, "params", params)
    u, u_spec = flat(where, "updates", updates)
    check_same(
        where,
        "updates",
        u_spec,
        "params",
        p_spec,
        p,
        u,
        fix="Pass the updates returned by update() for these params.",
    )
    for p_, u_ in foreach_groups(p, u):
        torch._foreach_add_(p_, u_)
    return params


def update_params(optimizer: GradientTransformation, grads: Updates, state: OptState, params: Params, **extra):
    """Update ``params`` in place from ``grads``; return the new optimizer state.

    Equal to ``updates, state = optimizer.update(grads, state, params);
    apply_updates(params, updates)``, but takes the optimizer's fused path
    where it has one (``adam``/``adamw`` use torch's fused kernel: one pass
    over memory instead of a dozen). Donates ``grads`` and ``state``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> p = {"w": torch.ones(2)}
        >>> opt = optim.adamw(0.1, weight_decay=0.0)
        >>> state = optim.update_params(opt, {"w": torch.ones(2)}, opt.init(p), p)
        >>> [round(x, 4) for x in p["w"].tolist()], int(state[0].count)
        ([0.9, 0.9], 1)
    """
    found = extra.pop("found_inf", None) if not optimizer.masks else None
    if found is not None and skip_on_host(extra, found):  # an optimizer that cannot skip on the device
        return state
    if optimizer.update_in_place is not None:
        return optimizer.update_in_place(grads, state, params, **extra)
    updates, state = optimizer.update(grads, state, params, **extra)
    found = extra.get("found_inf")
    if found is not None:  # its members kept their state where found_inf is set; the updates are dropped there
        skip = found != 0
        for u in T.tree_leaves(updates):
            u.masked_fill_(skip.to(u.device), 0.0)
    apply_updates(params, updates)
    return state


def skip_on_host(extra: dict, found: torch.Tensor) -> bool:
    """For an update that cannot take the device's decision as it is: read it (``found``, the step's
    ``found_inf``) on the host, and what the step said of the parameters on the device too (``extra``'s
    ``info`` becomes its :meth:`~zerofn.optim.StepInfo.on_host`). True: skip this update."""
    if bool(found):
        return True
    info = extra.get("info")
    if info is not None and getattr(info, "on_device", False):
        extra["info"] = info.on_host()
    return False


def in_place(init: Callable, update_in_place: Callable, where: str) -> GradientTransformation:
    """A GradientTransformation defined by its in-place update alone.

    Its ``update`` runs ``update_in_place`` on a copy of the params and
    returns the change it made as updates, so the pure interface works for
    wrappers whose work is naturally in place (master weights, offloaded
    state). ``where`` names the wrapper in errors.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> def halve(grads, state, params, **extra):
        ...     params["w"].mul_(0.5)
        ...     return state
        >>> opt = optim.in_place(lambda p: (), halve, "halve")
        >>> opt.update({"w": torch.zeros(2)}, (), {"w": torch.ones(2)})[0]["w"].tolist()
        [-0.5, -0.5]
    """

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError(f"{where}.update needs the params: update(updates, state, params)")
        work = tree_map(torch.clone, params)
        new_state = update_in_place(updates, state, work, **extra)
        return tree_map(lambda n, p: n - p, work, params), new_state

    return GradientTransformation(init, update, update_in_place)
