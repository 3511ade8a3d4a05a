"""What a step checks, and what it says when a check fails.

- The ranks start from the same parameters (:func:`check_same_params`, at ``init``).
- The ranks feed batches of one structure, shapes and dtypes: a run's first call agrees at once
  (:func:`batch_digest`, one small blocking all-reduce); every update then compares the digest in its
  statistics, on the device.
- ``loss_fn`` returns a scalar, a ``zf.Mean`` or ``(loss, aux)`` (:func:`split_loss`).
- The update applies only when the loss and the gradient are finite, the ranks' batches agreed, no
  ``zf.Mean`` counted a negative number and no part's check failed (:func:`verdict`, on the device);
  a part reports its own checks with :func:`report`. A fault found on the device is raised where the
  host next reads it (:func:`carry_fault`), or at once (:func:`decide`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections.abc import Iterator
from typing import Any

import torch

from zerofn import collectives as C
from zerofn import tree as T
from zerofn.losses import MEAN_HELP, Mean
from zerofn.state import Layout, RunCache
from zerofn.step._stats import Stats, absent

__all__ = [
    "IGNORED_PARAMS_HELP",
    "batch_digest",
    "carry_fault",
    "check_each_update",
    "check_same_params",
    "decide",
    "report",
    "reporting",
    "split_loss",
    "verdict",
]

IGNORED_PARAMS_HELP = """\
{name}(state, batch): no gradient reached the parameters the step passed to
loss_fn: the loss does not depend on them. loss_fn must compute the loss
from its params argument, for example

    def loss_fn(params, batch):
        return criterion(apply(params, batch["x"]), batch["y"])   # not apply.params, not model(...)

Nothing was updated and the state is as it was.
"""


# ---------------------------------------------------------------- the ranks' parameters and batches


def check_same_params(named: dict, where: str) -> None:
    """Every rank must start from the same parameters: the max and min over ranks of each tensor's sum and
    sum of squares (one small all-reduce) tell, before a state is built from numbers that differ between ranks."""
    names = [k for k, t in named.items() if t.device.type != "meta" and t.is_floating_point()]
    if not names:
        return
    sums = torch.stack(
        [
            torch.stack([named[k].detach().double().sum(), named[k].detach().double().square().sum()]).cpu()
            for k in names
        ]
    ).nan_to_num(0.0)
    hi, lo = C.max_min(sums)
    differ = [k for k, a, b in zip(names, hi, lo) if not torch.equal(a, b)]
    if differ:
        raise ValueError(
            f"{where}.init: the ranks passed different values for {len(differ)} parameter(s) ({differ[:3]}"
            f"{' ...' if len(differ) > 3 else ''}). Every rank must start from the same parameters: seed the "
            "random generator the same way on every rank before building the model (torch.manual_seed(0)), "
            "load the same weights on every rank, or load a checkpoint (zf.checkpoint.load)."
        )


_DIGEST_BITS = 20  # small enough that the statistics' sum of squares of it stays exact in float64


def batch_digest(where: str, run: RunCache, batch: Any) -> int | None:
    """The batch's structure, shapes and dtypes as a number (a host computation), when ranks must agree
    on it: a run's first call agrees at once (a small all-reduce, recorded in ``run``); every update
    compares it in its statistics (see :func:`verdict`), so no call waits on a read for it."""
    if C.world_size() == 1:
        return None
    digest = T.treespec_digest(batch) & ((1 << _DIGEST_BITS) - 1)
    run.get("batch agreed", lambda: check_batch(where, batch, digest))
    return digest


def check_batch(where: str, batch: Any, digest: int) -> bool:
    """All ranks must feed batches of one structure, shapes and dtypes: agreed at once (the first call)."""
    hi, lo = C.max_min(torch.tensor([digest], dtype=torch.int64))
    if not torch.equal(hi, lo):
        _batches_differ(where, batch)
    return True


def _batches_differ(where: str, batch: Any) -> None:
    shapes = T.tree_map(T.describe_leaf, batch)
    everyone = C.gather_objects(shapes)
    lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(everyone))
    raise ValueError(
        f"{where}(state, batch): ranks fed batches of different shapes or structure "
        f"(world size {C.world_size()}); every rank must feed a micro-batch of the same shapes:\n{lines}\n"
        "Drop or pad the last partial batch (for example DataLoader(..., drop_last=True))."
    )


# ---------------------------------------------------------------- what loss_fn returns


def _local(t: Any) -> Any:
    """A loss computed on a distributed tensor (a vocabulary-parallel cross-entropy over a ``DTensor`` of
    logits sharded by vocabulary) as the plain tensor every rank holds (differentiably)."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) and hasattr(t, "placements") else t


def split_loss(where: str, out: Any) -> tuple[torch.Tensor, dict, Mean | None]:
    """The loss to run backward on, the aux dict and, for a ``zf.Mean``, the Mean."""
    aux: dict = {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise TypeError(
                f"{where}: loss_fn returned a tuple of {len(out)} items; expected a scalar loss, a zf.Mean(total, "
                "count), or (loss, aux_dict)"
            )
        out, aux = out
    if isinstance(out, Mean):
        return _local(out.total), aux, out
    out = _local(out)
    if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
        got = (
            f"a tensor of shape {list(out.shape)} and dtype {out.dtype}"
            if isinstance(out, torch.Tensor)
            else f"a {type(out).__name__}"
        )
        raise ValueError(
            f"{where}: loss_fn must return a scalar (0-dim) floating-point tensor, got {got}. "
            "Reduce it first, for example return loss.mean(), or return zf.Mean(losses.sum(), count) for a mean "
            "over items whose number differs between ranks or micro-steps (tokens)."
        )
    return out, aux, None


# ---------------------------------------------------------------- the parts' checks on the device

_REPORTS: contextvars.ContextVar[list | None] = contextvars.ContextVar("zerofn_reports", default=None)


def report(failed: torch.Tensor, explain: str) -> None:
    """Report a check a part of the step made on the device during forward (a rank's batch against its
    peers'): ``failed``, a 0-dim bool tensor the host does not read. The step's update is then skipped on
    every rank of its group and the next wait (``zf.block_until_ready``, a checkpoint) raises
    ``ValueError(explain)``. Outside a step it is read at once and raises there."""
    reports = _REPORTS.get()
    if reports is not None:
        reports.append((failed, explain))
    elif bool(failed):
        raise ValueError(explain)


@contextlib.contextmanager
def reporting() -> Iterator[list]:
    """Within the block, :func:`report` appends ``(failed, explain)`` to the list it yields."""
    reports: list = []
    token = _REPORTS.set(reports)
    try:
        yield reports
    finally:
        _REPORTS.reset(token)


# ---------------------------------------------------------------- the verdict and its faults

_BATCHES_DIFFER, _NEGATIVE_COUNT, _REPORTED = 1, 2, 3


def verdict(stats: Stats, digest: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether the update applies, on the device (a 0-dim bool): the loss and the gradient are finite, the
    ranks' batches agreed and no ``zf.Mean`` counted a negative number; and what went wrong that the user
    must hear of (0: nothing, else a fault code, see :func:`_explain_fault`)."""
    ok = torch.isfinite(stats.loss) & torch.isfinite(stats.sumsq)
    fault = torch.zeros((), dtype=torch.int64, device=stats.sumsq.device)
    if digest is not None:
        differ = stats.world * stats.digest_square != stats.digest_sum * stats.digest_sum
        fault = torch.where(differ, _BATCHES_DIFFER, fault)
    if stats.negative is not None:
        fault = torch.where(stats.negative > 0, _NEGATIVE_COUNT, fault)
    if stats.reported is not None:
        fault = torch.where(stats.reported > 0, _REPORTED, fault)
    return ok & (fault == 0), fault


def check_each_update() -> bool:
    """``ZEROFN_CHECK_EACH_UPDATE=1``: read every update's decision on the host, raising at the call that fed
    a bad batch (a debugging aid: each read waits for the device)."""
    return os.environ.get("ZEROFN_CHECK_EACH_UPDATE", "") not in ("", "0")


def carry_fault(previous: Any, fault: torch.Tensor, where: str, reported: list) -> tuple:
    """The device's check still to be read: this update's fault, or an earlier one not read yet."""
    if previous is not None:
        fault = torch.maximum(previous[0], fault)
    return fault, functools.partial(_explain_fault, where, _messages(reported))


def _messages(reported: list) -> tuple:
    """What the parts' reported checks say when they fail, each once."""
    return tuple(dict.fromkeys(m for _, m in reported))


def _explain_fault(where: str, messages: tuple, code: int) -> None:
    if code == _REPORTED:
        raise ValueError(
            " ".join(messages)
            if messages
            else f"{where}: a check of the batch failed on another rank of this step's group on an update (that "
            "update was skipped on the device and the state kept as it was); that rank raises what was wrong."
        )
    if code == _NEGATIVE_COUNT:
        raise ValueError(f"zf.Mean: count must be >= 0 (how many items total sums), got a negative count. {MEAN_HELP}")
    raise ValueError(
        f"{where}(state, batch): ranks fed batches of different shapes or structure (world size "
        f"{C.world_size()}) on an update after the first; that update was skipped on the device and the state "
        "kept as it was (metrics['skipped']). Every rank must feed a micro-batch of the same shapes: drop or pad "
        "the last partial batch (for example DataLoader(..., drop_last=True)). Set ZEROFN_CHECK_EACH_UPDATE=1 to "
        "raise at the call that fed it, with each rank's shapes."
    )


def decide(
    where: str, ok: torch.Tensor, fault: torch.Tensor, stats: Stats, batch: Any, layout: Layout, reported: list
) -> tuple[bool, frozenset]:
    """The device's decision (:func:`verdict`) read on the host, with which parameters no rank gave a gradient
    (one read): whether the update applies, and those parameters; raises what the fault says (the ranks'
    batches differ, with every rank's shapes; a negative zf.Mean count; a part's check), before anything is
    updated."""
    none_gave = absent(*stats.seen, stats.world) if stats.seen is not None else None
    head = torch.stack([ok.double(), fault.double()])
    applies, code, *gone = (head if none_gave is None else torch.cat([head, none_gave.double()])).tolist()
    if code == _BATCHES_DIFFER:
        _batches_differ(where, batch)
    elif code:
        _explain_fault(where, _messages(reported), int(code))
    return bool(applies), frozenset(n for n, a in zip(layout.trainable_names, gone) if a)
