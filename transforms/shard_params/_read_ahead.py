"""Bringing shards that rest off the device to their gathers (:class:`ReadAhead`): shards in files
(``offload(..., params="nvme")``) read on an I/O thread ahead of their units' gathers, and shards in host
memory (``offload(params=True)``) copied to the device on a side stream, overlapping the compute."""

from __future__ import annotations

from typing import Any

import torch
from zerofn.transforms._param_files import ShardReads
from zerofn.transforms.shard_params._unit import LiveUnit

from zerofn import alloc


class ReadAhead:
    """The reads and host copies of one step's shards, for units gathered ``prefetch`` ahead."""

    def __init__(self, units: list[LiveUnit], prefetch: int, owner: Any):
        self.prefetch = prefetch
        # Shards in files: read on an I/O thread ahead of their gathers (a few units' worth at most).
        # The host buffers they are read into: pools of one per unit's shards read ahead (prefetch + 2 reads)
        # or still being gathered (prefetch + 1 units).
        on_disk = [u.files for u in units if u.files]
        self.reads = (
            ShardReads(prefetch + 2, prefetch + 1, on_disk, torch.cuda.is_available(), owner=owner) if on_disk else None
        )
        self.copies_stream: Any = None  # CUDA: where host shards are copied in (see to_device)

    @property
    def reading(self) -> bool:
        """Whether any shard rests in a file."""
        return self.reads is not None

    def take(self, unit: LiveUnit) -> alloc.Lease | None:
        """The host buffers ``unit``'s shards in files were read into (waiting for the read if it is still
        under way); None if none of its shards rests in a file."""
        return self.reads.take(unit.index, unit.files) if self.reads is not None and unit.files else None

    def ahead(self, unit: LiveUnit, order: list[LiveUnit]) -> None:
        """Start reading the shards of the units in ``order`` (the units expected after ``unit``) that rest in
        files and are neither gathered nor on their way: ``prefetch + 1`` of them."""
        for u in [u for u in order if u is not unit and u.idle and u.files][: self.prefetch + 1]:
            self.reads.ahead(u.index, u.files)

    def to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host shard copied to ``device`` without blocking. On CUDA the copy runs on a side stream, so it
        overlaps the kernels already queued on the compute stream (the unit before this one); the compute
        stream waits for it where this unit's all-gather is queued, before anything that reads it."""
        if device.type != "cuda":
            return torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host, non_blocking=True)
        if self.copies_stream is None:
            self.copies_stream = torch.cuda.Stream(device)
        compute = torch.cuda.current_stream(device)
        with torch.cuda.stream(self.copies_stream):
            # Allocated from the side stream's own blocks, so no kernel still queued on the compute stream can
            # be reading this memory; the pinned source is kept until the copy is done (torch's host allocator
            # records the stream it was copied on).
            out = torch.empty(host.shape, dtype=host.dtype, device=device).copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        compute.wait_event(done)
        out.record_stream(compute)  # used there next: not reused by the side stream before that work is done
        return out

    def release_after_copies(self, lease: alloc.Lease) -> None:
        """Give ``lease``'s buffers back once the copies to the device queued so far are done (the gathers
        read the copies, not the buffers)."""
        done = torch.cuda.Event()
        done.record(self.copies_stream)
        lease.release(after=done)

    def close(self) -> None:
        if self.reads is not None:
            self.reads.close()
