"""examples/multinode.md: two torchrun "nodes" over 127.0.0.1 train the GPT example to the very parameters
one machine with two ranks reaches."""

from __future__ import annotations

import os
import re
import sys

from test_examples import ROOT
from test_launch_cli import SCRIPT, SMALL, _free_port, _run, _same, _wait


def test_the_documented_loopback_commands_use_torchruns_flags():
    text = open(os.path.join(ROOT, "examples", "multinode.md")).read()
    assert (
        len(re.findall(r"torchrun --nnodes=2 --node_rank=[01] --nproc_per_node=1 --master_addr=127\.0\.0\.1", text))
        == 2
    )


def test_two_torchrun_nodes_over_loopback_equal_one_machine(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    one = _run(
        [
            *torchrun,
            "--standalone",
            "--nproc_per_node=2",
            SCRIPT,
            *SMALL,
            "--zero",
            "3",
            "--out",
            str(tmp_path / "one.pt"),
        ],
        tmp_path,
    )
    port = str(_free_port())
    nodes = [
        _run(
            [
                *torchrun,
                "--nnodes=2",
                f"--node_rank={r}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                SCRIPT,
                *SMALL,
                "--zero",
                "3",
                "--out",
                str(tmp_path / "two.pt"),
            ],
            tmp_path,
        )
        for r in range(2)
    ]
    _wait(one, *nodes)
    _same(tmp_path / "one.pt", tmp_path / "two.pt")
