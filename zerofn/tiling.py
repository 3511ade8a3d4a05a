"""Tiled MLPs: a transformer's MLP run over tiles of the sequence, one tile's activations alive at a time.

Why: at a long sequence the largest tensors a decoder layer makes are its
MLP's intermediate activations, ``[tokens, intermediate]`` with the
intermediate size 3 to 4 times the hidden size (a gated MLP keeps several:
the gate's and the up projection's outputs, the activation, their product).
The MLP treats every token alone, so it can run over pieces of the sequence
and give the same output: :func:`tiled` runs it on ``tiles`` pieces, each
under ``torch.utils.checkpoint`` (non-reentrant), so the forward keeps only
each piece's input and backward recomputes one piece at a time just before
its gradient is needed. A layer's MLP then holds one tile of those
activations instead of the whole sequence's, in forward and in backward
(ALST's ``TiledMLP``, done with torch's checkpoint). The parameters'
gradients are plain autograd's: each tile adds its part, and autograd sums
them before it accumulates the parameter's gradient, once.

What it costs: the MLP's forward runs twice, once in forward and once more
in backward (as under ``remat``), and a matmul over a tile is smaller than
over the whole sequence (keep tiles of a few thousand tokens on a GPU).

With ``remat``: a block that ``remat`` checkpoints runs its MLP tiled in its
forward and again in its recompute (the tiling is in the MLP's forward, which
the recompute calls), so backward recomputes the block with one tile of MLP
activations alive, and the MLP's forward runs three times in all.

:func:`tile_mlps` tiles every MLP of a model (Hugging Face decoders keep it
at ``model.layers[i].mlp``) while a ``with`` block is active, and leaves the
model as it was on exit.

Example:
    >>> import torch
    >>> from zerofn.tiling import tiled
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    >>> x = torch.randn(2, 10, 8)
    >>> torch.allclose(tiled(mlp, x, tiles=4), mlp(x), atol=1e-6)
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["tile_mlps", "tiled"]


def tiled(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, tiles: int, dim: int = 1) -> torch.Tensor:
    """``fn(x)`` computed over ``tiles`` pieces of ``x`` along ``dim``, the outputs concatenated.

    Right for a function that treats each position along ``dim`` alone (an MLP over the sequence), whose
    output keeps ``x``'s size along ``dim``. While grad is enabled each piece runs under
    ``torch.utils.checkpoint.checkpoint(fn, piece, use_reentrant=False)``: only one piece's intermediate
    tensors are alive at a time, in forward and in backward, at the price of ``fn``'s forward once more in
    backward (with the forward's random state: dropout masks are equal). Without grad the pieces run plainly,
    one after the other. The pieces are ``torch.tensor_split``'s: of sizes differing by at most one, empty
    ones (more tiles than positions) skipped.

    Args:
        fn: A module or function of one tensor that returns one tensor (an MLP).
        x: The input, for example ``[batch, seq, hidden]``.
        tiles: How many pieces (1 runs ``fn`` once, still checkpointed under grad).
        dim: The dim cut into pieces; 1, the sequence of ``[batch, seq, hidden]``, by default.

    Returns:
        ``fn``'s outputs on the pieces, concatenated along ``dim``.

    Raises:
        ValueError: ``tiles`` is not a positive int, ``dim`` is not a dim of ``x``, or ``fn`` returned
            something other than a tensor.

    Example:
        >>> import torch
        >>> from zerofn.tiling import tiled
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
        >>> x = torch.randn(3, 7, 4, requires_grad=True)
        >>> out = tiled(mlp, x, tiles=3)  # pieces of 3, 2 and 2 positions
        >>> out.shape, torch.allclose(out, mlp(x), atol=1e-6)
        (torch.Size([3, 7, 4]), True)
    """
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"tiled: tiles must be a positive int (how many pieces to cut x into), got {tiles!r}.")
    if not isinstance(x, torch.Tensor) or not -x.dim() <= dim < max(x.dim(), 1):
        what = f"a tensor of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"tiled: dim={dim} is not a dim of x, {what}; pass the dim to cut (the sequence's).")
    pieces = [p for p in torch.tensor_split(x, tiles, dim=dim) if p.shape[dim] > 0] or [x]
    grad = torch.is_grad_enabled()
    outs = []
    for piece in pieces:
        out = checkpoint(fn, piece, use_reentrant=False) if grad else fn(piece)
        if not isinstance(out, torch.Tensor):
            raise ValueError(
                f"tiled: fn returned {type(out).__name__}, expected one tensor (the output for its piece of x). "
                "Tile a function of one tensor that returns one tensor, such as an MLP; a module that also "
                "returns router logits (a mixture of experts) is not cut per position."
            )
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=dim)


@contextlib.contextmanager
def tile_mlps(module: nn.Module, tiles: int, *, names: tuple[str, ...] = ("mlp",)) -> Iterator[list[str]]:
    """While active, every submodule of ``module`` held under an attribute named in ``names`` runs its
    forward through :func:`tiled` over the sequence.

    The sequence is dim 1 of the submodule's first input, ``[batch, seq, hidden]`` (dim 0 of a 2-D
    ``[tokens, hidden]`` input); its other arguments pass to each tile unchanged. Only the forward is tiled:
    the submodule's hooks run once per call, around the tiles. A submodule inside another one that matches is
    left to it; one reached by two paths is tiled once. On exit every submodule gets its forward back and the
    model is as it was: calls after the block are untiled.

    Args:
        module: The model, for example a Hugging Face ``LlamaForCausalLM``.
        tiles: Pieces of the sequence each MLP runs over (see :func:`tiled`).
        names: The attribute names of the submodules to tile: ``("mlp",)`` finds Hugging Face decoders'
            ``model.layers[i].mlp``; GPT-2's is also ``mlp``, a model of its own may name it otherwise
            (``names=("ffn",)``).

    Yields:
        The paths of the tiled submodules.

    Raises:
        ValueError: No submodule is named in ``names``, or ``tiles`` is not a positive int.

    Example:
        >>> import torch
        >>> from zerofn.tiling import tile_mlps
        >>> block = torch.nn.Module()
        >>> block.mlp = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
        >>> x = torch.randn(1, 16, 8)
        >>> with tile_mlps(block, 4) as tiled_paths:
        ...     out = block.mlp(x)
        >>> tiled_paths, torch.allclose(out, block.mlp(x), atol=1e-6)
        (['mlp'], True)
    """
    if not isinstance(tiles, int) or isinstance(tiles, bool) or tiles < 1:
        raise ValueError(f"tile_mlps: tiles must be a positive int (pieces of the sequence), got {tiles!r}.")
    names = (names,) if isinstance(names, str) else tuple(names)
    found: dict[int, tuple[str, nn.Module]] = {}
    for path, sub in module.named_modules():
        if path.rpartition(".")[2] in names and id(sub) not in found:
            if not any(path.startswith(p + ".") for p, _ in found.values()):
                found[id(sub)] = (path, sub)
    if not found:
        raise ValueError(
            f"tile_mlps: no submodule of {type(module).__name__} is held under an attribute named "
            f"{' or '.join(repr(n) for n in names)}, so there is no MLP to tile. Pass names= with the attribute "
            "name of the model's MLP (print(model) shows it: names=('feed_forward',) for a module at "
            "layers[i].feed_forward)."
        )
    undo = []
    try:
        for _, sub in found.values():
            undo.append(_tile_forward(sub, tiles))
        yield [p for p, _ in found.values()]
    finally:
        for restore in reversed(undo):
            restore()


_ABSENT = object()


def _tile_forward(sub: nn.Module, tiles: int) -> Callable[[], None]:
    """Put a tiled forward on ``sub`` (an attribute of the instance, in front of its class's); returns what
    takes it away again, leaving ``sub`` as it was."""
    before = sub.__dict__.get("forward", _ABSENT)
    inner = sub.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if args:
            x, rest = args[0], args[1:]

            def one(piece: torch.Tensor) -> Any:
                return inner(piece, *rest, **kwargs)
        elif kwargs:
            key = next(iter(kwargs))
            x = kwargs[key]

            def one(piece: torch.Tensor) -> Any:
                return inner(**{**kwargs, key: piece})
        else:
            return inner()
        if not isinstance(x, torch.Tensor) or x.dim() < 2:  # no sequence to cut
            return inner(*args, **kwargs)
        return tiled(one, x, tiles=tiles, dim=1 if x.dim() > 2 else 0)

    sub.forward = forward

    def restore() -> None:
        if before is _ABSENT:
            sub.__dict__.pop("forward", None)
        else:
            sub.__dict__["forward"] = before

    return restore
