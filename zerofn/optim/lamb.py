"""LAMB (:func:`lamb`) and its per-parameter rule, :func:`scale_by_trust_ratio`.

LAMB scales each parameter's Adam update by its own trust ratio ``||w|| / ||u||``. The norms are of whole
parameters, but under a step the optimizer updates buckets (``{"b0": ..., "b1": ...}``), each holding
pieces of parameters, and under ``shard_optimizer`` and the stages above it only this rank's shard of
each bucket. :func:`scale_by_trust_ratio` therefore binds to the step's
:class:`~zerofn.optim.view.ParamView`: it takes each leaf apart into its parameters' pieces, and sums the
squares of a parameter cut across ranks over every rank that holds a piece of it, so that the update
equals the one a single process computes on the whole parameters, at any world size.

Example:
    >>> import torch
    >>> from zerofn.optim.lamb import lamb
    >>> from zerofn import optim
    >>> params = {"w": torch.full((2, 2), 1.0), "b": torch.zeros(2)}
    >>> opt = lamb(0.1, weight_decay=0.01, mask=optim.decay_mask())
    >>> state = optim.update_params(opt, {"w": torch.ones(2, 2), "b": torch.ones(2)}, opt.init(params), params)
    >>> round(params["w"][0, 0].item(), 6), round(params["b"][0].item(), 6)  # b: ||b|| = 0, so ratio 1
    (0.9, -0.1)
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

from zerofn import collectives as C
from zerofn import counters
from zerofn.optim._checks import FIX_PARAMS, check_count, check_number, check_same, check_state, flat
from zerofn.optim.base import (
    EmptyState,
    GradientTransformation,
    ScalarOrSchedule,
    ScaleByScheduleState,
    bind,
    chain,
    foreach_groups,
)
from zerofn.optim.groups import masked
from zerofn.optim.transforms import add_decayed_weights, scale_by_adam, scale_by_learning_rate
from zerofn.optim.view import ParamView, StepInfo, by_step, info_of, keys_of

__all__ = ["ScaleByTrustRatioState", "lamb", "scale_by_trust_ratio"]

ScaleByTrustRatioState = EmptyState  # optax's name; the transform keeps no state


def lamb(
    lr: ScalarOrSchedule,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    *,
    mask: Any = None,
    bias_correction: bool | str = True,
    min_trust_ratio: float | None = None,
    max_trust_ratio: float | None = None,
    mu_dtype: torch.dtype | None = None,
    nu_dtype: torch.dtype | None = None,
) -> GradientTransformation:
    """LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"), equal to ``optax.lamb``.

    ``chain(scale_by_adam(*betas, eps), add_decayed_weights(weight_decay), scale_by_trust_ratio(),
    scale_by_learning_rate(lr))``, optax's chain, with its defaults (eps 1e-6, no weight decay). Per
    parameter, with ``t`` its own update number::

        m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / (sqrt(v / (1 - b2**t)) + eps) + weight_decay * w
        r = ||w|| / ||u||, or 1 when either norm is 0;  w -= lr * r * u

    This is ``optax.lamb`` with ``eps_root=0`` (zerofn's Adam computes the same quotient in
    ``torch.optim.Adam``'s order of operations, so results agree to float rounding), and apex's
    ``FusedLAMB(adam_w_mode=True, use_nvlamb=True, max_grad_norm=0)``: apex by default scales only the
    groups with non-zero weight decay (the others get Adam's update, ratio 1: write that as a
    ``multi_transform`` of ``lamb`` and ``adam``) and divides the gradients by their clipped global norm
    first (chain :func:`~zerofn.optim.clip_by_global_norm` for that). DeepSpeed's ``FusedLamb`` clamps
    ``r`` to ``[min_coeff, max_coeff]`` (0.01 and 10 by default; ``min_trust_ratio``/``max_trust_ratio``
    here, a zero norm still giving 1), but reads ``r`` off the update before its bias correction, which it
    applies to the step size instead, so its numbers differ: ``bias_correction="step_size"`` is that
    rule (below). ``bias_correction=False`` uses the moments as they are (the paper's algorithm; apex's
    and DeepSpeed's option of that name).

    DeepSpeed's ``FusedLamb`` (``"type": "Lamb"``) is ``lamb(lr, betas, eps, weight_decay,
    bias_correction="step_size", min_trust_ratio=min_coeff, max_trust_ratio=max_coeff)``: the moments
    uncorrected, ``u = m / (sqrt(v) + eps) + weight_decay * w``, its ratio clamped, and the step
    ``w -= lr * sqrt(1 - b2**t) / (1 - b1**t) * r * u`` (``bias_correction=False`` there: ``w -= lr * r
    * u``), equal to DeepSpeed's CUDA kernel up to float rounding (it multiplies in another order).

    A parameter that got no gradient on a step is not updated at all (torch's rule, see
    :class:`~zerofn.optim.view.StepInfo`): its moments and its update count stay, its weight is not
    decayed and its update stays zero.

    Collectives: under a step whose optimizer shards are cut (``shard_optimizer`` and the stages above),
    one all-reduce per update of ``2 x (number of parameters)`` float64 partial sums (see
    :func:`scale_by_trust_ratio`); none at world size 1. The update then runs on the thread that runs the
    step: an ``offload`` that updates on its worker thread (``overlap``, ``delay``, ``early``) cannot
    run it at world size > 1.

    Args:
        lr: learning rate >= 0, or a schedule ``count -> float``.
        betas: ``(b1, b2)``, each in [0, 1).
        eps: added to Adam's denominator, >= 0.
        weight_decay: coefficient >= 0 of the weight added to the update before the trust ratio.
        mask: which parameters decay (a tree of bools over the parameters or a function of the params
            tree returning one, such as :func:`~zerofn.optim.decay_mask`; None: all of them).
        bias_correction: divide Adam's moments by ``1 - b**t`` (optax, and apex's default); False: use
            them as they are; ``"step_size"``: use them as they are and multiply the update after its
            trust ratio by ``sqrt(1 - b2**t) / (1 - b1**t)`` (DeepSpeed's ``FusedLamb``, its default).
        min_trust_ratio: the smallest trust ratio (None: no bound; DeepSpeed's ``min_coeff``).
        max_trust_ratio: the largest trust ratio (None: no bound; DeepSpeed's ``max_coeff``).
        mu_dtype: the first moment's dtype (None: the parameters'; ``torch.bfloat16`` halves it).
        nu_dtype: the second moment's dtype, likewise.

    Returns:
        A ``GradientTransformation``; its state is ``(ScaleByAdamState, [MaskedState or EmptyState],
        EmptyState, [ScaleByScheduleState], ScaleState or ScaleByScheduleState)``, the fourth with
        ``bias_correction="step_size"`` only.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> from zerofn.optim.lamb import lamb
        >>> p = {"w": torch.tensor([3.0, 4.0])}
        >>> opt = lamb(0.1)
        >>> u, _ = opt.update({"w": torch.tensor([1.0, -1.0])}, opt.init(p), p)
        >>> [round(x, 4) for x in u["w"].tolist()]  # Adam's update (1, -1) scaled by 5 / sqrt(2)
        [-0.3536, 0.3536]
    """
    where = f"lamb(lr={lr!r}, betas={betas!r}, eps={eps!r}, weight_decay={weight_decay!r})"
    if not callable(lr):
        check_number(where, "lr", lr, low=0.0, hint="Pass a float >= 0 or a schedule (count -> float).")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"{where}: betas must be a pair (b1, b2), got {betas!r}. Typically (0.9, 0.999).")
    weight_decay = check_number(where, "weight_decay", weight_decay, low=0.0, hint="Typically 0.01.")
    if not isinstance(bias_correction, bool) and bias_correction != "step_size":
        raise TypeError(
            f'{where}: bias_correction must be True, False or "step_size" (DeepSpeed\'s FusedLamb), '
            f"got {bias_correction!r}."
        )
    adam = scale_by_adam(betas[0], betas[1], eps, mu_dtype=mu_dtype, nu_dtype=nu_dtype)
    parts = [adam if bias_correction is True else _without_bias_correction(adam)]
    if weight_decay:
        decay = add_decayed_weights(weight_decay)
        parts.append(decay if mask is None else masked(decay, mask))
    parts.append(scale_by_trust_ratio(min_ratio=min_trust_ratio, max_ratio=max_trust_ratio))
    if bias_correction == "step_size":
        parts.append(_step_size_correction(float(betas[0]), float(betas[1]), None))
    parts.append(scale_by_learning_rate(lr))
    return chain(*parts)


def _step_size_correction(b1: float, b2: float, view: ParamView | None) -> GradientTransformation:
    """Multiply each parameter's update by ``sqrt(1 - b2**t) / (1 - b1**t)``, ``t`` its own update number
    (DeepSpeed's ``FusedLamb`` puts Adam's bias correction in its step size); parameters that got no
    gradient are left as they are. State: ``ScaleByScheduleState(count)``."""
    where = "lamb.update"

    def init(params):
        return ScaleByScheduleState(count=counters.new(0))

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        check_state(where, state, ScaleByScheduleState)
        u, spec = flat(where, "updates", updates)
        count = check_count(where, state.count)
        counters.add_(state.count)
        for t, (cols,) in by_step(view, keys_of(spec), info_of(extra), count, u):
            factor = (1 - b2**t) ** 0.5 / (1 - b1**t)
            for (group,) in foreach_groups(cols):
                torch._foreach_mul_(group, factor)
        return updates, state

    return GradientTransformation(init, update, bind=lambda v: _step_size_correction(b1, b2, v))


# Adam's bias corrections 1 - b**t tend to 1 as t grows; for this t, b**t is exactly 0.0 in float64 for
# every b < 1, so the corrections are exactly 1 and the moments are used as they are.
_NO_CORRECTION_T = 1 << 62


def _without_bias_correction(adam: GradientTransformation) -> GradientTransformation:
    """``adam`` with its bias corrections off: it is told every parameter is at update ``_NO_CORRECTION_T``
    (its state's own count still counts updates; parameters without a gradient are still skipped)."""

    def update(updates, state, params=None, **extra):
        info = info_of(extra)
        missing = info.missing if info is not None else frozenset()
        return adam.update(updates, state, params, **{**extra, "info": StepInfo(missing, None, _NO_CORRECTION_T)})

    return GradientTransformation(adam.init, update, bind=lambda v: _without_bias_correction(bind(adam, v)))


class _Options(NamedTuple):
    min_norm: float
    trust_coefficient: float
    eps: float
    min_ratio: float | None
    max_ratio: float | None


def scale_by_trust_ratio(
    min_norm: float = 0.0,
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
    *,
    min_ratio: float | None = None,
    max_ratio: float | None = None,
) -> GradientTransformation:
    """Scale each parameter's update by its trust ratio ``trust_coefficient * ||w|| / (||u|| + eps)``.

    optax's ``scale_by_trust_ratio`` (the norms raised to at least ``min_norm``; a ratio of 1 where
    either norm is 0), with DeepSpeed's optional clamp of the ratio to ``[min_ratio, max_ratio]``.
    The norms are each whole parameter's, whatever part of it this rank holds:

    - Called on a tree of whole parameters (a notebook), each leaf is one parameter.
    - Under a step (bound to its :class:`~zerofn.optim.view.ParamView`), each bucket is cut into its
      parameters' pieces (one ``split`` per bucket; ``torch._foreach_norm`` over the pieces, then one
      ``torch._foreach_mul_`` by their ratios: no temporary the size of a bucket). Where the buckets are
      sharded, the pieces of parameters cut by a shard boundary contribute their sums of squares to one
      all-reduce per update (every bucket of the call together), of a float64 ``(2, P)`` tensor indexed
      by parameter (P: the parameters in the tree), ``16 P`` bytes; whole pieces keep their local norm.
      Every rank issues it, whatever its shard holds.

    Parameters that got no gradient (``info.missing``) keep their update untouched.

    Args:
        min_norm: the smallest value either norm is taken to have, >= 0.
        trust_coefficient: a factor on the ratio, > 0.
        eps: added to the update's norm, >= 0.
        min_ratio: the smallest ratio (None: no bound), > 0.
        max_ratio: the largest ratio (None: no bound), >= ``min_ratio``.

    Returns:
        A ``GradientTransformation`` with ``EmptyState``; ``update`` needs the params.

    Raises:
        ValueError: at update, a leaf its view does not describe (an optimizer run on sub-groups of a
            bucket, as ``offload("nvme")`` does, cannot see whole parameters), or params missing.
        RuntimeError: at update, a sharded update on another thread than the main one (offload's worker).

    Example:
        >>> import torch
        >>> from zerofn.optim.lamb import scale_by_trust_ratio
        >>> opt = scale_by_trust_ratio()
        >>> p = {"w": torch.tensor([3.0, 4.0]), "z": torch.zeros(2)}
        >>> u, _ = opt.update({"w": torch.tensor([0.0, 2.0]), "z": torch.ones(2)}, opt.init(p), p)
        >>> u["w"].tolist(), u["z"].tolist()  # ||w|| / ||u|| = 5 / 2; z: ||w|| = 0, ratio 1
        ([0.0, 5.0], [1.0, 1.0])
    """
    where = "scale_by_trust_ratio"
    min_norm = check_number(where, "min_norm", min_norm, low=0.0)
    trust_coefficient = check_number(where, "trust_coefficient", trust_coefficient, low=0.0, low_open=True)
    eps = check_number(where, "eps", eps, low=0.0)
    if min_ratio is not None:
        min_ratio = check_number(where, "min_ratio", min_ratio, low=0.0, low_open=True, hint="Or None.")
    if max_ratio is not None:
        max_ratio = check_number(where, "max_ratio", max_ratio, low=min_ratio or 0.0, low_open=min_ratio is None)
    return _scale_by_trust_ratio(_Options(min_norm, trust_coefficient, eps, min_ratio, max_ratio), None)


class _Plan(NamedTuple):
    """How one call's leaves come apart into parameter pieces (fixed for a view and the leaves' layout).

    ``segments[i]``: None when leaf i is one whole piece, else (segment sizes, the segments that are pieces).
    The pieces are numbered in leaf order; ``groups``: the piece numbers of each (device, dtype).
    """

    segments: tuple
    names: tuple[str, ...]  # each piece's parameter
    groups: tuple[tuple[int, ...], ...]
    sharded: bool  # some leaf is a shard: the call all-reduces
    across: tuple  # per group: None, or (positions in the group, parameter indices) of its pieces cut across ranks
    size: int  # parameters in the tree (the all-reduce's columns)


def _plan(view: ParamView, keys: list[str], u: list[torch.Tensor], p: list[torch.Tensor]) -> _Plan:
    where = "scale_by_trust_ratio.update"
    index = {n: i for i, n in enumerate(view.names)}
    segments, names, kinds, partial, sharded = [], [], [], [], False
    for k, t, w in zip(keys, u, p):
        leaf = view.leaves.get(k)
        if leaf is None or leaf.numel != t.numel():
            got = "no entry" if leaf is None else f"{leaf.numel} elements"
            raise ValueError(
                f"{where}: the optimizer's leaf {k!r} ({t.numel()} elements) is not one its view describes "
                f"({got} there). The trust ratio needs each whole parameter's norm, so it must see whole "
                "buckets or their shards as the step hands them over; run on sub-groups of a bucket (a host "
                "engine that streams the state from disk in slices) or on leaves of another tree, it cannot "
                "compute it. Update whole buckets, or call the optimizer on a tree of whole parameters."
            )
        sharded |= leaf.sharded
        pieces = leaf.pieces
        if len(pieces) == 1 and pieces[0].offset == 0 and pieces[0].numel == t.numel():
            segments.append(None)
        else:
            sizes, which, at = [], [], 0
            for piece in pieces:
                if piece.offset > at:
                    sizes.append(piece.offset - at)
                which.append(len(sizes))
                sizes.append(piece.numel)
                at = piece.offset + piece.numel
            if at < t.numel():
                sizes.append(t.numel() - at)
            segments.append((tuple(sizes), tuple(which)))
        for piece in pieces:
            names.append(piece.name)
            kinds.append((t.device, t.dtype, w.dtype))
            partial.append(not piece.whole)
    groups: dict[tuple, list[int]] = {}
    for i, kind in enumerate(kinds):
        groups.setdefault(kind, []).append(i)
    across = []
    for (device, _, _), idx in groups.items():
        at = [j for j, i in enumerate(idx) if partial[i]]
        columns = [index[names[idx[j]]] for j in at]
        across.append((torch.tensor(at, device=device), torch.tensor(columns, device=device)) if at else None)
    grouped = tuple(tuple(g) for g in groups.values())
    return _Plan(tuple(segments), tuple(names), grouped, sharded, tuple(across), len(view.names))


def _pieces(plan: _Plan, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for t, cut in zip(leaves, plan.segments):
        if cut is None:
            out.append(t)
        else:
            sizes, which = cut
            segments = t.view(-1).split(sizes)
            out.extend(segments[j] for j in which)
    return out


def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    dtype = torch.float32 if tensors[0].element_size() < 4 else None  # half precision: reduced in float32
    return torch.stack(torch._foreach_norm(tensors, 2, dtype=dtype))


def _ratio(pn: torch.Tensor, un: torch.Tensor, o: _Options) -> torch.Tensor:
    if o.min_norm:
        pn, un = pn.clamp_min(o.min_norm), un.clamp_min(o.min_norm)
    top = pn * o.trust_coefficient if o.trust_coefficient != 1.0 else pn
    ratio = top / (un + o.eps) if o.eps else top / un
    if o.min_ratio is not None or o.max_ratio is not None:
        ratio = ratio.clamp(o.min_ratio, o.max_ratio)
    return torch.where((pn == 0) | (un == 0), torch.ones_like(ratio), ratio)


def _combine(plan: _Plan, norms: list, device: torch.device) -> list:
    """The norms of the pieces cut across ranks, from every rank's sums of squares: one all-reduce."""
    if C.world_size() > 1 and threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "scale_by_trust_ratio.update: the trust ratio of sharded parameters all-reduces their partial "
            "norms, which must happen on the thread that runs the step, in step order on every rank; this "
            f"update runs on thread {threading.current_thread().name!r}, which updates after the step returns or "
            "during backward. Turn off the overlapped, delayed and early host update (overlap=False, delay=0, "
            "early=False) so that the update runs before the step returns."
        )
    sums = torch.zeros(2, plan.size, dtype=torch.float64, device=device)
    for cut, (pn, un) in zip(plan.across, norms):
        if cut is not None:
            at, columns = cut
            sums[0].index_add_(0, columns.to(device), pn[at].to(device, torch.float64).square())
            sums[1].index_add_(0, columns.to(device), un[at].to(device, torch.float64).square())
    C.all_reduce(sums)
    out = []
    for cut, (pn, un) in zip(plan.across, norms):
        if cut is not None:
            at, columns = cut
            pn = pn.index_copy(0, at, sums[0, columns.to(device)].sqrt().to(pn.device, pn.dtype))
            un = un.index_copy(0, at, sums[1, columns.to(device)].sqrt().to(un.device, un.dtype))
        out.append((pn, un))
    return out


def _scale_by_trust_ratio(o: _Options, view: ParamView | None) -> GradientTransformation:
    where = "scale_by_trust_ratio.update"
    plans: dict = {}  # (keys, shapes, dtypes, devices) -> _Plan: fixed for a bound view and its layout

    def init(params):
        return EmptyState()

    @torch.no_grad()
    def update(updates, state, params=None, **extra):
        if params is None:
            raise ValueError(f"{where}: the trust ratio needs the params; call update(updates, state, params).")
        u, spec = flat(where, "updates", updates)
        p, p_spec = flat(where, "params", params)
        check_same(where, "updates", spec, "params", p_spec, p, u, fix=FIX_PARAMS)
        keys = keys_of(spec)
        sig = (tuple(keys), *(tuple((t.shape, t.dtype, t.device) for t in leaves) for leaves in (u, p)))
        plan = plans.get(sig)
        if plan is None:
            plan = plans[sig] = _plan(view if view is not None else ParamView.of_tree(updates), keys, u, p)
        up, pp = _pieces(plan, u), _pieces(plan, p)
        norms = [(_norms([pp[i] for i in idx]), _norms([up[i] for i in idx])) for idx in plan.groups]
        if plan.sharded:
            norms = _combine(plan, norms, u[0].device if u else torch.device("cpu"))
        info = info_of(extra)
        missing = info.missing if info is not None else frozenset()
        for idx, (pn, un) in zip(plan.groups, norms):
            ratios = _ratio(pn, un, o).unbind()
            live = [j for j, i in enumerate(idx) if plan.names[i] not in missing] if missing else range(len(idx))
            if live:  # no gradient: the update stays as it is (zero), not even multiplied
                torch._foreach_mul_([up[idx[j]] for j in live], [ratios[j] for j in live])
        return updates, state

    talks = view is not None  # whole parameters' norms: sums over pieces, all-reduced where sharded
    return GradientTransformation(init, update, bind=lambda v: _scale_by_trust_ratio(o, v), communicates=talks)
