"""The fused in-place Adam/AdamW path: torch's ``fused_adam(w)_`` kernels.

:func:`~zerofn.optim.alias.adam` and :func:`~zerofn.optim.alias.adamw` attach
``fused_adam`` as their ``update_in_place``, which :func:`~zerofn.optim.base.update_params`
takes; it falls back to the equivalent chain of primitives where the kernel
does not apply (see ``_fusable``).
"""

from __future__ import annotations

import torch

from zerofn.optim._checks import check_count, flat, schedule_value
from zerofn.optim.base import apply_updates, foreach_groups

_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fused_adam(base, adam_at, lr, b1, b2, eps, weight_decay, *, decoupled: bool):
    """In-place Adam/AdamW through torch's fused kernel, one pass over memory.

    ``base`` is the same optimizer as a chain of primitives: its state layout
    is shared, and it runs instead wherever the kernel does not apply
    (another device, mixed dtypes within a group). Every count in the chain's
    state advances exactly as ``base.update`` would advance it.
    """
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_

    @torch.no_grad()
    def update_in_place(grads, state, params, **extra):
        g, spec = flat("adam.update_in_place", "grads", grads)
        p, p_spec = flat("adam.update_in_place", "params", params)
        adam = state[adam_at]
        mu, _ = flat("adam.update_in_place", "state.mu", adam.mu)
        nu, _ = flat("adam.update_in_place", "state.nu", adam.nu)
        if spec != p_spec or not all(_fusable(*ts) for ts in zip(p, g, mu, nu)):
            updates, state = base.update(grads, state, params, **extra)
            apply_updates(params, updates)
            return state
        count = check_count("adam.update_in_place", adam.count)
        lr_value = schedule_value("adam.update_in_place", lr, count) if callable(lr) else lr
        if lr_value < 0:
            raise ValueError(
                f"adam.update_in_place: the learning-rate schedule returned {lr_value} at count {count}; it must be >= 0"
            )
        for sub in state:  # the counts of adam, the lr schedule and the decay schedule
            c = getattr(sub, "count", None)
            if isinstance(c, torch.Tensor):
                c.add_(1)
        for p_, g_, mu_, nu_ in foreach_groups(p, g, mu, nu):
            step = torch.full((), float(count + 1), dtype=torch.float32, device=p_[0].device)
            kernel(
                p_,
                g_,
                mu_,
                nu_,
                [],
                [step] * len(p_),
                lr=lr_value,
                beta1=b1,
                beta2=b2,
                weight_decay=weight_decay,
                eps=eps,
                amsgrad=False,
                maximize=False,
            )
        return state

    return update_in_place


def _fusable(*tensors: torch.Tensor) -> bool:
    """The fused kernel takes a parameter, its gradient and moments of one dtype on one device."""
    first = tensors[0]
    return (
        first.device.type in _FUSED_DEVICES
        and first.dtype in _FUSED_DTYPES
        and all(t.dtype == first.dtype and t.device == first.device for t in tensors)
    )
