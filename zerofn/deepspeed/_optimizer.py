"""The optimizer, its learning-rate schedule and gradient clipping a DeepSpeed config asks for, as ``zf.optim``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from zerofn import optim as O
from zerofn.deepspeed._keys import (
    ADAM_PARAMS,
    COMPRESSED_OPTIMIZERS,
    LAMB_PARAMS,
    OPTIMIZERS,
    SCHEDULERS,
    SGD_PARAMS,
)
from zerofn.deepspeed._precision import bf16_masters
from zerofn.deepspeed._reader import Block

__all__ = ["OptimizerSpec", "read_optimizer"]

FACTORIES = {"adam": O.adam, "adamw": O.adamw, "sgd": O.sgd, "lamb": O.lamb}


class OptimizerSpec(NamedTuple):
    """The optimizer a config asks for, read but not yet built.

    Attributes:
        kind: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"lamb"``, or ``"given"`` (``optimizer=`` was passed).
        args: the keyword arguments of ``zf.optim.adam`` / ``adamw`` / ``sgd`` / ``lamb``; ``lr`` may be a
            schedule.
        clip: ``gradient_clipping``, the largest global gradient norm (0: no clipping).
        given: the optimizer passed as ``optimizer=``, for kind ``"given"``.
        note: how it was chosen, when the config does not say (the Hugging Face Trainer's, from
            ``training_args``): a line of ``from_deepspeed``'s warning.
    """

    kind: str
    args: dict
    clip: float
    given: O.GradientTransformation | None = None
    note: str | None = None

    def build(self) -> O.GradientTransformation:
        """The optimizer, behind ``clip_by_global_norm(clip)`` when clipping is on."""
        opt = self.given if self.kind == "given" else FACTORIES[self.kind](**self.args)
        return O.chain(O.clip_by_global_norm(self.clip), opt) if self.clip > 0 else opt


def read_optimizer(
    r: Block,
    given: O.GradientTransformation | None,
    ignored: dict,
    trainer: Callable[[], tuple[dict, str]] | None = None,
) -> OptimizerSpec:
    """The ``optimizer`` and ``scheduler`` blocks and ``gradient_clipping`` of the config's top level ``r``.

    ``given`` is ``from_deepspeed``'s ``optimizer=``; keys with no equivalent are added to ``ignored``.
    ``trainer`` (with ``training_args=``): the Hugging Face Trainer's AdamW, for a config with no
    ``"optimizer"`` and no ``optimizer=`` (``zf.optim.adamw``'s keyword arguments and the warning's line).
    """
    kind, args, note = _optimizer(r, given, ignored, trainer)
    schedule = _schedule(r, args.get("lr") if kind != "given" else None)
    if schedule is not None:
        args["lr"] = schedule
    clip = r.get("gradient_clipping", 0.0, "float", low=0.0)
    return OptimizerSpec(kind, args, clip, given, note)


def _optimizer(r: Block, given: Any, ignored: dict, trainer: Callable | None) -> tuple[str, dict, str | None]:
    """The optimizer block: its kind (``"given"`` for ``optimizer=``) and keyword arguments, lr a number, and
    the warning's line when the Trainer's was chosen."""
    blk = r.block("optimizer")
    if blk is None:
        if given is not None:
            return "given", {}, None
        if trainer is None:
            raise ValueError(
                'from_deepspeed: the config has no "optimizer": add one, e.g. "optimizer": {"type": "AdamW", '
                '"params": {"lr": 3e-4, "weight_decay": 0.01}}, or pass optimizer=zf.optim.adamw(...), or '
                "training_args= (the Hugging Face Trainer's AdamW)"
            )
        args, note = trainer()
        return "adamw", {**args, **_moments(r)}, note
    if given is not None:
        raise ValueError(
            'from_deepspeed: the config has an "optimizer" and optimizer= was passed too (DeepSpeed refuses both): '
            "remove one"
        )
    kind = blk.get("type", None, "str")
    if kind is None:
        raise ValueError('from_deepspeed: optimizer needs a "type": one of ' + ", ".join(OPTIMIZERS))
    name = kind.lower()
    compressed = {k.lower(): base for k, base in COMPRESSED_OPTIMIZERS.items()}
    if name in compressed:
        base = compressed[name]
        raise ValueError(
            f"from_deepspeed: optimizer.type {kind!r} compresses communication: after a warmup it exchanges "
            "1-bit (0/1 Adam: also skipped) momentum with error feedback, which changes the updates; zerofn "
            f'reduces gradients uncompressed. Write "type": "{base}" (the same optimizer without compression) '
            'and, to cut traffic, reduce gradients in bf16 ("bf16": {"enabled": true}: half of fp32\'s bytes) '
            "or accumulate more micro-batches per update (gradient_accumulation_steps)"
        )
    if name not in FACTORIES:
        raise ValueError(
            f"from_deepspeed: optimizer.type {kind!r} is not supported; zerofn maps {', '.join(OPTIMIZERS)}. "
            'For another optimizer, build it with zf.optim and pass optimizer= (with no "optimizer" in the config)'
        )
    p = blk.block("params") or Block("optimizer.params", {})
    for k in blk.leftover():
        ignored[blk.key(k)] = "DeepSpeed reads only type and params here (an optimizer argument goes under params)"
    moments = _moments(r)
    if name == "lamb":
        return "lamb", _lamb(p, moments), None
    if "max_grad_norm" in p:
        raise ValueError(
            "from_deepspeed: optimizer.params.max_grad_norm is not an optimizer parameter (DeepSpeed refuses it too): "
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
        args = {
            "lr": lr,
            "betas": p.get("betas", (0.9, 0.999), "pair"),
            "eps": p.get("eps", 1e-8, "float", low=0.0),
            "weight_decay": wd,
            **moments,
        }
        if not p.get("bias_correction", True, "bool"):  # FusedAdam's option (torch.optim's Adam has none)
            args["bias_correction"] = False
        kind = "adamw" if decoupled else "adam"
    else:
        if p.get("dampening", 0.0, "float") != 0.0:
            raise ValueError("from_deepspeed: optimizer.params.dampening has no equivalent in zf.optim.sgd: remove it")
        args = {
            "lr": lr,
            "momentum": p.get("momentum", 0.0, "float", low=0.0),
            "nesterov": p.get("nesterov", False, "bool"),
            "weight_decay": p.get("weight_decay", 0.0, "float", low=0.0),
        }
        if args["momentum"] and moments:
            raise ValueError(
                "from_deepspeed: SGD with momentum under bf16.bf16_master_weights_and_grads: DeepSpeed keeps the "
                "momentum in fp32, zf.optim.sgd in the parameters' dtype (bf16); set bf16.bf16_optimizer_states "
                "true for bf16 momentum, or remove bf16_master_weights_and_grads"
            )
        kind = "sgd"
    unknown = p.leftover()
    if unknown:
        known = ADAM_PARAMS if name in ("adam", "adamw") else SGD_PARAMS
        raise ValueError(
            f"from_deepspeed: {p.key(unknown[0])}: not a parameter of DeepSpeed's {_kind_name(name)} that zerofn "
            f"maps (ignoring it could change the update): remove it. Mapped: {', '.join(known)}"
        )
    return kind, args, None


def _moments(r: Block) -> dict:
    """The dtypes of the moments, under bf16 masters: DeepSpeed's keep the optimizer state in fp32 unless
    bf16_optimizer_states, so the moments of the bf16 parameters the optimizer updates are fp32, or bf16
    (named, so that fp32 gradients, as the host update under offload gets them, are taken too: updated in
    fp32, stored in bf16)."""
    masters, bf16_states = bf16_masters(r)
    if not masters:
        return {}
    dtype = torch.bfloat16 if bf16_states else torch.float32
    return {"mu_dtype": dtype, "nu_dtype": dtype}


def _lamb(p: Block, moments: dict) -> dict:
    """DeepSpeed's ``FusedLamb`` parameters (its defaults) as ``zf.optim.lamb``'s keyword arguments."""
    if p.get("eps_inside_sqrt", False, "bool"):
        raise ValueError(
            "from_deepspeed: optimizer.params.eps_inside_sqrt true (sqrt(v + eps)) has no equivalent: zf.optim.lamb "
            "adds eps outside the square root (sqrt(v) + eps, DeepSpeed's default); remove it or set it false"
        )
    if p.get("amsgrad", False, "bool"):
        raise ValueError("from_deepspeed: optimizer.params.amsgrad true: DeepSpeed's Lamb refuses it too; remove it")
    if p.get("max_grad_norm", 0.0, "float", low=0.0) > 0:
        raise ValueError(
            "from_deepspeed: optimizer.params.max_grad_norm of Lamb clips with a norm DeepSpeed's engine does not "
            'pass it; write "gradient_clipping": 1.0 at the top level instead (and max_grad_norm 0 or nothing)'
        )
    min_coeff = p.get("min_coeff", 0.01, "float", low=0.0)
    max_coeff = p.get("max_coeff", 10.0, "float", low=0.0)
    if not 0 < min_coeff <= max_coeff:
        raise ValueError(
            f"from_deepspeed: optimizer.params.min_coeff and max_coeff must satisfy 0 < min_coeff <= max_coeff "
            f"(the trust ratio's bounds), got {min_coeff} and {max_coeff}; DeepSpeed's defaults are 0.01 and 10"
        )
    args = {
        "lr": p.get("lr", 1e-3, "float", low=0.0),
        "betas": p.get("betas", (0.9, 0.999), "pair"),
        "eps": p.get("eps", 1e-8, "float", low=0.0),
        "weight_decay": p.get("weight_decay", 0.0, "float", low=0.0),
        # FusedLamb corrects the bias in its step size, after the trust ratio of the uncorrected update.
        "bias_correction": "step_size" if p.get("bias_correction", True, "bool") else False,
        "min_trust_ratio": min_coeff,
        "max_trust_ratio": max_coeff,
        **moments,
    }
    unknown = p.leftover()
    if unknown:
        raise ValueError(
            f"from_deepspeed: {p.key(unknown[0])}: not a parameter of DeepSpeed's Lamb that zerofn maps (ignoring it "
            f"could change the update): remove it. Mapped: {', '.join(LAMB_PARAMS)}"
        )
    return args


def _kind_name(name: str) -> str:
    return {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}[name]


def _schedule(r: Block, lr: float | None) -> Callable | None:
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
    p = blk.block("params") or Block("scheduler.params", {})
    if blk.leftover():
        raise ValueError(f"from_deepspeed: {blk.key(blk.leftover()[0])}: a scheduler has only type and params")
    if p.get("last_batch_iteration", -1, "int") != -1:
        raise ValueError(
            "from_deepspeed: scheduler.params.last_batch_iteration: zerofn's schedules follow the update count, "
            "which a checkpoint restores (zf.checkpoint.load); remove it"
        )
    warmup = {
        "warmup_num_steps": p.get("warmup_num_steps", 1000, "int", low=0),
        "warmup_type": p.get("warmup_type", "log", "str"),
    }
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


def _build_schedule(kind: str, p: Block, lr: float, warmup: dict) -> Callable:
    if kind == "WarmupLR":
        out = O.deepspeed_warmup_lr(
            p.get("warmup_max_lr", lr, "float", low=0.0), p.get("warmup_min_lr", 0.0, "float", low=0.0), **warmup
        )
    elif kind == "WarmupDecayLR":
        if "total_num_steps" not in p:
            raise ValueError(
                "from_deepspeed: scheduler WarmupDecayLR needs params.total_num_steps (updates of the run)"
            )
        out = O.deepspeed_warmup_decay_lr(
            p.get("total_num_steps", None, "int", low=0),
            p.get("warmup_min_lr", 0.0, "float", low=0.0),
            p.get("warmup_max_lr", 0.001, "float", low=0.0),
            **warmup,
        )
    else:
        if "total_num_steps" not in p:
            raise ValueError(
                "from_deepspeed: scheduler WarmupCosineLR needs params.total_num_steps (updates of the run)"
            )
        out = O.deepspeed_warmup_cosine_lr(
            lr,
            p.get("total_num_steps", None, "int", low=0),
            p.get("warmup_min_ratio", 0.0, "float"),
            cos_min_ratio=p.get("cos_min_ratio", 0.0001, "float"),
            **warmup,
        )
    return out
