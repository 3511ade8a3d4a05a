"""Checkpoints: each rank saves what it holds, in the background, atomically; load on any world size
and any composition; export to safetensors.

``save(state, path)`` writes a directory::

    path/
      rank0.safetensors      this rank's pieces of the state (safetensors format)
      rank1.safetensors
      rank1.nvme0.bin ...    NVMe-offloaded optimizer state, hard-linked (or copied) file by file
      manifest.json          written last: layouts, where every piece lies, sizes, block checksums

Every state is described the same way, whatever made it: a *quantity*
(``params``, ``frozen``, ``buffers``, ``opt:<path>`` for each parameter-shaped
leaf of the optimizer's state, and each quantity a wrapper state declares
with ``state_parts()`` (:mod:`zerofn.roles`), such as amp's fp32 ``master``
weights) is laid out in flat buckets of named parameters
(``zerofn.state.Layout``), and a rank holds an element range of each bucket (all of it, or its shard). A
rank writes the ranges it holds; a range every rank holds (a replicated
bucket) is split so that rank r writes the r-th of N pieces: every byte is
written once, by N ranks in parallel, and no rank gathers anything.

``load(path, step)`` builds the state for ``step`` (``step.init`` on the
model's parameters, or a state you pass) and fills every range this rank
holds, parameter by parameter: it looks each parameter up in the saved
layout, maps its element range onto the saved pieces, and reads only those
byte ranges (checking each 4 MiB block it reads against the manifest's
CRC-32). So a checkpoint saved under ``shard_params`` on 4 ranks loads under
``shard_optimizer`` on 2, or plain on 1, with its optimizer moments. Across
compositions, a declared quantity's role (recorded in the manifest) decides
what fills what: a step with full-precision parameters gets a saved precise
quantity (amp's fp32 master weights) as its parameters, and a step that
declares one gets it from the saved precise quantity (or, from a checkpoint
without one, from the parameters); a step that declares no newer quantity
gets a delayed update's newest parameters as its parameters.

Scalars (the update count, the loss scale and its counters, the optimizer's
step counts, the entries of ``state.extra``) are written by rank 0; each
rank's RNG states by that rank, restored when the world size is the same.

Atomic and in the background: ``save`` snapshots this rank's state (a
device-to-host copy on GPU, a memory copy on CPU, a hard link for NVMe
files, which the offload writes afresh rather than in place) and, with
``blocking=False``, returns a handle while a thread writes the files into
``path.partial``; every rank then records its files (sizes, checksums) in a
small JSON file there, and rank 0, once all N have, writes ``manifest.json``
and renames the directory into place. A crash at any moment leaves
``path.partial`` without a manifest and every earlier checkpoint intact;
``latest(directory)`` finds the newest complete one. Coordination goes
through the file system, so the checkpoint directory must be one every rank
sees (a shared file system across machines, as with DCP).

Example:
    >>> import tempfile, torch, zerofn as zf
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> step = zf.train_step(lambda p, b: apply(p, b).square().mean(), zf.optim.adamw(1e-3))
    >>> state, _ = step(step.init(apply.params), torch.ones(2, 4))
    >>> d = tempfile.mkdtemp()
    >>> handle = zf.checkpoint.save(state, f"{d}/step_1", blocking=False)  # returns after the snapshot
    >>> handle.wait().done()
    True
    >>> again = zf.checkpoint.load(zf.checkpoint.latest(d), step)
    >>> int(again.count), torch.equal(again.params[0], state.params[0])
    (1, True)
"""

from zerofn._io import FileTensor, IntegrityError, read_at, write_at
from zerofn.checkpoint._format import CheckpointError
from zerofn.checkpoint.export import consolidate
from zerofn.checkpoint.loading import load, verify
from zerofn.checkpoint.manifest import latest
from zerofn.checkpoint.pretrained import pretrained_init
from zerofn.checkpoint.saving import SaveHandle, save
from zerofn.roles import find_quantity

__all__ = [
    "CheckpointError",
    "FileTensor",
    "IntegrityError",
    "SaveHandle",
    "consolidate",
    "find_quantity",
    "latest",
    "load",
    "pretrained_init",
    "read_at",
    "save",
    "verify",
    "write_at",
]
