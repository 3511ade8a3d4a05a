"""Error attribution for ``zerofn.launch``: which rank failed first, and how.

A rank either raised (it reported an ``("error", (line, traceback))``
message) or died (its process exited, or its connection closed, without a
report). :class:`Blame` turns either into the :class:`RankError` that names
the cause; the caller stops the ranks.
"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zerofn.launch._links import RankLinks
    from zerofn.launch._procs import RankProcs

# Seconds to look for a dead rank behind another rank's error.
DEATH_GRACE = 0.1
# Seconds a rank whose connection closed gets to exit, for its exit code.
EXIT_WAIT = 5.0


class RankError(RuntimeError):
    """A rank raised, or its process died, while running a function.

    Attributes:
        rank: the rank that failed first.
        exitcode: the process exit code when the rank died without reporting
            (negative: killed by that signal), else ``None``.
        remote_traceback: the rank's formatted traceback when it raised, else
            ``None``. It is also part of the message.
    """

    # Its public home, where tracebacks and pickles name it.
    __module__ = "zerofn.launch"

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exitcode: int | None = None,
        remote_traceback: str | None = None,
    ):
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode
        self.remote_traceback = remote_traceback

    def __reduce__(self):
        kwargs = dict(rank=self.rank, exitcode=self.exitcode, remote_traceback=self.remote_traceback)
        return (_make_rank_error, (self.args[0], kwargs))


def _make_rank_error(message: str, kwargs: dict) -> RankError:
    return RankError(message, **kwargs)


class Blame:
    """Builds the :class:`RankError` for a failed rank of one generation.

    Args:
        procs: the generation's processes (exit codes, pids, deaths).
        links: the generation's connections (reports not read yet).
    """

    def __init__(self, procs: RankProcs, links: RankLinks):
        self.procs = procs
        self.links = links

    def raised(self, rank: int, data, label: str, when: str, *, check_deaths=True) -> RankError:
        """The error for a rank that raised, unless another rank died first.

        When a rank dies, the others fail in their next collective ("Connection
        reset by peer") and may report that before its death shows: the death
        is the cause, so it wins.
        """
        exc_line, tb = data
        if check_deaths:
            n = self.procs.world_size
            dead = self.procs.wait_for_exit([r for r in range(n) if r != rank], DEATH_GRACE)
            if dead:
                err = self.exited(dead[0], label, when or "before reporting a result")
                note = f"\n\nRank {rank} then raised {exc_line}"
                err.args = (err.args[0] + note,)
                return err
        when = f" {when}" if when else ""
        stop = "" if (exc_line + when).rstrip().endswith((".", "!", "?")) else "."  # no ".." after a message's own
        return RankError(
            f"{label}: rank {rank} raised {exc_line}{when}{stop} All {self.procs.world_size} "
            f"ranks were stopped.\n\nTraceback from rank {rank}:\n{tb}",
            rank=rank,
            remote_traceback=tb,
        )

    def exited(self, rank: int, label: str, when: str) -> RankError:
        """The error for a rank whose process exited: what it reported, or its death."""
        reply = self.links.pending(rank)
        if reply is not None and reply[0] == "error":
            return self.raised(rank, reply[1], label, when, check_deaths=False)
        return self.died(rank, label, when)

    def died(self, rank: int, label: str, when: str) -> RankError:
        """The error for a rank that died without reporting, named by its exit code."""
        code = self.procs.exit_code(rank, EXIT_WAIT)
        if code is None:
            how = "closed its connection but did not exit"
        elif code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = f"was killed by {name} (exit code {code})"
        else:
            how = f"exited with exit code {code}"
        hint = ""
        if code == -signal.SIGABRT:
            hint = (
                " gloo aborts a rank whose collective receives data of another size than it "
                'expects ("Is there a distributed collective mismatch in your code?" on '
                "stderr): every rank must make the same collective calls in the same order."
            )
        return RankError(
            f"{label}: rank {rank} (pid {self.procs.pid(rank)}) {how}"
            f"{' ' + when if when else ''}. All {self.procs.world_size} ranks were "
            f"stopped. Its own output, if any, is above on stderr.{hint}",
            rank=rank,
            exitcode=code,
        )
