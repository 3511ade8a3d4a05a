"""``remat``: activation checkpointing per block, as ``jax.checkpoint`` does it.

Adds an extension to the step (see docs/design.md) whose context, around
each forward and backward, runs every call of each chosen block under
``torch.utils.checkpoint`` (non-reentrant): the forward keeps only each
block's inputs, and backward recomputes one block at a time just before
its gradient is needed. Activation memory then drops from every block's
intermediate tensors to the blocks' inputs plus one block's intermediates.

The block's call (its hooks and forward, as ``torch.distributed``'s
``checkpoint_wrapper`` checkpoints it) is checkpointed from outside it
(:class:`zerofn.transforms._units.Intercept`): nothing on the block is
changed after the step, and a block compiled with ``block.compile()`` is
recomputed by its compiled code, with no recompilation. A block inside a
region compiled as a whole (``model.compile()``) cannot be reached from
outside that region: the step raises instead of silently saving nothing.

- Which blocks: by default the same natural blocks ``shard_params`` gathers
  as units (``ModuleList``, ``Sequential`` and ``ModuleDict`` children),
  or ``blocks=``: a list of module paths or a predicate ``(path, module) ->
  bool``.
- What to save: ``policy=``, as ``jax.checkpoint``'s, a predicate ``op ->
  bool`` or a collection of ops (``torch.ops.aten.mm.default``, ...) whose
  outputs are kept instead of recomputed (torch's selective activation
  checkpointing); default: nothing inside a block is saved.
- The recompute runs under the forward's autocast (``amp``) and with the
  forward's random state (dropout masks are equal), as
  ``torch.utils.checkpoint`` preserves both.
- Under ``shard_params`` the recompute runs inside the unit's backward,
  after the unit has been gathered again for it, so there is no extra
  gather: traffic stays 3 x parameter bytes.

Composes with every transform, in either order. Collectives: none of its own.

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import remat
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    >>> apply = zf.functional(model)
    >>> step = remat(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(0.1)), blocks=["0", "2"])
    >>> state, metrics = step(step.init(apply.params), torch.ones(2, 4))
    >>> step.name
    'remat(train_step)'
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from zerofn.transforms._units import Intercept, compiled, compiles_children, natural_blocks, unit_names

from zerofn.extension import Extension
from zerofn.step import Step, reapply, transform

__all__ = ["remat"]


@transform
def remat(
    step: Step,
    /,
    *,
    blocks: Callable[[str, nn.Module], bool] | list[str] | None = None,
    policy: Callable[[Any], bool] | tuple | list | frozenset | None = None,
) -> Step:
    """Recompute each block's activations in backward instead of keeping them.

    Args:
        step: a Step (any transforms applied before or after). Called
            without it, returns a decorator.
        blocks: which modules are checkpointed: a list of module paths, a
            predicate ``(path, module) -> bool``, or None for the model's
            natural blocks (those ``shard_params`` uses as units).
        policy: which ops' outputs are saved rather than recomputed, like
            ``jax.checkpoint_policies``: a predicate ``op -> bool`` or a
            collection of ops; None saves nothing inside a block.

    Returns:
        The rewritten Step, named ``remat(...)``. Applied to a step that
        already has ``remat`` with the same options it returns that step
        unchanged.

    Raises:
        TypeError: ``step`` is not a Step, or ``policy`` is neither a
            predicate nor a collection of ops.
        ValueError: a step that already has ``remat`` with other options.
    """
    blocks = tuple(blocks) if isinstance(blocks, (list, tuple)) else blocks
    if policy is not None and not callable(policy):
        if not isinstance(policy, (tuple, list, set, frozenset)):
            raise TypeError(f"remat: policy must be a predicate op -> bool or a collection of ops, got {policy!r}")
        policy = frozenset(policy)
    options = (blocks, policy)
    have = step.extension("remat")
    if reapply(step, "remat", have and have.options, options, "recomputes activations"):
        return step
    return step.extend(Extension("remat", options, around=functools.partial(_checkpointed, blocks, policy)))


@contextlib.contextmanager
def _checkpointed(blocks: Any, save: Any, model: Callable, state: Any):
    """Run every call of the chosen blocks under checkpoint() for one forward and backward."""
    module = model().module
    names = natural_blocks(module) if blocks is None else unit_names(module, blocks, where="remat: blocks")
    _check_reachable(module, names)
    context_fn = functools.partial(_selective, save) if save is not None else None
    intercepts = []
    try:
        for name in names:
            intercepts.append(Intercept(module.get_submodule(name), functools.partial(_recomputed, context_fn)))
        yield
    finally:
        for i in reversed(intercepts):
            i.remove()


def _recomputed(context_fn: Callable | None, call: Callable, args: tuple, kwargs: dict) -> Any:
    if not torch.is_grad_enabled():  # nothing to save for: run it plainly
        return call(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(call, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _check_reachable(module: nn.Module, names: list[str]) -> None:
    """Raise when a chosen block lies inside a module that was compiled as a whole: its calls are made from
    compiled code, which runs the block's forward without passing through anything remat can put around it."""
    blocks = {id(module.get_submodule(n)): n for n in names}

    def walk(m: nn.Module, path: str, region: str | None) -> None:
        if region is not None and id(m) in blocks:
            raise ValueError(
                f"remat: block {blocks[id(m)]!r} runs inside {region or 'the model'}, which was compiled as a whole "
                f"({region or 'model'}.compile() or torch.compile), so its calls come from compiled code and remat "
                "cannot checkpoint them. Compile the blocks one by one instead (for block in model.blocks: "
                "block.compile()), as docs/compile.md shows, or leave the model uncompiled."
            )
        inner = region if region is not None else (path if compiled(m) or compiles_children(m) else None)
        for name, child in m.named_children():
            walk(child, f"{path}.{name}" if path else name, inner)

    walk(module, "", None)


def _selective(save: Any):
    def policy(ctx, op, *args, **kwargs):
        keep = save(op) if callable(save) else op in save
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
