"""The files of ``offload("nvme")``: where a rank's optimizer state lives on disk, and its manifest.

Each parameter-shaped tensor of the inner optimizer state (Adam's moments,
amp's master weights) is a file per rank under ``root/rank{r}``, in two
generations (``{stem}.g0``, ``{stem}.g1``), with a manifest naming the
current one (:class:`NvmeFiles`, :class:`FileEntry`); the small leaves (step
counts) stay in the pytree (:class:`SmallLeaf`). Backward's gradients land
in a scratch file per bucket (:class:`GradFiles`). :class:`NvmeState` is the
state that holds them. The engine (``_nvme``) builds them, the update
(``_nvme_update``) reads and writes them.

Every file operation goes through :mod:`zerofn._io`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from zerofn import optim as O
from zerofn import tree as T
from zerofn._io import FileTensor, generation_file, other_generation, remove, write_json
from zerofn.roles import Inner

__all__ = [
    "FileEntry",
    "GradFiles",
    "NvmeFiles",
    "NvmeState",
    "SmallLeaf",
    "check_manifest",
    "dtype_name",
    "fresh",
    "next_generation",
    "state_roles",
    "write_manifest",
]

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "zerofn-offload-1"


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


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: how a :class:`FileEntry` records its dtype."""
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


def state_roles(inner: O.GradientTransformation, params: dict) -> tuple[Any, tuple, list]:
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
            roles.append(FileEntry(f"{key}_{j}", dtype_name(leaf.dtype), leaf.numel()))
        else:
            roles.append(SmallLeaf(len(small)))
            small.append(leaf)
    return tree, tuple(roles), small


def fresh(files: NvmeFiles, generation: int, keys: list) -> None:
    """Unlink a generation's files before writing it: new files, never old ones changed in place, so a
    checkpoint's hard link to them keeps the bytes it saw."""
    stems = [e.stem for e in files.entries] + [f"{k}_next" for k in keys]
    for stem in stems:
        for g in {generation, 0} if stem.endswith("_next") else {generation}:
            remove(files.file(stem, g))


def next_generation(param: FileTensor) -> FileTensor:
    """The file a parameter's next values go to: its other generation (see :func:`zerofn._io.generation_file`)."""
    return FileTensor(other_generation(param.path), param.dtype, param.numel())


def _read_manifest(rank_dir: str) -> dict:
    with open(os.path.join(rank_dir, MANIFEST)) as f:
        return json.load(f)


def write_manifest(rank_dir: str, signature: str, generation: int) -> None:
    """Atomic: the old manifest or the new, never half (see :func:`zerofn._io.write_json`)."""
    write_json(
        os.path.join(rank_dir, MANIFEST), {"format": MANIFEST_FORMAT, "signature": signature, "generation": generation}
    )


def check_manifest(rank_dir: str, signature: str) -> None:
    """A directory that already holds state files holds this model's (layout, world size and rank), or raises."""
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
