"""Bounded waits: a collective that some rank never joins fails within ZEROFN_TIMEOUT_S
on every rank, naming the call, under zf.spawn and under torchrun.

Each test starts fresh ranks with ZEROFN_TIMEOUT_S=2 in their environment (the
session's shared pools keep the default, and a group that timed out is closed).
"""

from __future__ import annotations

import os
import pathlib
import pickle
import re
import subprocess
import sys
import textwrap
import time

import pytest

import zerofn as zf
from zerofn import collectives as C
from zerofn.collectives import _errors

TESTS = pathlib.Path(__file__).parent.parent
LIMIT = 2.0  # ZEROFN_TIMEOUT_S in these tests
SAME_CALLS = "Every rank must make the same collective calls in the same order"


def test_timeout_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("ZEROFN_TIMEOUT_S", raising=False)
    assert C.timeout_s() == C.DEFAULT_TIMEOUT_S == 600
    monkeypatch.setenv("ZEROFN_TIMEOUT_S", "2.5")
    assert C.timeout_s() == 2.5
    for bad in ("0", "-1", "ten", "inf"):
        monkeypatch.setenv("ZEROFN_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match=f"ZEROFN_TIMEOUT_S='{bad}': expected a positive number"):
            C.timeout_s()


def test_collective_errors_pickle_and_are_runtime_and_timeout_errors():
    err = C.CollectiveTimeoutError("msg", call="barrier", rank=1, world_size=2, waited_s=2.0)
    assert isinstance(err, RuntimeError) and isinstance(err, TimeoutError) and isinstance(err, C.CollectiveError)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is C.CollectiveTimeoutError and str(back) == "msg"
    assert (back.call, back.rank, back.world_size, back.waited_s) == ("barrier", 1, 2, 2.0)


def test_backend_errors_become_errors_that_name_the_call(monkeypatch):
    monkeypatch.setattr(_errors, "_first_failure", None)  # the process's first failure is quoted by later ones
    started = time.monotonic() - 2.0
    gloo = RuntimeError(
        "[/x/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"
    )
    err = _errors.translate(gloo, "all_reduce (8 bytes)", started, rank=1, world=2, limit=2)
    assert type(err) is C.CollectiveTimeoutError and err.call.startswith("all_reduce (8 bytes), called from test_")
    assert re.search(
        r"^all_reduce \(8 bytes\), called from test_backend_errors_become_errors_that_name_the_call "
        r"\(.*test_timeouts\.py:\d+\) timed out on rank 1 of world size 2 after 2\.\d s \(ZEROFN_TIMEOUT_S=2 s\): "
        r"not every rank joined it\. " + SAME_CALLS + r".*\[torch\.distributed: RuntimeError: Timed out waiting 2000ms",
        str(err),
    ), str(err)
    peer = RuntimeError("[/x/pair.cc:553] Connection closed by peer [127.0.0.1]:1234. This is typically caused by ...")
    err = _errors.translate(peer, "barrier", started, rank=0, world=2, limit=2)
    assert type(err) is C.CollectiveError and "failed on rank 0 of world size 2" in str(err)
    assert "the connection to another rank is gone" in str(err) and "Earlier on this rank: all_reduce" in str(err)
    assert (
        _errors.translate(RuntimeError("Tensors must be contiguous"), "barrier", started, rank=0, world=2, limit=2)
        is None
    )


def _sharded_state():
    from helpers import make_mlp
    from zerofn.transforms import shard_params

    _, apply, loss_fn = make_mlp()
    step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(lr=1e-3)))
    return step, step.init(apply.params)


def _rank_mismatched_calls():
    """Rank 0 gathers the full parameters, rank 1 waits in a barrier: neither completes."""
    step, state = _sharded_state()
    C.barrier()  # both ranks enter the mismatched calls together
    start = time.monotonic()
    try:
        if C.rank() == 0:
            step.full_params(state)
        else:
            C.barrier()
    except C.CollectiveError as err:
        return err, time.monotonic() - start, repr(err.__cause__)
    return None


def test_every_rank_raises_naming_its_call_under_spawn(monkeypatch):
    monkeypatch.setenv("ZEROFN_TIMEOUT_S", f"{LIMIT:g}")
    (err0, waited0, cause0), (err1, waited1, cause1) = zf.spawn(_rank_mismatched_calls, 2, timeout=60)
    for rank, err, waited, cause in ((0, err0, waited0, cause0), (1, err1, waited1, cause1)):
        assert isinstance(err, C.CollectiveError) and isinstance(err, RuntimeError)
        assert LIMIT - 0.5 < waited < LIMIT + 5, f"rank {rank} waited {waited:.1f} s"
        assert f"on rank {rank} of world size 2 after" in str(err) and SAME_CALLS in str(err)
        assert "step.full_params and step.apply are collective" in str(err)
        assert "ZEROFN_TIMEOUT_S=2" in str(err)
        assert cause.startswith("RuntimeError(")  # gloo's own error, chained
        assert err.rank == rank and err.world_size == 2
    assert re.match(r"all_gather \([\d,]+ bytes\) in Step\.full_params, called from _rank_mismatched_calls", err0.call)
    assert err1.call.startswith("barrier, called from _rank_mismatched_calls (")
    # The rank whose wait ends first times out; the other sees it leave (or times out too).
    assert any(isinstance(e, C.CollectiveTimeoutError) for e in (err0, err1))
    timed_out = err0 if isinstance(err0, C.CollectiveTimeoutError) else err1
    assert "timed out on rank" in str(timed_out) and "not every rank joined it" in str(timed_out)


def _rank_full_params_on_rank_0_only():
    step, state = _sharded_state()
    if C.rank() == 0:
        step.full_params(state)  # rank 1 never joins
    else:
        time.sleep(60)


def test_full_params_on_one_rank_fails_within_the_timeout_under_spawn(monkeypatch):
    """The issue's case: no ``timeout=``, rank 0 alone calls step.full_params."""
    monkeypatch.setenv("ZEROFN_TIMEOUT_S", f"{LIMIT:g}")
    start = time.monotonic()
    with pytest.raises(zf.RankError) as info:
        zf.spawn(_rank_full_params_on_rank_0_only, 2)
    elapsed = time.monotonic() - start
    assert elapsed < 20, f"took {elapsed:.1f} s (includes starting the ranks)"
    msg = str(info.value)
    assert info.value.rank == 0
    assert re.search(
        r"rank 0 raised CollectiveTimeoutError: all_gather \([\d,]+ bytes\) in Step\.full_params, "
        r"called from _rank_full_params_on_rank_0_only \(.*\) timed out on rank 0 of world size 2 "
        r"after [\d.]+ s \(ZEROFN_TIMEOUT_S=2 s\): not every rank joined it\. " + SAME_CALLS,
        msg,
    ), msg


_TORCHRUN_SCRIPT = """
from zerofn import collectives as C
from test_timeouts import _sharded_state

step, state = _sharded_state()  # joins the group on every rank
C.barrier()
if C.rank() == 0:
    step.full_params(state)  # alone
else:
    C.barrier()  # another collective
"""


def test_torchrun_every_rank_raises_naming_its_call(tmp_path):
    script = tmp_path / "alone.py"
    script.write_text(textwrap.dedent(_TORCHRUN_SCRIPT))
    env = dict(os.environ, ZEROFN_TIMEOUT_S="3", OMP_NUM_THREADS="1")
    here = str(pathlib.Path(__file__).parent)  # this module, which the script imports
    env["PYTHONPATH"] = os.pathsep.join([here, str(TESTS), str(TESTS.parent), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    start = time.monotonic()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    elapsed = time.monotonic() - start
    err = proc.stderr
    assert proc.returncode != 0, err
    assert elapsed < 40, f"took {elapsed:.1f} s (includes torchrun and torch imports)"
    # torchrun's summary lists both workers with a non-zero exit code.
    codes = dict(re.findall(r"rank\s*: (\d) \(local_rank: \d\)\s*\n\s*exitcode\s*: (-?\d+)", err))
    assert codes.keys() == {"0", "1"} and "0" not in codes.values(), err
    assert re.search(
        r"all_gather \([\d,]+ bytes\) in Step\.full_params, called from <module> \(.*alone\.py:\d+\)", err
    ), err
    assert "on rank 0 of world size 2 after" in err and "on rank 1 of world size 2 after" in err, err
    assert "barrier, called from <module>" in err and SAME_CALLS in err, err
    assert "zerofn.collectives.CollectiveTimeoutError" in err, err
