"""The split layers: a planned layer becomes its rank's slices, its class one that communicates.

:func:`split_layer` cuts a layer's weight (and bias) to this rank's slice (:func:`rule` says how,
:func:`slice_param` cuts) and gives the layer a class of its kind on top of its own (made once per layer
class and kind), which keeps its place and names in the model:

- :class:`ColumnLinear` (and GPT-2's :class:`ColumnConv1D`): a slice of the output features, the input
  copied into the region; :class:`RowLinear` (:class:`RowConv1D`): a slice of the input features, the
  output summed over the ranks, then the bias;
- :class:`VocabEmbedding`: a slice of the vocabulary's rows, the lookups summed; :class:`VocabHead`: a
  column-wise head over the vocabulary whose training logits are a ``DTensor`` on the tensor-parallel axis
  of the mesh's ``DeviceMesh``;
- a LoRA layer's adapters: :class:`InsideLinear` (B after a split A) and :class:`SummedLinear` (A whole).

A layer built on the meta device keeps what its slices are cut from (:meth:`Split.zf_materialise`, which
``shard_params``' sharded init calls). :func:`sum_gradients` makes a module left whole (a norm run on each
rank's part of the work) sum its gradients over the group. The communication is
``_autograd``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from zerofn.transforms.tensor_parallel._autograd import Reduce, SumGrad, copy_in, gather_last, leave
from zerofn.transforms.tensor_parallel._plan import (
    COLUMNS,
    COLWISE,
    COLWISE_QKV,
    EMBEDDING,
    HEAD,
    INSIDE,
    ROWWISE,
    SUMMED,
    is_conv1d,
)

from zerofn.mesh import Mesh
from zerofn.sharding import Shard, cut

_CLASSES: dict[tuple[type, str], type] = {}  # (a layer's class, its kind) -> the split class made for them


def split_layer(
    layer: nn.Linear, how: str, m: Mesh, path: str, named: dict, share: int = 1, replaced: dict | None = None
) -> dict[str, torch.Tensor]:
    """Make ``layer`` hold this rank's slice of its weight (and bias) and compute as ``how`` says;
    ``share`` ranks hold the same slice (a key/value head shared by that many ranks' query heads)."""
    prefix = f"{path}." if path else ""
    out = {}
    n, r = m.size("tp") // share, m.coordinate("tp") // share  # slices, and which one this rank holds
    conv = is_conv1d(layer)
    source = {}
    for pname in ("weight", "bias"):
        p = layer._parameters.get(pname)
        if p is None:
            continue
        if replaced is not None and id(p) in replaced:  # tied to a weight split already: that very slice
            layer._parameters[pname] = replaced[id(p)]
            continue
        held = named.get(prefix + pname, p)
        local = slice_param(held.detach(), how, pname, n, r, conv)
        if held.device.type == "meta":  # built on meta: shard_params' init slices the parameter's init
            source[pname] = p
            local = torch.empty(local.shape, dtype=held.dtype, device="meta")
        else:
            local = local.clone()
        layer._parameters[pname] = nn.Parameter(local, requires_grad=p.requires_grad)
        out[prefix + pname] = layer._parameters[pname]
        if replaced is not None:
            replaced[id(p)] = layer._parameters[pname]
    layer.__dict__["_zf_source"] = source
    layer.__dict__["_zf_whole"] = {
        k: getattr(layer, k)
        for k in ("in_features", "out_features", "num_embeddings", "padding_idx")
        if hasattr(layer, k)
    }
    layer.__dict__["_zf_how"] = how
    layer.__dict__["_zf_slices"] = (n, r, conv)
    # the ranks holding the same key/value head: a sub-split of the tensor-parallel axis (collective, made once)
    layer._zf_replicas = m.subgroup("tp", share) if share > 1 else None
    cls = type(layer)
    key = (cls, how)
    if key not in _CLASSES:
        if conv:
            base = RowConv1D if how == ROWWISE else ColumnConv1D
        else:
            base = {
                COLWISE: ColumnLinear,
                ROWWISE: RowLinear,
                EMBEDDING: VocabEmbedding,
                HEAD: VocabHead,
                INSIDE: InsideLinear,
                SUMMED: SummedLinear,
            }[how]
        _CLASSES[key] = type(f"{base.__name__}{cls.__name__}", (base, cls), {"__module__": __name__})
    layer.__class__ = _CLASSES[key]
    layer._zf_group, layer._zf_mesh = m.group("tp"), m
    if conv:
        if how == ROWWISE:
            layer.nx //= n
        else:
            layer.nf //= n
    elif how == SUMMED:
        pass
    elif how in COLUMNS:
        layer.out_features //= n  # n: the slices (fewer than the ranks when they share key/value heads)
    elif how == ROWWISE:
        layer.in_features //= n
    else:
        rows = layer.num_embeddings // n
        layer._zf_rows = (r * rows, (r + 1) * rows)
        pad = layer.padding_idx
        layer.padding_idx = pad - r * rows if pad is not None and r * rows <= pad < (r + 1) * rows else None
        layer.num_embeddings = rows
    return out


def rule(how: str, pname: str, conv: bool) -> tuple[int, int] | None:
    """How a split layer's parameter ``pname`` is cut: (dimension, chunks cut alike), or None (whole);
    ``conv``: a Conv1D, whose weight is ``(in, out)``."""
    if how == SUMMED or (how == ROWWISE and pname == "bias"):
        return None  # whole on every rank (a row-wise layer's bias is added after the all-reduce)
    if how == ROWWISE:
        return (0 if conv else 1), 1
    dim = 1 if conv and pname == "weight" else 0  # output features, or the vocabulary's rows
    return dim, (3 if how == COLWISE_QKV else 1)  # a fused q/k/v: each third split alike, side by side again


def placement(how: str, pname: str, conv: bool = False, share: int = 1) -> Shard | None:
    """A split layer's parameter ``pname``'s placement on the ``tp`` axis, as :func:`rule` cuts it: ``Shard(dim)``
    (a fused q/k/v: ``parts=3``; a key/value head ``share`` consecutive ranks hold: ``share``), or None (whole
    on every rank)."""
    how_cut = rule(how, pname, conv)
    return None if how_cut is None else Shard(*how_cut, share)


def slice_param(t: torch.Tensor, how: str, pname: str, n: int, r: int, conv: bool = False) -> torch.Tensor:
    """Rank ``r``'s slice (of ``n``) of a split layer's parameter ``pname``, as :func:`rule` says."""
    how_cut = rule(how, pname, conv)
    return t if how_cut is None else cut(t, (Shard(*how_cut),), (n,), (r,))


def sum_gradients(sub: nn.Module, group: Any) -> None:
    """Make ``sub`` (a module left whole) sum its parameters' gradients over ``group`` (:class:`_SumsGradients`)."""
    cls = type(sub)
    if not issubclass(cls, _SumsGradients):
        key = (cls, "seq")
        if key not in _CLASSES:
            _CLASSES[key] = type(f"SummedGradients{cls.__name__}", (_SumsGradients, cls), {"__module__": __name__})
        sub.__class__ = _CLASSES[key]
    sub._zf_group = group


def _seq(layer: Any) -> bool:
    """Whether the sequence is split around ``layer`` now: with sequence parallelism, in training (a
    forward without gradients, ``step.apply`` and generation, runs with the whole sequence: the same math)."""
    return layer._zf_seq and torch.is_grad_enabled()


class Split:
    """What a split layer's class adds: its slices' initial values when it was built on the meta device."""

    _zf_seq = False  # sequence parallelism: the residual stream around this layer is split over the sequence

    def zf_materialise(self, path: str, values: Callable[[], dict]) -> dict[str, torch.Tensor]:
        """This layer's slices' initial values by name: ``values()`` gives its whole parameters' (by
        ``init_fn`` or its model's initialisation), which it is for the while (shard_params' sharded init,
        one layer at a time), then each is sliced."""
        d = self.__dict__
        source, whole, how = d["_zf_source"], d["_zf_whole"], d["_zf_how"]
        held = {k: self._parameters[k] for k in source}
        split = {k: getattr(self, k) for k in whole}
        cls = type(self)
        self._parameters.update(source)
        for k, v in whole.items():
            setattr(self, k, v)
        self.__class__ = cls.__bases__[1]  # the layer's own class (the split class is (Kind, cls))
        try:
            got = values()
        finally:
            self.__class__ = cls
            self._parameters.update(held)
            for k, v in split.items():
                setattr(self, k, v)
        prefix = f"{path}." if path else ""
        n, r, conv = d["_zf_slices"]
        for k in source:
            got[prefix + k] = slice_param(got[prefix + k], how, k, n, r, conv)
        return got


class SplitLinear(Split, nn.Linear):
    _zf_group: Any


class ColumnLinear(SplitLinear):
    """A Linear holding a slice of its output features: input copied in (gradient all-reduced)."""

    _zf_replicas: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self._zf_replicas is not None:  # a key/value head several ranks hold: their gradients summed
            w = SumGrad.apply(w, self._zf_replicas)
        return self.zf_around(x, lambda x, b: F.linear(x, w, b))

    def zf_around(self, x: torch.Tensor, linear: Callable) -> torch.Tensor:
        """The layer's communication around ``linear(x, bias)``, its local matmul (another transform may
        compute it otherwise: ``quantize`` with its dequantized weight)."""
        b = self.bias
        if b is not None and self._zf_replicas is not None:
            b = SumGrad.apply(b, self._zf_replicas)
        if not _seq(self):  # under sequence parallelism the region's module (or the final norm, for the
            x = copy_in(x, self._zf_group)  # head) gathered the input already
        return linear(x, b)


class ColumnConv1D(Split, nn.Module):
    """transformers' Conv1D holding a slice of its output features (the columns of its ``(in, out)``
    weight): input copied in (gradient all-reduced)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _seq(self):  # under sequence parallelism the region's module gathered its input already
            x = copy_in(x, self._zf_group)
        y = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return y.view(*x.shape[:-1], self.nf)


class RowConv1D(Split, nn.Module):
    """transformers' Conv1D holding a slice of its input features (the rows of its weight): output summed
    over the ranks, then the bias."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = _seq(self)
        y = leave(x @ self.weight, self._zf_group, seq)
        return y + (SumGrad.apply(self.bias, self._zf_group) if seq else self.bias)


class InsideLinear(SplitLinear):
    """A Linear holding a slice of its output features whose input is already inside the region (a LoRA
    B after its A, whose output every rank computes whole)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class SummedLinear(SplitLinear):
    """A Linear every rank holds whole, inside a region (a LoRA A beside a column-wise base): its input
    copied in, its gradients summed over the ranks (each rank's slice of what follows adds its part)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = None if self.bias is None else SumGrad.apply(self.bias, self._zf_group)
        return F.linear(copy_in(x, self._zf_group), SumGrad.apply(self.weight, self._zf_group), b)


class RowLinear(SplitLinear):
    """A Linear holding a slice of its input features: output summed over the ranks, then the bias
    (with sequence parallelism: reduce-scattered over the sequence, and the bias's gradient summed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.zf_around(x, lambda x, b: F.linear(x, self.weight, b))

    def zf_around(self, x: torch.Tensor, linear: Callable) -> torch.Tensor:
        """The layer's communication around ``linear(x, None)``, its local matmul, then the bias."""
        seq = _seq(self)
        y = leave(linear(x, None), self._zf_group, seq)
        if self.bias is None:
            return y
        return y + (SumGrad.apply(self.bias, self._zf_group) if seq else self.bias)


class VocabEmbedding(Split, nn.Embedding):
    """An Embedding holding a slice of the vocabulary's rows: ids outside it look up zeros, and the ranks'
    lookups are summed (each id's row comes from the one rank that holds it)."""

    _zf_rows: tuple[int, int]
    _zf_group: Any

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        lo, hi = self._zf_rows
        outside = (ids < lo) | (ids >= hi)
        local = (ids - lo).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        return Reduce.apply(out, self._zf_group)


class VocabHead(ColumnLinear):
    """A column-wise output head over the vocabulary. In training its logits stay split: a ``DTensor``
    sharded on the last dimension, whose ``F.cross_entropy`` (under torch's ``loss_parallel``, which the
    step enters around forward and backward) is computed without gathering them; without gradients (a
    step's ``apply``, generation) the logits are gathered whole."""

    _zf_mesh: Mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        from torch.distributed.tensor import DTensor, Shard

        m = self._zf_mesh
        if m.size("tp") == 1:  # the whole vocabulary here: plain logits (and no group to mesh over)
            return local
        if not torch.is_grad_enabled():  # the logits whole, through zerofn's collectives (counted, timed)
            return gather_last(local, self._zf_group)
        if m.device_type != local.device.type:
            m = m.on(local.device.type)  # the same groups, its DeviceMesh on the logits' device
        return DTensor.from_local(local, m.device_submesh("tp"), [Shard(-1)])


class _SumsGradients:
    """A replicated module each rank runs on its own part of the work (a norm between the regions on its
    slice of the sequence; Qwen3's q_norm on its heads): each of its parameters is read through an identity
    whose backward sums the gradient over the tensor-parallel group."""

    _zf_group: Any

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = {n: p for n, p in self._parameters.items() if p is not None and p.requires_grad}
        if not own or not torch.is_grad_enabled():
            return super().__call__(*args, **kwargs)
        for n, p in own.items():
            self._parameters[n] = SumGrad.apply(p, self._zf_group)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._parameters.update(own)
