"""Where a state's bytes are, counted once for the printout, ``zf.memory`` and the benchmark.

A leaf is placed where it lives: a tensor on its device type (``"cpu"``, ``"cuda"``), a leaf that
stands for bytes held elsewhere by what it declares (``placement`` and ``nbytes``: the NVMe files
of an offloaded optimizer state). Tensors that share a storage count once; meta tensors hold nothing.

Example:
    >>> import torch
    >>> from zerofn.placement import format_bytes, held_bytes
    >>> w = torch.zeros(256)
    >>> held_bytes({"w": w, "view": w[:10]}), format_bytes(1536, binary=True), format_bytes(2.5e9)
    ({'cpu': 1024}, '1.50 KiB', '2.5 GB')
"""

from __future__ import annotations

from typing import Any

import torch

from zerofn import tree

__all__ = ["format_bytes", "held_bytes"]


def held_bytes(t: Any) -> dict[str, int]:
    """Bytes of the distinct storages under the tree ``t``, by placement."""
    seen: set[tuple[str, int]] = set()
    out: dict[str, int] = {}
    for leaf in tree.tree_leaves(t):
        placement = getattr(leaf, "placement", None)
        if isinstance(placement, str) and not isinstance(leaf, torch.Tensor):  # bytes held elsewhere (files)
            out[placement] = out.get(placement, 0) + int(leaf.nbytes)
            continue
        if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
            continue
        storage = leaf.untyped_storage()
        key = (str(leaf.device), storage.data_ptr())
        if key in seen and storage.data_ptr() != 0:
            continue
        seen.add(key)
        out[leaf.device.type] = out.get(leaf.device.type, 0) + storage.nbytes()
    return out


_UNITS = {False: (1000, ("KB", "MB", "GB", "TB")), True: (1024, ("KiB", "MiB", "GiB", "TiB"))}


def format_bytes(n: float, *, binary: bool = False) -> str:
    """``n`` bytes for a reader: decimal units as GPU and disk makers count them (``140.0 GB``,
    ``1.12 TB``), or binary ones (``1.50 KiB``, ``2.00 GiB``) as memory is allocated."""
    n = float(n)
    base, names = _UNITS[binary]
    for power in range(len(names), 0, -1):
        if n >= base**power:
            digits = 2 if binary or power == len(names) else 1
            return f"{n / base**power:.{digits}f} {names[power - 1]}"
    return f"{n:.0f} B"
