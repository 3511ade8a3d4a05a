"""``remat``: activation checkpointing per block, as ``jax.checkpoint`` does it.

Adds an extension to the step (see docs/design.md) whose context, around
each forward and backward, wraps the ``forward`` of every chosen block in
``torch.utils.checkpoint`` (non-reentrant): the forward keeps only each
block's inputs, and backward recomputes one block at a time just before
its gradient is needed. Activation memory then drops from every block's
intermediate tensors to the blocks' inputs plus one block's intermediates.

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
from zerofn.transforms._units import natural_blocks, unit_names

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
    """Wrap the chosen blocks' forward in checkpoint() for one forward and backward."""
    module = model().module
    names = natural_blocks(module) if blocks is None else unit_names(module, blocks, where="remat: blocks")
    context_fn = functools.partial(_selective, save) if save is not None else None
    patched = []
    try:
        for name in names:
            block = module.get_submodule(name)
            own = block.__dict__.get("forward")  # a forward set on the instance, kept as it is
            block.forward = functools.partial(_forward, block.forward, context_fn)
            patched.append((block, own))
        yield
    finally:
        for block, own in patched:
            if own is None:
                del block.forward
            else:
                block.forward = own


def _forward(forward: Callable, context_fn: Callable | None, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # nothing to save for: run it plainly
        return forward(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _selective(save: Any):
    def policy(ctx, op, *args, **kwargs):
        keep = save(op) if callable(save) else op in save
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)
