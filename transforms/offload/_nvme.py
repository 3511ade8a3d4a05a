"""The NVMe engine of ``offload("nvme")``: every parameter-shaped tensor of the optimizer state in files.

Each such tensor (Adam's moments, amp's master weights) is a file per rank
under ``root/rank{r}``, in two generations (``{stem}.g0``, ``{stem}.g1``), with
a manifest naming the current one; the small leaves (step counts) stay in the
pytree. :class:`NvmeEngine`'s update streams the files in sub-groups: a
thread reads the next sub-group and another writes the previous one (to the
other generation, the new parameters to a staging file ``{bucket}_next``)
while the current one is updated. Only when every write has succeeded are the
parameters copied in and the manifest switched, so a failed update (a full
disk) leaves the state from before the step intact.

Every file operation goes through :mod:`zerofn._io`.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from zerofn.transforms.offload._pending import landing_dtype

from zerofn import alloc
from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn._io import (
    FileTensor,
    digest,
    generation_file,
    new_file,
    other_generation,
    read_exact,
    remove,
    write_at,
    write_json,
)
from zerofn.roles import Inner

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

ALIGN_BYTES = 256  # a multiple of every CPU vector width (AVX2 32 bytes, AVX-512 64, SVE up to 256): see _spans
MANIFEST = "manifest.json"
# The update's sub-group buffers: the one read ahead, the one updated, and two waiting to be written.
UPDATE_BUFFERS = 4
MANIFEST_FORMAT = "zerofn-offload-1"


@dataclass(frozen=True)
class NvmeOptions:
    """What ``offload("nvme", ...)`` was asked for (compared by value when it is applied again)."""

    root: str
    sub_group_bytes: int
    pin: bool = False  # pinned host gradient buffers (CUDA present and pin_memory asked for)


class FileEntry(NamedTuple):
    """One parameter-shaped state tensor kept in a file: ``{stem}.g{generation}`` under the rank's directory."""

    stem: str  # "{bucket key}_{j}": the j-th parameter-shaped leaf of that bucket's state
    dtype_name: str  # "float32", ...
    numel: int

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class SmallLeaf(NamedTuple):
    """A leaf of the inner state kept in memory: ``NvmeState.small[index]``."""

    index: int


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(eq=False)
class NvmeFiles:
    """Where this rank's optimizer state lives on disk (a pytree leaf: placement and bytes show)."""

    root: str
    entries: list  # a FileEntry per parameter-shaped state tensor
    generation: int = 0
    signature: str = ""  # what the manifest records: model layout, world size and rank
    tree: Any = None  # the inner optimizer state's structure over every bucket
    roles: tuple = ()  # per leaf of tree: a FileEntry (in a file) or a SmallLeaf (in memory)
    placement: str = field(default="nvme", init=False)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def file(self, stem: str, generation: int | None = None) -> str:
        return generation_file(self.root, stem, self.generation if generation is None else generation)

    def tensor(self, stem: str, dtype: torch.dtype, numel: int, generation: int | None = None) -> FileTensor:
        """The file of ``stem`` in ``generation`` (default: the current one) as a :class:`FileTensor`."""
        return FileTensor(self.file(stem, generation), dtype, numel)

    def __repr__(self) -> str:
        return (
            f"NvmeFiles({self.root}, {len(self.entries)} files, {self.nbytes / 2**20:.2f} MiB, gen {self.generation})"
        )


@dataclass(eq=False)
class GradFiles:
    """A file per bucket that backward's gradients land in, under the rank's directory (scratch: written by
    each update's backward, read by its update, never saved). A pytree leaf: placement and bytes show."""

    root: str
    shapes: dict  # bucket key -> (numel, dtype)
    placement: str = field(default="nvme", init=False)

    @property
    def nbytes(self) -> int:
        return sum(n * dtype.itemsize for n, dtype in self.shapes.values())

    def tensor(self, key: str) -> FileTensor:
        n, dtype = self.shapes[key]
        return FileTensor(os.path.join(self.root, f"{key}.grad"), dtype, n)

    def __repr__(self) -> str:
        return f"GradFiles({self.root}, {len(self.shapes)} files, {self.nbytes / 2**20:.2f} MiB)"


class NvmeState(NamedTuple):
    """Optimizer state on NVMe: the small leaves (step counts) in memory, the rest in files, and a file
    per bucket that backward's gradients land in (:class:`GradFiles`: neither the device nor RAM ever
    holds the whole gradient partition)."""

    small: list
    files: NvmeFiles
    grads: GradFiles | None = None

    placement = "nvme"  # where the optimizer state lives (the state's printout shows it)

    def state_parts(self) -> tuple:
        """The inner optimizer state, its parameter-shaped leaves as :class:`~zerofn._io.FileTensor`."""
        f = self.files
        leaves = [
            f.tensor(r.stem, r.dtype, r.numel) if isinstance(r, FileEntry) else self.small[r.index] for r in f.roles
        ]
        return (Inner(T.tree_unflatten(f.tree, leaves)),)


class BucketPlan(NamedTuple):
    """How one bucket's state is streamed: its state's shape over a sub-group, and the sub-groups."""

    probe: O.StateProbe  # the inner state over one sub-group {"x": ...}: its treedef, big leaves, dtypes
    spans: list  # the sub-groups, (a, b) element ranges of the bucket


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
    (:func:`_spans`). An optimizer whose update runs collectives (``communicates``) gets each bucket in
    one call instead, so that its collectives run once per bucket in the step's order.
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
            probe = _probe(whole, numel, dtype, key)
            size = max(1, self.sub_group_bytes // (probe.bytes_per_element or 4))
            leaf = self.view.leaves.get(key) if self.view is not None else None
            starts = [q.offset for q in leaf.pieces] if leaf is not None else []
            spans = _spans(numel, size, starts, ALIGN_BYTES // dtype.itemsize)
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
        tree, roles, small = _roles(self.whole, params)
        plans = {k: self.plan(k, params[k].numel(), params[k].dtype) for k in keys}
        for k, plan in plans.items():
            _check_small(plan.probe, small, k)
        rank_dir = os.path.join(self.root, f"rank{C.rank()}")
        os.makedirs(rank_dir, exist_ok=True)
        entries = [
            FileEntry(f"{k}_{j}", _dtype_name(dt), params[k].numel())
            for k in keys
            for j, dt in enumerate(plans[k].probe.big_dtypes)
        ]
        signature = digest({"entries": entries, "world": C.world_size(), "rank": C.rank()})
        _check_manifest(rank_dir, signature)
        files = NvmeFiles(rank_dir, entries, 0, signature, tree, roles)
        _fresh(files, 0, keys)
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
        _write_manifest(rank_dir, signature, 0)
        grads = GradFiles(rank_dir, {k: (p.numel(), landing_dtype(p.dtype)) for k, p in params.items()})
        for k in keys:  # at their size, nothing written: each update's backward writes them whole
            g = grads.tensor(k)
            new_file(g.path, g.numel() * g.itemsize)
        return NvmeState(small, files, grads)

    @torch.no_grad()
    def update_in_place(self, grads: dict, state: NvmeState, params: dict, **extra) -> NvmeState:
        on_cpu = all(g.device.type == "cpu" for g in grads.values())
        return self.stream(state, params, extra, grads=grads, on_cpu=on_cpu)

    @torch.no_grad()
    def stream(
        self, state: NvmeState, params: dict, extra: dict, *, grads=None, landed=None, on_cpu: bool = False
    ) -> NvmeState:
        """The update, streamed sub-group by sub-group. The gradients: ``grads`` (bucket key -> the reduced
        gradient), or, when None, ``state.grads``' files, which backward landed them in in the dtypes
        ``landed`` gives (see :class:`FileLanding`); each sub-group's gradient is read beside its state.

        Its host buffers come from the engine's pool (:meth:`sub_group_buffers`). ``on_cpu``: the step
        computed on the CPU (its gradients arrived there): the memory it freed goes back to the system
        after the update (:func:`zerofn.alloc.return_freed`)."""
        on_disk = grads is None
        files = state.files
        old, new = files.generation, 1 - files.generation
        plans = {k: self.plan(k, p.numel(), p.dtype) for k, p in params.items()}
        new_small = None
        _fresh(files, new, list(params))
        # Parameters that rest in files (offload(..., params="nvme")): each sub-group read beside its state,
        # the new values written to the parameter's other generation, switched to once every write is done.
        in_files = {k: p for k, p in params.items() if isinstance(p, FileTensor)}
        next_gen = {k: _other_generation(p) for k, p in in_files.items()}
        for f in next_gen.values():
            remove(f.path)
        grad_dtype = {k: landing_dtype(p.dtype) if on_disk else grads[k].dtype for k, p in params.items()}
        pool = self.sub_group_buffers(
            [self.layout(k, p, a, b, grad_dtype[k]) for k, p in params.items() for a, b in plans[k].spans]
        )
        leases: list = []  # every lease taken, released (again: a no-op) however the update ends

        def take(k: str, span: tuple[int, int]) -> alloc.Lease:
            leases.append(pool.take(self.layout(k, params[k], *span, grad_dtype[k])))
            return leases[-1]

        try:
            with concurrent.futures.ThreadPoolExecutor(2) as io:
                for k in params:
                    probe, spans = plans[k]
                    flat_p = None if k in in_files else params[k].reshape(-1)
                    flat_g = None if on_disk else grads[k].reshape(-1)
                    n = params[k].numel()
                    olds = [files.tensor(f"{k}_{j}", dt, n, old) for j, dt in enumerate(probe.big_dtypes)]
                    news = [files.tensor(f"{k}_{j}", dt, n, new) for j, dt in enumerate(probe.big_dtypes)]
                    staged = next_gen[k] if k in in_files else files.tensor(f"{k}_next", params[k].dtype, n, 0)
                    # what is read from files, into the first of a sub-group's tensors, its gradient, its parameters
                    sources = [(f, j) for j, f in enumerate(olds)]
                    sources += [(state.grads.tensor(k), len(olds))] if on_disk else []
                    sources += [(in_files[k], len(olds) + 1)] if k in in_files else []
                    reading = io.submit(_read_group, sources, spans[0], take(k, spans[0])) if spans else None
                    writes: list = []
                    for i, (a, b) in enumerate(spans):
                        lease = reading.result()
                        if i + 1 < len(spans):  # read the next sub-group while this one is updated
                            reading = io.submit(_read_group, sources, spans[i + 1], take(k, spans[i + 1]))
                        *big, g_t, p_t = lease.tensors
                        if not on_disk:
                            g_t.copy_(flat_g[a:b])
                        if k not in in_files:
                            p_t.copy_(flat_p[a:b])
                        leaves: list = [None] * (len(probe.big) + len(state.small))
                        for pos, t in zip(probe.big, big):
                            leaves[pos] = t
                        rest = iter([s.clone() for s in state.small])  # the counts as they were before this step
                        leaves = [t if t is not None else next(rest) for t in leaves]
                        sub = T.tree_unflatten(probe.treedef, leaves)
                        p = {"x": p_t}
                        g = {"x": g_t.to(landed[k]) if on_disk else g_t}
                        sub = O.update_params(self.on(k, a, b), g, sub, p, **extra)
                        out = T.tree_leaves(sub)
                        new_small = [t for i2, t in enumerate(out) if i2 not in probe.big]
                        done = [out[pos] for pos in probe.big]
                        writes.append(io.submit(_write_group, news, a, done, staged, p_t, lease))
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
        finally:
            for lease in leases:
                lease.release()
        # Every write succeeded: copy the new parameters in (or switch to their new files), then switch
        # generations.
        for k, f in next_gen.items():
            in_files[k].path = f.path
        for k in (k for k in params if k not in in_files):
            flat_p = params[k].reshape(-1)
            staged = files.file(f"{k}_next", 0)
            for a, b in plans[k].spans:
                lease = pool.take([(flat_p.dtype, b - a)])
                read_exact(staged, lease.tensors[0], a)
                flat_p[a:b].copy_(lease.tensors[0])
                lease.release()
        _write_manifest(files.root, files.signature, new)
        new_files = dataclasses.replace(files, generation=new)
        if on_cpu:
            # The step computed on the CPU: its own buffers (gathered units, gradients) came from the C
            # allocator, whose freed memory stays resident, fragmented, in step with the model's size unless
            # handed back (the pools above it holds anyway).
            alloc.return_freed()
        return NvmeState(new_small if new_small is not None else state.small, new_files, state.grads)


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


def _other_generation(param: FileTensor) -> FileTensor:
    """The file a parameter's next values go to: its other generation (see :func:`zerofn._io.generation_file`)."""
    return FileTensor(other_generation(param.path), param.dtype, param.numel())


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


def _probe(opt: O.GradientTransformation, numel: int, dtype: torch.dtype, key: str) -> O.StateProbe:
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


def _check_small(probe: O.StateProbe, small: list, key: str) -> None:
    """Every sub-group's state carries the whole state's small leaves (its counts), in the same order."""
    mine = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in probe.small]
    whole = [(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t) for t in small]
    if mine != whole:
        raise ValueError(
            f"offload(nvme): the optimizer's state over bucket {key} has other small leaves (counts) than over "
            f"every bucket ({mine} against {whole}); NVMe offload keeps one set of small leaves for all "
            "sub-groups. Use offload('cpu') for this optimizer."
        )


def _roles(inner: O.GradientTransformation, params: dict) -> tuple[Any, tuple, list]:
    """The inner state's structure over every bucket, where each of its leaves lives (see NvmeFiles),
    and its small leaves as ``init`` makes them."""
    meta = {k: torch.empty(v.numel(), dtype=v.dtype, device="meta") for k, v in params.items()}
    paths, leaves, tree = T.tree_flatten_with_path(inner.init(meta))
    roles: list = []
    small: list = []
    seen: dict = {}
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
            key = next(c for c in reversed(path) if c in params)
            j = seen[key] = seen.get(key, -1) + 1
            roles.append(FileEntry(f"{key}_{j}", _dtype_name(leaf.dtype), leaf.numel()))
        else:
            roles.append(SmallLeaf(len(small)))
            small.append(leaf)
    return tree, tuple(roles), small


def _fresh(files: NvmeFiles, generation: int, keys: list) -> None:
    """Unlink a generation's files before writing it: new files, never old ones changed in place, so a
    checkpoint's hard link to them keeps the bytes it saw."""
    stems = [e.stem for e in files.entries] + [f"{k}_next" for k in keys]
    for stem in stems:
        for g in {generation, 0} if stem.endswith("_next") else {generation}:
            remove(files.file(stem, g))


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def _spans(n: int, size: int, starts: list[int], align: int) -> list[tuple[int, int]]:
    """Sub-groups of at most ``size`` of ``n`` elements, each cut where the parameter it cuts has an
    ``align``-element multiple of its elements on the left (``starts``: where each parameter's piece
    starts): a vectorised kernel then takes every element down the same code path as in one call over
    the whole bucket, so the update rounds the same (CPU kernels compute a tensor's last ``numel %
    vector width`` elements in scalar code). Without ``starts``, every ``size`` elements."""
    if not starts or size < align:
        return _chunks(n, size)
    spans, a = [], 0
    while a < n:
        b = a + size
        i = bisect.bisect_right(starts, b) - 1  # the piece that holds element b
        if b < n and i >= 0:
            cut = starts[i] + (b - starts[i]) // align * align
            b = cut if cut > a else b
        spans.append((a, min(n, b)))
        a = min(n, b)
    return spans


def _read_group(sources: list[tuple[FileTensor, int]], span: tuple[int, int], lease: alloc.Lease) -> alloc.Lease:
    """Elements ``span`` of each source file into the lease's tensor its index names."""
    for f, j in sources:
        read_exact(f.path, lease.tensors[j], span[0])
    return lease


def _write_group(
    tensors: list[FileTensor], a: int, big: list, staged: FileTensor, params: torch.Tensor, lease: alloc.Lease
) -> bool:
    """A sub-group's new state and parameters into their files; then its buffer goes back to the pool."""
    try:
        for f, t in zip(tensors, big):
            f.write(a, t)
        staged.write(a, params)
    finally:
        lease.release()
    return True


def _read_manifest(rank_dir: str) -> dict:
    with open(os.path.join(rank_dir, MANIFEST)) as f:
        return json.load(f)


def _write_manifest(rank_dir: str, signature: str, generation: int) -> None:
    """Atomic: the old manifest or the new, never half (see :func:`zerofn._io.write_json`)."""
    write_json(
        os.path.join(rank_dir, MANIFEST), {"format": MANIFEST_FORMAT, "signature": signature, "generation": generation}
    )


def _check_manifest(rank_dir: str, signature: str) -> None:
    name = os.path.join(rank_dir, MANIFEST)
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
