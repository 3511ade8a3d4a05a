"""``from_deepspeed(..., training_args=)``: each "auto" takes the value the Hugging Face Trainer puts there
(compared with transformers' own ``HfTrainerDeepSpeedConfig`` where transformers is installed), the
Trainer's own schedule when the config has none (compared with ``transformers.get_scheduler``), and the
errors: a value that disagrees with training_args, an "auto" an absent argument would fill."""

from __future__ import annotations

import copy
import importlib.util
import math
import warnings

import pytest
import torch
from helpers import make_mlp

import zerofn as zf
from zerofn.deepspeed import from_deepspeed
from zerofn.deepspeed._auto import TRAINING_ARGS_DEFAULTS, resolve_auto, trainer_schedule

HAS_HF = importlib.util.find_spec("transformers") is not None
needs_hf = pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
HIDDEN = 32


def auto_config(stage, precision="bf16", scheduler="WarmupDecayLR"):
    """A Hugging Face Trainer style config (transformers' docs, main_classes/deepspeed): "auto" everywhere."""
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"}
    if stage == 3:
        zero.update(
            {
                "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto",
                "stage3_max_live_parameters": 1e9,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": zero,
    }
    if scheduler is not None:
        params = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
        if scheduler != "WarmupLR":
            params["total_num_steps"] = "auto"
        config["scheduler"] = {"type": scheduler, "params": params}
    if precision is not None:
        config[precision] = {"enabled": "auto"}
    return config


ARGS = {
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "learning_rate": 3e-4,
    "adam_beta1": 0.8,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-6,
    "weight_decay": 0.1,
    "max_grad_norm": 0.5,
    "warmup_steps": 0.1,
    "max_steps": 50,
    "bf16": True,
}


# ---------------------------------------------------------------- against transformers' HfTrainerDeepSpeedConfig


@pytest.fixture(scope="module")
def hf():
    """transformers' pieces, and a tiny GPT-2 (hidden size 32) built before any DeepSpeed config exists."""
    if not HAS_HF:
        pytest.skip("transformers is not installed")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import transformers
        from transformers.integrations import deepspeed as hfds

        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(n_embd=HIDDEN, n_layer=1, n_head=2, vocab_size=64, n_positions=16)
        )
    return transformers, hfds, model


def _training_args(transformers, tmp_path, fields):
    fields = dict(fields)
    fp16 = fields.pop("fp16", False)  # TrainingArguments refuses fp16 on the CPU: set after construction
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields)
    args.fp16 = fp16
    return args


def _trainer_config(hfds, config):
    """transformers' HfTrainerDeepSpeedConfig for ``config``. Without deepspeed installed (it is not a test
    dependency) transformers gives the class no base; the Trainer's resolution, its own methods, is then run on
    accelerate's config base (the one transformers uses when deepspeed is there), which reads dicts only."""
    if importlib.util.find_spec("deepspeed") is not None:
        return hfds.HfTrainerDeepSpeedConfig(config)
    from accelerate.utils.deepspeed import HfDeepSpeedConfig

    methods = {k: v for k, v in vars(hfds.HfTrainerDeepSpeedConfig).items() if k not in ("__init__", "__dict__")}
    ds = type("HfTrainerDeepSpeedConfig", (HfDeepSpeedConfig,), methods)(config)
    ds._dtype, ds.mismatches = None, []
    hfds.set_hf_deepspeed_config(ds)  # as its constructor does; unset below
    return ds


def _trainer_resolves(hf, config, args):
    """The config as the Trainer resolves it: trainer_config_process(args), then trainer_config_finalize with
    the model and num_training_steps = max_steps."""
    _, hfds, model = hf
    ds = _trainer_config(hfds, copy.deepcopy(config))
    try:
        ds.trainer_config_process(args)
        ds.trainer_config_finalize(args, model, args.max_steps)
        return ds.config
    finally:
        hfds.unset_hf_deepspeed_config()


CASES = [
    (0, "bf16", "WarmupDecayLR", {}),
    (1, "fp16", "WarmupLR", {"bf16": False, "fp16": True, "warmup_steps": 7}),
    (2, "bf16", "WarmupCosineLR", {"warmup_steps": 0}),
    (3, "bf16", "WarmupDecayLR", {"warmup_steps": 0.25, "max_grad_norm": 0.0}),
    (3, None, None, {"bf16": False, "gradient_accumulation_steps": 1}),
]


@needs_hf
@pytest.mark.parametrize("stage,precision,scheduler,change", CASES)
def test_every_auto_is_what_the_trainer_writes(hf, tmp_path, stage, precision, scheduler, change):
    transformers = hf[0]
    fields = {**ARGS, **change}
    config = auto_config(stage, precision, scheduler)
    args = _training_args(transformers, tmp_path, fields)
    want = _trainer_resolves(hf, config, args)
    for given in (args, fields):  # the TrainingArguments, and the dict of its fields
        got = resolve_auto(config, given, world_size=1, hidden_size=HIDDEN)
        assert got == want
        assert [type(v) for v in _leaves(got)] == [type(v) for v in _leaves(want)]
    assert not any(v == "auto" for v in _leaves(want))
    if stage == 3:
        z = want["zero_optimization"]
        assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"], z["stage3_param_persistence_threshold"]) == (
            HIDDEN * HIDDEN,
            int(0.9 * HIDDEN * HIDDEN),
            10 * HIDDEN,
        )


def _leaves(tree):
    if isinstance(tree, dict):
        return [x for k in sorted(tree) for x in _leaves(tree[k])]
    if isinstance(tree, list):
        return [x for v in tree for x in _leaves(v)]
    return [tree]


@needs_hf
def test_the_world_size_multiplies_the_train_batch(hf, tmp_path):
    config = auto_config(2)
    got = resolve_auto(config, ARGS, world_size=4, hidden_size=HIDDEN)
    assert got["train_batch_size"] == 4 * 4 * 2 and got["train_micro_batch_size_per_gpu"] == 4


@needs_hf
def test_a_stage_below_3_leaves_the_stage3_sizes_as_the_trainer_does(hf, tmp_path):
    config = auto_config(2)
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = "auto"
    args = _training_args(hf[0], tmp_path, ARGS)
    want = _trainer_resolves(hf, config, args)
    got = resolve_auto(config, args, 1, HIDDEN)
    assert got == want and got["zero_optimization"]["stage3_prefetch_bucket_size"] == "auto"
    with pytest.warns(UserWarning, match="stage3_prefetch_bucket_size: prefetching is ZeRO-3's"):
        from_deepspeed(got, make_mlp()[2])  # the reader takes it as without training_args


@needs_hf
def test_a_value_that_disagrees_with_training_args_is_refused_as_by_the_trainer(hf, tmp_path):
    config = auto_config(1)
    config["optimizer"]["params"]["lr"] = 1e-3
    config["gradient_accumulation_steps"] = 4
    args = _training_args(hf[0], tmp_path, ARGS)
    with pytest.raises(ValueError, match="mismatch"):
        _trainer_resolves(hf, config, args)
    with pytest.raises(ValueError) as e:
        resolve_auto(config, args, 1, HIDDEN)
    msg = str(e.value)
    assert "the config disagrees with training_args" in msg
    assert "optimizer.params.lr is 0.001 but training_args learning_rate gives 0.0003" in msg
    assert "gradient_accumulation_steps is 4 but training_args gradient_accumulation_steps gives 2" in msg
    # equal values pass, as in the Trainer
    config["optimizer"]["params"]["lr"], config["gradient_accumulation_steps"] = 3e-4, 2
    assert resolve_auto(config, args, 1, HIDDEN) == _trainer_resolves(hf, config, args)


@needs_hf
def test_from_deepspeed_reads_the_hidden_size_from_the_model_loss_fn_calls(hf, tmp_path):
    model = hf[2]
    apply = zf.functional(model)

    def loss_fn(params, batch):
        return apply(params, batch["ids"], labels=batch["ids"]).loss

    args = _training_args(hf[0], tmp_path, ARGS)
    config = auto_config(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step, batch = from_deepspeed(config, loss_fn, training_args=args)
    assert step.name == "amp(shard_params(train_step))" and step.accumulate_steps == 2
    assert (batch.train_batch_size, batch.micro_batch_size) == (8, 4)
    assert step.bucket_bytes == HIDDEN * HIDDEN * 2  # reduce_bucket_size h*h elements of bf16
    # hidden_size= wins over the model's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step = from_deepspeed(config, loss_fn, training_args=args, hidden_size=64).step
    assert step.bucket_bytes == 64 * 64 * 2


@needs_hf
@pytest.mark.parametrize("kind", ["linear", "cosine", "constant", "constant_with_warmup"])
@pytest.mark.parametrize("warmup", [0, 3, 0.2])
def test_with_no_scheduler_the_trainers_schedule_is_applied(kind, warmup):
    from transformers import get_scheduler

    total = 12
    w = int(warmup) if warmup >= 1 else math.ceil(total * warmup)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler(kind, opt, num_warmup_steps=w, num_training_steps=total)
    want = []
    for _ in range(total + 3):
        want.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    factor = trainer_schedule({}, {"lr_scheduler_type": kind, "warmup_steps": warmup, "max_steps": total})
    got = [1.0 if factor is None else factor(c) for c in range(total + 3)]
    assert got == pytest.approx(want, rel=0, abs=1e-12)


# ---------------------------------------------------------------- the schedule, in the step


def _sgd_updates(opt, n):
    """The updates ``opt`` makes for a gradient of ones on a zero parameter, n times (its learning rates)."""
    params = {"w": torch.zeros(1)}
    state = opt.init(params)
    out = []
    for _ in range(n):
        u, state = opt.update({"w": torch.ones(1)}, state, params)
        out.append(-u["w"].item())
    return out


def test_the_trainer_schedule_scales_the_config_optimizer_and_a_given_one():
    _, _, loss_fn = make_mlp()
    fields = {"learning_rate": 0.5, "max_grad_norm": 0.0, "warmup_steps": 2, "max_steps": 6}
    config = {"train_batch_size": "auto", "gradient_clipping": "auto"}
    factor = trainer_schedule(config, fields)
    want = [0.5 * factor(c) for c in range(8)]
    assert want[:3] == [0.0, 0.25, 0.5] and want[-1] == 0.0
    step = from_deepspeed(
        {**config, "optimizer": {"type": "SGD", "params": {"lr": "auto"}}}, loss_fn, training_args=fields
    ).step
    assert _sgd_updates(step.optimizer, 8) == pytest.approx(want)
    step = from_deepspeed(config, loss_fn, optimizer=zf.optim.sgd(0.5), training_args=fields).step
    assert _sgd_updates(step.optimizer, 8) == pytest.approx(want)
    # "constant" (or a "scheduler" in the config) leaves the learning rate alone
    step = from_deepspeed(
        config, loss_fn, optimizer=zf.optim.sgd(0.5), training_args={**fields, "lr_scheduler_type": "constant"}
    ).step
    assert _sgd_updates(step.optimizer, 3) == pytest.approx([0.5] * 3)


# ---------------------------------------------------------------- the errors


def test_dict_fields_take_the_training_arguments_defaults():
    got = resolve_auto(auto_config(2, "bf16", scheduler=None), {}, world_size=2, hidden_size=8)
    assert got["train_micro_batch_size_per_gpu"] == 8 and got["train_batch_size"] == 16
    assert got["optimizer"]["params"] == {"lr": 5e-5, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
    assert got["gradient_clipping"] == 1.0 and got["bf16"]["enabled"] is False
    if HAS_HF:
        import dataclasses

        import transformers

        defaults = {f.name: f.default for f in dataclasses.fields(transformers.TrainingArguments)}
        for k, v in TRAINING_ARGS_DEFAULTS.items():
            if k in defaults and k != "lr_scheduler_type":
                assert defaults[k] == v, k
        assert getattr(defaults["lr_scheduler_type"], "value", defaults["lr_scheduler_type"]) == "linear"


ERRORS = [
    ({"max_steps": -1}, {}, r'scheduler.params.total_num_steps is "auto".*gives no max_steps: pass max_steps'),
    (
        {"max_steps": -1, "warmup_steps": 0.1},
        {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
        r'scheduler.params.warmup_num_steps is "auto".*warmup ratio.*gives no max_steps',
    ),
    ({"learning_rate": "fast"}, {}, r"training_args learning_rate must be a number >= 0, got 'fast'"),
    ({"per_device_train_batch_size": 0}, {}, r"per_device_train_batch_size must be a whole number >= 1"),
    ({"num_train_epochs": 3}, {}, r"field zerofn does not read: 'num_train_epochs'.*per_device_train_batch_size"),
    (
        {},
        {"zero_optimization": {"stage": "auto"}},
        r'zero_optimization.stage is "auto", which no Hugging Face Trainer argument fills.*0, 1, 2 or 3',
    ),
]


@pytest.mark.parametrize("fields,change,match", ERRORS)
def test_errors_name_the_key_and_the_argument(fields, change, match):
    _, _, loss_fn = make_mlp()
    config = {**auto_config(1, "bf16"), **change}
    with pytest.raises(ValueError, match=match):
        from_deepspeed(config, loss_fn, training_args={**ARGS, **fields}, hidden_size=HIDDEN)


def test_no_hidden_size_names_hidden_size():
    _, _, loss_fn = make_mlp()  # a plain torch module: no Hugging Face config
    with pytest.raises(ValueError, match=r'zero_optimization.reduce_bucket_size is "auto".*pass hidden_size='):
        from_deepspeed(auto_config(3), loss_fn, training_args=ARGS)
    with pytest.raises(ValueError, match=r"hidden_size must be a whole number >= 1, got 0"):
        from_deepspeed(auto_config(3), loss_fn, training_args=ARGS, hidden_size=0)
    # hidden_size= alone fills the hidden-size keys and nothing else
    config = resolve_auto(auto_config(3, scheduler=None), ARGS, 1, HIDDEN)
    config["zero_optimization"].update({"reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto"})
    got = resolve_auto(config, None, 1, 16)
    assert got["zero_optimization"]["reduce_bucket_size"] == 256
    assert got["zero_optimization"]["stage3_prefetch_bucket_size"] == int(0.9 * 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert from_deepspeed(config, loss_fn, hidden_size=16).step.bucket_bytes == 256 * 2  # bf16 elements
    # without training_args the sizes that only tune performance take zerofn's defaults, as before
    config = resolve_auto(auto_config(3), ARGS, 1, HIDDEN)
    config["zero_optimization"]["reduce_bucket_size"] = "auto"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert from_deepspeed(config, loss_fn).step.bucket_bytes == zf.step.DEFAULT_BUCKET_BYTES


def test_without_training_args_the_error_names_the_argument_that_fills_it():
    _, _, loss_fn = make_mlp()
    for key, field in [
        ("optimizer.params.lr", "learning_rate"),
        ("scheduler.params.warmup_num_steps", "warmup_steps"),
        ("gradient_clipping", "max_grad_norm"),
    ]:
        config = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        config.update({"scheduler": {"type": "WarmupLR", "params": {}}})
        *path, last = key.split(".")
        node = config
        for p in path:
            node = node[p]
        node[last] = "auto"
        with pytest.raises(ValueError, match=rf'{key} is "auto".*pass training_args= \(its {field} fills it\)'):
            from_deepspeed(config, loss_fn)


def test_the_trainer_schedule_errors():
    _, _, loss_fn = make_mlp()
    config = {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    quiet = {"learning_rate": 0.1, "max_grad_norm": 0.0, "weight_decay": 0.0}
    with pytest.raises(ValueError, match=r"lr_scheduler_type 'polynomial'.*zerofn maps only linear, cosine"):
        from_deepspeed(config, loss_fn, training_args={**quiet, "lr_scheduler_type": "polynomial", "max_steps": 9})
    with pytest.raises(ValueError, match=r"lr_scheduler_type 'linear' \(the Trainer's schedule.*pass max_steps"):
        from_deepspeed(config, loss_fn, training_args=quiet)
    with pytest.raises(ValueError, match=r"lr_scheduler_kwargs \{'power': 2\}"):
        from_deepspeed(config, loss_fn, training_args={**quiet, "max_steps": 9, "lr_scheduler_kwargs": {"power": 2}})
    with pytest.raises(TypeError, match=r"training_args must be a transformers.TrainingArguments or a dict"):
        from_deepspeed(config, loss_fn, training_args=[1])


# ---------------------------------------------------------------- no "optimizer": the Trainer's AdamW and schedule

TRAINER_FIELDS = {
    "per_device_train_batch_size": 2,
    "learning_rate": 3e-3,
    "adam_beta1": 0.8,
    "adam_beta2": 0.95,
    "adam_epsilon": 1e-6,
    "weight_decay": 0.1,
    "max_grad_norm": 0.0,
    "warmup_steps": 2,
    "max_steps": 6,
}
TRAINER_STEPS, TRAINER_WORLD = 6, 2
# each lr_scheduler_type under another ZeRO stage (shard_optimizer, shard_grads, shard_params)
TRAINER_CASES = [("linear", 1), ("cosine", 2), ("constant_with_warmup", 3), ("constant", 3)]
# no "optimizer" and no "scheduler": the Trainer supplies both (transformers' docs, main_classes/deepspeed)
TRAINER_CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


def _trainer_model():
    """A small Llama with biases (which, with its norm weights, the Trainer does not decay)."""
    from helpers import tiny_llama

    return tiny_llama(seed=3, attention_bias=True, mlp_bias=True)


def _trainer_batch(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return torch.randint(0, 64, (TRAINER_WORLD * TRAINER_FIELDS["per_device_train_batch_size"], 8), generator=g)


def _trainer_loss(apply):
    return lambda params, batch: apply(params, input_ids=batch, labels=batch, use_cache=False).loss


def _rank_trainer_runs(cases):
    """Each case trained on this rank's half of each batch by the step from_deepspeed builds with no "optimizer":
    its full parameters and the warning it gave."""
    from helpers import rank_slice

    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    out = {}
    for kind, stage in cases:
        module = _trainer_model()
        apply = zf.functional(module)
        loss_fn = _trainer_loss(apply)
        config = {**TRAINER_CONFIG, "zero_optimization": {"stage": stage}}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step, batch = from_deepspeed(config, loss_fn, training_args={**TRAINER_FIELDS, "lr_scheduler_type": kind})
        assert batch.micro_batch_size == 2 and step.name.startswith(
            {1: "shard_optimizer", 2: "shard_grads"}.get(stage, "shard_params")
        )
        state = step.init(apply.params)
        for i in range(TRAINER_STEPS):
            state, _ = step(state, rank_slice(_trainer_batch(i), rank, world))
        out[(kind, stage)] = (step.full_params(state), [str(w.message) for w in caught])
    return out


def _trainer_reference(kind: str, tmp_path) -> dict:
    """The Hugging Face Trainer's own optimizer and scheduler (create_optimizer_and_scheduler) driving the same
    model by hand, each update's gradient the mean of the two ranks' halves (DDP's)."""
    import transformers

    module = _trainer_model()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", lr_scheduler_type=kind, **TRAINER_FIELDS
    )
    trainer = transformers.Trainer(model=module, args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=TRAINER_FIELDS["max_steps"])
    opt, sched = trainer.optimizer, trainer.lr_scheduler
    decay = [g for g in opt.param_groups if g["weight_decay"] > 0]
    assert len(decay) == 1 and 0 < len(decay[0]["params"]) < sum(len(g["params"]) for g in opt.param_groups)
    params = [p for g in opt.param_groups for p in g["params"]]
    n = TRAINER_FIELDS["per_device_train_batch_size"]
    for i in range(TRAINER_STEPS):
        batch = _trainer_batch(i)
        grads = [
            torch.autograd.grad(module(input_ids=b, labels=b, use_cache=False).loss, params)
            for b in (batch[:n], batch[n:])
        ]
        for p, a, b in zip(params, *grads):
            p.grad = (a + b) / 2
        opt.step()
        sched.step()
    return {k: p.detach().clone() for k, p in module.named_parameters()}


@needs_hf
def test_with_no_optimizer_the_trainers_adamw_and_schedule_are_built(ranks, tmp_path):
    """A Trainer config with no "optimizer" (nor "scheduler"): from_deepspeed(training_args=) builds the Trainer's
    AdamW (no decay on biases and norm weights) and its lr_scheduler_type with warmup, on 2 ranks under ZeRO 1, 2
    and 3: the Trainer's own optimizer and scheduler stepped with the same gradients, within 1e-6 (as
    test_optim_groups' 2 ranks; measured: bit for bit); the warning says so in one line."""
    per_rank = ranks(TRAINER_WORLD).run(_rank_trainer_runs, TRAINER_CASES)
    start = {k: p.detach() for k, p in _trainer_model().named_parameters()}
    for case in TRAINER_CASES:
        kind, _ = case
        ref = _trainer_reference(kind, tmp_path)
        got, caught = per_rank[0][case]
        diff = max(float((got[k] - ref[k]).abs().max()) for k in ref)
        assert diff <= 1e-6, f"{case}: max |zerofn - Trainer| {diff:.3g}"
        assert max(float((start[k] - ref[k]).abs().max()) for k in ref) > 1e-3  # it trained
        assert all(torch.equal(per_rank[1][case][0][k], got[k]) for k in got)
        notes = [line for m in caught for line in m.splitlines() if 'has no "optimizer"' in line]
        assert len(notes) == 1, caught
        assert (
            "Trainer's AdamW from training_args (lr 0.003, betas (0.8, 0.95), eps 1e-06, weight_decay 0.1" in notes[0]
        )
        assert f"lr_scheduler_type {kind}" in notes[0]


def test_with_no_optimizer_what_zerofn_cannot_build_is_refused():
    """With no "optimizer": an optim or a schedule zerofn cannot build, and a weight decay with no model to read the
    Trainer's groups from, are refused; so is a config with no "optimizer" and no training_args, as before."""
    _, _, loss_fn = make_mlp()
    fields = {**TRAINER_FIELDS, "lr_scheduler_type": "constant"}
    with pytest.raises(ValueError, match=r'the config has no "optimizer": add one.*or training_args='):
        from_deepspeed({"train_batch_size": 2}, loss_fn)
    with pytest.raises(ValueError, match=r"training_args optim 'adafactor'.*only the Trainer's AdamW"):
        from_deepspeed(TRAINER_CONFIG, loss_fn, training_args={**fields, "optim": "adafactor"})
    with pytest.raises(ValueError, match=r"lr_scheduler_type 'polynomial'.*zerofn maps only linear, cosine"):
        from_deepspeed(TRAINER_CONFIG, loss_fn, training_args={**fields, "lr_scheduler_type": "polynomial"})
    no_model = lambda params, batch: sum(p.sum() for p in params.values())  # noqa: E731
    with pytest.raises(ValueError, match=r"weight_decay 0.1 to all but biases.*loss_fn calls no zf.functional"):
        from_deepspeed(TRAINER_CONFIG, no_model, training_args=fields)
    with warnings.catch_warnings():  # no decay: no model needed
        warnings.simplefilter("ignore")
        from_deepspeed(TRAINER_CONFIG, no_model, training_args={**fields, "weight_decay": 0.0})
    # a DeepSpeed "scheduler" with no "optimizer" sets the Trainer's AdamW's lr, as DeepSpeed's does
    scheduler = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto"}}
    with pytest.warns(UserWarning, match=r'has no "optimizer".*none on biases and norm weights\), the config\'s "sch'):
        from_deepspeed({**TRAINER_CONFIG, "scheduler": scheduler}, loss_fn, training_args=fields)
