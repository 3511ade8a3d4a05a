"""A small, optional metrics logger for training loops.

:class:`Logger` is what the examples use in place of a hand-made progress
bar: rank 0 shows a tqdm bar with the loss and tokens/s, and can append one
JSON line per logging step to a file, or write the scalars to TensorBoard.
Every other rank does nothing (but may call every method, so a loop needs
no ``if rank == 0``). Nothing here is needed by a training step; the
transforms never log.

Metrics are read only on logging steps (every ``every`` steps and on the
last): turning a tensor into a float waits for the device, so doing it on
every step would add a host sync per step on a GPU.

Example:

    >>> import torch
    >>> import zerofn as zf
    >>> with zf.metrics.Logger(3, tokens_per_step=64, disable=True) as log:
    ...     for i in range(3):
    ...         log.log(i, {"loss": torch.tensor(1.0 / (i + 1))})
    >>> s = log.summary()
    >>> s["steps"], s["tokens_per_s"] > 0
    (3, True)
"""

from __future__ import annotations

import json
import numbers
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
from tqdm import tqdm

from zerofn import collectives

__all__ = ["Logger", "scalars"]


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float | int | bool]:
    """The scalar entries of ``metrics`` as Python numbers; nested mappings flatten to ``"outer/inner"``.

    One-element tensors become floats (ints and bools stay as they are);
    larger tensors and anything else that is not a number are left out.

    >>> import torch
    >>> scalars({"loss": torch.tensor(0.5), "n": 3, "g": {"norm": torch.tensor([2.0])}, "v": torch.ones(2)})
    {'loss': 0.5, 'n': 3, 'g/norm': 2.0}
    """
    out: dict[str, float | int | bool] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, torch.Tensor):
            if value.numel() == 1:
                out[name] = float(value.detach().float().reshape(()).item())
        elif isinstance(value, (bool, numbers.Integral)):
            out[name] = value if isinstance(value, bool) else int(value)
        elif isinstance(value, numbers.Real):
            out[name] = float(value)
    return out


def _summary_writer(logdir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            f"Logger(tensorboard={logdir!r}) needs the tensorboard package, an optional dependency: "
            "pip install tensorboard (or zerofn[tensorboard])"
        ) from e
    return SummaryWriter


class Logger:
    """Rank 0's progress bar, JSON lines and TensorBoard scalars for a training loop.

    Args:
        total_steps: the step index the run ends at (the bar's total).
        start: the first step index of this run (a resumed run's step): the
            bar starts there.
        tokens_per_step: tokens one step consumes over all ranks (the global
            batch times the sequence length); without it there is no tokens/s.
        every: read the metrics and update the bar, file and TensorBoard
            every ``every`` steps (``step_index % every == 0``) and on the
            last (``step_index == total_steps - 1``).
        jsonl: a path: append one JSON object per logging step (``step``,
            ``time``: seconds since the logger started, ``tokens_per_s``:
            ``null`` without ``tokens_per_step``, and every scalar metric),
            flushed at once.
        tensorboard: a directory for ``torch.utils.tensorboard.SummaryWriter``
            (needs ``pip install tensorboard``; checked on every rank when the
            logger is made, so no rank fails alone).
        desc: the bar's label.
        disable: no output of any kind; default: every rank but rank 0.
        bar: show the progress bar (False keeps the file and TensorBoard
            output, e.g. for a ``--quiet`` run).
    """

    def __init__(
        self,
        total_steps: int,
        *,
        start: int = 0,
        tokens_per_step: int | None = None,
        every: int = 10,
        jsonl: str | os.PathLike | None = None,
        tensorboard: str | os.PathLike | None = None,
        desc: str = "train",
        disable: bool | None = None,
        bar: bool = True,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.total_steps, self.start, self.every = int(total_steps), int(start), int(every)
        self.tokens_per_step = tokens_per_step
        self.disable = collectives.rank() != 0 if disable is None else bool(disable)
        writer_cls = _summary_writer(str(tensorboard)) if tensorboard is not None else None
        self.steps = 0
        self.last: dict[str, float | int | bool] = {}
        self._closed = False
        self._file = None
        self._writer = None
        self._bar = None
        if not self.disable:
            if jsonl is not None:
                parent = os.path.dirname(os.fspath(jsonl))
                if parent:
                    os.makedirs(parent, exist_ok=True)
                self._file = open(jsonl, "a", encoding="utf-8")
            if writer_cls is not None:
                self._writer = writer_cls(str(tensorboard))
            if bar:
                self._bar = tqdm(total=self.total_steps, initial=self.start, desc=desc, dynamic_ncols=True)
        self._t0 = time.perf_counter()
        self._t_end: float | None = None

    # ------------------------------------------------------------ the loop

    def seconds(self) -> float:
        """Wall time since the logger was made (up to :meth:`close`)."""
        return (self._t_end if self._t_end is not None else time.perf_counter()) - self._t0

    def tokens_per_s(self) -> float | None:
        """Tokens per second over the steps logged so far; None without ``tokens_per_step``."""
        if self.tokens_per_step is None:
            return None
        return self.steps * self.tokens_per_step / max(self.seconds(), 1e-9)

    def logging_step(self, step_index: int) -> bool:
        """Whether :meth:`log` reads the metrics at ``step_index``."""
        return step_index % self.every == 0 or step_index == self.total_steps - 1

    def log(self, step_index: int, metrics: Mapping[str, Any] | None = None, **extra: Any) -> dict | None:
        """Count one step; on a logging step, read ``metrics`` and ``extra`` and show/write them.

        Returns the record (step, time, tokens_per_s and the scalars) on a
        logging step of an enabled logger with some output (a bar, a file or
        TensorBoard), else None: the metrics are not touched then, so no
        device sync happens.
        """
        self.steps += 1
        if self.disable or (self._bar is None and self._file is None and self._writer is None):
            return None  # nothing to show or write: the metrics stay unread
        if not self.logging_step(step_index):
            if self._bar is not None:
                self._bar.update(1)
            return None
        values = scalars({**(metrics or {}), **extra})
        self.last = values
        rate = self.tokens_per_s()
        if self._bar is not None:
            post = {}
            if "loss" in values:
                post["loss"] = f"{values['loss']:.3f}"
            if rate is not None:
                post["tok_s"] = f"{rate:,.0f}"
            self._bar.set_postfix(post, refresh=False)
            self._bar.update(1)
        record = {"step": int(step_index), "time": round(self.seconds(), 6), "tokens_per_s": rate, **values}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._writer is not None:
            for name, value in values.items():
                self._writer.add_scalar(name, float(value), int(step_index))
            if rate is not None:
                self._writer.add_scalar("tokens_per_s", rate, int(step_index))
        return record

    def print(self, *args: Any, sep: str = " ") -> None:
        """Rank 0's ``print`` (stdout) that keeps the progress bar whole; nothing elsewhere."""
        if not self.disable:
            tqdm.write(sep.join(str(a) for a in args))

    def summary(self) -> dict:
        """``{"steps": logged steps, "seconds": wall time, "tokens_per_s": rate or None}`` (on every rank)."""
        return {"steps": self.steps, "seconds": self.seconds(), "tokens_per_s": self.tokens_per_s()}

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close the bar, the file and the TensorBoard writer (idempotent); stops the clock."""
        if self._closed:
            return
        self._closed = True
        self._t_end = time.perf_counter()
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # a file left open by a loop that raised
        try:
            f = self._file
        except AttributeError:
            return
        if f is not None and not f.closed:
            f.close()
