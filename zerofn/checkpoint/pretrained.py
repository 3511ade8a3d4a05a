"""``pretrained_init(directory)``: a Hugging Face checkpoint's weights read one tensor at a time, as the
``init_fn`` of ``shard_params``, so that a model built on the meta device starts from them with no rank
holding the whole model.

``from_pretrained`` builds the whole model on every rank before a sharded state can take it over; under
``shard_params`` (and ``quantize``, which encodes each weight as soon as it is read) a model built on the
meta device needs only one module's weights at a time. This reads them from the model directory's
``*.safetensors`` files (one file, or several with ``model.safetensors.index.json``) by byte range: each
tensor's bytes are read when its module is materialised, and nothing else is kept.

The files are plain safetensors, read here with the standard library and torch (the format is a JSON
header and the tensors' bytes), so zerofn needs no ``safetensors`` package; they carry no checksums, unlike
zerofn's own checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

import torch

from zerofn._safetensors import dtype_from_name

__all__ = ["pretrained_init"]

# peft wraps a model: base_model.model.<the model's names>, and a LoRA layer's own Linear is <layer>.base_layer
_PEFT_PREFIX = "base_model.model."
_PEFT_BASE = ".base_layer"


class _File:
    """One safetensors file's header, and its tensors read by name."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(n))
        self.header.pop("__metadata__", None)
        self.start = 8 + n

    def read(self, name: str) -> torch.Tensor:
        entry = self.header[name]
        lo, hi = entry["data_offsets"]
        with open(self.path, "rb") as f:
            f.seek(self.start + lo)
            data = bytearray(f.read(hi - lo))
        if len(data) != hi - lo:
            raise ValueError(f"pretrained_init: {self.path} ended inside tensor {name!r} (a truncated file)")
        dtype = dtype_from_name(entry["dtype"])
        flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return flat.reshape(entry["shape"])


def _files(directory: str) -> dict[str, _File]:
    """Tensor name -> the file that holds it."""
    index = os.path.join(directory, "model.safetensors.index.json")
    single = os.path.join(directory, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        opened = {fn: _File(os.path.join(directory, fn)) for fn in sorted(set(weight_map.values()))}
        return {name: opened[fn] for name, fn in weight_map.items()}
    if os.path.isfile(single):
        f = _File(single)
        return dict.fromkeys(f.header, f)
    found = sorted(os.listdir(directory)) if os.path.isdir(directory) else None
    raise ValueError(
        f"pretrained_init({directory!r}): expected a Hugging Face model directory with model.safetensors or "
        f"model.safetensors.index.json; found {found if found is not None else 'no such directory'}. Save the "
        "model with save_pretrained(directory) (safetensors is its default), or convert a pytorch_model.bin with "
        "transformers first."
    )


def _adapter_init(name: str, meta: torch.Tensor) -> torch.Tensor | None:
    """peft's default initialisation of a LoRA Linear's adapters (``init_lora_weights=True``): A as a
    Linear's weight (Kaiming-uniform, a = sqrt 5), B zeros, so the adapted model starts as the base. A
    model's own ``_init_weights`` would draw B at random instead."""
    if ".lora_B." in name:
        return torch.zeros(meta.shape, dtype=meta.dtype)
    if ".lora_A." in name and meta.dim() == 2:
        return torch.nn.init.kaiming_uniform_(torch.empty(meta.shape, dtype=meta.dtype), a=math.sqrt(5))
    return None


def pretrained_init(directory: str | os.PathLike) -> Callable[[str, torch.Tensor], torch.Tensor | None]:
    """An ``init_fn`` for ``shard_params`` that reads each parameter from a Hugging Face checkpoint.

    ``shard_params(step, init_fn=zf.checkpoint.pretrained_init(directory))`` with a model built on the
    meta device (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(config)``, then
    ``get_peft_model`` if you train adapters) fills each rank's shards from the files, one module at a
    time; under ``quantize`` each weight is encoded as soon as it is read. peft's names are mapped to the
    base model's (``base_model.model.`` and ``.base_layer`` removed). peft's LoRA adapters, which the
    files do not hold, start as peft starts them (``lora_A`` Kaiming-uniform, ``lora_B`` zeros: the
    adapted model is the base model at step 0); other adapter parameters (``lora_`` in the name) are left
    to their module's initialisation (the function returns None for them).

    Args:
        directory: a model directory written by ``save_pretrained`` (``model.safetensors``, or shards
            listed in ``model.safetensors.index.json``).

    Returns:
        ``init_fn(name, meta) -> tensor | None``: the stored tensor, in the dtype the file holds (the
        caller casts), of ``meta``'s shape.

    Raises:
        ValueError: the directory holds no safetensors checkpoint; at ``init``, a parameter the files do
            not hold (other than an adapter), or one stored with another shape.

    Example:
        >>> import tempfile, torch, zerofn as zf
        >>> from zerofn.checkpoint import pretrained_init
        >>> d = tempfile.mkdtemp()
        >>> from zerofn._safetensors import Writer  # what save_pretrained writes, for the example
        >>> weight = torch.randn(2, 3)
        >>> w = Writer(f"{d}/model.safetensors", [("0.weight", torch.float32, (2, 3))])
        >>> w.write(weight); _ = w.close()
        >>> init = pretrained_init(d)
        >>> torch.equal(init("0.weight", torch.empty(2, 3, device="meta")), weight)
        True
        >>> init("0.lora_B.default.weight", torch.empty(2, 4, device="meta")).abs().sum().item()  # as peft
        0.0
    """
    directory = os.fspath(directory)
    where = _files(directory)

    def init_fn(name: str, meta: torch.Tensor) -> torch.Tensor | None:
        stored = name.removeprefix(_PEFT_PREFIX).replace(_PEFT_BASE, "")
        if stored not in where and name in where:
            stored = name
        if stored not in where:
            if "lora_" in name:
                return _adapter_init(name, meta)
            near = sorted(k for k in where if k.rpartition(".")[2] == stored.rpartition(".")[2])[:3]
            raise ValueError(
                f"pretrained_init({directory!r}): parameter {name!r} (looked up as {stored!r}) is not in the "
                f"checkpoint's files (names like it there: {near}). Build the model from the same config the "
                "directory holds, or wrap this init_fn to map the names: init_fn=lambda name, meta: "
                "init(rename(name), meta)."
            )
        t = where[stored].read(stored)
        if tuple(t.shape) != tuple(meta.shape):
            raise ValueError(
                f"pretrained_init({directory!r}): {stored!r} is stored with shape {list(t.shape)}, the model's "
                f"parameter {name!r} has {list(meta.shape)}: the directory holds another model's weights."
            )
        return t

    return init_fn
