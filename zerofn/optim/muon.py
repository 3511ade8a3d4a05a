"""Muon: momentum orthogonalised per weight matrix by a Newton-Schulz iteration (:func:`muon`).

The math is ``torch.optim.Muon``'s, operation for operation: the momentum buffer
``buf.lerp_(g, 1 - momentum)``; the direction ``g.lerp(buf, momentum)`` (Nesterov) or ``buf``; its
orthogonalisation, ``ns_steps`` quintic Newton-Schulz iterations in bfloat16 on the matrix scaled to
norm 1 (on its transpose when it is taller than wide); decoupled weight decay ``p *= 1 - lr *
weight_decay``; then ``p -= adjusted_lr * O``, with ``adjusted_lr`` the learning rate scaled by the
matrix's shape (``adjust_lr_fn``).

Everything but the orthogonalisation is elementwise and runs on whatever part of a parameter a rank
holds. The orthogonalisation needs the whole matrix: when a rank updates a shard of a bucket
(``shard_optimizer``, ``shard_grads``, ``shard_params``), the ranks all-gather the bucket's direction,
in bfloat16 (the iteration's first step rounds its input to bfloat16, so nothing is lost), and each
rank orthogonalises the matrices that overlap its shard and keeps its slice of the result. A matrix
that spans two shards is orthogonalised by both ranks, on the same numbers, so they agree.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from zerofn import alloc, counters
from zerofn import collectives as C
from zerofn.optim._checks import (
    check_count,
    check_number,
    check_same,
    check_state,
    flat,
    is_real,
    schedule_value,
)
from zerofn.optim.base import GradientTransformation, ScalarOrSchedule, in_place
from zerofn.optim.view import ParamView, info_of, keys_of
from zerofn.tree import Tree, tree_map

__all__ = ["MuonState", "muon"]

_ADJUST = (None, "original", "match_rms_adamw")

NOT_A_MATRIX = """\
{where}: {what}, but Muon orthogonalises weight matrices: it takes 2-D parameters only (as \
torch.optim.Muon does). Give it the matrices and route every other parameter (biases, norm weights, \
embeddings if your recipe says so) to AdamW with zf.optim.multi_transform:

    opt = zf.optim.multi_transform(
        {{"muon": zf.optim.muon(lr=0.02), "adamw": zf.optim.adamw(3e-4, weight_decay=0.01)}},
        lambda params: {{n: "muon" if p.ndim == 2 else "adamw" for n, p in params.items()}},
    )"""


class MuonState(NamedTuple):
    """``count``: int64 0-dim CPU tensor, the number of updates so far (a schedule's argument);
    ``momentum``: the momentum buffer, shaped like the params (torch's ``momentum_buffer``)."""

    count: torch.Tensor
    momentum: Tree


class _Options(NamedTuple):
    lr: ScalarOrSchedule
    weight_decay: float
    momentum: float
    nesterov: bool
    ns_coefficients: tuple[float, float, float]
    eps: float
    ns_steps: int
    adjust_lr_fn: str | None


class _Matrix(NamedTuple):
    """One matrix's piece in a leaf: where it lies (the view's Piece) and its learning-rate factor."""

    name: str
    shape: tuple[int, int]
    start: int  # the first of its elements in the leaf
    offset: int  # where that element lies in the leaf
    numel: int  # how many of its elements lie here
    whole: bool
    ratio: float  # adjusted_lr / lr


def muon(
    lr: ScalarOrSchedule = 1e-3,
    weight_decay: float = 0.1,
    momentum: float = 0.95,
    nesterov: bool = True,
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    eps: float = 1e-7,
    ns_steps: int = 5,
    adjust_lr_fn: str | None = None,
) -> GradientTransformation:
    """Muon, equal to ``torch.optim.Muon`` (same options, defaults and order of operations), for 2-D
    parameters.

    Each step: ``buf = lerp(buf, g, 1 - momentum)``; ``d = lerp(g, buf, momentum)`` with ``nesterov``,
    else ``buf``; ``O`` = ``ns_steps`` Newton-Schulz iterations on ``d`` in bfloat16;
    ``p *= 1 - lr * weight_decay``; ``p -= adjusted_lr * O``. A parameter that got no gradient on a
    step (:class:`~zerofn.optim.view.StepInfo`) is skipped, as torch skips ``grad is None``: its
    momentum stays, it is not decayed, its update is zero.

    Muon is for the weight matrices of hidden layers; give biases, norms and (usually) embeddings and
    the output head to AdamW through :func:`~zerofn.optim.multi_transform`, as Muon's users do::

        opt = zf.optim.multi_transform(
            {"muon": zf.optim.muon(lr=0.02), "adamw": zf.optim.adamw(3e-4, weight_decay=0.01)},
            lambda params: {n: "muon" if p.ndim == 2 else "adamw" for n, p in params.items()},
        )

    Collectives: none on whole parameters (no sharding of the optimizer). Under ``shard_optimizer``,
    ``shard_grads`` or ``shard_params``, one all-gather per bucket per step of the bucket's direction
    in bfloat16: ``2 * padded`` bytes counted per bucket (each rank receives ``(N - 1) / N`` of it),
    the next bucket's gather in flight while this one's matrices are orthogonalised; it needs one
    bfloat16 copy of at most two buckets at a time, beyond the momentum buffer (one per element, in
    the parameters' dtype). Every rank orthogonalises the matrices overlapping its shard.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> float`` (count 0 at the first update).
        weight_decay: decoupled weight decay coefficient >= 0 (multiplies ``lr``, not the adjusted one).
        momentum: momentum factor >= 0.
        nesterov: use Nesterov momentum.
        ns_coefficients: the coefficients ``(a, b, c)`` of the quintic Newton-Schulz iteration.
        eps: the smallest norm the direction is divided by, >= 0.
        ns_steps: Newton-Schulz iterations, an int in [0, 100).
        adjust_lr_fn: ``None`` or ``"original"``: ``lr * sqrt(max(1, rows / cols))`` (Keller Jordan's);
            ``"match_rms_adamw"``: ``lr * 0.2 * sqrt(max(rows, cols))`` (Moonshot's, to reuse AdamW's
            learning rate and weight decay).

    Returns:
        A ``GradientTransformation`` with :class:`MuonState`; ``update`` needs the params.

    Raises:
        TypeError / ValueError: an option out of range (at the call); a parameter that is not 2-D (at
            ``init`` or ``update``, naming it).

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> from zerofn.optim.muon import muon
        >>> w = torch.zeros(3, 3)
        >>> opt = muon(lr=1.0, weight_decay=0.0, momentum=0.0)
        >>> g = {"w": torch.tensor([[3.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 0.5]])}
        >>> state = optim.update_params(opt, g, opt.init({"w": w}), {"w": w})
        >>> s = torch.linalg.svdvals(w)  # the update is nearly orthogonal: singular values near 1
        >>> bool(((s > 0.5) & (s < 1.5)).all()), int(state.count)
        (True, 1)
    """
    where = (
        f"muon(lr={lr!r}, weight_decay={weight_decay!r}, momentum={momentum!r}, nesterov={nesterov!r}, "
        f"ns_steps={ns_steps!r}, adjust_lr_fn={adjust_lr_fn!r})"
    )
    if not callable(lr):
        lr = check_number(where, "lr", lr, low=0.0, hint="Pass a float >= 0 or a schedule (count -> float).")
    weight_decay = check_number(where, "weight_decay", weight_decay, low=0.0, hint="Typically 0.1.")
    momentum = check_number(where, "momentum", momentum, low=0.0, hint="Typically 0.95.")
    if not isinstance(nesterov, bool):
        raise TypeError(f"{where}: nesterov must be a bool, got {type(nesterov).__name__} {nesterov!r}.")
    if not (isinstance(ns_coefficients, (tuple, list)) and len(ns_coefficients) == 3) or not all(
        is_real(c) for c in ns_coefficients
    ):
        raise TypeError(
            f"{where}: ns_coefficients must be three real numbers (a, b, c), got {ns_coefficients!r}. "
            "Typically (3.4445, -4.7750, 2.0315)."
        )
    eps = check_number(where, "eps", eps, low=0.0, hint="Typically 1e-7.")
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or not 0 <= ns_steps < 100:
        raise ValueError(f"{where}: ns_steps must be an int in [0, 100), got {ns_steps!r}. Typically 5.")
    if adjust_lr_fn not in _ADJUST:
        raise ValueError(f"{where}: adjust_lr_fn must be one of {_ADJUST}, got {adjust_lr_fn!r}.")
    coefficients = tuple(float(c) for c in ns_coefficients)
    options = _Options(lr, weight_decay, momentum, nesterov, coefficients, eps, ns_steps, adjust_lr_fn)
    return _muon(options, None)


def _muon(options: _Options, view: ParamView | None) -> GradientTransformation:
    where = "muon.update"
    bound = _plan(view, options.adjust_lr_fn, "muon") if view is not None else None  # refuses non-matrices early

    def plan_of(tree: Any, what: str) -> dict[str, _Leaf]:
        return bound if bound is not None else _plan(ParamView.of_tree(tree), options.adjust_lr_fn, what)

    def init(params):
        flat("muon.init", "params", params)
        plan_of(params, "muon.init")
        return MuonState(
            count=counters.new(0),
            momentum=tree_map(lambda p: alloc.zeros_like(p), params),
        )

    @torch.no_grad()
    def update_in_place(grads, state, params, **extra):
        check_state(where, state, MuonState)
        g, spec = flat(where, "updates", grads)
        buf, buf_spec = flat(where, "state.momentum", state.momentum)
        check_same(where, "updates", spec, "state.momentum", buf_spec, buf, g, dtypes=True)
        if params is None:
            raise ValueError(f"{where}: muon needs the params; call update(updates, state, params).")
        p, p_spec = flat(where, "params", params)
        check_same(where, "updates", spec, "params", p_spec, p, g)
        count = check_count(where, state.count)
        lr = options.lr
        if callable(lr):
            lr = schedule_value(where, lr, count)
            if lr < 0:
                raise ValueError(
                    f"{where}: the learning-rate schedule returned {lr} at count {count}; a learning rate must "
                    "be >= 0. Check the schedule's arguments (e.g. end_value and decay_steps)."
                )
        plan = plan_of(grads, where)
        keys = keys_of(spec)
        unknown = [k for k in keys if k not in plan]
        if unknown:
            raise ValueError(
                f"{where}: the updates have leaves {unknown[:4]} that the view this muon was bound to does not "
                f"describe (it has {sorted(plan)[:4]}). Bind it to the view of these leaves: zf.optim.bind(opt, view)."
            )
        info = info_of(extra)
        missing = info.missing if info is not None else frozenset()
        counters.add_(state.count)
        # Each bucket's direction first (its gather started), then the previous bucket's matrices, so
        # that one gather is in flight while the CPU or GPU orthogonalises.
        previous = None
        for i, key in enumerate(keys):
            leaf = plan[key]
            live = _Leaf([m for m in leaf.matrices if m.name not in missing], leaf.sharded)
            current = _direction(options, g[i], buf[i], live)
            if previous is not None:
                _apply(options, lr, *previous)
            previous = (current, p[i], live)
        if previous is not None:
            _apply(options, lr, *previous)
        return state

    pure = in_place(init, update_in_place, "muon")
    talks = bound is not None  # whole matrices: gathered where a bucket is sharded
    return pure._replace(bind=lambda v: _muon(options, v), communicates=talks)


class _Leaf(NamedTuple):
    """The matrices (pieces) one leaf holds, and whether other ranks hold the rest of its bucket."""

    matrices: list[_Matrix]
    sharded: bool


def _plan(view: ParamView, adjust: str | None, where: str) -> dict[str, _Leaf]:
    """key -> the matrices (pieces) its leaf holds; a ValueError naming the parameters that are not 2-D."""
    out, bad = {}, {}
    for key, leaf in view.leaves.items():
        matrices = []
        for piece in leaf.pieces:
            if len(piece.shape) != 2:
                bad[piece.name] = tuple(piece.shape)
                continue
            rows, cols = piece.shape
            matrices.append(
                _Matrix(
                    piece.name,
                    (rows, cols),
                    piece.start,
                    piece.offset,
                    piece.numel,
                    piece.whole,
                    _ratio(adjust, rows, cols),
                )
            )
        out[key] = _Leaf(matrices, leaf.sharded)
    if bad:
        if len(bad) == 1:
            ((name, shape),) = bad.items()
            what = f"parameter {name!r} has shape {shape}"
        else:
            named = [f"{n!r} (shape {shape})" for n, shape in sorted(bad.items())]
            more = f" and {len(named) - 3} more" if len(named) > 3 else ""
            what = f"parameters {', '.join(named[:3])}{more} are not 2-D"
        raise ValueError(NOT_A_MATRIX.format(where=where, what=what))
    return out


def _ratio(adjust: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's ``_adjust_lr`` as a factor of ``lr``."""
    if adjust is None or adjust == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))


class _Direction(NamedTuple):
    """A leaf's direction: in place (``local``, the leaf's own elements) or gathered (``full``, the
    whole bucket in bfloat16, ``lo`` where this rank's shard starts in it, ``handle`` its gather)."""

    local: torch.Tensor
    full: torch.Tensor | None = None
    lo: int = 0
    handle: Any = None


def _direction(options: _Options, g: torch.Tensor, buf: torch.Tensor, leaf: _Leaf) -> _Direction:
    """The momentum update and the direction of every live piece of one leaf; for a sharded leaf, its
    gather started (every rank gathers every sharded leaf, live pieces or not, in the same order)."""
    g1, b1 = g.view(-1), buf.view(-1)
    for m in leaf.matrices:
        # torch's order: buf.lerp_(grad, 1 - momentum), then grad.lerp(buf, momentum) (written into the
        # gradient, which the update owns). Whole pieces in their own shape, as torch runs them.
        gm, bm = _piece(g1, m), _piece(b1, m)
        bm.lerp_(gm, 1 - options.momentum)
        if options.nesterov:
            gm.lerp_(bm, options.momentum)
    local = g1 if options.nesterov else b1
    if not leaf.sharded:
        return _Direction(local)
    world, n = C.world_size(), local.numel()
    lo = C.rank() * n
    full = torch.empty(world * n, dtype=torch.bfloat16, device=local.device)
    mine = full[lo : lo + n]
    mine.copy_(local)  # the rounding the iteration starts with, done before the gather: half the bytes
    return _Direction(local, full, lo, C.all_gather(full, mine, async_op=True))


def _piece(flat_leaf: torch.Tensor, m: _Matrix) -> torch.Tensor:
    part = flat_leaf[m.offset : m.offset + m.numel]
    return part.view(m.shape) if m.whole else part


def _apply(options: _Options, lr: float, d: _Direction, p: torch.Tensor, leaf: _Leaf) -> None:
    """Orthogonalise each live matrix of one leaf and update its part of the parameters."""
    if d.handle is not None:
        d.handle.wait()
    p1 = p.view(-1)
    decay = 1 - lr * options.weight_decay
    for m in leaf.matrices:
        if d.full is None:
            o = _orthogonalise(_piece(d.local, m), options, scratch=options.nesterov)
        else:
            at = d.lo + m.offset - m.start  # where the whole matrix lies in the gathered bucket
            o = _orthogonalise(d.full[at : at + m.shape[0] * m.shape[1]].view(m.shape), options, scratch=True)
            if not m.whole:
                o = o.reshape(-1)[m.start : m.start + m.numel]
        pm = _piece(p1, m)
        if options.weight_decay != 0.0:  # torch multiplies by 1.0 here: the same numbers
            pm.mul_(decay)
        pm.add_(o, alpha=-(lr * m.ratio))


def _orthogonalise(d: torch.Tensor, options: _Options, *, scratch: bool) -> torch.Tensor:
    """torch.optim.Muon's ``_zeropower_via_newtonschulz``, operation for operation. ``scratch``: ``d``
    may be overwritten (a bfloat16 ``d`` is otherwise copied first: torch would scale the momentum
    buffer itself in place there, with nesterov=False on bfloat16 parameters)."""
    a, b, c = options.ns_coefficients
    x = d.bfloat16()
    if not scratch and x.data_ptr() == d.data_ptr():
        x = x.clone()
    tall = d.size(0) > d.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=options.eps))
    for _ in range(options.ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    return x.T if tall else x
