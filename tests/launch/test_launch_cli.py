"""``python -m zerofn run``: torchrun's flags plus DeepSpeed's names, one machine or two nodes over loopback,
and the GPT example from a DeepSpeed config equal to the same transforms written by hand."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from test_examples import ROOT

from zerofn.launch.cli import torchrun_args

SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
SMALL = ["--steps", "6", "--dim", "32", "--layers", "1", "--seq-len", "16", "--quiet"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", ZEROFN_TIMEOUT_S="60")


def test_deepspeed_flag_names_become_torchruns():
    assert torchrun_args(["--num_gpus", "2", "t.py", "--num_gpus", "9"]) == [
        "--nproc_per_node",
        "2",
        "--standalone",
        "t.py",
        "--num_gpus",
        "9",  # the script's own flags untouched
    ]
    assert torchrun_args(["--num_nodes=2", "--node_rank", "1", "--master_addr", "h", "t.py"]) == [
        "--nnodes=2",
        "--node_rank",
        "1",
        "--master_addr",
        "h",
        "t.py",  # a rendezvous given: no --standalone
    ]
    assert torchrun_args(["--max-restarts", "1", "--standalone", "t.py"]) == [
        "--max-restarts",
        "1",
        "--standalone",
        "t.py",
    ]
    with pytest.raises(SystemExit, match=r"--hostfile .* not supported; run the same command on each machine"):
        torchrun_args(["--hostfile", "hosts", "t.py"])
    with pytest.raises(SystemExit, match=r"unknown flag '--gpus' before the script"):
        torchrun_args(["--gpus", "2", "t.py"])
    with pytest.raises(SystemExit, match="no script given"):
        torchrun_args(["--nproc_per_node", "2"])


def _run(argv, cwd, **kw):
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=ENV, **kw)


def _wait(*procs):
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"{p.args}\n{out[-2000:]}\n{err[-4000:]}"


def _same(a, b):
    a, b = torch.load(a), torch.load(b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_over_loopback_equal_one_machine(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    ref = _run([*torchrun, SCRIPT, *SMALL, "--zero", "1", "--out", str(tmp_path / "one.pt")], tmp_path)
    port = str(_free_port())
    nodes = [
        _run(
            [
                sys.executable,
                "-m",
                "zerofn",
                "run",
                "--num_nodes",
                "2",
                "--node_rank",
                str(r),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                SCRIPT,
                *SMALL,
                "--zero",
                "1",
                "--out",
                str(tmp_path / "two.pt"),
            ],
            tmp_path,
        )
        for r in range(2)
    ]
    _wait(ref, *nodes)
    _same(tmp_path / "one.pt", tmp_path / "two.pt")


def test_a_deepspeed_config_equals_the_transforms_written_by_hand(tmp_path):
    cfg = {
        "train_batch_size": 16,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
    }
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    ds = _run(
        [
            sys.executable,
            "-m",
            "zerofn",
            "run",
            "--nproc_per_node",
            "2",
            SCRIPT,
            *SMALL,
            "--deepspeed",
            str(tmp_path / "ds.json"),
            "--out",
            str(tmp_path / "ds.pt"),
        ],
        tmp_path,
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    by_hand = _run(
        [
            *torchrun,
            SCRIPT,
            *SMALL,
            "--zero",
            "2",
            "--amp",
            "bf16",
            "--batch",
            "16",
            "--accumulate",
            "2",
            "--lr",
            "3e-3",
            "--constant-lr",
            "--out",
            str(tmp_path / "hand.pt"),
        ],
        tmp_path,
    )
    _wait(ds, by_hand)
    _same(tmp_path / "ds.pt", tmp_path / "hand.pt")
