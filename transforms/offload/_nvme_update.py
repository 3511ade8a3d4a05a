"""The update of ``offload("nvme")``, streamed sub-group by sub-group through its files.

:func:`stream` runs it for the engine (``_nvme``): for each bucket, a thread
reads the next sub-group (its state from the current generation, its
gradient from the file backward landed it in, its parameters when they rest
in files) into a buffer of the engine's pool, while the current one is
updated and another thread writes the previous one: the new state to the
other generation, the new parameters to a staging file ``{bucket}_next``
(or, for parameters in files, to their other generation). Only when every
write has succeeded are the parameters copied in and the manifest switched,
so a failed update (a full disk) leaves the state from before the step
intact.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Protocol

import torch
from zerofn.transforms.offload._nvme_files import NvmeState, fresh, next_generation, write_manifest
from zerofn.transforms.offload._nvme_sub_groups import BucketPlan
from zerofn.transforms.offload._pending import landing_dtype

from zerofn import alloc
from zerofn import optim as O
from zerofn import tree as T
from zerofn._io import FileTensor, read_exact, remove

__all__ = ["SubGroups", "stream"]


class SubGroups(Protocol):
    """What the update asks of the engine (``_nvme.NvmeEngine``): each bucket's plan, the inner optimizer
    bound to a sub-group, a sub-group's tensors in its buffer, and the pool of those buffers."""

    def plan(self, key: str, numel: int, dtype: torch.dtype) -> BucketPlan: ...

    def on(self, key: str, a: int, b: int) -> O.GradientTransformation: ...

    def layout(self, key: str, param: Any, a: int, b: int, grad_dtype: torch.dtype) -> list: ...

    def sub_group_buffers(self, layouts: list) -> alloc.HostPool: ...


@torch.no_grad()
def stream(
    engine: SubGroups,
    state: NvmeState,
    params: dict,
    extra: dict,
    *,
    grads: dict | None = None,
    landed: dict | None = None,
    on_cpu: bool = False,
) -> NvmeState:
    """The update, streamed sub-group by sub-group. The gradients: ``grads`` (bucket key -> the reduced
    gradient), or, when None, ``state.grads``' files, which backward landed them in in the dtypes
    ``landed`` gives (see ``_nvme.FileLanding``); each sub-group's gradient is read beside its state.

    Its host buffers come from the engine's pool (``sub_group_buffers``). ``on_cpu``: the step computed on
    the CPU (its gradients arrived there): the memory it freed goes back to the system after the update
    (:func:`zerofn.alloc.return_freed`)."""
    on_disk = grads is None
    files = state.files
    old, new = files.generation, 1 - files.generation
    plans = {k: engine.plan(k, p.numel(), p.dtype) for k, p in params.items()}
    new_small = None
    fresh(files, new, list(params))
    # Parameters that rest in files (offload(..., params="nvme")): each sub-group read beside its state,
    # the new values written to the parameter's other generation, switched to once every write is done.
    in_files = {k: p for k, p in params.items() if isinstance(p, FileTensor)}
    next_gen = {k: next_generation(p) for k, p in in_files.items()}
    for f in next_gen.values():
        remove(f.path)
    grad_dtype = {k: landing_dtype(p.dtype) if on_disk else grads[k].dtype for k, p in params.items()}
    pool = engine.sub_group_buffers(
        [engine.layout(k, p, a, b, grad_dtype[k]) for k, p in params.items() for a, b in plans[k].spans]
    )
    leases: list = []  # every lease taken, released (again: a no-op) however the update ends

    def take(k: str, span: tuple[int, int]) -> alloc.Lease:
        leases.append(pool.take(engine.layout(k, params[k], *span, grad_dtype[k])))
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
                    sub = O.update_params(engine.on(k, a, b), g, sub, p, **extra)
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
    write_manifest(files.root, files.signature, new)
    new_files = dataclasses.replace(files, generation=new)
    if on_cpu:
        # The step computed on the CPU: its own buffers (gathered units, gradients) came from the C
        # allocator, whose freed memory stays resident, fragmented, in step with the model's size unless
        # handed back (the pools above it holds anyway).
        alloc.return_freed()
    return NvmeState(new_small if new_small is not None else state.small, new_files, state.grads)


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
