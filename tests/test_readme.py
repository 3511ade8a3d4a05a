"""The README's "In one screen" block runs as it stands, on one process and on two ranks under torchrun,
and a second run resumes from the checkpoints the first one left; and with each of its commented-out
transforms switched on, one at a time, to its last line (the held-out loss on step.full_params)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from test_examples import ROOT

ENV = dict(os.environ, OMP_NUM_THREADS="1", ZEROFN_TIMEOUT_S="60")


def _block() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## In one screen") :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(argv, cwd) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=cwd, env=ENV)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _loss(out: str) -> float:
    return float(re.search(r"held-out loss ([\d.]+)", out).group(1))


def test_the_readme_block_runs_alone_and_under_torchrun(tmp_path):
    (tmp_path / "train.py").write_text(_block())
    alone = _run([sys.executable, "train.py"], tmp_path)
    assert "TrainState(shard_optimizer(train_step), world_size=1, count=100" in alone
    assert _loss(alone) < 1.0  # it learned: from ln(10) = 2.3
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step_100", "step_50"]
    again = _run([sys.executable, "train.py"], tmp_path)  # resumes at 100: nothing left to run
    assert "count=100" in again and _loss(again) == _loss(alone)
    two = tmp_path / "two"
    two.mkdir()
    (two / "train.py").write_text(_block())
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"], two)
    assert "world_size=2, count=100" in out
    assert abs(_loss(out) - _loss(alone)) <= 0.002  # two ranks fed halves = one process fed the whole batch


def _commented() -> list[str]:
    """The block's commented-out transform lines (``# step = ...``), as they stand."""
    return [line for line in _block().splitlines() if line.startswith("# step = ")]


def test_the_block_has_the_commented_transforms_the_test_below_switches_on():
    assert [line.split("(")[0].removeprefix("# step = ") for line in _commented()] == [
        "shard_grads",
        "shard_params",
        "amp",
        "offload",
        "remat",
    ]


def test_each_commented_transform_switched_on_runs_to_the_end(tmp_path):
    """Each commented line uncommented, alone (offload's NVMe path a temporary directory): the block runs to its
    last line, the held-out loss on step.full_params, and learns. The five run side by side."""
    runs = []
    for i, line in enumerate(_commented()):
        where = tmp_path / str(i)
        (where / "nvme").mkdir(parents=True)  # the offload line's directory for its files
        code = line.removeprefix("# ").replace('path="/nvme"', f"path={str(where / 'nvme')!r}")
        block = _block()
        assert block.count(line) == 1
        (where / "train.py").write_text(block.replace(line, code))
        proc = subprocess.Popen(
            [sys.executable, "train.py"], cwd=where, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        runs.append((code, proc))
    for code, proc in runs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{code}\n{out[-2000:]}\n{err[-4000:]}"
        name = code.split("(")[0].removeprefix("step = ")
        assert f"TrainState({name}(" in out, (code, out)  # the transform is on: the outermost piece of the name
        assert _loss(out) < 1.0, (code, out)  # it ran to its last line, and learned
