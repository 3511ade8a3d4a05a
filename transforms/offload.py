"""``offload``: optimizer state and fp32 master weights in CPU RAM or in files on NVMe.

Composes with the shard transforms and ``amp`` in any order: it wraps the
optimizer after ``amp`` has (the fp32 master weights are optimizer state, so
they move with it), whatever order the transforms were applied in.

``device="cpu"``: the optimizer state (and amp's fp32 master) lives in host
memory, pinned when CUDA is present. Backward copies this rank's gradient
partition to the host bucket by bucket as each lands (non-blocking into
pinned buffers on CUDA) and frees it on the device; the update runs the
optimizer there (its fused kernel: torch's fused AdamW runs on the CPU) and
copies the updated parameters back; ``overlap`` lets it run on alongside the
next forward, ``early`` starts it during backward. On a CPU-only machine the
same code runs: the host copy is a separate placement with its own buffers,
not a shortcut.

``params=True`` (with ``shard_params``): the parameter shards themselves live
on the host; each unit's shard is copied in just before its all-gather, so
the ``prefetch`` of ``shard_params`` brings it in ahead of use.

``device="nvme"``: every optimizer-state tensor that is shaped like the
parameters (Adam's moments, amp's master weights) lives in files under
``path`` (one file per tensor per rank, in two generations); counters stay
in the state pytree. The update streams the files in sub-groups of
``sub_group_bytes``: a background thread reads the next sub-group and another
writes the previous one while the current one is updated, so RAM held for
optimizer state is a few sub-groups whatever the model size. New state goes
to the other generation and the new parameters to a staging file; only when
every write has succeeded are the parameters copied in and the manifest
switched, so a failed update (a full disk) leaves the state from before the
step intact and usable.

Offloaded state shows its placement: the optimizer state is a
:class:`HostState` or :class:`NvmeState`, and ``zf.memory.state_bytes``
reports bytes per placement (``by_placement``: "cpu", "cuda", "nvme").

Collectives: none of its own.

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import offload, shard_optimizer
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = offload(shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-3))), "cpu")
    >>> state, metrics = step(step.init(apply.params), torch.ones(2, 4))
    >>> type(state.opt_state).__name__
    'HostState'
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn.checkpoint import FileTensor, read_at, write_at
from zerofn.extension import Extension
from zerofn.step import Step, reapply, transform
from zerofn.state import arriving, settle
from zerofn.storage import to_host

__all__ = ["DelayedHostState", "HostState", "NvmeFiles", "NvmeState", "offload"]

DEFAULT_SUB_GROUP_BYTES = 64 * 2**20


@transform
def offload(
    step: Step,
    /,
    device: str = "cpu",
    *,
    path: str | os.PathLike | None = None,
    params: bool = False,
    sub_group_bytes: int = DEFAULT_SUB_GROUP_BYTES,
    pin_memory: bool = True,
    overlap: bool | None = None,
    delay: int = 0,
    early: bool = False,
) -> Step:
    """Keep optimizer state (and fp32 master weights) in CPU RAM or NVMe files.

    Args:
        step: a Step. Called without it, returns a decorator.
        device: ``"cpu"`` or ``"nvme"``.
        path: a writable directory for ``"nvme"``'s files (one sub-directory per rank).
        params: also keep parameter shards on the host (needs ``shard_params``; ``"cpu"`` only).
        sub_group_bytes: ``"nvme"``: bytes of optimizer state streamed per sub-group.
        pin_memory: pin host buffers when CUDA is present.
        overlap: ``"cpu"``: run the host update on a worker thread, bucket by
            bucket in the order the forward reads them, and return before it
            ends; the next forward waits for each bucket as it first reads it,
            and reading the state waits for all of it. The same numbers as
            ``overlap=False``, which updates before the step returns. None
            (the default): on when the parameters live on an accelerator, off
            when the step computes on the CPU, whose cores the update and
            the forward would share.
        delay: ``"cpu"``: ``1`` delays each update by one step, as
            ZeRO-Offload's delayed parameter update: the host update of step
            t runs through the forward and backward of step t + 1, which use
            the parameters from before it, so each gradient is taken one
            update behind. It changes the numbers (off by default; see the
            offload page of the docs). ``0``: no delay.
        early: ``"cpu"``: start each bucket's host update during backward,
            as soon as its gradient is on the host, before the global norm
            and the skip decision are known: speculatively, the bucket's
            state saved first into a second copy of the host optimizer
            state (host RAM for it twice), restored on a skipped step and
            updated again when the norm clips. The same numbers as
            ``early=False``; see the offload page of the docs for when it
            pays.

    Returns:
        The rewritten Step. Applied to a step that already offloads with the
        same settings it returns that step unchanged.

    Raises:
        TypeError: ``step`` is not a Step.
        ValueError: an unknown device, a missing or unwritable ``path``, bad
            sizes, or a step that already offloads with other settings.
    """
    if device not in ("cpu", "nvme"):
        raise ValueError(f'offload: device must be "cpu" or "nvme", got {device!r}')
    if not isinstance(sub_group_bytes, int) or sub_group_bytes < 4096:
        raise ValueError(f"offload: sub_group_bytes must be an int >= 4096, got {sub_group_bytes!r}")
    if params and device != "cpu":
        raise ValueError('offload: params=True keeps parameter shards in CPU RAM; use device="cpu"')
    if delay not in (0, 1) or isinstance(delay, bool):
        raise ValueError(f"offload: delay must be 0 (update before the next forward) or 1 (one step late), got {delay!r}")
    if delay and device != "cpu":
        raise ValueError('offload: delay=1 runs the host update alongside the next step in CPU RAM; use device="cpu"')
    if early and (device != "cpu" or params or delay):
        raise ValueError(
            'offload: early=True updates host optimizer state in CPU RAM during backward, while the forward\'s '
            "parameters stay as they are; it takes device=\"cpu\", params=False and delay=0 (got "
            f"device={device!r}, params={bool(params)}, delay={delay!r})"
        )
    if delay and params:
        raise ValueError(
            "offload: delay=1 keeps a second host copy of the parameters for the next forward to run on while "
            "the update writes the first, which params=True (the parameter shards themselves on the host) has "
            "no room for; use params=False with delay=1, or delay=0"
        )
    pin = bool(pin_memory) and torch.cuda.is_available()
    if device == "nvme":
        root = _check_path(path)
        wrap = functools.partial(_nvme_optimizer, root=root, sub_group_bytes=sub_group_bytes)
        options = ("nvme", root, sub_group_bytes)
    else:
        if path is not None:
            raise ValueError('offload: path is for device="nvme"; device="cpu" keeps state in RAM')
        overlap = None if overlap is None else bool(overlap)
        wrap = functools.partial(
            _host_optimizer, pin=pin, params_on_host=bool(params), overlap=overlap, delay=delay, early=bool(early)
        )
        options = ("cpu", bool(params), pin, overlap, delay, bool(early))
    have = step.extension("offload")
    if reapply(step, "offload", have and have.options, options, "offloads (device and settings)"):
        return step
    late = functools.partial(_runs_late, delay=delay, overlap=overlap) if device == "cpu" else None
    step = step.extend(
        Extension("offload", options, wrap_optimizer=wrap, check=_needs_units if params else None, updates_late=late)
    )
    return step.replace(storage=step.storage.replace(param_placement="cpu")) if params else step


def _runs_late(device_type: str, *, delay: int, overlap: bool | None) -> bool:
    """Whether the host update may run on after the step returns, for parameters on ``device_type``:
    delayed, or overlapped (by default where the forward runs on an accelerator)."""
    return bool(delay) or bool(overlap) or (overlap is None and device_type != "cpu")


def _needs_units(step: Step) -> None:
    if not step.storage.gathers_units:
        raise ValueError(
            f"{step.name}.init: offload(params=True) keeps parameter shards on the host and brings them in "
            "per unit, which needs shard_params: offload(shard_params(step), params=True)"
        )


def _check_path(path: Any) -> str:
    if path is None:
        raise ValueError('offload(device="nvme") needs path=, a directory on the NVMe disk for the optimizer state')
    root = os.fspath(path)
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"offload: path {root!r} is a file; pass a directory (on the NVMe disk) for the state files")
    if not os.path.isdir(root):
        raise ValueError(
            f"offload: path {root!r} does not exist or is not a directory; create it first "
            f"(os.makedirs({root!r})) or pass another path"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=root):
            pass
    except OSError as e:
        raise ValueError(f"offload: path {root!r} is not writable ({e.strerror}); pass a directory you can write to") from None
    return root


# ---------------------------------------------------------------- CPU RAM


class HostState(NamedTuple):
    """Optimizer state in host memory: host copies of the parameters it updates and of their gradients
    (buffers kept from step to step, as DeepSpeed keeps its fp32 gradient partition on the host), and
    the inner optimizer's state."""

    params: Any  # None when the parameters already live on the host (params=True)
    grads: Any
    inner: Any
    spare: Any = None  # early=True: room to save each bucket's state before a speculative update

    offloaded = True  # the state's printout says where the optimizer state lives

    def checkpoint_parts(self) -> dict:
        """For ``zerofn.checkpoint``: the inner state; the host parameters mirror the parameters
        (filled on load, not saved); the gradient buffers are scratch."""
        return {"": self.inner} if self.params is None else {"": self.inner, "=params": self.params}


class DelayedHostState(HostState):
    """:class:`HostState` of a delayed update (``delay=1``): the host parameters are one update ahead
    of the parameters the forward uses, so a checkpoint saves them as a quantity of their own."""

    __slots__ = ()

    def checkpoint_parts(self) -> dict:
        return {"": self.inner, "@pending": self.params}


def _host_optimizer(
    inner: O.GradientTransformation,
    *,
    pin: bool,
    params_on_host: bool,
    overlap: bool | None = False,
    delay: int = 0,
    early: bool = False,
) -> O.GradientTransformation:
    kind = DelayedHostState if delay else HostState
    split = _PerBucket(inner)
    speculation = {"on": early}  # turned off for good when the optimizer cannot run before the norm is known

    def init(params):
        host = None if params_on_host else T.tree_map(lambda p: to_host(p.detach(), pin), params)
        # fp32 (amp's gradients reach the optimizer in fp32), or wider for a wider parameter
        grads = T.tree_map(lambda p: torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), pin_memory=pin), params)
        state = kind(host, grads, inner.init(params if params_on_host else host))
        return state._replace(spare=split.spare(state.inner, host)) if early else state

    def later(params) -> bool:  # whether the update may run on after the step returns
        return any(_runs_late(p.device.type, delay=delay, overlap=overlap) for p in params.values())

    def to_host_grads(grads, state) -> None:
        torch._foreach_copy_(T.tree_leaves(state.grads), T.tree_leaves(grads), non_blocking=pin)
        if pin:
            torch.cuda.current_stream().synchronize()

    def on_host(state, target, extra):  # the whole update, here and now
        return state._replace(inner=O.update_params(inner, state.grads, state.inner, target, **extra))

    def copy_out(params, state) -> None:
        torch._foreach_copy_(T.tree_leaves(params), T.tree_leaves(state.params), non_blocking=pin)

    def update_host(state, params, extra, run_later: bool):
        """The update, the gradients on the host: here and now, or launched on the worker (the state
        marked as arriving)."""
        target = params if params_on_host else state.params
        if not run_later:
            new = on_host(state, target, extra)
            if not params_on_host:
                copy_out(params, state)
            return new
        if delay:  # the parameters the last update made, for the next forward; then this update
            copy_out(params, state)
            if pin:
                torch.cuda.current_stream().synchronize()
        device = None if (delay or params_on_host) else params
        launched = _launch(split, state, target, device, extra, pin)
        if launched is None:  # an optimizer state the update cannot be split over buckets for: update here
            new = on_host(state, target, extra)
            if device is not None:
                copy_out(params, state)
            return new
        _mark(launched, state, params, device is not None or params_on_host)
        return state

    @torch.no_grad()
    def update_now(grads, state, params, **extra):
        to_host_grads(grads, state)
        return update_host(state, params, extra, run_later=False)

    @torch.no_grad()
    def update_later(grads, state, params, **extra):
        # Reading state.opt_state waited for the update before this one: its buffers are free.
        to_host_grads(grads, state)
        return update_host(state, params, extra, run_later=later(params))

    def start_update(state, params):
        target = params if params_on_host else state.params
        plan = split.plan(state.inner, target) if speculation["on"] and state.spare is not None else None
        if plan is None:
            return _Landing(state, params, pin, lambda extra: update_host(state, params, extra, later(params)))
        return _Speculation(split, plan, state, target, params, pin, later(params), speculation)

    pure = O.in_place(init, update_now, "offload")  # the pure update() waits for its result
    if delay:  # the gradient buffers are read by the update of the step before until its update phase
        return O.GradientTransformation(init, pure.update, update_later)
    return O.GradientTransformation(init, pure.update, update_later if overlap is not False else update_now, start_update)


def _mark(launched: "_Launched", state: HostState, params: dict, params_written: bool) -> None:
    """Mark what a launched update writes as arriving: each device bucket until its own update is done."""
    if params_written:
        for k in params:
            arriving(params[k], launched.buckets[k])
    for t in T.tree_leaves(state):
        if isinstance(t, torch.Tensor):
            arriving(t, launched)


class _Landing(O.PendingUpdate):
    """Gradients copied to the host bucket by bucket as backward lands them (non-blocking on CUDA,
    overlapping the rest of backward); the update itself once they all have (``commit``)."""

    def __init__(self, state: HostState, params: dict, pin: bool, update) -> None:
        self.state, self.params, self.pin, self.update = state, params, pin, update
        self.copied: dict = {}  # key -> a CUDA event once its copy is done (None on the CPU)
        self.kept: dict = {}  # key -> a gradient still on the device, for pageable host buffers

    def grad(self, key: str, grad: torch.Tensor) -> None:
        host = self.state.grads[key]
        settle([host])  # the update before this one reads it until it is done
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


class _Speculation(_Landing):
    """The host update of each bucket started as soon as its gradient is on the host, during backward.

    Until the step decides (``commit`` or ``cancel``), each bucket is
    updated speculatively: its state saved first into the spare buffers,
    updated with a :class:`~zerofn.optim.PendingNorm` for the global norm,
    its device parameters left alone. A skipped step or an error restores
    what was updated; a commit whose norm clips (or an optimizer that reads
    the norm as a number) restores it and updates again. The newest landed
    bucket goes first, so that what is left when backward ends is the
    embedding's end, which the next forward reads first.
    """

    def __init__(self, split, plan, state, target, params, pin, run_later: bool, speculation: dict) -> None:
        super().__init__(state, params, pin, None)
        self.run = _BucketRun(split, plan, state, target, params, pin)
        self.run_later, self.speculation = run_later, speculation
        self.cv = threading.Condition()
        self.ready: list = []  # landed, not yet updated
        self.decision: tuple | None = None
        self.failed = False
        self.finished = _Done()  # the speculation over: restored, or committed
        _worker().submit(self.speculate)

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
                    self.speculation["on"] = False
            kind, extra = self.decision
            if kind == "cancel" or self.failed or not norm.holds(float(extra["grad_norm"])):
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

    def decide(self, decision: tuple) -> None:
        with self.cv:
            self.decision = decision
            self.cv.notify()

    @torch.no_grad()
    def commit(self, **extra):
        self.all_copied()  # the buckets the speculation has not reached are updated without waiting
        self.decide(("commit", extra))
        state, run = self.state, self.run
        if not self.run_later:
            run.done.wait()
            return state
        _mark(run.done, state, self.params, True)
        return state

    def cancel(self) -> None:
        self.decide(("cancel", None))
        self.finished.wait()


class _Done:
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


class _Launched(NamedTuple):
    buckets: dict  # bucket key -> _Done, set once its parameters are written
    all: _Done

    def wait(self) -> None:
        self.all.wait()


@functools.cache
def _worker() -> concurrent.futures.ThreadPoolExecutor:
    """One thread for every host update, so that they run in the order launched."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerofn-offload")


class _PerBucket:
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
        """Room for a copy of each bucket's state (see :class:`_Speculation`; the host parameters need
        none: the device holds the same values until the update commits); None when the state cannot be
        taken apart by bucket."""
        plan = self.plan(state, target)
        if plan is None:
            return None
        leaves, owner, _ = plan
        return {k: [torch.empty_like(t) for t, o in zip(leaves, owner) if o == k] for k in target}


class _BucketRun:
    """One step's host update, bucket by bucket, on the worker thread (see :class:`_PerBucket`)."""

    def __init__(self, split: _PerBucket, plan: tuple, state: HostState, target: dict, device: dict | None, pin: bool):
        self.split, self.state, self.target, self.device = split, state, target, device
        self.leaves, self.owner, self.defs = plan
        self.mine = {k: [i for i, o in enumerate(self.owner) if o == k or o is None] for k in target}
        self.order = list(reversed(list(target)))  # buckets are in backward order: the forward reads the last first
        self.done = _Launched({k: _Done() for k in target}, _Done())
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
        new = T.tree_leaves(O.update_params(self.split.inner, {k: self.state.grads[k]}, sub, {k: self.target[k]}, **extra))
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

    def fail(self, e: BaseException) -> None:  # every waiter hears of it
        for d in (*self.done.buckets.values(), self.done.all):
            if not d.future.done():
                d.future.set_exception(e)


def _launch(split: _PerBucket, state: HostState, target: dict, device: dict | None, extra: dict, pin: bool):
    """Start the host update of every bucket, the one the forward reads first first; None if it cannot be split."""
    plan = split.plan(state.inner, target)
    if plan is None:
        return None
    run = _BucketRun(split, plan, state, target, device, pin)
    _worker().submit(run.commit_phase, extra)
    return run.done


# ---------------------------------------------------------------- NVMe


@dataclass(eq=False)
class NvmeFiles:
    """Where this rank's optimizer state lives on disk (a pytree leaf: placement and bytes show)."""

    root: str
    entries: list  # (file stem, dtype name, numel) per parameter-shaped state tensor
    generation: int = 0
    signature: str = ""  # what the manifest records: model layout, world size and rank
    tree: Any = None  # the inner optimizer state's structure over every bucket
    roles: tuple = ()  # per leaf of tree: ("file", stem, dtype name, numel) or ("small", index)
    placement: str = field(default="nvme", init=False)

    @property
    def nbytes(self) -> int:
        return sum(n * torch.empty((), dtype=getattr(torch, d)).element_size() for _, d, n in self.entries)

    def file(self, stem: str, generation: int | None = None) -> str:
        g = self.generation if generation is None else generation
        return os.path.join(self.root, f"{stem}.g{g}")

    def __repr__(self) -> str:
        return f"NvmeFiles({self.root}, {len(self.entries)} files, {self.nbytes / 2**20:.2f} MiB, gen {self.generation})"


class NvmeState(NamedTuple):
    """Optimizer state on NVMe: the small leaves (step counts) in memory, the rest in files."""

    small: list
    files: NvmeFiles

    offloaded = True

    def checkpoint_parts(self) -> dict:
        """For ``zerofn.checkpoint``: the inner optimizer state, its parameter-shaped leaves as files."""
        f = self.files
        leaves = [
            FileTensor(f.file(r[1]), getattr(torch, r[2]), r[3]) if r[0] == "file" else self.small[r[1]]
            for r in f.roles
        ]
        return {"": T.tree_unflatten(f.tree, leaves)}


@dataclass(frozen=True)
class _Shape:
    """Which leaves of the inner optimizer's state are shaped like the parameters."""

    treedef: Any
    big: tuple[int, ...]  # positions of parameter-shaped leaves
    big_dtypes: tuple[torch.dtype, ...]


def _probe(inner: O.GradientTransformation, dtype: torch.dtype) -> tuple[_Shape, list]:
    state = inner.init({"x": torch.zeros(2, dtype=dtype)})
    leaves, treedef = T.tree_flatten(state)
    big = tuple(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.shape == (2,))
    small = [t for i, t in enumerate(leaves) if i not in big]
    return _Shape(treedef, big, tuple(leaves[i].dtype for i in big)), small


def _nvme_optimizer(inner: O.GradientTransformation, *, root: str, sub_group_bytes: int) -> O.GradientTransformation:
    def init(params):
        keys = list(params)
        dtypes = {params[k].dtype for k in keys}
        if len(dtypes) > 1:
            raise ValueError(f"offload(nvme): parameters of one dtype expected, got {sorted(map(str, dtypes))}")
        shape, small = _probe(inner, dtypes.pop())
        rank_dir = os.path.join(root, f"rank{C.rank()}")
        os.makedirs(rank_dir, exist_ok=True)
        entries = [(f"{k}_{j}", str(dt).replace("torch.", ""), params[k].numel()) for k in keys for j, dt in enumerate(shape.big_dtypes)]
        signature = _signature(entries, C.world_size(), C.rank())
        _check_manifest(rank_dir, signature)
        files = NvmeFiles(rank_dir, entries, 0, signature, *_roles(inner, params))
        _fresh(files, 0, keys)
        # Write generation 0 sub-group by sub-group: init's values for each slice of the parameters.
        for k in keys:
            flat = params[k].detach().reshape(-1)
            for a, b in _chunks(flat.numel(), _chunk_elems(shape, sub_group_bytes)):
                leaves = T.tree_leaves(inner.init({"x": flat[a:b].to("cpu", copy=True)}))
                for j, pos in enumerate(shape.big):
                    write_at(files.file(f"{k}_{j}", 0), leaves[pos], a)
        _write_manifest(rank_dir, signature, 0)
        return NvmeState(small, files)

    @torch.no_grad()
    def update_in_place(grads, state, params, **extra):
        files = state.files
        shape, _ = _probe(inner, next(iter(params.values())).dtype)
        old, new = files.generation, 1 - files.generation
        chunk = _chunk_elems(shape, sub_group_bytes)
        new_small = None
        _fresh(files, new, list(params))
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as io:
                for k in params:
                    flat_p, flat_g = params[k].reshape(-1), grads[k].reshape(-1)
                    stems = [f"{k}_{j}" for j in range(len(shape.big))]
                    spans = _chunks(flat_p.numel(), chunk)
                    reading = io.submit(_read_group, files, stems, old, spans[0], shape) if spans else None
                    writes: list = []
                    for i, (a, b) in enumerate(spans):
                        big = reading.result()
                        if i + 1 < len(spans):  # read the next sub-group while this one is updated
                            reading = io.submit(_read_group, files, stems, old, spans[i + 1], shape)
                        leaves: list = [None] * (len(shape.big) + len(state.small))
                        for pos, t in zip(shape.big, big):
                            leaves[pos] = t
                        rest = iter([s.clone() for s in state.small])  # the counts as they were before this step
                        leaves = [t if t is not None else next(rest) for t in leaves]
                        sub = T.tree_unflatten(shape.treedef, leaves)
                        p = {"x": flat_p[a:b].to("cpu", copy=True)}
                        g = {"x": flat_g[a:b].to("cpu", copy=True)}
                        sub = O.update_params(inner, g, sub, p, **extra)
                        out = T.tree_leaves(sub)
                        new_small = [t for i2, t in enumerate(out) if i2 not in shape.big]
                        writes.append(io.submit(_write_group, files, stems, new, a, big, p["x"], f"{k}_next"))
                        if len(writes) > 2:  # at most two sub-groups waiting to be written
                            writes.pop(0).result()
                    for w in writes:
                        w.result()
        except OSError as e:
            raise OSError(
                e.errno,
                f"offload(nvme): the update could not write the optimizer state under {files.root} "
                f"({e.strerror}). Nothing was changed: the state from before this step is intact. Free space "
                "(or pass another path) and run the step again.",
            ) from e
        # Every write succeeded: copy the new parameters in, then switch generations.
        for k in params:
            flat_p = params[k].reshape(-1)
            for a, b in _chunks(flat_p.numel(), chunk):
                buf = torch.empty(b - a, dtype=flat_p.dtype)
                _pread(files.file(f"{k}_next", 0), buf, a)
                flat_p[a:b].copy_(buf)
        _write_manifest(files.root, files.signature, new)
        new_files = dataclasses.replace(files, generation=new)
        return NvmeState(new_small if new_small is not None else state.small, new_files)

    return O.in_place(init, update_in_place, "offload")


def _roles(inner: O.GradientTransformation, params: dict) -> tuple[Any, tuple]:
    """The inner state's structure over every bucket, and where each of its leaves lives (see NvmeFiles)."""
    meta = {k: torch.empty(v.numel(), dtype=v.dtype, device="meta") for k, v in params.items()}
    paths, leaves, tree = T.tree_flatten_with_path(inner.init(meta))
    roles, seen, n_small = [], {}, 0
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
            key = next(c for c in reversed(path) if c in params)
            j = seen[key] = seen.get(key, -1) + 1
            roles.append(("file", f"{key}_{j}", str(leaf.dtype).replace("torch.", ""), leaf.numel()))
        else:
            roles.append(("small", n_small))
            n_small += 1
    return tree, tuple(roles)


def _fresh(files: NvmeFiles, generation: int, keys: list) -> None:
    """Unlink a generation's files before writing it: new files, never old ones changed in place, so a
    checkpoint's hard link to them keeps the bytes it saw."""
    stems = [e[0] for e in files.entries] + [f"{k}_next" for k in keys]
    for stem in stems:
        for g in {generation, 0} if stem.endswith("_next") else {generation}:
            try:
                os.unlink(files.file(stem, g))
            except FileNotFoundError:
                pass


def _chunk_elems(shape: _Shape, sub_group_bytes: int) -> int:
    per = sum(torch.empty((), dtype=d).element_size() for d in shape.big_dtypes) or 4
    return max(1, sub_group_bytes // per)


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def _read_group(files: NvmeFiles, stems: list, generation: int, span: tuple, shape: _Shape) -> list:
    a, b = span
    out = []
    for stem, dt in zip(stems, shape.big_dtypes):
        t = torch.empty(b - a, dtype=dt)
        _pread(files.file(stem, generation), t, a)
        out.append(t)
    return out


def _write_group(files: NvmeFiles, stems: list, generation: int, a: int, big: list, params: torch.Tensor, stage: str):
    for stem, t in zip(stems, big):
        write_at(files.file(stem, generation), t, a)
    write_at(files.file(stage, 0), params, a)
    return True


def _pread(path: str, t: torch.Tensor, offset_elems: int) -> None:
    if read_at(path, t, offset_elems) != t.numel() * t.element_size():
        raise OSError(5, f"offload(nvme): {path} is shorter than expected (a partial or foreign file)")


def _signature(entries: list, world: int, rank: int) -> str:
    text = json.dumps({"entries": entries, "world": world, "rank": rank})
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _read_manifest(rank_dir: str) -> dict:
    with open(os.path.join(rank_dir, "manifest.json")) as f:
        return json.load(f)


def _write_manifest(rank_dir: str, signature: str, generation: int) -> None:
    tmp = os.path.join(rank_dir, "manifest.json.tmp")
    with open(tmp, "w") as f:
        json.dump({"format": "zerofn-offload-1", "signature": signature, "generation": generation}, f)
    os.replace(tmp, os.path.join(rank_dir, "manifest.json"))  # atomic: the old or the new, never half


def _check_manifest(rank_dir: str, signature: str) -> None:
    name = os.path.join(rank_dir, "manifest.json")
    if not os.path.exists(name):
        return
    try:
        found = _read_manifest(rank_dir).get("signature")
    except (OSError, ValueError):
        found = None
    if found != signature:
        raise ValueError(
            f"offload(nvme): {rank_dir} holds optimizer state files of another model, world size or rank "
            f"(manifest signature {found!r}, this one {signature!r}). Use an empty directory for this run, or "
            "delete those files if they are no longer needed."
        )
