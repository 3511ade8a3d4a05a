"""The errors a collective raises, and the translation of the backend's errors into them.

:class:`CollectiveTimeoutError` when a rank waited ``ZEROFN_TIMEOUT_S`` for
one that never joined, :class:`CollectiveError` when another rank is gone.
:func:`translate` turns torch's own error (a gloo or NCCL ``RuntimeError``,
a ``DistError``) into one of them, naming the collective, the zerofn call it
ran in and where that was called (found on the stack), this rank, the world
size and how long it waited; an error that says neither is left as it is.
Issuing and waiting go through ``_handle.named``, which calls it.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from typing import Any

import torch.distributed as dist

from zerofn.collectives._timeouts import TIMEOUT_ENV, is_default

# The package whose frames are the collective itself, not a call that runs one (see _where).
_PACKAGE = __name__.rpartition(".")[0]


class CollectiveError(RuntimeError):
    """A collective failed on this rank because another rank is gone or never joined.

    The message names the collective, the zerofn call it ran in and where
    that was called, this rank, the world size and how long it waited; the
    backend's own error is chained (``__cause__``).

    Attributes:
        call: the collective, the zerofn call it ran in and where that was
            called (``"all_gather (144 bytes) in Step.full_params, called
            from main (train.py:41)"``).
        rank, world_size: this rank and the group's size.
        waited_s: seconds from issuing the collective to the failure.
    """

    def __init__(
        self, message: str, *, call: str = "", rank: Any = None, world_size: Any = None, waited_s: float = 0.0
    ):
        super().__init__(message)
        self.call, self.rank, self.world_size, self.waited_s = call, rank, world_size, waited_s

    __module__ = "zerofn.collectives"  # where users import it from (tracebacks, pickles)

    def __reduce__(self):
        kwargs = dict(call=self.call, rank=self.rank, world_size=self.world_size, waited_s=self.waited_s)
        return (_make_error, (type(self), self.args[0], kwargs))


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective waited ``ZEROFN_TIMEOUT_S`` for a rank that did not join it.

    Both a :class:`CollectiveError` (a ``RuntimeError``, as torch's own error
    was) and a ``TimeoutError``.
    """

    __module__ = "zerofn.collectives"


def _make_error(cls: type, message: str, kwargs: dict) -> CollectiveError:
    return cls(message, **kwargs)


# What init calls the join in its errors ("not every rank joined within that time").
JOIN = "joining the process group"
_SAME_CALLS = (
    "Every rank must make the same collective calls in the same order: step(state, batch), "
    "step.init, step.full_params and step.apply are collective; call them on every rank"
)
# Backend messages that say a peer's connection is gone (gloo), or that this
# rank's group was closed by its own earlier timeout ("pair closure").
_GONE = re.compile(r"closed by peer|reset by peer|pair closure|broken pipe|connection refused|socket closed", re.I)
_TIMED_OUT = re.compile(r"timed? ?out|timeout", re.I)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
# This process's first collective failure, quoted by later ones.
_first_failure: str | None = None


def translate(
    err: RuntimeError,
    what: str,
    started: float,
    *,
    rank,
    world,
    limit: float | None,
    group: Any = None,
    which: str = "",
):
    """The :class:`CollectiveError` for a backend error ``err`` in collective ``what``;
    None when ``err`` is not a timeout or a lost connection (it then goes up unchanged).

    ``limit``: the group's timeout, None for a group zerofn did not create. ``group``: the group it ran
    on (None: the default one), which ``which`` describes after the rank and size.
    """
    global _first_failure
    if isinstance(err, CollectiveError):
        return None
    text = str(err)
    gone, timed_out = bool(_GONE.search(text)), bool(_TIMED_OUT.search(text))
    if not (gone or timed_out or isinstance(err, getattr(dist, "DistError", ()))):
        return None
    waited = time.monotonic() - started
    call = what + _where()
    here = f"on rank {rank} of world size {world}{which} after {waited:.1f} s"
    limit_text = f"{TIMEOUT_ENV}={limit:g} s" if limit is not None else "the process group's timeout"
    if gone:
        earlier = f" Earlier on this rank: {_first_failure}." if _first_failure else ""
        cls, message = (
            CollectiveError,
            (
                f"{call} failed {here}: the connection to another rank is gone. Another rank exited or "
                f"failed (its own error is in its log), or gave up waiting in a collective after "
                f"{limit_text}, as it does when the ranks do not make the same collective calls.{earlier} "
                f"{_SAME_CALLS}."
            ),
        )
        summary = f"{call} lost a peer after {waited:.1f} s"
    elif timed_out:
        joined = "joined within that time" if what == JOIN else "joined it"
        cls, message = (
            CollectiveTimeoutError,
            (
                f"{call} timed out {here} ({limit_text}): not every rank {joined}. {_SAME_CALLS}, "
                f"not under `if rank == 0:`. A rank busy for longer than {TIMEOUT_ENV} (loading data, "
                f"writing a file) looks the same: then raise {TIMEOUT_ENV}."
            ),
        )
        summary = f"{call} timed out after {waited:.1f} s"
    else:
        cls, message = CollectiveError, f"{call} failed {here}."
        summary = f"{call} failed after {waited:.1f} s"
    first_line = _SOURCE_PREFIX.sub("", text.strip().splitlines()[0] if text.strip() else "")
    try:
        backend = dist.get_backend(None if is_default(group) else group) if dist.is_initialized() else None
    except Exception:  # the group is gone
        backend = None
    backend = backend or "torch.distributed"
    message += f" [{backend}: {type(err).__name__}: {first_line[:300]}]"
    if _first_failure is None:
        _first_failure = summary
    return cls(message, call=call, rank=rank, world_size=world, waited_s=waited)


def _where() -> str:
    """Which zerofn call the failing collective ran in, and where the user called it.

    The outermost frame of a zerofn module (the launch machinery aside) is
    the call (``Step.full_params``); the frame above it is the call site.
    A zerofn frame that hides itself from tracebacks (a local
    ``__tracebackhide__``, pytest's convention: a decorator's wrapper, such
    as the one that runs a step's method in its group) is neither.
    """
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        ours = module == "zerofn" or module.startswith("zerofn.")
        if not (ours and "__tracebackhide__" in frame.f_code.co_varnames):
            frames.append((frame, ours and not module.startswith("zerofn.launch")))
        frame = frame.f_back
    entry = caller = None
    for i, (frame, call) in enumerate(frames):
        if call:
            entry, caller = frame, frames[i + 1][0] if i + 1 < len(frames) else None
    if entry is None:
        return ""
    text = ""
    module = entry.f_globals.get("__name__", "")
    if not (module == _PACKAGE or module.startswith(_PACKAGE + ".")):  # a collective called directly
        code = entry.f_code
        name = getattr(code, "co_qualname", None)
        if name is None:  # Python 3.10
            owner = entry.f_locals.get("self")
            name = f"{type(owner).__name__}.{code.co_name}" if owner is not None else code.co_name
        text = f" in {name}"
    if caller is not None:
        path = caller.f_code.co_filename
        with contextlib.suppress(ValueError):  # another drive on Windows
            rel = os.path.relpath(path) if os.path.isabs(path) else path
            path = path if rel.startswith("..") else rel
        text += f", called from {caller.f_code.co_name} ({path}:{caller.f_lineno})"
    return text
