"""Export: the full model from a checkpoint, by ``state_dict`` names, as safetensors (one file, or the
Hugging Face sharded layout), read piece by piece in one process."""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from zerofn._io import write_json
from zerofn._safetensors import Writer
from zerofn.checkpoint._format import CheckpointError
from zerofn.checkpoint.manifest import Saved, Source
from zerofn.checkpoint.partitioned import partitions, whole
from zerofn.checkpoint.parts import PARAMS

__all__ = ["consolidate"]


class _Tensor(NamedTuple):
    """One tensor of the export: its name, where it is read from, and how it is written."""

    name: str
    source: Source
    offset: int
    numel: int
    shape: tuple
    dtype: torch.dtype  # as written

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _plan(saved: Saved, dtype: torch.dtype | None) -> list[_Tensor]:
    plan = []
    for name, _, held in saved.entries():
        if held not in saved.index:
            raise CheckpointError(f"{saved.what}: {name} ({held}) is not in the checkpoint")
        e = saved.index[held]
        # Parameters as the optimizer updates them: the full-precision copy where one was saved.
        key = saved.precise if e.kind == PARAMS and saved.precise is not None else e.kind
        source = Source(key, e.kind, e.bucket)
        src_dtype = saved.dtype(source)
        to = dtype if dtype is not None and src_dtype.is_floating_point else src_dtype
        plan.append(_Tensor(name, source, e.offset, e.numel, e.shape, to))
    return plan


def consolidate(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Write the full model (parameters and persistent buffers, by ``state_dict`` names) as safetensors.

    One process, no process group: each tensor is read from the pieces that
    hold it, written, and freed, so peak memory is about the largest tensor.
    Parameters come as the optimizer updates them (amp's fp32 masters where
    saved), cast to ``dtype`` when given; tied weights appear under each of
    their names, so ``model.load_state_dict(safetensors.torch.load_file(out))``
    accepts the file with ``strict=True``.

    Args:
        path: a checkpoint directory.
        out: the ``.safetensors`` file to write; with ``max_shard_bytes``
            and a larger model, a directory of ``model-0000k-of-0000n.safetensors``
            files and ``model.safetensors.index.json`` (the Hugging Face layout).
        dtype: cast floating tensors to this dtype (e.g. ``torch.bfloat16``).
        max_shard_bytes: the most bytes per file.

    Returns:
        The files written.
    """
    split = partitions(path)  # a split model's checkpoint: its parts reassembled, one parameter at a time
    saved = Saved(path) if split is None else whole(os.fspath(path), split)
    try:
        if not saved.m.get("frozen", True):
            raise CheckpointError(
                f"{saved.what} was saved without its frozen parameters (save(..., frozen=False)), so it does not "
                "hold the whole model. Load it with its step and the source it was saved from (zf.checkpoint.load), "
                "then save with frozen=True (or 'once') and consolidate that, or write the state with "
                "step.state_dict(state)."
            )
        plan = _plan(saved, dtype)
        out = os.fspath(out)
        total = sum(t.nbytes for t in plan)
        groups = [plan]
        if max_shard_bytes is not None and total > max_shard_bytes:
            groups, size = [[]], 0
            for t in plan:
                if groups[-1] and size + t.nbytes > max_shard_bytes:
                    groups.append([])
                    size = 0
                groups[-1].append(t)
                size += t.nbytes
        written = []
        if len(groups) == 1:
            targets = [out]
        else:
            os.makedirs(out, exist_ok=True)
            n = len(groups)
            targets = [os.path.join(out, f"model-{i + 1:05d}-of-{n:05d}.safetensors") for i in range(n)]
        weight_map = {}
        for target, group in zip(targets, groups):
            w = Writer(target, [(t.name, t.dtype, t.shape) for t in group], {"format": "pt"})
            for t in group:
                w.write(saved.read(t.source, t.offset, t.offset + t.numel).to(t.dtype).view(t.shape))
                weight_map[t.name] = os.path.basename(target)
            w.close()
            written.append(target)
        if len(groups) > 1:
            index = os.path.join(out, "model.safetensors.index.json")
            write_json(index, {"metadata": {"total_size": total}, "weight_map": weight_map})
            written.append(index)
        return written
    finally:
        saved.close()
