"""Primitive gradient transformations, each a ``GradientTransformation``.

Scaling (:func:`scale`, :func:`scale_by_schedule`,
:func:`scale_by_learning_rate`), Adam's moments (:func:`scale_by_adam`),
momentum (:func:`trace`), weight decay (:func:`add_decayed_weights`,
:func:`decay_weights`) and clipping (:func:`global_norm`,
:func:`clip_by_global_norm`). Named optimizers chain these in ``alias``.
"""

from __future__ import annotations

import struct
from typing import Any

import torch

from zerofn import alloc, counters
from zerofn.optim._checks import (
    FIX_PARAMS,
    check_count,
    check_number,
    check_same,
    check_state,
    count_device,
    flat,
    is_real,
    schedule_at,
    schedule_value,
)
from zerofn.optim.base import (
    EmptyState,
    GradientTransformation,
    PendingNorm,
    ScalarOrSchedule,
    ScaleByAdamState,
    ScaleByScheduleState,
    Schedule,
    TraceState,
    Tree,
    foreach_groups,
    skip_on_host,
)
from zerofn.optim.view import ParamView, by_step, info_of, keys_of, live_columns, maybe_pieces
from zerofn.tree import describe_leaf, tree_map


def _new_count(params: Any = None) -> torch.Tensor:
    """A count of 0 on the parameters' device (so that an update the device decides on advances it there)."""
    return counters.new(0, device=count_device(params))


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
    step_size = check_number("scale", "step_size", step_size)

    def init(params):
        return EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        leaves, _ = flat("scale.update", "updates", updates)
        for (u,) in foreach_groups(leaves):
            torch._foreach_mul_(u, step_size)
        return updates, state

    return GradientTransformation(init, update, masks=True)  # no state: runs either way


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
        return ScaleByScheduleState(count=_new_count(params))

    def check(value: float, count: int) -> None:
        if nonneg and value < 0:
            raise ValueError(
                f"{where}: the learning-rate schedule returned {value} at count {count}; "
                f"a learning rate must be >= 0. Check the schedule's arguments (e.g. "
                f"end_value and decay_steps)."
            )

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        check_state(where, state, ScaleByScheduleState)
        found = extra.get("found_inf")
        if found is None or found.device != state.count.device:
            if found is not None and skip_on_host(extra, found):  # counts elsewhere than the decision
                return updates, state
            count = check_count(where, state.count)
            value = schedule_value(where, fn, count)
            check(value, count)
            counters.add_(state.count)
        else:  # the device decides: the schedule's value by the count there, which advances where it applies
            value = schedule_at(where, fn, state.count, check)
            counters.advance_(state.count, found == 0)
        leaves, _ = flat(where, "updates", updates)
        for (u,) in foreach_groups(leaves):
            factor = sign * value
            torch._foreach_mul_(u, factor.to(u[0].device) if isinstance(factor, torch.Tensor) else factor)
        return updates, state

    return GradientTransformation(init, update, masks=True)


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
        return _scale_by_schedule(learning_rate, sign=-1.0, where="scale_by_learning_rate.update", nonneg=True)
    lr = check_number(
        "scale_by_learning_rate",
        "learning_rate",
        learning_rate,
        low=0.0,
        hint="Pass a float >= 0 or a schedule (a function count -> float).",
    )
    return scale(-lr)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    bias_correction: bool = True,
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moment estimates.

    ``mu = lerp(mu, g, 1-b1)``, ``nu = b2*nu + (1-b2)*g*g``, and the update is
    ``mu / (sqrt(nu)/sqrt(1-b2**t) + eps) / (1-b1**t)``, in torch.optim.Adam's
    order of operations. Allocates one temporary (the denominator) per step.
    With ``bias_correction=False`` the moments are used as they are:
    ``mu / (sqrt(nu) + eps)`` (DeepSpeed's ``FusedAdam(bias_correction=False)``).

    Under a step, ``t`` is each parameter's own update number (torch's
    ``state["step"]``), and a parameter that got no gradient is skipped: its
    moments stay and its update is zero (see :class:`~zerofn.optim.view.StepInfo`).

    Args:
        b1: decay of the first moment, in [0, 1).
        b2: decay of the second moment, in [0, 1).
        eps: added to the denominator, >= 0.
        mu_dtype: the first moment's dtype (None: the parameters'); ``torch.bfloat16``
            halves its bytes. The moments are updated in the wider of the gradient's
            dtype and their own, and stored rounded to their own (fp32 moments of
            bf16 parameters, as DeepSpeed's bf16 master weights keep them, are
            updated in fp32; the update is then rounded to the gradient's dtype).
        nu_dtype: the second moment's dtype, likewise.
        bias_correction: divide the moments by ``1 - b**t`` (torch's Adam); False: use them
            as they are.

    Returns:
        A ``GradientTransformation`` with ``ScaleByAdamState(count, mu, nu)``;
        ``mu`` and ``nu`` are shaped like params.

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
    b1 = check_number(where, "b1", b1, low=0.0, high=1.0, high_open=True, hint="Typically 0.9.")
    b2 = check_number(where, "b2", b2, low=0.0, high=1.0, high_open=True, hint="Typically 0.999.")
    eps = check_number(where, "eps", eps, low=0.0, hint="Typically 1e-8.")
    for name, dt in (("mu_dtype", mu_dtype), ("nu_dtype", nu_dtype)):
        if dt is not None and not (isinstance(dt, torch.dtype) and dt.is_floating_point):
            raise TypeError(
                f"{where}: {name} must be a floating torch.dtype such as torch.bfloat16, or None; got {dt!r}"
            )
    if not isinstance(bias_correction, bool):
        raise TypeError(f"{where}: bias_correction must be a bool, got {type(bias_correction).__name__}.")
    return _scale_by_adam(b1, b2, eps, mu_dtype, nu_dtype, None, bias_correction)


def moments_like(p: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A zero moment for parameter (or bucket) ``p``, in ``dtype`` (None: ``p``'s); inside
    :func:`zerofn.alloc.unfilled` (a state built to be loaded into), allocated only."""
    return alloc.zeros_like(p, dtype=dtype or p.dtype)


def _scale_by_adam(
    b1, b2, eps, mu_dtype, nu_dtype, view: ParamView | None, correct: bool = True
) -> GradientTransformation:
    where = "scale_by_adam.update"

    def init(params):
        flat("scale_by_adam.init", "params", params)
        return ScaleByAdamState(
            count=_new_count(params),
            mu=tree_map(lambda p: moments_like(p, mu_dtype), params),
            nu=tree_map(lambda p: moments_like(p, nu_dtype), params),
        )

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        check_state(where, state, ScaleByAdamState)
        g, spec = flat(where, "updates", updates)
        mu, mu_spec = flat(where, "state.mu", state.mu)
        nu, nu_spec = flat(where, "state.nu", state.nu)
        check_same(where, "updates", spec, "state.mu", mu_spec, mu, g, dtypes=mu_dtype is None)
        check_same(where, "state.nu", nu_spec, "state.mu", mu_spec, mu, nu, dtypes=mu_dtype == nu_dtype)
        count = check_count(where, state.count)
        counters.add_(state.count)
        for t, cols in by_step(view, keys_of(spec), info_of(extra), count, g, mu, nu):
            for g_, mu_, nu_ in foreach_groups(*cols):
                _adam_moments(g_, mu_, nu_, t, b1, b2, eps, correct)
        return updates, state

    return GradientTransformation(
        init, update, bind=lambda v: _scale_by_adam(b1, b2, eps, mu_dtype, nu_dtype, v, correct)
    )


def _adam_moments(
    g_: list, mu_: list, nu_: list, t: int, b1: float, b2: float, eps: float, correct: bool = True
) -> None:
    """One Adam step on lists of one device and dtype each: the moments in place, the update into ``g_``."""
    narrow = mu_[0].dtype != g_[0].dtype or nu_[0].dtype != g_[0].dtype
    stored, out = (mu_, nu_), g_
    if narrow:  # moments of another dtype: updated in the wider one, stored rounded to their own
        work = max((g_[0].dtype, mu_[0].dtype, nu_[0].dtype), key=lambda d: torch.finfo(d).bits)
        mu_ = [m.to(work) for m in mu_]
        nu_ = [n.to(work) for n in nu_]
        g_ = [g.to(work) for g in g_] if work != g_[0].dtype else g_
    torch._foreach_lerp_(mu_, g_, 1 - b1)
    torch._foreach_mul_(nu_, b2)
    torch._foreach_addcmul_(nu_, g_, g_, 1 - b2)
    denom = torch._foreach_sqrt(nu_)
    if correct:
        torch._foreach_div_(denom, (1 - b2**t) ** 0.5)
    torch._foreach_add_(denom, eps)
    # The gradient is spent: write the update into its (donated) buffers.
    torch._foreach_zero_(g_)
    torch._foreach_addcdiv_(g_, mu_, denom, 1 / (1 - b1**t) if correct else 1.0)
    del denom
    if narrow:
        torch._foreach_copy_(stored[0], mu_)
        torch._foreach_copy_(stored[1], nu_)
        if g_ is not out:
            torch._foreach_copy_(out, g_)


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
    decay = check_number("trace", "decay", decay, low=0.0, hint="Typically 0.9.")
    if not isinstance(nesterov, bool):
        raise TypeError(f"trace: nesterov must be a bool, got {type(nesterov).__name__}.")
    return _trace(decay, nesterov, None)


def _trace(decay: float, nesterov: bool, view: ParamView | None) -> GradientTransformation:
    where = "trace.update"

    def init(params):
        flat("trace.init", "params", params)
        return TraceState(trace=tree_map(lambda p: alloc.zeros_like(p), params))

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        check_state(where, state, TraceState)
        g, spec = flat(where, "updates", updates)
        buf, buf_spec = flat(where, "state.trace", state.trace)
        check_same(where, "updates", spec, "state.trace", buf_spec, buf, g, dtypes=True)
        g, buf = live_columns(view, keys_of(spec), info_of(extra), g, buf)  # no gradient: the trace stays
        found = extra.get("found_inf")
        # a parameter no rank may have given a gradient (decided on the device): its trace kept where none did
        kept = [
            (flag, gp, bp, bp.clone()) for flag, (gp, bp) in maybe_pieces(view, keys_of(spec), info_of(extra), g, buf)
        ]
        factor: float | torch.Tensor = decay
        if found is not None:  # the device decides: a skipped update leaves the trace (x 1, + 0) as it was
            skip = found != 0
            for t in g:
                t.masked_fill_(skip, 0.0)  # whatever it held (inf, nan): a skipped update's gradient adds nothing
            one = torch.ones((), dtype=torch.float32, device=found.device)
            factor = torch.where(skip, one, torch.full_like(one, decay))
        # A zero-initialised trace makes the first step trace = g exactly, as torch's clone.
        for g_, buf_ in foreach_groups(g, buf):
            torch._foreach_mul_(buf_, factor if isinstance(factor, float) else factor.to(buf_[0].device))
            torch._foreach_add_(buf_, g_)
            if nesterov:
                torch._foreach_add_(g_, buf_, alpha=decay)
            else:
                torch._foreach_copy_(g_, buf_)
        for flag, gp, bp, before in kept:
            bp.copy_(torch.where(flag, before, bp))
            gp.masked_fill_(flag, 0.0)  # no update either
        return updates, state

    return GradientTransformation(init, update, bind=lambda v: _trace(decay, nesterov, v), masks=True)


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
    weight_decay = check_number("add_decayed_weights", "weight_decay", weight_decay, low=0.0, hint="Typically 0.01.")
    return _add_decayed_weights(weight_decay, None)


def _add_decayed_weights(weight_decay: float, view: ParamView | None) -> GradientTransformation:
    where = "add_decayed_weights.update"

    def init(params):
        return EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise ValueError(
                f"{where}: weight_decay={weight_decay} needs the params; call update(updates, state, params)."
            )
        g, spec = flat(where, "updates", updates)
        p, p_spec = flat(where, "params", params)
        check_same(where, "updates", spec, "params", p_spec, p, g, fix=FIX_PARAMS)
        g, p = live_columns(view, keys_of(spec), info_of(extra), g, p)  # no gradient: no decay either
        for g_, p_ in foreach_groups(g, p):
            torch._foreach_add_(g_, p_, alpha=weight_decay)
        for flag, (gp,) in maybe_pieces(view, keys_of(spec), info_of(extra), g):  # decided on the device
            gp.masked_fill_(flag, 0.0)
        return updates, state

    return GradientTransformation(init, update, bind=lambda v: _add_decayed_weights(weight_decay, v), masks=True)


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
    if not callable(rate):
        rate = check_number("decay_weights", "rate", rate, low=0.0)
    return _decay_weights(rate, None)


def _decay_weights(rate: ScalarOrSchedule, view: ParamView | None) -> GradientTransformation:
    where = "decay_weights.update"

    def init(params):
        return ScaleByScheduleState(count=_new_count(params)) if callable(rate) else EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        if callable(rate):
            check_state(where, state, ScaleByScheduleState)
            count = check_count(where, state.count)
            value = schedule_value(where, rate, count)
            if value < 0.0:
                raise ValueError(
                    f"{where}: the decay rate at count {count} is {value}; it must be >= 0 "
                    f"(it is lr * weight_decay). Check the learning-rate schedule."
                )
            counters.add_(state.count)
        else:
            value = rate
        if params is None:
            raise ValueError(f"{where}: decay_weights needs the params; call update(updates, state, params).")
        g, spec = flat(where, "updates", updates)
        p, p_spec = flat(where, "params", params)
        check_same(where, "updates", spec, "params", p_spec, p, g, fix=FIX_PARAMS)
        g, p = live_columns(view, keys_of(spec), info_of(extra), g, p)  # no gradient: no decay either
        for g_, p_ in foreach_groups(g, p):
            factor = _round_like_torch_scalar(1.0 - value, p_[0].dtype) - 1.0
            if factor != 0.0:
                torch._foreach_add_(g_, p_, alpha=factor)
        for flag, (gp,) in maybe_pieces(view, keys_of(spec), info_of(extra), g):  # decided on the device
            gp.masked_fill_(flag, 0.0)
        return updates, state

    # a constant rate keeps no state and runs either way; a scheduled one decides on the host (its factor
    # is rounded there as torch rounds a Python scalar)
    return GradientTransformation(init, update, bind=lambda v: _decay_weights(rate, v), masks=not callable(rate))


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
    leaves, _ = flat("global_norm", "tree", tree)
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    device = leaves[0].device
    norms = []
    for (group,) in foreach_groups(leaves):
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
    Given a :class:`PendingNorm` (an update running before the norm is
    known) it does not scale, and records that this holds only if the true
    norm will not clip.

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
    max_norm = check_number("clip_by_global_norm", "max_norm", max_norm, low=0.0, low_open=True)
    where = "clip_by_global_norm.update"

    def _coef(norm: torch.Tensor) -> torch.Tensor:
        return torch.clamp(max_norm / (norm.reshape(()) + 1e-6), max=1.0)

    def init(params):
        return EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        leaves, _ = flat(where, "updates", updates)
        norm = extra.get("grad_norm")
        if norm is None:
            norm = global_norm(updates)
        if isinstance(norm, PendingNorm):  # not known yet: go on as if not clipping, and say when that holds
            norm.assume_below(lambda true: _coef(torch.tensor(true)) == 1.0)
            return updates, state
        if isinstance(norm, torch.Tensor):
            if norm.numel() != 1:
                raise ValueError(
                    f"{where}: grad_norm must be a float or a 0-dim tensor, got a tensor "
                    f"{describe_leaf(norm)}. Pass the global norm, e.g. optim.global_norm(grads)."
                )
            coef = _coef(norm)
            for (u,) in foreach_groups(leaves):
                torch._foreach_mul_(u, coef.to(u[0].device))
            return updates, state
        if not is_real(norm):
            raise TypeError(
                f"{where}: grad_norm must be a float or a 0-dim tensor, got "
                f"{type(norm).__name__} {norm!r}. Pass the global norm of the full "
                f"gradient, or leave grad_norm out to use the local tree's norm."
            )
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            for (u,) in foreach_groups(leaves):
                torch._foreach_mul_(u, coef)
        return updates, state

    return GradientTransformation(init, update, masks=True)  # no state, and a tensor norm stays on the device
