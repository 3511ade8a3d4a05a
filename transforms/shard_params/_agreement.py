"""The ranks' agreement on which unit runs (:class:`Agreement`): at each point of a step where a rank
issues a collective for a unit (:class:`Point`), every rank checks that the others are at the same point
with the same unit, so that ranks whose control flow differs raise together (:func:`diverged`) instead of
waiting in mismatched collectives until the timeout."""

from __future__ import annotations

import enum

import numpy as np
import torch
from zerofn.transforms.shard_params._unit import LiveUnit

from zerofn import collectives as C


class Point(enum.IntEnum):
    """The points of a step at which the ranks agree."""

    OPEN = 0  # a unit opens in the forward
    OUTSIDE = 1  # a unit's parameter is read from outside it
    BACKWARD = 2  # a unit is gathered for backward
    END = 3  # the model's forward ends


class Agreement:
    """The ranks' agreement on each point of a step, over the step's ``units``; one in flight at most."""

    def __init__(self, units: list[LiveUnit]):
        self.units = units
        self.probe: tuple | None = None  # the agreement in flight: (handle, its values on the host, code)

    def agree(self, point: Point, unit: LiveUnit | None, wait: bool = True) -> None:
        """Every rank must be at the same point: opening the same unit, reading the same unit's parameter
        from outside it, gathering the same unit for backward, or ending the forward. One max-reduce of
        (code, -code) on the control group, which ranks that took different paths see differ, so that they
        raise together instead of waiting in mismatched collectives.

        ``wait``: wait for it here, before any gather this point issues. Otherwise it stays in flight until
        the next agreement (or :meth:`settled`): a forward that follows the recorded order issues the same
        gathers on every rank whichever unit each one opened (see ``Runner``), so it checks each point one
        point later, and no rank waits for a round trip per unit. The values are read from the probe's host
        buffer (a CPU tensor of the control group), no device read."""
        if C.world_size() == 1:
            return
        self.settled()
        n = len(self.units)
        code = point * (n + 1) + (unit.index if unit is not None else n)
        values = np.array([code, -code], dtype=np.int64)
        handle = C.all_reduce(torch.from_numpy(values), "max", async_op=True, control=True)
        self.probe = (handle, values, code)
        if wait:
            self.settled()

    def settled(self) -> None:
        """Wait for the agreement in flight, if any; raise if the ranks were at different points."""
        if self.probe is None:
            return
        handle, values, code = self.probe
        self.probe = None
        handle.wait()
        hi, lo = int(values[0]), -int(values[1])
        if hi != lo:
            raise diverged(self.point(code), self.point(hi if hi != code else lo))

    def point(self, code: int) -> str:
        """What a rank did at the point an agreement's ``code`` stands for, in words."""
        n = len(self.units)
        kind, index = divmod(code, n + 1)
        if index >= n:
            return "ended the model's forward"
        name = repr(self.units[index].spec.name or "<root>")
        return {
            Point.OPEN: f"ran unit {name}",
            Point.OUTSIDE: f"read a parameter of unit {name} from outside it",
            Point.BACKWARD: f"gathered unit {name} for backward",
        }[kind]


def diverged(mine: str, theirs: str) -> RuntimeError:
    """The error every rank raises when the ranks were at different points: this rank did ``mine``, another
    ``theirs``."""
    return RuntimeError(
        f"shard_params: ranks gathered different units at the same point of the step: rank {C.rank()} "
        f"{mine} while another rank {theirs} (world size {C.world_size()}). Every rank must run the same units "
        "in the same order: make control flow that skips or repeats a unit the same on every rank (for example "
        "decide it from a value broadcast from rank 0)."
    )
