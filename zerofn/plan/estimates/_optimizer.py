"""What an optimizer's state holds per parameter element and besides (:class:`OptimizerBytes`,
:func:`optimizer_bytes`), found by initialising it once on a two-element tensor."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerofn import optim as O

ADAM_COUNT_BYTES = 8  # the optimizer's int64 step count


@dataclass(frozen=True)
class OptimizerBytes:
    """What an optimizer's state holds, as the planner counts it (:func:`optimizer_bytes`).

    Attributes:
        per_element: bytes per parameter element of its parameter-shaped state (Adam in fp32: 8, with
            bf16 moments 4), amp's master weights not included.
        fixed: bytes of its other tensors (step counts), whatever the model's size.
    """

    per_element: int
    fixed: int


ADAM = OptimizerBytes(8, ADAM_COUNT_BYTES)  # Adam's two fp32 moments and its step count


def optimizer_bytes(optimizer: O.GradientTransformation | None, dtype: torch.dtype = torch.float32) -> OptimizerBytes:
    """What ``optimizer``'s state holds per parameter element and besides, found by initialising it on one
    two-element parameter of ``dtype`` (:func:`zerofn.optim.probe_state`; fp32: amp's master weights, or the
    parameters in full precision, are what it updates; bf16 under ``amp(..., master_dtype=torch.bfloat16)``,
    where its moments default to bf16). None: Adam with fp32 moments.

    Under ``multi_transform`` the probe's parameter gets one group's transformation (the one its label
    function gives a 1-D tensor); for groups whose states differ in size, pass the largest group's
    optimizer to over-count rather than under-count.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> from zerofn.plan import optimizer_bytes
        >>> optimizer_bytes(optim.adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16))
        OptimizerBytes(per_element=4, fixed=8)
    """
    if optimizer is None:
        return ADAM
    if not isinstance(optimizer, O.GradientTransformation):
        raise TypeError(
            f"estimate: optimizer must be a zf.optim optimizer such as zf.optim.adamw(3e-4), got "
            f"{type(optimizer).__name__}"
        )
    probe = O.probe_state(optimizer, dtype)
    fixed = sum(t.numel() * t.dtype.itemsize for t in probe.small if isinstance(t, torch.Tensor))
    return OptimizerBytes(probe.bytes_per_element, fixed)
