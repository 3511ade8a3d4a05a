"""Context parallelism inside a Hugging Face model, through transformers' attention interface.

transformers looks each attention layer's function up by name at every forward
(``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``), so a function registered
under a name of its own (:data:`NAME`) serves every model that uses the interface (Llama, Qwen2/3,
Mistral, Gemma, ...) without a plan. While a step runs (:class:`Around`) the model's configs name it; before
and after, they name the implementation they had, so ``step.apply``, evaluation and generation run the
model as it was. Under that name transformers builds no mask (the name has no mask function): the
attention function masks by itself from the whole sequence's positions and padding mask, which the fed
batch's context holds (:mod:`._feed`).

Around the model's call, a pre-hook completes what the fed batch implies: the global ``position_ids`` of
this rank's tokens when ``loss_fn`` did not pass them, ``labels`` from ``shift_labels`` (transformers
computes its loss only when ``labels`` is given; with ``shift_labels`` it scores them as they are), no
cache, and ``num_items_in_batch`` so that the model's loss on each rank is ``cp`` times its tokens' share
of the micro-batch's mean: the mean of it over the ``cp`` ranks, which is what the step averages, is one
process's loss over the whole sequence, padding and all.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from zerofn.transforms.context_parallel._feed import ACTIVE, HELP, IGNORE, Active
from zerofn.transforms.context_parallel._ulysses import attention as ulysses_attention

from zerofn.losses import chunked_cross_entropy
from zerofn.mesh import Mesh
from zerofn.tiling import tile_mlps

NAME = "zerofn_context_parallel"
_REGISTERED: list[bool] = []


def register() -> None:
    """Register :func:`attention` with transformers, once per process."""
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)
    _REGISTERED.append(True)


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention function signature: ``query`` ``[B, Hq, L, D]``, ``key``/``value`` ``[B, Hkv, L,
    D]`` on this rank's tokens; returns ``([B, L, Hq, D], None)``."""
    active = ACTIVE.get()
    if active is None or not active.fed:
        raise RuntimeError(
            f"context_parallel: {type(module).__name__} ran under attention implementation {NAME!r} outside a "
            "context-parallel step's forward; the step sets and restores it around its own forward"
        )
    unsupported = [k for k in ("softcap", "s_aux", "sinks") if kwargs.get(k) is not None]
    if unsupported:
        raise ValueError(
            f"context_parallel: {type(module).__name__} asks attention for {unsupported[0]!r}, which "
            "context_parallel's attention does not implement; train this model without context_parallel"
        )
    causal = bool(getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    if active.method == "ring":
        if window is not None or dropout:
            raise ValueError(
                f"context_parallel: method='ring' implements neither a sliding window nor attention dropout "
                f"({type(module).__name__} asked for {'sliding_window' if window is not None else 'dropout'}); "
                "use method='ulysses'"
            )
        from zerofn.transforms.context_parallel._ring import ring_attention

        out = ring_attention(
            query,
            key,
            value,
            group=active.group,
            positions=active.positions,
            scale=scaling,
            causal=causal,
            key_valid=active.ring_valid,
        )
    else:
        out = ulysses_attention(
            query,
            key,
            value,
            cp=active.cp,
            group=active.group,
            causal=causal,
            scale=scaling,
            key_valid=active.key_valid,
            window=window,
            dropout=dropout,
        )
    return out.transpose(1, 2).contiguous(), None


def _configs(module: torch.nn.Module) -> list:
    """The distinct configs the model's modules read their attention implementation from."""
    out: dict[int, Any] = {}
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            out.setdefault(id(cfg), cfg)
    return list(out.values())


def check_model(module: torch.nn.Module, where: str) -> None:
    """Raises unless ``module`` is a model that reads its attention through transformers' interface."""
    if module is None or not _configs(module) or "transformers" not in sys.modules:
        raise ValueError(
            f"{where}: context_parallel runs attention through transformers' attention interface, and "
            f"{type(module).__name__ if module is not None else 'a plain tree of params'} has no transformers config (config._attn_implementation): train a "
            "Hugging Face model (LlamaForCausalLM, Qwen3ForCausalLM, ...) or one whose attention layers call "
            "transformers' ALL_ATTENTION_FUNCTIONS"
        )


class Around:
    """Around a step's forward and backward: the model's configs name :data:`NAME`, the model's call is
    completed by :meth:`_complete`, and the forward's :class:`zerofn.transforms.context_parallel._feed.Active` context is set."""

    def __init__(self, method: str, m: Mesh, model: Callable, chunked_loss: bool = True, mlp_tiles: int | None = None):
        self.method, self.m, self.model = method, m, model
        self.chunked_loss, self.mlp_tiles = chunked_loss, mlp_tiles
        self.pending: list[dict] = []  # the chunked losses of the model's calls in flight, innermost last

    def __enter__(self):
        register()
        module = self.model().module
        self.configs = [(c, c._attn_implementation) for c in _configs(module)]
        for c, _ in self.configs:
            c._attn_implementation = NAME
        self.hooks = [
            module.register_forward_pre_hook(self._complete, with_kwargs=True),
            module.register_forward_hook(self._finish),
        ]
        self.tiles = None
        if self.mlp_tiles:
            self.tiles = tile_mlps(module, self.mlp_tiles)
            self.tiles.__enter__()
        m = self.m
        active = Active(m.size("cp"), m.coordinate("cp"), m.group("cp"), self.method)
        self.token = ACTIVE.set(active)
        return self

    def __exit__(self, *exc):
        ACTIVE.reset(self.token)
        if self.tiles is not None:
            self.tiles.__exit__(*exc)
        for h in self.hooks:
            h.remove()
        for c, was in self.configs:
            c._attn_implementation = was
        return False

    def _complete(self, module, args, kwargs):
        active = ACTIVE.get()
        if active is None or not active.fed:
            return None
        kwargs = dict(kwargs)
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        local = active.seq // active.cp
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] != local:
            raise ValueError(
                f"context_parallel: the model was called on {ids.shape[1]} tokens; this rank holds {local} of the "
                f"sequence's {active.seq}. Call it on the fed batch's tensors (batch['input_ids'], ...), which "
                "the step cut to this rank's tokens"
            )
        if kwargs.get("position_ids") is None:
            device = ids.device if isinstance(ids, torch.Tensor) else None
            kwargs["position_ids"] = active.positions[active.rank].to(device).unsqueeze(0)
        if kwargs.get("shift_labels") is not None:
            if kwargs.get("labels") is None:
                kwargs["labels"] = kwargs["shift_labels"]
        elif kwargs.get("labels") is not None:
            raise ValueError(f"context_parallel: the model was given labels= of this rank's tokens. {HELP}")
        if kwargs.get("labels") is not None:
            given = kwargs.get("num_items_in_batch")
            items = given if given is not None else active.items
            if items is None:
                items = (kwargs["shift_labels"] != IGNORE).sum()
            if isinstance(items, torch.Tensor):
                items = items.clamp(min=1).to(torch.float32)
            kwargs["num_items_in_batch"] = items / active.cp
            head = _chunkable_head(module, kwargs) if self.chunked_loss else None
            if head is not None:  # the model computes no logits and no loss; the head computes the loss by chunks
                record = {"labels": kwargs.pop("shift_labels"), "divisor": kwargs.pop("num_items_in_batch")}
                del kwargs["labels"]
                record["restore"], record["module"] = _chunked_head(head, record), module
                self.pending.append(record)
        if "use_cache" in kwargs or _takes_use_cache(type(module)):
            kwargs["use_cache"] = False
        return args, kwargs

    def _finish(self, module, args, output):
        """The loss the head computed by chunks, put where the model's would be (``output.loss``); the model's
        logits, never made, are None."""
        if not self.pending or self.pending[-1]["module"] is not module:
            return None
        record = self.pending.pop()
        record["restore"]()
        if "loss" not in record:
            return None
        output["loss"] = record["loss"]
        output["logits"] = None
        return output


# Causal LMs whose forward is `logits = lm_head(hidden); loss = loss_function(logits, labels, ...)` and nothing
# else between (no soft-capping, no logit scale, no auxiliary loss added to it)
CHUNKABLE = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def _chunkable_head(module: torch.nn.Module, kwargs: dict) -> torch.nn.Module | None:
    """The model's output head, when its loss may be computed by chunks in place of the model's own: a plain
    Linear head of a causal LM in :data:`CHUNKABLE`, called for every position with a dict output."""
    config = getattr(module, "config", None)
    get = getattr(module, "get_output_embeddings", None)
    if getattr(config, "model_type", None) not in CHUNKABLE or get is None or kwargs.get("return_dict") is False:
        return None
    if kwargs.get("logits_to_keep", 0) not in (0, None):
        return None
    head = get()
    return head if type(head) is torch.nn.Linear else None


def _chunked_head(head: torch.nn.Linear, record: dict) -> Callable[[], None]:
    """Make ``head``'s next call compute the chunked cross entropy of its input against ``record["labels"]``
    (summed, over ``record["divisor"]``) into ``record["loss"]`` and return no logits (a ``[..., 0]``
    tensor). Its hooks run as for any call (``shard_params`` gathers its unit for it). Returns the undo."""

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        head.__dict__.pop("forward", None)
        total = chunked_cross_entropy(hidden, head.weight, record["labels"], bias=head.bias, reduction="sum")
        record["loss"] = total / record["divisor"]
        return hidden.new_empty(*hidden.shape[:-1], 0)

    head.forward = forward
    return lambda: head.__dict__.pop("forward", None)


@functools.cache
def _takes_use_cache(kind: type) -> bool:
    try:
        return "use_cache" in inspect.signature(kind.forward).parameters
    except (TypeError, ValueError):
        return False
