"""The fused in-place Adam/AdamW path: torch's ``fused_adam(w)_`` kernels.

:func:`~zerofn.optim.alias.adam` and :func:`~zerofn.optim.alias.adamw` attach
``fused_adam`` as their ``update_in_place``, which :func:`~zerofn.optim.base.update_params`
takes; it falls back to the equivalent chain of primitives where the kernel
does not apply (see ``_fusable``).
"""

from __future__ import annotations

import torch

from zerofn import counters
from zerofn.optim._checks import check_count, flat, schedule_at, schedule_value
from zerofn.optim.base import apply_updates, foreach_groups, skip_on_host
from zerofn.optim.view import LeafView, ParamView, Piece, by_step, info_of, keys_of, pieces_of

_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def fused_adam(base, adam_at, lr, b1, b2, eps, weight_decay, *, decoupled: bool, view=None, decayed=None):
    """In-place Adam/AdamW through torch's fused kernel, one pass over memory.

    ``base`` is the same optimizer as a chain of primitives: its state layout
    is shared, and it runs instead wherever the kernel does not apply
    (another device, mixed dtypes within a group, narrow moments). Every count
    in the chain's state advances exactly as ``base.update`` would advance it.
    ``view`` is the :class:`~zerofn.optim.view.ParamView` it is bound to (None:
    unbound); ``decayed``, the keys weight decay applies to (None: every key).
    Parameters that got no gradient are left out of the kernel's lists, and
    parameters with different update numbers go in separate calls. On CPU each
    leaf goes to the kernel in runs that end where a parameter's own tensor
    would (see :func:`_runs`), so that every element rounds as under torch's
    per-parameter calls.
    """
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
    runs_of: dict = {}  # (keys, itemsizes) -> the runs' keys, their view and where they lie (one per layout)

    def check_lr(value: float, count: int) -> None:
        if value < 0:
            raise ValueError(
                f"adam.update_in_place: the learning-rate schedule returned {value} at count {count}; it must be >= 0"
            )

    @torch.no_grad()
    def update_in_place(grads, state, params, **extra):
        found = extra.pop("found_inf", None)
        g, spec = flat("adam.update_in_place", "grads", grads)
        p, p_spec = flat("adam.update_in_place", "params", params)
        adam = state[adam_at]
        mu, _ = flat("adam.update_in_place", "state.mu", adam.mu)
        nu, _ = flat("adam.update_in_place", "state.nu", adam.nu)
        info = info_of(extra)
        fusable = spec == p_spec and all(_fusable(*ts) for ts in zip(p, g, mu, nu))
        if found is not None and not (fusable and _masks_here(found, adam.count, p, info)):
            if skip_on_host(extra, found):  # an update the kernel cannot skip on the device
                return state
            found, info = None, info_of(extra)
        if not fusable:
            updates, state = base.update(grads, state, params, **extra)
            apply_updates(params, updates)
            return state
        if found is None:
            count = check_count("adam.update_in_place", adam.count)
            lr_value = schedule_value("adam.update_in_place", lr, count) if callable(lr) else lr
            check_lr(lr_value, count)
            _advance_counts(state)  # of adam, the lr schedule and the decay schedule (masked or not)
        else:  # the device decides: the kernel skips where found_inf is 1, and the counts advance where it is 0
            count = 0  # one group below: every parameter counts adam.count's updates
            lr_value = schedule_at("adam.update_in_place", lr, adam.count, check_lr) if callable(lr) else lr
            if isinstance(lr_value, torch.Tensor) and lr_value.device.type != "cpu":
                lr_value = lr_value.float()  # CUDA's kernel reads a tensor lr as float32 (the CPU's, as a double)
            _advance_counts(state, found == 0)
            number = adam.count.float()  # this update's number where it applies
        keys = keys_of(spec)
        one_kind = len({(t.device, t.dtype) for t in p}) == 1
        wd = [weight_decay if decayed is None or k in decayed else 0.0 for k in keys]
        # parameters some of which may have gone without a gradient, or received unequal numbers of updates
        each = found is not None and info is not None and (bool(info.maybe) or info.counts is not None)
        for decay in sorted(set(wd)):
            pick = [i for i, w in enumerate(wd) if w == decay]
            cols = ([k for i, k in enumerate(keys) if i in pick],) + tuple([c[i] for i in pick] for c in (p, g, mu, nu))
            if each:

                def call(columns: list, skip: torch.Tensor, decay: float = decay) -> None:
                    kernel(*columns[:4], [], columns[4], lr=lr_value, beta1=b1, beta2=b2, weight_decay=decay,
                           eps=eps, amsgrad=False, maximize=False, found_inf=skip)  # fmt: skip

                _each_parameter(call, view, info, found, number, *cols)
                continue
            at = view
            if view is not None and all(t.device.type == "cpu" for t in cols[1]):
                at, cols = _cut(runs_of, view, *cols, keep=(0, 2, 3))  # params and moments: the same tensors
            for t, (p_, g_, mu_, nu_) in by_step(at, cols[0], info, count, *cols[1:]):
                # each leaf's parameter, gradient and moments share its dtype and device (_fusable), and so do
                # its runs: one group where the leaves do
                groups = [(p_, g_, mu_, nu_)] if one_kind else foreach_groups(p_, g_, mu_, nu_)
                for p2, g2, mu2, nu2 in groups:
                    if found is None:
                        step = torch.full((), float(t), dtype=torch.float32, device=p2[0].device)
                    kernel(
                        p2,
                        g2,
                        mu2,
                        nu2,
                        [],
                        [step if found is None else number] * len(p2),
                        lr=lr_value,
                        beta1=b1,
                        beta2=b2,
                        weight_decay=decay,
                        eps=eps,
                        amsgrad=False,
                        maximize=False,
                        found_inf=found,
                    )
        return state

    return update_in_place


# A multiple of every vector width torch's CPU kernels use (AVX2 32 bytes, AVX-512 and SVE up to 256).
_RUN_BYTES = 256


def _runs(view: ParamView, keys: list[str], itemsizes: list[int]) -> tuple[list[str], ParamView, list]:
    """The leaves ``keys`` of ``view`` cut into runs of contiguous pieces, each run ending after the first
    piece whose size is not a multiple of ``_RUN_BYTES``: ``(run keys, their view, where they lie)`` (see
    :func:`_spans`).

    torch's CPU fused Adam computes a tensor's last ``numel % vector width`` elements in scalar code,
    which rounds differently from its vector code (no fused multiply-add); torch calls it once per
    parameter. A run's tail is then its last parameter's own tail, and every other element goes through
    the vector code as in torch's call: the same bits. Padding after a leaf's last piece is left out (its
    parameters, moments and gradients are zeros, which an update leaves zeros).
    """
    run_keys, leaves, where = [], {}, []
    for i, (k, item) in enumerate(zip(keys, itemsizes)):
        leaf = view.leaves.get(k)
        if leaf is None:  # not the step's view (a tree of whole tensors): the leaf as it is
            run_keys.append(k)
            where.append((i, None, None))
            continue
        groups: list[list[Piece]] = []
        for piece in leaf.pieces:
            last = groups[-1][-1] if groups else None
            if last is not None and last.offset + last.numel == piece.offset and (last.numel * item) % _RUN_BYTES == 0:
                groups[-1].append(piece)
            else:
                groups.append([piece])
        for j, run in enumerate(groups):
            lo, hi = run[0].offset, run[-1].offset + run[-1].numel
            key = f"{k}[{j}]"
            pieces = tuple(Piece(q.name, q.shape, q.start, q.offset - lo, q.numel) for q in run)
            leaves[key] = LeafView(pieces, hi - lo, leaf.sharded)
            run_keys.append(key)
            where.append((i, lo, hi))
    at = ParamView(leaves, view.treedef, view.names, view.shapes, view.dtypes, view.trainable)
    return run_keys, at, _spans(where)


def _spans(where: list) -> list[tuple[int, int | None, list[int] | None]]:
    """``where``'s runs as stretches that lie end to end in one leaf: ``(leaf index, start, run sizes)``, each
    cut from its leaf with one split (a leaf taken whole: ``(index, None, None)``)."""
    spans: list = []
    for i, lo, hi in where:
        last = spans[-1] if spans else None
        if lo is None:
            spans.append((i, None, None))
        elif last is not None and last[0] == i and last[1] is not None and last[1] + sum(last[2]) == lo:
            last[2].append(hi - lo)
        else:
            spans.append((i, lo, [hi - lo]))
    return spans


def _cut(cache: dict, view: ParamView, keys: list[str], *columns: list, keep: tuple[int, ...] = ()) -> tuple:
    """``(view of the runs, (run keys, *columns cut into runs))`` for the kernel on CPU (see :func:`_runs`).
    The columns at the positions ``keep`` (the parameters and the moments: the same memory from update to
    update) are cut once and their runs kept while they lie where they lay; the others (the gradients, new
    each update) every time."""
    sizes = [t.element_size() for t in columns[0]]
    key = (tuple(keys), tuple(sizes))
    if key not in cache:
        cache[key] = _runs(view, keys, sizes)
    run_keys, at, spans = cache[key]

    def runs(c: list) -> list:
        out = []
        for i, lo, sizes in spans:
            if lo is None:
                out.append(c[i])
                continue
            t = c[i] if c[i].dim() == 1 else c[i].view(-1)
            if len(sizes) == 1:
                out.append(t[lo : lo + sizes[0]])
            else:  # one call for the stretch's runs, not one per run
                out.extend(t[lo : lo + sum(sizes)].split_with_sizes(sizes))
        return out

    out = []
    for j, c in enumerate(columns):
        if j not in keep:
            out.append(runs(c))
            continue
        # The same memory (a shard's slice is a new tensor each update, over the same bytes): the kept runs
        # view it. They hold its storage, so no other tensor can have these addresses meanwhile.
        where_now = [(t.data_ptr(), t.numel(), t.dtype) for t in c]
        kept = cache.get((key, j))
        if kept is None or kept[0] != where_now:
            kept = cache[(key, j)] = (where_now, runs(c))
        out.append(kept[1])
    return at, (run_keys, *out)


def _advance_counts(node, ok: torch.Tensor | None = None) -> None:
    """Add one to every ``count`` of the chain's states, nested ones (a masked decay schedule's) included;
    ``ok``: a 0-dim bool on the device, where the device decides whether this update applies."""
    if not isinstance(node, tuple):
        return
    c = getattr(node, "count", None) if hasattr(node, "_fields") else None
    if isinstance(c, torch.Tensor):
        if ok is None:
            counters.add_(c)
        else:
            counters.advance_(c, ok)
    for child in node:
        _advance_counts(child, ok)


def _masks_here(found: torch.Tensor, count: torch.Tensor, params: list, info) -> bool:
    """Whether the kernel can take the device's decision as it is: the decision, the counts and the
    parameters on one device, and what the step says of the parameters there too (or nothing to say)."""
    dev = params[0].device if params else found.device
    if found.device != dev or count.device != dev:
        return False
    if info is None:
        return True
    if info.missing or info.steps is not None:
        return False
    return all(t is None or t.device == dev for t in (info.absent, info.counts))


def _each_parameter(call, view, info, found: torch.Tensor, number: torch.Tensor, keys: list, *columns) -> None:
    """The kernel on each parameter's piece of the leaves (``columns``: params, grads, moments), for a step
    that decided on the device while some parameters may have gone without a gradient (``info.maybe``) or
    received unequal numbers of updates (``info.counts``): each piece's step number is its own count plus one,
    on the device; a piece of a parameter no rank may have given a gradient goes in a call of its own, skipped
    where the device says none did (torch skips a parameter whose grad is None). ``call(columns, found_inf)``
    runs the kernel; ``number``: the update's number where every parameter counts alike."""
    numbers = (info.counts + 1).float() if info.counts is not None else None
    common: list[list] = [[] for _ in range(5)]
    for i, k in enumerate(keys):
        for piece in pieces_of(view, k, columns[0][i].numel()):
            views = [piece.of(c[i]) for c in columns]
            at = info.index.get(piece.name)
            step = numbers[at] if numbers is not None and at is not None else number
            if piece.name in info.maybe:
                skip = torch.maximum(found, info.absent[at].to(found.dtype))
                call([[v] for v in views] + [[step]], skip)
            else:
                for column, v in zip(common, [*views, step]):
                    column.append(v)
    for group in foreach_groups(*common) if common[0] else ():
        call(list(group), found)


def _fusable(*tensors: torch.Tensor) -> bool:
    """The fused kernel takes a parameter, its gradient and moments of one dtype on one device."""
    first = tensors[0]
    return (
        first.device.type in _FUSED_DEVICES
        and first.dtype in _FUSED_DTYPES
        and all(t.dtype == first.dtype and t.device == first.device for t in tensors)
    )
