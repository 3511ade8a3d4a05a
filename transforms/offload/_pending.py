"""Host updates that are not over when they return: the gradients landing on the host during backward
(:class:`Landing`), the speculative update of each bucket as it lands (:class:`Speculation`), and the
update bucket by bucket on the one worker thread (:class:`PerBucket`, :class:`BucketRun`), whose
progress a step reads through :class:`Done` handles (:class:`Launched`).

Every host update runs on :func:`worker`, one thread, so that updates run in the order they were
launched. What a launched update writes is marked as arriving (:func:`mark`): its handles go into the
in-flight record of the state the step returns (``state.inflight``), which a reader of the state waits
on, a forward for each bucket as it first reads it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from zerofn.transforms.offload._state import HostState

from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn.state import arriving

__all__ = ["BucketRun", "Done", "Landing", "Launched", "PerBucket", "Speculation", "launch", "mark", "worker"]


def landing_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter's gradient lands in on the host (a buffer, or a file): fp32, as amp's gradients
    reach the optimizer, or wider for a wider parameter; a narrower gradient goes there and back exactly."""
    return torch.promote_types(param_dtype, torch.float32)


class Done:
    """A handle (``wait()``) on work a worker thread finishes: returns once it has, raises what it raised."""

    def __init__(self) -> None:
        self.future: concurrent.futures.Future = concurrent.futures.Future()

    def wait(self) -> None:
        try:
            self.future.result()
        except Exception as e:
            raise RuntimeError(
                f"offload: the host update running alongside the next step failed ({type(e).__name__}: {e}). "
                "The parameters and optimizer state of this step are incomplete: load the last checkpoint, "
                "and to find the cause run the same step with offload(..., overlap=False), which raises where "
                "it fails."
            ) from e


class Launched(NamedTuple):
    """The handles of one launched update: each bucket's, and the whole update's."""

    buckets: dict  # bucket key -> Done, set once its parameters are written
    all: Done

    def wait(self) -> None:
        self.all.wait()


@functools.cache
def worker() -> concurrent.futures.ThreadPoolExecutor:
    """One thread for every host update, so that they run in the order launched."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerofn-offload")


def mark(launched: Launched, state: HostState, params: dict, params_written: bool) -> None:
    """Mark what a launched update writes as arriving: each device bucket until its own update is done."""
    if params_written:
        for k in params:
            arriving(params[k], launched.buckets[k])
    for t in T.tree_leaves(state):
        if isinstance(t, torch.Tensor):
            arriving(t, launched)


class Landing(O.PendingUpdate):
    """Gradients copied to the host bucket by bucket as backward lands them (non-blocking on CUDA,
    overlapping the rest of backward); the update itself once they all have (``commit``)."""

    def __init__(
        self, state: HostState, params: dict, pin: bool, update: Callable[[dict], Any] | None, previous: Callable
    ) -> None:
        self.state, self.params, self.pin, self.update = state, params, pin, update
        self.previous = previous  # waits for the update before this one, which may still read the host buffers
        self.copied: dict = {}  # key -> a CUDA event once its copy is done (None on the CPU)
        self.kept: dict = {}  # key -> a gradient still on the device, for pageable host buffers

    def grad(self, key: str, grad: torch.Tensor) -> None:
        host = self.state.grads[key]
        self.previous()  # the update before this one reads it until it is done
        if grad.device.type == "cuda" and not self.pin:
            # Into pageable memory the copy would stall backward here: keep the gradient until commit.
            self.kept[key] = grad
            return
        host.copy_(grad, non_blocking=self.pin)
        event = None
        if self.pin:
            event = torch.cuda.Event()
            event.record()
        self.copied[key] = event
        self.landed(key)

    def copy_kept(self) -> None:
        """The gradients kept on the device (pageable host memory), copied in now."""
        for key, grad in self.kept.items():
            self.state.grads[key].copy_(grad)
            self.copied[key] = None
            self.landed(key)
        self.kept = {}

    def landed(self, key: str) -> None:
        pass

    def wait_copied(self, key: str) -> None:
        event = self.copied[key]
        if event is not None:
            event.synchronize()

    def all_copied(self) -> None:
        """Every landed gradient in its host buffer."""
        self.copy_kept()
        for k in self.copied:
            self.wait_copied(k)

    @torch.no_grad()
    def commit(self, **extra):
        self.all_copied()
        return self.update(extra)

    def cancel(self) -> None:
        self.kept = {}
        self.all_copied()


class Speculation(Landing):
    """The host update of each bucket started as soon as its gradient is on the host, during backward.

    Until the step decides (``commit`` or ``cancel``), each bucket is
    updated speculatively: its state saved first into the spare buffers,
    updated with a :class:`~zerofn.optim.PendingNorm` for the global norm,
    its device parameters left alone. A skipped step or an error restores
    what was updated; a commit whose norm clips (or an optimizer that reads
    the norm as a number) restores it and updates again. The newest landed
    bucket goes first, so that what is left when backward ends is the
    embedding's end, which the next forward reads first.

    ``give_up()`` is called when the optimizer cannot run before the norm is
    known (or failed): the engine then speculates no more.
    """

    def __init__(
        self,
        split: PerBucket,
        plan: tuple,
        state: HostState,
        target: dict,
        params: dict,
        pin: bool,
        run_later: bool,
        give_up: Callable[[], None],
        previous: Callable,
    ) -> None:
        super().__init__(state, params, pin, None, previous)
        self.run = BucketRun(split, plan, state, target, params, pin)
        self.run_later, self.give_up = run_later, give_up
        self.cv = threading.Condition()
        self.ready: list = []  # landed, not yet updated
        self.decision: tuple | None = None
        self.failed = False
        self.finished = Done()  # the speculation over: restored, or committed
        worker().submit(C.with_current_group(self.speculate))

    def landed(self, key: str) -> None:
        with self.cv:
            self.ready.append(key)
            self.cv.notify()

    @torch.no_grad()
    def speculate(self) -> None:
        run, norm = self.run, O.PendingNorm()
        try:
            run.begin()
            while True:
                with self.cv:
                    while self.decision is None and (self.failed or (not self.ready and not run.unsaved())):
                        self.cv.wait()
                    if self.decision is not None:
                        break
                    key = self.ready.pop() if self.ready else None  # the newest first
                if key is None:  # nothing landed yet: save the next bucket backward brings
                    run.save(run.unsaved()[0])
                    continue
                self.wait_copied(key)
                run.save(key)
                try:
                    run.update(key, {"grad_norm": norm}, speculative=True)
                except Exception:  # it needs the norm (or failed): once the norm is known, again, and no more
                    run.restore(key)
                    self.failed = True
                    self.give_up()
            kind, extra = self.decision
            # A parameter that got no gradient, or parameters updated unequally often: the update needs to
            # know which (the speculative one did not), so it runs again.
            info = extra.get("info") if extra else None
            uneven = info is not None and (
                info.missing
                or info.maybe
                or info.counts is not None
                or (info.steps is not None and info.uniform is None)
            )
            # the device's decision, read here on the worker: a skipped update is a cancelled one
            skipped = extra is not None and extra.get("found_inf") is not None and bool(extra["found_inf"])
            if skipped:
                kind = "cancel"
            if kind == "cancel" or self.failed or uneven or not norm.holds(float(extra["grad_norm"])):
                for key in run.updated:
                    run.restore(key)
                run.updated = []
            self.finished.future.set_result(None)
        except BaseException as e:
            run.fail(e)
            self.finished.future.set_exception(e)
            return
        if kind == "commit":
            run.commit_phase(extra)
        elif skipped:  # committed, but the device decided to skip: the state as it was, and nothing to wait for
            run.skip()

    def decide(self, decision: tuple) -> None:
        with self.cv:
            self.decision = decision
            self.cv.notify()

    @torch.no_grad()
    def commit(self, **extra):
        self.all_copied()  # the buckets the speculation has not reached are updated without waiting
        self.decide(("commit", host_extra(extra)))
        state, run = self.state, self.run
        if not self.run_later:
            run.done.wait()
            return state
        mark(run.done, state, self.params, True)
        return state

    def cancel(self) -> None:
        self.decide(("cancel", None))
        self.finished.wait()


class PerBucket:
    """The inner optimizer's state taken apart by bucket, to update one bucket at a time.

    The optimizer then runs once per bucket (as the NVMe path runs it once
    per sub-group); each run starts from the counters as they were before
    the step (cloned), and the last run's counters become the state's. Every
    ``zf.optim`` transform treats its parameters independently (clipping
    reads the step's global norm), so the result is the same to the bit.
    """

    def __init__(self, inner: O.GradientTransformation):
        self.inner = inner
        self.treedefs: dict = {}

    def plan(self, state: Any, params: dict) -> tuple | None:
        """``(leaves, owner, treedef per key)``: owner[i] is the bucket key of leaf i (None: shared);
        None when the state cannot be taken apart so."""
        paths, leaves, _ = T.tree_flatten_with_path(state)
        owner = [next((c for c in reversed(p) if isinstance(c, str) and c in params), None) for p in paths]
        if not all(isinstance(t, torch.Tensor) for t in leaves):
            return None
        defs = {}
        for k, p in params.items():
            sig = (k, p.numel(), p.dtype)
            if sig not in self.treedefs:
                meta = {k: torch.empty(p.shape, dtype=p.dtype, device="meta")}
                self.treedefs[sig] = T.tree_structure(self.inner.init(meta))
            defs[k] = self.treedefs[sig]
            if defs[k].num_leaves != sum(o == k or o is None for o in owner):
                return None
        return leaves, owner, defs

    def spare(self, state: Any, target: dict) -> dict | None:
        """Room for a copy of each bucket's state (see :class:`Speculation`; the host parameters need
        none: the device holds the same values until the update commits); None when the state cannot be
        taken apart by bucket."""
        plan = self.plan(state, target)
        if plan is None:
            return None
        leaves, owner, _ = plan
        return {k: [torch.empty_like(t) for t, o in zip(leaves, owner) if o == k] for k in target}


class BucketRun:
    """One step's host update, bucket by bucket, on the worker thread (see :class:`PerBucket`)."""

    def __init__(self, split: PerBucket, plan: tuple, state: HostState, target: dict, device: dict | None, pin: bool):
        self.split, self.state, self.target, self.device = split, state, target, device
        self.leaves, self.owner, self.defs = plan
        self.mine = {k: [i for i, o in enumerate(self.owner) if o == k or o is None] for k in target}
        self.order = list(reversed(list(target)))  # buckets are in backward order: the forward reads the last first
        self.done = Launched({k: Done() for k in target}, Done())
        self.side = torch.cuda.Stream() if (pin and device is not None) else None
        self.before: dict | None = None
        self.last_shared: dict = {}
        self.updated: list = []  # buckets updated so far
        self.saved: set = set()

    def begin(self) -> None:
        """On the worker, once the update before this one is done: the counters as they were before."""
        if self.before is None:
            self.before = {i: t.clone() for i, t in enumerate(self.leaves) if self.owner[i] is None}

    def _own(self, k: str) -> list:
        return [self.leaves[i] for i in self.mine[k] if self.owner[i] is not None]

    def unsaved(self) -> list:
        return [k for k in self.target if k not in self.saved] if self.state.spare is not None else []

    def save(self, k: str) -> None:
        if k not in self.saved:
            torch._foreach_copy_(self.state.spare[k], self._own(k))
            self.saved.add(k)

    def restore(self, k: str) -> None:
        """Bucket ``k`` as saved, its host parameters from the device's (not written before the commit)."""
        torch._foreach_copy_(self._own(k), self.state.spare[k])
        self.target[k].copy_(self.device[k])

    def update(self, k: str, extra: dict, speculative: bool = False) -> None:
        leaves, owner = self.leaves, self.owner
        sub_leaves = [self.before[i].clone() if owner[i] is None else leaves[i] for i in self.mine[k]]
        sub = T.tree_unflatten(self.defs[k], sub_leaves)
        new = T.tree_leaves(
            O.update_params(self.split.inner, {k: self.state.grads[k]}, sub, {k: self.target[k]}, **extra)
        )
        for i, t in zip(self.mine[k], new):
            if owner[i] is None:
                self.last_shared[i] = t
            elif t is not leaves[i]:
                leaves[i].copy_(t)
        self.updated.append(k)

    def publish(self, k: str) -> None:
        """Copy bucket ``k``'s parameters to the device and mark it done."""
        if self.device is not None:
            if self.side is None:
                self.device[k].copy_(self.target[k])
            else:
                with torch.cuda.stream(self.side):
                    self.device[k].copy_(self.target[k], non_blocking=True)
                self.side.synchronize()
        self.done.buckets[k].future.set_result(None)

    @torch.no_grad()  # grad mode is per thread
    def commit_phase(self, extra: dict) -> None:
        """Every bucket not updated yet, then each bucket's parameters out, the forward's first first."""
        try:
            self.begin()
            for k in self.order:
                if k not in self.updated:
                    self.update(k, extra)
                self.publish(k)
            for i, t in self.last_shared.items():
                if t is not self.leaves[i]:
                    self.leaves[i].copy_(t)
            self.done.all.future.set_result(None)
        except BaseException as e:
            self.fail(e)

    def skip(self) -> None:
        """No update after all (every bucket restored): the waiters go on with the values as they were."""
        for d in (*self.done.buckets.values(), self.done.all):
            if not d.future.done():
                d.future.set_result(None)

    def fail(self, e: BaseException) -> None:  # every waiter hears of it
        for d in (*self.done.buckets.values(), self.done.all):
            if not d.future.done():
                d.future.set_exception(e)


def host_extra(extra: dict) -> dict:
    """``extra`` for an update on the host: the device's decision (``found_inf``) copied to host memory, where
    the host update reads it (it waits for the device anyway: its gradients come from there)."""
    found, info = extra.get("found_inf"), extra.get("info")
    if found is None or found.device.type == "cpu":
        return extra
    out = {**extra, "found_inf": found.to("cpu")}
    if info is not None and info.on_device:  # what the step said of the parameters on the device, too
        cpu = {k: getattr(info, k).to("cpu") for k in ("absent", "counts") if getattr(info, k) is not None}
        out["info"] = dataclasses.replace(info, **cpu)
    return out


def launch(split: PerBucket, state: HostState, target: dict, device: dict | None, extra: dict, pin: bool):
    """Start the host update of every bucket, the one the forward reads first first; None if it cannot be split."""
    plan = split.plan(state.inner, target)
    if plan is None:
        return None
    run = BucketRun(split, plan, state, target, device, pin)
    worker().submit(C.with_current_group(run.commit_phase), extra)
    return run.done
