"""Optax-style gradient transformations over pytrees of torch tensors.

A :class:`GradientTransformation` is a pair of functions, ``init(params) ->
state`` and ``update(updates, state, params=None, **extra) -> (updates,
state)``. Stateful pieces keep their own ``<Name>State`` NamedTuple; named
optimizers (:func:`sgd`, :func:`adam`, :func:`adamw`) only :func:`chain`
primitives. All math is multi-tensor (``torch._foreach_*``), one call per
group of leaves that share a device and dtype.

**update donates updates and state; clone them first to keep them.** Like
buffer donation in JAX, ``update`` works in place: the returned updates may be
the very tensors passed in (overwritten), and the returned state's leaves are
the same tensor objects as the input state's, updated in place. No new
optimizer-state-sized tensors are allocated per step beyond what torch.optim's
foreach implementations allocate (Adam's denominator). :func:`apply_updates`
adds updates to params in place.

Step counts are int64 0-dim CPU tensors, even for CUDA params, so reading one
(for bias correction or a schedule) never waits on the device.

Extra keyword arguments to ``update`` are passed by :func:`chain` to every
member; each transform ignores those it does not know.
:func:`clip_by_global_norm` reads ``grad_norm``: the global norm computed by
the caller across ranks, for when ``updates`` is only this rank's shard.

Example:
    >>> import torch
    >>> from zerofn import optim
    >>> params = {"w": torch.ones(3), "b": torch.zeros(())}
    >>> opt = optim.adamw(1e-3, weight_decay=0.0)
    >>> state = opt.init(params)
    >>> grads = {"w": torch.ones(3), "b": torch.ones(())}
    >>> updates, state = opt.update(grads, state, params)  # grads now overwritten
    >>> params = optim.apply_updates(params, updates)
    >>> round(params["w"][0].item(), 6), int(state[0].count)
    (0.999, 1)
"""

from __future__ import annotations

import math
import numbers
import struct
from typing import Any, Callable, NamedTuple, Union

import torch

from zerofn.tree import describe_leaf, keystr, tree_flatten, tree_flatten_with_path, tree_map

__all__ = [
    "AddDecayedWeightsState",
    "ClipByGlobalNormState",
    "EmptyState",
    "GradientTransformation",
    "ScaleByAdamState",
    "ScaleByScheduleState",
    "ScaleState",
    "Schedule",
    "TraceState",
    "adam",
    "adamw",
    "add_decayed_weights",
    "apply_updates",
    "chain",
    "clip_by_global_norm",
    "constant_schedule",
    "cosine_decay_schedule",
    "decay_weights",
    "global_norm",
    "linear_schedule",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_schedule",
    "sgd",
    "trace",
    "update_params",
    "warmup_cosine_decay_schedule",
]

Tree = Any
Params = Tree
Updates = Tree
OptState = Any
Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]


class GradientTransformation(NamedTuple):
    """An optimizer as a pair of functions.

    ``init(params) -> state`` builds the state; ``update(updates, state,
    params=None, **extra) -> (updates, state)`` transforms the updates,
    donating (consuming) ``updates`` and ``state``.
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    # Optional fast path: apply(grads, state, params, **extra) -> state updates
    # params in place, equal to update() followed by apply_updates() (for
    # example one fused kernel for all of AdamW). See update_params().
    apply: Callable[..., OptState] | None = None


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


# --------------------------------------------------------------------------- #
# Validation helpers
# --------------------------------------------------------------------------- #


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_number(
    where: str,
    name: str,
    value: Any,
    *,
    low: float | None = None,
    low_open: bool = False,
    high: float | None = None,
    high_open: bool = False,
    hint: str = "",
) -> float:
    """``value`` as a float, or a TypeError/ValueError naming ``where`` and ``name``."""
    if not _is_real(value):
        raise TypeError(
            f"{where}: {name} must be a real number, got {type(value).__name__} {value!r}. "
            f"Pass a Python float{hint and '; ' + hint}."
        )
    value = float(value)
    bad = math.isnan(value)
    if low is not None:
        bad |= value <= low if low_open else value < low
    if high is not None:
        bad |= value >= high if high_open else value > high
    if bad:
        lo = "(" if low_open else "["
        hi = ")" if high_open else "]"
        lo_s = "-inf" if low is None else f"{low:g}"
        hi_s = "inf" if high is None else f"{high:g}"
        raise ValueError(
            f"{where}: {name} must be in {lo}{lo_s}, {hi_s}{hi}, got {value!r}."
            + (f" {hint}" if hint else "")
        )
    return value


def _schedule_value(where: str, schedule: Schedule, count: int) -> float:
    """Call ``schedule(count)`` and check that it returned a finite real number."""
    value = schedule(count)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if not _is_real(value):
        raise TypeError(
            f"{where}: the schedule {getattr(schedule, '__name__', schedule)!r} returned "
            f"{type(value).__name__} {value!r} at count {count}; expected a Python float. "
            f"A schedule is a function of the int step count (0 for the first update) "
            f"returning a float, e.g. lambda count: 1e-3 * min(1.0, (count + 1) / 100)."
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(
            f"{where}: the schedule {getattr(schedule, '__name__', schedule)!r} returned "
            f"{value} at count {count}; expected a finite float."
        )
    return value


def _flat(where: str, what: str, tree: Tree):
    leaves, spec = tree_flatten(tree)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            paths, _, _ = tree_flatten_with_path(tree)
            path = next(p for p, lf in zip(paths, leaves) if lf is leaf)
            raise TypeError(
                f"{where}: every leaf of {what} must be a torch.Tensor, but {what} at "
                f"{keystr(path)} is {type(leaf).__name__} {leaf!r}. Convert it with "
                f"torch.as_tensor, or keep it out of the tree."
            )
    return leaves, spec


_FIX_STATE = (
    "Build the state with init(params) on the params (or shards) whose gradients you "
    "pass, and pass updates shaped like those params."
)


def _check_same(
    where: str,
    what: str,
    spec,
    other: str,
    other_spec,
    other_leaves,
    leaves,
    *,
    fix: str = _FIX_STATE,
    dtypes: bool = False,
):
    """Raise unless ``leaves`` (of ``what``) match ``other_leaves`` in structure and shapes."""
    if spec != other_spec:
        raise ValueError(
            f"{where}: {what} has tree structure\n  {spec}\nbut {other} has\n  {other_spec}\n"
            f"They must match leaf for leaf. {fix}"
        )
    for i, (a, b) in enumerate(zip(leaves, other_leaves)):
        if a.shape != b.shape or (dtypes and a.dtype != b.dtype):
            paths = other_spec.paths()
            kind = "shapes" if a.shape != b.shape else "dtypes"
            raise ValueError(
                f"{where}: {what} at {keystr(paths[i])} is {describe_leaf(a)} but {other} "
                f"there is {describe_leaf(b)}; {kind} must match. {fix}"
                + (
                    " To keep the state in a wider dtype, cast the gradients first: "
                    "tree_map(lambda g, m: g.to(m.dtype), grads, state.mu)."
                    if kind == "dtypes"
                    else ""
                )
            )


_FIX_PARAMS = "Pass the params (or this rank's shards of them) that the updates are for."


def _groups(*columns: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
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


def _new_count() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64, device="cpu")


def _check_count(where: str, count: Any) -> int:
    if not (isinstance(count, torch.Tensor) and count.dim() == 0 and count.dtype == torch.int64):
        raise TypeError(
            f"{where}: state.count must be an int64 0-dim CPU tensor, got "
            f"{describe_leaf(count) if isinstance(count, torch.Tensor) else repr(count)}. "
            f"Build the state with this transform's init(params)."
        )
    return int(count.item())


def _check_state(where: str, state: Any, cls: type) -> None:
    if not isinstance(state, cls):
        raise TypeError(
            f"{where}: expected a {cls.__name__} as state, got {type(state).__name__}. "
            f"Pass the state made by this transform's init(params) (or the state "
            f"returned by its previous update)."
        )


# --------------------------------------------------------------------------- #
# Combinators and primitives
# --------------------------------------------------------------------------- #


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
            got = f"a {type(state).__name__}" + (
                f" of length {len(state)}" if isinstance(state, tuple) else ""
            )
            raise ValueError(
                f"chain.update: expected a tuple of {len(transforms)} states (one per "
                f"transform), got {got}. Build the state with this chain's init(params)."
            )
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params, **extra)
            new_state.append(s)
        return updates, tuple(new_state)

    last = transforms[-1] if transforms else None
    if last is None or last.apply is None:
        return GradientTransformation(init, update)

    def apply(grads, state, params, **extra):
        # The members before the last transform the gradients; the last one
        # (e.g. a fused AdamW) turns them into parameter updates in place.
        head = []
        for t, s in zip(transforms[:-1], state[:-1]):
            grads, s = t.update(grads, s, params, **extra)
            head.append(s)
        return tuple(head) + (last.apply(grads, state[-1], params, **extra),)

    return GradientTransformation(init, update, apply)


def scale(step_size: float) -> GradientTransformation:
    """Multiply updates by a constant, in place.

    Args:
        step_size: the factor (any real number; negative for descent).

    Returns:
        A ``GradientTransformation`` with ``EmptyState``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.scale(-2.0)
        >>> u, _ = opt.update({"w": torch.ones(2)}, opt.init({"w": torch.ones(2)}))
        >>> u["w"].tolist()
        [-2.0, -2.0]
    """
    step_size = _check_number("scale", "step_size", step_size)

    def init(params):
        return EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        leaves, _ = _flat("scale.update", "updates", updates)
        for (u,) in _groups(leaves):
            torch._foreach_mul_(u, step_size)
        return updates, state

    return GradientTransformation(init, update)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply updates by ``step_size_fn(count)``, then increment ``count``.

    Args:
        step_size_fn: a function of the int step count (0 at the first update)
            returning a float.

    Returns:
        A ``GradientTransformation`` with ``ScaleByScheduleState(count)``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.scale_by_schedule(lambda count: 0.5 ** count)
        >>> state = opt.init({"w": torch.ones(1)})
        >>> _, state = opt.update({"w": torch.ones(1)}, state)
        >>> u, state = opt.update({"w": torch.ones(1)}, state)
        >>> u["w"].item(), int(state.count)
        (0.5, 2)
    """
    if not callable(step_size_fn):
        raise TypeError(
            f"scale_by_schedule: step_size_fn must be callable (count -> float), got "
            f"{type(step_size_fn).__name__}. For a constant use optim.scale(x)."
        )
    return _scale_by_schedule(step_size_fn, sign=1.0, where="scale_by_schedule.update")


def _scale_by_schedule(fn: Schedule, *, sign: float, where: str, nonneg: bool = False):
    def init(params):
        return ScaleByScheduleState(count=_new_count())

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        _check_state(where, state, ScaleByScheduleState)
        count = _check_count(where, state.count)
        value = _schedule_value(where, fn, count)
        if nonneg and value < 0:
            raise ValueError(
                f"{where}: the learning-rate schedule returned {value} at count {count}; "
                f"a learning rate must be >= 0. Check the schedule's arguments (e.g. "
                f"end_value and decay_steps)."
            )
        leaves, _ = _flat(where, "updates", updates)
        for (u,) in _groups(leaves):
            torch._foreach_mul_(u, sign * value)
        state.count.add_(1)
        return updates, state

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule) -> GradientTransformation:
    """Multiply updates by ``-learning_rate`` (descent), in place.

    Args:
        learning_rate: a float >= 0, or a schedule ``count -> float`` (count 0 is
            the first update, as ``torch.optim.lr_scheduler.LambdaLR`` sees it).

    Returns:
        ``scale(-lr)`` for a float, else a transform with ``ScaleByScheduleState``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.scale_by_learning_rate(0.1)
        >>> u, _ = opt.update({"w": torch.ones(1)}, opt.init({"w": torch.ones(1)}))
        >>> round(u["w"].item(), 6)
        -0.1
    """
    if callable(learning_rate):
        return _scale_by_schedule(
            learning_rate, sign=-1.0, where="scale_by_learning_rate.update", nonneg=True
        )
    lr = _check_number(
        "scale_by_learning_rate",
        "learning_rate",
        learning_rate,
        low=0.0,
        hint="Pass a float >= 0 or a schedule (a function count -> float).",
    )
    return scale(-lr)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moment estimates.

    ``mu = lerp(mu, g, 1-b1)``, ``nu = b2*nu + (1-b2)*g*g``, and the update is
    ``mu / (sqrt(nu)/sqrt(1-b2**t) + eps) / (1-b1**t)``, in torch.optim.Adam's
    order of operations. Allocates one temporary (the denominator) per step.

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the denominator, >= 0.

    Returns:
        A ``GradientTransformation`` with ``ScaleByAdamState(count, mu, nu)``;
        ``mu`` and ``nu`` are like params (same dtypes and shapes).

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.scale_by_adam()
        >>> state = opt.init({"w": torch.zeros(2)})
        >>> u, state = opt.update({"w": torch.tensor([2.0, -3.0])}, state)
        >>> [round(x, 4) for x in u["w"].tolist()], int(state.count)
        ([1.0, -1.0], 1)
    """
    where = f"scale_by_adam(b1={b1!r}, b2={b2!r}, eps={eps!r})"
    b1 = _check_number(where, "b1", b1, low=0.0, high=1.0, high_open=True, hint="Typically 0.9.")
    b2 = _check_number(where, "b2", b2, low=0.0, high=1.0, high_open=True, hint="Typically 0.999.")
    eps = _check_number(where, "eps", eps, low=0.0, hint="Typically 1e-8.")
    where = "scale_by_adam.update"

    def init(params):
        leaves, _ = _flat("scale_by_adam.init", "params", params)
        return ScaleByAdamState(
            count=_new_count(),
            mu=tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params),
            nu=tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params),
        )

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        _check_state(where, state, ScaleByAdamState)
        g, spec = _flat(where, "updates", updates)
        mu, mu_spec = _flat(where, "state.mu", state.mu)
        nu, nu_spec = _flat(where, "state.nu", state.nu)
        _check_same(where, "updates", spec, "state.mu", mu_spec, mu, g, dtypes=True)
        _check_same(where, "state.nu", nu_spec, "state.mu", mu_spec, mu, nu, dtypes=True)
        t = _check_count(where, state.count) + 1
        state.count.add_(1)
        bias_correction1 = 1 - b1**t
        bias_correction2_sqrt = (1 - b2**t) ** 0.5
        for g_, mu_, nu_ in _groups(g, mu, nu):
            torch._foreach_lerp_(mu_, g_, 1 - b1)
            torch._foreach_mul_(nu_, b2)
            torch._foreach_addcmul_(nu_, g_, g_, 1 - b2)
            denom = torch._foreach_sqrt(nu_)
            torch._foreach_div_(denom, bias_correction2_sqrt)
            torch._foreach_add_(denom, eps)
            # The gradient is spent: write the update into its (donated) buffers.
            torch._foreach_zero_(g_)
            torch._foreach_addcdiv_(g_, mu_, denom, 1 / bias_correction1)
            del denom
        return updates, state

    return GradientTransformation(init, update)


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum with torch.optim.SGD's semantics (no dampening).

    The first step sets ``trace = g``, later ones ``trace = decay*trace + g``.
    The update is ``trace``, or ``g + decay*trace`` with ``nesterov=True``.

    Args:
        decay: the momentum, >= 0.
        nesterov: use Nesterov momentum.

    Returns:
        A ``GradientTransformation`` with ``TraceState(trace)``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.trace(0.9)
        >>> state = opt.init({"w": torch.zeros(1)})
        >>> _, state = opt.update({"w": torch.ones(1)}, state)
        >>> u, state = opt.update({"w": torch.ones(1)}, state)
        >>> round(u["w"].item(), 6)
        1.9
    """
    decay = _check_number("trace", "decay", decay, low=0.0, hint="Typically 0.9.")
    if not isinstance(nesterov, bool):
        raise TypeError(f"trace: nesterov must be a bool, got {type(nesterov).__name__}.")
    where = "trace.update"

    def init(params):
        _flat("trace.init", "params", params)
        return TraceState(
            trace=tree_map(lambda p: torch.zeros_like(p, memory_format=torch.preserve_format), params)
        )

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        _check_state(where, state, TraceState)
        g, spec = _flat(where, "updates", updates)
        buf, buf_spec = _flat(where, "state.trace", state.trace)
        _check_same(where, "updates", spec, "state.trace", buf_spec, buf, g, dtypes=True)
        # A zero-initialised trace makes the first step trace = g exactly, as torch's clone.
        for g_, buf_ in _groups(g, buf):
            torch._foreach_mul_(buf_, decay)
            torch._foreach_add_(buf_, g_)
            if nesterov:
                torch._foreach_add_(g_, buf_, alpha=decay)
            else:
                torch._foreach_copy_(g_, buf_)
        return updates, state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float = 0.0) -> GradientTransformation:
    """Add ``weight_decay * params`` to updates, in place.

    Args:
        weight_decay: the coefficient, >= 0. ``update`` needs ``params`` unless it is 0.

    Returns:
        A ``GradientTransformation`` with ``EmptyState``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.add_decayed_weights(0.5)
        >>> p = {"w": torch.full((1,), 2.0)}
        >>> u, _ = opt.update({"w": torch.ones(1)}, opt.init(p), p)
        >>> u["w"].item()
        2.0
    """
    weight_decay = _check_number(
        "add_decayed_weights", "weight_decay", weight_decay, low=0.0, hint="Typically 0.01."
    )
    where = "add_decayed_weights.update"

    def init(params):
        return EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise ValueError(
                f"{where}: weight_decay={weight_decay} needs the params; call "
                f"update(updates, state, params)."
            )
        g, spec = _flat(where, "updates", updates)
        p, p_spec = _flat(where, "params", params)
        _check_same(where, "updates", spec, "params", p_spec, p, g, fix=_FIX_PARAMS)
        for g_, p_ in _groups(g, p):
            torch._foreach_add_(g_, p_, alpha=weight_decay)
        return updates, state

    return GradientTransformation(init, update)


def _round_like_torch_scalar(x: float, dtype: torch.dtype) -> float:
    """``x`` as torch uses a Python scalar with a ``dtype`` tensor: float64 stays, else float32.

    (Elementwise kernels compute in float32 for float32, float16 and bfloat16.)
    """
    if dtype == torch.float64:
        return x
    return struct.unpack("f", struct.pack("f", x))[0]


def decay_weights(rate: ScalarOrSchedule) -> GradientTransformation:
    """Add the update that multiplies params by ``1 - rate`` (decoupled weight decay).

    Adds ``(c - 1) * params`` to the updates, where ``c = 1 - rate`` is rounded
    as ``torch.optim.AdamW``'s ``p.mul_(1 - lr * weight_decay)`` rounds it (to
    float32 unless the params are float64), so that ``apply_updates`` lands
    where torch does. Place it after :func:`scale_by_learning_rate`; ``rate`` is
    then ``lr * weight_decay``.

    Args:
        rate: the fraction of the params to remove per step, >= 0, or a
            schedule ``count -> float`` (count 0 at the first update).

    Returns:
        A ``GradientTransformation`` with ``EmptyState`` for a float rate,
        ``ScaleByScheduleState(count)`` for a schedule. ``update`` needs params.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.decay_weights(0.25)
        >>> p = {"w": torch.full((1,), 2.0)}
        >>> u, _ = opt.update({"w": torch.zeros(1)}, opt.init(p), p)
        >>> u["w"].item()
        -0.5
    """
    where = "decay_weights.update"
    if not callable(rate):
        rate = _check_number("decay_weights", "rate", rate, low=0.0)

    def init(params):
        return ScaleByScheduleState(count=_new_count()) if callable(rate) else EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        if callable(rate):
            _check_state(where, state, ScaleByScheduleState)
            count = _check_count(where, state.count)
            value = _schedule_value(where, rate, count)
            if value < 0.0:
                raise ValueError(
                    f"{where}: the decay rate at count {count} is {value}; it must be >= 0 "
                    f"(it is lr * weight_decay). Check the learning-rate schedule."
                )
            state.count.add_(1)
        else:
            value = rate
        if params is None:
            raise ValueError(f"{where}: decay_weights needs the params; call update(updates, state, params).")
        g, spec = _flat(where, "updates", updates)
        p, p_spec = _flat(where, "params", params)
        _check_same(where, "updates", spec, "params", p_spec, p, g, fix=_FIX_PARAMS)
        for g_, p_ in _groups(g, p):
            factor = _round_like_torch_scalar(1.0 - value, p_[0].dtype) - 1.0
            if factor != 0.0:
                torch._foreach_add_(g_, p_, alpha=factor)
        return updates, state

    return GradientTransformation(init, update)


@torch.no_grad()
def global_norm(tree: Tree) -> torch.Tensor:
    """The L2 norm of all leaves of ``tree`` taken together, as a 0-dim float32 tensor.

    Uses ``torch._foreach_norm`` per device/dtype group; half-precision leaves
    are reduced in float32. The result lives on the first leaf's device (CPU
    for an empty tree), so computing it does not synchronise.

    Args:
        tree: a pytree of tensors.

    Returns:
        A 0-dim float32 tensor.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor(4.0)}).item()
        5.0
    """
    leaves, _ = _flat("global_norm", "tree", tree)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    device = leaves[0].device
    norms = []
    for (group,) in _groups(leaves):
        dtype = torch.float32 if group[0].element_size() < 4 else None
        norms.extend(torch._foreach_norm(group, 2, dtype=dtype))
    stacked = torch.stack([n.to(device=device, dtype=torch.float32) for n in norms])
    return torch.linalg.vector_norm(stacked, 2)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale updates so their global L2 norm is at most ``max_norm``.

    Same semantics as ``torch.nn.utils.clip_grad_norm_``: the factor is
    ``max_norm / (norm + 1e-6)``, applied only when below 1. When the caller
    passes ``grad_norm=`` (a float or 0-dim tensor, e.g. the norm across all
    ranks of a sharded gradient) it is used instead of the local tree's norm.
    With a tensor norm the factor is clamped on device, never read back.

    Args:
        max_norm: the largest allowed global norm, > 0.

    Returns:
        A ``GradientTransformation`` with ``EmptyState``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.clip_by_global_norm(1.0)
        >>> g = {"w": torch.tensor([3.0, 4.0])}
        >>> u, _ = opt.update(g, opt.init(g), grad_norm=10.0)
        >>> [round(x, 4) for x in u["w"].tolist()]
        [0.3, 0.4]
    """
    max_norm = _check_number("clip_by_global_norm", "max_norm", max_norm, low=0.0, low_open=True)
    where = "clip_by_global_norm.update"

    def init(params):
        return EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        leaves, _ = _flat(where, "updates", updates)
        norm = extra.get("grad_norm")
        if norm is None:
            norm = global_norm(updates)
        if isinstance(norm, torch.Tensor):
            if norm.numel() != 1:
                raise ValueError(
                    f"{where}: grad_norm must be a float or a 0-dim tensor, got a tensor "
                    f"{describe_leaf(norm)}. Pass the global norm, e.g. optim.global_norm(grads)."
                )
            coef = torch.clamp(max_norm / (norm.reshape(()) + 1e-6), max=1.0)
            for (u,) in _groups(leaves):
                torch._foreach_mul_(u, coef.to(u[0].device))
            return updates, state
        if not _is_real(norm):
            raise TypeError(
                f"{where}: grad_norm must be a float or a 0-dim tensor, got "
                f"{type(norm).__name__} {norm!r}. Pass the global norm of the full "
                f"gradient, or leave grad_norm out to use the local tree's norm."
            )
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for (u,) in _groups(leaves):
                torch._foreach_mul_(u, coef)
        return updates, state

    return GradientTransformation(init, update)


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
    p, p_spec = _flat(where, "params", params)
    u, u_spec = _flat(where, "updates", updates)
    _check_same(
        where, "updates", u_spec, "params", p_spec, p, u,
        fix="Pass the updates returned by update() for these params.",
    )
    for p_, u_ in _groups(p, u):
        torch._foreach_add_(p_, u_)
    return params


# --------------------------------------------------------------------------- #
# Named optimizers: composition only
# --------------------------------------------------------------------------- #


def _check_lr(where: str, lr: Any) -> None:
    if not callable(lr):
        _check_number(
            where, "lr", lr, low=0.0, hint="Pass a float >= 0 or a schedule (count -> float)."
        )


def _check_betas(where: str, betas: Any) -> tuple[float, float]:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(
            f"{where}: betas must be a pair (b1, b2), got {betas!r}. Typically (0.9, 0.999)."
        )
    return betas[0], betas[1]


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, equal to ``torch.optim.SGD`` (no dampening).

    ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov),
    scale_by_learning_rate(lr))``; the first two only when their coefficient is
    non-zero. Weight decay is L2 (added to the gradient before momentum).

    Args:
        lr: learning rate >= 0, or a schedule ``count -> float``.
        momentum: momentum factor >= 0.
        nesterov: Nesterov momentum (needs ``momentum > 0``).
        weight_decay: L2 coefficient >= 0.

    Returns:
        A ``GradientTransformation``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> p = {"w": torch.ones(1)}
        >>> opt = optim.sgd(0.1, momentum=0.9)
        >>> u, state = opt.update({"w": torch.ones(1)}, opt.init(p), p)
        >>> round(optim.apply_updates(p, u)["w"].item(), 6)
        0.9
    """
    where = f"sgd(lr={lr!r}, momentum={momentum!r}, nesterov={nesterov!r}, weight_decay={weight_decay!r})"
    _check_lr(where, lr)
    momentum = _check_number(where, "momentum", momentum, low=0.0, hint="Typically 0.9.")
    weight_decay = _check_number(where, "weight_decay", weight_decay, low=0.0)
    if nesterov and momentum == 0.0:
        raise ValueError(f"{where}: Nesterov momentum needs momentum > 0; pass momentum=0.9, say.")
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay))
    if momentum:
        parts.append(trace(momentum, nesterov=nesterov))
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)


def adam(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Adam, equal to ``torch.optim.Adam`` (L2 weight decay added to the gradient).

    ``chain(add_decayed_weights(weight_decay), scale_by_adam(*betas, eps),
    scale_by_learning_rate(lr))``; the first only when ``weight_decay`` is non-zero.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> float``.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 coefficient >= 0.

    Returns:
        A ``GradientTransformation``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> p = {"w": torch.ones(1)}
        >>> opt = optim.adam(0.1)
        >>> u, state = opt.update({"w": torch.ones(1)}, opt.init(p), p)
        >>> round(optim.apply_updates(p, u)["w"].item(), 5)
        0.9
    """
    where = f"adam(lr={lr!r}, betas={betas!r}, eps={eps!r}, weight_decay={weight_decay!r})"
    _check_lr(where, lr)
    b1, b2 = _check_betas(where, betas)
    weight_decay = _check_number(where, "weight_decay", weight_decay, low=0.0)
    parts = []
    if weight_decay:
        parts.append(add_decayed_weights(weight_decay))
    parts.append(scale_by_adam(b1, b2, eps))
    parts.append(scale_by_learning_rate(lr))
    base = chain(*parts)
    adam_at = 1 if weight_decay else 0
    return base._replace(apply=_fused_adam(base, adam_at, lr, b1, b2, eps, weight_decay, decoupled=False))


def adamw(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
) -> GradientTransformation:
    """AdamW, equal to ``torch.optim.AdamW`` (decoupled: ``p *= 1 - lr * weight_decay``).

    ``chain(scale_by_adam(*betas, eps), scale_by_learning_rate(lr),
    decay_weights(lr * weight_decay))``; the last only when ``weight_decay`` is
    non-zero. :func:`decay_weights` rounds the factor ``1 - lr * weight_decay``
    as torch does, so float32 runs do not drift apart from torch's.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> float``.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: decoupled decay coefficient >= 0.

    Returns:
        A ``GradientTransformation``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> p = {"w": torch.ones(1)}
        >>> opt = optim.adamw(0.1, weight_decay=0.1)
        >>> u, state = opt.update({"w": torch.ones(1)}, opt.init(p), p)
        >>> round(optim.apply_updates(p, u)["w"].item(), 5)
        0.89
    """
    where = f"adamw(lr={lr!r}, betas={betas!r}, eps={eps!r}, weight_decay={weight_decay!r})"
    _check_lr(where, lr)
    b1, b2 = _check_betas(where, betas)
    weight_decay = _check_number(where, "weight_decay", weight_decay, low=0.0)
    parts = [scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr)]
    if weight_decay:
        if callable(lr):
            schedule = lr

            def rate(count: int) -> float:
                return _schedule_value("adamw.update", schedule, count) * weight_decay

            parts.append(decay_weights(rate))
        else:
            parts.append(decay_weights(lr * weight_decay))
    base = chain(*parts)
    return base._replace(apply=_fused_adam(base, 0, lr, b1, b2, eps, weight_decay, decoupled=True))


_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _fused_adam(base, adam_at, lr, b1, b2, eps, weight_decay, *, decoupled: bool):
    """In-place Adam/AdamW through torch's fused kernel, one pass over memory.

    ``base`` is the same optimizer as a chain of primitives: its state layout
    is shared, and it runs instead wherever the kernel does not apply
    (another device, mixed dtypes within a group). Every count in the chain's
    state advances exactly as ``base.update`` would advance it.
    """
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_

    @torch.no_grad()
    def apply(grads, state, params, **extra):
        g, spec = _flat("adam.apply", "grads", grads)
        p, p_spec = _flat("adam.apply", "params", params)
        adam = state[adam_at]
        mu, _ = _flat("adam.apply", "state.mu", adam.mu)
        nu, _ = _flat("adam.apply", "state.nu", adam.nu)
        if spec != p_spec or not all(_fusable(*ts) for ts in zip(p, g, mu, nu)):
            updates, state = base.update(grads, state, params, **extra)
            apply_updates(params, updates)
            return state
        count = _check_count("adam.apply", adam.count)
        lr_value = _schedule_value("adam.apply", lr, count) if callable(lr) else lr
        if lr_value < 0:
            raise ValueError(f"adam.apply: the learning-rate schedule returned {lr_value} at count {count}; it must be >= 0")
        for sub in state:  # the counts of adam, the lr schedule and the decay schedule
            c = getattr(sub, "count", None)
            if isinstance(c, torch.Tensor):
                c.add_(1)
        for p_, g_, mu_, nu_ in _groups(p, g, mu, nu):
            step = torch.full((), float(count + 1), dtype=torch.float32, device=p_[0].device)
            kernel(
                p_, g_, mu_, nu_, [], [step] * len(p_),
                lr=lr_value, beta1=b1, beta2=b2, weight_decay=weight_decay, eps=eps,
                amsgrad=False, maximize=False,
            )
        return state

    return apply


def _fusable(*tensors: torch.Tensor) -> bool:
    """The fused kernel takes a parameter, its gradient and moments of one dtype on one device."""
    first = tensors[0]
    return (
        first.device.type in _FUSED_DEVICES
        and first.dtype in _FUSED_DTYPES
        and all(t.dtype == first.dtype and t.device == first.device for t in tensors)
    )


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
    if optimizer.apply is not None:
        return optimizer.apply(grads, state, params, **extra)
    updates, state = optimizer.update(grads, state, params, **extra)
    apply_updates(params, updates)
    return state


# --------------------------------------------------------------------------- #
# Schedules: plain functions count -> float, with optax's meanings
# --------------------------------------------------------------------------- #


def _count(where: str, count: Any) -> int:
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        count = count.item()
    if not isinstance(count, numbers.Integral) or isinstance(count, bool):
        raise TypeError(
            f"{where}: the step count must be an int, got {type(count).__name__} {count!r}."
        )
    return int(count)


def constant_schedule(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Args:
        value: the constant.

    Returns:
        A function ``count -> float``.

    Example:
        >>> from zerofn import optim
        >>> optim.constant_schedule(0.1)(1000)
        0.1
    """
    value = _check_number("constant_schedule", "value", value)

    def schedule(count: int) -> float:
        return value

    return schedule


def linear_schedule(
    init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0
) -> Schedule:
    """Linear interpolation from ``init_value`` to ``end_value`` over ``transition_steps``.

    Constant ``init_value`` before ``transition_begin`` and ``end_value`` after
    ``transition_begin + transition_steps``, as ``optax.linear_schedule``.

    Args:
        init_value: the value at count ``transition_begin`` and before.
        end_value: the value from count ``transition_begin + transition_steps`` on.
        transition_steps: the number of steps of the ramp; if <= 0, the schedule
            is the constant ``init_value``.
        transition_begin: the count where the ramp starts, >= 0.

    Returns:
        A function ``count -> float``.

    Example:
        >>> from zerofn import optim
        >>> s = optim.linear_schedule(0.0, 1.0, 10)
        >>> s(0), s(5), s(10), s(20)
        (0.0, 0.5, 1.0, 1.0)
    """
    where = "linear_schedule"
    init_value = _check_number(where, "init_value", init_value)
    end_value = _check_number(where, "end_value", end_value)
    if not isinstance(transition_steps, numbers.Integral):
        raise TypeError(f"{where}: transition_steps must be an int, got {transition_steps!r}.")
    if not isinstance(transition_begin, numbers.Integral) or transition_begin < 0:
        raise ValueError(f"{where}: transition_begin must be an int >= 0, got {transition_begin!r}.")
    if transition_steps <= 0:
        return constant_schedule(init_value)

    def schedule(count: int) -> float:
        c = min(max(_count(where, count) - transition_begin, 0), transition_steps)
        frac = 1 - c / transition_steps
        return (init_value - end_value) * frac + end_value

    return schedule


def cosine_decay_schedule(
    init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0
) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    As ``optax.cosine_decay_schedule``: ``init_value * ((1-alpha) * c**exponent +
    alpha)`` with ``c = (1 + cos(pi * min(count, decay_steps) / decay_steps)) / 2``.

    Args:
        init_value: the value at count 0.
        decay_steps: the length of the decay, > 0.
        alpha: the final value as a fraction of ``init_value``.
        exponent: power applied to the cosine factor.

    Returns:
        A function ``count -> float``.

    Example:
        >>> from zerofn import optim
        >>> s = optim.cosine_decay_schedule(1.0, 100)
        >>> s(0), round(s(50), 6), s(100), s(200)
        (1.0, 0.5, 0.0, 0.0)
    """
    where = "cosine_decay_schedule"
    init_value = _check_number(where, "init_value", init_value)
    alpha = _check_number(where, "alpha", alpha)
    exponent = _check_number(where, "exponent", exponent)
    if not isinstance(decay_steps, numbers.Integral) or decay_steps <= 0:
        raise ValueError(
            f"{where}: decay_steps must be an int > 0, got {decay_steps!r}. For a constant "
            f"value use constant_schedule({init_value})."
        )

    def schedule(count: int) -> float:
        c = min(_count(where, count), decay_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * c / decay_steps))
        return init_value * ((1 - alpha) * cosine**exponent + alpha)

    return schedule


def warmup_cosine_decay_schedule(
    init_value: float,
    peak_value: float,
    warmup_steps: int,
    decay_steps: int,
    end_value: float = 0.0,
    exponent: float = 1.0,
) -> Schedule:
    """Linear warmup from ``init_value`` to ``peak_value``, then cosine decay to ``end_value``.

    As ``optax.warmup_cosine_decay_schedule``: ``decay_steps`` counts the warmup,
    so the cosine phase lasts ``decay_steps - warmup_steps`` steps.

    Args:
        init_value: the value at count 0.
        peak_value: the value at count ``warmup_steps``.
        warmup_steps: the length of the warmup, >= 0.
        decay_steps: total length of warmup plus decay, > ``warmup_steps``.
        end_value: the value from count ``decay_steps`` on.
        exponent: power applied to the cosine factor.

    Returns:
        A function ``count -> float``.

    Example:
        >>> from zerofn import optim
        >>> s = optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 110, end_value=0.1)
        >>> s(0), s(5), s(10), round(s(60), 6), round(s(110), 6)
        (0.0, 0.5, 1.0, 0.55, 0.1)
    """
    where = "warmup_cosine_decay_schedule"
    peak_value = _check_number(where, "peak_value", peak_value)
    end_value = _check_number(where, "end_value", end_value)
    if not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0:
        raise ValueError(f"{where}: warmup_steps must be an int >= 0, got {warmup_steps!r}.")
    if not isinstance(decay_steps, numbers.Integral) or decay_steps <= warmup_steps:
        raise ValueError(
            f"{where}: decay_steps must be an int > warmup_steps={warmup_steps} (it counts "
            f"the warmup too, as in optax), got {decay_steps!r}."
        )
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    warmup = linear_schedule(init_value, peak_value, warmup_steps)
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)

    def schedule(count: int) -> float:
        c = _count(where, count)
        return warmup(c) if c < warmup_steps else decay(c - warmup_steps)

    return schedule
