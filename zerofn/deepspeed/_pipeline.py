"""Pipeline parallelism: DeepSpeed's ``PipelineModule(layers, num_stages=N)`` (in code, so ``from_deepspeed``'s
``pipeline_stages=N``, or the config's ``"pipeline": {"stages": N}``) with the config's ``"pipeline"`` block, as
``pipeline_parallel(step, N, microbatches=gradient_accumulation_steps, schedule="1f1b")`` on the built step.

DeepSpeed's ``PipelineEngine`` runs ``gradient_accumulation_steps`` micro-batches through its stages per
``train_batch()`` (its ``TrainSchedule``, 1F1B), so they are the pipeline's micro-batches: the step takes the whole
batch of a rank per call (``accumulate_steps`` 1) and cuts it. Its config block (``get_pipeline_config`` in
``deepspeed/runtime/config.py``: ``stages``, ``partition``, ``seed_layers``, ``activation_checkpoint_interval``,
``pipe_partitioned``, ``grad_partitioned``, and ``use_reentrant`` read by the engine) is read only under a
``PipelineModule``; of its keys the engine reads ``activation_checkpoint_interval`` (``remat``), ``use_reentrant``,
``pipe_partitioned`` and ``grad_partitioned``, while ``stages``, ``partition`` and ``seed_layers`` are defaults that
``PipelineModule``'s arguments override. zerofn has no ``PipelineModule``, so an int ``stages`` says the number of
stages as ``num_stages`` would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofn.deepspeed._keys import PIPE_IGNORED, PIPE_QUIET
from zerofn.deepspeed._reader import Block

__all__ = ["PipelineSpec", "check_pipeline", "read_pipeline"]

_NO_PIPELINE = (
    "DeepSpeed reads the pipeline block only for a PipelineModule; for pipeline parallelism pass "
    "pipeline_stages=N (PipelineModule's num_stages)"
)


@dataclass(frozen=True)
class PipelineSpec:
    """What the pipeline asks for.

    Attributes:
        stages: ``pipeline_parallel``'s stages (None: no pipeline).
        remat: ``activation_checkpoint_interval`` > 0: ``remat`` on the step.
    """

    stages: int | None = None
    remat: bool = False


def read_pipeline(raw: dict, world: int, group: Any, ignored: dict, stages: Any = None) -> PipelineSpec:
    """The pipeline ``pipeline_stages`` (``stages``) and the config's ``"pipeline"`` block ask for, checked against
    the ``world`` ranks left by tensor parallelism; keys with no equivalent go to ``ignored``.

    Raises:
        ValueError: a ``pipeline_stages`` or ``pipeline.stages`` that is not an int >= 1 (``"auto"`` allowed in the
            config), the two disagreeing, stages that do not divide the ranks, ``group=`` beside a pipeline, or a
            value of the wrong type in the block.
    """
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
        raise ValueError(
            f"from_deepspeed: pipeline_stages must be an int >= 1 (PipelineModule's num_stages), got {stages!r}"
        )
    data = raw.get("pipeline")
    blk = Block("pipeline", {} if data is None or data is False else data)  # false asks for nothing
    written = blk.get("stages", None, "int", auto=-1, low=1)
    if written not in (None, -1):
        if stages is not None and stages != written:
            raise ValueError(
                f"from_deepspeed: pipeline.stages {written} and pipeline_stages={stages} disagree: give the number of "
                "stages once (DeepSpeed takes it from PipelineModule's num_stages, pipeline_stages= here)"
            )
        stages = written
    interval = blk.get("activation_checkpoint_interval", 0, "int", low=0)
    values = {  # null, or absent: asks for nothing
        k: PIPE_QUIET[k][0] if blk.raw(k) is None else blk.get(k, None, "str" if k == "partition" else "bool")
        for k in PIPE_IGNORED
    }
    if stages is None:  # a block without a pipeline: DeepSpeed's plain engine ignores it, and so does zerofn
        if interval:
            ignored[blk.key("activation_checkpoint_interval")] = _NO_PIPELINE
        for k, v in values.items():
            if v not in PIPE_QUIET[k]:
                ignored[blk.key(k)] = _NO_PIPELINE
        for k in blk.leftover():
            ignored[blk.key(k)] = _NO_PIPELINE
        return PipelineSpec()
    if interval > 1:
        ignored[blk.key("activation_checkpoint_interval")] = (
            f"remat checkpoints each of the model's blocks (interval 1): the same numbers, where DeepSpeed's "
            f"interval {interval} recomputes runs of {interval} layers from the input of the first"
        )
    for k, v in values.items():
        if v not in PIPE_QUIET[k] and not (k == "use_reentrant" and not interval):
            ignored[blk.key(k)] = PIPE_IGNORED[k]
    for k in blk.leftover():
        ignored[blk.key(k)] = "unknown key"
    if world % stages:
        raise ValueError(
            f"from_deepspeed: a pipeline of {stages} stages does not divide the {world} ranks it would cut (the world "
            f"over tensor_parallel.autotp_size): the ranks are {stages} stages times the data-parallel ranks of each. "
            f"Run on a multiple of {stages} ranks, or pick a number of stages that divides {world}"
        )
    if group is not None:
        raise ValueError(
            "from_deepspeed: group= and a pipeline (pipeline_stages) together: pipeline_parallel lays its stages out "
            "on a mesh over the world and runs the step on each stage's data-parallel group. Leave group= out."
        )
    return PipelineSpec(stages, interval > 0)


def check_pipeline(pipe: PipelineSpec, stage: int, mics: int | None, accumulation: int, sp: int) -> None:
    """Raise for what is not mapped beside a pipeline: MiCS, Ulysses (``context_parallel``), and fewer
    micro-batches than stages. ZeRO-2 and ZeRO-3, which DeepSpeed refuses with a pipeline, compose in zerofn
    (``shard_grads``, ``shard_params`` over each stage's data-parallel ranks)."""
    if pipe.stages is None:
        return
    n = pipe.stages
    if mics is not None:
        raise ValueError(
            f"from_deepspeed: zero_optimization.mics_shard_size with a pipeline of {n} stages: DeepSpeed's MiCS is "
            "ZeRO-3's, which it refuses beside a pipeline, and zerofn shards each stage's state over the stage's "
            "data-parallel ranks. Remove mics_shard_size"
        )
    if sp > 1:
        raise ValueError(
            f"from_deepspeed: sequence_parallel_size {sp} with a pipeline of {n} stages: from_deepspeed does not map "
            "Ulysses beside a pipeline. Remove sequence_parallel_size and write the step by hand: "
            "pipeline_parallel(context_parallel(step, sp), stages, microbatches=m)"
        )
    if accumulation < n:
        raise ValueError(
            f"from_deepspeed: gradient_accumulation_steps {accumulation} is the pipeline's micro-batches per step, "
            f"fewer than its {n} stages: torch's 1F1B schedule runs at least one micro-batch per stage (DeepSpeed's "
            f"runs fewer, with stages idle). Write gradient_accumulation_steps {n} or more (train_batch_size = "
            "train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel ranks)"
        )
