"""What an optimizer keeps per parameter element, found by initialising it on a two-element tensor.

Placing optimizer state (host RAM, NVMe files) and sizing it (a config's sub-group in bytes) need to know
which leaves of the state are shaped like the parameters and in which dtypes, without building it for
the whole model.

Example:
    >>> import torch
    >>> from zerofn import optim
    >>> p = optim.probe_state(optim.adamw(1e-3), torch.float32)
    >>> p.big_dtypes, p.bytes_per_element
    ((torch.float32, torch.float32), 8)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from zerofn import tree as T
from zerofn.optim.base import GradientTransformation

__all__ = ["StateProbe", "probe_state"]


class StateProbe(NamedTuple):
    """An optimizer state's shape over one parameter.

    Attributes:
        treedef: the state's tree structure over one parameter ``{"x": ...}``.
        big: the positions (in leaf order) of the leaves shaped like the parameter.
        big_dtypes: their dtypes.
        small: the other leaves (step counts, scalars), as ``init`` made them.
    """

    treedef: Any
    big: tuple[int, ...]
    big_dtypes: tuple[torch.dtype, ...]
    small: list

    @property
    def bytes_per_element(self) -> int:
        """Bytes of parameter-shaped state per parameter element (Adam in fp32: 8)."""
        return sum(d.itemsize for d in self.big_dtypes)


def probe_state(optimizer: GradientTransformation, dtype: torch.dtype) -> StateProbe:
    """Initialise ``optimizer`` on one two-element parameter of ``dtype`` and say what its state holds."""
    leaves, treedef = T.tree_flatten(optimizer.init({"x": torch.zeros(2, dtype=dtype)}))
    big = tuple(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.shape == (2,))
    small = [t for i, t in enumerate(leaves) if i not in big]
    return StateProbe(treedef, big, tuple(leaves[i].dtype for i in big), small)
