"""What one GPU holds of parameters a parallelism cuts, from their placements alone (:func:`local_shape`,
:func:`local_params`).

A parallelism that cuts parameters states each one's placement per axis of the step's mesh
(:mod:`zerofn.sharding`: ``Replicate``, or ``Shard(dim, parts, share)``), in the state's spec and in its
planning alike; the planner counts a rank's parameters from them with no formula of its own: along each
axis of ``size`` ranks a ``Shard`` holds ``1 / pieces`` of its dimension (``pieces``: ``size / share``, a
piece ``share`` consecutive ranks hold whole, :func:`zerofn.sharding.piece`), each of its ``parts``
blocks cut alike, as :func:`zerofn.sharding.cut` cuts it; a parameter without placements is whole on every
rank. The cuts are even (the parallelisms refuse others), and so must be the shapes given here.

Example:
    >>> from zerofn.plan import local_params, local_shape
    >>> from zerofn.sharding import Shard
    >>> local_shape((96, 64), (Shard(0, parts=3),), (4,))           # a fused q/k/v over 4 ranks
    (24, 64)
    >>> local_shape((32, 64), (Shard(0, share=2),), (4,))           # 2 key/value heads over 4 ranks
    (16, 64)
    >>> shapes = {"q.weight": (64, 64), "o.weight": (64, 64), "norm.weight": (64,)}
    >>> local_params(shapes, {"q.weight": (Shard(0),), "o.weight": (Shard(1),)}, (4,))  # 2 x 1024 + 64
    2112
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from zerofn.sharding import Placement, Shard, piece

__all__ = ["local_params", "local_shape"]


def local_shape(shape: Sequence[int], placements: Sequence[Placement], sizes: Sequence[int]) -> tuple[int, ...]:
    """The shape of the piece of a ``shape`` tensor one rank holds, cut by ``placements`` (one per axis) over
    axes of ``sizes`` ranks; the inverse of :func:`zerofn.sharding.whole_shape`.

    Raises:
        ValueError: a placement that does not cut its dimension evenly (into its blocks, then each block
            into the axis's pieces), or names a dimension the shape lacks; a ``share`` that does not divide
            its axis.
    """
    out = list(shape)
    for p, size in zip(placements, sizes):
        _, n = piece(p, size, 0)
        if not isinstance(p, Shard) or n == 1:
            continue
        if not 0 <= p.dim < len(out) or out[p.dim] % (p.parts * n):
            raise ValueError(
                f"local_shape: {p} over {size} ranks cuts dimension {p.dim} of {tuple(out)} into {p.parts} x {n} "
                "even pieces, which it does not have"
            )
        out[p.dim] //= n
    return tuple(out)


def local_params(
    shapes: Mapping[str, Sequence[int]], placements: Mapping[str, Sequence[Placement]], sizes: Sequence[int]
) -> int:
    """The elements one rank holds of the parameters ``shapes`` gives whole (name -> shape), each cut by its
    ``placements`` (name -> one placement per axis of ``sizes``; a name without them: whole on every rank).
    A piece that ``share`` ranks hold counts whole on each of them."""
    return sum(math.prod(local_shape(s, placements.get(name, ()), sizes)) for name, s in shapes.items())
