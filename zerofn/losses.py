"""Losses: ``zf.Mean(total, count)`` for a mean over items, and a cross entropy that never holds the logits.

**zf.Mean.** A loss averaged over tokens (a masked-LM, a causal LM with padding, a
supervised fine-tune that masks the prompt) is a mean over a number of
items that differs from rank to rank and from micro-step to micro-step.
Each rank's own mean is then over its own count, and averaging those means
over ranks and micro-steps weights every rank alike, whatever it holds: N
ranks train something else than one process fed the concatenated batch
(the gradient-accumulation error Hugging Face's Trainer fixed with
``num_items_in_batch``).

``loss_fn`` returns ``zf.Mean(total, count)`` instead (alone, or as the
first element of ``(loss, aux)``): ``total`` the sum of the per-item losses
on this rank's micro-batch, ``count`` how many items it summed. The step
runs backward on ``total`` and divides the reduced gradient, once, by the
count summed over every rank and micro-step of the update, which travels in
the step's statistics all-reduce (no round trip before backward). The loss
is then ``sum(total) / sum(count)``, and its gradient exactly that of one
process computing that mean over the concatenated batch.

**chunked_cross_entropy.** A language model's output head turns every token's
hidden state into a row of logits over the vocabulary: ``tokens x V`` floats,
and in float32 (where the cross entropy is computed) 4 bytes each. At a long
sequence that is the largest tensor of the whole step (32k tokens over a
128k vocabulary: 16 GiB, once more for its gradient), larger than the model's
activations. :func:`chunked_cross_entropy` computes the head's matmul and the
cross entropy over chunks of tokens, and in the same pass the gradients of
the hidden states, the head's weight and its bias, so that only one chunk's
logits are ever alive (Liger Kernel's fused linear cross entropy, in plain
torch ops). Backward then only scales the gradients it kept.

Example:
    >>> import torch, torch.nn.functional as F, zerofn as zf
    >>> apply = zf.functional(torch.nn.Linear(4, 3))
    >>> def loss_fn(params, batch):
    ...     logits = apply(params, batch["x"])
    ...     total = F.cross_entropy(logits, batch["y"], ignore_index=-100, reduction="sum")
    ...     return zf.Mean(total, (batch["y"] != -100).sum())
    >>> step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    >>> state = step.init(apply.params)
    >>> batch = {"x": torch.ones(4, 4), "y": torch.tensor([0, 2, -100, -100])}
    >>> state, metrics = step(state, batch)
    >>> float(metrics["count"])
    2.0
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

__all__ = ["Mean", "chunked_cross_entropy"]

MEAN_HELP = (
    "Return zf.Mean(total, count) with total the 0-dim sum of the per-item losses on this rank's micro-batch "
    "(for example F.cross_entropy(logits, labels, ignore_index=-100, reduction='sum')) and count how many items "
    "it summed (for example (labels != -100).sum())."
)


@dataclass(frozen=True)
class Mean:
    """A mean over items: ``total`` (0-dim float tensor, the sum of the per-item losses on this rank's
    micro-batch) over ``count`` (how many items it summed: an int or a 0-dim tensor, 0 allowed).

    The step's loss is the sum of ``total`` over ranks and micro-steps divided by the sum of ``count``
    over them; ``metrics["count"]`` reports that global count. See the module docs.
    """

    total: torch.Tensor
    count: Any

    def __post_init__(self) -> None:
        t = self.total
        if not isinstance(t, torch.Tensor) or t.dim() != 0 or not t.is_floating_point():
            got = f"a tensor of shape {list(t.shape)} and dtype {t.dtype}" if isinstance(t, torch.Tensor) else type(t)
            raise ValueError(f"zf.Mean: total must be a 0-dim floating-point tensor, got {got}. {MEAN_HELP}")
        c = self.count
        ok = (isinstance(c, int) and not isinstance(c, bool)) or (isinstance(c, torch.Tensor) and c.numel() == 1)
        if not ok:
            got = f"a tensor of shape {list(c.shape)}" if isinstance(c, torch.Tensor) else repr(c)
            raise ValueError(f"zf.Mean: count must be an int or a one-element tensor, got {got}. {MEAN_HELP}")

    def counted(self, device: Any = None) -> torch.Tensor:
        """``count`` as a float64 0-dim tensor on ``device``, without a host read (a negative count in a
        tensor is caught in the step's statistics; one given as an int raises here)."""
        if isinstance(self.count, torch.Tensor):
            return self.count.detach().reshape(()).to(device=device, dtype=torch.float64)
        if self.count < 0:
            raise ValueError(f"zf.Mean: count must be >= 0 (how many items total sums), got {self.count}. {MEAN_HELP}")
        return torch.full((), float(self.count), dtype=torch.float64, device=device)

    def __add__(self, other: Any) -> Any:
        raise TypeError(
            "zf.Mean cannot be added to: its normaliser, the count over every rank and micro-step, is known only "
            "after backward. Add a per-item term to total before building the Mean (zf.Mean(total + extra_sum, "
            "count)), or return a plain mean loss instead."
        )

    __radd__ = __add__


# ---------------------------------------------------------------- the cross entropy without the logits

CHUNK_BYTES = 64 << 20  # the default chunk's logits, in their float32 (or wider) dtype
REDUCTIONS = ("mean", "sum", "none")
CAUSAL_HELP = (
    "hidden at position t predicts labels at t (no shift inside): for a causal LM pass hidden[:, :-1] and "
    "labels[:, 1:], or labels already shifted (such as a batch's shift_labels) with the whole hidden."
)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The cross entropy of the output head ``hidden @ weight.T + bias`` against ``labels``, one chunk of
    tokens at a time, never holding the whole ``[tokens, V]`` logits.

    Equal, value and gradients, to ``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels,
    ignore_index=ignore_index, reduction=reduction)`` over the flattened tokens: the logits are computed in
    the matmul's dtype and upcast to float32 (as Hugging Face's ``logits.float()``), the softmax and the loss
    in float32. The head's matmul runs in ``weight``'s dtype (``hidden`` cast to it where they differ, as the
    head's module does under ``amp(..., compute="param")``), or under ``torch.autocast`` in the autocast dtype,
    as ``F.linear`` would.

    The labels are **already aligned** with the hidden states: ``hidden[..., t, :]`` predicts
    ``labels[..., t]``; nothing is shifted inside. For a causal LM, whose hidden state at t predicts the token
    at t + 1, pass ``hidden[:, :-1]`` and ``labels[:, 1:]``; a shifted-label tensor (a batch's
    ``shift_labels``, as sequence-parallel data collators build) is used as is, with the whole ``hidden``.

    With ``reduction="mean"`` or ``"sum"`` the forward computes, chunk by chunk, the loss and (when an input
    requires grad) the gradients with respect to ``hidden`` (into one preallocated tensor of ``hidden``'s
    shape), ``weight`` and ``bias`` (summed in float32, returned in their own dtype); backward only scales
    them by the incoming gradient. Memory: one chunk's logits (plus their bf16 copy when the inputs are
    bf16), the gradients, and a float32 weight-sized sum when ``weight`` is not float32. No gradient work is
    done when no input requires grad or grad is disabled. ``reduction="none"`` returns the per-token losses
    and recomputes each chunk's logits in backward (the forward cannot know each token's incoming gradient),
    keeping only each token's log-sum-exp in between: the head's matmul then runs twice.

    Under ``zf.Mean``, take the sum and count the labels: ``zf.Mean(chunked_cross_entropy(h, w, y,
    reduction="sum"), (y != -100).sum())``.

    Args:
        hidden: ``[..., H]`` floating-point activations the head reads (fp32, bf16, ...).
        weight: The head's ``[V, H]`` weight (``lm_head.weight``).
        labels: ``[...]`` integer class indices, ``hidden``'s shape without its last dim, aligned with it.
        bias: The head's ``[V]`` bias, if it has one.
        ignore_index: Labels equal to it add nothing to the loss, its gradient or the mean's count.
        reduction: ``"mean"`` over the labels that are not ``ignore_index`` (with none of them the loss is
            nan and the gradients zero, as ``F.cross_entropy``'s), ``"sum"``, or ``"none"`` (float32 losses
            of ``labels``' shape, 0 at ignored labels).
        chunk_size: Tokens per chunk. Default: as many as keep one chunk's float32 logits within 64 MiB
            (``max(1, 64 MiB // (4 * V))``: 128 tokens for a 128k vocabulary), whatever the sequence.

    Returns:
        A float32 tensor (float64 for float64 inputs): 0-dim for ``"mean"`` and ``"sum"``, ``labels``' shape
        for ``"none"``.

    Raises:
        ValueError: ``hidden``, ``weight``, ``bias`` or ``labels`` of shapes that do not fit together,
            labels that are not integers, an unknown ``reduction`` or a ``chunk_size`` that is not a positive
            int.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> from zerofn.losses import chunked_cross_entropy
        >>> _ = torch.manual_seed(0)
        >>> hidden, head = torch.randn(2, 6, 8), torch.nn.Linear(8, 11)
        >>> labels = torch.randint(11, (2, 6))
        >>> loss = chunked_cross_entropy(hidden[:, :-1], head.weight, labels[:, 1:], bias=head.bias, chunk_size=3)
        >>> full = F.cross_entropy(head(hidden[:, :-1]).flatten(0, 1).float(), labels[:, 1:].flatten())
        >>> torch.allclose(loss, full)
        True
    """
    relevant = tuple(t for t in (hidden, weight, labels, bias) if isinstance(t, torch.Tensor))
    if torch.overrides.has_torch_function(relevant):
        # a tensor subclass that computes in its own way (shard_params' placeholder of a parameter read outside
        # its unit, which gathers it and computes with a copy whose gradient reaches the parameter) sees this
        # call as one function, as it sees F.linear: the autograd function below gets plain tensors
        return torch.overrides.handle_torch_function(
            chunked_cross_entropy,
            relevant,
            hidden,
            weight,
            labels,
            bias=bias,
            ignore_index=ignore_index,
            reduction=reduction,
            chunk_size=chunk_size,
        )
    tokens, targets, compute = _checked(hidden, weight, labels, bias, reduction, chunk_size)
    wide = torch.promote_types(compute, torch.float32)
    chunk = chunk_size or max(1, CHUNK_BYTES // (weight.shape[0] * wide.itemsize))
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if grads:
        out = _ChunkedCrossEntropy.apply(tokens, weight, bias, targets, ignore_index, reduction, chunk, compute)
    else:
        with _no_autocast(hidden):
            out = _forward(tokens, weight, bias, targets, ignore_index, reduction, chunk, compute, (False,) * 3)[0]
    return out.reshape(labels.shape) if reduction == "none" else out


def _checked(
    hidden: Any, weight: Any, labels: Any, bias: Any, reduction: str, chunk_size: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """The tokens ``[N, H]``, the labels ``[N]`` as int64, and the dtype the head's matmul runs in."""
    where = "chunked_cross_entropy"
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a tensor, got {type(t).__name__}.")
    if not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(
            f"{where}: hidden must be a floating-point tensor [..., H] (the activations the output head reads), "
            f"got shape {list(hidden.shape)} and dtype {hidden.dtype}."
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or not weight.is_floating_point():
        raise ValueError(
            f"{where}: weight must be the output head's [V, H] floating-point weight with H = hidden's last dim "
            f"({hidden.shape[-1]}), got shape {list(weight.shape)} and dtype {weight.dtype}. Pass the head's "
            "weight as stored (lm_head.weight, [vocab, hidden]), not its transpose."
        )
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],)):
        got = list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(f"{where}: bias must be the head's [V] = [{weight.shape[0]}] bias or None, got {got}.")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(
            f"{where}: labels must be integer class indices (torch.long), got dtype {labels.dtype}. "
            "Pass labels.long() if they hold class indices; probabilities over the vocabulary are not supported."
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"{where}: labels of shape {list(labels.shape)} do not match hidden's leading dims "
            f"{list(hidden.shape[:-1])} (hidden {list(hidden.shape)}); expected labels of shape "
            f"{list(hidden.shape[:-1])}. {CAUSAL_HELP}"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"{where}: reduction must be one of {REDUCTIONS}, got {reduction!r}.")
    if chunk_size is not None and (not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1):
        raise ValueError(
            f"{where}: chunk_size must be a positive int (tokens per chunk) or None (chunks of at most 64 MiB of "
            f"float32 logits), got {chunk_size!r}."
        )
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        compute = torch.get_autocast_dtype(device)
    else:  # the head's own dtype, as its module runs under a parameter-dtype policy (amp's compute="param")
        compute = weight.dtype
    return hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long(), compute


def _no_autocast(like: torch.Tensor) -> Any:
    """Autocast off: the matmuls run in the dtypes chosen here, the softmax and the sums in float32."""
    return torch.autocast(device_type=like.device.type, enabled=False)


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, wide: torch.dtype) -> torch.Tensor:
    """One chunk's logits, computed in the weight's dtype and upcast (a fresh tensor, safe to overwrite)."""
    out = F.linear(h.to(weight.dtype), weight, bias)
    return out.to(wide) if out.dtype != wide else out


def _into_grad(p: torch.Tensor, targets: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """Turn the probabilities ``p`` in place into the gradient of each row's loss times ``row_scale``:
    ``(softmax - onehot(target)) * row_scale[:, None]``."""
    p[torch.arange(p.shape[0], device=p.device), targets] -= 1
    return p.mul_(row_scale[:, None])


def _add_grads(
    g: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, sums: list, grad_hidden: torch.Tensor | None, lo: int
) -> None:
    """Add one chunk's gradient ``g`` (``[c, V]``, float32) to the hidden states' (rows ``lo:lo + c``), the
    weight's and the bias' (``sums``: their float32 sums, None where not wanted)."""
    if grad_hidden is not None:
        grad_hidden[lo : lo + g.shape[0]] = g.to(weight.dtype) @ weight
    if sums[0] is not None:
        sums[0].addmm_(g.t(), h.to(g.dtype))
    if sums[1] is not None:
        sums[1] += g.sum(0)


def _forward(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
    reduction: str,
    chunk: int,
    compute: torch.dtype,
    want: tuple[bool, bool, bool],
) -> tuple[torch.Tensor, Any, Any]:
    """The loss, chunk by chunk, and with it what backward needs: for ``"mean"`` and ``"sum"`` the wanted
    gradients (hidden, weight, bias), for ``"none"`` each token's log-sum-exp."""
    wide = torch.promote_types(compute, torch.float32)
    n, device = tokens.shape[0], tokens.device
    w = weight.to(compute)
    b = None if bias is None else bias.to(compute)
    valid = targets != ignore_index
    if reduction == "mean":
        count = valid.sum()
        row_scale = torch.where(count > 0, 1.0 / count.to(wide).clamp(min=1), 0.0).to(wide)
    else:
        row_scale = torch.ones((), dtype=wide, device=device)
    grad_hidden = torch.empty_like(tokens) if want[0] else None
    sums = [
        torch.zeros(weight.shape, dtype=wide, device=device) if want[1] else None,
        torch.zeros(weight.shape[0], dtype=wide, device=device) if want[2] else None,
    ]
    losses = torch.zeros(n, dtype=wide, device=device) if reduction == "none" else None
    lse_all = torch.empty(n, dtype=wide, device=device) if reduction == "none" else None
    total = torch.zeros((), dtype=wide, device=device)
    for lo in range(0, n, chunk):
        h, y, ok = tokens[lo : lo + chunk], targets[lo : lo + chunk], valid[lo : lo + chunk]
        safe = torch.where(ok, y, 0)
        p = _logits(h, w, b, wide)
        picked = p.gather(1, safe[:, None]).squeeze(1)
        top = p.amax(1, keepdim=True)
        p.sub_(top).exp_()
        sum_exp = p.sum(1)
        lse = top.squeeze(1) + sum_exp.log()
        loss = torch.where(ok, lse - picked, 0.0)
        if reduction == "none":
            losses[lo : lo + chunk], lse_all[lo : lo + chunk] = loss, lse
        else:
            total += loss.sum()
        if any(want):
            p.div_(sum_exp[:, None])
            _add_grads(_into_grad(p, safe, ok.to(wide) * row_scale), h, w, sums, grad_hidden, lo)
        del p  # before the next chunk's logits: one chunk alive at a time
    if reduction == "none":
        return losses, lse_all, None
    if reduction == "mean":
        total = total / valid.sum()  # 0 / 0 = nan with no label counted, as F.cross_entropy
    return total, grad_hidden, sums


def _backward_none(
    grad_out: torch.Tensor,
    tokens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    lse_all: torch.Tensor,
    ignore_index: int,
    chunk: int,
    compute: torch.dtype,
    want: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, list]:
    """``reduction="none"``'s gradients: each chunk's logits again, scaled by each token's incoming gradient."""
    wide = lse_all.dtype
    w = weight.to(compute)
    b = None if bias is None else bias.to(compute)
    grad_hidden = torch.empty_like(tokens) if want[0] else None
    sums = [
        torch.zeros(weight.shape, dtype=wide, device=tokens.device) if want[1] else None,
        torch.zeros(weight.shape[0], dtype=wide, device=tokens.device) if want[2] else None,
    ]
    valid = targets != ignore_index
    for lo in range(0, tokens.shape[0], chunk):
        h, y, ok = tokens[lo : lo + chunk], targets[lo : lo + chunk], valid[lo : lo + chunk]
        p = _logits(h, w, b, wide).sub_(lse_all[lo : lo + chunk, None]).exp_()
        scale = torch.where(ok, grad_out[lo : lo + chunk].to(wide), 0.0)
        _add_grads(_into_grad(p, torch.where(ok, y, 0), scale), h, w, sums, grad_hidden, lo)
        del p
    return grad_hidden, sums


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``chunked_cross_entropy``'s autograd: the gradients computed in forward, scaled in backward."""

    @staticmethod
    def forward(ctx, tokens, weight, bias, targets, ignore_index, reduction, chunk, compute):
        want = tuple(ctx.needs_input_grad[:3])
        now = want if reduction != "none" else (False,) * 3  # "none": in backward, per token
        ctx.reduction, ctx.want = reduction, want
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        with _no_autocast(tokens):
            out, first, sums = _forward(tokens, weight, bias, targets, ignore_index, reduction, chunk, compute, now)
        if reduction == "none":
            ctx.options = (ignore_index, chunk, compute)
            ctx.save_for_backward(tokens, weight, bias, targets, first)
        else:
            ctx.save_for_backward(first, *sums)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if ctx.reduction == "none":
            tokens, weight, bias, targets, lse_all = ctx.saved_tensors
            with _no_autocast(tokens):
                grad_hidden, sums = _backward_none(
                    grad_out, tokens, weight, bias, targets, lse_all, *ctx.options, ctx.want
                )
            scale = None
        else:
            grad_hidden, *sums = ctx.saved_tensors
            scale = grad_out
            if grad_hidden is not None:
                grad_hidden = grad_hidden * grad_out
        grad_weight, grad_bias = (
            None if s is None else (s if scale is None else s * scale).to(dtype) for s, dtype in zip(sums, ctx.dtypes)
        )
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None
