"""Mixture-of-experts router losses that mean on N ranks what they mean on one process.

A data-parallel step averages the ranks' gradients, which trains the mean
over ranks of each rank's loss on its own micro-batch. For a loss that is a
mean over items (cross-entropy over tokens, equal counts per rank) that is
the loss over the concatenated batch. Mixtral's router load-balancing loss
(Switch Transformer's, Hugging Face's ``load_balancing_loss_func``) is not:
it is ``E * sum_e f_e * P_e``, the product of two batch means per expert (the
fraction ``f_e`` of top-k assignments that go to expert ``e`` and the mean
router probability ``P_e`` it gets), and the mean of products over ranks is
not the product of the means. N ranks then train another model than one
process fed the same tokens.

:func:`load_balancing_loss` computes the one-process term over the ranks'
concatenated micro-batches. ``f`` takes no gradient (it comes from a top-k),
so once it is known the term is linear in the router probabilities: one
all-reduce (sum, no gradient) of the per-expert assignment counts, the
per-expert probability sums and the token count gives the global ``f``, the
global value and the global normaliser, and each rank's gradient flows
through its own probability sums scaled so that the mean over ranks of the
ranks' gradients (what the step computes) is the gradient of the global term.

Example:
    >>> import torch
    >>> from zerofn import moe
    >>> balanced = (10 * torch.eye(4),)      # one layer: 4 tokens, each prefers its own expert
    >>> round(float(moe.load_balancing_loss(balanced, num_experts=4, top_k=1)), 6)
    1.0
    >>> skewed = (10 * torch.eye(4)[[0, 0, 0, 0]],)  # every token prefers expert 0
    >>> round(float(moe.load_balancing_loss(skewed, num_experts=4, top_k=1)), 4)
    3.9995
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from zerofn import collectives as C

__all__ = ["experts_modules", "load_balancing_loss"]

_STACKED = ("gate_up_proj", "up_proj", "down_proj")  # the stacked weights an experts module holds


def experts_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """path -> every experts module of transformers' experts interface in ``module``: a module of a class
    decorated with ``@use_experts_implementation`` (its forward dispatched by ``config._experts_implementation``),
    holding stacked 3-D weights (``gate_up_proj`` or ``up_proj``, ``down_proj``) whose first dim is its
    ``num_experts``, as Mixtral's, Qwen2-MoE's, Qwen3-MoE's, DeepSeek-V3's and GPT-OSS's experts are; one
    whose stacked weights ``quantize`` holds as parts counts too (``_zf_quantized_experts``)."""
    out = {}
    for path, m in module.named_modules():
        forward = getattr(type(m), "forward", None)
        n = getattr(m, "num_experts", None)
        if not (isinstance(n, int) and hasattr(forward, "__wrapped__") and hasattr(m, "config")):
            continue
        stacked = [getattr(m, a, None) for a in _STACKED]
        if "_zf_quantized_experts" in m.__dict__ or any(
            isinstance(p, torch.nn.Parameter) and p.dim() == 3 and p.shape[0] == n for p in stacked
        ):
            out[path] = m
    return out


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    num_experts: int,
    top_k: int = 2,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mixtral's router load-balancing loss over the global micro-batch: on N data-parallel ranks its value
    on every rank, and the mean over ranks of its gradients, equal the one-process term over the ranks'
    concatenated micro-batches.

    The arguments and the term are those of Hugging Face's ``load_balancing_loss_func``
    (``transformers.models.mixtral.modeling_mixtral``): ``E * sum_e f_e * P_e`` with ``f_e`` the fraction of
    top-k assignments routed to expert ``e`` and ``P_e`` its mean router probability, both over every layer
    and every token the mask keeps. Pass it in place of the model's own aux loss: call the model without
    labels (or with ``router_aux_loss_coef=0``) and add ``coef * load_balancing_loss(out.router_logits, ...)``
    to a plain mean loss. It cannot join a ``zf.Mean``, whose normaliser is known only after backward.

    Why a collective: the term is a product of batch means, so each rank's term on its own micro-batch,
    averaged as the step averages gradients, is another objective (the mean over ranks of the per-rank
    terms). The fractions take no gradient, so with them fixed the term is linear in the probabilities;
    one all-reduce (sum) of ``2 * num_experts + 1`` float64 values (assignment counts, probability sums,
    token count) on the default group gives the global fractions and value, and each rank's gradient flows
    through its own probability sums times ``world_size`` over the global token count.

    It is a collective: every rank must call it the same number of times per micro-step, with the same
    ``num_experts``. Under ``accumulate_steps=k`` it is, on each micro-step, the term over that micro-step's
    global batch (the update then averages the k terms, as one process running k micro-batches does). At
    world size 1 nothing is sent and the value is Hugging Face's: bit for bit for float32 logits. The sums
    run in the logits' dtype promoted to at least float32 (float64 logits stay float64, where Hugging Face
    rounds to float32; bf16/fp16 logits get their softmax in float32, as Mixtral's router routes, where Hugging
    Face's aux takes it in the logits' dtype). A
    micro-step whose mask keeps no token on any rank gives nan, as Hugging Face's does (the step then skips
    the update).

    Args:
        router_logits: one ``[tokens, num_experts]`` tensor of router logits per layer (a tuple or list;
            a Hugging Face MoE model returns it as ``outputs.router_logits`` when called with
            ``output_router_logits=True``), ``tokens`` the micro-batch's ``batch * sequence`` rows.
        num_experts: experts per layer (``config.num_local_experts``).
        top_k: experts each token is routed to (``config.num_experts_per_tok``).
        attention_mask: optional ``[batch, sequence]`` mask of this rank's micro-batch (1 keeps a token, 0
            drops it: padding), weighting each token's count and probabilities.

    Returns:
        A 0-dim tensor: the global term (the same value on every rank), whose gradient on each rank is this
        rank's share of the global term's gradient times ``world_size``.

    Raises:
        TypeError / ValueError: router logits that are not a non-empty sequence of ``[tokens, num_experts]``
            tensors of one token count, a ``top_k`` outside ``1..num_experts``, or a mask whose size is not
            the token count.
    """
    layers = _check(router_logits, num_experts, top_k, attention_mask)
    dtype = torch.promote_types(layers[0].dtype, torch.float32)
    device = layers[0].device
    rows = layers[0].shape[0]
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=dtype)
    weight = torch.ones(rows, dtype=torch.float64, device=device) if mask is None else mask.detach().to(torch.float64)
    counts = torch.zeros(num_experts, dtype=torch.float64, device=device)  # top-k assignments per expert
    probs = torch.zeros(num_experts, dtype=dtype, device=device)  # router probabilities per expert
    for logits in layers:
        p = torch.softmax(logits.to(device=device, dtype=dtype), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices
        counts.scatter_add_(0, chosen.reshape(-1), weight.repeat_interleave(top_k))
        probs = probs + (p.sum(dim=0) if mask is None else (p * mask.unsqueeze(-1)).sum(dim=0))
    kept = weight.sum() * len(layers)  # the rows both means divide by, every layer's counted
    if C.world_size() == 1:  # Hugging Face's expression, so that the value is its value
        total = float(rows * len(layers)) if mask is None else kept.to(dtype)
        fractions, mean_probs = counts.to(dtype) / total, probs / total
        return torch.sum(fractions * mean_probs.unsqueeze(0)) * num_experts
    stats = torch.cat([counts, probs.detach().to(torch.float64), kept.reshape(1)])
    C.all_reduce(stats, "sum")
    g_counts, g_probs, g_kept = stats[:num_experts], stats[num_experts:-1], stats[-1]
    fractions = g_counts / g_kept
    value = (torch.sum(fractions * g_probs) / g_kept * num_experts).to(dtype)
    scale = (num_experts * C.world_size() / g_kept).to(dtype)
    local = torch.sum(fractions.to(dtype) * probs) * scale  # mean over ranks: the global term
    return local + (value - local).detach()


def _check(router_logits, num_experts: int, top_k: int, attention_mask) -> list[torch.Tensor]:
    """The layers' logits, once their kinds and shapes agree with each other, the experts and the mask."""
    if router_logits is None:
        raise ValueError(
            "load_balancing_loss: router_logits is None; the model returned no router logits. Call the model "
            "with output_router_logits=True and pass outputs.router_logits (one [tokens, num_experts] tensor per "
            "layer)."
        )
    is_sequence = isinstance(router_logits, Sequence) and not isinstance(router_logits, torch.Tensor)
    layers = list(router_logits) if is_sequence else []
    if not layers or not all(isinstance(t, torch.Tensor) for t in layers):
        raise TypeError(
            f"load_balancing_loss: router_logits must be a non-empty tuple or list of per-layer tensors, got "
            f"{_describe(router_logits)}. Pass outputs.router_logits from a model called with "
            "output_router_logits=True (one layer's logits alone: a tuple of one, (logits,))."
        )
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(
            f"load_balancing_loss: num_experts must be an int >= 1, got {num_experts!r}. Pass the model's "
            "config.num_local_experts."
        )
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"load_balancing_loss: top_k must be an int in 1..num_experts ({num_experts}), got {top_k!r}. Pass "
            "the model's config.num_experts_per_tok."
        )
    shapes = [tuple(t.shape) for t in layers]
    rows = shapes[0][0] if len(shapes[0]) == 2 else None
    floats = all(t.is_floating_point() for t in layers)
    if any(len(s) != 2 or s[1] != num_experts or s[0] != rows for s in shapes) or not floats:
        raise ValueError(
            f"load_balancing_loss: every layer's router logits must be a float [tokens, num_experts] tensor with "
            f"num_experts={num_experts} and one token count for every layer, got shapes {shapes[:4]}"
            f"{' ...' if len(shapes) > 4 else ''} of dtype(s) {sorted({str(t.dtype) for t in layers})}. Pass "
            "outputs.router_logits unchanged and the model's config.num_local_experts."
        )
    if attention_mask is not None and attention_mask.numel() != rows:
        raise ValueError(
            f"load_balancing_loss: attention_mask has {attention_mask.numel()} elements (shape "
            f"{list(attention_mask.shape)}) but the router logits have {rows} tokens per layer; expected the "
            "[batch, sequence] mask of the micro-batch the model was called on (batch * sequence = tokens)."
        )
    return layers


def _describe(x) -> str:
    """What was passed, in words, for an error message."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {list(x.shape)}"
    if isinstance(x, Sequence) and not isinstance(x, str):
        return f"a {type(x).__name__} of {len(x)} item(s) of type(s) {sorted({type(t).__name__ for t in x})}"
    return f"a value of type {type(x).__name__}"
