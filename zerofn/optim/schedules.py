"""Schedules: plain functions ``count -> float``, with optax's meanings.

Pass one wherever a learning rate is taken; count 0 is the first update.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from zerofn.optim._checks import _check_number
from zerofn.optim.base import Schedule


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
