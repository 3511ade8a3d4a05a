"""The records of ``offload("cpu")``'s state: :class:`HostState`, and :class:`DelayedHostState` for a
delayed update. The engine (``_host``) builds them and the updates that run on (``_pending``) write
them; both import them from here, neither the other's module.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from zerofn.roles import Inner, Quantity

__all__ = ["DelayedHostState", "HostState"]


class HostState(NamedTuple):
    """Optimizer state in host memory: host copies of the parameters it updates and of their gradients
    (buffers kept from step to step, as DeepSpeed keeps its fp32 gradient partition on the host), and
    the inner optimizer's state."""

    params: Any  # None when the parameters already live on the host (params=True)
    grads: Any
    inner: Any
    spare: Any = None  # early=True: room to save each bucket's state before a speculative update

    placement = "cpu"  # where the optimizer state lives (the state's printout shows it)

    def state_parts(self) -> tuple:
        """The inner state; the host parameters mirror the parameters (filled from them on load, never
        saved); the gradient buffers and the spare are scratch."""
        if self.params is None:
            return (Inner(self.inner),)
        return (Inner(self.inner), Quantity("host_params", self.params, mirror=True))


class DelayedHostState(HostState):
    """:class:`HostState` of a delayed update (``delay=1``): the host parameters are one update ahead
    of the parameters the forward uses, so a checkpoint saves them as a quantity of their own."""

    __slots__ = ()

    def state_parts(self) -> tuple:
        return (Inner(self.inner), Quantity("pending", self.params, newer=True))
