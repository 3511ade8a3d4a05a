"""``from_deepspeed``: the Step a DeepSpeed config (``ds_config.json``) asks for, built from zerofn's transforms.

``from_deepspeed(config, loss_fn)`` reads a DeepSpeed config (a dict, or the
path of a JSON file) and composes what its keys ask for, the same Step one
would write by hand::

    train_step(loss_fn, chain(clip_by_global_norm(c), adamw(schedule, ...)), accumulate_steps, bucket_bytes=...)
      -> shard_optimizer / shard_grads / shard_params(prefetch=...)   zero_optimization.stage 1 / 2 / 3
      -> amp(torch.float16 | torch.bfloat16, loss scale ...)          fp16 / bf16
      -> offload("cpu" | "nvme", params=..., sub_group_bytes=...)     offload_optimizer / offload_param
      -> remat()                                                      activation_checkpointing

and adds one extension, ``deepspeed``, that holds the batch sizes the
config resolved (:class:`DeepSpeedConfig`; no effect on the step, it adds
``deepspeed(...)`` to the step's name). A rank feeds
``micro_batch_size(step)`` samples per call, and every
``step.accumulate_steps``-th call updates: ``train_batch_size`` samples
over all ranks, as under DeepSpeed.

The rules (the key-by-key table is in docs/migrating/deepspeed.md):

- Numbers keep DeepSpeed's meaning and defaults (its code's, where its
  docs differ: ``initial_scale_power`` 16, ``gradient_clipping`` 0), and
  sizes DeepSpeed counts in elements are converted to the bytes zerofn
  counts (``reduce_bucket_size`` x the bytes of a held parameter element;
  ``sub_group_size`` x the optimizer-state bytes per element).
- A key zerofn has no equivalent for, and whose absence changes no number
  (logging, profiling, tuning of DeepSpeed's own buffers), is listed in one
  ``UserWarning`` with what zerofn does instead; a key set to ``false``, or
  a block with ``"enabled": false``, asks for nothing and passes silently.
- A key that would change the numbers if ignored (``amsgrad``, apex
  ``amp``, ``consecutive_hysteresis``, curriculum learning, ...) raises a
  ValueError naming it and what to write instead, before anything is built.
- ``"auto"`` (filled in by the Hugging Face Trainer, which zerofn does not
  have) raises, naming the key and what to write, except where zerofn can
  resolve it: one batch key when the other two are numbers, and the sizes
  that only tune performance (buckets, prefetch), which take zerofn's
  defaults.

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms.deepspeed import from_deepspeed, micro_batch_size
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = from_deepspeed({
    ...     "train_batch_size": 8, "gradient_accumulation_steps": 2,
    ...     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    ...     "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
    ... }, loss_fn)
    >>> step.name, step.accumulate_steps, micro_batch_size(step)
    ('deepspeed(amp(shard_grads(train_step)))', 2, 4)
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn.extension import Extension
from zerofn.step import DEFAULT_BUCKET_BYTES, Step, train_step
from zerofn.transforms.amp import amp
from zerofn.transforms.offload import DEFAULT_SUB_GROUP_BYTES, offload
from zerofn.transforms.remat import remat
from zerofn.transforms.shard_grads import shard_grads
from zerofn.transforms.shard_optimizer import shard_optimizer
from zerofn.transforms.shard_params import shard_params

__all__ = ["DeepSpeedConfig", "batch_sizes", "from_deepspeed", "micro_batch_size"]

AUTO = "auto"
OPTIMIZERS = ("Adam", "AdamW", "SGD")
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad")
SGD_PARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
_WARMUP = ("warmup_num_steps", "warmup_type", "last_batch_iteration")
SCHEDULERS = {  # each scheduler's parameters
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", *_WARMUP),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", *_WARMUP),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "cos_min_ratio", *_WARMUP),
}

# What to write instead of "auto", per key (the Hugging Face Trainer's source of each value).
AUTO_HINTS = {
    "train_batch_size": "the global batch per update, over all ranks",
    "train_micro_batch_size_per_gpu": "the batch each rank feeds per call (the Trainer's per_device_train_batch_size)",
    "gradient_accumulation_steps": "the micro-batches per update (the Trainer's gradient_accumulation_steps)",
    "gradient_clipping": "the largest gradient norm, e.g. 1.0 (the Trainer's max_grad_norm), or 0 for none",
    "lr": "the learning rate, e.g. 3e-4",
    "betas": "[beta1, beta2], e.g. [0.9, 0.999]",
    "eps": "e.g. 1e-8",
    "weight_decay": "e.g. 0.01, or 0",
    "warmup_min_lr": "the learning rate at the start, e.g. 0",
    "warmup_max_lr": "the peak learning rate, e.g. 3e-4",
    "warmup_num_steps": "the updates of the warmup, e.g. 100",
    "total_num_steps": "the number of updates of the whole run",
    "enabled": "true or false",
    "stage": "0, 1, 2 or 3",
}

# Top-level keys with no equivalent whose absence changes no number: warned, with what zerofn does.
TOP_IGNORED = {
    "steps_per_print": "zerofn prints nothing itself: each step returns its metrics (loss, grad_norm, loss_scale, ...)",
    "wall_clock_breakdown": "no timers: time the steps yourself",
    "dump_state": "print(state) shows what the state holds, where, and its bytes",
    "memory_breakdown": "zf.memory.state_bytes(state) and zf.memory.track() measure memory",
    "zero_allow_untested_optimizer": "every zf.optim optimizer runs under every stage",
    "zero_force_ds_cpu_optimizer": "offload runs the zf.optim optimizer on the host",
    "flops_profiler": "no profiler: use torch.profiler",
    "tensorboard": "no monitors: log the metrics yourself",
    "wandb": "no monitors: log the metrics yourself",
    "csv_monitor": "no monitors: log the metrics yourself",
    "comet": "no monitors: log the metrics yourself",
    "comms_logger": "metrics['comm_bytes'] counts each step's collective traffic",
    "checkpoint": "zf.checkpoint.save and load take their options as arguments",
    "nebula": "zf.checkpoint.save(..., blocking=False) writes in the background",
    "aio": "NVMe offload streams with its own reader and writer threads",
    "autotuning": "no autotuner",
    "dataloader_drop_last": "zerofn builds no data loader: drop the last partial batch yourself",
    "sparse_gradients": "gradients are dense",
    "prescale_gradients": "gradients are averaged once, after the reduction (the same average up to rounding)",
    "gradient_predivide_factor": "gradients are averaged once, after the reduction (the same average up to rounding)",
    "disable_allgather": "stages 1-3 always all-gather the updated shards",
    "pipeline": "no pipeline parallelism",
    "eigenvalue": "no eigenvalue computation",
    "sparse_attention": "no sparse-attention kernels: the model computes its own attention",
    "compression_training": "no compression library",
    "hybrid_engine": "no inference engine: step.apply(state, ...) runs the model",
    "timers": "no timers",
    "data_types": "gradients accumulate in the dtype they are reduced in (communication_data_type)",
    "seq_parallel_communication_data_type": "no sequence parallelism",
    "tensor_parallel": "no tensor parallelism",
    "weight_quantization": "no quantization",
    "communication_data_type": "gradients of fp32 parameters are reduced in fp32 (another dtype needs bf16 or fp16)",
}

TOP_QUIET = {"gradient_predivide_factor": 1.0}  # DeepSpeed's defaults that ask for nothing

# Top-level blocks that would change the numbers when enabled: errors, with what to write instead.
TOP_ERRORS = {
    "amp": 'apex AMP has no equivalent; zerofn\'s mixed precision is "bf16": {"enabled": true} or '
    '"fp16": {"enabled": true}: write one of those instead',
    "torch_autocast": 'write "bf16": {"enabled": true} (or "fp16") for zerofn\'s amp: autocast, fp32 master weights',
    "elasticity": "it changes the batch sizes with the world size; zerofn takes them as written (and its checkpoints "
    "load on any world size): remove it and write train_batch_size / train_micro_batch_size_per_gpu",
    "curriculum_learning": "it changes the data each step sees; zerofn has no data pipeline: remove it "
    '(or set "enabled": false) and feed the batches you want',
    "data_efficiency": "it changes the data each step sees; zerofn has no data pipeline: remove it "
    '(or set "enabled": false) and feed the batches you want',
    "progressive_layer_drop": "it skips layers while training; zerofn has no equivalent: remove it "
    '(or set "enabled": false)',
    "quantize_training": "it quantizes the weights while training; zerofn has no equivalent: remove it "
    '(or set "enabled": false)',
}

# zero_optimization keys zerofn's shard transforms do anyway: silent with these values, warned otherwise.
ZERO_ANYWAY = {
    "overlap_comm": (True, "reductions always overlap backward"),
    "contiguous_gradients": (True, "gradients always go into contiguous buckets"),
    "reduce_scatter": (True, "stages 1-3 always reduce-scatter"),
    "allgather_partitions": (True, "stages 1-2 always all-gather the updated shards"),
    "ignore_unused_parameters": (True, "a parameter without a gradient gets zeros"),
    "load_from_fp32_weights": (True, "checkpoints restore the fp32 master weights"),
    "round_robin_gradients": (False, "no round-robin gradient copies"),
    "elastic_checkpoint": (True, "checkpoints load on any composition and world size"),
    "grad_hooks": (True, "gradients are reduced from hooks during backward"),
}

# zero_optimization keys with no equivalent (memory and traffic only): warned.
ZERO_IGNORED = {
    "allgather_bucket_size": "updated shards are all-gathered per bucket of reduce_bucket_size",
    "stage3_max_live_parameters": "ZeRO-3 gathers one unit (a block) at a time plus the prefetched ones",
    "stage3_max_reuse_distance": "ZeRO-3 releases a unit after its forward and gathers it again for backward",
    "stage3_param_persistence_threshold": "ZeRO-3 shards every parameter; small ones travel with their module's unit "
    "(to gather coarser units, build the step by hand with shard_params(units=MinUnitBytes(n)))",
    "stage3_model_persistence_threshold": "ZeRO-3 shards every parameter",
    "stage3_gather_16bit_weights_on_model_save": "step.state_dict(state) and python -m zerofn consolidate gather "
    "on demand",
    "stage3_module_granularity_threshold": "ZeRO-3 units are the model's blocks (shard_params(units=...) by hand)",
    "stage3_use_all_reduce_for_fetch_params": "ZeRO-3 fetches with all-gathers",
    "memory_efficient_linear": "linear layers are the model's own",
    "zero_hpz_partition_size": "no hierarchical partitioning",
    "mics_shard_size": "no MiCS sub-groups: state is sharded over all ranks",
    "mics_hierarchical_params_gather": "no MiCS sub-groups",
    "use_multi_rank_bucket_allreduce": "one collective per bucket",
    "legacy_stage1": "one stage-1 implementation",
    "pipeline_loading_checkpoint": "no pipeline parallelism",
    "override_module_apply": "no module patching",
    "log_trace_cache_warnings": "no trace cache",
    "zeropp_loco_param": "no quantized communication",
}
ZERO_QUIET = {"zero_hpz_partition_size": (1,), "mics_shard_size": (-1, 0)}  # values that ask for nothing
ZERO_ALIASES = {  # DeepSpeed's names without the stage3_ prefix
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
}
ZERO_ERRORS = {  # true would change the numbers
    "zero_quantized_weights": "quantized weight communication changes the numbers; zerofn gathers full-precision "
    "shards: remove it",
    "zero_quantized_nontrainable_weights": "quantized weight communication changes the numbers: remove it",
    "zero_quantized_gradients": "quantized gradient communication changes the numbers; zerofn reduces in the "
    "gradient dtype (bf16/fp16 under amp): remove it",
}


@dataclass(frozen=True)
class DeepSpeedConfig:
    """What a config resolved, held by a ``from_deepspeed`` step's ``deepspeed`` extension.

    Attributes:
        train_batch_size: samples per update over all ranks.
        micro_batch_size: samples each rank feeds per call
            (``train_micro_batch_size_per_gpu``).
        gradient_accumulation_steps: calls per update (the step's ``accumulate_steps``).
        world_size: the ranks the batch sizes were resolved for.
        ignored: the keys listed in the construction warning (no equivalent in zerofn).
    """

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    ignored: tuple[str, ...] = ()


def micro_batch_size(step: Step) -> int:
    """The samples each rank feeds per call of a ``from_deepspeed`` step (``train_micro_batch_size_per_gpu``).

    ``step.extension("deepspeed").options`` is the whole :class:`DeepSpeedConfig`.
    """
    ext = step.extension("deepspeed") if isinstance(step, Step) else None
    if ext is None or not isinstance(ext.options, DeepSpeedConfig):
        raise ValueError(
            f"micro_batch_size: {getattr(step, 'name', type(step).__name__)} was not built by from_deepspeed; "
            "the batch a rank feeds is whatever your loop passes it"
        )
    return ext.options.micro_batch_size


# ---------------------------------------------------------------- reading the config


class _Block:
    """One dict of the config, read key by key; what is never read is left over for the warning."""

    def __init__(self, path: str, data: Any):
        if not isinstance(data, dict):
            raise ValueError(f"from_deepspeed: {path} must be a JSON object (a dict), got {data!r}")
        self.path, self.data, self.used = path, data, set()

    def key(self, k: str) -> str:
        return f"{self.path}.{k}" if self.path else k

    def __contains__(self, k: str) -> bool:
        return k in self.data

    def raw(self, k: str, default: Any = None) -> Any:
        self.used.add(k)
        return self.data.get(k, default)

    def get(self, k: str, default: Any, kind: str, *, auto: Any = None, low: float | None = None) -> Any:
        """The value of ``k`` (``default`` when absent) as ``kind``; "auto" raises unless ``auto`` resolves it."""
        self.used.add(k)
        if k not in self.data:
            return default
        v = self.data[k]
        if v == AUTO:
            if auto is not None:
                return auto
            raise _auto_error(self.key(k))
        return _as(self.key(k), v, kind, low)

    def block(self, k: str) -> "_Block | None":
        self.used.add(k)
        v = self.data.get(k)
        return None if v is None else _Block(self.key(k), v)

    def leftover(self) -> list[str]:
        return [k for k in self.data if k not in self.used]


def _auto_error(key: str) -> ValueError:
    hint = AUTO_HINTS.get(key.rsplit(".", 1)[-1], "the value itself")
    return ValueError(
        f'from_deepspeed: {key} is "auto", which the Hugging Face Trainer fills in from its own arguments; '
        f"zerofn has no Trainer to resolve it: write {hint}"
    )


def _as(key: str, v: Any, kind: str, low: float | None = None) -> Any:
    """``v`` as ``kind`` ("bool", "int" (an element count: 5e8 is fine), "float", "str", "pair")."""
    if kind == "bool":
        if isinstance(v, bool):
            return v
        raise ValueError(f"from_deepspeed: {key} must be true or false, got {v!r}")
    if kind == "str":
        if isinstance(v, str):
            return v
        raise ValueError(f"from_deepspeed: {key} must be a string, got {v!r}")
    if kind == "pair":
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(_real(x) for x in v):
            return (float(v[0]), float(v[1]))
        raise ValueError(f"from_deepspeed: {key} must be a list of two numbers such as [0.9, 0.999], got {v!r}")
    if not _real(v) or not math.isfinite(v):
        raise ValueError(f"from_deepspeed: {key} must be a number, got {v!r}")
    if kind == "int":
        if float(v) != int(v):
            raise ValueError(f"from_deepspeed: {key} must be a whole number, got {v!r}")
        v = int(v)
    else:
        v = float(v)
    if low is not None and v < low:
        raise ValueError(f"from_deepspeed: {key} must be >= {low:g}, got {v!r}")
    return v


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _load(config: Any) -> dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"from_deepspeed: no config file {path!r}; pass a DeepSpeed JSON file or a dict")

        def no_duplicates(pairs):
            seen = {}
            for k, v in pairs:
                if k in seen:
                    raise ValueError(f"from_deepspeed: {path}: key {k!r} appears twice (DeepSpeed refuses it too)")
                seen[k] = v
            return seen

        with open(path) as f:
            try:
                return json.load(f, object_pairs_hook=no_duplicates)
            except json.JSONDecodeError as e:
                raise ValueError(f"from_deepspeed: {path} is not valid JSON: {e}") from None
    raise TypeError(
        f"from_deepspeed: config must be a dict or the path of a DeepSpeed JSON file, got {type(config).__name__}"
    )


def _asks_nothing(v: Any) -> bool:
    """A key set to false (or null), or a block with "enabled": false."""
    return v is False or v is None or (isinstance(v, dict) and v.get("enabled") is False)


# ---------------------------------------------------------------- batch sizes


def batch_sizes(config: Any, world_size: int | None = None) -> tuple[int, int, int]:
    """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)`` as DeepSpeed resolves them.

    DeepSpeed's rule: ``train_batch_size == micro x accumulation x world_size``;
    given two of the three, the third is derived; given only the micro batch,
    accumulation is 1; given only the train batch, accumulation is 1 and the
    micro batch is ``train_batch_size / world_size``. A value ``"auto"`` is
    resolved when the other two are numbers.

    Args:
        config: a DeepSpeed config (dict or JSON path).
        world_size: the number of ranks; default ``zerofn.collectives.world_size()``.

    Raises:
        ValueError: the three do not agree (the message names all four
            numbers), too few are given, or an "auto" cannot be resolved.

    Example:
        >>> from zerofn.transforms.deepspeed import batch_sizes
        >>> batch_sizes({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, world_size=2)
        (32, 8, 2)
    """
    world = C.world_size() if world_size is None else world_size
    return _batch_sizes(_Block("", _load(config)), world)


def _batch_sizes(r: _Block, world: int) -> tuple[int, int, int]:
    names = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    raw = {k: r.raw(k) for k in names}
    autos = [k for k in names if raw[k] == AUTO]
    vals = {k: None if raw[k] is None or raw[k] == AUTO else _as(k, raw[k], "int", 1) for k in names}
    if autos and sum(v is not None for v in vals.values()) < 2:
        raise _auto_error(autos[0])
    train, micro, accum = (vals[k] for k in names)

    def derive(given: str, by: int) -> int:
        if train % by:
            a, b = ((names[1], micro), (names[2], accum))[given == names[2]]
            missing = names[2] if given == names[1] else names[1]
            raise ValueError(
                f"from_deepspeed: train_batch_size {train} must equal train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps x world size, but it is not a multiple of {a} {b} x world size "
                f"{world} (= {by}): no whole {missing} gives it. Change one of the numbers"
            )
        return train // by

    if train is not None and micro is not None and accum is None:
        accum = derive(names[1], micro * world)
    elif train is not None and accum is not None and micro is None:
        micro = derive(names[2], accum * world)
    elif micro is not None and accum is not None and train is None:
        train = micro * accum * world
    elif train is not None and micro is None and accum is None:
        accum = 1
        micro = derive(names[2], world)
    elif micro is not None and train is None and accum is None:
        accum, train = 1, micro * world
    elif train is None or micro is None or accum is None:
        raise ValueError(
            "from_deepspeed: give train_batch_size or train_micro_batch_size_per_gpu (or both, with "
            "gradient_accumulation_steps): DeepSpeed derives the third from two of them"
        )
    if micro < 1 or accum < 1 or train != micro * accum * world:
        raise ValueError(
            f"from_deepspeed: train_batch_size {train} must equal train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {accum} x world size {world} (= {micro * accum * world}), as in DeepSpeed. "
            "Give two of the three and the third is derived."
        )
    return train, micro, accum


# ---------------------------------------------------------------- optimizer and scheduler


def _optimizer(r: _Block, given: Any, ignored: dict) -> tuple[str, dict]:
    """The optimizer the config asks for: (kind, keyword arguments), lr maybe a schedule later."""
    blk = r.block("optimizer")
    if blk is None:
        if given is None:
            raise ValueError(
                'from_deepspeed: the config has no "optimizer": add one, e.g. "optimizer": {"type": "AdamW", '
                '"params": {"lr": 3e-4, "weight_decay": 0.01}}, or pass optimizer=zf.optim.adamw(...)'
            )
        return "given", {}
    if given is not None:
        raise ValueError(
            'from_deepspeed: the config has an "optimizer" and optimizer= was passed too (DeepSpeed refuses both): '
            "remove one"
        )
    kind = blk.get("type", None, "str")
    if kind is None:
        raise ValueError('from_deepspeed: optimizer needs a "type": one of ' + ", ".join(OPTIMIZERS))
    name = kind.lower()
    if name not in ("adam", "adamw", "sgd"):
        raise ValueError(
            f"from_deepspeed: optimizer.type {kind!r} is not supported; zerofn maps {', '.join(OPTIMIZERS)}. "
            "For another optimizer, build it with zf.optim and pass optimizer= (with no \"optimizer\" in the config)"
        )
    p = blk.block("params") or _Block("optimizer.params", {})
    for k in blk.leftover():
        ignored[blk.key(k)] = "DeepSpeed reads only type and params here (an optimizer argument goes under params)"
    if "max_grad_norm" in p:
        raise ValueError(
            'from_deepspeed: optimizer.params.max_grad_norm is not an optimizer parameter (DeepSpeed refuses it too): '
            'write "gradient_clipping": 1.0 at the top level instead'
        )
    for k in ("maximize", "amsgrad"):
        if p.get(k, False, "bool"):
            raise ValueError(f"from_deepspeed: optimizer.params.{k} true has no equivalent in zf.optim: remove it")
    for k in ("fused", "foreach", "capturable", "differentiable", "set_grad_none"):
        if k in p:
            p.raw(k)
            ignored[p.key(k)] = "zf.optim picks its own kernels (multi-tensor and fused)"
    lr = p.get("lr", 1e-3, "float", low=0.0)
    if name in ("adam", "adamw"):
        torch_adam = p.get("torch_adam", False, "bool")
        w_mode = p.get("adam_w_mode", True, "bool")
        # DeepSpeed: "AdamW" is always decoupled; "Adam" is too unless adam_w_mode is false.
        decoupled = name == "adamw" or w_mode
        # FusedAdam / DeepSpeedCPUAdam default to no decay; torch.optim.AdamW (torch_adam) to 0.01.
        wd = p.get("weight_decay", 0.01 if torch_adam and decoupled else 0.0, "float", low=0.0)
        if not p.get("bias_correction", True, "bool"):
            raise ValueError(
                "from_deepspeed: optimizer.params.bias_correction false has no equivalent: zf.optim's Adam always "
                "corrects its moments' bias; remove it"
            )
        args = {"lr": lr, "betas": p.get("betas", (0.9, 0.999), "pair"), "eps": p.get("eps", 1e-8, "float", low=0.0),
                "weight_decay": wd}  # fmt: skip
        kind = "adamw" if decoupled else "adam"
    else:
        if p.get("dampening", 0.0, "float") != 0.0:
            raise ValueError("from_deepspeed: optimizer.params.dampening has no equivalent in zf.optim.sgd: remove it")
        args = {"lr": lr, "momentum": p.get("momentum", 0.0, "float", low=0.0),
                "nesterov": p.get("nesterov", False, "bool"),
                "weight_decay": p.get("weight_decay", 0.0, "float", low=0.0)}  # fmt: skip
        kind = "sgd"
    unknown = p.leftover()
    if unknown:
        known = ADAM_PARAMS if name in ("adam", "adamw") else SGD_PARAMS
        raise ValueError(
            f"from_deepspeed: {p.key(unknown[0])}: not a parameter of DeepSpeed's {_kind_name(name)} that zerofn "
            f"maps (ignoring it could change the update): remove it. Mapped: {', '.join(known)}"
        )
    return kind, args


def _kind_name(name: str) -> str:
    return {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}[name]


def _schedule(r: _Block, lr: float | None) -> Callable | None:
    """The scheduler block as a zerofn schedule (the update count -> DeepSpeed's lr for that update)."""
    blk = r.block("scheduler")
    if blk is None:
        return None
    if lr is None:
        raise ValueError(
            'from_deepspeed: a "scheduler" needs the config\'s "optimizer" (it sets that optimizer\'s lr); with '
            "optimizer= pass a zf.optim schedule as its lr instead, e.g. zf.optim.deepspeed_warmup_lr(...)"
        )
    kind = blk.get("type", None, "str")
    if kind not in SCHEDULERS:
        raise ValueError(
            f"from_deepspeed: scheduler.type {kind!r} is not supported; zerofn maps {', '.join(SCHEDULERS)}. "
            "For another schedule, pass a zf.optim schedule as the optimizer's lr (optimizer=...)"
        )
    p = blk.block("params") or _Block("scheduler.params", {})
    if blk.leftover():
        raise ValueError(f"from_deepspeed: {blk.key(blk.leftover()[0])}: a scheduler has only type and params")
    if p.get("last_batch_iteration", -1, "int") != -1:
        raise ValueError(
            "from_deepspeed: scheduler.params.last_batch_iteration: zerofn's schedules follow the update count, "
            "which a checkpoint restores (zf.checkpoint.load); remove it"
        )
    warmup = {"warmup_num_steps": p.get("warmup_num_steps", 1000, "int", low=0),
              "warmup_type": p.get("warmup_type", "log", "str")}  # fmt: skip
    try:
        out = _build_schedule(kind, p, lr, warmup)
    except (TypeError, ValueError) as e:  # the schedule's own checks, in terms of the config
        if str(e).startswith("from_deepspeed"):
            raise
        raise ValueError(f"from_deepspeed: scheduler {kind}: {e}") from None
    unknown = p.leftover()
    if unknown:
        raise ValueError(
            f"from_deepspeed: {p.key(unknown[0])}: not a parameter of DeepSpeed's {kind} (ignoring it could change "
            f"the schedule): remove it. Mapped: {', '.join(SCHEDULERS[kind])}"
        )
    return out


def _build_schedule(kind: str, p: _Block, lr: float, warmup: dict) -> Callable:
    if kind == "WarmupLR":
        out = O.deepspeed_warmup_lr(
            p.get("warmup_max_lr", lr, "float", low=0.0), p.get("warmup_min_lr", 0.0, "float", low=0.0), **warmup
        )
    elif kind == "WarmupDecayLR":
        if "total_num_steps" not in p:
            raise ValueError("from_deepspeed: scheduler WarmupDecayLR needs params.total_num_steps (updates of the run)")
        out = O.deepspeed_warmup_decay_lr(
            p.get("total_num_steps", None, "int", low=0), p.get("warmup_min_lr", 0.0, "float", low=0.0),
            p.get("warmup_max_lr", 0.001, "float", low=0.0), **warmup,
        )  # fmt: skip
    else:
        if "total_num_steps" not in p:
            raise ValueError("from_deepspeed: scheduler WarmupCosineLR needs params.total_num_steps (updates of the run)")
        out = O.deepspeed_warmup_cosine_lr(
            lr, p.get("total_num_steps", None, "int", low=0), p.get("warmup_min_ratio", 0.0, "float"),
            cos_min_ratio=p.get("cos_min_ratio", 0.0001, "float"), **warmup,
        )  # fmt: skip
    return out


# ---------------------------------------------------------------- precision


def _precision(r: _Block, ignored: dict) -> tuple[torch.dtype, dict] | None:
    """``(dtype, amp keyword arguments)`` for fp16 / bf16, or None."""
    fp16 = r.block("fp16")
    bf16 = r.block("bf16")
    if bf16 is None:
        bf16 = r.block("bfloat16")  # DeepSpeed's older name
    on16 = fp16 is not None and fp16.get("enabled", False, "bool")
    onbf = bf16 is not None and bf16.get("enabled", False, "bool")
    if on16 and onbf:
        raise ValueError(
            "from_deepspeed: fp16.enabled and bf16.enabled are both true (DeepSpeed refuses it too): enable one"
        )
    out = None
    if on16:
        if fp16.get("consecutive_hysteresis", False, "bool"):
            raise ValueError(
                "from_deepspeed: fp16.consecutive_hysteresis true: zerofn's loss scale follows DeepSpeed's default "
                "(hysteresis refilled when the scale grows, not after every good step); remove it or set it false"
            )
        if fp16.get("fp16_master_weights_and_grads", False, "bool"):
            raise ValueError(
                "from_deepspeed: fp16.fp16_master_weights_and_grads true: zerofn's amp keeps fp32 master weights; "
                "remove it or set it false"
            )
        fp16.raw("auto_cast")  # zerofn's amp runs the forward under torch.autocast either way
        scale = fp16.get("loss_scale", 0.0, "float", low=0.0)
        if scale == 0:
            kw = {
                "loss_scale": "dynamic",
                "init_scale": 2.0 ** fp16.get("initial_scale_power", 16, "int", low=0),
                "growth_interval": fp16.get("loss_scale_window", 1000, "int", low=1),
                "hysteresis": fp16.get("hysteresis", 2, "int", low=1),
                "min_scale": fp16.get("min_loss_scale", 1.0, "float"),
            }
        else:
            kw = {"loss_scale": scale}
            for k in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
                fp16.raw(k)  # they tune the dynamic scale only
        out = (torch.float16, kw)
    elif onbf:
        for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            if bf16.get(k, False, "bool"):
                raise ValueError(f"from_deepspeed: {bf16.key(k)} true: zerofn's amp keeps fp32 master weights and "
                                 "optimizer state; remove it or set it false")  # fmt: skip
        out = (torch.bfloat16, {})
    for blk, on in ((fp16, on16), (bf16, onbf)):
        if blk is not None and on:
            for k in blk.leftover():
                ignored[blk.key(k)] = "no equivalent in zerofn's amp"
    # The dtype gradients travel in: communication_data_type, else fp32_allreduce.
    comm = r.raw("communication_data_type")
    fp32_reduce = r.raw("fp32_allreduce", False)
    if comm is not None and comm not in ("fp32", "fp16", "bf16"):
        raise ValueError(f'from_deepspeed: communication_data_type must be "fp32", "fp16" or "bf16", got {comm!r}')
    if out is None:
        if comm in ("fp16", "bf16"):
            ignored["communication_data_type"] = TOP_IGNORED["communication_data_type"]
        return None
    dtype, kw = out
    want = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(comm)
    if want is None and fp32_reduce is True:
        want = torch.float32
    if want is not None and want != dtype:
        kw["reduce_dtype"] = want
    return out


# ---------------------------------------------------------------- ZeRO


@dataclass
class _Zero:
    stage: int = 0
    bucket_elems: int | None = None
    prefetch: int = 1
    sub_group_elems: int | None = None
    offload_device: str | None = None  # "cpu" | "nvme"
    nvme_path: str | None = None
    offload_params: bool = False
    pin_memory: bool = False


def _zero(r: _Block, ignored: dict) -> _Zero:
    z = _Zero()
    raw = r.raw("zero_optimization")
    if raw is None:
        return z
    if isinstance(raw, bool):  # DeepSpeed's older form: true is stage 1
        z.stage = int(raw)
        return z
    raw = _Block("zero_optimization", raw).data  # (checks it is a dict)
    blk = _Block("zero_optimization", {ZERO_ALIASES.get(k, k): v for k, v in raw.items()})
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
    # Offload: the optimizer state (cpu | nvme), and with stage 3 the parameter shards (cpu).
    opt = blk.block("offload_optimizer")
    par = blk.block("offload_param")
    legacy_pin = blk.get("cpu_offload_use_pin_memory", None, "bool")
    if opt is None and blk.get("cpu_offload", False, "bool"):  # deprecated spelling of offload_optimizer cpu
        opt = _Block("zero_optimization.offload_optimizer", {"device": "cpu"})
    if par is None and blk.get("cpu_offload_param", False, "bool"):
        par = _Block("zero_optimization.offload_param", {"device": "cpu"})
    pins = []
    if opt is not None:
        device = opt.get("device", "cpu", "str")
        if device not in ("cpu", "nvme", "none"):
            raise ValueError(f'from_deepspeed: {opt.key("device")} must be "cpu", "nvme" or "none", got {device!r}')
        if device != "none":
            z.offload_device = device
            pins.append(opt.get("pin_memory", None, "bool"))
            if device == "nvme":
                path = opt.raw("nvme_path")
                if isinstance(path, os.PathLike):
                    z.nvme_path = os.fspath(path)
                elif path is not None:
                    z.nvme_path = _as(opt.key("nvme_path"), path, "str")
                if not z.nvme_path:
                    raise ValueError(
                        f'from_deepspeed: {opt.key("device")} "nvme" needs "nvme_path": a directory on the NVMe disk'
                    )
            ratio = opt.get("ratio", 1.0, "float")
            if ratio != 1.0:
                ignored[opt.key("ratio")] = "offload moves the whole optimizer state"
            for k in opt.leftover():
                ignored[opt.key(k)] = "tunes DeepSpeed's own NVMe buffers (zerofn streams sub-groups of sub_group_size)"
    if par is not None:
        device = par.get("device", "cpu", "str")
        if device not in ("cpu", "nvme", "none"):
            raise ValueError(f'from_deepspeed: {par.key("device")} must be "cpu", "nvme" or "none", got {device!r}')
        if device == "nvme":
            raise ValueError(
                f'from_deepspeed: {par.key("device")} "nvme": zerofn keeps parameter shards in CPU RAM, not on NVMe; '
                'write "device": "cpu" (the optimizer state can still go to NVMe only without offload_param)'
            )
        if device == "cpu":
            if z.stage != 3:
                raise ValueError(
                    f"from_deepspeed: zero_optimization.offload_param needs stage 3, got stage {z.stage} "
                    '(DeepSpeed refuses it too): set "stage": 3 or remove offload_param'
                )
            if z.offload_device == "nvme":
                raise ValueError(
                    'from_deepspeed: zero_optimization.offload_param "cpu" with offload_optimizer "nvme": zerofn '
                    'updates host-resident shards on the host, so both must be "cpu"; write offload_optimizer '
                    '"device": "cpu" or remove offload_param'
                )
            z.offload_params, z.offload_device = True, "cpu"
            pins.append(par.get("pin_memory", None, "bool"))
            for k in par.leftover():
                ignored[par.key(k)] = "tunes DeepSpeed's NVMe parameter buffers"
    pins.append(legacy_pin)
    z.pin_memory = next((p for p in pins if p is not None), False)  # DeepSpeed's default: not pinned
    if z.sub_group_elems is not None and z.offload_device != "nvme":
        ignored[blk.key("sub_group_size")] = "sub-groups stream NVMe-offloaded state only"
    for k, msg in ZERO_ERRORS.items():
        if blk.get(k, False, "bool"):
            raise ValueError(f"from_deepspeed: {blk.key(k)} true: {msg}")
    for k in blk.leftover():
        v = blk.raw(k)
        if k in ZERO_ANYWAY:
            value, why = ZERO_ANYWAY[k]
            if v != value:
                ignored[blk.key(k)] = f"zerofn's behaviour is fixed: {why}"
        elif k in ZERO_IGNORED:
            if v is not False and v is not None and v not in ZERO_QUIET.get(k, ()):
                ignored[blk.key(k)] = ZERO_IGNORED[k]
        else:
            ignored[blk.key(k)] = "unknown key"
    return z


def _remat(r: _Block, ignored: dict) -> bool:
    blk = r.block("activation_checkpointing")
    if blk is None:
        return False
    flags = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
             "synchronize_checkpoint_boundary")  # fmt: skip
    on = any([blk.get(k, False, "bool") for k in flags]) or blk.raw("number_checkpoints") is not None
    profile = blk.get("profile", False, "bool")
    if on:
        if blk.data.get("cpu_checkpointing") is True:
            ignored[blk.key("cpu_checkpointing")] = "checkpointed inputs stay where the model runs"
        if blk.data.get("number_checkpoints") is not None:
            ignored[blk.key("number_checkpoints")] = "remat checkpoints each of the model's natural blocks"
        if profile:
            ignored[blk.key("profile")] = "no profiler"
    for k in blk.leftover():
        ignored[blk.key(k)] = "unknown key"
    return on


# ---------------------------------------------------------------- the step


def from_deepspeed(config: Any, loss_fn: Callable, *, optimizer: O.GradientTransformation | None = None) -> Step:
    """The Step a DeepSpeed config asks for, composed from zerofn's transforms (see the module docs).

    Args:
        config: a DeepSpeed config: a dict, or the path of a JSON file.
        loss_fn: ``loss_fn(params, batch)``, as for ``zf.train_step``.
        optimizer: a ``zf.optim`` optimizer, when the config has no
            ``"optimizer"`` (as ``deepspeed.initialize(optimizer=...)``).

    Returns:
        The Step; ``step.accumulate_steps`` is ``gradient_accumulation_steps``
        and :func:`micro_batch_size` gives the batch each rank feeds per call
        (``step.extension("deepspeed").options`` holds every resolved size).
        Keys with no equivalent are listed in one ``UserWarning``.

    Raises:
        ValueError: batch sizes that disagree, an unsupported optimizer or
            scheduler, an "auto" zerofn cannot resolve, or a key that would
            change the numbers if ignored (each message names the key and
            what to write instead).
        TypeError: ``config`` is neither a dict nor a path.
    """
    r = _Block("", _load(config))
    ignored: dict[str, str] = {}
    world = C.world_size()
    train, micro, accum = _batch_sizes(r, world)
    kind, opt_args = _optimizer(r, optimizer, ignored)
    schedule = _schedule(r, opt_args.get("lr") if kind != "given" else None)
    if schedule is not None:
        opt_args["lr"] = schedule
    clip = r.get("gradient_clipping", 0.0, "float", low=0.0)
    precision = _precision(r, ignored)
    zero = _zero(r, ignored)
    remat_on = _remat(r, ignored)
    for k in r.leftover():
        v = r.raw(k)
        if k in TOP_ERRORS:
            if isinstance(v, dict) and v.get("enabled", False) is True or v is True:
                raise ValueError(f"from_deepspeed: {k} is enabled: {TOP_ERRORS[k]}")
        elif _asks_nothing(v) or TOP_QUIET.get(k, object()) == v:
            continue
        else:
            ignored[k] = TOP_IGNORED.get(k, "unknown key")

    # Build: the optimizer, the step, then each transform the config asks for.
    opt = optimizer if kind == "given" else {"adam": O.adam, "adamw": O.adamw, "sgd": O.sgd}[kind](**opt_args)
    if clip > 0:
        opt = O.chain(O.clip_by_global_norm(clip), opt)
    elem = 2 if precision is not None else 4  # bytes of a held parameter element (fp16/bf16 under amp)
    bucket_bytes = zero.bucket_elems * elem if zero.bucket_elems is not None else DEFAULT_BUCKET_BYTES
    step = train_step(loss_fn, opt, accum, bucket_bytes=bucket_bytes)
    if zero.stage == 1:
        step = shard_optimizer(step)
    elif zero.stage == 2:
        step = shard_grads(step)
    elif zero.stage == 3:
        step = shard_params(step, prefetch=zero.prefetch)
    if precision is not None:
        step = amp(step, precision[0], **precision[1])
    if zero.offload_device == "nvme":
        sub = DEFAULT_SUB_GROUP_BYTES
        if zero.sub_group_elems is not None:
            sub = max(4096, zero.sub_group_elems * _state_bytes_per_element(step, precision))
        step = offload(step, "nvme", path=zero.nvme_path, sub_group_bytes=sub, pin_memory=zero.pin_memory)
    elif zero.offload_device == "cpu":
        step = offload(step, "cpu", params=zero.offload_params, pin_memory=zero.pin_memory)
    if remat_on:
        step = remat(step)
    if ignored:
        lines = "\n".join(f"  {k}: {why}" for k, why in ignored.items())
        warnings.warn(
            f"from_deepspeed: zerofn has no equivalent for these keys and ignores them (none changes the numbers):\n"
            f"{lines}",
            UserWarning,
            stacklevel=2,
        )
    options = DeepSpeedConfig(train, micro, accum, world, tuple(ignored))
    return step.extend(Extension("deepspeed", options))


def _state_bytes_per_element(step: Step, precision: Any) -> int:
    """Bytes of parameter-shaped optimizer state per parameter element (what NVMe offload streams):
    Adam's two moments, plus amp's fp32 master weights."""
    dtype = precision[0] if precision is not None else torch.float32
    state = step.precision.wrap_optimizer(step.optimizer).init({"x": torch.zeros(2, dtype=dtype)})
    big = [t for t in T.tree_leaves(state) if isinstance(t, torch.Tensor) and t.shape == (2,)]
    return sum(t.element_size() for t in big) or 4
