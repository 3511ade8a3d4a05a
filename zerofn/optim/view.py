"""The optimizer's view of the parameters: which parameter each element of each leaf it updates is.

A step keeps trainable parameters in flat buckets, sharded or not, and hands the optimizer one tensor per
bucket (``{"b0": ..., "b1": ...}``). A :class:`ParamView` says, for each of those keys, which parts of
which parameters the tensor holds (:class:`Piece`: the parameter's name as in ``apply.params``, its full
shape, the range of its flattened elements that lies here, and where). Called on a tree of whole
parameters (a notebook's ``opt.init(params)``), the view is that tree's: one key per leaf, each leaf one
whole parameter (:meth:`ParamView.of_tree`).

Transforms that decide per parameter take the view through ``bind`` (see
:class:`~zerofn.optim.base.GradientTransformation`): masks and labels resolve to sets of keys once
(a step keeps parameters of different labels in different buckets), a per-parameter rule (LAMB's trust
ratio, Muon's orthogonalisation) cuts each leaf into its pieces. Elementwise rules never look at it.

Each step also says which parameters got no gradient this step and how many updates each parameter has
received (:class:`StepInfo`, passed to ``update`` as ``info=``), which torch's rule for parameters
without a gradient needs.

Example:
    >>> import torch
    >>> from zerofn.optim.view import ParamView
    >>> view = ParamView.of_tree({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    >>> [(k, [(p.name, p.shape) for p in leaf.pieces]) for k, leaf in view.leaves.items()]
    [('b', [('b', (3,))]), ('w', [('w', (2, 3))])]
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from zerofn import tree as T

__all__ = [
    "LeafView",
    "ParamView",
    "Piece",
    "StepInfo",
    "by_step",
    "info_of",
    "keys_of",
    "live_columns",
    "maybe_pieces",
    "pieces_of",
]


class Piece(NamedTuple):
    """The part of one parameter that lies in a leaf the optimizer updates.

    Attributes:
        name: the parameter's name (its key path in the params tree, as in ``apply.params``).
        shape: the parameter's full shape.
        start: the first of its (flattened) elements that lies here.
        offset: where that element lies in the leaf.
        numel: how many of its elements lie here.
    """

    name: str
    shape: tuple[int, ...]
    start: int
    offset: int
    numel: int

    @property
    def whole(self) -> bool:
        """The leaf holds all of the parameter."""
        return self.start == 0 and self.numel == _numel(self.shape)

    def of(self, leaf: torch.Tensor) -> torch.Tensor:
        """This piece's elements of ``leaf`` (a tensor laid out as the leaf: its parameters, moments...)."""
        return leaf.view(-1)[self.offset : self.offset + self.numel]


class LeafView(NamedTuple):
    """What one leaf the optimizer updates holds.

    Attributes:
        pieces: its parameters' pieces, in offset order (padding after the last is no parameter's).
        numel: the leaf's number of elements.
        sharded: other ranks hold other pieces of the same bucket (a sum over a parameter's elements
            needs their partial sums).
    """

    pieces: tuple[Piece, ...]
    numel: int
    sharded: bool = False


@dataclass(frozen=True)
class ParamView:
    """Key -> :class:`LeafView` for the leaves an optimizer updates, and the parameter tree they come from.

    Attributes:
        leaves: optimizer key (``"b0"``; a leaf's key path for a tree of whole parameters) -> its view.
        treedef: the params tree's structure (every parameter, frozen ones included).
        names: every parameter's name, in the tree's leaf order.
        shapes: every parameter's full shape, in that order.
        dtypes: every parameter's dtype, in that order.
        trainable: the names of the parameters the optimizer updates (None: all of them). A mask or the
            labels need entries for these alone: a frozen parameter's is never read.
    """

    leaves: Mapping[str, LeafView]
    treedef: Any
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    trainable: frozenset[str] | None = None

    def __hash__(self) -> int:
        return hash((tuple(self.leaves.items()), self.names, self.shapes, self.trainable))

    @staticmethod
    def of_tree(tree: Any) -> ParamView:
        """The view of a tree of whole parameters: one key per leaf (its key path), one piece each."""
        paths, leaves, treedef = T.tree_flatten_with_path(tree)
        names = tuple(T.keystr(p) for p in paths)
        shapes = tuple(tuple(t.shape) for t in leaves)
        views = {n: LeafView((Piece(n, s, 0, 0, _numel(s)),), _numel(s)) for n, s in zip(names, shapes)}
        return ParamView(views, treedef, names, shapes, tuple(t.dtype for t in leaves))  # every leaf trainable

    def params(self) -> Any:
        """The params tree with meta tensors of each parameter's full shape and dtype (for a mask or
        labels function: ``lambda params: tree_map(lambda p: p.ndim >= 2, params)``)."""
        metas = [torch.empty(s, dtype=d, device="meta") for s, d in zip(self.shapes, self.dtypes)]
        return T.tree_unflatten(self.treedef, metas)

    def select(self, keys: Any) -> ParamView:
        """The view restricted to ``keys``."""
        return ParamView({k: self.leaves[k] for k in keys}, *self._rest())

    def chunk(self, key: str, lo: int, hi: int, as_key: str | None = None) -> ParamView:
        """The view of elements ``[lo, hi)`` of leaf ``key`` alone, under ``as_key`` (default ``key``)."""
        leaf = self.leaves[key]
        pieces = []
        for p in leaf.pieces:
            a, b = max(lo, p.offset), min(hi, p.offset + p.numel)
            if a < b:
                pieces.append(Piece(p.name, p.shape, p.start + a - p.offset, a - lo, b - a))
        sharded = leaf.sharded or any(not p.whole for p in pieces)
        return ParamView({as_key or key: LeafView(tuple(pieces), hi - lo, sharded)}, *self._rest())

    def _rest(self) -> tuple:
        return self.treedef, self.names, self.shapes, self.dtypes, self.trainable

    @property
    def trainable_names(self) -> tuple[str, ...]:
        """The names of the parameters the optimizer updates, in the params tree's leaf order."""
        return self.names if self.trainable is None else tuple(n for n in self.names if n in self.trainable)

    def resolve(self, spec: Any, what: str, where: str, fill: Any = None) -> dict[str, Any]:
        """``spec`` (a tree over the parameters, or a function of :meth:`params` returning one) as
        name -> value, for every parameter; ``what`` and ``where`` name it in errors.

        ``spec`` needs an entry for every trainable parameter; a frozen one's may be absent (as in a tree
        built from ``model.named_parameters()`` where ``p.requires_grad``): it is ``fill`` then."""
        tree = spec(self.params()) if callable(spec) else spec
        needed = self.trainable_names
        if isinstance(tree, Mapping):
            flat = dict(tree)
            if set(flat) >= set(needed) and all(not isinstance(v, (Mapping, list, tuple)) for v in flat.values()):
                return {n: flat.get(n, fill) for n in self.names}
        try:
            paths, values, _ = T.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)
        except Exception as e:  # pragma: no cover - optree's own message is clear enough
            raise TypeError(f"{where}: {what} must be a tree over the parameters: {e}") from e
        given = dict(zip((T.keystr(p) for p in paths), values))
        missing = [n for n in needed if n not in given]
        extra = [n for n in given if n not in set(self.names)]
        if not missing and not extra:
            return {n: given.get(n, fill) for n in self.names}
        raise ValueError(
            f"{where}: {what} must have an entry for every trainable parameter, keyed as in the params tree "
            "(apply.params) (a frozen one's may be left out)"
            + (f"; it lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else "")
            + (f"; it has entries no parameter has: {extra[:4]}{' ...' if len(extra) > 4 else ''}" if extra else "")
            + ". Pass a tree shaped like the params, or a function of the params tree returning one, e.g. "
            "lambda params: {name: p.ndim >= 2 for name, p in params.items()}."
        )

    def keys_where(self, values: Mapping[str, Any], where: str, what: str) -> dict[str, Any]:
        """key -> the one value its pieces share (a step keeps parameters of different labels in different
        buckets); a ValueError for a leaf whose pieces disagree."""
        out = {}
        for k, leaf in self.leaves.items():
            seen = {values[p.name] for p in leaf.pieces}
            if len(seen) > 1:
                raise ValueError(
                    f"{where}: the optimizer's leaf {k!r} holds parameters of different {what} "
                    f"({sorted(map(repr, seen))}): the step must keep them in separate buckets. Build the step "
                    "with zf.train_step(loss_fn, optimizer) and this optimizer, whose labels it reads at init."
                )
            out[k] = seen.pop() if seen else None
        return out


@dataclass(frozen=True)
class StepInfo:
    """What a step tells its optimizer about the parameters on one update (``update(..., info=)``).

    Attributes:
        missing: the parameters no rank gave a gradient this step (on no micro-step): torch's optimizers
            skip a parameter whose ``grad`` is None, so these are not updated at all.
        steps: name -> the number of updates the parameter received before this one (torch's per-parameter
            ``state["step"]``); absent names count as ``count``.
        count: the number of updates before this one (the step's ``state.count``); None when the step
            decided on the device whether its updates applied (the host does not hold the number): every
            parameter then received as many updates as the optimizer's own count says, unless ``counts``.
        maybe: (a step that decided on the device) the parameters this rank gave no gradient: no rank may
            have, which ``absent`` says on the device.
        absent: a bool tensor on the device, one per name in ``names``: no rank gave it a gradient (read
            only for ``maybe``); None: none is missing.
        counts: an int64 tensor on the device, one per name in ``names``: the updates each received before
            this one, where they may differ (None: as ``count`` says).
        names: the order of ``absent`` and ``counts``.
    """

    missing: frozenset = frozenset()
    steps: Mapping[str, int] | None = None
    count: int | None = 0
    maybe: frozenset = frozenset()
    absent: Any = None
    counts: Any = None
    names: tuple = ()

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """name -> its place in ``names`` (in ``absent`` and ``counts``)."""
        return {n: i for i, n in enumerate(self.names)}

    @property
    def on_device(self) -> bool:
        """Whether part of what it says is on the device (``absent``, ``counts``): read it with :meth:`on_host`."""
        return self.absent is not None or self.counts is not None

    def on_host(self) -> StepInfo:
        """The same, read on the host (one read): which parameters are missing and each one's count."""
        if not self.on_device:
            return self
        parts = [t.to(torch.int64).reshape(-1) for t in (self.absent, self.counts) if t is not None]
        read = torch.cat(parts).tolist()
        absent = read[: len(self.names)] if self.absent is not None else [0] * len(self.names)
        counts = read[-len(self.names) :] if self.counts is not None else None
        missing = self.missing | {n for n, a in zip(self.names, absent) if a and n in self.maybe}
        if counts is None:
            return StepInfo(frozenset(missing), None, self.count)
        lo, hi = min(counts, default=0), max(counts, default=0)
        per = None if lo == hi else dict(zip(self.names, counts))
        return StepInfo(frozenset(missing), per, lo)

    def step_of(self, name: str) -> int:
        """The number of updates parameter ``name`` received before this one."""
        if self.steps is None:
            return self.count
        return self.steps.get(name, self.count)

    @functools.cached_property
    def uniform(self) -> int | None:
        """The number of updates every parameter received before this one, when they agree (None: not)."""
        if self.steps is None:
            return self.count
        values = set(self.steps.values())
        return values.pop() if len(values) == 1 else (self.count if not values else None)


def info_of(extra: Mapping[str, Any]) -> StepInfo | None:
    """The :class:`StepInfo` an ``update`` got (None: called outside a step, as from a notebook)."""
    info = extra.get("info")
    return info if isinstance(info, StepInfo) else None


def pieces_of(view: ParamView | None, key: str, numel: int) -> tuple[Piece, ...]:
    """The pieces of leaf ``key`` (one whole piece of ``numel`` elements when there is no view)."""
    if view is None or key not in view.leaves:
        return (Piece(key, (numel,), 0, 0, numel),)
    return view.leaves[key].pieces


def live_columns(view: ParamView | None, keys: list[str], info: StepInfo | None, *columns: list) -> tuple:
    """``columns`` (lists of tensors, one per key in ``keys``) without the pieces of parameters that got no
    gradient: each leaf whole when all of its parameters got one (the usual case: the lists come back as
    they are), else cut into the views of its live pieces."""
    if info is None or not info.missing:
        return columns
    missing = info.missing
    out: list[list] = [[] for _ in columns]
    for i, k in enumerate(keys):
        numel = columns[0][i].numel()
        pieces = pieces_of(view, k, numel)
        if not any(p.name in missing for p in pieces):
            for o, c in zip(out, columns):
                o.append(c[i])
            continue
        for p in pieces:
            if p.name not in missing:
                for o, c in zip(out, columns):
                    o.append(p.of(c[i]))
    return tuple(out)


def maybe_pieces(view: ParamView | None, keys: list[str], info: StepInfo | None, *columns: list) -> list[tuple]:
    """For a step that decided on the device: each piece of a parameter this rank gave no gradient
    (``info.maybe``), with the device's flag that no rank did (``info.absent``):
    ``[(flag, [the piece of each column]), ...]``; empty in the usual case."""
    if info is None or not info.maybe:
        return []
    out = []
    for i, k in enumerate(keys):
        for p in pieces_of(view, k, columns[0][i].numel()):
            if p.name in info.maybe:
                out.append((info.absent[info.index[p.name]], [p.of(c[i]) for c in columns]))
    return out


def keys_of(spec: Any) -> list[str]:
    """The key (key path) of every leaf of a flattened tree's ``spec``."""
    return [T.keystr(p) for p in spec.paths()]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def by_step(view: ParamView | None, keys: list[str], info: StepInfo | None, count: int, *columns: list) -> list:
    """``columns`` in groups of pieces that share their parameters' update number ``t`` (1 for a parameter's
    first update): ``[(t, columns), ...]``; pieces of parameters that got no gradient are left out. One
    group of whole leaves in the usual case (every parameter updated as often as the others)."""
    if info is None:
        return [(count + 1, columns)]
    base = count if info.count is None else info.count  # None: the optimizer's own count (decided on the device)
    if not info.missing:
        same = base if info.steps is None else info.uniform
        if same is not None:
            return [(same + 1, columns)]
    groups: dict[int, list[list]] = {}
    for i, k in enumerate(keys):
        for p in pieces_of(view, k, columns[0][i].numel()):
            if p.name in info.missing:
                continue
            t = base if info.steps is None else info.steps.get(p.name, base)
            cols = groups.setdefault(t + 1, [[] for _ in columns])
            for o, c in zip(cols, columns):
                o.append(p.of(c[i]))
    return [(t, tuple(cols)) for t, cols in sorted(groups.items())]
