"""Named optimizers: :func:`sgd`, :func:`adam`, :func:`adamw`.

Composition only: each chains primitives from ``transforms``; ``adam`` and
``adamw`` also attach the fused path from ``fused``.
"""

from __future__ import annotations

from typing import Any

import torch

from zerofn.optim._checks import check_number, schedule_value
from zerofn.optim.base import GradientTransformation, ScalarOrSchedule, bind, chain
from zerofn.optim.fused import fused_adam
from zerofn.optim.groups import masked, masked_keys
from zerofn.optim.transforms import (
    add_decayed_weights,
    decay_weights,
    scale_by_adam,
    scale_by_learning_rate,
    trace,
)
from zerofn.optim.view import ParamView


def _check_lr(where: str, lr: Any) -> None:
    if not callable(lr):
        check_number(where, "lr", lr, low=0.0, hint="Pass a float >= 0 or a schedule (count -> float).")


def _check_betas(where: str, betas: Any) -> tuple[float, float]:
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"{where}: betas must be a pair (b1, b2), got {betas!r}. Typically (0.9, 0.999).")
    return betas[0], betas[1]


def sgd(
    lr: ScalarOrSchedule,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    mask: Any = None,
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
        mask: which parameters decay (see :func:`~zerofn.optim.masked`; None: all of them).

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
    momentum = check_number(where, "momentum", momentum, low=0.0, hint="Typically 0.9.")
    weight_decay = check_number(where, "weight_decay", weight_decay, low=0.0)
    if nesterov and momentum == 0.0:
        raise ValueError(f"{where}: Nesterov momentum needs momentum > 0; pass momentum=0.9, say.")
    parts = []
    if weight_decay:
        parts.append(_decaying(add_decayed_weights(weight_decay), mask))
    if momentum:
        parts.append(trace(momentum, nesterov=nesterov))
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)


def _decaying(decay: GradientTransformation, mask: Any) -> GradientTransformation:
    return decay if mask is None else masked(decay, mask)


def _mask_keys(mask: Any, view: ParamView | None) -> set | None:
    """The keys of ``view`` whose parameters decay under ``mask`` (None: all of them)."""
    if mask is None or view is None:
        return None
    return set(masked_keys(mask, view, "adam"))


def _with_fused(parts: list, adam_at: int, lr, b1, b2, eps, weight_decay, mask, *, decoupled: bool, view=None):
    """``chain(*parts)`` with the fused kernel as its in-place path, bound to ``view`` (None: unbound)."""
    base = chain(*parts)
    if view is not None:
        base = bind(base, view)
    if not weight_decay:
        mask = None  # no decay term: nothing to mask (and no labels, so the buckets may mix parameters)
    fused = fused_adam(
        base, adam_at, lr, b1, b2, eps, weight_decay, decoupled=decoupled, view=view, decayed=_mask_keys(mask, view)
    )
    if mask is not None and view is None:  # unbound with a mask: the keys are known only from the tree
        fused = _bind_on_call(parts, adam_at, lr, b1, b2, eps, weight_decay, mask, decoupled)
    binder = lambda v: _with_fused(parts, adam_at, lr, b1, b2, eps, weight_decay, mask, decoupled=decoupled, view=v)  # noqa: E731
    return base._replace(update_in_place=fused, bind=binder, masks=True)  # the kernel takes found_inf


def _bind_on_call(parts, adam_at, lr, b1, b2, eps, weight_decay, mask, decoupled):
    def update_in_place(grads, state, params, **extra):
        view = ParamView.of_tree(grads)
        bound = _with_fused(parts, adam_at, lr, b1, b2, eps, weight_decay, mask, decoupled=decoupled, view=view)
        return bound.update_in_place(grads, state, params, **extra)

    return update_in_place


def adam(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    mask: Any = None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    bias_correction: bool = True,
) -> GradientTransformation:
    """Adam, equal to ``torch.optim.Adam`` (L2 weight decay added to the gradient).

    ``chain(add_decayed_weights(weight_decay), scale_by_adam(*betas, eps),
    scale_by_learning_rate(lr))``; the first only when ``weight_decay`` is non-zero.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> float``.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: added to the denominator, >= 0.
        weight_decay: L2 coefficient >= 0.
        mask: which parameters decay (see :func:`~zerofn.optim.masked`; None: all of them).
        mu_dtype: the first moment's dtype (None: the parameters'; ``torch.bfloat16`` halves it).
        nu_dtype: the second moment's dtype, likewise.
        bias_correction: divide the moments by ``1 - b**t`` (torch's Adam); False: use them as they
            are, ``lr * mu / (sqrt(nu) + eps)``, as DeepSpeed's ``FusedAdam(bias_correction=False)``
            (the chain of primitives then runs: torch's fused kernel always corrects).

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
    weight_decay = check_number(where, "weight_decay", weight_decay, low=0.0)
    parts = []
    if weight_decay:
        parts.append(_decaying(add_decayed_weights(weight_decay), mask))
    parts.append(scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype, bias_correction=bias_correction))
    parts.append(scale_by_learning_rate(lr))
    if not bias_correction:
        return chain(*parts)
    adam_at = 1 if weight_decay else 0
    return _with_fused(parts, adam_at, lr, b1, b2, eps, weight_decay, mask, decoupled=False)


def adamw(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    *,
    mask: Any = None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
    bias_correction: bool = True,
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
        mask: which parameters decay: a tree of bools over the parameters or a function of the params
            tree returning one, such as :func:`~zerofn.optim.decay_mask` (None: all of them).
        mu_dtype: the first moment's dtype (None: the parameters'; ``torch.bfloat16`` halves it).
        nu_dtype: the second moment's dtype, likewise.
        bias_correction: divide the moments by ``1 - b**t`` (torch's Adam); False: use them as they
            are, ``lr * mu / (sqrt(nu) + eps)``, as DeepSpeed's ``FusedAdam(bias_correction=False)``
            (the chain of primitives then runs: torch's fused kernel always corrects).

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
    weight_decay = check_number(where, "weight_decay", weight_decay, low=0.0)
    parts = [
        scale_by_adam(b1, b2, eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype, bias_correction=bias_correction),
        scale_by_learning_rate(lr),
    ]
    if weight_decay:
        if callable(lr):
            schedule = lr

            def rate(count: int) -> float:
                return schedule_value("adamw.update", schedule, count) * weight_decay

            parts.append(_decaying(decay_weights(rate), mask))
        else:
            parts.append(_decaying(decay_weights(lr * weight_decay), mask))
    if not bias_correction:
        return chain(*parts)
    return _with_fused(parts, 0, lr, b1, b2, eps, weight_decay, mask, decoupled=True)
