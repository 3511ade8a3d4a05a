"""zf.metrics.Logger: rank 0's progress bar, JSON lines and TensorBoard scalars."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import zerofn as zf


def test_jsonl_lines_hold_the_logging_steps_and_their_values(tmp_path, capsys):
    path = tmp_path / "sub" / "log.jsonl"
    losses = [torch.tensor(10.0 - i) for i in range(25)]
    with zf.metrics.Logger(25, tokens_per_step=128, every=10, jsonl=path) as log:
        for i in range(25):
            log.log(i, {"loss": losses[i], "vector": torch.ones(3)}, lr=0.5 * i)
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [0, 10, 20, 24]  # every 10, and the last
    for r in records:
        assert r["loss"] == 10.0 - r["step"]
        assert r["lr"] == 0.5 * r["step"]
        assert "vector" not in r  # not a scalar
        assert r["tokens_per_s"] > 0 and r["time"] >= 0
    assert records[-1]["time"] >= records[0]["time"]
    s = log.summary()
    assert s["steps"] == 25 and s["seconds"] > 0 and s["tokens_per_s"] > 0
    assert s["tokens_per_s"] == pytest.approx(25 * 128 / s["seconds"])
    # appends: a second run adds to the file
    with zf.metrics.Logger(2, jsonl=path, every=1) as log:
        log.log(0, {"loss": 1.0})
        log.log(1, {"loss": 2.0})
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 6 and records[-1]["tokens_per_s"] is None and records[-1]["loss"] == 2.0
    err = capsys.readouterr().err
    assert "train: 100%" in err and "25/25" in err and "loss=" in err and "tok_s=" in err


def test_resumed_bar_starts_at_the_first_step(capsys):
    with zf.metrics.Logger(12, start=8, tokens_per_step=4) as log:
        for i in range(8, 12):
            log.log(i, {"loss": 0.1})
    assert "12/12" in capsys.readouterr().err
    assert log.summary()["steps"] == 4


def test_disabled_logger_writes_nothing_and_reads_no_metrics(tmp_path, capsys):
    class Boom(dict):
        def items(self):
            raise AssertionError("metrics read by a disabled logger")

    path = tmp_path / "log.jsonl"
    with zf.metrics.Logger(3, jsonl=path, disable=True) as log:
        for i in range(3):
            assert log.log(i, Boom()) is None
        log.print("hidden")
    assert not path.exists()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_print_writes_to_stdout_and_bar_false_keeps_the_file(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    with zf.metrics.Logger(2, jsonl=path, bar=False) as log:
        log.print("hello", 3)
        log.log(0, {"loss": torch.tensor(2.0)})
        log.log(1, {"loss": torch.tensor(1.0)})
    out = capsys.readouterr()
    assert out.out == "hello 3\n" and out.err == ""
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [0, 1]


def _log_on_every_rank(path):
    with zf.metrics.Logger(5, tokens_per_step=16, every=2, jsonl=path) as log:
        for i in range(5):
            log.log(i, {"loss": torch.tensor(float(zf.collectives.rank()))})
    return zf.collectives.rank(), log.disable, log.summary()["steps"]


def test_only_rank_0_writes_under_spawn(tmp_path):
    path = str(tmp_path / "log.jsonl")
    results = zf.spawn(_log_on_every_rank, 2, path, timeout=120)
    assert [(r, d, n) for r, d, n in results] == [(0, False, 5), (1, True, 5)]
    records = [json.loads(line) for line in open(path).read().splitlines()]
    assert [r["step"] for r in records] == [0, 2, 4]
    assert all(r["loss"] == 0.0 and r["tokens_per_s"] > 0 for r in records)  # rank 0's values, once


def test_missing_tensorboard_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # its import raises ImportError
    with pytest.raises(ImportError, match="pip install tensorboard"):
        zf.metrics.Logger(3, tensorboard=str(tmp_path / "tb"), disable=True)


def test_tensorboard_writes_an_events_file(tmp_path):
    pytest.importorskip("tensorboard")
    logdir = tmp_path / "tb"
    with zf.metrics.Logger(3, tokens_per_step=8, every=1, tensorboard=str(logdir)) as log:
        for i in range(3):
            log.log(i, {"loss": torch.tensor(1.0)})
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logdir))


def test_every_must_be_positive():
    with pytest.raises(ValueError, match="every"):
        zf.metrics.Logger(3, every=0)
