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
- Where the kept inputs wait: on the device, or with ``offload="cpu"`` in
  host memory until their block's recompute. They are what remat's memory
  still grows with in depth (one hidden state per block), so holding them
  on the host leaves the device one block's intermediates and the one
  input being recomputed.

Offloading the inputs. Non-reentrant ``checkpoint`` keeps a block's
positional tensor inputs as saved tensors (its own saved-tensor hooks
handle what the block computes from them), so a
``torch.autograd.graph.saved_tensors_hooks`` around the ``checkpoint``
call sees exactly those inputs: its pack hook copies each input that
autograd computed and needs a gradient for (the hidden state flowing
through the blocks) to the host, and autograd holds that copy instead of
the device tensor, which is released as soon as nothing else uses it; its
unpack hook copies it back when backward reaches the block and
``checkpoint`` asks for its inputs to recompute it. Any other input
(attention mask, position ids, rotary tables, a parameter) stays as it
is: it is small, shared by every block or held by the state, so a copy
would free nothing. A keyword tensor input that needs a gradient is
handed to ``checkpoint`` positionally, as its keyword inputs would sit on
the device in the recompute's closure. On CUDA the copies run on a side
stream into pinned memory: the copy out waits for the compute stream to
have produced the input and overlaps the next block's forward, the copy
in overlaps the backward work still queued; ``record_stream`` keeps the
allocator from handing either device tensor's memory out again before the
streams using it are done, and the compute stream waits for the copy in
before the recompute reads it. The copies are exact, so the numbers are
plain remat's, bit for bit. On the CPU the same hooks run (a host copy
held, the original released) but save nothing: host memory is the
device's. What ``policy=`` keeps is saved by torch's selective
checkpointing, outside these hooks: it stays on the device.

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

OFFLOADS = (None, "cpu")  # where the blocks' inputs wait for their recompute: the device, host memory


@transform
def remat(
    step: Step,
    /,
    *,
    blocks: Callable[[str, nn.Module], bool] | list[str] | None = None,
    policy: Callable[[Any], bool] | tuple | list | frozenset | None = None,
    offload: str | None = None,
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
        offload: where the blocks' inputs wait for their recompute: None on
            the device, ``"cpu"`` in host memory (each input that needs a
            gradient is copied out in forward and back in when backward
            reaches its block: one host copy out and in per block per
            step, overlapped on CUDA, no memory saved on the CPU; what
            ``policy`` keeps stays on the device).

    Returns:
        The rewritten Step, named ``remat(...)``. Applied to a step that
        already has ``remat`` with the same options it returns that step
        unchanged.

    Raises:
        TypeError: ``step`` is not a Step, or ``policy`` is neither a
            predicate nor a collection of ops.
        ValueError: ``offload`` is neither None nor ``"cpu"``, or a step
            that already has ``remat`` with other options.
    """
    blocks = tuple(blocks) if isinstance(blocks, (list, tuple)) else blocks
    if policy is not None and not callable(policy):
        if not isinstance(policy, (tuple, list, set, frozenset)):
            raise TypeError(f"remat: policy must be a predicate op -> bool or a collection of ops, got {policy!r}")
        policy = frozenset(policy)
    if offload not in OFFLOADS:
        raise ValueError(
            f"remat: offload must be one of {OFFLOADS} (None keeps the blocks' inputs on the device, 'cpu' holds "
            f"them in host memory until their recompute), got {offload!r}. Pass offload='cpu' or leave it out; "
            "to move optimizer state or parameters off the device (also to NVMe), use "
            "zerofn.transforms.offload."
        )
    options = (blocks, policy, offload)
    have = step.extension("remat")
    if reapply(step, "remat", have and have.options, options, "recomputes activations"):
        return step
    around = functools.partial(_checkpointed, blocks, policy, offload)
    return step.extend(Extension("remat", options, around=around))


@contextlib.contextmanager
def _checkpointed(blocks: Any, save: Any, offload: str | None, model: Callable, state: Any):
    """Run every call of the chosen blocks under checkpoint() for one forward and backward."""
    module = model().module
    names = natural_blocks(module) if blocks is None else unit_names(module, blocks, where="remat: blocks")
    _check_reachable(module, names)
    context_fn = functools.partial(_selective, save) if save is not None else None
    copies = _HostCopies() if offload == "cpu" else None
    intercepts = []
    try:
        for name in names:
            around = functools.partial(_recomputed, context_fn, copies)
            intercepts.append(Intercept(module.get_submodule(name), around))
        yield
    finally:
        for i in reversed(intercepts):
            i.remove()


def _recomputed(
    context_fn: Callable | None, copies: _HostCopies | None, call: Callable, args: tuple, kwargs: dict
) -> Any:
    if not torch.is_grad_enabled():  # nothing to save for: run it plainly
        return call(*args, **kwargs)
    extra = {"context_fn": context_fn} if context_fn is not None else {}
    if copies is None:
        return checkpoint(call, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)
    call, args, kwargs = _grad_keywords_positional(call, args, kwargs)
    # Innermost while checkpoint saves its inputs; inside the block checkpoint's own hooks are pushed above it.
    with torch.autograd.graph.saved_tensors_hooks(copies.pack, copies.unpack):
        return checkpoint(call, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)


def _grad_keywords_positional(call: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple, dict]:
    """``call``, args and kwargs with the keyword tensors that need a gradient passed positionally after
    ``args``: checkpoint saves its positional tensors (where the hooks see them) but keeps keyword ones in
    the recompute's closure."""
    moved = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not moved:
        return call, args, kwargs
    n = len(args)

    def by_name(*a: Any, **kw: Any) -> Any:
        return call(*a[:n], **dict(zip(moved, a[n:])), **kw)

    return by_name, (*args, *(kwargs[k] for k in moved)), {k: v for k, v in kwargs.items() if k not in moved}


class _Held:
    """A block's input while its host copy stands in for it: the copy and the device it goes back to."""

    __slots__ = ("device", "host")

    def __init__(self, host: torch.Tensor, device: torch.device):
        self.host, self.device = host, device


class _HostCopies:
    """The saved-tensor hooks that hold one step's block inputs in host memory (see the module docs).

    On CUDA the copies run on a side stream (one per device, made on first use) into pinned memory; on
    any other device they are plain copies, and on the CPU the held copy is returned as it is (it is on
    the device already). The logic is the same everywhere but for the streams and the pinning.
    """

    def __init__(self) -> None:
        self.streams: dict[torch.device, Any] = {}

    def side(self, device: torch.device) -> Any:
        """The side stream the copies to and from ``device`` run on; None off CUDA."""
        if device.type != "cuda":
            return None
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def pack(self, t: torch.Tensor) -> Any:
        if not t.requires_grad or t.grad_fn is None:
            return t  # a mask, position ids, rotary tables, a parameter: a copy would free nothing
        side = self.side(t.device)
        host = torch.empty_like(t, device="cpu", pin_memory=side is not None)
        if side is None:
            host.copy_(t.detach())
        else:
            side.wait_stream(torch.cuda.current_stream(t.device))  # t is written on the compute stream
            with torch.cuda.stream(side):
                host.copy_(t.detach(), non_blocking=True)
            t.record_stream(side)  # its memory is not handed out again before the copy is done
        return _Held(host, t.device)

    def unpack(self, held: Any) -> torch.Tensor:
        if not isinstance(held, _Held):
            return held
        if held.device.type == "cpu":
            return held.host
        side = self.side(held.device)
        if side is None:
            return held.host.to(held.device)
        compute = torch.cuda.current_stream(held.device)
        with torch.cuda.stream(side):  # after the copy out, on the same stream; overlaps queued backward work
            # Allocated from the side stream's blocks, so nothing still queued on the compute stream reads
            # this memory; the pinned source is kept until the copy is done (torch's host allocator records
            # the stream it was copied on).
            out = torch.empty_like(held.host, device=held.device).copy_(held.host, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        compute.wait_event(done)  # the recompute reads it
        out.record_stream(compute)  # not reused by the side stream before the recompute is done with it
        return out


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
