"""``"auto"`` resolved as the Hugging Face Trainer resolves it, from its ``TrainingArguments``.

:func:`resolve_auto` is a pure function of the config and the arguments: it returns a copy of the
config with each ``"auto"`` the Trainer fills replaced by the Trainer's value, and refuses (as the
Trainer does) a value written in the config that disagrees with the argument the Trainer would
fill it from. The reader then reads plain numbers. :func:`trainer_schedule` is the learning-rate
factor the Trainer applies itself when the config has no ``"scheduler"`` (its
``lr_scheduler_type``).

The Trainer's rules (``HfTrainerDeepSpeedConfig.trainer_config_process`` and
``trainer_config_finalize``), key by key, are tabulated in docs/migrating/deepspeed.md.
"""

from __future__ import annotations

import copy
import math
import numbers
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from zerofn import counters
from zerofn import optim as O
from zerofn.deepspeed._keys import AUTO

__all__ = [
    "FILLED_BY",
    "TRAINING_ARGS_DEFAULTS",
    "TrainerArgs",
    "model_hidden_size",
    "resolve_auto",
    "trainer_optimizer",
    "trainer_schedule",
    "with_trainer_schedule",
]

_TORCH = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])

# The TrainingArguments fields zerofn reads, with TrainingArguments' defaults.
TRAINING_ARGS_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
    "max_grad_norm": 1.0,
    "warmup_steps": 0,
    "warmup_ratio": 0.0,  # transformers < 5 (5 reads a warmup_steps below 1 as the ratio)
    "max_steps": -1,
    "lr_scheduler_type": "linear",
    "lr_scheduler_kwargs": None,
    "optim": "adamw_torch_fused" if _TORCH >= (2, 8) else "adamw_torch",  # as TrainingArguments: the same AdamW
    "fp16": False,
    "bf16": False,
    "fp16_full_eval": False,
    "bf16_full_eval": False,
}

# Where each "auto" the Trainer fills comes from in training_args (named by from_deepspeed's errors).
FILLED_BY = {
    "train_batch_size": "its per_device_train_batch_size x gradient_accumulation_steps x world size fills it",
    "train_micro_batch_size_per_gpu": "its per_device_train_batch_size fills it",
    "gradient_accumulation_steps": "its gradient_accumulation_steps fills it",
    "gradient_clipping": "its max_grad_norm fills it",
    "optimizer.params.lr": "its learning_rate fills it",
    "optimizer.params.betas": "its adam_beta1 and adam_beta2 fill it",
    "optimizer.params.eps": "its adam_epsilon fills it",
    "optimizer.params.weight_decay": "its weight_decay fills it",
    "scheduler.params.warmup_min_lr": "any training_args: the Trainer writes 0",
    "scheduler.params.warmup_max_lr": "its learning_rate fills it",
    "scheduler.params.total_num_steps": "its max_steps fills it",
    "scheduler.params.warmup_num_steps": "its warmup_steps fills it",
    "fp16.enabled": "its fp16 fills it",
    "bf16.enabled": "its bf16 fills it",
}

# The keys whose "auto" needs the model's hidden size, and the Trainer's value for hidden size h.
HIDDEN_SIZE_KEYS = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),  # stage 3 only
    "stage3_param_persistence_threshold": lambda h: 10 * h,  # stage 3 only
}

# The lr_scheduler_types zerofn maps (the factor of the learning rate at each update: _hf_lambda, as LambdaLR).
SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")

# The TrainingArguments optims zerofn builds when the config has no "optimizer": torch.optim.AdamW (fused or not).
TRAINER_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def _warmup(count: int, w: int) -> float:
    return count / max(1, w)


def _hf_factor(kind: str, w: int, t: int) -> Callable[[int], float]:
    factor = _hf_lambda(kind, w, t)

    def schedule(count: Any) -> float:
        return factor(int(counters.value(count)))

    return schedule


def _hf_lambda(kind: str, w: int, t: int) -> Callable[[int], float]:
    if kind == "constant_with_warmup":
        return lambda c: _warmup(c, w) if c < w else 1.0
    if kind == "linear":
        return lambda c: _warmup(c, w) if c < w else max(0.0, (t - c) / max(1, t - w))
    assert kind == "cosine", kind
    return lambda c: _warmup(c, w) if c < w else max(0.0, 0.5 * (1.0 + math.cos(math.pi * (c - w) / max(1, t - w))))


class TrainerArgs:
    """The TrainingArguments fields zerofn reads, checked: from a ``TrainingArguments`` or a dict of its fields."""

    def __init__(self, args: Any):
        if isinstance(args, Mapping):
            unknown = [k for k in args if k not in TRAINING_ARGS_DEFAULTS]
            if unknown:
                raise ValueError(
                    f"from_deepspeed: training_args has a field zerofn does not read: {unknown[0]!r}. The fields it "
                    f"reads (TrainingArguments' names): {', '.join(TRAINING_ARGS_DEFAULTS)}; remove the others, or "
                    "pass the transformers.TrainingArguments object itself"
                )
            get = lambda k: args.get(k, TRAINING_ARGS_DEFAULTS[k])  # noqa: E731
        elif hasattr(args, "per_device_train_batch_size") and hasattr(args, "learning_rate"):
            get = lambda k: getattr(args, k, TRAINING_ARGS_DEFAULTS[k])  # noqa: E731
        else:
            raise TypeError(
                "from_deepspeed: training_args must be a transformers.TrainingArguments or a dict of its fields "
                f"(per_device_train_batch_size, learning_rate, ...), got {type(args).__name__}"
            )
        self.micro = _arg("per_device_train_batch_size", get, "int", 1)
        self.accum = _arg("gradient_accumulation_steps", get, "int", 1)
        self.lr = _arg("learning_rate", get, "float", 0)
        self.beta1 = _arg("adam_beta1", get, "float", 0)
        self.beta2 = _arg("adam_beta2", get, "float", 0)
        self.eps = _arg("adam_epsilon", get, "float", 0)
        self.weight_decay = _arg("weight_decay", get, "float", 0)
        self.max_grad_norm = _arg("max_grad_norm", get, "float", 0)
        self.warmup_steps = _arg("warmup_steps", get, "float", 0)
        self.warmup_ratio = _arg("warmup_ratio", get, "float", 0)
        self.max_steps = _arg("max_steps", get, "int", None)
        kind = get("lr_scheduler_type")
        self.lr_scheduler_type = getattr(kind, "value", kind)  # transformers' SchedulerType is a str enum
        if not isinstance(self.lr_scheduler_type, str):
            raise ValueError(f"from_deepspeed: training_args lr_scheduler_type must be a string, got {kind!r}")
        self.lr_scheduler_kwargs = get("lr_scheduler_kwargs") or {}
        optim = get("optim")
        self.optim = getattr(optim, "value", optim)  # transformers' OptimizerNames is a str enum
        self.fp16 = _arg("fp16", get, "bool", None) or _arg("fp16_full_eval", get, "bool", None)
        self.bf16 = _arg("bf16", get, "bool", None) or _arg("bf16_full_eval", get, "bool", None)

    @property
    def total_steps(self) -> int | None:
        """``max_steps``, the Trainer's ``num_training_steps``; None when not given (the Trainer counts the data)."""
        return self.max_steps if self.max_steps > 0 else None

    def warmup_needs_total(self) -> bool:
        return self.warmup_steps < 1 and (self.warmup_steps > 0 or self.warmup_ratio > 0)

    def warmup(self, total: int | None) -> int:
        """The Trainer's ``get_warmup_steps(total)``: warmup_steps >= 1 as is, a fraction below 1 (or
        transformers 4's warmup_ratio) of ``total``, rounded up."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        ratio = self.warmup_steps if self.warmup_steps > 0 else self.warmup_ratio
        if ratio == 0:
            return 0
        assert total is not None
        return math.ceil(total * ratio)


def _arg(name: str, get: Callable, kind: str, low: float | None) -> Any:
    v = get(name)
    if kind == "bool":
        if isinstance(v, bool):
            return v
        raise ValueError(f"from_deepspeed: training_args {name} must be True or False, got {v!r}")
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
    if ok and kind == "int":
        ok = float(v) == int(v)
    if not ok or (low is not None and v < low):
        what = {"int": "a whole number", "float": "a number"}[kind] + (f" >= {low:g}" if low is not None else "")
        raise ValueError(f"from_deepspeed: training_args {name} must be {what}, got {v!r}")
    return int(v) if kind == "int" else float(v)


def model_hidden_size(model: Any) -> int | None:
    """The hidden size the Trainer reads from a Hugging Face model: ``config.hidden_size``, else the largest of
    ``config.hidden_sizes``, else the same of ``config.text_config``; None when it has none of them."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None) is not None:
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None


class _Filler:
    """``fill_match`` of the Trainer over a copy of the config: each "auto" replaced, each disagreement kept."""

    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []

    def node(self, key: str) -> tuple[dict | None, str]:
        *path, last = key.split(".")
        node: Any = self.config
        for p in path:
            node = node.get(p) if isinstance(node, dict) else None
            if node is None:
                return None, last
        return (node if isinstance(node, dict) else None), last

    def is_auto(self, key: str) -> bool:
        node, k = self.node(key)
        return node is not None and _is_auto(node.get(k))

    def fill(self, key: str, value: Any, field: str, must_match: bool = True) -> None:
        node, k = self.node(key)
        if node is None:
            return
        if _is_auto(node.get(k)):
            node[k] = value
        elif must_match and node.get(k) is not None and not _same(node[k], value):
            self.mismatches.append(f"  {key} is {node[k]!r} but training_args {field} gives {value!r}")


def _is_auto(v: Any) -> bool:
    return isinstance(v, str) and v == AUTO


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _needs(key: str, field: str, why: str, write: str) -> ValueError:
    return ValueError(
        f'from_deepspeed: {key} is "auto", which the Hugging Face Trainer fills from {why}, and training_args '
        f"gives no {field}: pass {field}, or write {write} in the config"
    )


def _check_hidden_size(h: Any) -> None:
    if isinstance(h, bool) or not isinstance(h, numbers.Integral) or h < 1:
        raise ValueError(f"from_deepspeed: hidden_size must be a whole number >= 1, got {h!r}")


def resolve_auto(
    config: dict,
    training_args: Any = None,
    world_size: int = 1,
    hidden_size: int | Callable[[], int | None] | None = None,
) -> dict:
    """A copy of ``config`` with each ``"auto"`` the Hugging Face Trainer fills replaced by the Trainer's value.

    Args:
        config: a DeepSpeed config dict (not modified).
        training_args: a ``transformers.TrainingArguments``, or a dict of its fields
            (TrainingArguments' defaults for the absent ones); None fills only the hidden-size keys.
        world_size: the ranks (the Trainer's ``args.world_size``), for ``train_batch_size``.
        hidden_size: the model's hidden size for ``reduce_bucket_size`` and, at stage 3,
            ``stage3_prefetch_bucket_size`` and ``stage3_param_persistence_threshold``;
            a callable is called only when one of them is "auto" (None: it could not be found).

    Raises:
        ValueError: a value written in the config disagrees with the argument the Trainer fills it
            from (all of them in one message, as the Trainer), or an "auto" the Trainer fills
            needs an argument training_args does not give (``max_steps``, ``hidden_size=``).
    """
    f = _Filler(copy.deepcopy(config))
    args = None if training_args is None else TrainerArgs(training_args)
    if hidden_size is not None and not callable(hidden_size):
        _check_hidden_size(hidden_size)
    if args is not None:
        # trainer_config_process
        f.fill("train_micro_batch_size_per_gpu", args.micro, "per_device_train_batch_size")
        f.fill("gradient_accumulation_steps", args.accum, "gradient_accumulation_steps")
        f.fill(
            "train_batch_size",
            world_size * args.micro * args.accum,
            f"per_device_train_batch_size x gradient_accumulation_steps x world size {world_size}",
        )
        f.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
        f.fill("optimizer.params.lr", args.lr, "learning_rate")
        f.fill("optimizer.params.betas", [args.beta1, args.beta2], "[adam_beta1, adam_beta2]")
        f.fill("optimizer.params.eps", args.eps, "adam_epsilon")
        f.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
        f.fill("scheduler.params.warmup_min_lr", 0, "", must_match=False)
        f.fill("scheduler.params.warmup_max_lr", args.lr, "learning_rate")
        f.fill("fp16.enabled", args.fp16, "fp16")
        f.fill("bf16.enabled", args.bf16, "bf16")
    # trainer_config_finalize: the sizes from the model's hidden size
    zero = f.config.get("zero_optimization")
    stage3 = isinstance(zero, dict) and zero.get("stage") == 3
    autos = [k for k in HIDDEN_SIZE_KEYS if f.is_auto(f"zero_optimization.{k}")]
    if autos and (args is not None or hidden_size is not None):
        h = hidden_size() if callable(hidden_size) else hidden_size
        if h is None:
            raise ValueError(
                f'from_deepspeed: zero_optimization.{autos[0]} is "auto", which the Hugging Face Trainer fills from '
                "the model's hidden size, and loss_fn's model has no Hugging Face config with hidden_size or "
                "hidden_sizes: pass hidden_size= (e.g. hidden_size=model.config.hidden_size), or write the number "
                "in the config"
            )
        _check_hidden_size(h)
        for k, rule in HIDDEN_SIZE_KEYS.items():
            if k == "reduce_bucket_size" or stage3:
                f.fill(f"zero_optimization.{k}", rule(int(h)), "", must_match=False)
    if args is not None:
        total = args.total_steps
        if total is not None:
            f.fill("scheduler.params.total_num_steps", total, "max_steps")
        elif f.is_auto("scheduler.params.total_num_steps"):
            raise _needs("scheduler.params.total_num_steps", "max_steps", "the run's length", "the updates of the run")
        if total is not None or not args.warmup_needs_total():
            f.fill("scheduler.params.warmup_num_steps", max(1, args.warmup(total)), "warmup_steps")
        elif f.is_auto("scheduler.params.warmup_num_steps"):
            raise _needs(
                "scheduler.params.warmup_num_steps",
                "max_steps",
                "its warmup ratio times the run's length",
                "the updates of the warmup",
            )
    if f.mismatches:
        lines = "\n".join(f.mismatches)
        raise ValueError(
            "from_deepspeed: the config disagrees with training_args (the Hugging Face Trainer refuses it too):\n"
            f'{lines}\nwrite "auto" for these keys (training_args fills them) or the same value in both'
        )
    return f.config


def trainer_schedule(config: dict, training_args: Any) -> Callable[[int], float] | None:
    """The factor of the learning rate the Trainer applies at each update when ``config`` has no ``"scheduler"``:
    its ``lr_scheduler_type`` (LambdaLR over the optimizer's lr; count 0 is the first update). None for
    ``"constant"``, a config with a ``"scheduler"`` (DeepSpeed's schedule applies), or no training_args."""
    if training_args is None or "scheduler" in config:
        return None
    args = TrainerArgs(training_args)
    kind = args.lr_scheduler_type
    if kind not in SCHEDULES:
        raise ValueError(
            f'from_deepspeed: training_args lr_scheduler_type {kind!r}: the config has no "scheduler", so the '
            f"Hugging Face Trainer would build this schedule, and zerofn maps only {', '.join(SCHEDULES)}: use one "
            'of those, or add a DeepSpeed "scheduler" to the config'
        )
    if args.lr_scheduler_kwargs:
        raise ValueError(
            f"from_deepspeed: training_args lr_scheduler_kwargs {args.lr_scheduler_kwargs!r}: zerofn maps the "
            'Trainer\'s schedules with their default arguments only: remove them, or add a DeepSpeed "scheduler" '
            "to the config"
        )
    if kind == "constant":
        return None
    total = args.total_steps
    if total is None and (kind != "constant_with_warmup" or args.warmup_needs_total()):
        raise ValueError(
            f"from_deepspeed: training_args lr_scheduler_type {kind!r} (the Trainer's schedule when the config has "
            'no "scheduler") needs the run\'s length, and training_args gives no max_steps: pass max_steps, or '
            'lr_scheduler_type="constant" for no schedule'
        )
    return _hf_factor(kind, args.warmup(total), total if total is not None else 0)


def trainer_optimizer(config: dict, training_args: Any, model: Callable[[], Any]) -> tuple[dict, str]:
    """The optimizer the Hugging Face Trainer builds when the config has no ``"optimizer"``: ``create_optimizer``'s
    torch.optim.AdamW over two groups, ``weight_decay`` on every trainable parameter but biases and norm weights
    (``get_decay_parameter_names``: ``zf.optim.decay_mask("huggingface", model)``), none on those.

    Returns ``zf.optim.adamw``'s keyword arguments (lr a number: the schedule is the Trainer's, applied by
    :func:`with_trainer_schedule`, or the config's ``"scheduler"``) and the line ``from_deepspeed``'s warning
    says it with. ``model()`` is the model ``loss_fn`` calls (read only for a weight decay)."""
    args = TrainerArgs(training_args)
    if args.optim not in TRAINER_OPTIMS:
        raise ValueError(
            f'from_deepspeed: the config has no "optimizer", so the Hugging Face Trainer would build training_args '
            f"optim {args.optim!r}, and zerofn builds only the Trainer's AdamW ({', '.join(TRAINER_OPTIMS)}): use "
            'one of those, add an "optimizer" to the config, or build it with zf.optim and pass optimizer='
        )
    kwargs: dict[str, Any] = {
        "lr": args.lr,
        "betas": (args.beta1, args.beta2),
        "eps": args.eps,
        "weight_decay": args.weight_decay,
    }
    if args.weight_decay:
        module = model()
        if module is None:
            raise ValueError(
                f'from_deepspeed: the config has no "optimizer", so the Hugging Face Trainer\'s AdamW applies '
                f"training_args weight_decay {args.weight_decay:g} to all but biases and norm weights, which zerofn "
                "reads from the model, and loss_fn calls no zf.functional apply: write loss_fn to call apply = "
                'zf.functional(model), or add an "optimizer" to the config, or pass optimizer='
            )
        kwargs["mask"] = O.decay_mask("huggingface", module)
    note = (
        f'the config has no "optimizer": the Hugging Face Trainer\'s AdamW from training_args (lr {args.lr:g}, '
        f"betas ({args.beta1:g}, {args.beta2:g}), eps {args.eps:g}, weight_decay {args.weight_decay:g}, none on "
        f"biases and norm weights), {_schedule_note(config, args)}"
    )
    return kwargs, note


def _schedule_note(config: dict, args: TrainerArgs) -> str:
    if "scheduler" in config:
        return 'the config\'s "scheduler" on its lr'
    kind = args.lr_scheduler_type
    if kind == "constant" or kind not in SCHEDULES:  # (an unmapped one is refused by trainer_schedule)
        return f"lr_scheduler_type {kind}"
    total = args.total_steps
    warmup = args.warmup(total) if total is not None or not args.warmup_needs_total() else 0
    of = f" of {total}" if total is not None else ""
    return f"lr_scheduler_type {kind}, {warmup} warmup updates{of}"


def with_trainer_schedule(spec: Any, factor: Callable[[int], float] | None) -> Any:
    """The ``OptimizerSpec`` ``spec`` with its learning rate scaled by ``factor`` (the Trainer's LambdaLR):
    the config's optimizer takes ``lr * factor(count)`` as its lr; an ``optimizer=`` is followed by
    ``scale_by_schedule(factor)`` (the same update: every zf.optim update is proportional to its lr)."""
    if factor is None:
        return spec
    if spec.kind == "given":
        return spec._replace(given=O.chain(spec.given, O.scale_by_schedule(factor)))
    lr = spec.args["lr"]
    return spec._replace(args={**spec.args, "lr": lambda count: lr * factor(count)})
