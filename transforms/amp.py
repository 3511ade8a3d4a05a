"""``amp``: bf16/fp16 compute against fp32 master weights, with loss scaling all ranks agree on.

Composes with every shard transform, in any order. It replaces the step's
``precision`` part (see ``zerofn.step``) with a :class:`MixedPrecision`
policy, as jmp's ``Policy`` with its loss scale:

- ``cast``: trainable and frozen parameters are held in ``dtype`` (2 bytes
  each) and the forward runs under ``torch.autocast`` to it, so matmuls
  run in ``dtype`` and reductions (softmax, norms, losses) in fp32.
  BatchNorm's parameters stay in fp32, beside its running statistics, as
  FSDP's ``MixedPrecision`` keeps them.
- ``compute="param"`` (FSDP2's ``MixedPrecisionPolicy``): no autocast; the
  forward runs in the parameters' dtype. The model's floating-point
  positional inputs are cast to ``dtype`` where they enter and its floating
  outputs come back in fp32 (so the loss is computed in fp32); modules of the
  ``fp32_modules`` types (norms, losses) keep their parameters in fp32 and
  run in fp32: their floating inputs are cast up, their outputs back down
  (a loss's stay fp32). Hooks on the model's modules do it, registered while
  the step runs its forward and backward (a recompute under ``remat`` sees
  them too) and removed after.
- ``grad_dtype``: gradients are bucketed and reduced in ``dtype`` (or
  ``reduce_dtype``, as FSDP2's ``reduce_dtype``): half of fp32's traffic.
- ``wrap_optimizer`` (:func:`master_weights`): the optimizer state holds an
  fp32 master copy of the parameters it updates (this rank's shard under
  ``shard_optimizer``), the inner optimizer updates the master, and the
  result is cast back into the low-precision parameters, which are then
  published (all-gathered) in ``dtype``. The precision part wraps the
  optimizer before any extension does, so ``offload`` moves the master
  weights with the rest of the optimizer state. With
  ``master_dtype=dtype`` (DeepSpeed's ``bf16_master_weights_and_grads``)
  there is no master copy: the optimizer takes the gradients in ``dtype``
  and updates the held parameters themselves (its moments in their own
  dtype: ``zf.optim.adamw(..., mu_dtype=torch.float32, nu_dtype=torch.float32)``
  keeps fp32 moments of bf16 parameters, the default moments are bf16).
- the loss scale, a pytree in the state like jmp's:
  :class:`NoOpLossScale`, :class:`StaticLossScale` or
  :class:`DynamicLossScale`, one interface (``scale``, ``adjust(finite)``).

The loss is multiplied by the scale before backward; after the reduction
the gradient partition is cast to fp32 and divided by (ranks x micro-steps x
scale) in one fused multiply. Overflow (inf/nan in any rank's gradient) is
agreed with the step's one small all-reduce (the global gradient norm is
non-finite on every rank); then every rank skips the update, leaves
parameters and optimizer state as they were, and the dynamic scale backs
off with DeepSpeed's hysteresis: it shrinks by ``backoff`` on the
``hysteresis``-th overflow since the last growth, and grows by
``1 / backoff`` after ``growth_interval`` steps without overflow. At
``min_scale`` training goes on skipping and says so in the metrics
(``skipped``, ``consecutive_skips``, ``loss_scale``); it never raises.

Per-rank model-state bytes then follow the memory table in docs/design.md:
DDP 16 Psi, ZeRO-1 4 Psi + 12 Psi / N, ZeRO-2 2 Psi + 14 Psi / N, ZeRO-3
16 Psi / N (2 Psi of parameters, 4 Psi master + 8 Psi Adam moments in the
optimizer state, and 2 Psi of gradients inside a step); ``master_dtype=dtype``
drops the 4 Psi master (and bf16 moments halve the 8 Psi).

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import amp, shard_optimizer
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = amp(shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-3))), torch.float16)
    >>> state = step.init(apply.params)
    >>> state, metrics = step(state, torch.ones(2, 4))
    >>> float(metrics["loss_scale"]), state.params[0].dtype
    (65536.0, torch.float16)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.loss import _Loss
from torch.utils._pytree import tree_map_only

from zerofn import alloc, counters
from zerofn import optim as O
from zerofn import tree as T
from zerofn._io import FileTensor
from zerofn.functional import BINDING
from zerofn.precision import Precision
from zerofn.roles import Inner, Quantity, find_quantity
from zerofn.step import Step, reapply, transform

__all__ = [
    "FP32_MODULES",
    "MASTER",
    "DynamicLossScale",
    "MasterState",
    "MixedPrecision",
    "NoOpLossScale",
    "ScaleSettings",
    "StaticLossScale",
    "amp",
    "master_weights",
]

_DEFAULT = object()
_DTYPES = (torch.bfloat16, torch.float16)


class ScaleSettings(NamedTuple):
    """The loss scale's settings as :func:`amp` was given them (compared when amp is applied again)."""

    loss_scale: Any = None  # "dynamic", a positive float (static) or None (no scaling)
    init_scale: float = 2.0**16
    growth_interval: int = 1000
    backoff: float = 0.5
    hysteresis: int = 2
    min_scale: float = 1.0

    def new(self, device: Any = None) -> Any:
        """A fresh loss scale of these settings (its tensors on ``device``, default the CPU); raises a
        ValueError on a bad setting."""
        return _new_scale(self, device)


_COMPUTE = ("autocast", "param")
# Modules that run in fp32 under compute="param": norms (BatchNorm, InstanceNorm, LayerNorm, GroupNorm,
# LocalResponseNorm, RMSNorm where torch has it) and losses.
FP32_MODULES: tuple[type, ...] = (
    _NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
    _Loss,
)


# ---------------------------------------------------------------- loss scales


def _i64(v: int, device: Any = None) -> torch.Tensor:
    return counters.new(v, device=device)  # carries its value on the host: adjusting the scale reads no tensor


def _skips(skips: torch.Tensor, finite: bool | torch.Tensor) -> torch.Tensor:
    """The consecutive skipped steps after one that was (or was not) finite: on the host for a decision the
    host read, on the device for a 0-dim bool tensor."""
    if isinstance(finite, torch.Tensor):
        return torch.where(finite, torch.zeros_like(skips), skips + 1)
    return _i64(0 if finite else counters.value(skips) + 1, skips.device)


@T.state_class
class NoOpLossScale:
    """No scaling (bf16): scale 1; overflow still skips the step and is counted."""

    skips: torch.Tensor

    @property
    def scale(self) -> float:
        return 1.0

    def adjust(self, finite: bool | torch.Tensor) -> NoOpLossScale:
        return NoOpLossScale(_skips(self.skips, finite))


@T.state_class
class StaticLossScale:
    """A fixed scale."""

    scale: torch.Tensor
    skips: torch.Tensor

    def adjust(self, finite: bool | torch.Tensor) -> StaticLossScale:
        return StaticLossScale(self.scale, _skips(self.skips, finite))


@T.state_class
class DynamicLossScale:
    """DeepSpeed's dynamic loss scale: back off on overflow with hysteresis, grow after a good run.

    Leaves are the counters; the policy is static (in the treedef), so a
    tree round trip keeps every setting (jmp's flatten drops min_loss_scale).
    """

    scale: torch.Tensor  # fp32
    good_steps: torch.Tensor  # steps since the last overflow (this one included)
    hysteresis_left: torch.Tensor  # overflows still tolerated before backing off
    skips: torch.Tensor  # consecutive skipped steps
    growth_interval: int = T.field(static=True, default=1000)
    backoff: float = T.field(static=True, default=0.5)
    hysteresis: int = T.field(static=True, default=2)
    min_scale: float = T.field(static=True, default=1.0)

    def adjust(self, finite: bool | torch.Tensor) -> DynamicLossScale:
        if isinstance(finite, torch.Tensor):
            return self._adjust_on_device(finite)
        scale, good, left, skips = (
            counters.value(t) for t in (self.scale, self.good_steps, self.hysteresis_left, self.skips)
        )
        if finite:
            good, skips = good + 1, 0
            if good % self.growth_interval == 0:
                scale, left = scale / self.backoff, self.hysteresis
        else:
            good, skips = 0, skips + 1
            if left <= 1:
                scale = max(scale * self.backoff, self.min_scale)
            else:
                left -= 1
        dev = self.scale.device
        return self._replace(
            counters.new(scale, torch.float32, dev), _i64(good, dev), _i64(left, dev), _i64(skips, dev)
        )

    def _adjust_on_device(self, finite: torch.Tensor) -> DynamicLossScale:
        """:meth:`adjust` for a decision the host did not read: the same rule as ``torch.where`` selects
        (the scale computed in float64 and rounded once, as the host rule computes it)."""
        good = torch.where(finite, self.good_steps + 1, torch.zeros_like(self.good_steps))
        grow = finite & (good % self.growth_interval == 0)
        back = ~finite & (self.hysteresis_left <= 1)
        wide = self.scale.double()
        scale = torch.where(
            grow, wide / self.backoff, torch.where(back, (wide * self.backoff).clamp(min=self.min_scale), wide)
        ).float()
        left = torch.where(
            grow,
            torch.full_like(self.hysteresis_left, self.hysteresis),
            torch.where(~finite & ~back, self.hysteresis_left - 1, self.hysteresis_left),
        )
        return self._replace(scale, good, left, _skips(self.skips, finite))

    def _replace(self, scale, good, left, skips) -> DynamicLossScale:
        return DynamicLossScale(
            scale, good, left, skips, self.growth_interval, self.backoff, self.hysteresis, self.min_scale
        )


# ---------------------------------------------------------------- master weights

MASTER = "master"  # the quantity amp's fp32 master weights are declared (and saved) as


class MasterState(NamedTuple):
    """fp32 master copies of the parameters an optimizer updates, and that optimizer's state."""

    master: Any
    inner: Any

    def state_parts(self) -> tuple:
        """What this state holds (``zerofn.roles``): the parameters in full precision, then the inner state."""
        return (Quantity(MASTER, self.master, precise=True), Inner(self.inner))


def master_weights(inner: O.GradientTransformation) -> O.GradientTransformation:
    """Run ``inner`` on fp32 master copies of low-precision parameters.

    ``init(params)`` keeps an fp32 copy of ``params`` (which may be bf16/fp16
    shards); its update takes fp32 gradients, updates the master with
    ``inner`` (its fused path where it has one) and casts the result back
    into the low-precision parameters in place.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> from zerofn.transforms.amp import master_weights
        >>> p = {"w": torch.ones(3, dtype=torch.bfloat16)}
        >>> opt = master_weights(optim.sgd(0.5))
        >>> s = optim.update_params(opt, {"w": torch.ones(3)}, opt.init(p), p)
        >>> p["w"].tolist(), s.master["w"].dtype
        ([0.5, 0.5, 0.5], torch.float32)
    """

    def init(params):
        master = T.tree_map(lambda p: alloc.copy_of(p, torch.float32), params)  # unfilled under alloc.unfilled
        return MasterState(master, inner.init(master))

    @torch.no_grad()
    def update_in_place(grads, state, params, **extra):
        grads = T.tree_map(lambda g: g.float(), grads)
        new_inner = O.update_params(inner, grads, state.inner, state.master, **extra)
        torch._foreach_copy_(T.tree_leaves(params), T.tree_leaves(state.master))
        return MasterState(state.master, new_inner)

    # Bound to a view, the inner optimizer is: the masters hold the same pieces as the parameters.
    return O.in_place(init, update_in_place, "master_weights")._replace(
        bind=lambda view: master_weights(O.bind(inner, view)), communicates=inner.communicates, masks=inner.masks
    )


# ---------------------------------------------------------------- the policy


@dataclass(frozen=True)
class MixedPrecision(Precision):
    """``dtype`` parameters and compute, gradients reduced in ``reduce_dtype``, fp32 master weights.

    Attributes:
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        reduce_dtype: the dtype gradients travel in (None: ``dtype``).
        scale_settings: the loss scale's settings as given to :func:`amp`
            (:class:`ScaleSettings`).
        compute: ``"autocast"`` (the forward under ``torch.autocast``) or
            ``"param"`` (in the parameters' dtype, ``fp32_modules`` in fp32).
        fp32_modules: the module types that run in fp32 under ``"param"``
            (empty under ``"autocast"``).
        master_dtype: the dtype of the weights the optimizer updates:
            ``torch.float32`` (a master copy) or ``dtype`` (no copy: the
            held parameters, with gradients in ``dtype``).
    """

    name: str | None = "amp"
    dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    scale_settings: ScaleSettings = ScaleSettings()
    compute: str = "autocast"
    fp32_modules: tuple = ()
    master_dtype: torch.dtype = torch.float32

    @property
    def keeps_masters(self) -> bool:
        """Whether the optimizer state holds a master copy (False: the held parameters are updated)."""
        return self.master_dtype != self.dtype

    def cast(self, t: torch.Tensor, owner: torch.nn.Module | None = None) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == self.dtype or isinstance(owner, (_BatchNorm, *self.fp32_modules)):
            # BatchNorm keeps its parameters in its running statistics' dtype, as FSDP's
            # MixedPrecision does: batch_norm needs them alike, and takes bf16 inputs.
            # Under compute="param" the fp32 modules keep theirs too: they run in fp32.
            return t
        # Inside zerofn.alloc.unfilled (a state built to be loaded into), the cast holds no values.
        return alloc.copy_of(t, self.dtype).requires_grad_(t.requires_grad)

    def autocast(self, device: str):
        if self.compute == "param":
            return _ParamCompute(self.dtype, self.fp32_modules)
        return torch.autocast(device_type=torch.device(device).type, dtype=self.dtype)

    def grad_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.reduce_dtype or param_dtype

    def wrap_optimizer(self, optimizer: O.GradientTransformation) -> O.GradientTransformation:
        return master_weights(optimizer) if self.keeps_masters else optimizer

    def optimizer_grads(self, reduced: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.keeps_masters:  # the optimizer works on the held parameters, in their dtype
            return {k: v.to(self.master_dtype) for k, v in reduced.items()}
        return {k: v.float() for k, v in reduced.items()}  # the optimizer works on the fp32 masters

    def masters(self, opt_state: Any) -> tuple | None:
        if not self.keeps_masters:
            return None  # the parameters themselves are what the optimizer updates
        found = find_quantity(opt_state, MASTER)  # in memory, on the host, or in NVMe files
        if not found:
            raise ValueError("amp: no fp32 master weights in the optimizer state (a state of another step?)")
        return tuple(t.read() if isinstance(t, FileTensor) else t for t in (found[i] for i in range(len(found))))

    def new_loss_scale(self, device: Any = None) -> Any:
        return self.scale_settings.new(device)

    def loss_scale_factor(self, loss_scale: Any) -> float | torch.Tensor:
        scale = loss_scale.scale
        if not isinstance(scale, torch.Tensor):
            return float(scale)
        # the host's number while it holds it; the device's tensor once an update adjusted it there
        return float(counters.value(scale)) if counters.known(scale) else scale

    def adjust(self, loss_scale: Any, finite: bool | torch.Tensor) -> Any:
        return loss_scale.adjust(finite)

    def metrics(self, loss_scale: Any) -> dict[str, Any]:
        return {
            "loss_scale": loss_scale.scale.float()
            if isinstance(loss_scale.scale, torch.Tensor)
            else torch.tensor(loss_scale.scale, dtype=torch.float32),
            "consecutive_skips": loss_scale.skips,
        }


# ---------------------------------------------------------------- the transform


@transform
def amp(
    step: Step,
    /,
    dtype: torch.dtype = torch.bfloat16,
    *,
    loss_scale: Any = _DEFAULT,
    init_scale: float = 2.0**16,
    growth_interval: int = 1000,
    backoff: float = 0.5,
    hysteresis: int = 2,
    min_scale: float = 1.0,
    reduce_dtype: torch.dtype | None = None,
    compute: str = "autocast",
    fp32_modules: Any = None,
    master_dtype: torch.dtype = torch.float32,
) -> Step:
    """Mixed precision: ``dtype`` parameters and compute, fp32 master weights, loss scaling.

    Args:
        step: a Step (any shard transforms applied before or after). Called
            without it, returns a decorator.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        loss_scale: ``"dynamic"``, a float (static scale) or None (no
            scaling). Default: dynamic for fp16, None for bf16 (DeepSpeed's
            defaults).
        init_scale, growth_interval, backoff, hysteresis, min_scale: the
            dynamic scale (DeepSpeed's ``initial_scale_power`` 16,
            ``loss_scale_window`` 1000, ``hysteresis`` 2, ``min_loss_scale`` 1).
        reduce_dtype: dtype gradients travel in; default ``dtype``.
        compute: ``"autocast"`` (default): the forward runs under
            ``torch.autocast(dtype)``, which picks fp32 for reductions op by
            op. ``"param"``: no autocast; the forward runs in the parameters'
            dtype, as FSDP2's ``MixedPrecisionPolicy``: the model's floating
            positional inputs are cast to ``dtype``, its floating outputs
            come back in fp32, and the ``fp32_modules`` run in fp32.
        fp32_modules: with ``compute="param"``, the module types (a type or
            a tuple of types) whose own parameters stay in fp32 and whose
            forward runs in fp32 (floating inputs cast up, outputs cast back
            to ``dtype``; a loss's outputs stay fp32). Default
            :data:`FP32_MODULES`: norms (BatchNorm, InstanceNorm, LayerNorm,
            GroupNorm, LocalResponseNorm, RMSNorm) and losses. Give ``()``
            to run every module in ``dtype``.
        master_dtype: ``torch.float32`` (default): the optimizer updates an
            fp32 master copy (:func:`master_weights`). ``dtype``: no master
            copy, as DeepSpeed's ``bf16_master_weights_and_grads``: the
            optimizer takes the gradients in ``dtype`` and updates the held
            parameters in place (2 bytes per parameter less than the 4 of
            the fp32 copy; its moments are as its ``mu_dtype``/``nu_dtype``
            say, the parameters' dtype by default).

    Returns:
        The rewritten Step; its metrics add ``loss_scale`` and
        ``consecutive_skips``. Applied to a step that already runs in mixed
        precision with the same settings it returns that step unchanged.

    Raises:
        TypeError: ``step`` is not a Step.
        ValueError: a dtype that is not bf16/fp16, a ``master_dtype`` that is
            neither fp32 nor ``dtype``, bad scale settings, an unknown ``compute``, ``fp32_modules`` that are not module types
            (or given with ``compute="autocast"``), or a step that already
            runs in mixed precision with other settings.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"amp: dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if reduce_dtype is not None and not (isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point):
        raise ValueError(f"amp: reduce_dtype must be a floating dtype such as torch.float32, got {reduce_dtype!r}")
    if master_dtype not in (torch.float32, dtype):
        raise ValueError(
            f"amp: master_dtype must be torch.float32 (an fp32 master copy) or the compute dtype {dtype} "
            f"(no master copy: the held parameters are updated), got {master_dtype!r}"
        )
    if loss_scale is _DEFAULT:
        loss_scale = "dynamic" if dtype == torch.float16 else None
    settings = ScaleSettings(loss_scale, init_scale, growth_interval, backoff, hysteresis, min_scale)
    settings.new()  # check the settings now, not at init
    modules = _fp32_modules(compute, fp32_modules)
    policy = MixedPrecision(
        dtype=dtype,
        reduce_dtype=reduce_dtype,
        scale_settings=settings,
        compute=compute,
        fp32_modules=modules,
        master_dtype=master_dtype,
    )
    have = step.precision if isinstance(step.precision, MixedPrecision) else None
    if reapply(step, "amp", have, policy, "runs in mixed precision"):
        return step
    if type(step.precision) is not Precision:
        raise ValueError(f"amp: {step.name} already sets its precision ({step.precision!r}); apply one precision")
    return step.replace(precision=policy)


def _fp32_modules(compute: str, fp32_modules: Any) -> tuple:
    """The checked ``fp32_modules`` as a tuple of module types (empty under autocast)."""
    if compute not in _COMPUTE:
        raise ValueError(f'amp: compute must be "autocast" or "param", got {compute!r}')
    if compute == "autocast":
        if fp32_modules is not None:
            raise ValueError(
                'amp: fp32_modules applies with compute="param"; under compute="autocast" torch.autocast '
                "picks the fp32 ops itself"
            )
        return ()
    if fp32_modules is None:
        return FP32_MODULES
    types = tuple(fp32_modules) if isinstance(fp32_modules, (tuple, list)) else (fp32_modules,)
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad:
        raise ValueError(f"amp: fp32_modules must be nn.Module subclasses (types), got {bad!r}")
    return tuple(dict.fromkeys(types))


class _ParamCompute:
    """compute="param"'s casts: the model's inputs to ``dtype`` and its outputs to fp32; ``fp32`` modules'
    inputs to fp32 and their outputs back to ``dtype`` (a loss's stay fp32).

    A module called while no other runs, during the forward, is a top-level call (the model's; a loss module's
    in loss_fn). One global forward pre-hook finds such calls and is there only between them: at a top-level
    call it removes itself and gives the module hooks of its own, on it and on its ``fp32`` modules (once per
    step), and the module's forward hook puts it back when the call returns. So no module runs under a global
    hook while a top-level call runs (a block compiled with ``block.compile()`` traces its own modules' hooks
    only, the same functions every step). The modules' hooks stay until the step's backward is over (the
    step's binding stack), so a recompute in backward (``remat``'s checkpointing) casts alike; outside a step,
    or when the forward raises, every hook goes at the context's exit. Nothing stays on the modules after.
    """

    def __init__(self, dtype: torch.dtype, fp32: tuple):
        self.dtype, self.fp32 = dtype, fp32
        self.forward = True  # the forward is running (not a recompute in backward)
        self.finder: Any = None  # the global pre-hook that finds top-level calls, between them
        self.prepared: set[int] = set()  # ids of the modules called at the top level, which have hooks
        self.handles: list = []  # those modules' hooks and their fp32 modules'

    def __enter__(self) -> _ParamCompute:
        self._arm()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.forward = False
        self._disarm()
        binding = BINDING.get()
        if binding is not None and exc[0] is None:
            binding.callback(self._remove)  # after the step's backward
        else:
            self._remove()

    def _arm(self) -> None:
        if self.forward and self.finder is None:
            self.finder = torch.nn.modules.module.register_module_forward_pre_hook(self._found)

    def _disarm(self) -> None:
        if self.finder is not None:
            self.finder.remove()
            self.finder = None

    def _remove(self) -> None:
        self._disarm()
        for h in self.handles:
            h.remove()
        self.handles = []

    def _found(self, module: nn.Module, args: tuple) -> tuple | None:
        """A top-level call: its module gets hooks of its own (this call's pre-hooks are already chosen, so
        this one casts its inputs), and the finder goes until the call returns."""
        self._disarm()
        if id(module) in self.prepared:
            return None  # its own pre-hook casts
        self.prepared.add(id(module))
        outer = torch.float32 if isinstance(module, self.fp32) else self.dtype
        for m in module.modules():
            if m is not module and isinstance(m, self.fp32):
                self.handles.append(m.register_forward_pre_hook(functools.partial(_cast_in, torch.float32)))
                self.handles.append(m.register_forward_hook(functools.partial(_fp32_out, self.dtype)))
        self.handles.append(module.register_forward_pre_hook(functools.partial(_cast_in, outer)))
        self.handles.append(module.register_forward_hook(self._top_out, always_call=True))
        return _to(args, outer)

    def _top_out(self, module: nn.Module, args: tuple, out: Any) -> Any:
        self._arm()  # the next top-level call
        return _to(out, torch.float32)


def _cast_in(dtype: torch.dtype, module: nn.Module, args: tuple) -> tuple:
    return _to(args, dtype)


def _fp32_out(dtype: torch.dtype, module: nn.Module, args: tuple, out: Any) -> Any:
    """An fp32 module's output, back to ``dtype`` (a loss's stays fp32)."""
    return out if isinstance(module, _Loss) else _to(out, dtype)


def _to(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with its floating-point tensors cast to ``dtype``."""
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def _new_scale(s: ScaleSettings, device: Any = None):
    """A fresh loss scale for amp's settings (checking them)."""
    loss_scale, init_scale, growth_interval, backoff = s.loss_scale, s.init_scale, s.growth_interval, s.backoff
    hysteresis, min_scale = s.hysteresis, s.min_scale
    if loss_scale is None:
        return NoOpLossScale(_i64(0, device))
    if loss_scale == "dynamic":
        if not (0 < backoff < 1):
            raise ValueError(f"amp: backoff must be in (0, 1), got {backoff}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"amp: growth_interval must be an int >= 1, got {growth_interval!r}")
        if not (isinstance(hysteresis, int) and hysteresis >= 1):
            raise ValueError(f"amp: hysteresis must be an int >= 1, got {hysteresis!r}")
        if not (0 < min_scale <= init_scale):
            raise ValueError(f"amp: need 0 < min_scale <= init_scale, got {min_scale} and {init_scale}")
        return DynamicLossScale(
            counters.new(float(init_scale), torch.float32, device),
            _i64(0, device),
            _i64(hysteresis, device),
            _i64(0, device),
            growth_interval,
            backoff,
            hysteresis,
            float(min_scale),
        )
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool) and loss_scale > 0:
        return StaticLossScale(counters.new(float(loss_scale), torch.float32, device), _i64(0, device))
    raise ValueError(f'amp: loss_scale must be "dynamic", a positive float or None, got {loss_scale!r}')
