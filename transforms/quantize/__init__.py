"""``quantize``: frozen weights held as 4-bit NF4 (or int8) in the state, dequantized per call (QLoRA).

Adds an extension whose ``prepare`` rewrites what ``init`` holds: every
frozen weight the policy picks (by default the weight of each ``nn.Linear``
with ``requires_grad=False``, as peft leaves a base model; never an
embedding, the output head or a weight tied to another module's) is
replaced by its quantized parts (:mod:`zerofn.transforms.quantize._codecs`:
NF4 codes, two per byte, with double-quantized per-block scales, or int8
codes with a scale per block), and its module holds those parts as frozen
parameters (``weight_codes``, ...) in place of the weight. The module's
forward dequantizes the weight just before it runs, in the dtype it was
held in (amp's, or ``compute_dtype``), and frees it after; backward
dequantizes it again rather than keeping it (:class:`QuantizedLinearFn`).

Everything else sees ordinary frozen tensors: under ``shard_params`` the
parts are what is sharded, gathered per unit and released, so a unit's
traffic and its gathered bytes are the quantized sizes; ``offload(...,
params=...)`` rests them in RAM or in files; ``remat`` dequantizes again in
its recompute; checkpoints save and load them; ``zf.memory.state_bytes``
counts them. Trainable parameters (LoRA adapters, norms left trainable) are
untouched.

A model built on the meta device (or loaded file by file) is quantized
layer by layer under ``shard_params``: each layer's parts stay on meta until
its sharded init initialises the layer's weight (``init_fn``, e.g.
``zf.checkpoint.pretrained_init(directory)`` reading a Hugging Face
checkpoint, or the model's own initialisation), encodes it and keeps this
rank's shard of the parts, so no rank ever holds more than one layer's
weight unquantized.

To export, :func:`dequantized` turns the full parameters
(``step.full_params(state)`` or ``step.state_dict(state)``) back into those
of the unquantized model: each layer's parts become its ``weight``, decoded
with the layer's codec, under the name the model had before, ready for
``load_state_dict`` into a freshly built model (and, for peft, for
``merge_and_unload``).

Collectives: none of its own.

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import quantize
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    >>> _ = model[0].weight.requires_grad_(False)  # the frozen base
    >>> apply = zf.functional(model)
    >>> step = quantize(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3)), "nf4")
    >>> state, metrics = step(step.init(apply.params), torch.ones(2, 64))
    >>> sorted(n for n in state.spec.layout.frozen)
    ['0.weight_codes', '0.weight_factors', '0.weight_mean', '0.weight_scalers']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from zerofn.transforms.quantize._codecs import Codec, codec
from zerofn.transforms.quantize._experts import decode_stacked, quantize_experts, quantized_experts

from zerofn.extension import Extension
from zerofn.functional import Functional
from zerofn.moe import experts_modules
from zerofn.step import Step, reapply, transform
from zerofn.storage import ParamSplit, split_params

__all__ = ["QuantizedLinearFn", "QuantizeOptions", "dequantized", "quantize", "quantized_layers"]


@dataclass(frozen=True)
class QuantizeOptions:
    """What ``quantize`` was asked for (compared by value when it is applied again)."""

    kind: str
    block_size: int
    compute_dtype: torch.dtype | None
    policy: Any


@transform
def quantize(
    step: Step,
    kind: str = "nf4",
    /,
    *,
    block_size: int = 64,
    compute_dtype: torch.dtype | None = None,
    policy: Callable[[str, nn.Module], bool] | None = None,
) -> Step:
    """Hold the model's frozen ``Linear`` weights quantized, dequantized per call.

    Args:
        step: a Step (any transforms applied before or after). Called without
            it, returns a decorator.
        kind: ``"nf4"`` (4-bit NormalFloat with double-quantized block scales,
            QLoRA's; torchao's values bit for bit) or ``"int8"`` (int8 codes,
            an fp32 absmax scale per block).
        block_size: elements per quantization block (64: QLoRA's).
        compute_dtype: the dtype a layer computes with its dequantized weight;
            None: the dtype the weight is held in (``amp``'s, else its own).
        policy: which modules' weights to quantize, ``(path, module) -> bool``;
            None: every ``nn.Linear`` whose weight is frozen, but for the
            output head and weights tied to another module. A module it picks
            must be an ``nn.Linear`` with a frozen weight.

    Returns:
        The rewritten Step, named ``quantize(...)``. Applied to a step that
        already quantizes with the same settings it returns that step unchanged.

    Raises:
        ValueError: an unknown ``kind``, a ``block_size`` that is not a
            positive even int, or a step that already quantizes otherwise;
            at ``init``: params not from ``zf.functional``, a weight on the
            meta device, a policy that picks what cannot be held quantized.
    """
    codec(kind, block_size)  # checks kind and block_size now
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ValueError(f"quantize: compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}")
    options = QuantizeOptions(kind, block_size, compute_dtype, policy)
    have = step.extension("quantize")
    if reapply(step, "quantize", have and have.options, options, "quantizes frozen weights"):
        return step
    return step.extend(
        Extension("quantize", options, prepare=lambda split, f, where: _prepare(options, split, f, where))
    )


# ---------------------------------------------------------------- init: the weights become their parts


@dataclass(frozen=True)
class Quantized:
    """How a layer's weight is held: its codec, shape, the dtype it was quantized from and computes in."""

    codec: Codec
    shape: torch.Size
    dtype: torch.dtype
    compute_dtype: torch.dtype


def quantized_layers(module: nn.Module) -> dict[str, Quantized]:
    """path -> how its weight is held, for every layer of ``module`` that ``quantize`` holds quantized."""
    return {path: m._zf_quantized for path, m in module.named_modules() if isinstance(m, _QuantizedLinear)}


def dequantized(params: dict, model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The full parameters of the unquantized model: each quantized layer's parts replaced by its weight.

    Args:
        params: name -> tensor, the full parameters of a model that ``quantize``
            holds quantized: ``step.full_params(state)`` or
            ``step.state_dict(state)`` (``master=True`` too), on any rank.
        model: the module the step runs (the one ``zf.functional`` wraps), after
            ``step.init``: its quantized layers say how each weight is held
            (:func:`quantized_layers`).
        dtype: the dtype of the dequantized weights; None: the dtype each was
            quantized from (amp's under ``amp``). Other tensors are left as
            they are.

    Returns:
        A new dict, in the order of ``params``: each layer's parts
        (``<path>.weight_codes``, ...) replaced, where the first of them was,
        by ``<path>.weight``, decoded with the layer's codec (the numbers
        the layer computes with); every other entry the same tensor. Its names
        are those of the unquantized model, so ``load_state_dict(...,
        strict=True)`` into a freshly built one (peft's adapters included)
        loads it.

    Raises:
        TypeError: ``params`` is not a dict or ``model`` not a module.
        ValueError: ``model`` holds no layer quantized, or ``params`` lacks some
            of a layer's parts or holds one of the wrong size or kind.

    Example:
        >>> import torch, zerofn as zf
        >>> from zerofn.transforms.quantize import dequantized, quantize
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
        >>> _ = model[0].weight.requires_grad_(False)
        >>> apply = zf.functional(model)
        >>> step = quantize(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.adamw(1e-3)), "nf4")
        >>> state = step.init(apply.params)
        >>> sorted(step.full_params(state))
        ['0.bias', '0.weight_codes', '0.weight_factors', '0.weight_mean', '0.weight_scalers', '1.bias', '1.weight']
        >>> full = dequantized(step.full_params(state), model)
        >>> sorted(full), full["0.weight"].shape
        (['0.bias', '0.weight', '1.bias', '1.weight'], torch.Size([64, 64]))
        >>> fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
        >>> fresh.load_state_dict(full)
        <All keys matched successfully>
    """
    if isinstance(model, Functional):
        model = model.module
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"dequantized(params, model): model must be the nn.Module the step runs, got {type(model).__name__}"
        )
    if not isinstance(params, dict):
        raise TypeError(
            f"dequantized(params, model): params must be a dict of name -> tensor (step.full_params(state) or "
            f"step.state_dict(state)), got {type(params).__name__}"
        )
    layers = quantized_layers(model)
    experts = quantized_experts(model)
    if not layers and not experts:
        raise ValueError(
            "dequantized(params, model): no layer of model is held quantized. Pass the module the quantized step "
            "runs (the one zf.functional wraps), after step.init(...): a freshly built model holds plain weights."
        )
    order = {name: i for i, name in enumerate(params)}
    firsts: dict[str, str] = {}  # the first of a layer's parts in params -> the layer's path
    taken: set[str] = set()
    for path, held in layers.items():
        prefix = f"{path}." if path else ""
        names = [f"{prefix}weight_{k}" for k in held.codec.parts(held.shape.numel(), held.dtype)]
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(
                f"dequantized(params, model): params lack {missing} of {path!r}, which is held quantized "
                f"({held.codec.name}: its parts are {names}). Pass every full parameter: "
                "step.full_params(state) or step.state_dict(state), and the model that step runs."
            )
        if f"{prefix}weight" in params:
            raise ValueError(
                f"dequantized(params, model): params hold both {prefix}weight and the parts of {path!r}; "
                "pass the full parameters as the quantized step gives them (step.full_params(state))."
            )
        firsts[min(names, key=order.__getitem__)] = path
        taken.update(names)
    stacked: dict[str, tuple] = {}  # the first of a stacked experts weight's parts in params -> (its name, how)
    for path, held_experts in experts.items():
        for wname, (fmt, shape, was, _, names) in held_experts.weights.items():
            full = f"{path}.{wname}" if path else wname
            parts = {k: f"{path}.{n}" if path else n for k, n in names.items()}
            missing = [n for n in parts.values() if n not in params]
            if missing:
                raise ValueError(
                    f"dequantized(params, model): params lack {missing} of {full!r}, a stacked experts weight held "
                    f"quantized ({fmt.name}, expert by expert). Pass every full parameter: step.full_params(state) "
                    "or step.state_dict(state), and the model that step runs."
                )
            stacked[min(parts.values(), key=order.__getitem__)] = (full, fmt, shape, was, parts)
            taken.update(parts.values())
    out: dict[str, torch.Tensor] = {}
    for name, t in params.items():
        if name in firsts:
            path = firsts[name]
            held = layers[path]
            prefix = f"{path}." if path else ""
            out[f"{prefix}weight"] = _decode_full(params, prefix, held, dtype)
        elif name in stacked:
            full, fmt, shape, was, parts = stacked[name]
            want = fmt.parts(shape.numel(), was)
            pieces = {}
            for k, n in parts.items():
                p = params[n].detach()
                pieces[k] = p.to(want[k][1]) if p.is_floating_point() and want[k][1].is_floating_point else p
            out[full] = decode_stacked(fmt, pieces, shape, dtype or was)
        elif name not in taken:
            out[name] = t
    return out


def _decode_full(params: dict, prefix: str, held: Quantized, dtype: torch.dtype | None) -> torch.Tensor:
    """One layer's weight from its full parts, each read in the dtype the codec holds it in (``master=True``
    gives the float parts in fp32: cast back, exactly, as they were rounded from it)."""
    want = held.codec.parts(held.shape.numel(), held.dtype)
    parts = {}
    for k, (_, dt) in want.items():
        t = params[f"{prefix}weight_{k}"]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"dequantized(params, model): {prefix}weight_{k} is a {type(t).__name__}, not a tensor")
        parts[k] = t.detach().to(dt) if t.is_floating_point() and dt.is_floating_point else t.detach()
    with torch.no_grad():
        return held.codec.decode(parts, held.shape, dtype or held.dtype)


def _prepare(options: QuantizeOptions, split: ParamSplit, functional: Functional | None, where: str) -> ParamSplit:
    if functional is None:
        raise ValueError(
            f"{where}: quantize holds the model's frozen Linear weights quantized and runs those layers on them, so it "
            "needs the params of zf.functional(model): step.init(apply.params), apply = zf.functional(model)"
        )
    module = functional.module
    targets = _targets(options.policy, module, functional, split, where)
    fmt = codec(options.kind, options.block_size)
    named: dict[str, torch.Tensor] = {}
    for name, t in split.named.items():
        if name not in targets:
            named[name] = t
            continue
        path = targets[name]
        layer = module.get_submodule(path)
        if t.device.type == "meta":  # built on meta: shard_params' init computes the parts from the weight's init
            parts = {k: torch.empty(n, dtype=dt, device="meta") for k, (n, dt) in fmt.parts(t.numel(), t.dtype).items()}
        else:
            with torch.no_grad():
                parts = fmt.encode(t.detach())
        compute = options.compute_dtype or t.dtype
        _hold_quantized(layer, parts, Quantized(fmt, t.shape, t.dtype, compute), path, where)
        prefix = f"{path}." if path else ""
        named.update((f"{prefix}weight_{k}", layer._parameters[f"weight_{k}"]) for k in parts)
    # a mixture of experts' frozen stacked expert weights (those of the experts modules the policy picks)
    picked = {p: m for p, m in experts_modules(module).items() if options.policy is None or options.policy(p, m)}
    if picked:
        named = quantize_experts(module, named, fmt, options.compute_dtype, where, picked)
    functional.refresh()
    out = split_params(named, where)
    return out._replace(trainable={k: out.named[k] for k in split.trainable})


def _targets(policy: Any, module: nn.Module, functional: Functional, split: ParamSplit, where: str) -> dict[str, str]:
    """weight name -> its module's path, for every weight held quantized."""
    tied = set(functional.tied) | set(functional.tied.values())
    head = _output_head(module)
    experts = experts_modules(module)
    out: dict[str, str] = {}
    for path, m in module.named_modules():
        if isinstance(m, _QuantizedLinear):
            continue
        if policy is None:
            picked = isinstance(m, nn.Linear) and m is not head and not path.endswith("lm_head")
        else:
            picked = bool(policy(path, m))
        if not picked:
            continue
        name = f"{path}.weight" if path else "weight"
        if path in experts:  # stacked experts: held quantized expert by expert (_experts)
            continue
        w = m._parameters.get("weight") if isinstance(m, nn.Linear) else None
        if policy is None and (w is None or w.requires_grad or name in tied or name not in split.named):
            continue
        if not isinstance(m, nn.Linear) or not (type(m).forward is nn.Linear.forward or hasattr(m, "zf_around")):
            raise ValueError(
                f"{where}: quantize's policy picked {path or '<root>'!r}, a {type(m).__name__}; only nn.Linear layers "
                "(whose forward is Linear's, or a layer tensor_parallel split) can be held quantized. Leave it out of "
                "the policy."
            )
        if w is None or name not in split.named:
            raise ValueError(f"{where}: quantize's policy picked {path!r}, whose weight is not among the params")
        if w.requires_grad:
            raise ValueError(
                f"{where}: quantize's policy picked {path!r}, whose weight is trainable (requires_grad=True); only "
                "frozen weights are held quantized (no gradient, no optimizer state). Freeze it "
                "(weight.requires_grad_(False)) or leave it out of the policy."
            )
        if name in tied:
            raise ValueError(
                f"{where}: quantize's policy picked {path!r}, whose weight is tied to another module's (read there "
                "unquantized too). Leave it out of the policy."
            )
        t = split.named[name]
        if t.dim() < 2 or not t.is_floating_point() or t.numel() == 0:
            if policy is None:
                continue
            raise ValueError(
                f"{where}: quantize's policy picked {path!r}, whose weight ({list(t.shape)}, {t.dtype}) is not a "
                "non-empty floating-point matrix. Leave it out of the policy."
            )
        out[name] = path
    return out


def _output_head(module: nn.Module) -> nn.Module | None:
    """A Hugging Face model's output embeddings (its head), which the default policy leaves as it is."""
    get = getattr(module, "get_output_embeddings", None)
    if callable(get):
        try:
            return get()
        except (AttributeError, NotImplementedError):
            return None
    return None


_CLASSES: dict[type, type] = {}


def _hold_quantized(layer: nn.Linear, parts: dict, held: Quantized, path: str, where: str) -> None:
    """Make ``layer`` hold ``parts`` in place of its weight and compute with them (its class becomes a
    subclass of its own whose forward dequantizes; the object, and so its place in the model, stays)."""
    for k in parts:
        if f"weight_{k}" in layer._parameters or hasattr(layer, f"weight_{k}"):
            raise ValueError(f"{where}: quantize: {path!r} already has an attribute weight_{k}")
    weight = layer._parameters.pop("weight")
    if weight.device.type == "meta":
        layer.__dict__["_zf_source"] = weight  # what zf_materialise initialises the parts from
    for k, t in parts.items():
        layer.register_parameter(f"weight_{k}", nn.Parameter(t, requires_grad=False))
    cls = type(layer)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Quantized{cls.__name__}", (_QuantizedLinear, cls), {"__module__": __name__})
    layer.__class__ = _CLASSES[cls]
    layer._zf_quantized = held


class _QuantizedLinear(nn.Linear):
    """The class a quantized layer takes on (see :func:`_hold_quantized`): it computes with its weight
    dequantized just for the call."""

    _zf_quantized: Quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        held = self._zf_quantized
        names = tuple(held.codec.parts(held.shape.numel(), held.dtype))
        parts = [self._parameters[f"weight_{k}"] for k in names]
        around = getattr(super(), "zf_around", None)  # a layer split over ranks: its communication around
        if around is not None:
            return around(x, lambda x, b: QuantizedLinearFn.apply(x, b, held, names, *parts))
        return QuantizedLinearFn.apply(x, self.bias, held, names, *parts)

    def zf_materialise(self, path: str, values: Callable[[], dict]) -> dict[str, torch.Tensor]:
        """The initial values of this layer's meta parameters (its parts, from its weight's initial value;
        its bias) by name; ``values()`` gives those of the layer's own parameters as a plain Linear (by
        ``init_fn``, or its model's initialisation), which it is for the while (shard_params' sharded init,
        one layer at a time)."""
        held, source = self._zf_quantized, self.__dict__.get("_zf_source")
        if source is None:
            raise ValueError(f"quantize: {path!r} holds its weight quantized from real values; nothing to initialise")
        names = list(held.codec.parts(held.shape.numel(), held.dtype))
        parts = {k: self._parameters.pop(f"weight_{k}") for k in names}
        self._parameters["weight"] = source
        cls = type(self)
        self.__class__ = cls.__bases__[1]  # the layer's own class (Quantized<cls> is (_QuantizedLinear, cls))
        try:
            got = values()
        finally:
            self.__class__ = cls
            del self._parameters["weight"]
            for k in names:
                self._parameters[f"weight_{k}"] = parts[k]
        prefix = f"{path}." if path else ""
        w = got.pop(f"{prefix}weight")
        with torch.no_grad():
            encoded = held.codec.encode(w.to(held.dtype))
        got.update((f"{prefix}weight_{k}", v) for k, v in encoded.items())
        return got

    def __getattr__(self, name: str) -> Any:
        if name == "weight" and "weight" not in self._parameters:
            raise AttributeError(
                f"this {type(self).__name__[len('Quantized') :]} holds its weight quantized "
                f"({self._zf_quantized.codec.name}, zerofn.transforms.quantize): it exists only while the layer "
                "runs. Read the full weights with step.full_params(state) and dequantize them with "
                "zerofn.transforms.quantize.dequantized(...)."
            )
        return super().__getattr__(name)


class QuantizedLinearFn(torch.autograd.Function):
    """``F.linear`` with a weight given by its quantized parts: dequantized in forward, used and freed;
    dequantized again in backward for the input's gradient (only the parts are saved)."""

    @staticmethod
    def forward(ctx, x, bias, held: Quantized, names: tuple, *parts):
        w = _dequantize(held, names, parts)
        ctx.save_for_backward(*parts)
        ctx.held, ctx.names, ctx.bias_grad = held, names, bias is not None and bias.requires_grad
        if not torch.is_autocast_enabled(x.device.type):  # else autocast casts both, as for any Linear
            w = w.to(x.dtype)
        return F.linear(x, w, bias)

    @staticmethod
    def backward(ctx, grad):
        w = _dequantize(ctx.held, ctx.names, ctx.saved_tensors)
        gx = grad.matmul(w.to(grad.dtype)) if ctx.needs_input_grad[0] else None
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
        return (gx, gb, None, None, *([None] * len(ctx.names)))


def _dequantize(held: Quantized, names: tuple, parts) -> torch.Tensor:
    return held.codec.decode(dict(zip(names, parts)), held.shape, held.dtype).to(held.compute_dtype)
