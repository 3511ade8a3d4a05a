"""The memory blocks of a DeepSpeed config: ``zero_optimization`` (stage, buckets, offload) and ``activation_checkpointing``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from zerofn.deepspeed._keys import (
    OFFLOAD_KNOWN,
    ZERO_ALIASES,
    ZERO_ANYWAY,
    ZERO_BLOCK_ERRORS,
    ZERO_IGNORED,
    ZERO_READ,
)
from zerofn.deepspeed._reader import Block, value_as

__all__ = ["ZeroSpec", "read_remat", "read_zero"]


@dataclass
class ZeroSpec:
    """What ``zero_optimization`` asks for, as the shard and offload transforms' options.

    Attributes:
        stage: the ZeRO stage, 0 to 3.
        bucket_elems: ``reduce_bucket_size`` in elements (None: zerofn's default bucket).
        prefetch: ``shard_params``'s prefetch (0 when ``stage3_prefetch_bucket_size`` is 0).
        sub_group_elems: ``sub_group_size`` in elements (NVMe offload; None: zerofn's default).
        offload_device: where ``offload`` moves the optimizer state, ``"cpu"`` or ``"nvme"`` (None: nowhere).
        nvme_path: the directory of NVMe offload (the optimizer state's, and the parameter shards' beside it).
        param_device: where ``offload_param`` (stage 3) puts the parameter shards, ``"cpu"`` or ``"nvme"``
            (None: on the device).
        pin_memory: pinned host buffers.
        replicate: ``mics_shard_size``'s replicas (MiCS: shard within groups of that many ranks, replicate
            across): the ZeRO stage's ``replicate`` (None: shard over all ranks).
        hpz: ``zero_hpz_partition_size`` (ZeRO++'s hpZ): ``shard_params``'s ``hpz`` (None: none).
        gather_dtype: ``"int8"`` with ``zero_quantized_weights`` (qwZ).
        reduce_dtype: ``"int8"`` with ``zero_quantized_gradients`` (qgZ).
    """

    stage: int = 0
    bucket_elems: int | None = None
    prefetch: int = 1
    sub_group_elems: int | None = None
    offload_device: str | None = None  # "cpu" | "nvme"
    nvme_path: str | None = None
    param_device: str | None = None  # "cpu" | "nvme"
    pin_memory: bool = False
    replicate: int | None = None
    hpz: int | None = None
    gather_dtype: str | None = None
    reduce_dtype: str | None = None


def read_zero(r: Block, ignored: dict) -> ZeroSpec:
    """What ``zero_optimization`` of the config's top level ``r`` asks for; keys with no equivalent go to ``ignored``."""
    z = ZeroSpec()
    raw = r.raw("zero_optimization")
    if raw is None:
        return z
    if isinstance(raw, bool):  # DeepSpeed's older form: true is stage 1
        z.stage = int(raw)
        return z
    raw = Block("zero_optimization", raw).data  # (checks it is a dict)
    blk = Block("zero_optimization", {ZERO_ALIASES.get(k, k): v for k, v in raw.items()})
    z.stage = blk.get("stage", 0, "int")
    if z.stage not in (0, 1, 2, 3):
        raise ValueError(f"from_deepspeed: zero_optimization.stage must be 0, 1, 2 or 3, got {z.stage!r}")
    # Sizes that only tune performance: "auto" takes zerofn's default.
    z.bucket_elems = blk.get("reduce_bucket_size", None, "int", auto=-1, low=1)
    z.bucket_elems = None if z.bucket_elems == -1 else z.bucket_elems
    prefetch = blk.get("stage3_prefetch_bucket_size", None, "int", auto=-1, low=0)
    z.prefetch = 0 if prefetch == 0 else 1
    if "stage3_prefetch_bucket_size" in blk and z.stage < 3:
        ignored[blk.key("stage3_prefetch_bucket_size")] = "prefetching is ZeRO-3's (stage 3)"
    sub = blk.get("sub_group_size", None, "int", auto=-1, low=0)
    z.sub_group_elems = None if sub in (None, -1) else sub
    # Offload: the optimizer state (cpu | nvme), and with stage 3 the parameter shards (cpu | nvme).
    opt = blk.block("offload_optimizer")
    par = blk.block("offload_param")
    legacy_pin = blk.get("cpu_offload_use_pin_memory", None, "bool")
    if opt is None and blk.get("cpu_offload", False, "bool"):  # deprecated spelling of offload_optimizer cpu
        opt = Block("zero_optimization.offload_optimizer", {"device": "cpu"})
    if par is None and blk.get("cpu_offload_param", False, "bool"):
        par = Block("zero_optimization.offload_param", {"device": "cpu"})
    pins = []
    if opt is not None:
        device = opt.get("device", "cpu", "str")
        if device not in ("cpu", "nvme", "none"):
            raise ValueError(f'from_deepspeed: {opt.key("device")} must be "cpu", "nvme" or "none", got {device!r}')
        if device != "none":
            z.offload_device = device
            pins.append(opt.get("pin_memory", None, "bool"))
            if device == "nvme":
                z.nvme_path = _nvme_path(opt)
            ratio = opt.get("ratio", 1.0, "float")
            if ratio != 1.0:
                ignored[opt.key("ratio")] = "offload moves the whole optimizer state"
            _offload_leftover(
                opt, ignored, "tunes DeepSpeed's own NVMe buffers (zerofn streams sub-groups of sub_group_size)"
            )
    if par is not None:
        device = par.get("device", "cpu", "str")
        if device not in ("cpu", "nvme", "none"):
            raise ValueError(f'from_deepspeed: {par.key("device")} must be "cpu", "nvme" or "none", got {device!r}')
        if device != "none":
            if z.stage != 3:
                raise ValueError(
                    f"from_deepspeed: zero_optimization.offload_param needs stage 3, got stage {z.stage} "
                    '(DeepSpeed refuses it too): set "stage": 3 or remove offload_param'
                )
            if device == "nvme":  # ZeRO-Infinity: the shards in files, beside the optimizer state's
                _check_params_on_nvme(par, z)
            elif z.offload_device != "nvme":
                # The shards in RAM; the optimizer state where offload_optimizer puts it (RAM, or files on NVMe
                # as ZeRO-Infinity's configs write it), and in RAM beside them when it names no device.
                z.offload_device = "cpu"
            z.param_device = device
            pins.append(par.get("pin_memory", None, "bool"))
            _offload_leftover(par, ignored, "tunes DeepSpeed's NVMe parameter buffers")
    pins.append(legacy_pin)
    z.pin_memory = next((p for p in pins if p is not None), False)  # DeepSpeed's default: not pinned
    if z.sub_group_elems is not None and z.offload_device != "nvme":
        ignored[blk.key("sub_group_size")] = "sub-groups stream NVMe-offloaded state only"
    _read_zeropp(blk, z)
    for k, msg in ZERO_BLOCK_ERRORS.items():
        v = blk.raw(k)
        if v is not None and v is not False and not (isinstance(v, dict) and v.get("enabled", True) is False):
            raise ValueError(f"from_deepspeed: {blk.key(k)} is set: {msg}")
    for k in blk.leftover():
        v = blk.raw(k)
        if k in ZERO_ANYWAY:
            anyway = ZERO_ANYWAY[k]
            if v != anyway.value:
                ignored[blk.key(k)] = f"zerofn's behaviour is fixed: {anyway.why}"
        elif k in ZERO_IGNORED:
            if v is not False and v is not None:
                ignored[blk.key(k)] = ZERO_IGNORED[k]
        else:
            raise ValueError(
                f"from_deepspeed: {blk.key(k)}: not a zero_optimization key zerofn knows (DeepSpeed refuses unknown "
                "keys here too, and ignoring it could change the numbers): check its spelling, or remove it. Known: "
                + ", ".join(sorted(ZERO_READ | set(ZERO_ANYWAY) | set(ZERO_IGNORED)))
            )
    return z


def _read_zeropp(blk: Block, z: ZeroSpec) -> None:
    """ZeRO++ and MiCS: ``zero_hpz_partition_size`` (hpZ), ``mics_shard_size`` (hybrid sharding),
    ``zero_quantized_weights`` / ``zero_quantized_nontrainable_weights`` (qwZ) and
    ``zero_quantized_gradients`` (qgZ), as the ZeRO stage's options."""
    hpz = blk.get("zero_hpz_partition_size", 1, "int", low=1)
    mics = blk.get("mics_shard_size", -1, "int")
    weights = blk.get("zero_quantized_weights", False, "bool")
    frozen = blk.get("zero_quantized_nontrainable_weights", False, "bool")
    grads = blk.get("zero_quantized_gradients", False, "bool")
    if hpz > 1 or weights or frozen:
        if z.stage != 3:
            which = "zero_hpz_partition_size" if hpz > 1 else "zero_quantized_weights"
            raise ValueError(
                f"from_deepspeed: {blk.key(which)} is ZeRO-3's (parameters gathered per unit), got stage {z.stage}: "
                'set "stage": 3 or remove it'
            )
        z.hpz = hpz if hpz > 1 else None
    if frozen and not weights:
        raise ValueError(
            f"from_deepspeed: {blk.key('zero_quantized_nontrainable_weights')} without zero_quantized_weights: "
            "zerofn's qwZ (shard_params(gather_dtype='int8')) gathers every unit's floating buffers as int8, trainable "
            "and frozen alike: set zero_quantized_weights true too, or remove it"
        )
    z.gather_dtype = "int8" if weights else None
    if grads:
        if z.stage < 2:
            raise ValueError(
                f"from_deepspeed: {blk.key('zero_quantized_gradients')} needs sharded gradients (stage 2 or 3), got "
                f'stage {z.stage}: set "stage": 2 or 3, or remove it'
            )
        z.reduce_dtype = "int8"
    if mics > 0:
        if z.stage == 0:
            raise ValueError(
                f'from_deepspeed: {blk.key("mics_shard_size")} needs a ZeRO stage: set "stage" or remove it'
            )
        if z.hpz is not None:
            raise ValueError(
                f"from_deepspeed: {blk.key('mics_shard_size')} and zero_hpz_partition_size both say how a node's ranks "
                "hold the parameters: give one"
            )
        z.replicate = mics  # the shard size here; the builder divides the world by it


def _nvme_path(blk: Block) -> str:
    """The ``nvme_path`` of an offload block whose device is ``"nvme"``: a string or a path, and not empty."""
    path = blk.raw("nvme_path")
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    elif path is not None:
        path = value_as(blk.key("nvme_path"), path, "str")
    if not path:
        raise ValueError(f'from_deepspeed: {blk.key("device")} "nvme" needs "nvme_path": a directory on the NVMe disk')
    return path


def _check_params_on_nvme(par: Block, z: ZeroSpec) -> None:
    """``offload_param`` ``"nvme"`` maps to ``offload(..., "nvme", path=nvme_path, params="nvme")``: the optimizer
    state on NVMe too (``offload`` streams parameter shards from files only beside it), in the same directory."""
    path = _nvme_path(par)
    if z.offload_device != "nvme":
        where = (
            'in CPU RAM (offload_optimizer "device": "cpu")'
            if z.offload_device == "cpu"
            else 'where the step computes (no offload_optimizer, or "device": "none")'
        )
        raise ValueError(
            f'from_deepspeed: {par.key("device")} "nvme" with the optimizer state {where}: zerofn keeps parameter '
            "shards in files only beside an optimizer state on NVMe too (under Adam and bf16 the state is six times "
            "their size, so where it fits in RAM the parameters do): set offload_optimizer "
            '{"device": "nvme", "nvme_path": ...} with the same nvme_path, or write offload_param "device": "cpu"'
        )
    if os.path.realpath(path) != os.path.realpath(z.nvme_path):
        raise ValueError(
            f"from_deepspeed: {par.key('nvme_path')} {path!r} and zero_optimization.offload_optimizer.nvme_path "
            f"{z.nvme_path!r} differ: zerofn keeps the parameter files and the optimizer-state files in one "
            'directory tree (a sub-directory per rank): give both blocks the same "nvme_path"'
        )


def _offload_leftover(blk: Block, ignored: dict, why: str) -> None:
    """The keys of an offload block zerofn does not read: DeepSpeed's buffer settings are warned, others refused."""
    for k in blk.leftover():
        if k not in OFFLOAD_KNOWN:
            raise ValueError(
                f"from_deepspeed: {blk.key(k)}: not an offload key zerofn knows (DeepSpeed refuses unknown keys here "
                f"too): check its spelling, or remove it. Known: "
                + ", ".join(sorted(OFFLOAD_KNOWN | {"device", "pin_memory", "ratio"}))
            )
        ignored[blk.key(k)] = why


def read_remat(r: Block, ignored: dict) -> dict | None:
    """The ``remat`` options ``activation_checkpointing`` asks for (``{"offload": "cpu"}`` with
    ``cpu_checkpointing``), or None for no ``remat``; keys with no equivalent go to ``ignored``."""
    blk = r.block("activation_checkpointing")
    if blk is None:
        return None
    flags = (
        "partition_activations",
        "cpu_checkpointing",
        "contiguous_memory_optimization",
        "synchronize_checkpoint_boundary",
    )
    on = any([blk.get(k, False, "bool") for k in flags]) or blk.raw("number_checkpoints") is not None
    profile = blk.get("profile", False, "bool")
    if on:
        if blk.data.get("number_checkpoints") is not None:
            ignored[blk.key("number_checkpoints")] = "remat checkpoints each of the model's natural blocks"
        if profile:
            ignored[blk.key("profile")] = "no profiler"
    for k in blk.leftover():
        ignored[blk.key(k)] = "unknown key"
    if not on:
        return None
    return {"offload": "cpu"} if blk.data.get("cpu_checkpointing") is True else {}
