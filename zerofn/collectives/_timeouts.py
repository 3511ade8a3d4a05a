"""How long a collective may wait, and the tables that hold each group's: the lowest module of the package.

``ZEROFN_TIMEOUT_S`` (default 600 s) bounds every wait on another rank; it
is read when a group is created (``_groups``), and the seconds each group
was given are kept in :data:`TIMEOUTS`, which the error messages quote
(``_errors``). The package's tables (timeouts, counters, control groups)
are keyed by :func:`group_key`, under which the default group has one key
whether or not it is joined yet.
"""

from __future__ import annotations

import os
from typing import Any

import torch.distributed as dist

# Seconds a collective waits for the other ranks when ZEROFN_TIMEOUT_S is not set.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "ZEROFN_TIMEOUT_S"


def timeout_s() -> float:
    """Seconds a collective waits for the other ranks: ``ZEROFN_TIMEOUT_S``, default 600.

    Read from the environment when a process group is created (so set it
    before :func:`init`, ``step.init`` or the first collective, or before
    ``zf.spawn``/``zf.RankPool``, whose ranks inherit the caller's
    environment).
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(
            f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds that a collective "
            f"may wait for the other ranks (default {DEFAULT_TIMEOUT_S:g})."
        )
    return seconds


# The timeout each group was given (what a timed-out collective reports), by group_key: the default group's
# from init or set_group_timeout, a subgroup's from new_group or set_group_timeout.
TIMEOUTS: dict = {}


class _Default:
    """The key of the default group in the package's tables, whether or not it is joined yet."""

    def __repr__(self) -> str:
        return "the default group"


DEFAULT_GROUP = _Default()


def group_key(group: Any) -> Any:
    """``group``'s key in the package's tables: :data:`DEFAULT_GROUP` for None and the default group."""
    return DEFAULT_GROUP if group is None or group is dist.group.WORLD else group


def is_default(group: Any) -> bool:
    """Whether ``group`` is the default group (or None, which stands for it)."""
    return group_key(group) is DEFAULT_GROUP
