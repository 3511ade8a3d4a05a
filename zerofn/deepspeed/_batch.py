"""The batch sizes a DeepSpeed config resolves, and the record ``from_deepspeed`` returns them in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from zerofn import collectives as C
from zerofn.deepspeed._keys import AUTO
from zerofn.deepspeed._reader import Block, auto_error, load_config, value_as

__all__ = ["BatchSizes", "DeepSpeedConfig", "batch_sizes", "resolve_batch_sizes"]

TRAIN, MICRO, ACCUM = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


class BatchSizes(NamedTuple):
    """The three batch sizes of a config, as DeepSpeed resolves them."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


@dataclass(frozen=True)
class DeepSpeedConfig:
    """What a config resolved beside its step: the batch settings and the ignored keys (``from_deepspeed(...).batch``).

    A rank feeds ``micro_batch_size`` samples per call, and every
    ``gradient_accumulation_steps``-th call updates: ``train_batch_size``
    samples over all ranks, as under DeepSpeed. Under a pipeline
    (``pipeline_stages``) each call updates, and a rank feeds
    ``micro_batch_size x gradient_accumulation_steps`` samples per call, which
    the step cuts into the pipeline's micro-batches (DeepSpeed's
    ``PipelineEngine.train_batch()``): ``samples_per_call`` says which.

    Attributes:
        train_batch_size: samples per update over all ranks.
        micro_batch_size: samples per micro-batch of a rank
            (``train_micro_batch_size_per_gpu``): per call, without a pipeline.
        gradient_accumulation_steps: micro-batches per update: calls (the step's ``accumulate_steps``), or
            under a pipeline its micro-batches (``pipeline_parallel``'s ``microbatches``).
        world_size: the data-parallel ranks the batch sizes were resolved for.
        ignored: the keys listed in the construction warning (no equivalent in zerofn).
        pipeline_stages: the pipeline's stages (None: no pipeline).
    """

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    world_size: int
    ignored: tuple[str, ...] = ()
    pipeline_stages: int | None = None

    @property
    def samples_per_call(self) -> int:
        """The samples a rank feeds per call of the step: ``micro_batch_size``, or under a pipeline the
        whole batch of its update, ``micro_batch_size x gradient_accumulation_steps``."""
        if self.pipeline_stages is None:
            return self.micro_batch_size
        return self.micro_batch_size * self.gradient_accumulation_steps


def batch_sizes(config: Any, world_size: int | None = None) -> BatchSizes:
    """``(train_batch_size, micro_batch_size, gradient_accumulation_steps)`` as DeepSpeed resolves them.

    DeepSpeed's rule: ``train_batch_size == micro x accumulation x world_size``;
    given two of the three, the third is derived; given only the micro batch
    (``train_micro_batch_size_per_gpu``), accumulation is 1; given only the
    train batch, accumulation is 1 and the micro batch is
    ``train_batch_size / world_size``. A value ``"auto"`` is resolved when the
    other two are numbers.

    Args:
        config: a DeepSpeed config (dict or JSON path).
        world_size: the number of ranks; default ``zerofn.collectives.world_size()``.

    Raises:
        ValueError: the three do not agree (the message names all four
            numbers), too few are given, or an "auto" cannot be resolved.

    Example:
        >>> from zerofn.deepspeed import batch_sizes
        >>> batch_sizes({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}, world_size=2)
        BatchSizes(train_batch_size=32, micro_batch_size=8, gradient_accumulation_steps=2)
    """
    world = C.world_size() if world_size is None else world_size
    return resolve_batch_sizes(Block("", load_config(config)), world)


def resolve_batch_sizes(r: Block, world: int) -> BatchSizes:
    """The batch sizes of the config's top-level block ``r`` for ``world`` ranks (see :func:`batch_sizes`)."""
    names = (TRAIN, MICRO, ACCUM)
    raw = {k: r.raw(k) for k in names}
    autos = [k for k in names if raw[k] == AUTO]
    vals = {k: None if raw[k] is None or raw[k] == AUTO else value_as(k, raw[k], "int", 1) for k in names}
    if autos and sum(v is not None for v in vals.values()) < 2:
        raise auto_error(autos[0])
    train, micro, accum = vals[TRAIN], vals[MICRO], vals[ACCUM]

    def derive(given: str, value: int, missing: str) -> int:
        """``train / (value x world)``, where ``value`` is the ``given`` key's and ``missing`` the key derived."""
        by = value * world
        if train % by:
            raise ValueError(
                f"from_deepspeed: train_batch_size {train} must equal train_micro_batch_size_per_gpu x "
                f"gradient_accumulation_steps x world size, but it is not a multiple of {given} {value} x world size "
                f"{world} (= {by}): no whole {missing} gives it. Change one of the numbers"
            )
        return train // by

    if train is not None and micro is not None and accum is None:
        accum = derive(MICRO, micro, ACCUM)
    elif train is not None and accum is not None and micro is None:
        micro = derive(ACCUM, accum, MICRO)
    elif micro is not None and accum is not None and train is None:
        train = micro * accum * world
    elif train is not None and micro is None and accum is None:
        accum = 1
        micro = derive(ACCUM, accum, MICRO)
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
    return BatchSizes(train, micro, accum)
