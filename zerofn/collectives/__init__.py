"""The one module that talks to torch.distributed, and the byte accounting.

Every collective here is the identity at world size 1 with no process group,
so a single-process reference costs nothing. Under torchrun the default
process group is joined by :func:`init` (``step.init`` calls it, and so does
the first collective), from the environment torchrun sets: gloo for CPU
tensors, nccl when CUDA is present; ``zf.spawn`` and ``zf.RankPool`` ranks
have joined when they start. Asking :func:`rank` or :func:`world_size` joins
nothing: before the join they read torchrun's ``RANK`` and ``WORLD_SIZE``.

Every function takes ``group=``, a torch ``ProcessGroup``; the default is the
*current group*: the one :func:`group_scope` made current around the call
(a ``contextvars`` variable, so it holds per thread and per asyncio task),
else the default group. :func:`rank` and :func:`world_size` are this rank's
place and the size within it; the small CPU messages go on a gloo group of
its own over the same ranks (made on its first use, only by its members),
:func:`counting` counts the current group's traffic, and timeouts are the
group's. A thread started inside a scope does not inherit it: wrap the
function it runs with :func:`with_current_group` where it is launched.

Every wait on another rank is bounded by ``ZEROFN_TIMEOUT_S`` seconds
(default 600), read when the group is created: under torchrun by
:func:`init`, under ``zf.spawn`` and ``zf.RankPool`` in each rank as it
starts, for a subgroup by :func:`new_group` (one from ``dist.new_group``
keeps the timeout given there). A collective
that some rank never joins (a rank calling ``step.full_params`` alone, a save
on some ranks only) then raises :class:`CollectiveTimeoutError` on the ranks
that wait, naming the call; one that fails because another rank is gone
raises :class:`CollectiveError`.

Traffic is counted the way the ZeRO paper counts it: an all-reduce of a
tensor of n bytes costs 2n (a reduce-scatter plus an all-gather), a
reduce-scatter or an all-gather whose full tensor has n bytes costs n. At
world size 1 nothing travels and nothing is counted.

Example:
    >>> import torch
    >>> from zerofn import collectives as C
    >>> with C.counting() as c:
    ...     x = C.all_reduce(torch.ones(4), op="mean")
    >>> x.tolist(), c.bytes   # world size 1: identity, no traffic
    ([1.0, 1.0, 1.0, 1.0], 0)
"""

from __future__ import annotations

# The public API, from private modules by job (each says what it holds): _timeouts (ZEROFN_TIMEOUT_S and
# each group's timeout; the lowest), _errors (the errors, and torch's errors translated into them), _groups
# (joining, membership, the current group, rank and size, the control group), _accounting (counting),
# _handle (Handle, and naming a collective that fails) and _ops (the operations).
from zerofn.collectives._accounting import Counter, counting
from zerofn.collectives._errors import CollectiveError, CollectiveTimeoutError
from zerofn.collectives._groups import (
    NonMember,
    along,
    current_group,
    data_rank,
    ensure_initialized,
    group_scope,
    init,
    new_group,
    rank,
    set_along,
    set_group_timeout,
    set_without,
    with_current_group,
    without,
    world_size,
)
from zerofn.collectives._handle import Handle
from zerofn.collectives._ops import (
    account,
    all_gather,
    all_gather_tree,
    all_reduce,
    all_reduce_tree,
    all_to_all,
    any_of,
    barrier,
    broadcast_object,
    gather_objects,
    max_min,
    recv,
    reduce_scatter,
    reduce_scatter_tree,
    ring_shift,
    send,
)
from zerofn.collectives._quantized import (
    QUANTIZED_DTYPES,
    all_gather_quantized,
    dequantize_blocks,
    quantize_blocks,
    reduce_scatter_quantized,
)
from zerofn.collectives._timeouts import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from zerofn.collectives._timeouts import TIMEOUT_ENV as TIMEOUT_ENV
from zerofn.collectives._timeouts import timeout_s

# In reading order, which the API reference (docs/api/collectives.md) follows.
__all__ = [
    "timeout_s",
    "set_group_timeout",
    "init",
    "ensure_initialized",
    "NonMember",
    "current_group",
    "group_scope",
    "with_current_group",
    "new_group",
    "world_size",
    "rank",
    "Counter",
    "counting",
    "CollectiveError",
    "CollectiveTimeoutError",
    "Handle",
    "data_rank",
    "without",
    "set_without",
    "along",
    "set_along",
    "all_reduce",
    "any_of",
    "max_min",
    "reduce_scatter",
    "all_gather",
    "all_to_all",
    "ring_shift",
    "send",
    "recv",
    "account",
    "all_gather_quantized",
    "reduce_scatter_quantized",
    "quantize_blocks",
    "dequantize_blocks",
    "QUANTIZED_DTYPES",
    "barrier",
    "gather_objects",
    "broadcast_object",
    "all_reduce_tree",
    "reduce_scatter_tree",
    "all_gather_tree",
]
