"""Writes the stored checkpoints ``tests/checkpoint/test_stored_checkpoints.py`` loads: for each kind of state, the
checkpoint after step 3 (``<kind>/step_3``) and ``<kind>/expected.pt`` (the state_dict at the save and the
losses of the two steps after it). They are kept as written by the zerofn of the commit that added them:
run this again only to add a kind, and never over the kinds stored already.

    .venv/bin/python tests/data/checkpoints/make.py [KIND ...]
"""

from __future__ import annotations

import os
import pathlib
import sys
import tempfile

import torch

HERE = pathlib.Path(__file__).parent
TESTS = HERE.parent.parent
sys.path[:0] = [str(TESTS), str(TESTS / "checkpoint")]  # helpers, and the test module wherever it is

import test_stored_checkpoints as T  # noqa: E402

import zerofn as zf  # noqa: E402
from zerofn import collectives as C  # noqa: E402


def _write(root: str, kinds: list, scratch: str) -> None:
    for kind in kinds:
        step, apply = T.build(kind, nvme=f"{scratch}/nvme-{kind}-{C.rank()}")
        state = step.init(apply.params)
        for i in range(T.SAVED_AT):
            state, _ = step(state, T.batch(kind, i, step))
        group = step.group if "tp" in T.KINDS[kind][1] else None
        zf.checkpoint.save(state, f"{root}/{kind}/step_{T.SAVED_AT}", group=group)
        at_save = step.state_dict(state, master=T.master(kind))
        losses = []
        for i in range(T.SAVED_AT, T.SAVED_AT + T.AFTER):
            state, m = step(state, T.batch(kind, i, step))
            losses.append(float(m["loss"]))
        if C.rank() == 0:
            torch.save({"state_dict": at_save, "losses": losses}, f"{root}/{kind}/expected.pt")


def main(kinds: list) -> None:
    kinds = kinds or list(T.KINDS)
    for kind in kinds:
        if (HERE / kind).exists():
            raise SystemExit(f"{kind} is stored already: it stays as it was written")
    with tempfile.TemporaryDirectory() as scratch:
        for world in (1, 2):
            mine = [k for k in kinds if T.KINDS[k][0] == world]
            if mine:
                with zf.RankPool(world) as pool:
                    pool.run(_write, str(HERE), mine, scratch)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
