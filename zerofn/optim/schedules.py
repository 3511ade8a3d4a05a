"""Schedules: plain functions ``count -> float``, with optax's meanings.

Pass one wherever a learning rate is taken; count 0 is the first update.
``deepspeed_warmup_lr``, ``deepspeed_warmup_decay_lr`` and
``deepspeed_warmup_cosine_lr`` are DeepSpeed's ``WarmupLR``,
``WarmupDecayLR`` and ``WarmupCosineLR``: the learning rate DeepSpeed's
engine uses for each update, by the same count.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from zerofn import counters
from zerofn.optim._checks import check_number
from zerofn.optim.base import Schedule


def _count(where: str, count: Any) -> int:
    if isinstance(count, torch.Tensor) and count.numel() == 1:
        count = counters.value(count)
    if not isinstance(count, numbers.Integral) or isinstance(count, bool):
        raise TypeError(f"{where}: the step count must be an int, got {type(count).__name__} {count!r}.")
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
    value = check_number("constant_schedule", "value", value)

    def schedule(count: int) -> float:
        return value

    return schedule


def linear_schedule(init_value: float, end_value: float, transition_steps: int, transition_begin: int = 0) -> Schedule:
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
    init_value = check_number(where, "init_value", init_value)
    end_value = check_number(where, "end_value", end_value)
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


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0, exponent: float = 1.0) -> Schedule:
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
    init_value = check_number(where, "init_value", init_value)
    alpha = check_number(where, "alpha", alpha)
    exponent = check_number(where, "exponent", exponent)
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
    peak_value = check_number(where, "peak_value", peak_value)
    end_value = check_number(where, "end_value", end_value)
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


# ---------------------------------------------------------------- DeepSpeed's schedules
#
# DeepSpeed's engine steps its scheduler *after* each optimizer update, and the scheduler's
# constructor has already set the lr the first update uses (its value at last_batch_iteration
# -1). So the update zerofn counts as ``count`` runs at DeepSpeed's lr for iteration
# ``count - 1``; these schedules take the update count and apply that shift, so that the
# sequence of learning rates the updates use equals DeepSpeed's, the first one included.


def _deepspeed_warmup(where: str, warmup_num_steps: Any, warmup_type: Any):
    """DeepSpeed's warmup: ``(W, gamma)`` with W = max(2, warmup_num_steps) and gamma(it) for it < W."""
    if not isinstance(warmup_num_steps, numbers.Integral) or isinstance(warmup_num_steps, bool) or warmup_num_steps < 0:
        raise ValueError(f"{where}: warmup_num_steps must be an int >= 0, got {warmup_num_steps!r}.")
    if warmup_type not in ("log", "linear"):
        raise ValueError(f'{where}: warmup_type must be "log" or "linear" (DeepSpeed\'s two), got {warmup_type!r}.')
    w = max(2, int(warmup_num_steps))  # as DeepSpeed: log(1) would divide by zero
    inverse_log = 1.0 / math.log(w)

    def gamma(it: int) -> float:
        return inverse_log * math.log(it + 1) if warmup_type == "log" else it / w

    return w, gamma


def _warmup_then(where: str, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, *, after) -> Schedule:
    """DeepSpeed's warmup from ``warmup_min_lr`` to ``warmup_max_lr``, then ``min + (max - min) * after(it, W)``;
    ``count`` runs at DeepSpeed's iteration ``count - 1``, and iteration -1 at ``warmup_min_lr``."""
    max_lr = check_number(where, "warmup_max_lr", warmup_max_lr, low=0.0)
    min_lr = check_number(where, "warmup_min_lr", warmup_min_lr, low=0.0)
    w, gamma = _deepspeed_warmup(where, warmup_num_steps, warmup_type)
    delta = max_lr - min_lr

    def schedule(count: int) -> float:
        it = _count(where, count) - 1
        if it < 0:
            return min_lr
        return min_lr + delta * (gamma(it) if it < w else after(it, w))

    return schedule


def _check_total(where: str, total_num_steps: Any) -> int:
    if not isinstance(total_num_steps, numbers.Integral) or isinstance(total_num_steps, bool) or total_num_steps < 0:
        raise ValueError(
            f"{where}: total_num_steps must be an int >= 0 (the number of optimizer updates of the run), "
            f"got {total_num_steps!r}."
        )
    return int(total_num_steps)


def deepspeed_warmup_lr(
    warmup_max_lr: float, warmup_min_lr: float = 0.0, warmup_num_steps: int = 1000, warmup_type: str = "log"
) -> Schedule:
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` up to ``warmup_max_lr``, then constant.

    With ``W = max(2, warmup_num_steps)`` and DeepSpeed's iteration
    ``it = count - 1`` (see below): ``lr = min + (max - min) * gamma``, where
    ``gamma = log(it + 1) / log(W)`` (``"log"``, DeepSpeed's default) or
    ``it / W`` (``"linear"``) while ``it < W``, and 1 after.

    ``count`` is the update count (0 for the first update), and the value is
    the learning rate DeepSpeed's engine uses for that update: it steps its
    scheduler after each update, so update ``count`` runs at the scheduler's
    value for iteration ``count - 1``; the first update (iteration -1) runs
    at ``warmup_min_lr``, and so does the second (``gamma(0) = 0``).

    Args:
        warmup_max_lr: the learning rate after the warmup (DeepSpeed's
            default: the optimizer's ``lr``).
        warmup_min_lr: the learning rate at the start.
        warmup_num_steps: the length of the warmup, >= 0 (DeepSpeed uses at least 2).
        warmup_type: ``"log"`` or ``"linear"``.

    Returns:
        A function ``count -> float``.

    Example:
        >>> from zerofn import optim
        >>> s = optim.deepspeed_warmup_lr(1e-3, warmup_num_steps=100)
        >>> [round(s(c), 6) for c in (0, 1, 2, 51, 101, 500)]
        [0.0, 0.0, 0.000151, 0.000854, 0.001, 0.001]
    """
    return _warmup_then(
        "deepspeed_warmup_lr", warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, after=lambda it, w: 1.0
    )


def deepspeed_warmup_decay_lr(
    total_num_steps: int,
    warmup_min_lr: float = 0.0,
    warmup_max_lr: float = 0.001,
    warmup_num_steps: int = 1000,
    warmup_type: str = "log",
) -> Schedule:
    """DeepSpeed's ``WarmupDecayLR``: :func:`deepspeed_warmup_lr`'s warmup, then linear decay to 0.

    After the warmup (``it >= W``, ``W = max(2, warmup_num_steps)``),
    ``lr = min + (max - min) * max(0, (total_num_steps - it) / max(1, total_num_steps - W))``,
    reaching ``warmup_min_lr`` at iteration ``total_num_steps``. ``count`` is
    the update count and runs at DeepSpeed's iteration ``count - 1``, as in
    :func:`deepspeed_warmup_lr`.

    Args:
        total_num_steps: the number of updates of the run, >= 0.
        warmup_min_lr: the learning rate at the start and the end.
        warmup_max_lr: the peak learning rate (DeepSpeed's default 0.001).
        warmup_num_steps: the length of the warmup, >= 0 (DeepSpeed uses at least 2).
        warmup_type: ``"log"`` or ``"linear"``.

    Returns:
        A function ``count -> float``.

    Example:
        >>> from zerofn import optim
        >>> s = optim.deepspeed_warmup_decay_lr(100, warmup_max_lr=1.0, warmup_num_steps=10, warmup_type="linear")
        >>> [round(s(c), 6) for c in (0, 1, 6, 11, 56, 101, 200)]
        [0.0, 0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """
    where = "deepspeed_warmup_decay_lr"
    total = _check_total(where, total_num_steps)
    return _warmup_then(
        where,
        warmup_min_lr,
        warmup_max_lr,
        warmup_num_steps,
        warmup_type,
        after=lambda it, w: max(0.0, float(total - it) / float(max(1.0, total - w))),
    )


def deepspeed_warmup_cosine_lr(
    lr: float,
    total_num_steps: int,
    warmup_min_ratio: float = 0.0,
    warmup_num_steps: int = 1000,
    cos_min_ratio: float = 0.0001,
    warmup_type: str = "log",
) -> Schedule:
    """DeepSpeed's ``WarmupCosineLR``: ``lr`` times a ratio that warms up to 1, then decays as a cosine.

    With ``W = max(2, warmup_num_steps)`` and DeepSpeed's iteration
    ``it = count - 1``: while ``it < W`` the ratio is ``warmup_min_ratio +
    gamma * (1 - warmup_min_ratio)`` (``gamma`` as in :func:`deepspeed_warmup_lr`);
    after, ``max(0, cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * (it - W + 1)
    / (total_num_steps - W))) / 2)``. As DeepSpeed's: the first update
    (iteration -1) runs at lr 0, and past ``total_num_steps`` the cosine is
    not clamped (it turns back up); stop at ``total_num_steps`` updates.

    Args:
        lr: the peak learning rate (the optimizer's ``lr`` in a DeepSpeed config).
        total_num_steps: the number of updates of the run, > ``max(2, warmup_num_steps)``.
        warmup_min_ratio: the ratio at the start of the warmup.
        warmup_num_steps: the length of the warmup, >= 0 (DeepSpeed uses at least 2).
        cos_min_ratio: the ratio at the end of the cosine.
        warmup_type: ``"log"`` or ``"linear"``.

    Returns:
        A function ``count -> float``.

    Example:
        >>> from zerofn import optim
        >>> s = optim.deepspeed_warmup_cosine_lr(1.0, 110, warmup_num_steps=10, cos_min_ratio=0.0, warmup_type="linear")
        >>> [round(s(c), 6) for c in (0, 1, 6, 10, 60, 110)]
        [0.0, 0.0, 0.5, 0.9, 0.5, 0.0]
    """
    where = "deepspeed_warmup_cosine_lr"
    lr = check_number(where, "lr", lr, low=0.0)
    total = _check_total(where, total_num_steps)
    min_ratio = check_number(where, "warmup_min_ratio", warmup_min_ratio, low=0.0, high=1.0)
    cos_min = check_number(where, "cos_min_ratio", cos_min_ratio, low=0.0, high=1.0)
    w, gamma = _deepspeed_warmup(where, warmup_num_steps, warmup_type)
    if total <= w:
        raise ValueError(
            f"{where}: total_num_steps ({total}) must be greater than max(2, warmup_num_steps) ({w}): "
            "the cosine divides by their difference."
        )

    def schedule(count: int) -> float:
        it = _count(where, count) - 1
        if it < 0:
            return 0.0
        if it < w:
            ratio = min_ratio + gamma(it) * (1.0 - min_ratio)
        else:
            ratio = (1 + math.cos(math.pi * (it - w + 1) / (total - w))) / 2
            ratio = max(0.0, cos_min + (1.0 - cos_min) * ratio)
        return lr * ratio

    return schedule
