"""Starting, watching and killing the rank processes of ``zerofn.launch``.

:class:`RankProcs` hosts the rendezvous ``TCPStore`` (port 0, so no port
race) and starts each rank as a fresh interpreter with ``subprocess`` running
``python -c`` :data:`BOOTSTRAP`, in its own session (so a kill takes its
children too), with the caller's ``sys.path``, working directory and
stdout/stderr, and the variables ``torchrun`` sets. Where the OS has them
(Linux ``pidfd_open``) it keeps a handle per process that becomes readable
when the process exits; elsewhere callers poll :meth:`RankProcs.exited`.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import wait

from zerofn.launch._links import HOST

# Environment variables that carry the rank's start info and the caller's sys.path.
ENV_INFO = "ZEROFN_LAUNCH_INFO"
ENV_PATH = "ZEROFN_LAUNCH_SYS_PATH"
# The rank entry point: put the caller's sys.path first, then start the loop.
BOOTSTRAP = (
    "import json, os, sys; "
    f"sys.path[:0] = json.loads(os.environ.pop({ENV_PATH!r})); "
    "del json, os, sys; "
    "from zerofn.launch._rank import main; "
    "main()"
)


class RankProcs:
    """The processes of one generation of ranks and the store they meet at.

    Args:
        world_size: number of ranks.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._procs: list[subprocess.Popen] = []
        self._handles: list[int | None] = []
        self._store = None

    def start(self, start_timeout: float, address: tuple[str, int], authkey: bytes) -> None:
        """Host the store and start every rank; each connects back to ``address``."""
        import torch.distributed as dist

        n = self.world_size
        self._store = dist.TCPStore(
            HOST,
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=start_timeout),
            wait_for_workers=False,
        )
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")  # killed ranks lose no prints
        env.update(
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR=HOST,
            MASTER_PORT=str(self._store.port),
        )
        env[ENV_PATH] = json.dumps(sys.path)
        # Our buffered output first, so it is not overtaken by the ranks'.
        flush_std()
        host, port = address
        for rank in range(n):
            info = dict(
                host=host,
                port=port,
                authkey=authkey.hex(),
                rank=rank,
                world_size=n,
                parent_pid=os.getpid(),
                start_timeout=start_timeout,
            )
            env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            env[ENV_INFO] = json.dumps(info)
            proc = subprocess.Popen(
                [sys.executable, "-c", BOOTSTRAP],
                env=env,
                cwd=os.getcwd(),
                start_new_session=os.name == "posix",
            )
            self._procs.append(proc)
            self._handles.append(_process_handle(proc))

    def pid(self, rank: int) -> int:
        return self._procs[rank].pid

    def exited(self, rank: int) -> bool:
        """Whether the process of ``rank`` has exited (reaping it if so)."""
        return self._procs[rank].poll() is not None

    def exit_code(self, rank: int, timeout: float) -> int | None:
        """The exit code of ``rank`` once it exits, or ``None`` after ``timeout`` seconds."""
        try:
            return self._procs[rank].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def exit_handles(self, ranks: list[int]) -> tuple[dict[int, int], list[int]]:
        """Handles of ``ranks`` that become readable on exit (to their rank), and
        the ranks without one, which must be polled."""
        handles = {self._handles[r]: r for r in ranks if self._handles[r] is not None}
        return handles, [r for r in ranks if self._handles[r] is None]

    def wait_for_exit(self, ranks: list[int], timeout: float) -> list[int]:
        """Wait up to ``timeout`` seconds for one of ``ranks`` to exit; those that have."""
        handles, unwatched = self.exit_handles(ranks)
        if unwatched:
            time.sleep(timeout)
        else:
            wait(list(handles), timeout=timeout)
        return [r for r in ranks if self.exited(r)]

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds, in all, for every rank to exit."""
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break

    def kill(self) -> None:
        """Kill every rank (and its process group) now, reap it; idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                try:
                    if os.name == "posix":
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        proc.kill()
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self._procs:
            proc.wait()
        for handle in self._handles:
            if handle is not None:
                os.close(handle)
        self._handles = [None] * len(self._handles)
        self._store = None


def _process_handle(proc: subprocess.Popen) -> int | None:
    """A file descriptor that becomes readable when ``proc`` exits, if the OS has one."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return pidfd_open(proc.pid)
    except OSError:
        return None


def flush_std() -> None:
    """Flush our stdout and stderr, which the ranks share, so outputs keep their order."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
