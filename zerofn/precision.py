"""The numeric precision of a step: the :class:`Precision` part of a Step.

Like jmp's ``Policy`` and loss scale together: which dtype parameters are
held and computed in, which dtype gradients travel in, what wraps the
optimizer so it still works in fp32, and the loss scale (created, applied,
undone and adjusted only through this part, so the step never asks "is
there a scaler?"). The default here is full precision: every tensor keeps
its dtype, nothing is scaled, and the optimizer is the user's. ``amp``
replaces it with a mixed-precision subclass.

Example:
    >>> import torch
    >>> from zerofn.precision import Precision
    >>> p = Precision()
    >>> p.cast(torch.ones(2)).dtype, p.grad_dtype(torch.float32), p.loss_scale_factor(p.new_loss_scale())
    (torch.float32, torch.float32, 1.0)
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from zerofn import optim as O

__all__ = ["Precision"]


@dataclass(frozen=True)
class Precision:
    """Full precision: parameters, compute and gradients in their own dtypes; no loss scale.

    Attributes:
        name: this part's piece of the step's name (None: it adds none).
    """

    name: str | None = None

    def cast(self, t: torch.Tensor, owner: torch.nn.Module | None = None) -> torch.Tensor:
        """A parameter as the state holds it (and the forward uses it); ``owner`` is its module, if known."""
        return t

    def autocast(self, device: str):
        """The context the forward runs under."""
        return contextlib.nullcontext()

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype a bucket of ``param_dtype`` parameters gathers and reduces its gradient in."""
        return param_dtype

    def wrap_optimizer(self, optimizer: O.GradientTransformation) -> O.GradientTransformation:
        """The optimizer the step runs (amp's keeps fp32 master weights in its state)."""
        return optimizer

    def optimizer_grads(self, reduced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The reduced gradients as the optimizer takes them."""
        return reduced

    def masters(self, opt_state: Any) -> tuple | None:
        """The full-precision copies the optimizer updates, one per bucket as it sees them; None:
        the parameters themselves are."""
        return None

    # ---------------------------------------------------------- the loss scale (a pytree in the state)

    def new_loss_scale(self, device: Any = None) -> Any:
        """A fresh state's loss scale; None: the state carries none."""
        return None

    def loss_scale_factor(self, loss_scale: Any) -> float | torch.Tensor:
        """What the loss is multiplied by before backward (and the gradients divided by after): a number,
        or a 0-dim tensor on the device once the device adjusts it (see :meth:`adjust`)."""
        return 1.0

    def adjust(self, loss_scale: Any, finite: bool | torch.Tensor) -> Any:
        """The loss scale after a step whose gradients were (or were not) all finite: a bool the host read,
        or a 0-dim bool tensor on the device (the new scale is then computed there)."""
        return loss_scale

    def metrics(self, loss_scale: Any) -> dict[str, Any]:
        """What this precision adds to a step's metrics."""
        return {}

    def replace(self, **changes) -> Precision:
        return dataclasses.replace(self, **changes)
