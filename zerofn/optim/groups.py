"""Per-parameter choices, with optax's names: :func:`masked`, :func:`multi_transform`, and the common weight
decay rules (:func:`decay_mask`).

A mask or labels is a tree over the parameters (keyed as in ``apply.params``) or a function of the params
tree returning one; the function gets meta tensors of each parameter's full shape and dtype, so it works
the same whether this rank holds a parameter whole, a shard of it, or none of it. A step reads the labels
once at ``init`` and keeps parameters of different labels in different buckets, so each transform still
runs fused over whole buckets; the labels then resolve to sets of buckets (see ``zerofn.optim.view``).

Example (nanoGPT's two groups):
    >>> import torch
    >>> from zerofn import optim
    >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
    >>> opt = optim.adamw(0.1, weight_decay=0.5, mask=optim.decay_mask())
    >>> grads = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    >>> state = optim.update_params(opt, grads, opt.init(params), params)
    >>> round(params["w"][0, 0].item(), 6), params["b"][0].item()  # the matrix decays, the bias does not
    (0.95, 1.0)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Mapping
from typing import Any, NamedTuple

import torch

from zerofn import tree as T
from zerofn.optim.base import GradientTransformation, Updates, apply_updates, bind, labels, update_params
from zerofn.optim.view import ParamView
from zerofn.roles import Inner

__all__ = ["MaskedState", "MultiTransformState", "decay_mask", "masked", "multi_transform"]


class MaskedState(NamedTuple):
    """The state of :func:`masked`: the inner transform's, over the masked parameters only."""

    inner_state: Any


class MultiTransformState(NamedTuple):
    """The state of :func:`multi_transform`: label -> that label's transform's state, over its parameters.

    A checkpoint saves each label's parameter-shaped leaves under the path they would have without the
    labels, so that a checkpoint saved with one grouping loads under another when the transforms agree
    (one AdamW, or AdamW with and without decay); the labels' counts are saved per label.
    """

    inner_states: dict

    def state_parts(self) -> tuple:
        return tuple(Inner(s, scope=str(label)) for label, s in self.inner_states.items())


def _view_of(tree: Any, view: ParamView | None) -> ParamView:
    return view if view is not None else ParamView.of_tree(tree)


def _sub(tree: Mapping, keys) -> dict:
    return {k: tree[k] for k in keys if k in tree}


def _check_keys(tree: Any, where: str) -> Mapping:
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{where}: expected the updates as a dict keyed by parameter (or by bucket, under a step), got "
            f"{type(tree).__name__}. Pass a flat dict such as apply.params."
        )
    return tree


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """``inner`` applied to the parameters where ``mask`` is True; the others' updates pass through unchanged.

    optax's ``masked``: ``inner`` holds state for the masked parameters only.

    Args:
        inner: the transformation to apply where the mask is True.
        mask: a tree of bools over the parameters (the params tree's structure), or a function of the params
            tree returning one (see :func:`decay_mask`).

    Returns:
        A ``GradientTransformation`` with ``MaskedState(inner_state)``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.masked(optim.scale(-1.0), {"w": True, "b": False})
        >>> p = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> u, _ = opt.update({"w": torch.ones(1), "b": torch.ones(1)}, opt.init(p), p)
        >>> u["w"].item(), u["b"].item()
        (-1.0, 1.0)
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"masked: inner must be a GradientTransformation, got {type(inner).__name__}")
    if not (callable(mask) or isinstance(mask, (Mapping, list, tuple)) or T.tree_leaves(mask)):
        raise TypeError(f"masked: mask must be a tree of bools over the parameters or a function of them, got {mask!r}")
    return _masked(inner, mask, None)


def _mask_of(mask: Any, view: ParamView, where: str) -> dict[str, bool]:
    values = view.resolve(mask, "the mask", where, fill=False)  # a frozen parameter's entry is never read
    bad = {n: v for n, v in values.items() if not isinstance(v, (bool, torch.Tensor)) and v not in (0, 1)}
    if bad:
        name, v = next(iter(bad.items()))
        raise TypeError(f"{where}: the mask must hold bools; at {name!r} it holds {type(v).__name__} {v!r}")
    return {n: bool(v) for n, v in values.items()}


def masked_keys(mask: Any, view: ParamView, where: str) -> list[str]:
    """The keys of ``view`` whose parameters ``mask`` selects (each key's parameters agree: a step keeps
    parameters of different masks in different buckets)."""
    on = view.keys_where(_mask_of(mask, view, where), where, "masks")
    return [k for k, m in on.items() if m]


def _masked(inner: GradientTransformation, mask: Any, view: ParamView | None) -> GradientTransformation:
    where = "masked"

    def selected(tree: Any) -> tuple[ParamView, list[str]]:
        v = _view_of(tree, view)
        return v, masked_keys(mask, v, where)

    def bind_for(tree: Any) -> tuple[GradientTransformation, list[str]]:
        v, keys = selected(tree)
        return bind(inner, v.select(keys)), keys

    once = bind_for(None) if view is not None else None  # bound: resolved once, not on every update

    def bound(tree: Any) -> tuple[GradientTransformation, list[str]]:
        return once if once is not None else bind_for(tree)

    def init(params):
        opt, keys = bound(_check_keys(params, f"{where}.init"))
        return MaskedState(opt.init(_sub(params, keys)))

    def update(updates, state, params=None, **extra):
        updates = _check_keys(updates, f"{where}.update")
        opt, keys = bound(updates)
        sub, new = opt.update(
            _sub(updates, keys), state.inner_state, None if params is None else _sub(params, keys), **extra
        )
        return {**updates, **sub}, MaskedState(new)

    def update_in_place(grads, state, params, **extra):
        grads = _check_keys(grads, f"{where}.update")
        opt, keys = bound(grads)
        new = update_params(opt, _sub(grads, keys), state.inner_state, _sub(params, keys), **extra)
        rest = [k for k in grads if k not in set(keys)]
        found = extra.get("found_inf")
        if found is not None:  # the gradients of the parameters outside the mask are their updates: dropped
            for k in rest:
                grads[k].masked_fill_(found != 0, 0.0)
        apply_updates(_sub(params, rest), _sub(grads, rest))
        return MaskedState(new)

    def partition(v: ParamView) -> dict:
        on = _mask_of(mask, v, where)
        inner_labels = labels(inner, v) or {}
        return {n: (on[n], inner_labels.get(n)) for n in v.names}

    talks = once[0].communicates if once is not None else inner.communicates
    return GradientTransformation(
        init,
        update,
        update_in_place,
        bind=lambda v: _masked(inner, mask, v),
        partition=partition,
        communicates=talks,
        masks=inner.masks,
    )


def multi_transform(transforms: Mapping[Hashable, GradientTransformation], param_labels: Any) -> GradientTransformation:
    """A transformation per label: each parameter gets the one its label names (optax's ``multi_transform``).

    Each label's transform sees only its parameters: its own state, learning rate and schedule. Torch's
    ``param_groups`` written as labels::

        opt = zf.optim.multi_transform(
            {"decay": zf.optim.adamw(3e-4, weight_decay=0.1), "no_decay": zf.optim.adamw(3e-4, weight_decay=0.0)},
            lambda params: {n: "decay" if p.ndim >= 2 else "no_decay" for n, p in params.items()},
        )

    Args:
        transforms: label -> ``GradientTransformation``.
        param_labels: a tree of labels over the parameters (the params tree's structure), or a function of
            the params tree returning one. Every label must be a key of ``transforms``.

    Returns:
        A ``GradientTransformation`` with ``MultiTransformState(inner_states)``.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> opt = optim.multi_transform({"a": optim.sgd(1.0), "b": optim.sgd(0.5)}, {"w": "a", "v": "b"})
        >>> p = {"w": torch.zeros(1), "v": torch.zeros(1)}
        >>> u, _ = opt.update({"w": torch.ones(1), "v": torch.ones(1)}, opt.init(p), p)
        >>> u["w"].item(), u["v"].item()
        (-1.0, -0.5)
    """
    if not isinstance(transforms, Mapping) or not transforms:
        raise TypeError(
            f"multi_transform: transforms must be a non-empty dict label -> transformation, got {transforms!r}"
        )
    for label, t in transforms.items():
        if not isinstance(t, GradientTransformation):
            raise TypeError(
                f"multi_transform: transforms[{label!r}] is a {type(t).__name__}, not a GradientTransformation; "
                "pass transforms such as zf.optim.adamw(3e-4)"
            )
    return _multi(dict(transforms), param_labels, None)


def _labels_of(transforms: dict, param_labels: Any, view: ParamView, where: str) -> dict[str, Hashable]:
    values = view.resolve(param_labels, "the labels", where)  # a frozen parameter's label is never read
    unknown = sorted({repr(values[n]) for n in view.trainable_names if values[n] not in transforms})
    if unknown:
        raise ValueError(
            f"{where}: labels {unknown} name no transform; the transforms are for {sorted(map(repr, transforms))}. "
            "Give every trainable parameter one of those labels (a frozen one's may be left out: it is not used)."
        )
    return values


def _multi(transforms: dict, param_labels: Any, view: ParamView | None) -> GradientTransformation:
    where = "multi_transform"

    def split(tree: Any) -> dict[Hashable, tuple[GradientTransformation, list[str]]]:
        if once is not None:
            return once
        return split_for(tree)

    def split_for(tree: Any) -> dict[Hashable, tuple[GradientTransformation, list[str]]]:
        v = _view_of(tree, view)
        of_key = v.keys_where(_labels_of(transforms, param_labels, v, where), where, "labels")
        out = {}
        for label, t in transforms.items():
            keys = [k for k, lab in of_key.items() if lab == label]
            out[label] = (bind(t, v.select(keys)), keys)
        return out

    once = None
    once = split_for(None) if view is not None else None  # bound: resolved once, not on every update

    def init(params):
        parts = split(_check_keys(params, f"{where}.init"))
        return MultiTransformState({label: t.init(_sub(params, keys)) for label, (t, keys) in parts.items()})

    def update(updates: Updates, state, params=None, **extra):
        updates = _check_keys(updates, f"{where}.update")
        out, new = dict(updates), {}
        for label, (t, keys) in split(updates).items():
            p = None if params is None else _sub(params, keys)
            sub, new[label] = t.update(_sub(updates, keys), state.inner_states[label], p, **extra)
            out.update(sub)
        return out, MultiTransformState(new)

    def update_in_place(grads, state, params, **extra):
        grads = _check_keys(grads, f"{where}.update")
        new = {}
        for label, (t, keys) in split(grads).items():
            new[label] = update_params(t, _sub(grads, keys), state.inner_states[label], _sub(params, keys), **extra)
        return MultiTransformState(new)

    def partition(v: ParamView) -> dict:
        of = _labels_of(transforms, param_labels, v, where)
        inner = {label: labels(t, v) or {} for label, t in transforms.items()}
        return {n: (of[n], inner[of[n]].get(n) if of[n] in inner else None) for n in v.names}

    members = [t for t, _ in once.values()] if once is not None else list(transforms.values())
    return GradientTransformation(
        init,
        update,
        update_in_place,
        bind=lambda v: _multi(transforms, param_labels, v),
        partition=partition,
        communicates=any(t.communicates for t in members),
        masks=all(t.masks for t in transforms.values()),
    )


# ---------------------------------------------------------------- the common weight decay rules


def decay_mask(rule: str = "nanogpt", model: torch.nn.Module | None = None) -> Callable[[Any], Any]:
    """Which parameters get weight decay, as a recipe decides it: a mask function for ``masked`` or ``mask=``.

    Rules:
        - ``"nanogpt"``: tensors of two or more dimensions decay (matrices and embeddings), the rest
          (biases, norm weights) do not: nanoGPT's ``configure_optimizers``.
        - ``"huggingface"``: every parameter decays except biases and the weights of normalisation layers:
          the Hugging Face ``Trainer``'s ``get_decay_parameter_names`` (layers of a ``LayerNorm``-like type,
          or whose names say ``norm``; names containing ``bias``). Needs ``model``.
        - ``"mingpt"``: only the weights of ``Linear`` layers decay (not embeddings, norms or biases):
          minGPT's ``configure_optimizers``. Needs ``model``.

    Args:
        rule: one of the above.
        model: the ``nn.Module`` whose parameters the mask is for (the rules that read layer types).

    Returns:
        A function of the params tree returning a tree of bools.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> params = dict(model.named_parameters())
        >>> optim.decay_mask("huggingface", model)(params)
        {'0.weight': True, '0.bias': False, '1.weight': False, '1.bias': False}
    """
    rules = ("nanogpt", "huggingface", "mingpt")
    if rule not in rules:
        raise ValueError(f"decay_mask: rule must be one of {rules}, got {rule!r}")
    if rule == "nanogpt":
        return lambda params: T.tree_map(lambda p: p.ndim >= 2, params)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"decay_mask({rule!r}) reads layer types, so it needs the model: decay_mask({rule!r}, model); "
            f"got {type(model).__name__}. decay_mask('nanogpt') needs none."
        )
    decays = _decaying_names(model, rule)

    def mask(params: Any) -> Any:
        paths, leaves, treedef = T.tree_flatten_with_path(params)
        return T.tree_unflatten(treedef, [T.keystr(p) in decays for p in paths])

    return mask


def _decaying_names(model: torch.nn.Module, rule: str) -> set[str]:
    """The names (as ``named_parameters`` gives them, tied ones under each name) of the parameters that decay."""
    out = set()
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, _ in module.named_parameters(prefix=mname, recurse=False, remove_duplicate=False):
            if rule == "mingpt":
                if isinstance(module, torch.nn.Linear) and pname.rsplit(".", 1)[-1] == "weight":
                    out.add(pname)
                continue
            # Hugging Face: not inside a LayerNorm (below the root), no forbidden pattern in the name
            inside_norm = any(isinstance(m, torch.nn.LayerNorm) for m in _ancestors(model, mname))
            if not inside_norm and not any(p.search(pname.lower()) for p in _HF_FORBIDDEN):
                out.add(pname)
    return out


# The Hugging Face Trainer's forbidden name patterns (get_decay_parameter_names, transformers 4.5x-5.x).
_HF_FORBIDDEN = tuple(
    re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")
)


def _ancestors(model: torch.nn.Module, mname: str) -> list[torch.nn.Module]:
    """The modules on the path from ``model``'s children down to module ``mname`` (the root excluded)."""
    out, node = [], model
    for part in mname.split(".") if mname else ():
        node = getattr(node, part)
        out.append(node)
    return out
