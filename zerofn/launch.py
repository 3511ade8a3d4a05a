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
  authkey. The caller waits on those connections and on process handles at
  once, so a rank that raises or dies fails the call at once (all ranks are
  killed; the others may be stuck in a collective) and nothing hangs.
- Rank stdout and stderr are the caller's, so prints from ranks show up.

This module and ``collectives.py`` are the only ones that touch
``torch.distributed``: here only to start the process group.
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener, wait
from typing import Any, Callable

import cloudpickle

__all__ = ["RankError", "RankPool", "spawn"]

_HOST = "127.0.0.1"
# Seconds a rank may take to start: interpreter, `import torch`, rendezvous.
_START_TIMEOUT = 120.0
# Seconds ranks get to exit cleanly on close before they are killed.
_CLOSE_TIMEOUT = 10.0
# Collective timeout of the process group (torch's default for gloo).
_PG_TIMEOUT = datetime.timedelta(minutes=30)
# Seconds to look for a dead rank behind another rank's error.
_DEATH_GRACE = 0.1
# Seconds between liveness checks where the OS gives no process handle.
_POLL_INTERVAL = 0.1

_ENV_INFO = "ZEROFN_LAUNCH_INFO"
_ENV_PATH = "ZEROFN_LAUNCH_SYS_PATH"
# The rank entry point: put the caller's sys.path first, then start the loop.
_BOOTSTRAP = (
    "import json, os, sys; "
    f"sys.path[:0] = json.loads(os.environ.pop({_ENV_PATH!r})); "
    "del json, os, sys; "
    "from zerofn.launch import _child_main; "
    "_child_main()"
)


class RankError(RuntimeError):
    """A rank raised, or its process died, while running a function.

    Attributes:
        rank: the rank that failed first.
        exitcode: the process exit code when the rank died without reporting
            (negative: killed by that signal), else ``None``.
        remote_traceback: the rank's formatted traceback when it raised, else
            ``None``. It is also part of the message.
    """

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
        kwargs = dict(
            rank=self.rank, exitcode=self.exitcode, remote_traceback=self.remote_traceback
        )
        return (_make_rank_error, (self.args[0], kwargs))


def _make_rank_error(message: str, kwargs: dict) -> RankError:
    return RankError(message, **kwargs)


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
            ``None`` for no limit.

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
    closed when garbage collected and at interpreter exit.

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

    def _ensure_started(self, label: str) -> _Ranks:
        if self.closed:
            raise ValueError(f"{label}: the pool is closed. Make a new RankPool.")
        if self._box.ranks is None:
            self._box.ranks = _Ranks.start(self.world_size, self._start_timeout, label)
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
        self.ranks: _Ranks | None = None

    def close(self) -> None:
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.close()

    def kill(self) -> None:
        ranks, self.ranks = self.ranks, None
        if ranks is not None:
            ranks.kill()


class _Ranks:
    """One generation of rank processes, their connections and the store."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection | None] = [None] * world_size
        self.sentinels: list[int | None] = []
        self.store = None
        self.listener: Listener | None = None

    @classmethod
    def start(cls, world_size: int, start_timeout: float, label: str) -> _Ranks:
        """Start all ranks in parallel and wait until each joined the group."""
        ranks = cls(world_size)
        try:
            ranks._start(start_timeout, label)
        except BaseException:
            ranks.kill()
            raise
        return ranks

    def _start(self, start_timeout: float, label: str) -> None:
        import torch.distributed as dist

        n = self.world_size
        self.store = dist.TCPStore(
            _HOST,
            0,
            None,
            True,
            timeout=datetime.timedelta(seconds=start_timeout),
            wait_for_workers=False,
        )
        authkey = os.urandom(32)
        self.listener = Listener((_HOST, 0), backlog=max(n, 8), authkey=authkey)
        host, port = self.listener.address
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", "1")
        env.setdefault("PYTHONUNBUFFERED", "1")  # killed ranks lose no prints
        env.update(
            WORLD_SIZE=str(n),
            LOCAL_WORLD_SIZE=str(n),
            MASTER_ADDR=_HOST,
            MASTER_PORT=str(self.store.port),
        )
        env[_ENV_PATH] = json.dumps(sys.path)
        # Our buffered output first, so it is not overtaken by the ranks'.
        _flush_std()
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
            env[_ENV_INFO] = json.dumps(info)
            proc = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP],
                env=env,
                cwd=os.getcwd(),
                start_new_session=os.name == "posix",
            )
            self.procs.append(proc)
            self.sentinels.append(_process_handle(proc))

        # The listening socket, so accepting waits alongside the process
        # handles: a rank that dies before connecting must not hang us.
        listen_socket = self.listener._listener._socket
        deadline = time.monotonic() + start_timeout
        ready: set[int] = set()
        while len(ready) < n:
            waiting = [r for r in range(n) if r not in ready]
            objs: list = [listen_socket] if None in self.conns else []
            objs += [self.conns[r] for r in waiting if self.conns[r] is not None]
            got = self._wait_step(objs, waiting, deadline)
            if got == "timeout":
                raise TimeoutError(
                    f"{label}: ranks {waiting} of world size {n} did not start within "
                    f"{start_timeout:g} s (interpreter start, `import torch`, gloo "
                    "rendezvous). All ranks were stopped. On a busy machine pass a "
                    "larger start_timeout to RankPool."
                )
            for obj in got:
                if obj is listen_socket:
                    self._accept(label)
                    continue
                rank = self._rank_of(obj)
                if rank in ready:
                    continue
                if isinstance(obj, Connection):
                    kind, data = self._recv(rank, label, "while starting")
                    if kind != "ready":
                        raise self._error(rank, data, label, "while starting")
                    ready.add(rank)
                elif self.procs[rank].poll() is not None:
                    raise self._dead_or_reported(rank, label, "while starting")

    def _wait_step(self, objs: list, r_list: list[int], deadline: float | None):
        """Wait on ``objs`` and the process handles of ``r_list``.

        Returns the ready objects (process handles as ints, or the rank's
        index as a ``_Dead`` marker where there is no handle), or "timeout".
        """
        handles = [self.sentinels[r] for r in r_list if self.sentinels[r] is not None]
        polling = len(handles) < len(r_list)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        step = remaining
        if polling:
            step = _POLL_INTERVAL if remaining is None else min(remaining, _POLL_INTERVAL)
        ready = wait(objs + handles, timeout=step)
        if polling:
            ready += [
                _Dead(r)
                for r in r_list
                if self.sentinels[r] is None and self.procs[r].poll() is not None
            ]
        if not ready and deadline is not None and time.monotonic() >= deadline:
            return "timeout"
        # Messages before deaths: a rank that reported and then died has
        # reported.
        return sorted(ready, key=lambda o: not isinstance(o, Connection))

    def _rank_of(self, obj) -> int:
        if isinstance(obj, _Dead):
            return obj.rank
        if isinstance(obj, Connection):
            return self.conns.index(obj)
        return self.sentinels.index(obj)

    def _accept(self, label: str) -> None:
        try:
            conn = self.listener.accept()
        except (AuthenticationError, EOFError, OSError):
            return  # a stranger on the port, or a rank that died mid-handshake
        try:
            kind, rank = conn.recv()
        except (EOFError, OSError):
            conn.close()
            return  # its death shows on its process handle
        if kind != "hello" or not 0 <= rank < self.world_size or self.conns[rank] is not None:
            conn.close()
            raise RuntimeError(f"{label}: unexpected greeting {kind!r} from rank {rank!r}.")
        self.conns[rank] = conn

    def _recv(self, rank: int, label: str, when: str):
        try:
            return self.conns[rank].recv()
        except (EOFError, OSError):
            raise self._death(rank, label, when) from None

    def run(self, payload: bytes, timeout: float | None, label: str) -> list:
        """Send one job to every rank and gather the results in rank order."""
        n = self.world_size
        _flush_std()
        for rank in range(n):
            try:
                self.conns[rank].send(("run", payload))
            except OSError:
                raise self._death(rank, label, "before the job reached it") from None
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict[int, bytes] = {}
        while len(results) < n:
            pending = [r for r in range(n) if r not in results]
            ready = self._wait_step([self.conns[r] for r in pending], pending, deadline)
            if ready == "timeout":
                raise TimeoutError(
                    f"{label}: ranks {pending} of world size {n} did not finish within "
                    f"{timeout:g} s. All ranks were stopped. Raise the timeout, or look "
                    "for a rank stuck in a collective that another rank never reached."
                )
            for obj in ready:
                rank = self._rank_of(obj)
                if rank in results:
                    continue
                if isinstance(obj, Connection):
                    kind, data = self._recv(rank, label, "before reporting a result")
                    if kind != "ok":
                        raise self._error(rank, data, label, "")
                    results[rank] = data
                elif self.procs[rank].poll() is not None:
                    raise self._dead_or_reported(rank, label, "before reporting a result")
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

    def _pending_error(self, rank: int):
        """The error a rank reported but we have not read yet, else ``None``."""
        conn = self.conns[rank]
        try:
            if conn is None or not conn.poll():
                return None
            kind, data = conn.recv()
        except (EOFError, OSError):
            return None
        return data if kind == "error" else None

    def _dead_ranks(self, exclude: int) -> list[int]:
        """Ranks other than ``exclude`` whose process has exited, after a short grace."""
        others = [r for r in range(self.world_size) if r != exclude]
        handles = [self.sentinels[r] for r in others if self.sentinels[r] is not None]
        if len(handles) == len(others):
            wait(handles, timeout=_DEATH_GRACE)
        else:
            time.sleep(_DEATH_GRACE)
        return [r for r in others if self.procs[r].poll() is not None]

    def _dead_or_reported(self, rank: int, label: str, when: str) -> RankError:
        """The error for a rank whose process exited: what it reported, or its death."""
        data = self._pending_error(rank)
        if data is not None:
            return self._error(rank, data, label, when, check_deaths=False)
        return self._death(rank, label, when)

    def _error(self, rank: int, data, label: str, when: str, *, check_deaths=True) -> RankError:
        """The error for a rank that raised, unless another rank died first.

        When a rank dies, the others fail in their next collective ("Connection
        reset by peer") and may report that before its death shows: the death
        is the cause, so it wins.
        """
        exc_line, tb = data
        if check_deaths:
            dead = self._dead_ranks(exclude=rank)
            if dead:
                err = self._dead_or_reported(dead[0], label, when or "before reporting a result")
                note = f"\n\nRank {rank} then raised {exc_line}"
                err.args = (err.args[0] + note,)
                return err
        self.kill()
        when = f" {when}" if when else ""
        return RankError(
            f"{label}: rank {rank} raised {exc_line}{when}. All {self.world_size} "
            f"ranks were stopped.\n\nTraceback from rank {rank}:\n{tb}",
            rank=rank,
            remote_traceback=tb,
        )

    def _death(self, rank: int, label: str, when: str) -> RankError:
        proc = self.procs[rank]
        try:
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self.kill()
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
        return RankError(
            f"{label}: rank {rank} (pid {proc.pid}) {how}{' ' + when if when else ''}. All "
            f"{self.world_size} ranks were stopped. Its own output, if any, is above "
            "on stderr.",
            rank=rank,
            exitcode=code,
        )

    def close(self) -> None:
        """Ask the ranks to exit, then kill those that do not."""
        for conn in self.conns:
            if conn is not None:
                try:
                    conn.send(("close", None))
                except OSError:
                    pass
        deadline = time.monotonic() + _CLOSE_TIMEOUT
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        self.kill()

    def kill(self) -> None:
        """Kill every rank (and its process group) now; idempotent."""
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    if os.name == "posix":
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        proc.kill()
                except (ProcessLookupError, PermissionError):
                    pass
        for proc in self.procs:
            proc.wait()
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.conns = [None] * self.world_size
        for handle in self.sentinels:
            if handle is not None:
                os.close(handle)
        self.sentinels = [None] * len(self.sentinels)
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        self.store = None


class _Dead:
    """Marks a rank found dead by polling (no OS process handle)."""

    def __init__(self, rank: int):
        self.rank = rank


def _process_handle(proc: subprocess.Popen) -> int | None:
    """A file descriptor that becomes readable when ``proc`` exits, if the OS has one."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        return pidfd_open(proc.pid)
    except OSError:
        return None


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass


def _fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _check_fn(fn, where: str) -> None:
    if not callable(fn):
        raise TypeError(
            f"{where}: fn must be callable, got {type(fn).__name__} {fn!r}. "
            f"Pass the function first: {where}(fn, ...)."
        )


def _check_world_size(world_size, where: str) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(
            f"{where}: world_size must be an int, got {type(world_size).__name__} "
            f"{world_size!r}."
        )
    if world_size < 1:
        raise ValueError(f"{where}: world_size must be at least 1, got {world_size}.")


def _check_timeout(timeout, where: str, name: str = "timeout") -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"{where}: {name} must be a number of seconds or None, got "
            f"{type(timeout).__name__} {timeout!r}."
        )
    if not timeout > 0:
        raise ValueError(f"{where}: {name} must be positive seconds or None, got {timeout}.")


# --------------------------------------------------------------------------
# Rank side.


def _child_main() -> None:
    """Entry point of a rank process: connect, join the group, run jobs until closed."""
    info = json.loads(os.environ.pop(_ENV_INFO))
    seen: set[str] = set()
    sys.path[:] = [p for p in sys.path if not (p in seen or seen.add(p))]
    rank, world_size = info["rank"], info["world_size"]
    conn = Client((info["host"], info["port"]), authkey=bytes.fromhex(info["authkey"]))
    _watch_parent(info["parent_pid"])
    conn.send(("hello", rank))
    try:
        import torch.distributed as dist

        store = dist.TCPStore(
            info["host"],
            int(os.environ["MASTER_PORT"]),
            world_size,
            False,
            timeout=datetime.timedelta(seconds=info["start_timeout"]),
        )
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=_PG_TIMEOUT
        )
    except BaseException as exc:
        conn.send(("error", (_exc_line(exc), traceback.format_exc())))
        _flush_std()
        return
    conn.send(("ready", None))
    while True:
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):
            break
        if kind == "close":
            break
        try:
            fn, args = cloudpickle.loads(payload)
            reply = ("ok", cloudpickle.dumps(fn(*args)))
        except BaseException as exc:
            reply = ("error", (_exc_line(exc), traceback.format_exc()))
        _flush_std()
        conn.send(reply)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    conn.close()
    # Run atexit handlers, then skip the rest of interpreter teardown: with
    # torch loaded it takes about a second, and close() waits for it.
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is not None:
        run_exitfuncs()
    _flush_std()
    os._exit(0)


def _exc_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _watch_parent(parent_pid: int) -> None:
    """Exit this rank if the caller dies, so no orphan outlives it."""

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="zerofn-parent-watch", daemon=True).start()
