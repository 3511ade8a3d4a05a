"""A step's statistics: one small vector, summed over the ranks by one all-reduce, and the record that
names its slots.

Each call packs what the ranks must sum (the loss, the gradient's sum of squares, the batch digest, a
``zf.Mean``'s running sums, the scalar aux values, the parts' checks, which ranks gave each parameter a
gradient) into ONE float64 tensor, reduces it with ONE collective and reads it back as a :class:`Stats`
record: :class:`_Slots` is the one place that says where each quantity lies, for packing and unpacking
alike. The record's tensors stay on the device: the verdict (``zerofn.step._checks``) and the metrics
read them by name.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from zerofn import collectives as C
from zerofn.precision import Precision

__all__ = ["Stats", "absent", "any_failed", "metrics", "pack_seen", "start_stats", "sum_of_squares"]


@dataclasses.dataclass(frozen=True)
class Stats:
    """An update's (or a micro-step's) statistics, summed over the ranks, as device tensors.

    Attributes:
        world: how many ranks summed them.
        loss: the loss, the mean over ranks (a ``zf.Mean``'s: its total over its count).
        sumsq: the gradient's sum of squares (0 when no gradient was taken on this call).
        digest_sum, digest_square: the sums of the ranks' batch digests and of their squares: the ranks
            fed batches of one shape exactly when ``world * digest_square == digest_sum ** 2``.
        count: a ``zf.Mean``'s count over the ranks and micro-steps (None: the loss is not a Mean).
        negative: how many ranks counted a negative number (with ``count``).
        aux: the scalar aux values, each the mean over ranks.
        reported: how many ranks' parts reported a failed check (None: no part reports).
        seen: ``(packed, n)``: how many ranks gave each of the ``n`` trainable parameters a gradient, packed
            (see :func:`pack_seen`); None when every rank gave every parameter one.
    """

    world: int
    loss: torch.Tensor
    sumsq: torch.Tensor
    digest_sum: torch.Tensor
    digest_square: torch.Tensor
    count: torch.Tensor | None = None
    negative: torch.Tensor | None = None
    aux: dict = dataclasses.field(default_factory=dict)
    reported: torch.Tensor | None = None
    seen: tuple | None = None


class _Slots:
    """Where each quantity lies in the packed vector: the fixed head, then a ``zf.Mean``'s sums, the
    scalar aux values, the parts' checks, and last the packed bits of who gave each parameter a
    gradient."""

    LOSS, SUMSQ, UNSEEN, DIGEST, DIGEST_SQUARE = range(5)
    TOTAL, COUNT, NEGATIVE = 5, 6, 7  # with a zf.Mean only

    def __init__(self, items: bool, scalars: int, reported: bool) -> None:
        self.aux = 8 if items else 5
        end = self.aux + scalars
        self.reported = end if reported else None
        self.bits = end + reported


def sum_of_squares(norms: list, device: Any) -> torch.Tensor:
    """The sum of the squares of ``norms`` (0-dim tensors), in float64 on ``device`` (0 for none)."""
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack([n.double().square() for n in norms]).sum().to(device)


def start_stats(
    loss,
    aux,
    norms,
    *,
    world: int,
    rank: int,
    replicated: bool,
    digest,
    unseen: bool = False,
    items=None,
    seen=None,
    reported=None,
    counted=None,
    model_groups: tuple = (),
) -> Callable[[], Stats]:
    """One small all-reduce, on the loss's device, read by no one here: the loss (mean over ranks), the
    gradient sum of squares (from each bucket's norm; None: no gradient; ``counted``: which of them this
    rank counts, see below; summed first over each of ``model_groups``, the model-parallel axes' groups,
    whose ranks hold different pieces of the parameters), how many ranks gave some
    parameter no gradient (``unseen`` here), the batch digest and its square (equal on every rank when
    n * sum(d^2) == sum(d)^2), a ``zf.Mean``'s running sums of total and count (``items``; the loss is then
    their quotient) and how many ranks counted a negative number, the scalar aux values and, on an update
    across ranks (``seen``: this rank's bits or None, and how many trainable parameters), how many ranks gave
    each parameter a gradient. The verdict decides on the device from the record, or the host reads what it
    must know, once per update (``zerofn.step._checks``).

    Returns a function that waits for the all-reduce, which stays in flight until then, and gives the record.
    """
    scalars = {k: v for k, v in sorted(aux.items()) if _is_scalar(v)}
    dev = loss.device
    slots = _Slots(items is not None, len(scalars), reported is not None)

    def const(v: float) -> torch.Tensor:  # made on the device: no copy from the host
        return torch.full((), float(v), dtype=torch.float64, device=dev)

    # Each bucket's norm counted by the ranks that hold its elements once between them: every rank of a
    # sharded bucket, rank 0 of a replicated one's group, and along a model-parallel axis every rank of a
    # bucket cut along it, rank 0 of one whole along it (``counted``; default: rank 0 of the step's group).
    counted = counted if counted is not None else [not replicated or rank == 0] * len(norms or ())
    sumsq = sum_of_squares([n for n, c in zip(norms or (), counted) if c], dev)  # 0: none this rank counts
    if norms is not None:  # summed over the model-parallel axes too: their ranks hold different pieces (tensor
        # parallelism's slices, a pipeline's stages; a stage with nothing to train adds 0)
        for g in model_groups:
            C.all_reduce(sumsq, "sum", group=g)
    d = digest or 0
    parts = [loss.double(), sumsq, const(1.0 if unseen else 0.0), const(d), const(d * d)]
    if items is not None:
        parts += [items[0].to(dev), items[1].to(dev), (items[1] < 0).double().to(dev)]
    parts += [
        v.detach().double().reshape(()).to(dev) if isinstance(v, torch.Tensor) else const(v) for v in scalars.values()
    ]
    if reported is not None:  # parts' checks on the device (see zerofn.step.report): after the aux values
        parts.append(reported)
    bits = None
    if seen is not None and world > 1:
        mine, n = seen
        bits = pack_seen(torch.ones(n, device=dev) if mine is None else mine.to(dev), world)
    vec = torch.stack(parts) if bits is None else torch.cat([torch.stack(parts), bits])
    handle = C.all_reduce(vec, "sum", async_op=True)
    return functools.partial(_read, handle, slots, world, scalars, items is not None, bits is not None, seen, dev)


def _read(handle: Any, slots: _Slots, world: int, scalars: dict, items: bool, bits: bool, seen, dev) -> Stats:
    """The record of :func:`start_stats`' vector, once its all-reduce is done."""
    vec = handle.wait()
    out: dict[str, Any] = {"loss": vec[slots.LOSS] / world}
    if items:
        total, n = vec[slots.TOTAL], vec[slots.COUNT]
        # nan when no rank counted any: the step is then skipped
        out.update(loss=total / n, count=n, negative=vec[slots.NEGATIVE])
    out["aux"] = {k: vec[slots.aux + j] / world for j, k in enumerate(scalars)}
    if slots.reported is not None:
        out["reported"] = vec[slots.reported]
    if bits:
        out["seen"] = (vec[slots.bits :], seen[1])
    elif seen is not None and seen[0] is not None:  # one rank: its own bits, one per field
        out["seen"] = (pack_seen(seen[0].to(dev), 1), seen[1])
    return Stats(
        world, sumsq=vec[slots.SUMSQ], digest_sum=vec[slots.DIGEST], digest_square=vec[slots.DIGEST_SQUARE], **out
    )


def any_failed(reported: list, device: Any) -> torch.Tensor:
    """Whether any of the reported checks failed, as a float64 on ``device`` (0 or 1)."""
    flag = torch.zeros((), dtype=torch.float64, device=device)
    for failed, _ in reported:
        flag = torch.maximum(flag, failed.to(device, torch.float64))
    return flag


def _field_bits(world: int) -> int:
    """Bits per parameter in the packed count of ranks that gave it a gradient: room for 0..world."""
    return max(1, world.bit_length())


def pack_seen(bits: torch.Tensor, world: int) -> torch.Tensor:
    """This rank's bit per trainable parameter (gave it a gradient or not), packed into float64s of 52 bits
    each, ``_field_bits(world)`` bits per parameter: the all-reduce's sum of them is, field by field, how
    many ranks gave each parameter a gradient (no field overflows, every sum stays exact)."""
    b = _field_bits(world)
    per = 52 // b
    n = bits.numel()
    padded = torch.zeros(-(-n // per) * per, dtype=torch.float64, device=bits.device)
    padded[:n] = bits.to(torch.float64)
    exponents = torch.arange(0, b * per, b, device=bits.device)  # made on the device: no copy from the host
    weights = torch.ldexp(torch.ones(per, dtype=torch.float64, device=bits.device), exponents)
    return (padded.view(-1, per) * weights).sum(1)


def absent(packed: torch.Tensor, n: int, world: int) -> torch.Tensor:
    """Which of the ``n`` parameters no rank gave a gradient, on the device (a bool each), from the packed
    sums (see :func:`pack_seen`): each field shifted down by a power of two and cut, exact in float64."""
    b = _field_bits(world)
    per = 52 // b
    exponents = -torch.arange(0, b * per, b, device=packed.device)
    scales = torch.ldexp(torch.ones(per, dtype=torch.float64, device=packed.device), exponents)  # 2^-(b j)
    shifted = (packed.reshape(-1, 1) * scales.reshape(1, -1)).floor()
    return (torch.remainder(shifted, float(1 << b)).reshape(-1)[:n]) == 0


def metrics(precision: Precision, loss_scale: Any, stats: Stats, aux: dict, skipped=None, grad_norm=None) -> dict:
    """The metrics, device tensors (read one to wait for it: ``float(metrics["loss"])``): none of them
    waits here. ``skipped``: a 0-dim bool tensor (None: no update on this call, so False)."""
    dev = stats.loss.device
    m: dict[str, Any] = {
        "loss": stats.loss.float(),
        "grad_norm": grad_norm if grad_norm is not None else torch.full((), math.nan, device=dev),
        "skipped": skipped if skipped is not None else torch.zeros((), dtype=torch.bool, device=dev),
    }
    if stats.count is not None:
        m["count"] = stats.count
    m.update(precision.metrics(loss_scale))
    for k, v in aux.items():
        m[k] = stats.aux[k].float() if k in stats.aux else v
    return m


def _is_scalar(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)
