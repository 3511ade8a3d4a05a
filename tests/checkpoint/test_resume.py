"""The GPT example checkpoints and resumes: a run killed mid-way and restarted by torchrun, or stopped and
started again, ends with the very parameters (bit for bit) of a run that never stopped."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import torch
from test_examples import ROOT

SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
SMALL = ["--steps", "12", "--dim", "32", "--layers", "1", "--seq-len", "16", "--batch", "8"]
# ZEROFN_TIMEOUT_S: a rank that hangs instead of failing fails the test in a minute, not after 600 s.
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: by default torchrun's restarted workers share the first attempt's
# TCPStore, where gloo finds the dead workers' addresses and fails to connect about half the time
# (pytorch/pytorch#135712); with it, each attempt gets a fresh store.
ENV = dict(os.environ, OMP_NUM_THREADS="1", ZEROFN_TIMEOUT_S="60", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
ENV.pop("TORCHELASTIC_RESTART_COUNT", None)  # every launch below starts on its first attempt


def _run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=cwd, env=ENV)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _torchrun(args: list[str], cwd, *launcher: str) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *launcher]
    return _run([*launch, SCRIPT, *args], cwd)


def _python(args: list[str], cwd) -> subprocess.CompletedProcess:
    return _run([sys.executable, SCRIPT, *args], cwd)


def _assert_same_params(a_path, b_path) -> None:
    a, b = torch.load(a_path), torch.load(b_path)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ from the uninterrupted run: {differ}"


def _checkpoints(directory) -> list[str]:
    return sorted(p for p in os.listdir(directory) if re.fullmatch(r"step_\d{6}", p))


def test_torchrun_restart_after_a_killed_rank_resumes_to_the_same_params(tmp_path):
    args = [*SMALL, "--zero", "3"]
    _torchrun([*args, "--quiet", "--out", str(tmp_path / "straight.pt")], tmp_path)

    ckpt = tmp_path / "ckpt"
    # Rank 1 dies (SIGKILL) after step 10, on the first attempt only: the save of step 4 is surely
    # committed by then (the save of step 8 waits for it), the one of step 8 maybe not.
    resume = [*args, "--ckpt-dir", str(ckpt), "--save-every", "4", "--die-at-step", "10"]
    proc = _torchrun([*resume, "--out", str(tmp_path / "resumed.pt")], tmp_path, "--max-restarts=1")
    assert "exitcode: -9" in proc.stderr, proc.stderr[-5000:]  # the kill happened
    assert re.search(r"resumed from \S*step_0000(04|08) at step (4|8)\n", proc.stdout), proc.stdout
    # the restarted attempt's progress bar started at the resumed step and ran to the end
    assert re.search(r"train: 100%\|\S*\| 12/12 \[", proc.stderr), proc.stderr[-3000:]
    _assert_same_params(tmp_path / "resumed.pt", tmp_path / "straight.pt")
    assert _checkpoints(ckpt) == ["step_000008", "step_000012"]  # --keep 2, and the last step saved


def test_stopped_run_started_again_with_more_steps_matches_one_run(tmp_path):
    _python([*SMALL, "--quiet", "--out", str(tmp_path / "straight.pt")], tmp_path)

    ckpt = tmp_path / "ckpt"
    # The first part stops at step 6 on the whole run's learning-rate schedule (12 steps).
    part = [*SMALL, "--ckpt-dir", str(ckpt), "--save-every", "4"]
    _python([*part, "--quiet", "--steps", "6", "--schedule-steps", "12"], tmp_path)
    assert _checkpoints(ckpt) == ["step_000004", "step_000006"]
    proc = _python([*part, "--out", str(tmp_path / "resumed.pt")], tmp_path)
    assert re.search(r"resumed from \S*step_000006 at step 6\n", proc.stdout), proc.stdout
    _assert_same_params(tmp_path / "resumed.pt", tmp_path / "straight.pt")

    # Started once more, it finds the run complete: nothing to train, the same parameters.
    proc = _python([*part, "--out", str(tmp_path / "again.pt")], tmp_path)
    assert "resumed from" in proc.stdout and "at step 12" in proc.stdout, proc.stdout
    _assert_same_params(tmp_path / "again.pt", tmp_path / "straight.pt")
