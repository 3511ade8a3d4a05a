"""Token-by-token generation from a step's state: ``zf.generate`` (Hugging Face causal LMs).

A loop over :meth:`zerofn.Step.apply`: the first call runs the prompt, each
later one the token just chosen, with the cache the model returned the call
before (``past_key_values``, ``use_cache=True``; ``cache`` where the model
names it so, as transformers 5.24 does), so the positions follow from the
cache. It therefore runs under any composition as ``step.apply``
does: whole parameters, ``amp``'s autocast, ``quantize``'s dequantization
per layer, and under ``shard_params`` one unit gathered at a time, for a
model no rank holds whole.

Collectives: those of ``step.apply`` only. Under ``shard_params`` (and
``offload`` of the params) it is collective: every rank calls it with the
same arguments, and each rank gets the same tokens; each call gathers every
unit, so the model's bytes cross the ranks for every token, unless
``gather_once=True`` gathers them once for the whole loop
(``zerofn.transforms.shard_params.gathered``). With ``do_sample=True``
give every rank a ``torch.Generator`` seeded alike: the ranks compute the
same logits and draw from them alone.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from zerofn.transforms.shard_params import gathered

__all__ = ["generate"]


def generate(
    step: Any,
    state: Any,
    input_ids: torch.Tensor,
    /,
    *,
    max_new_tokens: int,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    gather_once: bool = False,
) -> torch.Tensor:
    """Extend ``input_ids`` by up to ``max_new_tokens`` tokens the state's model chooses, one at a time.

    The model is the one the step's ``loss_fn`` calls (``zf.functional`` of a
    Hugging Face causal LM, a peft model included): it must take
    ``input_ids``, ``attention_mask``, ``past_key_values`` and ``use_cache``
    and return ``logits`` and ``past_key_values``. It runs as it is (call
    ``model.eval()`` first if it has dropout); greedy tokens equal those of
    the model's own ``generate(..., do_sample=False)`` on the same weights.

    Args:
        step, state: a Step and its state; any composition.
        input_ids: the prompts, ``(batch, tokens)`` integers, on the device the
            step computes on. Left-pad prompts of different lengths.
        max_new_tokens: the most tokens to add to each row.
        attention_mask: ``(batch, tokens)``, 0 on padding; None: all ones.
            With padding, the positions come from it (as Hugging Face's
            ``generate`` computes them) and are passed as ``position_ids``.
        do_sample: False (default): the most likely token (greedy). True: draw
            from the softmax of ``logits / temperature``, over the ``top_k``
            most likely tokens if given, with ``generator``.
        temperature, top_k: for sampling only.
        eos_token_id: the end-of-sequence token (or tokens): a row that emits
            one is done, and gets ``pad_token_id`` after it; generation stops
            when every row is done.
        pad_token_id: what a done row gets; None: the (first) eos token.
        generator: the ``torch.Generator`` sampling draws with (on the
            logits' device); None: torch's default.
        gather_once: under ``shard_params``, gather every unit once before
            the first token and release them after the last, instead of
            gathering them for every token: one gather of the model in
            all, for the whole model on every rank while it runs
            (``gathered(step, state)`` of ``zerofn.transforms.shard_params``,
            which also takes a ``max_bytes`` budget). Without
            ``shard_params``: no effect.

    Returns:
        A ``torch.long`` tensor ``(batch, tokens + n)``: the prompts, then the
        ``n <= max_new_tokens`` tokens generated (fewer when every row
        emitted eos first).

    Raises:
        TypeError, ValueError: arguments of the wrong kind, shape or range; a
            model whose output has no ``logits`` or ``past_key_values``.

    Example:
        >>> import torch, zerofn as zf
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> _ = torch.manual_seed(0)
        >>> cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        ...                   num_attention_heads=2, num_key_value_heads=2)
        >>> model = LlamaForCausalLM(cfg).eval()
        >>> apply = zf.functional(model)
        >>> def loss_fn(params, ids):
        ...     return apply(params, input_ids=ids, labels=ids).loss
        >>> step = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
        >>> state = step.init(apply.params)
        >>> prompt = torch.tensor([[1, 2, 3]])
        >>> out = zf.generate(step, state, prompt, max_new_tokens=4)
        >>> out.shape, torch.equal(out, model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0))
        (torch.Size([1, 7]), True)
    """
    ids, mask, eos, pad = _checked(
        input_ids, max_new_tokens, attention_mask, do_sample, temperature, top_k, eos_token_id, pad_token_id
    )
    if not isinstance(gather_once, bool):
        raise TypeError(f"zf.generate: gather_once must be True or False, got {gather_once!r}")
    with gathered(step, state) if gather_once else contextlib.nullcontext():
        return _loop(step, state, ids, mask, eos, pad, max_new_tokens, do_sample, temperature, top_k, generator)


def _loop(step, state, ids, mask, eos, pad, max_new_tokens, do_sample, temperature, top_k, generator) -> torch.Tensor:
    """The token loop: the prompt's call, then one call per token chosen, with the cache of the call before."""
    padded = bool((mask == 0).any())
    keep = _takes(step, "logits_to_keep")  # the prompt's logits but the last are never needed
    cache_arg = "cache" if _takes(step, "cache") else "past_key_values"  # its name since transformers 5.24
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    cache, feed = None, ids
    for _ in range(max_new_tokens):
        kwargs: dict[str, Any] = {"attention_mask": mask, cache_arg: cache, "use_cache": True}
        if padded:  # Hugging Face's positions: a row's own token count, whatever its padding
            positions = (mask.cumsum(-1) - 1).masked_fill_(mask == 0, 1)
            kwargs["position_ids"] = positions[:, -feed.shape[1] :]
        if keep:
            kwargs["logits_to_keep"] = 1
        out = step.apply(state, input_ids=feed, **kwargs)
        logits, cache = _read(out)
        nxt = _choose(logits[:, -1, :].float(), do_sample, temperature, top_k, generator)
        if eos is not None:
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            done |= torch.isin(nxt, eos)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        if eos is not None and bool(done.all()):
            break
        feed = nxt[:, None]
    return ids


def _checked(input_ids, max_new_tokens, attention_mask, do_sample, temperature, top_k, eos_token_id, pad_token_id):
    """(ids, mask, eos tensor or None, pad) from the arguments, or an error that says what to pass."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = f"a {input_ids.dim()}-D {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor) else "a "
        got += "" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise TypeError(
            f"zf.generate: input_ids must be a 2-D integer tensor (batch, tokens), got {got}; "
            "for one prompt pass ids[None]"
        )
    if input_ids.shape[1] == 0:
        raise ValueError("zf.generate: input_ids holds no tokens; give each row a prompt of at least one token")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"zf.generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if attention_mask is None:
        mask = torch.ones_like(input_ids, dtype=torch.long)
    else:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
            raise ValueError(
                f"zf.generate: attention_mask must be a tensor shaped like input_ids {tuple(input_ids.shape)}, "
                f"got {shape}"
            )
        mask = attention_mask.long()
        if bool((mask.sum(-1) == 0).any()):
            raise ValueError("zf.generate: a row of attention_mask is all 0; every prompt needs a token to attend to")
    if do_sample:
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
            raise ValueError(f"zf.generate: temperature must be a number > 0, got {temperature!r}")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"zf.generate: top_k must be an int >= 1 or None, got {top_k!r}")
    eos = None
    if eos_token_id is not None:
        listed = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        if not listed or not all(isinstance(t, int) and not isinstance(t, bool) for t in listed):
            raise ValueError(f"zf.generate: eos_token_id must be a token id or a list of them, got {eos_token_id!r}")
        eos = torch.tensor(listed, device=input_ids.device)
        pad_token_id = listed[0] if pad_token_id is None else pad_token_id
    if pad_token_id is not None and (isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int)):
        raise ValueError(f"zf.generate: pad_token_id must be a token id, got {pad_token_id!r}")
    return input_ids.long(), mask, eos, pad_token_id


def _takes(step: Any, name: str) -> bool:
    """Whether the step's model names ``name`` among its forward's arguments (a peft model's base model's)."""
    try:
        module = step.model().module
    except Exception:  # no zf.functional found: pass only what every causal LM takes
        return False
    for m in (module, getattr(module, "get_base_model", lambda: None)()):
        if m is not None and name in inspect.signature(m.forward).parameters:
            return True
    return False


def _read(out: Any) -> tuple[torch.Tensor, Any]:
    logits = getattr(out, "logits", None)
    cache = getattr(out, "cache", None)  # since transformers 5.24; past_key_values, still read, warns
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if not isinstance(logits, torch.Tensor) or cache is None:
        raise ValueError(
            f"zf.generate: the model returned a {type(out).__name__} without logits and past_key_values; it needs a "
            "causal LM that returns both when called with use_cache=True (a Hugging Face *ForCausalLM)"
        )
    return logits, cache


def _choose(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """The next token of each row from its logits (fp32): the argmax, or a draw (temperature, then top-k)."""
    if not do_sample:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
