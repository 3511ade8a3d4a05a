"""``from_deepspeed``: read a whole config, then build the step its blocks ask for, transform by transform."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn.closure import find_functional
from zerofn.deepspeed._auto import (
    model_hidden_size,
    resolve_auto,
    trainer_optimizer,
    trainer_schedule,
    with_trainer_schedule,
)
from zerofn.deepspeed._batch import DeepSpeedConfig, resolve_batch_sizes
from zerofn.deepspeed._compression import read_compression
from zerofn.deepspeed._expert import MOE_TOP_LEVEL, read_expert_parallel
from zerofn.deepspeed._keys import TOP_ERRORS, TOP_IGNORED, TOP_QUIET
from zerofn.deepspeed._optimizer import read_optimizer
from zerofn.deepspeed._pipeline import check_pipeline, read_pipeline
from zerofn.deepspeed._precision import AmpSpec, read_precision
from zerofn.deepspeed._reader import Block, asks_nothing, load_config
from zerofn.deepspeed._tensor import read_tensor_parallel
from zerofn.deepspeed._zero import read_remat, read_zero
from zerofn.step import DEFAULT_BUCKET_BYTES, Step, train_step
from zerofn.transforms import (
    amp,
    context_parallel,
    offload,
    remat,
    shard_grads,
    shard_optimizer,
    shard_params,
    tensor_parallel,
)
from zerofn.transforms.offload import DEFAULT_SUB_GROUP_BYTES

__all__ = ["DeepSpeedRun", "from_deepspeed"]


class DeepSpeedRun(NamedTuple):
    """What ``from_deepspeed`` returns: ``step, batch = zf.from_deepspeed(config, loss_fn)``.

    Attributes:
        step: the Step the config asks for, the same (name included) as the
            composition written by hand; ``step.accumulate_steps`` is
            ``gradient_accumulation_steps``.
        batch: the batch settings the config resolved and the keys it ignored
            (:class:`DeepSpeedConfig`); a rank feeds ``batch.micro_batch_size``
            samples per call.
    """

    step: Step
    batch: DeepSpeedConfig


def from_deepspeed(
    config: Any,
    loss_fn: Callable,
    *,
    optimizer: O.GradientTransformation | None = None,
    group: Any = None,
    training_args: Any = None,
    hidden_size: int | None = None,
    pipeline_stages: int | None = None,
) -> DeepSpeedRun:
    """The Step a DeepSpeed config asks for, composed from zerofn's transforms, and its batch settings.

    See the package docs (``zerofn.deepspeed``) for the rules.

    Args:
        config: a DeepSpeed config: a dict, or the path of a JSON file.
        loss_fn: ``loss_fn(params, batch)``, as for ``zf.train_step``.
        optimizer: a ``zf.optim`` optimizer, when the config has no
            ``"optimizer"`` (as ``deepspeed.initialize(optimizer=...)``).
        group: the torch ``ProcessGroup`` the step runs on (``zf.train_step(..., group=)``;
            default: the current group, the world unless a ``zf.collectives.group_scope`` says otherwise);
            the batch sizes are resolved for its world size (under ``tensor_parallel.autotp_size`` N,
            for the ``world // N`` data-parallel ranks, as DeepSpeed does; ``group=`` is then refused, and
            beside ``expert_parallel.autoep_size`` too, which does not divide the data-parallel ranks: every
            rank of an expert-parallel group feeds its own micro-batch).
        training_args: a ``transformers.TrainingArguments``, or a dict of its fields
            (``per_device_train_batch_size``, ``learning_rate``, ``max_steps``, ...; its defaults
            for the absent ones): each ``"auto"`` takes the value the Hugging Face Trainer would put
            there, a written value that disagrees with its argument raises (as in the Trainer),
            with no ``"scheduler"`` in the config the Trainer's ``lr_scheduler_type`` scales
            the learning rate, and with no ``"optimizer"`` (nor ``optimizer=``) the optimizer is
            the Trainer's AdamW (its ``optim`` default; no decay on biases and norm weights), said
            in one line of the warning (docs/migrating/deepspeed.md, ``"auto"``, has the mapping key
            by key).
        hidden_size: the model's hidden size, for the ``"auto"`` of ``reduce_bucket_size``,
            ``stage3_prefetch_bucket_size`` and ``stage3_param_persistence_threshold`` (the Trainer's
            ``h*h``, ``int(0.9*h*h)``, ``10*h``); default with ``training_args``: the Hugging Face
            config of the model ``loss_fn`` calls (``config.hidden_size``, or the largest of
            ``config.hidden_sizes``).
        pipeline_stages: DeepSpeed's ``PipelineModule(layers, num_stages=N)``, which is code, not config (or
            the config's ``"pipeline": {"stages": N}``): ``pipeline_parallel(step, N,
            microbatches=gradient_accumulation_steps, schedule="1f1b")`` applied last, DeepSpeed's
            ``PipelineEngine`` (its 1F1B ``TrainSchedule``, ``gradient_accumulation_steps`` micro-batches per
            ``train_batch()``): the step updates on every call (``accumulate_steps`` 1), a rank feeding
            ``batch.samples_per_call`` samples, and the batch sizes count the ``world // (N x autotp_size)``
            data-parallel ranks; the config's ``pipeline.activation_checkpoint_interval`` > 0 adds ``remat``.
            The model must be one ``pipeline_parallel`` cuts (a Hugging Face decoder, or zerofn's example GPT).
            ZeRO stages 0 to 2 compose (DeepSpeed allows 0 and 1); stage 3 is refused.

    The config's ``"optimizer"`` applies to every parameter, as in DeepSpeed (``weight_decay``
    included). Parameter groups (torch's ``param_groups``: no decay for biases and norms, a learning
    rate per group) are not a config key: build the optimizer with ``zf.optim`` and pass it as
    ``optimizer=``, leaving ``"optimizer"`` (and ``"scheduler"``: give each group's ``lr`` a schedule)
    out of the config; ``gradient_clipping`` still applies, over every parameter::

        groups = zf.optim.multi_transform(
            {"decay": zf.optim.adamw(3e-4, weight_decay=0.1), "no_decay": zf.optim.adamw(3e-4, weight_decay=0.0)},
            lambda params: {n: "decay" if p.ndim >= 2 else "no_decay" for n, p in params.items()},
        )
        step, batch = zf.from_deepspeed(config, loss_fn, optimizer=groups)

    or, for one learning rate, ``optimizer=zf.optim.adamw(3e-4, weight_decay=0.1, mask=zf.optim.decay_mask())``.

    Returns:
        ``DeepSpeedRun(step, batch)``: the Step (``step.accumulate_steps`` is
        ``gradient_accumulation_steps``) and the :class:`DeepSpeedConfig`
        with every resolved size (``batch.micro_batch_size`` is the batch each
        rank feeds per call). Keys with no equivalent are listed in one
        ``UserWarning``.

    Raises:
        ValueError: an ``autotp_size`` that does not divide the world, an ``autoep_size`` that does not divide the
            data-parallel ranks, batch sizes that disagree, an unsupported optimizer or
            scheduler, an "auto" zerofn cannot resolve (the message names the
            key and the training_args field that fills it), a value that
            disagrees with training_args, or a key that would change the
            numbers if ignored (each message names the key and what to write
            instead).
        TypeError: ``config`` is neither a dict nor a path, or ``training_args``
            neither a TrainingArguments nor a dict.
    """
    ignored: dict[str, str] = {}
    world = C.world_size(group=group)
    raw = load_config(config)
    _refuse_features(raw)  # first: a feature zerofn lacks is the one thing to say about such a config
    # AutoTP: the batch sizes are DeepSpeed's over the data-parallel ranks, world // autotp_size
    tp = read_tensor_parallel(raw, world, group, ignored)
    world //= tp
    # PipelineModule's num_stages: stages of world // (tp x stages) data-parallel ranks each, which the batch sizes count
    pipe = read_pipeline(raw, world, group, ignored, pipeline_stages)
    world //= pipe.stages or 1
    # Ulysses (ALST): sequence_parallel_size ranks share each micro-batch; the batch sizes count the rest
    sp = read_sequence_parallel(raw, world)
    world //= sp
    # AutoEP: autoep_size of those ranks hold each block's experts, and each still feeds its own micro-batch: the
    # batch sizes count them all (DeepSpeed's data-parallel world includes them too)
    ep = read_expert_parallel(raw, world, group, ignored)
    if training_args is not None or hidden_size is not None:  # "auto" as the Hugging Face Trainer fills it
        hidden = hidden_size if hidden_size is not None else (lambda: _model_hidden_size(loss_fn))
        raw = resolve_auto(raw, training_args, world, hidden)
    r = Block("", raw)
    r.raw("tensor_parallel")  # read above
    r.raw("sequence_parallel_size")
    r.raw("pipeline")
    for k in ("expert_parallel", "moe", *MOE_TOP_LEVEL):
        r.raw(k)
    sizes = resolve_batch_sizes(r, world)
    trainer = None
    if training_args is not None:  # no "optimizer" (and no optimizer=): the Hugging Face Trainer's AdamW
        trainer = lambda: trainer_optimizer(raw, training_args, lambda: _model_of(loss_fn))  # noqa: E731
    spec = read_optimizer(r, optimizer, ignored, trainer)
    spec = with_trainer_schedule(spec, trainer_schedule(raw, training_args))
    precision = read_precision(r, ignored)
    zero = read_zero(r, ignored)
    check_pipeline(pipe, zero.stage, zero.replicate, sizes.gradient_accumulation_steps, sp)
    remat_options = read_remat(r, ignored)
    if remat_options is None and pipe.remat:  # pipeline.activation_checkpoint_interval
        remat_options = {}
    read_compression(r)
    for k in r.leftover():
        v = r.raw(k)
        if k in TOP_ERRORS:
            if isinstance(v, dict) and v.get("enabled", False) is True or v is True:
                raise ValueError(f"from_deepspeed: {k} is enabled: {TOP_ERRORS[k]}")
        elif asks_nothing(v) or TOP_QUIET.get(k, object()) == v:
            continue
        else:
            ignored[k] = TOP_IGNORED.get(k, "unknown key")

    # Build: the optimizer, the step, then each transform the config asks for.
    held = precision.dtype if precision is not None else torch.float32  # a held parameter element's dtype
    bucket_bytes = zero.bucket_elems * held.itemsize if zero.bucket_elems is not None else DEFAULT_BUCKET_BYTES
    # under a pipeline the micro-batches are the pipeline's, cut from each call's batch: every call updates
    accumulate = 1 if pipe.stages else sizes.gradient_accumulation_steps
    step = train_step(loss_fn, spec.build(), accumulate, bucket_bytes=bucket_bytes, group=group)
    replicate = _mics_replicas(zero.replicate, group)
    if zero.stage == 1:
        step = shard_optimizer(step, replicate=replicate)
    elif zero.stage == 2:
        step = shard_grads(step, replicate=replicate, reduce_dtype=zero.reduce_dtype)
    elif zero.stage == 3:
        step = shard_params(
            step,
            prefetch=zero.prefetch,
            replicate=replicate,
            hpz=zero.hpz,
            gather_dtype=zero.gather_dtype,
            reduce_dtype=zero.reduce_dtype,
        )
    if precision is not None:
        step = amp(step, precision.dtype, **precision.options)
    if zero.offload_device == "nvme":
        sub = DEFAULT_SUB_GROUP_BYTES
        if zero.sub_group_elems is not None:
            sub = max(4096, zero.sub_group_elems * _state_bytes_per_element(step, precision))
        params = zero.param_device or False  # "cpu", "nvme" (ZeRO-Infinity: the shards in files beside the state)
        step = offload(
            step, "nvme", path=zero.nvme_path, params=params, sub_group_bytes=sub, pin_memory=zero.pin_memory
        )
    elif zero.offload_device == "cpu":
        step = offload(step, "cpu", params=zero.param_device == "cpu", pin_memory=zero.pin_memory)
    if remat_options is not None:
        step = remat(step, **remat_options)
    if tp > 1:  # it runs the whole composition on its data-parallel group
        step = tensor_parallel(step, tp)
    if ep > 1:  # its axis joins the mesh outside tensor_parallel's and inside context_parallel's
        from zerofn.transforms import expert_parallel  # on first use: a config without it imports nothing more

        step = expert_parallel(step, ep)
    if sp > 1:  # its axis joins the mesh outside tensor_parallel's and expert_parallel's
        step = context_parallel(step, sp)
    if pipe.stages:  # last: pp is the mesh's outermost axis
        from zerofn.transforms import pipeline_parallel  # on first use: a config without it imports nothing more

        step = pipeline_parallel(step, pipe.stages, microbatches=sizes.gradient_accumulation_steps, schedule="1f1b")
    if ignored:
        lines = "\n".join(f"  {k}: {why}" for k, why in ignored.items())
        chosen = f"from_deepspeed: {spec.note}\n" if spec.note else ""
        warnings.warn(
            f"{chosen}from_deepspeed: zerofn has no equivalent for these keys and ignores them (none changes the "
            f"numbers):\n{lines}",
            UserWarning,
            stacklevel=2,
        )
    elif spec.note:
        warnings.warn(f"from_deepspeed: {spec.note}", UserWarning, stacklevel=2)
    batch = DeepSpeedConfig(
        sizes.train_batch_size,
        sizes.micro_batch_size,
        sizes.gradient_accumulation_steps,
        world,
        tuple(ignored),
        pipe.stages,
    )
    return DeepSpeedRun(step, batch)


def read_sequence_parallel(raw: dict, world: int) -> int:
    """``sequence_parallel_size`` (DeepSpeed's Ulysses, ALST): ``context_parallel(step, N)``; 1 asks for nothing.

    Raises:
        ValueError: not an int >= 1, or one that does not divide the data-parallel ranks left by tensor parallelism.
    """
    size = raw.get("sequence_parallel_size", 1)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"from_deepspeed: sequence_parallel_size must be an int >= 1, got {size!r}")
    if world % size:
        raise ValueError(
            f"from_deepspeed: sequence_parallel_size {size} does not divide the {world} ranks it would split "
            f"(the world over tensor_parallel.autotp_size): run on a multiple of {size} ranks per tensor-parallel "
            "slice, or pick a size that divides them"
        )
    return size


def _model_of(loss_fn: Callable) -> torch.nn.Module | None:
    """The model ``loss_fn`` calls (through its ``zf.functional`` apply); None when it calls none."""
    try:
        return find_functional(loss_fn).module
    except ValueError:  # loss_fn calls no zf.functional apply
        return None


def _model_hidden_size(loss_fn: Callable) -> int | None:
    """The hidden size of the Hugging Face model ``loss_fn`` calls (through its ``zf.functional`` apply)."""
    model = _model_of(loss_fn)
    return None if model is None else model_hidden_size(model)


def _refuse_features(raw: dict) -> None:
    """Raise for an enabled top-level block that changes what is trained (``TOP_ERRORS``) or an enabled
    compression technique, before the batch sizes, "auto" or any other key is read."""
    for k, why in TOP_ERRORS.items():
        v = raw.get(k)
        if isinstance(v, dict) and v.get("enabled", False) is True or v is True:
            raise ValueError(f"from_deepspeed: {k} is enabled: {why}")
    read_compression(Block("", raw))


def _state_bytes_per_element(step: Step, precision: AmpSpec | None) -> int:
    """Bytes of parameter-shaped optimizer state per parameter element (what NVMe offload streams):
    Adam's two moments, plus amp's fp32 master weights. Under groups with states of different sizes
    (Adam for some parameters, SGD for others), the largest, so that no sub-group of the largest has
    more than ``sub_group_size`` elements."""
    dtype = precision.dtype if precision is not None else torch.float32
    opt = step.precision.wrap_optimizer(step.optimizer)
    try:
        params = step.model().params
    except ValueError:  # loss_fn calls no zf.functional apply: one parameter stands for all
        return O.probe_state(opt, dtype).bytes_per_element or 4
    metas = T.tree_map(lambda p: torch.empty(p.shape, dtype=dtype, device="meta"), params)
    paths, leaves, _ = T.tree_flatten_with_path(O.bind(opt, O.ParamView.of_tree(metas)).init(metas))
    names, sizes = T.tree_flatten_with_path(metas)[:2]
    numel = {T.keystr(n): m.numel() for n, m in zip(names, sizes)}
    held: dict[str, int] = {}
    for path, leaf in zip(paths, leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "meta":
            name = next((c for c in reversed(path) if isinstance(c, str) and c in numel), None)
            if name is not None:
                held[name] = held.get(name, 0) + leaf.numel() * leaf.dtype.itemsize
    per = [math.ceil(b / numel[n]) for n, b in held.items() if numel[n]]
    return max(per) if per else (O.probe_state(opt, dtype).bytes_per_element or 4)


def _mics_replicas(shard_size: int | None, group) -> int | None:
    """The replicas of ``mics_shard_size`` ranks each over the step's ranks (None: shard over all)."""
    if shard_size is None:
        return None
    world = C.world_size(group)
    if world % shard_size:
        raise ValueError(
            f"from_deepspeed: zero_optimization.mics_shard_size {shard_size} does not divide the {world} ranks: "
            "each replica shards over that many ranks; give a divisor of the world size"
        )
    return world // shard_size
