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

import concurrent.futures
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn._io import FileTensor, digest, read_exact, write_at, write_json
from zerofn.roles import Inner

__all__ = ["FileEntry", "NvmeEngine", "NvmeFiles", "NvmeOptions", "NvmeState", "SmallLeaf", "nvme_optimizer"]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "zerofn-offload-1"


@dataclass(frozen=True)
class NvmeOptions:
    """What ``offload("nvme", ...)`` was asked for (compared by value when it is applied again)."""

    root: str
    sub_group_bytes: int


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
        g = self.generation if generation is None else generation
        return os.path.join(self.root, f"{stem}.g{g}")

    def tensor(self, stem: str, dtype: torch.dtype, numel: int, generation: int | None = None) -> FileTensor:
        """The file of ``stem`` in ``generation`` (default: the current one) as a :class:`FileTensor`."""
        return FileTensor(self.file(stem, generation), dtype, numel)

    def __repr__(self) -> str:
        return (
            f"NvmeFiles({self.root}, {len(self.entries)} files, {self.nbytes / 2**20:.2f} MiB, gen {self.generation})"
        )


class NvmeState(NamedTuple):
    """Optimizer state on NVMe: the small leaves (step counts) in memory, the rest in files."""

    small: list
    files: NvmeFiles

    placement = "nvme"  # where the optimizer state lives (the state's printout shows it)

    def state_parts(self) -> tuple:
        """The inner optimizer state, its parameter-shaped leaves as :class:`~zerofn._io.FileTensor`."""
        f = self.files
        leaves = [
            f.tensor(r.stem, r.dtype, r.numel) if isinstance(r, FileEntry) else self.small[r.index] for r in f.roles
        ]
        return (Inner(T.tree_unflatten(f.tree, leaves)),)


class NvmeEngine:
    """The inner optimizer with its parameter-shaped state in files (see the module docs), as a
    :class:`~zerofn.optim.GradientTransformation` (:meth:`transformation`)."""

    def __init__(self, inner: O.GradientTransformation, options: NvmeOptions) -> None:
        self.inner, self.root, self.sub_group_bytes = inner, options.root, options.sub_group_bytes
        self.probes: dict = {}  # dtype -> StateProbe, for the update (its treedef and dtypes)

    def transformation(self) -> O.GradientTransformation:
        return O.in_place(self.init, self.update_in_place, "offload")

    def probe(self, dtype: torch.dtype) -> O.StateProbe:
        """What the inner state keeps per parameter element of ``dtype`` (found once per dtype)."""
        if dtype not in self.probes:
            self.probes[dtype] = O.probe_state(self.inner, dtype)
        return self.probes[dtype]

    def chunk_elems(self, probe: O.StateProbe) -> int:
        """Parameter elements per sub-group."""
        return max(1, self.sub_group_bytes // (probe.bytes_per_element or 4))

    def init(self, params: dict) -> NvmeState:
        keys = list(params)
        dtypes = {params[k].dtype for k in keys}
        if len(dtypes) > 1:
            raise ValueError(f"offload(nvme): parameters of one dtype expected, got {sorted(map(str, dtypes))}")
        probe = O.probe_state(self.inner, dtypes.pop())  # its small leaves become this state's own
        rank_dir = os.path.join(self.root, f"rank{C.rank()}")
        os.makedirs(rank_dir, exist_ok=True)
        entries = [
            FileEntry(f"{k}_{j}", _dtype_name(dt), params[k].numel())
            for k in keys
            for j, dt in enumerate(probe.big_dtypes)
        ]
        signature = digest({"entries": entries, "world": C.world_size(), "rank": C.rank()})
        _check_manifest(rank_dir, signature)
        files = NvmeFiles(rank_dir, entries, 0, signature, *_roles(self.inner, params))
        _fresh(files, 0, keys)
        # Write generation 0 sub-group by sub-group: init's values for each slice of the parameters.
        for k in keys:
            flat = params[k].detach().reshape(-1)
            for a, b in _chunks(flat.numel(), self.chunk_elems(probe)):
                leaves = T.tree_leaves(self.inner.init({"x": flat[a:b].to("cpu", copy=True)}))
                for j, pos in enumerate(probe.big):
                    write_at(files.file(f"{k}_{j}", 0), leaves[pos], a)
        _write_manifest(rank_dir, signature, 0)
        return NvmeState(probe.small, files)

    @torch.no_grad()
    def update_in_place(self, grads: dict, state: NvmeState, params: dict, **extra) -> NvmeState:
        files = state.files
        probe = self.probe(next(iter(params.values())).dtype)
        old, new = files.generation, 1 - files.generation
        chunk = self.chunk_elems(probe)
        new_small = None
        _fresh(files, new, list(params))
        try:
            with concurrent.futures.ThreadPoolExecutor(2) as io:
                for k in params:
                    flat_p, flat_g = params[k].reshape(-1), grads[k].reshape(-1)
                    n = flat_p.numel()
                    olds = [files.tensor(f"{k}_{j}", dt, n, old) for j, dt in enumerate(probe.big_dtypes)]
                    news = [files.tensor(f"{k}_{j}", dt, n, new) for j, dt in enumerate(probe.big_dtypes)]
                    staged = files.tensor(f"{k}_next", flat_p.dtype, n, 0)
                    spans = _chunks(n, chunk)
                    reading = io.submit(_read_group, olds, spans[0]) if spans else None
                    writes: list = []
                    for i, (a, b) in enumerate(spans):
                        big = reading.result()
                        if i + 1 < len(spans):  # read the next sub-group while this one is updated
                            reading = io.submit(_read_group, olds, spans[i + 1])
                        leaves: list = [None] * (len(probe.big) + len(state.small))
                        for pos, t in zip(probe.big, big):
                            leaves[pos] = t
                        rest = iter([s.clone() for s in state.small])  # the counts as they were before this step
                        leaves = [t if t is not None else next(rest) for t in leaves]
                        sub = T.tree_unflatten(probe.treedef, leaves)
                        p = {"x": flat_p[a:b].to("cpu", copy=True)}
                        g = {"x": flat_g[a:b].to("cpu", copy=True)}
                        sub = O.update_params(self.inner, g, sub, p, **extra)
                        out = T.tree_leaves(sub)
                        new_small = [t for i2, t in enumerate(out) if i2 not in probe.big]
                        writes.append(io.submit(_write_group, news, a, big, staged, p["x"]))
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
            staged = files.file(f"{k}_next", 0)
            for a, b in _chunks(flat_p.numel(), chunk):
                buf = torch.empty(b - a, dtype=flat_p.dtype)
                read_exact(staged, buf, a)
                flat_p[a:b].copy_(buf)
        _write_manifest(files.root, files.signature, new)
        new_files = dataclasses.replace(files, generation=new)
        return NvmeState(new_small if new_small is not None else state.small, new_files)


def nvme_optimizer(inner: O.GradientTransformation, *, options: NvmeOptions) -> O.GradientTransformation:
    """``inner`` with its parameter-shaped state in files (see :class:`NvmeEngine`)."""
    return NvmeEngine(inner, options).transformation()


def _roles(inner: O.GradientTransformation, params: dict) -> tuple[Any, tuple]:
    """The inner state's structure over every bucket, and where each of its leaves lives (see NvmeFiles)."""
    meta = {k: torch.empty(v.numel(), dtype=v.dtype, device="meta") for k, v in params.items()}
    paths, leaves, tree = T.tree_flatten_with_path(inner.init(meta))
    roles: list = []
    seen: dict = {}
    n_small = 0
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
            key = next(c for c in reversed(path) if c in params)
            j = seen[key] = seen.get(key, -1) + 1
            roles.append(FileEntry(f"{key}_{j}", _dtype_name(leaf.dtype), leaf.numel()))
        else:
            roles.append(SmallLeaf(n_small))
            n_small += 1
    return tree, tuple(roles)


def _fresh(files: NvmeFiles, generation: int, keys: list) -> None:
    """Unlink a generation's files before writing it: new files, never old ones changed in place, so a
    checkpoint's hard link to them keeps the bytes it saw."""
    stems = [e.stem for e in files.entries] + [f"{k}_next" for k in keys]
    for stem in stems:
        for g in {generation, 0} if stem.endswith("_next") else {generation}:
            try:
                os.unlink(files.file(stem, g))
            except FileNotFoundError:
                pass


def _chunks(n: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(n, a + size)) for a in range(0, n, size)]


def _read_group(tensors: list[FileTensor], span: tuple[int, int]) -> list[torch.Tensor]:
    a, b = span
    return [t.read(a, b - a) for t in tensors]


def _write_group(tensors: list[FileTensor], a: int, big: list, staged: FileTensor, params: torch.Tensor) -> bool:
    for f, t in zip(tensors, big):
        f.write(a, t)
    staged.write(a, params)
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
