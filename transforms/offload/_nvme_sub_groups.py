"""How ``offload("nvme")`` cuts a bucket's state into sub-groups, and what that state holds per element.

The update streams each bucket's files in sub-groups of about
``sub_group_bytes`` of state: :func:`probe_state` finds the inner optimizer's
state over one sub-group (which leaves are parameter-shaped, kept in files,
and their dtypes) on the meta device, :func:`check_small` that every
sub-group carries the same small leaves as the whole state, and
:func:`sub_group_spans` where the sub-groups are cut, so that a vectorised kernel
rounds as over the whole bucket. :class:`BucketPlan` holds both for one
bucket; the engine (``_nvme``) makes one per bucket and layout.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from zerofn import optim as O
from zerofn import tree as T

__all__ = ["ALIGN_BYTES", "BucketPlan", "check_small", "probe_state", "sub_group_spans"]

ALIGN_BYTES = 256  # a multiple of every CPU vector width (AVX2 32 bytes, AVX-512 64, SVE up to 256)


class BucketPlan(NamedTuple):
    """How one bucket's state is streamed: its state's shape over a sub-group, and the sub-groups."""

    probe: O.StateProbe  # the inner state over one sub-group {"x": ...}: its treedef, big leaves, dtypes
    spans: list  # the sub-groups, (a, b) element ranges of the bucket


def probe_state(opt: O.GradientTransformation, numel: int, dtype: torch.dtype, key: str) -> O.StateProbe:
    """``opt``'s state over one sub-group ``{"x": numel elements of dtype}``, built on the meta device: the
    leaves it makes from the parameter (meta) are parameter-shaped, kept in files; the others are small."""
    meta = torch.empty(numel, dtype=dtype, device="meta")
    leaves, treedef = T.tree_flatten(opt.init({"x": meta}))
    big = tuple(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.device.type == "meta")
    odd = [tuple(leaves[i].shape) for i in big if tuple(leaves[i].shape) != (numel,)]
    if odd:
        raise ValueError(
            f"offload(nvme): the optimizer's state over bucket {key} holds tensors built from the parameters that "
            f"are not shaped like them (shapes {odd[:3]} for {numel} elements); NVMe offload streams only "
            "parameter-shaped state. Use offload('cpu') for this optimizer."
        )
    small = [t for i, t in enumerate(leaves) if i not in big]
    return O.StateProbe(treedef, big, tuple(leaves[i].dtype for i in big), small)


def check_small(probe: O.StateProbe, small: list, key: str) -> None:
    """Every sub-group's state carries the whole state's small leaves (its counts), in the same order."""
    mine = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in probe.small]
    whole = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in small]
    if mine != whole:
        raise ValueError(
            f"offload(nvme): the optimizer's state over bucket {key} has other small leaves (counts) than over "
            f"every bucket ({mine} against {whole}); NVMe offload keeps one set of small leaves for all "
            "sub-groups. Use offload('cpu') for this optimizer."
        )


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def sub_group_spans(n: int, size: int, starts: list[int], align: int) -> list[tuple[int, int]]:
    """Sub-groups of at most ``size`` of ``n`` elements, each cut where the parameter it cuts has an
    ``align``-element multiple of its elements on the left (``starts``: where each parameter's piece
    starts): a vectorised kernel then takes every element down the same code path as in one call over
    the whole bucket, so the update rounds the same (CPU kernels compute a tensor's last ``numel %
    vector width`` elements in scalar code). Without ``starts``, every ``size`` elements."""
    if not starts or size < align:
        return _chunks(n, size)
    out, a = [], 0
    while a < n:
        b = a + size
        i = bisect.bisect_right(starts, b) - 1  # the piece that holds element b
        if b < n and i >= 0:
            cut = starts[i] + (b - starts[i]) // align * align
            b = cut if cut > a else b
        out.append((a, min(n, b)))
        a = min(n, b)
    return out
