"""``zf.Mean(total, count)``: a loss that is a mean over items, weighted by how many each rank has.

A loss averaged over tokens (a masked-LM, a causal LM with padding, a
supervised fine-tune that masks the prompt) is a mean over a number of
items that differs from rank to rank and from micro-step to micro-step.
Each rank's own mean is then over its own count, and averaging those means
over ranks and micro-steps weights every rank alike, whatever it holds: N
ranks train something else than one process fed the concatenated batch
(the gradient-accumulation error Hugging Face's Trainer fixed with
``num_items_in_batch``).

``loss_fn`` returns ``zf.Mean(total, count)`` instead (alone, or as the
first element of ``(loss, aux)``): ``total`` the sum of the per-item losses
on this rank's micro-batch, ``count`` how many items it summed. The step
runs backward on ``total`` and divides the reduced gradient, once, by the
count summed over every rank and micro-step of the update, which travels in
the step's statistics all-reduce (no round trip before backward). The loss
is then ``sum(total) / sum(count)``, and its gradient exactly that of one
process computing that mean over the concatenated batch.

Example:
    >>> import torch, torch.nn.functional as F, zerofn as zf
    >>> apply = zf.functional(torch.nn.Linear(4, 3))
    >>> def loss_fn(params, batch):
    ...     logits = apply(params, batch["x"])
    ...     total = F.cross_entropy(logits, batch["y"], ignore_index=-100, reduction="sum")
    ...     return zf.Mean(total, (batch["y"] != -100).sum())
    >>> step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    >>> state = step.init(apply.params)
    >>> batch = {"x": torch.ones(4, 4), "y": torch.tensor([0, 2, -100, -100])}
    >>> state, metrics = step(state, batch)
    >>> float(metrics["count"])
    2.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Mean"]

MEAN_HELP = (
    "Return zf.Mean(total, count) with total the 0-dim sum of the per-item losses on this rank's micro-batch "
    "(for example F.cross_entropy(logits, labels, ignore_index=-100, reduction='sum')) and count how many items "
    "it summed (for example (labels != -100).sum())."
)


@dataclass(frozen=True)
class Mean:
    """A mean over items: ``total`` (0-dim float tensor, the sum of the per-item losses on this rank's
    micro-batch) over ``count`` (how many items it summed: an int or a 0-dim tensor, 0 allowed).

    The step's loss is the sum of ``total`` over ranks and micro-steps divided by the sum of ``count``
    over them; ``metrics["count"]`` reports that global count. See the module docs.
    """

    total: torch.Tensor
    count: Any

    def __post_init__(self) -> None:
        t = self.total
        if not isinstance(t, torch.Tensor) or t.dim() != 0 or not t.is_floating_point():
            got = f"a tensor of shape {list(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(f"zf.Mean: total must be a 0-dim floating-point tensor, got {got}. {MEAN_HELP}")
        c = self.count
        ok = (isinstance(c, int) and not isinstance(c, bool)) or (isinstance(c, torch.Tensor) and c.numel() == 1)
        if not ok:
            got = f"a tensor of shape {list(c.shape)}" if isinstance(c, torch.Tensor) else repr(c)
            raise ValueError(f"zf.Mean: count must be an int or a one-element tensor, got {got}. {MEAN_HELP}")

    def counted(self, device: Any = None) -> torch.Tensor:
        """``count`` as a float64 0-dim tensor on ``device``, without a host read (a negative count in a
        tensor is caught in the step's statistics; one given as an int raises here)."""
        if isinstance(self.count, torch.Tensor):
            return self.count.detach().reshape(()).to(device=device, dtype=torch.float64)
        if self.count < 0:
            raise ValueError(f"zf.Mean: count must be >= 0 (how many items total sums), got {self.count}. {MEAN_HELP}")
        return torch.full((), float(self.count), dtype=torch.float64, device=device)

    def __add__(self, other: Any) -> Any:
        raise TypeError(
            "zf.Mean cannot be added to: its normaliser, the count over every rank and micro-step, is known only "
            "after backward. Add a per-item term to total before building the Mean (zf.Mean(total + extra_sum, "
            "count)), or return a plain mean loss instead."
        )

    __radd__ = __add__
