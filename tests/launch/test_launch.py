"""Tests for zerofn.launch: spawn and RankPool on local gloo ranks (CPU)."""

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from zerofn.launch import RankError, RankPool, spawn

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")


def _proc_stat(pid):
    """(state, ppid) of a process from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def _alive(pid):
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in "ZX"


def _children():
    """Pids of this process's live children."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return {pid for pid in pids if (s := _proc_stat(pid)) and s[1] == os.getpid() and _alive(pid)}


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as p:
        yield p


# A module-level function travels by reference: the rank imports this module.
def _rank_report(x):
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1)
    return {
        "rank": rank,
        "world": world,
        "sum": t.item(),
        "x": x,
        "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")},
        "omp": os.environ["OMP_NUM_THREADS"],
        "cwd": os.getcwd(),
        "f64": base,
        "view": base.t()[1:],  # non-contiguous view of a bigger storage
        "bf16": torch.full((5,), rank + 0.5, dtype=torch.bfloat16),
        "i64": torch.tensor([2**40 + rank]),
        "leaf": torch.ones(2, requires_grad=True),
    }


@pytest.mark.parametrize("world_size", [1, 2, 3], ids=lambda n: f"ws{n}")
def test_spawn_returns_results_in_rank_order(world_size):
    out = spawn(_rank_report, world_size, "arg")
    assert len(out) == world_size
    expected_sum = world_size * (world_size + 1) / 2
    for rank, r in enumerate(out):
        assert r["rank"] == rank and r["world"] == world_size and r["x"] == "arg"
        assert r["sum"] == expected_sum
        assert r["env"] == {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
        }
        assert r["omp"] == os.environ.get("OMP_NUM_THREADS", "1")
        assert r["cwd"] == os.getcwd()
        base = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (rank + 1)
        assert torch.equal(r["f64"], base)
        assert torch.equal(r["view"], base.t()[1:]) and r["view"].shape == (3, 3)
        assert r["bf16"].dtype == torch.bfloat16
        assert torch.equal(r["bf16"], torch.full((5,), rank + 0.5, dtype=torch.bfloat16))
        assert r["i64"].item() == 2**40 + rank
        assert r["leaf"].requires_grad and r["leaf"].is_leaf


def test_closures_and_lambdas(pool):
    offset = torch.tensor([1.0, 2.0])  # a local the closure captures

    def shifted_sum(scale):
        t = offset * scale + dist.get_rank()
        dist.all_reduce(t)
        return t

    out = pool.run(shifted_sum, 3.0)
    expected = offset * 3.0 * 2 + 1  # ranks 0 and 1
    assert all(torch.equal(t, expected) for t in out)
    assert pool.run(lambda k: dist.get_rank() * k, 10) == [0, 10]


def test_pool_reuses_processes_and_restarts_after_failure(pool):
    pids = pool.run(os.getpid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert pool.run(os.getpid) == pids
    assert pool.run(dist.get_world_size) == [2, 2]  # the group stays up

    def fail_on_rank_0():
        if dist.get_rank() == 0:
            raise KeyError("nope")
        return 1

    with pytest.raises(RankError, match="rank 0 raised KeyError: 'nope'"):
        pool.run(fail_on_rank_0)
    assert _wait_gone(pids, 5) == []
    new_pids = pool.run(os.getpid)
    assert set(new_pids).isdisjoint(pids)
    assert pool.run(os.getpid) == new_pids
    assert pool.run(_rank_report, 0)[1]["sum"] == 3.0


@needs_proc
def test_rank_raises_while_other_waits_in_collective():
    before = _children()

    def fn():
        if dist.get_rank() == 1:
            raise ValueError("boom")
        dist.barrier()  # rank 0 would wait here for ever

    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank 1 raised ValueError: boom.*Traceback from rank 1") as info:
        spawn(fn, 2)
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"took {elapsed:.1f} s (includes starting the ranks)"
    err = info.value
    assert isinstance(err, RuntimeError) and err.rank == 1 and err.exitcode is None
    assert "ValueError: boom" in err.remote_traceback and "in fn" in err.remote_traceback
    assert _children() == before


def test_rank_error_after_pool_start_is_fast(pool):
    pool.run(os.getpid)  # ranks up: time only the failure

    def fn():
        if dist.get_rank() == 1:
            raise ValueError("boom")
        t = torch.ones(1)
        dist.all_reduce(t)

    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 raised ValueError: boom"):
        pool.run(fn)
    assert time.monotonic() - start < 3


def test_rank_exit_names_exit_code(pool):
    def fn():
        if dist.get_rank() == 1:
            os._exit(3)
        dist.barrier()

    with pytest.raises(RankError, match=r"rank 1 \(pid \d+\) exited with exit code 3") as info:
        pool.run(fn)
    assert info.value.rank == 1 and info.value.exitcode == 3


def test_rank_killed_by_signal(pool):
    with pytest.raises(RankError, match=r"rank 0 \(pid \d+\) was killed by SIGKILL") as info:
        pool.run(lambda: os.kill(os.getpid(), signal.SIGKILL) if dist.get_rank() == 0 else dist.barrier())
    assert info.value.exitcode == -signal.SIGKILL


def test_timeout_names_unfinished_ranks(pool):
    def fn():
        if dist.get_rank() == 1:
            time.sleep(60)
        return "done"

    pool.run(os.getpid)  # ranks up: time only the run
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] of world size 2 did not finish within 0.5 s"):
        pool.run(fn, timeout=0.5)
    assert time.monotonic() - start < 3
    assert pool.run(lambda: "again") == ["again", "again"]


def test_unpicklable_argument_keeps_pool(pool):
    pids = pool.run(os.getpid)
    with pytest.raises(TypeError, match="must be picklable by cloudpickle"):
        pool.run(len, threading.Lock())
    assert pool.run(os.getpid) == pids


def test_pool_close_is_idempotent_and_leaves_no_processes():
    p = RankPool(1)
    pids = p.run(os.getpid)
    p.close()
    p.close()
    assert p.closed and _wait_gone(pids, 1) == []
    with pytest.raises(ValueError, match="the pool is closed"):
        p.run(os.getpid)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: spawn("fn", 2), TypeError, "fn must be callable"),
        (lambda: spawn(print, 0), ValueError, "world_size must be at least 1"),
        (lambda: spawn(print, 2.0), TypeError, "world_size must be an int"),
        (lambda: spawn(print, 1, timeout=-1), ValueError, "timeout must be positive"),
        (lambda: RankPool(True), TypeError, "world_size must be an int"),
    ],
    ids=["fn", "world_size_zero", "world_size_float", "timeout", "pool_bool"],
)
def test_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_rank_killed_by_sigabrt_hints_at_a_collective_mismatch():
    from zerofn.launch._errors import Blame

    class Procs:  # a rank that gloo aborted (collectives of different sizes)
        world_size = 2

        def exit_code(self, rank, timeout):
            return -signal.SIGABRT

        def pid(self, rank):
            return 1234

    err = Blame(Procs(), links=None).died(1, "spawn(fn, world_size=2)", "")
    assert "rank 1 (pid 1234) was killed by SIGABRT" in str(err)
    assert "every rank must make the same collective calls in the same order" in str(err)


def test_rank_error_pickles():
    err = RankError("msg", rank=2, exitcode=-9, remote_traceback="tb")
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.rank, back.exitcode, back.remote_traceback) == ("msg", 2, -9, "tb")


# Fresh interpreters: code with __main__ functions and no __main__ guard.

_NO_GUARD_SCRIPT = """
import os
import torch
import torch.distributed as dist
from zerofn.launch import RankPool, spawn

def work(x):
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    print(f"hello from rank {dist.get_rank()}", flush=True)
    return x + t.item()

print("results", spawn(work, 2, 100))
pool = RankPool(2)  # left open: closed at exit
print("pids", *pool.run(os.getpid), flush=True)
"""

_DASH_C_PROGRAM = """
import os, signal
import torch.distributed as dist
from zerofn.launch import RankPool, spawn
scale = 3
fn = lambda x: (dist.get_rank() + x) * scale
print("results", spawn(fn, 2, 1))
pool = RankPool(2)
print("pids", *pool.run(os.getpid), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no cleanup at all: ranks must notice
"""


@needs_proc
@pytest.mark.parametrize("mode", ["script_without_guard", "python_dash_c"])
def test_fresh_interpreter_main(mode, tmp_path):
    if mode == "script_without_guard":
        script = tmp_path / "no_guard.py"
        script.write_text(_NO_GUARD_SCRIPT)
        argv, expected = [sys.executable, str(script)], "results [101.0, 101.0]"
    else:
        argv, expected = [sys.executable, "-c", textwrap.dedent(_DASH_C_PROGRAM)], "results [3, 6]"
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    out = proc.stdout
    assert expected in out, (out, proc.stderr)
    assert out.count("results") == 1, "the main program ran again inside a rank"
    if mode == "script_without_guard":
        assert proc.returncode == 0, proc.stderr
        assert "hello from rank 0" in out and "hello from rank 1" in out
        seconds = 0.5  # closed at exit: already gone
    else:
        assert proc.returncode == -signal.SIGKILL
        seconds = 5  # the ranks' parent watch notices within a second
    pids = [int(p) for p in out.split("pids", 1)[1].split()]
    assert len(pids) == 2
    assert _wait_gone(pids, seconds) == [], "rank processes outlived their caller"
