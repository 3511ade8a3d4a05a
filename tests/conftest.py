"""Shared rank pools: spawning a rank costs seconds (importing torch), so each
world size gets one pool of live gloo ranks for the whole session."""

from __future__ import annotations

import pytest
import torch

import zerofn as zf

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ranks():
    pools: dict[int, zf.RankPool] = {}

    def get(world_size: int) -> zf.RankPool:
        if world_size not in pools:
            pools[world_size] = zf.RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
