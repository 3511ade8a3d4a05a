"""The NVMe engine of ``offload("nvme")``: every parameter-shaped tensor of the optimizer state in files.

Each such tensor (Adam's moments, amp's master weights) is a file per rank
under ``root/rank{r}``, in two generations, with a manifest naming the
current one (``_nvme_files``); the small leaves (step counts) stay in the
pytree. :class:`NvmeEngine` binds the inner optimizer to each bucket's
sub-groups (``_nvme_sub_groups`` cuts them), writes generation 0 at
``init``, lands backward's gradients in their files (:class:`FileLanding`)
and runs the update streamed through the files (``_nvme_update``), so that
a failed update (a full disk) leaves the state from before the step intact.

Every file operation goes through :mod:`zerofn._io`.
"""

from __future__ import annotations

import concurrent.futures
import os
from dataclasses import dataclass
from typing import Any

import torch
from zerofn.transforms.offload._nvme_files import (
    FileEntry,
    GradFiles,
    NvmeFiles,
    NvmeState,
    SmallLeaf,
    check_manifest,
    dtype_name,
    fresh,
    state_roles,
    write_manifest,
)
from zerofn.transforms.offload._nvme_sub_groups import (
    ALIGN_BYTES,
    BucketPlan,
    check_small,
    probe_state,
    sub_group_spans,
)
from zerofn.transforms.offload._nvme_update import stream
from zerofn.transforms.offload._pending import landing_dtype

from zerofn import alloc
from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn._io import FileTensor, digest, new_file, write_at

__all__ = [
    "BucketPlan",
    "FileEntry",
    "NvmeEngine",
    "NvmeFiles",
    "NvmeOptions",
    "NvmeState",
    "SmallLeaf",
    "nvme_optimizer",
]

# The update's sub-group buffers: the one read ahead, the one updated, and two waiting to be written.
UPDATE_BUFFERS = 4


@dataclass(frozen=True)
class NvmeOptions:
    """What ``offload("nvme", ...)`` was asked for (compared by value when it is applied again)."""

    root: str
    sub_group_bytes: int
    pin: bool = False  # pinned host gradient buffers (CUDA present and pin_memory asked for)


class NvmeEngine:
    """The inner optimizer with its parameter-shaped state in files (see the module docs), as a
    :class:`~zerofn.optim.GradientTransformation` (:meth:`transformation`).

    Bound to a :class:`~zerofn.optim.ParamView` (a step binds it once per layout), the engine hands the
    inner optimizer each sub-group as the one leaf ``"x"`` of a view of its own (elements ``[a, b)`` of a
    bucket: :meth:`~zerofn.optim.ParamView.chunk`), so masks, groups and per-parameter rules see which
    parameters the sub-group holds, and the step's ``info`` (which parameters got no gradient) reaches
    each sub-group's update. Unbound, the inner optimizer sees each sub-group as a parameter of its own.

    Sub-groups are cut per bucket, from its state's bytes per element (groups of different optimizers
    stream different numbers of elements), where a vectorised kernel rounds as over the whole bucket
    (``_nvme_sub_groups.sub_group_spans``). An optimizer whose update runs collectives (``communicates``)
    gets each bucket in one call instead, so that its collectives run once per bucket in the step's order.
    """

    def __init__(self, inner: O.GradientTransformation, options: NvmeOptions, view: O.ParamView | None = None) -> None:
        self.inner, self.options, self.view = inner, options, view
        self.root, self.sub_group_bytes = options.root, options.sub_group_bytes
        self.whole = O.bind(inner, view) if view is not None else inner  # over every bucket at once
        self.plans: dict = {}  # (bucket key, numel, dtype) -> BucketPlan
        self.bound: dict = {}  # (bucket key, a, b) -> the inner optimizer bound to that sub-group
        self.buffers: alloc.HostPool | None = None  # the update's sub-groups (see :meth:`sub_group_buffers`)
        self.landing: alloc.HostPool | None = None  # gradients on their way to their files (see FileLanding)

    def transformation(self) -> O.GradientTransformation:
        pure = O.in_place(self.init, self.update_in_place, "offload")
        return pure._replace(
            start_update=self.start_update,
            bind=lambda view: NvmeEngine(self.inner, self.options, view).transformation(),
        )

    def start_update(self, state: NvmeState, params: dict, previous: Any) -> FileLanding:
        """Backward's gradients written to their files bucket by bucket as each lands (and freed on the
        device), then the streamed update reading them from there (``commit``)."""
        return FileLanding(self, state, params)

    def on(self, key: str, a: int, b: int) -> O.GradientTransformation:
        """The inner optimizer for elements ``[a, b)`` of bucket ``key``, as the one leaf ``"x"``."""
        if self.view is None or key not in self.view.leaves:
            return self.inner
        span = (key, a, b)
        if span not in self.bound:
            self.bound[span] = O.bind(self.inner, self.view.chunk(key, a, b, as_key="x"))
        return self.bound[span]

    def plan(self, key: str, numel: int, dtype: torch.dtype) -> BucketPlan:
        """What the inner state of bucket ``key`` keeps per element, and its sub-groups (found once)."""
        found = (key, numel, dtype)
        if found not in self.plans:
            whole = self.on(key, 0, numel)
            probe = probe_state(whole, numel, dtype, key)
            size = max(1, self.sub_group_bytes // (probe.bytes_per_element or 4))
            leaf = self.view.leaves.get(key) if self.view is not None else None
            starts = [q.offset for q in leaf.pieces] if leaf is not None else []
            spans = sub_group_spans(numel, size, starts, ALIGN_BYTES // dtype.itemsize)
            if whole.communicates or any(self.on(key, a, b).communicates for a, b in spans):
                # Its update runs collectives over the parameters it is given (Muon's gathers of matrices
                # cut across ranks or sub-groups): the bucket in one call, its collectives once per bucket
                # in the step's order, as without offload.
                spans = [(0, numel)]
            self.plans[found] = BucketPlan(probe, spans)
        return self.plans[found]

    def layout(self, key: str, param: Any, a: int, b: int, grad_dtype: torch.dtype) -> list:
        """A sub-group's tensors in its pool buffer: the state's parameter-shaped leaves, the gradient,
        the parameters, each over elements ``[a, b)``."""
        probe = self.plan(key, param.numel(), param.dtype).probe
        return [(dt, b - a) for dt in probe.big_dtypes] + [(grad_dtype, b - a), (param.dtype, b - a)]

    def sub_group_buffers(self, layouts: list) -> alloc.HostPool:
        """The update's pool: :data:`UPDATE_BUFFERS` buffers, each the largest sub-group's ``layouts``
        (made once for a layout of the model, reused by every update after)."""
        nbytes = max((alloc.slot_bytes(t) for t in layouts), default=0)
        if self.buffers is None or self.buffers.nbytes < nbytes:
            self.buffers = alloc.HostPool(UPDATE_BUFFERS, nbytes)
        return self.buffers

    def landing_buffers(self, params: dict) -> alloc.HostPool:
        """The pool gradients are copied into on their way to their files: :attr:`FileLanding.IN_FLIGHT`
        waiting to be written and the one landing, each the size of the largest bucket's gradient."""
        nbytes = max((alloc.slot_bytes([(landing_dtype(p.dtype), p.numel())]) for p in params.values()), default=0)
        if self.landing is None or self.landing.nbytes < nbytes:
            self.landing = alloc.HostPool(FileLanding.IN_FLIGHT + 1, nbytes, pin=self.options.pin)
        return self.landing

    def init(self, params: dict) -> NvmeState:
        keys = list(params)
        dtypes = {params[k].dtype for k in keys}
        if len(dtypes) > 1:
            raise ValueError(f"offload(nvme): parameters of one dtype expected, got {sorted(map(str, dtypes))}")
        tree, roles, small = state_roles(self.whole, params)
        plans = {k: self.plan(k, params[k].numel(), params[k].dtype) for k in keys}
        for k, plan in plans.items():
            check_small(plan.probe, small, k)
        rank_dir = os.path.join(self.root, f"rank{C.rank()}")
        os.makedirs(rank_dir, exist_ok=True)
        entries = [
            FileEntry(f"{k}_{j}", dtype_name(dt), params[k].numel())
            for k in keys
            for j, dt in enumerate(plans[k].probe.big_dtypes)
        ]
        signature = digest({"entries": entries, "world": C.world_size(), "rank": C.rank()})
        check_manifest(rank_dir, signature)
        files = NvmeFiles(rank_dir, entries, 0, signature, tree, roles)
        fresh(files, 0, keys)
        # Write generation 0 sub-group by sub-group: init's values for each slice of the parameters. A state
        # built to be loaded into (inside alloc.unfilled) gets its files at their size with nothing written
        # (the load writes every element); its structure is still checked, on the meta device.
        filling = alloc.filling()
        for k in keys:
            probe = plans[k].probe
            for a, b in plans[k].spans:
                x = _slice(params[k], a, b) if filling else torch.empty(b - a, dtype=params[k].dtype, device="meta")
                leaves, treedef = T.tree_flatten(self.on(k, a, b).init({"x": x}))
                if treedef != probe.treedef:
                    raise ValueError(
                        f"offload(nvme): the optimizer's state over elements {a}..{b} of bucket {k} has another "
                        f"structure than over the whole bucket ({treedef} against {probe.treedef}); NVMe offload "
                        "streams a bucket's state in sub-groups, so its structure must not depend on which "
                        "elements a sub-group holds. Use offload('cpu') for this optimizer."
                    )
                for j, pos in enumerate(probe.big if filling else ()):
                    write_at(files.file(f"{k}_{j}", 0), leaves[pos], a)
        if not filling:
            for e in entries:
                alloc.zeros_file(files.file(e.stem, 0), e.dtype, e.numel)
        write_manifest(rank_dir, signature, 0)
        grads = GradFiles(rank_dir, {k: (p.numel(), landing_dtype(p.dtype)) for k, p in params.items()})
        for k in keys:  # at their size, nothing written: each update's backward writes them whole
            g = grads.tensor(k)
            new_file(g.path, g.numel() * g.itemsize)
        return NvmeState(small, files, grads)

    @torch.no_grad()
    def update_in_place(self, grads: dict, state: NvmeState, params: dict, **extra) -> NvmeState:
        on_cpu = all(g.device.type == "cpu" for g in grads.values())
        return self.stream(state, params, extra, grads=grads, on_cpu=on_cpu)

    def stream(
        self, state: NvmeState, params: dict, extra: dict, *, grads=None, landed=None, on_cpu: bool = False
    ) -> NvmeState:
        """The update, streamed sub-group by sub-group through the files (see ``_nvme_update.stream``)."""
        return stream(self, state, params, extra, grads=grads, landed=landed, on_cpu=on_cpu)


class FileLanding(O.PendingUpdate):
    """Each bucket's gradient written to its file as backward lands it, on a writer thread (overlapping
    the rest of backward), from a host copy (pinned and non-blocking on CUDA; on the CPU the gradient
    itself) that lives only until its write is done; at most ``IN_FLIGHT`` are waiting at once.
    The host copies are buffers of the engine's landing pool (:meth:`NvmeEngine.landing_buffers`),
    ``IN_FLIGHT + 1`` of them. ``commit`` streams the update from the files."""

    IN_FLIGHT = 2

    def __init__(self, engine: NvmeEngine, state: NvmeState, params: dict) -> None:
        self.engine, self.state, self.params = engine, state, params
        self.buffers: alloc.HostPool | None = None  # the engine's landing pool, once a gradient needs a copy
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zerofn-nvme-grads")
        self.writes: list = []
        self.landed: dict = {}  # bucket key -> the dtype its gradient arrived in
        self.on_cpu = True  # every gradient arrived on the CPU: the step computed there

    def grad(self, key: str, grad: torch.Tensor) -> None:
        pin = self.engine.options.pin and grad.device.type == "cuda"
        dtype, event = landing_dtype(grad.dtype), None
        lease = None
        if grad.device.type == "cpu" and grad.dtype == dtype:
            host = grad  # handed over: written as it is, no copy
        else:
            if self.buffers is None:
                self.buffers = self.engine.landing_buffers(self.params)
            lease = self.buffers.take([(dtype, grad.numel())])
            host = lease.tensors[0]
            host.copy_(grad.reshape(-1), non_blocking=pin)
        if pin:
            event = torch.cuda.Event()
            event.record()
        self.landed[key] = grad.dtype
        self.on_cpu = self.on_cpu and grad.device.type == "cpu"
        file = self.state.grads.tensor(key)
        self.writes.append(self.writer.submit(_land, file, host, event, lease))
        while len(self.writes) > self.IN_FLIGHT:
            self.writes.pop(0).result()
            if grad.device.type == "cpu":  # the gradient it wrote, freed: back to the system (see stream)
                alloc.return_freed()

    def _written(self) -> None:
        try:
            for w in self.writes:
                w.result()
        finally:
            self.writes = []
            self.writer.shutdown()

    def commit(self, **extra: Any) -> NvmeState:
        try:
            self._written()
        except OSError as e:
            raise OSError(
                e.errno,
                f"offload(nvme): a gradient could not be written under {self.state.grads.root} ({e.strerror}). "
                "Nothing was changed: the state from before this step is intact. Free space (or pass another "
                "path) and run the step again.",
            ) from e
        return self.engine.stream(self.state, self.params, extra, landed=self.landed, on_cpu=self.on_cpu)

    def cancel(self) -> None:
        try:
            self._written()
        except OSError:
            pass  # a gradient file is scratch: the state is as it was, and the step's own error goes on


def _slice(param: Any, a: int, b: int) -> torch.Tensor:
    """Elements ``[a, b)`` of a flat parameter (a tensor or a file) in a new CPU tensor."""
    if isinstance(param, FileTensor):
        return param.read(a, b - a)
    return param.detach().reshape(-1)[a:b].to("cpu", copy=True)


def _land(file: FileTensor, host: torch.Tensor, event: Any, lease: alloc.Lease | None) -> None:
    try:
        if event is not None:
            event.synchronize()
        file.write(0, host)
    finally:
        if lease is not None:
            lease.release()


def nvme_optimizer(inner: O.GradientTransformation, *, options: NvmeOptions) -> O.GradientTransformation:
    """``inner`` with its parameter-shaped state in files (see :class:`NvmeEngine`)."""
    return NvmeEngine(inner, options).transformation()
