"""The README's main job: the GPT example under torchrun on 2 CPU ranks learns the corpus."""

from __future__ import annotations

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_gpt_under_torchrun_learns_the_chain():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        os.path.join(ROOT, "examples", "train_gpt.py"),
        "--zero",
        "1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout

    def figure(label):
        return float(re.search(rf"{label}\s+([0-9.]+)", out).group(1))

    unigram, floor, held_out = figure("unigram entropy"), figure("conditional entropy"), figure("held-out loss")
    assert "shard_optimizer(train_step) on 2 rank(s)" in out
    assert held_out < unigram - 1.0, out  # learned the transitions, far below what no context allows
    assert held_out > floor - 0.05, out  # and not below the floor, which would mean a broken measurement
    # the progress bar (rank 0's tqdm, on stderr) ran to the end: a bare "train" would also match any
    # warning printed from train_gpt.py
    assert re.search(r"train: 100%\|\S*\| (\d+)/\1 \[", proc.stderr), proc.stderr[-3000:]
