"""Run a function on local gloo ranks: ``spawn`` for one call, ``RankPool`` for many.

``spawn(fn, world_size, *args)`` starts ``world_size`` fresh Python
interpreters, joins them in a ``torch.distributed`` gloo default process group,
calls ``fn(*args)`` on each and returns the per-rank results, rank 0 first.
``RankPool`` keeps the ranks (and their process group) alive across calls, so
tests pay the interpreter and ``import torch`` cost once.

How it works, and why:

- Ranks are fresh interpreters started with ``subprocess`` running
  ``python -c``, never ``multiprocessing``'s spawn, which re-imports the main
  script. So ``spawn`` works from a script without an
  ``if __name__ == "__main__"`` guard, from ``python -c`` and from notebooks.
- ``fn`` and ``args`` travel as cloudpickle bytes. cloudpickle pickles
  functions from ``__main__`` (and closures, lambdas) by value; importable
  functions go by reference and are imported in the rank, which gets the
  caller's ``sys.path`` and working directory.
- Rendezvous has no port race: the caller hosts a ``TCPStore`` on port 0
  (the OS picks a free port) and every rank connects to it as a client.
  Ranks also see the variables ``torchrun`` sets (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) and
  ``OMP_NUM_THREADS=1`` unless it is already set.
- Messages go over ``multiprocessing.connection`` on 127.0.0.1 with a random
  authkey. The caller owns the listening socket (port 0 again) and waits on
  it, on the rank connections and on the process handles at once, so a rank
  that raises or dies, even before it connects, fails the call at once (all
  ranks are killed; the others may be stuck in a collective) and nothing
  hangs.
- Rank stdout and stderr are the caller's, so prints from ranks show up.
- Each collective waits at most ``ZEROFN_TIMEOUT_S`` seconds (default 600)
  for the other ranks: the ranks join the group with the start timeout, then
  set that bound, read from the environment they inherit from the caller. A
  collective that one rank never joins (rank 0 alone calling
  ``step.full_params``) raises ``zerofn.collectives.CollectiveTimeoutError``,
  naming the call, on the rank that waits, and the call fails with the
  ``RankError`` of that rank. It bounds one collective's wait, not a call:
  ``timeout=`` does that.

This package's ``__init__`` holds the public API; ``cli`` is the torchrun
front (``python -m zerofn run``). One generation of ranks is
``_ranks.Ranks``, built from ``_procs`` (start, watch and kill the
processes), ``_links`` (listening socket, handshake, messages) and
``_errors`` (``RankError``, and which rank failed and how); ``_rank`` is
what each rank runs (``python -c`` imports ``zerofn.launch._rank``). With
``zerofn.collectives`` they are the only modules that touch
``torch.distributed``, and only to host the store (``_procs``) and start
the process group (``_rank``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import cloudpickle

from zerofn.launch._errors import RankError
from zerofn.launch._ranks import Ranks

__all__ = ["RankError", "RankPool", "spawn"]

# Seconds a rank may take to start: interpreter, `import torch`, rendezvous.
_START_TIMEOUT = 120.0


def spawn(fn: Callable[..., Any], world_size: int, /, *args: Any, timeout: float | None = None) -> list:
    """Run ``fn(*args)`` on ``world_size`` local gloo ranks and return their results.

    Each rank is a fresh interpreter in one ``torch.distributed`` default
    process group, so ``dist.get_rank()``, ``dist.all_reduce`` and friends
    work inside ``fn``. This is a one-shot :class:`RankPool`; use the pool to
    run several functions on the same processes.

    Args:
        fn: the function to run on every rank. Anything cloudpickle can
            pickle: functions defined in ``__main__``, closures and lambdas
            travel by value; importable functions are imported in the rank.
        world_size: number of ranks, at least 1.
        *args: positional arguments for ``fn``, pickled with cloudpickle and
            identical on every rank.
        timeout: seconds ``fn`` may run, counted from when the ranks are up;
            ``None`` for no limit. Without it, a collective that some rank
            never joins still fails after ``ZEROFN_TIMEOUT_S`` (default
            600 s; set it in the environment before calling).

    Returns:
        The list of ``fn``'s return values, rank 0 first (tensors included).

    Raises:
        RankError: a rank raised (the message holds its traceback) or its
            process died; all ranks are stopped.
        TimeoutError: ``fn`` ran past ``timeout`` on some rank; the message
            names those ranks, and all ranks are stopped.
        TypeError, ValueError: bad ``fn``, ``world_size`` or ``timeout``.

    Example:
        >>> import torch, torch.distributed as dist
        >>> def total(x):
        ...     t = torch.tensor([x * (dist.get_rank() + 1.0)])
        ...     dist.all_reduce(t)
        ...     return t.item()
        >>> spawn(total, 2, 10)
        [30.0, 30.0]
    """
    _check_fn(fn, "spawn")
    _check_world_size(world_size, "spawn")
    _check_timeout(timeout, "spawn")
    label = f"spawn({_fn_name(fn)}, world_size={world_size})"
    pool = RankPool._create(world_size, label)
    try:
        return pool._run(fn, args, timeout, label)
    finally:
        pool.close()


class RankPool:
    """A set of live local gloo ranks that run one function after another.

    The ranks start (in parallel) when the pool is made and keep their
    process group between runs. After a failed run (a rank raised, died or
    timed out) every rank is killed and fresh ones start on the next
    :meth:`run`. Close it with :meth:`close` or a ``with`` block; it is also
    closed when garbage collected and at interpreter exit. Each collective
    waits at most ``ZEROFN_TIMEOUT_S`` (default 600 s), as set in the
    environment when the ranks start.

    Args:
        world_size: number of ranks, at least 1.
        start_timeout: seconds the ranks may take to start and join the
            process group.

    Attributes:
        world_size: the number of ranks.

    Raises:
        RankError: a rank died or raised while starting.
        TimeoutError: the ranks did not start within ``start_timeout``.

    Example:
        >>> import os
        >>> with RankPool(2) as pool:
        ...     first = pool.run(os.getpid)
        ...     assert pool.run(os.getpid) == first   # same processes
    """

    def __init__(self, world_size: int, /, *, start_timeout: float = _START_TIMEOUT):
        _check_world_size(world_size, "RankPool")
        _check_timeout(start_timeout, "RankPool", name="start_timeout")
        self._setup(world_size, start_timeout, f"RankPool({world_size})")

    @classmethod
    def _create(cls, world_size: int, label: str) -> RankPool:
        """A started pool whose start errors are labelled ``label`` (for spawn)."""
        pool = cls.__new__(cls)
        pool._setup(world_size, _START_TIMEOUT, label)
        return pool

    def _setup(self, world_size: int, start_timeout: float, label: str) -> None:
        self.world_size = world_size
        self._start_timeout = start_timeout
        self._lock = threading.Lock()
        self._box = _Box()
        # Closes the ranks on garbage collection and at exit, without
        # keeping the pool itself alive.
        self._finalizer = weakref.finalize(self, _Box.close, self._box)
        with self._lock:
            self._ensure_started(label)

    def run(self, fn: Callable[..., Any], /, *args: Any, timeout: float | None = None) -> list:
        """Run ``fn(*args)`` on every rank of the pool and return their results.

        Args:
            fn: the function to run; see :func:`spawn`.
            *args: positional arguments for ``fn``, the same on every rank.
            timeout: seconds ``fn`` may run; ``None`` for no limit.

        Returns:
            The list of ``fn``'s return values, rank 0 first.

        Raises:
            RankError: a rank raised or died. The pool restarts on the next run.
            TimeoutError: ``fn`` ran past ``timeout``. The pool restarts on
                the next run.
            ValueError: the pool is closed.

        Example:
            >>> import torch.distributed as dist
            >>> with RankPool(2) as pool:
            ...     pool.run(dist.get_rank)
            [0, 1]
        """
        _check_fn(fn, "RankPool.run")
        _check_timeout(timeout, "RankPool.run")
        label = f"RankPool({self.world_size}).run({_fn_name(fn)})"
        return self._run(fn, args, timeout, label)

    def close(self) -> None:
        """Stop all ranks. Idempotent; the pool cannot run afterwards."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return not self._finalizer.alive

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running" if self._box.ranks else "idle"
        return f"RankPool({self.world_size}, {state})"

    def _ensure_started(self, label: str) -> Ranks:
        if self.closed:
            raise ValueError(f"{label}: the pool is closed. Make a new RankPool.")
        if self._box.ranks is None:
            self._box.ranks = Ranks.start(self.world_size, self._start_timeout, label)
        return self._box.ranks

    def _run(self, fn, args, timeout, label) -> list:
        try:
            payload = cloudpickle.dumps((fn, args))
        except Exception as err:
            raise TypeError(
                f"{label}: fn and its args must be picklable by cloudpickle to reach "
                f"the ranks, but pickling failed with {type(err).__name__}: {err}. "
                "Pass tensors and plain data as args, and build unpicklable objects "
                "(locks, open files, process groups) inside fn."
            ) from err
        with self._lock:
            ranks = self._ensure_started(label)
            try:
                return ranks.run(payload, timeout, label)
            except BaseException:
                # Any failure (including KeyboardInterrupt) leaves ranks in an
                # unknown state, maybe stuck in a collective: start afresh.
                self._box.kill()
                raise


class _Box:
    """The pool's current ranks, kept apart from the pool for its finalizer."""

    def __init__(self):
        self.ranks: Ranks | None = None

    def close(self) -> None:
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.close()

    def kill(self) -> None:
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.kill()


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _check_fn(fn, where: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"{where}: fn must be callable, got {type(fn).__name__} {fn!r}. Pass the function first: {where}(fn, ...)."
        )


def _check_world_size(world_size, where: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"{where}: world_size must be an int, got {type(world_size).__name__} {world_size!r}.")
    if world_size < 1:
        raise ValueError(f"{where}: world_size must be at least 1, got {world_size}.")


def _check_timeout(timeout, where: str, name: str = "timeout") -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"{where}: {name} must be a number of seconds or None, got {type(timeout).__name__} {timeout!r}."
        )
    if not timeout > 0:
        raise ValueError(f"{where}: {name} must be positive seconds or None, got {timeout}.")
