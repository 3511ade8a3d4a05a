"""``gathered``: every unit of a state gathered once for a block of forwards (generation), then released.
It drives a :class:`~zerofn.transforms.shard_params._runner.Runner` through its public methods and leaves
the whole parameters where :class:`~zerofn.transforms.shard_params._storage.UnitStorage`'s forward finds
them (``HELD_WHOLE``)."""

from __future__ import annotations

import contextlib

from zerofn.transforms.shard_params._storage import HELD_WHOLE, HeldWhole, UnitStorage

from zerofn import collectives as C
from zerofn import tree as T
from zerofn.state import TrainState
from zerofn.step import Step


@contextlib.contextmanager
def gathered(step: Step, state: TrainState, /, *, max_bytes: int | None = None):
    """Gather every unit of ``state`` once, for a block of ``step.apply`` calls (generation), then release.

    Under ``shard_params`` each ``step.apply`` gathers every unit and releases
    it: a model's whole bytes cross the ranks for every call, so for every
    token ``zf.generate`` chooses. Inside this block each ``step.apply(state,
    ...)`` of this state runs on the parameters gathered on entering it and
    issues no collective of its own; they are released on leaving it.
    ``zf.generate(..., gather_once=True)`` runs its loop inside it.

    Memory: the whole model, as the state holds it (amp's compute dtype,
    quantize's codes), on every rank for the block's span, where a call
    gathers one unit at a time (and ``prefetch`` more). Without
    ``shard_params`` the rank holds it already and this does nothing.

    Collective: every rank of the step's group enters it with the same
    step and state (it all-gathers every unit, in order). The block is for
    that state: a step that trains it (donating it) leaves the block
    nothing to run on; a step's ``apply`` of another state gathers per call.

    Args:
        step, state: a Step and its state (any composition).
        max_bytes: the most bytes the gathered units may take on a rank;
            None: no limit. Exceeding it raises before anything is gathered.

    Raises:
        ValueError: ``max_bytes`` is not an int >= 0, or the whole model
            takes more bytes than it on a rank.

    Example:
        >>> import torch, zerofn as zf
        >>> from zerofn.transforms import shard_params
        >>> from zerofn.transforms.shard_params import gathered
        >>> apply = zf.functional(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)))
        >>> step = shard_params(zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.adamw(1e-3)))
        >>> state = step.init(apply.params)
        >>> with gathered(step, state, max_bytes=2**20):
        ...     outs = [step.apply(state, torch.ones(1, 4)) for _ in range(3)]
        >>> outs[0].shape
        torch.Size([1, 1])
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"shard_params.gathered: max_bytes must be an int >= 0 or None, got {max_bytes!r}")
    storage = getattr(step, "storage", None)
    if not isinstance(storage, UnitStorage):  # the rank holds the whole parameters already
        yield
        return
    held = HELD_WHOLE.get()
    if held is not None and held.state is state:  # gathered already, by an enclosing block
        yield
        return
    with C.group_scope(step.group):
        step.check_state(state)
        layout = state.spec.layout
        whole = C.world_size() == 1 and storage.param_placement == "device"  # nothing to gather: views
        need = 0 if whole else sum(b.nbytes for b in (*layout.buckets, *layout.frozen_buckets))
        if max_bytes is not None and need > max_bytes:
            raise ValueError(
                f"shard_params.gathered: gathering every unit takes {need:,} bytes ({need / 2**30:.2f} GiB) on "
                f"each rank, more than max_bytes={max_bytes:,}. Gather per call instead, one unit at a time "
                "(zf.generate without gather_once, step.apply outside the block), or raise max_bytes."
            )
        functional = step.model()
        runner = storage.runner(state, functional)
        try:
            runner.unwatch()  # the block's calls run on whole parameters: no unit opens or closes
            for unit in runner.units:  # every gather in flight, in the same order on every rank
                runner.gather(unit)
            for unit in runner.units:
                runner.ensure(unit)
            params = T.tree_unflatten(state.spec.treedef, [runner.leaves[n] for n in layout.names])
        except BaseException:
            runner.close()
            raise
    token = HELD_WHOLE.set(HeldWhole(state, functional, params))
    try:
        yield
    finally:
        HELD_WHOLE.reset(token)
        runner.close()
