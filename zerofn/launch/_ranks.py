"""One generation of ranks for ``zerofn.launch``: start, run jobs, stop.

:class:`Ranks` puts the pieces together: :class:`~zerofn.launch._procs.RankProcs`
(the processes), :class:`~zerofn.launch._links.RankLinks` (their connections)
and :class:`~zerofn.launch._errors.Blame` (which rank failed, and how). Every
wait is on the rank messages, the listening socket and the process handles at
once (the socket while some rank has not connected), with a deadline, so a
rank that raises or dies fails the call at once and nothing hangs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import wait

import cloudpickle

from zerofn.launch._errors import Blame, RankError
from zerofn.launch._links import RankLinks
from zerofn.launch._procs import RankProcs, flush_std

# Seconds ranks get to exit cleanly on close before they are killed.
CLOSE_TIMEOUT = 10.0
# Seconds between liveness checks where the OS gives no process handle.
POLL_INTERVAL = 0.1


class Ranks:
    """The processes, connections and store of one generation of ranks.

    Any failure of :meth:`start` or :meth:`run` stops every rank; make a new
    generation to go on.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.procs = RankProcs(world_size)
        self.links = RankLinks(world_size)
        self.blame = Blame(self.procs, self.links)

    @classmethod
    def start(cls, world_size: int, start_timeout: float, label: str) -> Ranks:
        """Start all ranks in parallel and wait until each joined the group."""
        ranks = cls(world_size)
        try:
            ranks.procs.start(start_timeout, ranks.links.address, ranks.links.authkey)
            ranks._gather(
                "ready",
                label,
                when="while starting",
                raised_when="while starting",
                deadline=time.monotonic() + start_timeout,
                too_late=lambda waiting: TimeoutError(
                    f"{label}: ranks {waiting} of world size {world_size} did not start "
                    f"within {start_timeout:g} s (interpreter start, `import torch`, gloo "
                    "rendezvous). All ranks were stopped. On a busy machine pass a "
                    "larger start_timeout to RankPool."
                ),
            )
        except BaseException:
            ranks.kill()
            raise
        return ranks

    def run(self, payload: bytes, timeout: float | None, label: str) -> list:
        """Send one job to every rank and gather the results in rank order."""
        try:
            return self._run(payload, timeout, label)
        except BaseException:
            self.kill()
            raise

    def _run(self, payload: bytes, timeout: float | None, label: str) -> list:
        n = self.world_size
        flush_std()
        for rank in range(n):
            try:
                self.links.send(rank, ("run", payload))
            except OSError:
                raise self.blame.died(rank, label, "before the job reached it") from None
        results = self._gather(
            "ok",
            label,
            when="before reporting a result",
            raised_when="",
            deadline=None if timeout is None else time.monotonic() + timeout,
            too_late=lambda pending: TimeoutError(
                f"{label}: ranks {pending} of world size {n} did not finish within "
                f"{timeout:g} s. All ranks were stopped. Raise the timeout, or look "
                "for a rank stuck in a collective that another rank never reached."
            ),
        )
        out = []
        for rank in range(n):
            try:
                out.append(cloudpickle.loads(results[rank]))
            except Exception as err:
                raise RankError(
                    f"{label}: the result of rank {rank} could not be unpickled here: "
                    f"{type(err).__name__}: {err}. Return tensors and plain data, or "
                    "types importable in this process.",
                    rank=rank,
                ) from err
        return out

    def _gather(
        self,
        expected: str,
        label: str,
        *,
        when: str,
        raised_when: str,
        deadline: float | None,
        too_late: Callable[[list[int]], BaseException],
    ) -> dict:
        """Wait until every rank sent an ``expected`` message; its data by rank.

        Accepts connections while some rank has not connected. Raises the
        :class:`RankError` of the first rank that raised or died (``when`` and
        ``raised_when`` say when, in its message), or ``too_late(pending)`` at
        ``deadline``.
        """
        got: dict = {}
        while len(got) < self.world_size:
            pending = [r for r in range(self.world_size) if r not in got]
            events = self._wait(pending, deadline)
            if events is None:
                raise too_late(pending)
            for kind, rank in events:
                if kind == "accept":
                    self.links.accept(label)
                elif rank in got:
                    continue
                elif kind == "message":
                    reply, data = self._recv(rank, label, when)
                    if reply != expected:
                        raise self.blame.raised(rank, data, label, raised_when)
                    got[rank] = data
                elif self.procs.exited(rank):
                    raise self.blame.exited(rank, label, when)
        return got

    def _wait(self, ranks: list[int], deadline: float | None) -> list[tuple] | None:
        """Wait for a message from or the exit of one of ``ranks``, or a new connection.

        Returns ``(kind, rank)`` events: ``"message"`` ones first (a rank that
        reported and then died has reported), then ``("accept", None)``, then
        ``"exit"`` ones; ``None`` once ``deadline`` passed with nothing ready.
        """
        conns = self.links.connections(ranks)
        listening = self.links.listening
        handles, unwatched = self.procs.exit_handles(ranks)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = remaining
        if unwatched:
            step = POLL_INTERVAL if remaining is None else min(remaining, POLL_INTERVAL)
        objs = [*conns, *handles] + ([listening] if listening is not None else [])
        ready = wait(objs, timeout=step)
        events: list[tuple] = [("message", conns[o]) for o in ready if o in conns]
        if listening is not None and listening in ready:
            events.append(("accept", None))
        events += [("exit", handles[o]) for o in ready if o in handles]
        events += [("exit", r) for r in unwatched if self.procs.exited(r)]
        if not events and deadline is not None and time.monotonic() >= deadline:
            return None
        return events

    def _recv(self, rank: int, label: str, when: str):
        try:
            return self.links.recv(rank)
        except (EOFError, OSError):
            raise self.blame.died(rank, label, when) from None

    def close(self) -> None:
        """Ask the ranks to exit, then kill those that do not."""
        self.links.send_all(("close", None))
        self.procs.join(CLOSE_TIMEOUT)
        self.kill()

    def kill(self) -> None:
        """Kill every rank now and close the connections; idempotent."""
        self.procs.kill()
        self.links.close()
