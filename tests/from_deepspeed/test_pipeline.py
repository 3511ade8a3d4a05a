"""from_deepspeed maps DeepSpeed's pipeline parallelism, ``PipelineModule(layers, num_stages=N)`` (``pipeline_stages=N``,
or the config's ``"pipeline": {"stages": N}``) run by its ``PipelineEngine``, to ``pipeline_parallel(step, N,
microbatches=gradient_accumulation_steps, schedule="1f1b")`` on the built step, with ``accumulate_steps`` 1 (the
engine's micro-batches are the pipeline's): on real gloo ranks (one process at one stage, 2 ranks at two stages) a
tiny Llama trains bit for bit like the composition written by hand, named the same; the pipeline block's keys are
read, warned or refused, as are the ZeRO stage, MiCS, Ulysses and micro-batch counts a pipeline does not run with."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import tiny_llama

import zerofn as zf
from zerofn.deepspeed import from_deepspeed
from zerofn.deepspeed._pipeline import PipelineSpec, check_pipeline, read_pipeline

pytest.importorskip("transformers")

STEPS, MICRO, ACCUM, SEQ = 3, 2, 2, 16
BASE = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": ACCUM,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "gradient_clipping": 1.0,
}
# name: (config, from_deepspeed's keywords, the step's name written by hand)
CASES = {
    # one process, PipelineModule(num_stages=1): ZeRO-1, remat from the pipeline block's checkpoint interval
    "one stage": (
        {
            **BASE,
            "zero_optimization": {"stage": 1},
            "pipeline": {"activation_checkpoint_interval": 1, "pipe_partitioned": False, "partition": "uniform"},
        },
        {"pipeline_stages": 1},
        "pipeline_parallel(remat(shard_optimizer(train_step)))",
    ),
    # 2 ranks, the stages written in the config, ZeRO-1 (DeepSpeed's pipeline with ZeRO)
    "two stages, zero 1": (
        {**BASE, "zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}},
        {},
        "pipeline_parallel(shard_optimizer(train_step))",
    ),
    # 2 ranks, ZeRO-2 (DeepSpeed refuses it beside a pipeline; zerofn's shard_grads composes), bf16, remat on the host
    "two stages, zero 2, bf16": (
        {
            **BASE,
            "zero_optimization": {"stage": 2},
            "bf16": {"enabled": True},
            "activation_checkpointing": {"cpu_checkpointing": True},
            "pipeline": {"activation_checkpoint_interval": 1},
        },
        {"pipeline_stages": 2},
        "pipeline_parallel(remat(amp(shard_grads(train_step))))",
    ),
    # 2 ranks, ZeRO-3 (refused by DeepSpeed beside a pipeline; zerofn's shard_params composes)
    "two stages, zero 3": (
        {**BASE, "zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}},
        {},
        "pipeline_parallel(shard_params(train_step))",
    ),
}


def _hand(name: str, loss_fn):
    from zerofn.transforms import amp, pipeline_parallel, remat, shard_grads, shard_optimizer, shard_params

    opt = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(1e-3, weight_decay=0.1))
    step = zf.train_step(loss_fn, opt)  # accumulate_steps 1: the micro-batches are the pipeline's
    if name == "one stage":
        return pipeline_parallel(remat(shard_optimizer(step)), 1, microbatches=ACCUM, schedule="1f1b")
    if name == "two stages, zero 1":
        return pipeline_parallel(shard_optimizer(step), 2, microbatches=ACCUM, schedule="1f1b")
    if name == "two stages, zero 3":
        return pipeline_parallel(shard_params(step), 2, microbatches=ACCUM, schedule="1f1b")
    step = remat(amp(shard_grads(step), torch.bfloat16), offload="cpu")
    return pipeline_parallel(step, 2, microbatches=ACCUM, schedule="1f1b")


def _train(name: str, by_hand: bool) -> dict:
    config, kw, _ = CASES[name]
    apply = zf.functional(tiny_llama(num_hidden_layers=4))

    def loss_fn(params, batch):
        return apply(params, **batch).loss

    batch = None
    if by_hand:
        step = _hand(name, loss_fn)
        rows = MICRO * ACCUM
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing to warn about
            step, batch = from_deepspeed(config, loss_fn, **kw)
        rows = batch.samples_per_call
    state = step.init(apply.params)
    r, losses = zf.collectives.data_rank(step), []
    for i in range(STEPS):  # every rank of a pipeline feeds its data-parallel rank's rows (one such rank here)
        ids = torch.randint(0, 64, (MICRO * ACCUM, SEQ), generator=torch.Generator().manual_seed(i))
        ids = ids[r * rows : (r + 1) * rows]
        state, m = step(state, {"input_ids": ids, "labels": ids})
        losses.append(float(m["loss"]))
    return {"name": step.name, "accumulate": step.accumulate_steps, "params": step.full_params(state), "losses": losses,
            "batch": batch}  # fmt: skip


def _both(names: tuple) -> dict:
    return {name: (_train(name, False), _train(name, True)) for name in names}


def _check(name: str, built: dict, hand: dict) -> None:
    assert built["name"] == hand["name"] == CASES[name][2], (name, built["name"])
    assert built["accumulate"] == hand["accumulate"] == 1, name
    assert built["losses"] == hand["losses"], name
    assert built["params"].keys() == hand["params"].keys() and built["params"], name
    for k, v in built["params"].items():
        assert torch.equal(v, hand["params"][k]), (name, k)


def test_one_stage_on_one_process_is_pipeline_parallel_written_by_hand(ranks):
    (runs,) = ranks(1).run(_both, ("one stage",))
    built, hand = runs["one stage"]
    _check("one stage", built, hand)
    b = built["batch"]
    # each call feeds the update's whole batch, which the step cuts into gradient_accumulation_steps micro-batches
    assert (b.pipeline_stages, b.world_size, b.train_batch_size, b.samples_per_call) == (1, 1, 4, 4)
    assert (b.micro_batch_size, b.gradient_accumulation_steps) == (MICRO, ACCUM)


def test_two_stages_on_two_ranks_are_pipeline_parallel_written_by_hand(ranks):
    names = ("two stages, zero 1", "two stages, zero 2, bf16", "two stages, zero 3")
    for runs in ranks(2).run(_both, names):
        for name in names:
            built, hand = runs[name]
            _check(name, built, hand)
            # the batch sizes count the data-parallel ranks: 2 ranks at 2 stages are one
            b = built["batch"]
            assert (b.pipeline_stages, b.world_size, b.train_batch_size, b.samples_per_call) == (2, 1, 4, 4)


def _read(block: dict | None = None, world: int = 4, stages=None, group=None) -> tuple[PipelineSpec, dict]:
    ignored: dict = {}
    raw = {} if block is None else {"pipeline": block}
    return read_pipeline(raw, world, group, ignored, stages), ignored


def _refused(*args, **kw) -> str:
    with pytest.raises(ValueError) as e:
        _read(*args, **kw)
    return str(e.value)


def test_the_pipeline_block_read():
    # DeepSpeed's defaults (get_pipeline_config, and the engine's use_reentrant) ask for nothing
    defaults = {
        "stages": "auto",
        "partition": "best",
        "seed_layers": False,
        "activation_checkpoint_interval": 0,
        "pipe_partitioned": False,
        "grad_partitioned": False,
        "use_reentrant": None,
    }
    assert _read(defaults, stages=2) == (PipelineSpec(2, False), {})
    assert _read({"stages": 4}) == (PipelineSpec(4, False), {})  # the config's stages, as num_stages
    assert _read({"stages": 2}, stages=2)[0] == PipelineSpec(2, False)
    assert _read({"activation_checkpoint_interval": 1}, stages=2) == (PipelineSpec(2, True), {})
    assert _read(None) == _read({}) == _read(False) == (PipelineSpec(), {})
    # what only tunes DeepSpeed's engine, or where its layers sit: warned, with what zerofn does
    spec, ignored = _read(
        {
            "activation_checkpoint_interval": 2,
            "pipe_partitioned": True,
            "grad_partitioned": True,
            "use_reentrant": True,
            "seed_layers": True,
            "partition": "parameters",
            "stagez": 2,
        },
        stages=2,
    )
    assert spec == PipelineSpec(2, True)
    assert sorted(ignored) == [f"pipeline.{k}" for k in sorted(
        ("activation_checkpoint_interval", "pipe_partitioned", "grad_partitioned", "use_reentrant", "seed_layers",
         "partition", "stagez"))]  # fmt: skip
    assert "recomputes runs of 2 layers" in ignored["pipeline.activation_checkpoint_interval"]
    assert "split=[...]" in ignored["pipeline.partition"] and ignored["pipeline.stagez"] == "unknown key"
    # use_reentrant picks DeepSpeed's checkpoint function only when it checkpoints
    assert _read({"use_reentrant": True}, stages=2)[1] == {}
    # no stages: DeepSpeed reads the block only for a PipelineModule; zerofn says how to ask for one
    spec, ignored = _read({"activation_checkpoint_interval": 1, "pipe_partitioned": True, "stages": "auto"})
    assert spec == PipelineSpec() and sorted(ignored) == ["pipeline.activation_checkpoint_interval",
                                                         "pipeline.pipe_partitioned"]  # fmt: skip
    assert all("pass pipeline_stages=N" in v for v in ignored.values())


def test_what_the_reader_refuses():
    assert "pipeline_stages must be an int >= 1 (PipelineModule's num_stages), got 0" in _refused(stages=0)
    assert "got True" in _refused(stages=True) and "got '2'" in _refused(stages="2")
    assert "pipeline.stages must be >= 1, got 0" in _refused({"stages": 0})
    assert "pipeline.stages must be a number" in _refused({"stages": "two"})
    assert "pipeline.activation_checkpoint_interval must be >= 0" in _refused({"activation_checkpoint_interval": -1})
    assert "pipeline.pipe_partitioned must be true or false" in _refused({"pipe_partitioned": 1}, stages=2)
    message = _refused({"stages": 2}, stages=4)
    assert "pipeline.stages 2 and pipeline_stages=4 disagree: give the number of stages once" in message
    message = _refused(stages=3, world=4)
    assert "a pipeline of 3 stages does not divide the 4 ranks" in message and "Run on a multiple of 3" in message
    assert "group= and a pipeline (pipeline_stages) together" in _refused(stages=2, group=object())


def _check_refused(*args) -> str:
    with pytest.raises(ValueError) as e:
        check_pipeline(*args)
    return str(e.value)


def test_what_a_pipeline_does_not_run_beside():
    two = PipelineSpec(2)
    for stage in (0, 1, 2, 3):
        check_pipeline(two, stage, None, 2, 1)
    check_pipeline(PipelineSpec(), 3, 4, 1, 2)  # no pipeline: nothing to check
    assert "MiCS is ZeRO-3's" in _check_refused(two, 1, 2, 2, 1)
    assert "pipeline_parallel(context_parallel(step, sp)" in _check_refused(two, 1, None, 2, 2)
    message = _check_refused(two, 1, None, 1, 1)
    assert "gradient_accumulation_steps 1 is the pipeline's micro-batches per step, fewer than its 2 stages" in message
    assert "Write gradient_accumulation_steps 2 or more" in message


def test_from_deepspeed_refuses_before_building():
    def loss_fn(params, batch):  # never called: every refusal comes before a step is built
        raise AssertionError

    config = {**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    with pytest.raises(ValueError, match="a pipeline of 2 stages does not divide the 1 ranks"):
        from_deepspeed(config, loss_fn, pipeline_stages=2)  # one process
    with pytest.raises(ValueError, match="mics_shard_size with a pipeline"):
        from_deepspeed({**config, "zero_optimization": {"stage": 1, "mics_shard_size": 1}}, loss_fn, pipeline_stages=1)


def test_a_pipeline_block_without_stages_is_warned_and_pipelines_nothing():
    apply = zf.functional(torch.nn.Linear(4, 1))
    config = {
        **BASE,
        "pipeline": {"activation_checkpoint_interval": 1, "seed_layers": True},
        "zero_optimization": {"stage": 1, "pipeline_loading_checkpoint": True},
    }
    with pytest.warns(UserWarning) as record:
        step, batch = from_deepspeed(config, lambda p, b: apply(p, b).square().mean())
    text = str(record[0].message)
    assert (
        "pipeline.activation_checkpoint_interval: DeepSpeed reads the pipeline block only for a PipelineModule" in text
    )
    assert "pipeline.seed_layers" in text
    assert "zero_optimization.pipeline_loading_checkpoint: it makes the ranks of a node load" in text
    assert step.name == "shard_optimizer(train_step)" and step.accumulate_steps == ACCUM
    assert batch.pipeline_stages is None and batch.samples_per_call == MICRO
