"""The rank side of ``zerofn.launch``: what each rank process runs.

:data:`zerofn.launch._procs.BOOTSTRAP` calls :func:`main`, which connects back to
the caller, joins the gloo process group (each collective bounded by
``ZEROFN_TIMEOUT_S``, read here from the environment the rank inherits from
the caller) and then runs the jobs it is sent until it is told to close (or
the caller goes away).
"""

from __future__ import annotations

import atexit
import datetime
import json
import os
import sys
import threading
import time
import traceback
from multiprocessing.connection import Client

import cloudpickle

from zerofn.launch._procs import ENV_INFO, flush_std


def main() -> None:
    """Entry point of a rank process: connect, join the group, run jobs until closed."""
    info = json.loads(os.environ.pop(ENV_INFO))
    seen: set[str] = set()
    sys.path[:] = [p for p in sys.path if not (p in seen or seen.add(p))]
    rank, world_size = info["rank"], info["world_size"]
    conn = Client((info["host"], info["port"]), authkey=bytes.fromhex(info["authkey"]))
    _watch_parent(info["parent_pid"])
    conn.send(("hello", rank))
    try:
        import torch.distributed as dist

        from zerofn import collectives

        timeout = collectives.timeout_s()  # ZEROFN_TIMEOUT_S, from the caller's environment
        start = datetime.timedelta(seconds=info["start_timeout"])
        store = dist.TCPStore(info["host"], int(os.environ["MASTER_PORT"]), world_size, False, timeout=start)
        # Join with the start timeout (interpreters start unevenly), then bound
        # each collective's wait by ZEROFN_TIMEOUT_S.
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=start)
        collectives.set_group_timeout(timeout)
    except BaseException as exc:
        conn.send(("error", (_exc_line(exc), traceback.format_exc())))
        flush_std()
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
        flush_std()
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
    flush_std()
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
