"""Byte accounting: :func:`counting` and its :class:`Counter`, and :func:`count`, which each collective calls.

Traffic is counted the way the ZeRO paper counts it: an all-reduce of a
tensor of n bytes counts 2n (a reduce-scatter plus an all-gather), a
reduce-scatter or an all-gather whose full tensor has n bytes counts n
(``_ops`` says which for each call). Counters are kept per group: a counter
sees the traffic of the groups it was opened on, from any thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from zerofn.collectives._groups import current_group, member
from zerofn.collectives._timeouts import group_key


@dataclass(eq=False)  # compared by identity: counting() removes its own counter, not an equal one
class Counter:
    """Bytes this rank moved through collectives while it was active."""

    bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes += nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1


_counters: dict = {}  # group_key(group) -> the counters open on it


@contextlib.contextmanager
def counting(group: Any = None, *, also: tuple = ()) -> Iterator[Counter]:
    """Count the collective traffic this rank issues on ``group`` (default: the current group) inside the
    block, from any thread (nests). Its small CPU messages (the control group's) count as its own.
    ``also``: more groups whose traffic counts in the same counter (a tensor-parallel group beside the
    data-parallel one a step runs on)."""
    keys_ = [group_key(current_group() if group is None else member(group, "counting"))]
    keys_ += [group_key(member(g, "counting")) for g in also if g is not None and group_key(g) not in keys_]
    c = Counter()
    for key in keys_:
        _counters.setdefault(key, []).append(c)
    try:
        yield c
    finally:
        for key in keys_:
            _counters[key].remove(c)
            if not _counters[key]:
                del _counters[key]


def count(kind: str, nbytes: int, group: Any) -> None:
    """Add ``nbytes`` of collective ``kind`` on ``group`` to every counter open on it."""
    for c in _counters.get(group_key(group), ()):
        c.add(kind, nbytes)


def tensor_bytes(t: torch.Tensor) -> int:
    """The bytes ``t`` holds."""
    return t.numel() * t.element_size()
