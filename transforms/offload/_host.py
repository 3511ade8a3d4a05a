"""The host-RAM engine of ``offload("cpu")``: the optimizer state, host copies of the parameters it
updates and host gradient buffers in CPU memory, the update run there.

:class:`HostEngine` wraps the inner optimizer. Each step's gradients reach the
host bucket by bucket as backward lands them (``start_update``, a
:class:`~zerofn.transforms.offload._pending.Landing`), or all at once
(``update_in_place``); the update then runs here and now, or on the worker
thread after the step returns (:func:`runs_late` decides which), bucket by
bucket, the updated parameters copied back as each is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from zerofn.transforms.offload._pending import Landing, PerBucket, Speculation, host_extra, landing_dtype, launch, mark
from zerofn.transforms.offload._state import DelayedHostState, HostState

from zerofn import optim as O
from zerofn import tree as T
from zerofn.storage import to_host

__all__ = ["DelayedHostState", "HostEngine", "HostOptions", "HostState", "host_optimizer", "runs_late"]


def runs_late(device_type: str, *, delay: int, overlap: bool | None) -> bool:
    """Whether the host update may run on after the step returns, for parameters on ``device_type``:
    delayed, or overlapped (by default where the forward runs on an accelerator).

    The one predicate of it: the transform's ``Extension.updates_late`` and the engine's run-time
    choice (:meth:`HostEngine.later`) both ask it."""
    return bool(delay) or bool(overlap) or (overlap is None and device_type != "cpu")


@dataclass(frozen=True)
class HostOptions:
    """What ``offload("cpu", ...)`` was asked for (compared by value when it is applied again).

    Attributes:
        params: the parameter shards themselves live on the host (``params=True``).
        pin: host buffers are pinned (``pin_memory`` and CUDA present).
        overlap: run the update on the worker after the step returns (None: where the forward runs
            on an accelerator).
        delay: ``1``: each update one step late.
        early: start each bucket's update during backward, speculatively.
    """

    params: bool = False
    pin: bool = False
    overlap: bool | None = None
    delay: int = 0
    early: bool = False


class HostEngine:
    """The inner optimizer run on the host (see the module docs), as a :class:`~zerofn.optim.GradientTransformation`
    (:meth:`transformation`)."""

    def __init__(self, inner: O.GradientTransformation, options: HostOptions) -> None:
        if options.delay and inner.communicates:
            raise ValueError(
                "offload(delay=1): this optimizer runs collectives in its update (LAMB's or Muon's sums and "
                "gathers over shards), which a delayed update would run on another thread, across the next step's; "
                "use delay=0 (the update then runs in the step), or an elementwise optimizer such as adamw"
            )
        self.inner, self.options = inner, options
        self.pin = options.pin
        self.params_on_host = options.params
        self.kind = DelayedHostState if options.delay else HostState
        self.split = PerBucket(inner)
        # off for good once the optimizer cannot run before the norm is known; never for an optimizer that
        # communicates in its update (its collectives must run in the step, in the step's order)
        self.speculating = options.early and not inner.communicates

    def transformation(self) -> O.GradientTransformation:
        pure = O.in_place(self.init, self.update_now, "offload")  # the pure update() waits for its result
        # Bound to a view, the inner optimizer is: the host copies hold the same pieces as the parameters.
        rebind = lambda view: host_optimizer(O.bind(self.inner, view), options=self.options)  # noqa: E731
        if self.options.delay:  # the gradient buffers are read by the update of the step before until its update phase
            return O.GradientTransformation(
                self.init,
                pure.update,
                self.update_in_place,
                bind=rebind,
                communicates=self.inner.communicates,
                masks=self.inner.masks,
            )
        return O.GradientTransformation(
            self.init,
            pure.update,
            self.update_in_place,
            self.start_update,
            bind=rebind,
            communicates=self.inner.communicates,
            masks=self.inner.masks,  # the host update takes the device's decision to the host (host_extra)
        )

    # ---- the state

    def init(self, params: dict) -> HostState:
        pin = self.pin
        host = None if self.params_on_host else T.tree_map(lambda p: to_host(p.detach(), pin), params)
        # fp32 (amp's gradients reach the optimizer in fp32), or wider for a wider parameter
        grads = T.tree_map(lambda p: torch.zeros(p.shape, dtype=landing_dtype(p.dtype), pin_memory=pin), params)
        state = self.kind(host, grads, self.inner.init(params if self.params_on_host else host))
        return state._replace(spare=self.split.spare(state.inner, host)) if self.options.early else state

    def target(self, state: HostState, params: dict) -> dict:
        """The parameters the host update writes: the host copies, or the parameters themselves."""
        return params if self.params_on_host else state.params

    # ---- when

    def later(self, params: dict) -> bool:
        """Whether the update may run on after the step returns (see :func:`runs_late`)."""
        o = self.options
        if self.inner.communicates:  # collectives on the worker thread could cross the next step's
            return False
        return any(runs_late(p.device.type, delay=o.delay, overlap=o.overlap) for p in params.values())

    def stop_speculating(self) -> None:
        self.speculating = False

    # ---- copies

    def to_host_grads(self, grads: dict, state: HostState) -> None:
        torch._foreach_copy_(T.tree_leaves(state.grads), T.tree_leaves(grads), non_blocking=self.pin)
        if self.pin:
            torch.cuda.current_stream().synchronize()

    def copy_out(self, params: dict, state: HostState) -> None:
        torch._foreach_copy_(T.tree_leaves(params), T.tree_leaves(state.params), non_blocking=self.pin)

    # ---- the update

    def on_host(self, state: HostState, target: dict, extra: dict) -> HostState:
        """The whole update, here and now."""
        return state._replace(inner=O.update_params(self.inner, state.grads, state.inner, target, **extra))

    def update_host(self, state: HostState, params: dict, extra: dict, run_later: bool) -> HostState:
        """The update, the gradients on the host: here and now, or launched on the worker (the state
        marked as arriving)."""
        target, extra = self.target(state, params), host_extra(extra)
        if not run_later:
            new = self.on_host(state, target, extra)
            if not self.params_on_host:
                self.copy_out(params, state)
            return new
        if self.options.delay:  # the parameters the last update made, for the next forward; then this update
            self.copy_out(params, state)
            if self.pin:
                torch.cuda.current_stream().synchronize()
        device = None if (self.options.delay or self.params_on_host) else params
        launched = launch(self.split, state, target, device, extra, self.pin)
        if launched is None:  # an optimizer state the update cannot be split over buckets for: update here
            new = self.on_host(state, target, extra)
            if device is not None:
                self.copy_out(params, state)
            return new
        mark(launched, state, params, device is not None or self.params_on_host)
        return state

    @torch.no_grad()
    def update_now(self, grads: dict, state: HostState, params: dict, **extra) -> HostState:
        """The update before it returns (the pure ``update``)."""
        self.to_host_grads(grads, state)
        return self.update_host(state, params, extra, run_later=False)

    @torch.no_grad()
    def update_in_place(self, grads: dict, state: HostState, params: dict, **extra) -> HostState:
        """The update, on after the step returns where :meth:`later` says so."""
        # The step read state.opt_state, which waited for the update before this one: its buffers are free.
        self.to_host_grads(grads, state)
        return self.update_host(state, params, extra, run_later=self.later(params))

    def start_update(self, state: HostState, params: dict, previous: Callable[[], None]) -> Landing:
        """The gradients landed bucket by bucket during backward; each bucket's update started as it
        lands when ``early`` (and the state can be taken apart by bucket). ``previous`` waits for the
        update still writing ``state`` (the step's state in flight), before a gradient lands on its buffers."""
        target, run_later = self.target(state, params), self.later(params)
        plan = self.split.plan(state.inner, target) if self.speculating and state.spare is not None else None
        if plan is None:
            update = lambda extra: self.update_host(state, params, extra, run_later)  # noqa: E731
            return Landing(state, params, self.pin, update, previous)
        return Speculation(
            self.split, plan, state, target, params, self.pin, run_later, self.stop_speculating, previous
        )


def host_optimizer(inner: O.GradientTransformation, *, options: HostOptions) -> O.GradientTransformation:
    """``inner`` with its state in host memory, updated there (see :class:`HostEngine`)."""
    return HostEngine(inner, options).transformation()
