"""One call ``step(state, batch)``: the six phases of the design page of the docs ("The phases of a
step"), numbered alike in the comments, and the three ways a call ends.

Every call sets up its gradient sink (1) and runs forward and backward (2). Then it ends in one of three
phases, each saying what changes in the state (:class:`_Next`), and :meth:`_Call.run` builds the next
state in ONE place:

- accumulate: a micro-step before the last carries its gradient to the next one (3);
- skip: the last micro-step's update is skipped (a non-finite loss or gradient, a rank's failed check),
  decided on the host;
- update: the gradient is averaged and unscaled (4), the optimizer updates in place (5) and the storage
  publishes the parameters (6). An update the device decides to skip runs this phase too, masked there.

Ranks issue the same collectives in the same order: the order of every collective and device operation
here is part of the step's contract (``tests/core/test_host_syncs.py`` counts the host's reads).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple

import torch

from zerofn import collectives as C
from zerofn import counters, keys
from zerofn import optim as O
from zerofn import tree as T
from zerofn.functional import BINDING
from zerofn.optim.bucket_view import advance_steps, step_info
from zerofn.reduction import GradSink, bucket_group, bucket_rank, replica
from zerofn.state import InFlight, TrainState, collecting
from zerofn.step._checks import (
    IGNORED_PARAMS_HELP,
    batch_digest,
    carry_fault,
    check_each_update,
    decide,
    reporting,
    split_loss,
    verdict,
)
from zerofn.step._derived import run_model, run_optimizer
from zerofn.step._grads import average_buffers, divide, float_buffers, mean_factor, unscale
from zerofn.step._init import device_of, opt_params
from zerofn.step._stats import Stats, absent, any_failed, metrics, start_stats, sum_of_squares

__all__ = ["call", "forward_backward"]


def call(step: Any, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
    """One micro-step of ``step`` on ``state`` (see ``Step.__call__``), in the step's group."""
    this = _Call(step, state, batch)
    try:
        return this.run()
    finally:
        this.sink = None  # it calls back into the call (an update started in backward): no cycle outlives it


class _Next(NamedTuple):
    """How a call ends: what changes in the state, and what the metrics are made of."""

    changes: dict  # the state's fields that change
    stats: Stats
    aux: dict
    loss_scale: Any  # the one the metrics report
    skipped: Any = None  # a 0-dim bool tensor (None: no update on this call)
    grad_norm: Any = None
    reported: list | None = None  # the parts' checks of the update under way, carried to its next micro-step


class _Decision(NamedTuple):
    """The update's verdict, before it applies (see :meth:`_Call.judge`)."""

    stats: Stats
    ok: torch.Tensor  # on the device: the update applies
    fault: torch.Tensor  # on the device: what went wrong (zerofn.step._checks)
    on_device: bool  # decided on the device (the host reads nothing)
    finite: bool  # decided on the host: the update applies
    info: O.StepInfo
    decided: Any  # what the loss scale adjusts on: ``ok``, or ``finite``


class _Call:
    """One call's context: phase 1 (the sink, and an update that starts as buckets land) is set up here."""

    def __init__(self, step: Any, state: TrainState, batch: Any) -> None:
        self.step, self.state, self.batch = step, state, batch
        self.layout, self.world, self.rank = state.spec.layout, state.spec.world_size, C.rank()
        self.micro = counters.value(state.micro)  # host counters: no device read (zerofn.counters)
        self.last = self.micro + 1 == step.accumulate_steps
        self.precision, self.ls = step.precision, state.loss_scale
        self.digest = batch_digest(step.name, state.run, batch)

        # 1. The sink. Between micro-steps a state carries either full local gradient
        # sums (reduced once, on the last micro-step) or, when gradients are sharded,
        # this rank's reduced partition (reduced on every micro-step).
        every_micro = step.reduction.every_micro
        self.reduce_now = self.last or every_micro
        carried = state.grad_accum
        self.scale = self.precision.loss_scale_factor(self.ls)
        self.optimizer = run_optimizer(step, state.run, self.layout, self.rank, state.spec.treedef)
        # An optimizer that can start before backward ends gets each bucket's gradient as it is final.
        self.pending = None
        if self.last and self.optimizer.start_update is not None:
            self.pending = self.optimizer.start_update(
                state.arriving_opt_state(),
                opt_params(step, state.arriving_params(), self.layout, self.rank),
                state.inflight.wait_opt,
            )
        self.norms: list = []  # of each bucket's final gradient, as it lands (the gradient then goes)
        self.early: dict = {}  # a zf.Mean's global count, for an update that starts as buckets land (see below)
        self.sink = GradSink(
            self.layout,
            step.reduction,
            self.precision.grad_dtype,
            self.rank,
            self.reduce_now,
            carried=None if every_micro else carried,
            reduced_sums=carried if every_micro else None,
            on_result=self._final if self.pending is not None else None,
        )
        k = step.accumulate_steps
        self.factors = [divide(d, self.world * k, self.scale) for d in self.sink.predivide]  # phase 4's, per bucket
        self.reduced: dict | None = None  # bucket key -> the reduced gradient (phase 4: averaged, unscaled)
        replicated, mesh = step.reduction.replicated, step.mesh
        # the model-parallel axes (tensor parallelism's): outside the step's group, their ranks hold different
        # pieces of the parameters they cut and the same whole ones of the others
        model = sorted({b.cut for b in self.layout.buckets if b.cut})
        # a pipeline's stages hold different parameters: their norms are summed over its axis too
        model_groups = tuple(mesh.group(a) for a in model) + (
            (mesh.group("pp"),) if mesh is not None and mesh.size("pp") > 1 else ()
        )
        self.start_stats = functools.partial(
            start_stats,
            world=self.world,
            rank=self.rank,
            replicated=replicated,
            digest=self.digest,
            counted=[
                (not replicated or bucket_rank(b, self.rank) == 0)
                and replica(b) == 0  # hybrid sharding: one replica of each shard counts it
                and all(mesh.coordinate(a) % (b.share if b.cut == a else mesh.size(a)) == 0 for a in model)
                for b in self.layout.buckets
            ],
            model_groups=model_groups,
        )
        # Every gradient whole and the same on every rank once reduced (each bucket all-reduced over the step's
        # group, none cut along a model-parallel axis or replicated apart): each rank takes the norm itself,
        # equal to the one rank 0 would add to the statistics' sum (zeros from the others), so the statistics
        # need no gradient and their all-reduce starts before the gradients' reductions are waited for.
        self.norm_here = (
            replicated
            and self.world > 1
            and not model_groups
            and all(bucket_group(b) is None and not b.replicate for b in self.layout.buckets)
        )

    def _final(self, i: int, r: torch.Tensor) -> None:
        """Phase 4 below, for one bucket, as it lands (an update that starts in backward)."""
        key, early = keys.bucket(i), self.early
        if "handle" in early:  # the count's all-reduce, under way since the forward ended (a host read:
            early["n"] = float(early.pop("handle").wait()[1])  # this update runs on the host anyway)
        f = self.factors[i] if "n" not in early else mean_factor(self.sink.predivide[i], early["n"], self.scale)
        g, norm = unscale(self.precision, {key: r}, [f])
        self.norms.extend(norm)
        self.pending.grad(key, g[key])

    def run(self) -> tuple[TrainState, dict[str, Any]]:
        """The phases in order; the one exit builds the next state from what the last phase changes."""
        state, sink = self.state, self.sink
        try:
            # 2. Forward and backward; each bucket is reduced as backward completes it.
            # A zf.Mean's running sums reach the other ranks in the statistics below; an update that starts
            # as buckets land needs the count sooner: its all-reduce overlaps backward.
            counts = self.early if self.pending is not None else None
            with reporting() as mine:
                loss, aux, extra, items = forward_backward(self.step, state, self.batch, sink, self.scale, counts)
            reported = state.inflight.reported + mine  # this update's micro-steps' checks
            after = {"micro": counters.new(self.micro + 1), "extra": extra, "items": items}
            after["seen"] = seen = sink.seen(state.seen)  # None: every parameter got a gradient here so far

            if not self.reduce_now:
                end = self.accumulate(loss, aux, items, after, reported, sink.full_buffers)
            else:
                started = None
                if self.last and self.norm_here and items is None:
                    sink.launch()  # every bucket's reduction under way first: they are the step's to wait for
                    started = self.update_stats(loss, aux, None, items, seen, reported)
                self.reduced = sink.finish()
                if "handle" in self.early:  # no bucket landed to wait for it
                    self.early.pop("handle").wait()
                if not self.last:
                    end = self.accumulate(loss, aux, items, after, reported, lambda: tuple(self.reduced.values()))
                else:
                    decision = self.judge(loss, aux, items, seen, reported, started)
        except BaseException:
            if self.pending is not None:  # nothing it started may stay: the state is as it was
                self.pending.cancel()
            raise
        if self.last:
            end = self.conclude(decision, aux, after, reported)
        new = state.replace(**end.changes)
        if end.reported is not None:
            new.inflight.reported = end.reported
        return new, metrics(self.precision, end.loss_scale, end.stats, end.aux, end.skipped, end.grad_norm)

    # ------------------------------------------------------------ accumulate

    def accumulate(self, loss, aux, items, after: dict, reported: list, carry) -> _Next:
        """3. Carry the gradient to the next micro-step (``carry()``: the local sums, or this rank's reduced
        partition). The statistics stay on the device: nothing here waits for it (the metrics are read when
        the user reads them)."""
        done = self.start_stats(loss, aux, None, items=items)()
        return _Next({"grad_accum": carry(), **after}, done, aux, self.ls, reported=reported)

    # ------------------------------------------------------------ the update's verdict

    def update_stats(self, loss, aux, norms, items, seen, reported: list) -> Any:
        """The update's statistics (``norms``: None, none in them), their all-reduce launched: the returned
        function waits for it (:func:`start_stats`)."""
        checks = any_failed(reported, loss.device) if any(e.reports for e in self.step.extensions) else None
        return self.start_stats(
            loss,
            aux,
            norms,
            unseen=seen is not None,
            items=items,
            seen=(seen, len(self.layout.trainable_names)),
            reported=checks,
        )

    def judge(self, loss, aux, items, seen, reported: list, started: Any = None) -> _Decision:
        """4. Average over ranks and micro-steps and undo the loss scale: one fused multiply. A zf.Mean
        divides by its global count instead, which the statistics bring: the norms are taken first (of the
        gradient before that division, which scales them alike) and the multiply follows. Then whether the
        update applies. ``started``: the statistics, their all-reduce under way since before the gradients were
        waited for, with no norm in them (see ``norm_here``)."""
        step, layout, state, precision = self.step, self.layout, self.state, self.precision
        norms = self.norms
        divide_later = self.pending is None and items is not None
        if divide_later:
            scales = [divide(d, 1, self.scale) for d in self.sink.predivide]
            self.reduced, norms = unscale(precision, self.reduced, None, scales)
        elif self.pending is None:
            self.reduced, norms = unscale(precision, self.reduced, self.factors)
        if started is not None:
            done = dataclasses.replace(started(), sumsq=sum_of_squares(norms, loss.device))
        else:
            done = self.update_stats(loss, aux, norms, items, seen, reported)()
        if divide_later:
            n = done.count
            for g, d in zip(self.reduced.values(), self.sink.predivide):
                g.mul_(mean_factor(d, n, self.scale))
            done = dataclasses.replace(done, sumsq=done.sumsq / n.square())
        # Whether the update applies (a finite loss and gradient, batches the ranks agree on) is decided on
        # the device, read by no one, when the optimizer can skip there (GradientTransformation.masks), and
        # so are which parameters no rank gave a gradient; otherwise the host reads both (one read).
        ok, fault = verdict(done, self.digest)
        on_device = (
            self.optimizer.masks
            and not check_each_update()
            and all(t.device == ok.device for t in T.tree_leaves((state.count, self.ls)) if isinstance(t, torch.Tensor))
        )
        if on_device:  # what the optimizer needs to know of the parameters, on the device too
            names = layout.trainable_names
            maybe = frozenset(n for n, b in zip(names, counters.values(seen)) if not b) if seen is not None else None
            gone = absent(*done.seen, done.world) if maybe else None
            # a copy: an update on the host's worker may read it after the counts below advance
            counts = None if counters.uniform(state.param_steps) else state.param_steps.clone()
            info = O.StepInfo(frozenset(), None, None, maybe or frozenset(), gone, counts, names)
            return _Decision(done, ok, fault, True, True, info, ok)
        finite, missing = decide(step.name, ok, fault, done, self.batch, layout, reported)
        info = step_info(state.count, state.param_steps, layout.trainable_names, missing)
        return _Decision(done, ok, fault, False, finite, info, finite)

    def conclude(self, d: _Decision, aux: dict, after: dict, reported: list) -> _Next:
        """The last micro-step's end: the update, or (decided on the host) skip it."""
        grad_norm = d.stats.sumsq.sqrt().float()  # nan when negative (no gradient reached it)
        after.update(
            micro=counters.new(0),
            grad_accum=None,
            seen=None,
            items=None,
            loss_scale=self.precision.adjust(self.ls, d.decided),
        )
        skipped = ~d.ok if d.on_device else torch.full((), not d.finite, device=d.ok.device)
        if not d.on_device and not d.finite:
            return self.skip(d, aux, after, skipped, grad_norm)
        return self.update(d, aux, after, reported, skipped, grad_norm)

    # ------------------------------------------------------------ skip

    def skip(self, d: _Decision, aux: dict, after: dict, skipped, grad_norm) -> _Next:
        """The update does not apply (decided on the host): the state keeps its parameters and optimizer
        state; the micro-steps and the loss scale move on."""
        if self.pending is not None:
            self.pending.cancel()
        return _Next(after, d.stats, aux, after["loss_scale"], skipped, grad_norm)

    # ------------------------------------------------------------ update

    def update(self, d: _Decision, aux: dict, after: dict, reported: list, skipped, grad_norm) -> _Next:
        """5. Update in place, then 6. publish. What is left running (a host update on another thread, the
        publish's all-gathers) is recorded in the new state's in-flight handles, which its readers wait on."""
        step, state, layout, info = self.step, self.state, self.layout, d.info
        flats = state.arriving_params()
        inflight = InFlight(
            carry_fault(state.inflight.fault, d.fault, step.name, reported) if d.on_device else state.inflight.fault
        )
        found = {"found_inf": skipped.float()} if d.on_device else {}
        reduced, self.reduced = self.reduced, None  # the gradients: freed once the optimizer has them
        with torch.no_grad(), collecting(inflight, flats):
            if self.pending is not None:
                opt_state = self.pending.commit(grad_norm=grad_norm, info=info, **found)
            else:
                params = opt_params(step, flats, layout, self.rank)
                opt_state = O.update_params(
                    self.optimizer, reduced, state.opt_state, params, grad_norm=grad_norm, info=info, **found
                )
            del reduced
            step.storage.publish(flats, layout, self.rank, inflight)
        if d.on_device:  # in place: the input state is donated (or a copy)
            count = counters.advance_(state.count, d.ok)
            steps = counters.advance_(state.param_steps, d.ok if info.absent is None else d.ok & ~info.absent)
        else:
            steps = advance_steps(state.param_steps, layout.trainable_names, info)
            count = counters.new(counters.value(state.count) + 1, device=state.count.device)
        changes = {"opt_state": opt_state, "count": count, "param_steps": steps, "inflight": inflight, **after}
        return _Next(changes, d.stats, aux, after["loss_scale"], skipped, grad_norm)


def forward_backward(step: Any, state: TrainState, batch: Any, sink: GradSink, scale: float, counts: dict | None):
    """Phase 2: returns the loss (detached), the aux dict, the state entries for the next state and, for a
    ``zf.Mean``, this rank's running sums of total and count (else None). ``counts``: where to put the
    all-reduce of those sums, launched before backward, for an update that starts as buckets land."""
    model = functools.partial(run_model, step, state.run)
    extra = dict(state.extra)
    before = float_buffers(state.buffers, copy=True)
    runs = next((e.runs for e in step.extensions if e.runs is not None), None)
    with contextlib.ExitStack() as stack:
        if state.buffers:
            stack.callback(model().bind_buffers(state.buffers))
        # an extension that runs forward and backward itself (a pipeline's schedule) takes the gradients first
        runner = runs(step, state, sink, scale) if runs is not None else None
        params = stack.enter_context(step.storage.bind(state, runner.sink if runner else sink, model, extra))
        for e in step.extensions:
            if e.around is not None:
                stack.enter_context(e.around(model, state))
        # Parameters a zf.functional call swaps in stay until backward is over,
        # so a recompute in backward (checkpointing in the model) sees them too.
        token = BINDING.set(stack)
        stack.callback(BINDING.reset, token)
        for e in step.extensions:
            if e.feed is not None and runner is None:  # a runner feeds each of its micro-batches itself
                batch = e.feed(batch)
        with step.precision.autocast(device_of(state.spec.layout)):
            out = runner(params, batch) if runner is not None else step.loss_fn(params, batch)
        loss, aux, mean = split_loss(step.name, out)
        loss = loss.float()
        items = None
        if mean is not None:
            now = torch.stack([loss.detach().double(), mean.counted(loss.device)])
            items = now if state.items is None else state.items + now
            if counts is not None and counters.value(state.micro) + 1 == step.accumulate_steps:
                counts["handle"] = C.all_reduce(items.clone(), "sum", async_op=True, control=True)
        if loss.requires_grad:
            sink.backward_started = True  # a backward before this one was a torch.autograd.grad in loss_fn
            (loss * scale if isinstance(scale, torch.Tensor) or scale != 1.0 else loss).backward()
        del params, out
    if sink.received == 0 and state.spec.layout.buckets:
        raise ValueError(IGNORED_PARAMS_HELP.format(name=step.name))
    average_buffers(float_buffers(state.buffers), before)
    return loss.detach(), aux, extra, items
