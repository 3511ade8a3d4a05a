"""Issuing and waiting: :class:`Handle`, an in-flight collective, and :func:`named`, around both.

Inside :func:`named` a backend timeout or lost peer becomes a
``CollectiveError`` naming the collective, its size, the group, this rank
and how long it waited (``_errors.translate``); a :class:`Handle`'s
``wait()`` runs inside it too, and then finishes the result (a mean's
division, the two-rank reduce-scatter's own half).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from zerofn.collectives._errors import translate
from zerofn.collectives._groups import describe
from zerofn.collectives._timeouts import TIMEOUTS, group_key, is_default


@contextlib.contextmanager
def named(kind: str, nbytes: int = 0, started: float | None = None, group: Any = None) -> Iterator[float]:
    """Issue or wait for collective ``kind`` on ``group`` inside: a backend timeout or lost peer becomes a
    :class:`CollectiveError` naming it. Yields the time it was issued (``started``, or now)."""
    started = time.monotonic() if started is None else started
    try:
        yield started
    except RuntimeError as err:
        _reraise(err, kind, nbytes, started, group)


def _reraise(err: RuntimeError, kind: str, nbytes: int, started: float, group: Any = None):
    """Raise ``err`` as a :class:`CollectiveError` naming the collective, or unchanged."""
    sub = not is_default(group)
    try:
        rank, world = (group.rank(), group.size()) if sub else (dist.get_rank(), dist.get_world_size())
    except Exception:  # the group is gone as well
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
    which = ""
    if sub:
        with contextlib.suppress(Exception):
            which = f" (in {describe(group)}; global rank {dist.get_rank()})"
    what = f"{kind} ({nbytes:,} bytes)" if nbytes else kind
    new = translate(
        err, what, started, rank=rank, world=world, limit=TIMEOUTS.get(group_key(group)), group=group, which=which
    )
    if new is None:
        raise err
    raise new from err


# ---------------------------------------------------------------- handles


class Handle:
    """An in-flight collective; ``wait()`` returns its result.

    ``wait()`` raises :class:`CollectiveTimeoutError` or
    :class:`CollectiveError` (naming the collective) when the collective
    timed out or lost a rank.
    """

    __slots__ = ("_work", "_result", "_after", "_kind", "_nbytes", "_started", "_group")

    def __init__(
        self,
        work: Any,
        result: Any,
        after=None,
        kind: str = "collective",
        nbytes: int = 0,
        started: float = 0.0,
        group: Any = None,
    ):
        self._work, self._result, self._after = work, result, after
        self._kind, self._nbytes, self._started, self._group = kind, nbytes, started, group

    def wait(self) -> Any:
        if self._work is not None:
            with named(self._kind, self._nbytes, self._started, self._group):
                self._work.wait()
            self._work = None
            if self._after is not None:
                self._after(self._result)
                self._after = None
        return self._result


def done(result: Any) -> Handle:
    """A Handle of a collective that had nothing to wait for (world size 1): ``wait()`` returns ``result``."""
    return Handle(None, result)
