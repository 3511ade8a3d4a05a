"""The ranks' agreement on which unit runs (:class:`Agreement`): at each point of a step where a rank
issues a collective for a unit (:class:`Point`), every rank checks that the others are at the same point
with the same unit, so that ranks whose control flow differs raise together (:func:`diverged`) instead of
waiting in mismatched collectives until the timeout.

An agreement is a max-reduce of ``(code, -code)`` on the control group; ranks whose codes differ see the
two values differ. It may stay in flight (:meth:`Agreement.post`) while the rank goes on: every rank posts
its agreements in the same order, so each pairs with the others' of the same number, and a rank that waits
for a gather posted after an agreement waits for that agreement first (:meth:`Agreement.settled`), so a rank
that diverged is seen before any collective it did not issue is waited for.

A forward that follows the order the last step recorded posts none until its end (``Runner._left``): every
rank issues that order's gathers, and a rank that leaves it issues the rest of them too before it agrees
(:meth:`Agreement.left`) where the others agree on the end."""

from __future__ import annotations

import enum
import zlib

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
    HELD = 4  # backward's plan reaches a unit this rank holds gathered already: no gather issued
    LEFT = 5  # a forward that follows the last step's order without agreeing per unit left it (Runner._left)


class Agreement:
    """The ranks' agreement on each point of a step, over the step's ``units``; any number in flight, settled
    oldest first."""

    def __init__(self, units: list[LiveUnit]):
        self.units = units
        self.probes: list[tuple] = []  # in flight, oldest first: (handle, its values on the host, code, number)
        self.posted = 0  # agreements posted this step (each one's number is the count after it)
        self.failed: int | None = None  # the number of the first agreement the ranks failed
        self.plan: list[LiveUnit] = []  # the units backward gathers, in order, as this rank ended the forward

    def agree(
        self,
        point: Point,
        unit: LiveUnit | None,
        wait: bool = True,
        plan: list[LiveUnit] | None = None,
        digest: int = 0,
    ) -> None:
        """Every rank must be at the same point: opening the same unit, reading the same unit's parameter
        from outside it, gathering the same unit for backward, or ending the forward (``plan``: with the
        same units for backward to gather). Every agreement in flight is settled first.

        ``wait``: wait for it here, before any gather this point issues. Otherwise it stays in flight until
        the next agreement (or :meth:`settled`): a forward that follows the recorded order issues the same
        gathers on every rank whichever unit each one opened (see ``Runner``), so it checks each point one
        point later, and no rank waits for a round trip per unit. The values are read from the probe's host
        buffer (a CPU tensor of the control group), no device read."""
        if C.world_size() == 1:
            return
        self.settled()
        if plan is not None:
            self.plan = plan
        self.post(point, unit, _digest(plan) if plan is not None else digest)
        if wait:
            self.settled()

    def left(self, action: Point, unit: LiveUnit | None, expected: LiveUnit | None) -> None:
        """Agree, waiting, that this rank left the order the last step recorded: it did ``action`` (opened
        ``unit``, read a parameter of ``unit`` from outside it, or ended the forward: ``unit`` None) where the
        order has ``expected`` next (None: the order was over). The ranks that follow the order post their
        agreement on the forward's end at this number instead, so the codes differ, and every rank raises;
        ranks that all left it alike pass and go on."""
        n = len(self.units)
        self.agree(Point.LEFT, unit, digest=action * (n + 1) + (expected.index if expected is not None else n))

    def post(self, point: Point, unit: LiveUnit | None, digest: int = 0) -> int:
        """Post an agreement on ``point`` and leave it in flight, whatever is in flight before it; returns its
        number, for :meth:`settled` (0 on one rank, where there is nothing to agree with)."""
        if C.world_size() == 1:
            return 0
        code = self.code(point, unit, digest)
        values = np.array([code, -code], dtype=np.int64)
        handle = C.all_reduce(torch.from_numpy(values), "max", async_op=True, control=True)
        self.posted += 1
        self.probes.append((handle, values, code, self.posted))
        return self.posted

    def settled(self, upto: int | None = None) -> None:
        """Wait for the agreements in flight, oldest first, through number ``upto`` (None: all of them); raise
        at the first where the ranks were at different points (the later ones are dropped: a rank that diverged
        may never post them)."""
        while self.probes and (upto is None or self.probes[0][3] <= upto):
            handle, values, code, number = self.probes.pop(0)
            handle.wait()
            hi, lo = int(values[0]), -int(values[1])
            if hi != lo:
                self.probes = []
                self.failed = number
                raise self.error(code, hi if hi != code else lo)

    def code(self, point: Point, unit: LiveUnit | None, digest: int = 0) -> int:
        n = len(self.units)
        return (digest * len(Point) + point) * (n + 1) + (unit.index if unit is not None else n)

    def _decode(self, code: int) -> tuple[int, int, int]:
        n = len(self.units)
        rest, index = divmod(code, n + 1)
        digest, kind = divmod(rest, len(Point))
        return digest, kind, index

    def error(self, mine: int, theirs: int) -> RuntimeError:
        """The error for agreement codes that differ: this rank's ``mine``, another's ``theirs``."""
        (d1, k1, i1), (d2, k2, i2) = self._decode(mine), self._decode(theirs)
        if k1 == k2 == Point.END and i1 == i2 and d1 != d2:
            names = [u.spec.name or "<root>" for u in self.plan]
            return RuntimeError(
                f"shard_params: the ranks ended the model's forward expecting backward to gather different units: "
                f"rank {C.rank()} gathers {names} (a unit is gathered in backward if it has trainable parameters "
                f"or frozen ones whose outputs need a gradient), another rank a different list (world size "
                f"{C.world_size()}). Every rank must run the same units with the same need for gradients: make "
                "requires_grad and the inputs of each unit the same on every rank."
            )
        return diverged(self.point(mine), self.point(theirs))

    def point(self, code: int) -> str:
        """What a rank did at the point an agreement's ``code`` stands for, in words."""
        digest, kind, index = self._decode(code)
        if kind == Point.LEFT:
            return self._left(digest, index)
        if index >= len(self.units):
            return "ended the model's forward"
        name = repr(self.units[index].spec.name or "<root>")
        return {
            Point.OPEN: f"ran unit {name}",
            Point.OUTSIDE: f"read a parameter of unit {name} from outside it",
            Point.BACKWARD: f"gathered unit {name} for backward",
            Point.HELD: f"held unit {name} gathered where backward gathers it",
        }[kind]

    def _left(self, digest: int, index: int) -> str:
        """What a rank that left the recorded order did (see :meth:`left`), in words."""
        n = len(self.units)
        action, expected = divmod(digest, n + 1)
        name = repr(self.units[index].spec.name or "<root>") if index < n else ""
        did = {
            Point.OPEN: f"ran unit {name}",
            Point.OUTSIDE: f"read a parameter of unit {name} from outside it",
            Point.END: "ended the model's forward",
        }[Point(action)]
        if expected >= n:
            return f"{did} after the last unit of the order the last step ran"
        return f"{did} where the order the last step ran has unit {self.units[expected].spec.name or '<root>'!r}"


def _digest(plan: list[LiveUnit]) -> int:
    """A digest of the units backward gathers, the same on every rank that has the same list (32 bits)."""
    return zlib.crc32(np.array([u.index for u in plan], dtype=np.int64).tobytes())


def diverged(mine: str, theirs: str) -> RuntimeError:
    """The error every rank raises when the ranks were at different points: this rank did ``mine``, another
    ``theirs``."""
    return RuntimeError(
        f"shard_params: ranks gathered different units at the same point of the step: rank {C.rank()} "
        f"{mine} while another rank {theirs} (world size {C.world_size()}). Every rank must run the same units "
        "in the same order: make control flow that skips or repeats a unit the same on every rank (for example "
        "decide it from a value broadcast from rank 0)."
    )
