"""zerofn's defaults the estimate counts with, repeated here so that it reads no step's or transform's
defaults (tests check they agree), and the pools of buffers they size."""

from __future__ import annotations

BUCKET_BYTES = 25 * 2**20  # zerofn.step.DEFAULT_BUCKET_BYTES
NVME_SUB_GROUP_BYTES = 64 * 2**20  # the NVMe update's sub-group (transforms/offload.py)
# offload("nvme")'s host pools (docs/transforms/offload.md), as many buffers as the transform makes:
NVME_UPDATE_BUFFERS = 4  # the update's sub-groups: the one read ahead, the one updated, two being written
NVME_LANDING_BUFFERS = 3  # gradients copied off the GPU on their way to their files: two being written, one landing
PREFETCH = 1  # ZeRO-3's default prefetch

DEVICES = (None, "cpu", "nvme")  # where the optimizer state is: the GPU, CPU RAM, NVMe


def nvme_read_buffers(prefetch: int = PREFETCH) -> int:
    """The buffers ZeRO-3's parameter shards are read into from their files (``offload(..., params="nvme")``):
    one per unit read ahead (``prefetch + 2``) or still being gathered (``prefetch + 1``)."""
    return (prefetch + 2) + (prefetch + 1)
