"""The live unit: one unit's full buffers during a step (empty, being gathered, or ready) and the counts
that decide when the runner may release them (:class:`LiveUnit`)."""

from __future__ import annotations

from typing import Any

import torch
from zerofn.transforms._units import ROOT, Unit

from zerofn import alloc
from zerofn import collectives as C
from zerofn._io import FileTensor


class LiveUnit:
    """One unit's full buffers during a step: empty, being gathered, or ready."""

    def __init__(self, spec: Unit, index: int):
        self.spec, self.index = spec, index
        self.fulls: list[tuple[torch.Tensor, torch.Tensor]] = []  # (full buffer, this rank's shard)
        self.groups: list = []  # the group each of them is gathered over (None: the step's)
        self.handles: list[C.Handle] = []
        self.agreed = 0  # the number of the agreement posted with its gather in flight (0: none; see Runner._wait)
        # hpZ: this rank's piece of each full buffer within its node, kept from the first gather of the step
        self.secondaries: list[torch.Tensor] = []
        self.ready = False
        self.remaining = 0  # trainable leaves whose gradient has not arrived yet
        self.inputs = 0  # its calls whose inputs' gradients backward has not computed yet
        self.backward = False  # an output of its forward needs a gradient: backward runs through it
        self.depth = 0  # module calls of this unit now running
        # Gathered by an inner torch.autograd.grad (a gradient penalty in loss_fn): kept until its backward
        # is over (with frozen parameters: until the step ends), since the graph that grad built with
        # create_graph=True reads the parameters in an order that no hook of the unit's own sees coming
        # (see Runner._inner).
        self.pinned = False
        self.lease: alloc.Lease | None = None  # the host buffer its shards were read into, while gathered
        # A step of several micro-batch backwards (a pipeline's, see Runner.run_microbatches): its trainable
        # leaves (each backward hands each one gradient), the backwards still to hand them, and the backward
        # (autograd's graph task) whose gradients ``remaining`` counts.
        self.per_round = 0
        self.rounds_left = 0
        self.task: int | None = None

    def give_back(self) -> None:
        """The gather is done: the buffer its shards were read into goes back to the pool."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    @property
    def needed_in_backward(self) -> bool:
        """Backward still needs its parameters: gradients of its own to come, or frozen weights that
        backward runs through (not a frozen unit whose outputs needed no gradient: an embedding left frozen)."""
        return bool(self.remaining) or (bool(self.spec.frozen) and self.backward)

    @property
    def finished(self) -> bool:
        """Under several micro-batch backwards: every one of them has handed its gradients in."""
        return self.per_round > 0 and self.rounds_left == 0

    @property
    def idle(self) -> bool:
        """Neither gathered nor on its way: gathering it now issues a collective."""
        return not (self.ready or self.handles)

    @property
    def files(self) -> list[FileTensor]:
        """Its shards that rest in files (``offload(..., params="nvme")``), in the order of ``fulls``."""
        return [shard for _, shard in self.fulls if isinstance(shard, FileTensor)]


def last_block(order: list[LiveUnit]) -> Any:
    """The last unit other than the root in a forward order (None if there is none)."""
    return next((u for u in reversed(order) if u.spec.name != ROOT), None)
