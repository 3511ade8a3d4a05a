"""``pipeline_parallel``: the model cut into stages over a ``pp`` axis of the mesh, its micro-batches run
through them by a schedule of ``torch.distributed.pipelining``.

Past a few nodes ZeRO-3's gathers cross the slow links every step and tensor parallelism stays inside a
node; a pipeline moves only activations, between neighbours. Under ``pipeline_parallel(step, stages,
microbatches=m)`` the ``stages`` ranks of a ``pp`` group each hold the parameters of one part of the model (the
embeddings on the first, a run of blocks each, the final norm, head and loss on the last) and its optimizer
state; every rank of the group feeds the same batch (that of its data-parallel rank,
``zf.collectives.data_rank(step)``), which the step cuts into ``m`` micro-batches along its first dimension.

What torch provides and what zerofn adds:

- **The schedule is torch's.** ``schedule="1f1b"`` is ``Schedule1F1B``, ``"interleaved"``
  ``ScheduleInterleaved1F1B`` (``virtual_stages=v``: each rank runs ``v`` stages, ``r, r + p, ...``),
  ``"zero_bubble"`` ``ScheduleInterleavedZeroBubble`` (backward split into the input's gradient, sent at once,
  and the weights', run in the bubbles); the stages are ``PipelineStage``s on the mesh's ``pp`` group, which
  infer the shapes they send from the first micro-batch (once per run and micro-batch shape).
- **The cut is zerofn's.** A stage runs the model's own forward through ``loss_fn``, with the blocks of other
  stages passing their input through, its input received where the embedding would have made it, and (before
  the last stage) its output taken where the final norm would have run (:mod:`._cut`). So no model is
  rewritten into a sequence of layers, whatever it computes around its blocks (masks, rotary tables) is
  computed as on one process, and ``loss_fn`` runs unchanged on the last stage. Hugging Face decoders (Llama,
  Qwen2/3, Mistral, Gemma, GPT-2) and zerofn's example GPT are cut without help; any other model names its
  :class:`Parts`. The blocks divide evenly (the first stages one more) or where ``split=`` says.
- **A weight tied across stages is held once.** A head tied to the input embedding stays with the embedding
  on the first stage, with its optimizer state; each step the first stage sends it to the last, which sends
  its gradient back to be added before the update: DeepSpeed's ``TiedLayerSpec`` sums the two stages'
  gradients the same way, but keeps a copy (and its Adam moments) on both.
- **The step means what it meant.** Each parameter's gradient is the sum over the micro-batches (a mean loss
  divided by ``m``, a ``zf.Mean``'s total by its count over every micro-batch and rank); the loss, ``zf.Mean``'s
  count and ``loss_fn``'s scalar aux values reach every stage (one small all-reduce over ``pp``); the gradient
  norm sums every stage's; clipping, ``amp``'s loss scale and its skipped updates are decided alike on every
  stage; ``accumulate_steps`` accumulates whole pipelined steps. ``metrics["comm_bytes"]`` counts the
  activations and their gradients each rank sends.

The step runs on the data-parallel group of its stage: ``shard_optimizer`` and ``shard_grads`` shard a stage's
state over the data-parallel ranks (DeepSpeed's pipeline with ZeRO-1), the gradient's reduction covers a
stage's parameters only. ``pp`` is the outermost axis: apply ``pipeline_parallel`` after every other
parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerofn.transforms.pipeline_parallel._cut import KNOWN, Parts, find_parts
from zerofn.transforms.pipeline_parallel._run import SCHEDULES, Runner, local_stages, stages_of

from zerofn.extension import Extension
from zerofn.mesh import for_step
from zerofn.sharding import Claim
from zerofn.step import Step, reapply, transform
from zerofn.storage import split_params

__all__ = ["KNOWN", "SCHEDULES", "Parts", "PipelineOptions", "find_parts", "pipeline_parallel"]


@dataclass(frozen=True)
class PipelineOptions:
    """What ``pipeline_parallel`` was asked for (compared by value when it is applied again)."""

    stages: int
    microbatches: int
    schedule: str
    virtual_stages: int
    split: tuple | None
    parts: Parts | None
    reshard_between_microbatches: bool = True


def _positive(where: str, name: str, v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{where}: {name} must be an int >= 1, got {v!r}")


@transform
def pipeline_parallel(
    step: Step,
    stages: int,
    /,
    *,
    microbatches: int,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    split: Any = None,
    parts: Parts | None = None,
    reshard_between_microbatches: bool = True,
) -> Step:
    """Cut the model into ``stages`` stages over a ``pp`` axis and run each batch through them as
    ``microbatches`` micro-batches (see the module).

    Args:
        step: a Step (every other parallelism applied first). Called without it, returns a decorator.
        stages: ranks per pipeline; it must divide the world size.
        microbatches: micro-batches per batch (its rows must divide by it); at least ``stages`` keeps every
            stage busy in the steady state.
        schedule: ``"1f1b"``, ``"interleaved"`` (``virtual_stages >= 2``) or ``"zero_bubble"``.
        virtual_stages: stages per rank (interleaved and zero-bubble schedules): rank ``r`` runs stages
            ``r, r + stages, ...`` of ``stages x virtual_stages``.
        split: the block indices where stages ``1 ..`` start (``stages x virtual_stages - 1`` of them); None:
            as even as the blocks divide.
        parts: where the model's blocks, input embedding and final norm are (:class:`Parts`); None: found for
            Hugging Face decoders and zerofn's example GPT.
        reshard_between_microbatches: under ``shard_params``, each micro-batch's forward and backward gathers
            the units it runs and releases them after (memory: a unit at a time, as without a pipeline);
            False keeps a stage's units gathered from their first use to their last micro-batch's backward
            (one gather per unit per step; the stage's parameters whole meanwhile). Without ``shard_params``
            it changes nothing.

    Returns:
        The rewritten Step, named ``pipeline_parallel(...)``, running on its stage's data-parallel group.

    Raises:
        ValueError: bad sizes or an unknown schedule; at ``init``: a model it cannot cut (how to name its parts
            shown), fewer blocks than stages; at a step: a batch whose rows do not divide into micro-batches.
    """
    where = "pipeline_parallel"
    _positive(where, "stages", stages)
    _positive(where, "microbatches", microbatches)
    _positive(where, "virtual_stages", virtual_stages)
    if schedule not in SCHEDULES:
        raise ValueError(f"{where}: schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    if schedule == "1f1b" and virtual_stages != 1:
        raise ValueError(
            f"{where}: schedule='1f1b' runs one stage per rank; for virtual_stages={virtual_stages} use "
            "schedule='interleaved' or 'zero_bubble'"
        )
    if schedule == "interleaved" and virtual_stages < 2:
        raise ValueError(
            f"{where}: schedule='interleaved' runs several stages per rank; give virtual_stages=2 or more "
            "(or use schedule='1f1b')"
        )
    if parts is not None and not isinstance(parts, Parts):
        raise ValueError(f"{where}: parts must be a pipeline_parallel.Parts, got {type(parts).__name__}")
    m = for_step(step.mesh, where, "pp", stages)
    options = PipelineOptions(
        stages,
        microbatches,
        schedule,
        virtual_stages,
        tuple(split) if split is not None else None,
        parts,
        bool(reshard_between_microbatches),
    )
    have = step.extension(where)
    if reapply(step, where, have and have.options, options, "cuts the model into stages"):
        return step
    out = step.extend(
        Extension(
            where,
            options,
            prepare=lambda split_, functional, w: _prepare(split_, functional, w, options, m),
            runs=lambda s, state, sink, scale: Runner(s, state, sink, scale, options, m),
            check=_check,
        )
    )
    return out.claim(
        Claim(
            "pp",
            where,
            placements=_stage_placements(out, options, where),
            groups=lambda: (m.group("pp"),) if m.size("pp") > 1 else (),
        ),
        m,
    )


def _check(step: Step) -> None:
    """At ``init``: refuse the parallelisms a pipeline has not been made to run beside."""
    if step.extension("expert_parallel") is not None:
        raise ValueError(
            f"{step.name}.init: pipeline_parallel does not run beside expert_parallel yet (a stage's experts "
            "and their token exchanges are not cut by stage). Train the mixture of experts without the pipeline, "
            "or the pipeline on a dense model."
        )
    if step.reduction.replicate:
        raise ValueError(
            f"{step.name}.init: pipeline_parallel does not run beside hybrid sharding (replicate=, hpz=) yet: a "
            "pipeline's stages already keep the slow links for activations. Shard each stage's state over its "
            "data-parallel ranks instead: leave replicate= and hpz= out."
        )


def _prepare(split: Any, functional: Any, where: str, options: PipelineOptions, mesh: Any) -> Any:
    """At ``init``: keep the parameters of this rank's stages only."""
    if functional is None:
        raise ValueError(
            f"{where}: pipeline_parallel cuts a zf.functional model into stages; pass apply.params of "
            "apply = zf.functional(model) to init"
        )
    plan = stages_of(functional.module, options, where)
    mine = set(local_stages(options, mesh))
    keep = [n for n in split.named if plan.owner.get(n) in mine]
    local = split_params({n: split.named[n] for n in keep}, where)
    trainable = {n: split.named[n] for n in split.trainable if n in local.named}
    return split._replace(named=local.named, trainable=trainable, treedef=local.treedef)


def _stage_placements(step: Step, options: PipelineOptions, where: str) -> Any:
    """The claim's placements: ``() -> {name: Stage(coordinate)}`` for every parameter of the model, held by
    the ranks at coordinate ``stage % stages`` of ``pp`` (:class:`zerofn.sharding.Stage`), whether this rank
    holds it or not. The cut is read from the model ``loss_fn`` calls, once per model (kept in a cell of its
    own, weakly: first asked at ``init``, before the state takes the module's parameters over)."""
    import weakref

    from zerofn.sharding import Stage

    cell: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> {name: Stage}

    def placements() -> dict:
        module = step.model().module
        found = cell.get(module)
        if found is None:
            plan = stages_of(module, options, where)
            found = cell[module] = {name: Stage(s % options.stages) for name, s in plan.owner.items()}
        return found

    return placements
