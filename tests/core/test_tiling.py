"""``zerofn.tiling``: a Hugging Face Llama whose MLPs run over tiles of the sequence gives the untiled model's
logits and gradients, holds one tile of MLP activations instead of the whole sequence's, is left as it was
when the block exits, and trains as the untiled model inside a step, under ``remat`` too."""

from __future__ import annotations

import pytest
import torch
from helpers import max_abs_diff, tiny_llama

import zerofn as zf
from zerofn.tiling import tile_mlps, tiled

pytest.importorskip("transformers")


def _forward_backward(model, ids):
    """The logits, and every parameter's gradient after backward through a loss of them."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits
    logits.float().square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _peak(model, ids):
    model.zero_grad(set_to_none=True)
    with zf.memory.track() as t:
        model(input_ids=ids).logits.float().square().mean().backward()
    return t.peak


def test_tiled_llama_gives_the_untiled_logits_and_gradients():
    model = tiny_llama(seed=0)
    ids = torch.randint(64, (2, 37), generator=torch.Generator().manual_seed(0))  # 37: tiles of 10 and 9
    want, want_grads = _forward_backward(model, ids)
    with tile_mlps(model, 4) as paths:
        got, got_grads = _forward_backward(model, ids)
    assert paths == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert (got - want).abs().max() <= 1e-6
    assert max_abs_diff(got_grads, want_grads) <= 1e-6


def test_peak_memory_holds_one_tile_of_mlp_activations():
    """intermediate_size 1024 over hidden 64, 512 tokens: each layer's gated MLP keeps four [512, 1024]
    float32 tensors for backward untiled (the gate's and the up projection's outputs, the activation, their
    product: 8 MiB a layer), a quarter of one of them tiled. The tiled peak is lower by at least three of
    them a layer."""
    seq, inter, layers = 512, 1024, 2
    model = tiny_llama(seed=0, intermediate_size=inter, max_position_embeddings=seq, num_hidden_layers=layers)
    ids = torch.randint(64, (1, seq), generator=torch.Generator().manual_seed(1))
    untiled = _peak(model, ids)
    with tile_mlps(model, 4):
        tiled_peak = _peak(model, ids)
    activations = seq * inter * 4  # one [seq, intermediate] float32 tensor
    assert untiled - tiled_peak >= layers * 3 * activations, (untiled, tiled_peak)
    assert _peak(model, ids) == untiled  # after the block: untiled again


def test_the_block_leaves_the_model_as_it_was(monkeypatch):
    import zerofn.tiling

    model = tiny_llama(seed=0)
    before = {n: dict(vars(m)) for n, m in model.named_modules()}
    ids = torch.randint(64, (1, 9), generator=torch.Generator().manual_seed(2))
    calls = []
    real = zerofn.tiling.checkpoint
    monkeypatch.setattr(zerofn.tiling, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    with tile_mlps(model, 3):
        model(input_ids=ids)
    inside = len(calls)
    model(input_ids=ids)
    assert inside == 2 * 3  # two MLPs, three tiles each
    assert len(calls) == inside  # nothing tiled after the block
    assert {n: dict(vars(m)) for n, m in model.named_modules()} == before
    with pytest.raises(RuntimeError), tile_mlps(model, 2):  # restored also when the block raises
        raise RuntimeError("inside")
    assert all("forward" not in vars(m) for m in model.modules())


def test_a_model_without_mlp_is_refused_with_the_way_to_name_it():
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    with pytest.raises(ValueError, match=r"no submodule of Sequential is held under an attribute named 'mlp'.*names="):
        with tile_mlps(model, 2):
            pass
    block = torch.nn.Module()
    block.ffn = model
    with tile_mlps(block, 2, names=("ffn",)) as paths:
        assert paths == ["ffn"]


def test_tiled_without_grad_and_with_uneven_or_too_many_tiles():
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.SiLU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 3, 4)
    with torch.no_grad():
        assert (tiled(mlp, x, tiles=8) - mlp(x)).abs().max() <= 1e-6  # 8 tiles over 3 positions
    with pytest.raises(ValueError, match="tiles must be a positive int"):
        tiled(mlp, x, tiles=0)
    with pytest.raises(ValueError, match="dim=3 is not a dim of x"):
        tiled(mlp, x, tiles=2, dim=3)


def test_inside_a_step_and_under_remat_it_trains_as_untiled():
    """Float64, two AdamW updates: tiled inside a step, and tiled inside blocks remat recomputes, give the
    untiled step's parameters."""
    from zerofn.transforms import remat

    def train(tiles, rematted):
        model = tiny_llama(seed=0).double()
        apply = zf.functional(model)

        def loss_fn(params, ids):
            return apply(params, input_ids=ids).logits.square().mean()

        step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
        step = remat(step) if rematted else step
        state = step.init(apply.params)
        with tile_mlps(model, tiles) if tiles else torch.enable_grad():
            for i in range(2):
                state, _ = step(state, torch.randint(64, (2, 11), generator=torch.Generator().manual_seed(i)))
        return step.full_params(state)

    want = train(0, False)
    assert max_abs_diff(train(3, False), want) < 1e-10
    assert max_abs_diff(train(3, True), want) < 1e-10
