"""A loss that differentiates inside itself (a gradient penalty: ``torch.autograd.grad(..., create_graph=True)``
in ``loss_fn``, on its inputs or on parameters) trains under every shard transform as plain torch does.

References: one process running plain torch (the module, ``torch.optim.AdamW``) on the concatenated batch,
whose loss is the mean over the ranks' slices of the same penalised loss (DDP's semantics: a parameter-gradient
penalty is taken per rank), on real gloo ranks at world sizes 1 and 2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import make_mlp, max_abs_diff, mlp_batch, rank_slice, tiny_llama, train
from test_shard_params import VOCAB, batch_for, make_model
from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

import zerofn as zf

GLOBAL_BATCH = 8
STEPS = 3
LR = 1e-2
PENALTY = 0.5
PENALISED = ("layers.0.weight", "layers.2.bias")  # the parameters whose gradient the "param" penalty takes
# In test_shard_params' model (LoRA over frozen weights, a block used twice, tied embeddings): the first block's
# and the shared block's adapters, so the inner grad runs back through every block and its frozen weights.
ZOO_PENALISED = ("blocks.0.fc.weight", "blocks.1.proj.a")

COMPOSITIONS = {
    "train_step": lambda s: s,
    "shard_optimizer": shard_optimizer,
    "shard_grads": shard_grads,
    "shard_params": shard_params,
    "shard_params(prefetch=0)": lambda s: shard_params(s, prefetch=0),
    "shard_params, accumulate_steps=2": shard_params,
    "offload(shard_optimizer)": lambda s: offload(shard_optimizer(s), "cpu"),
    "remat(shard_params)": lambda s: remat(shard_params(s)),
    "offload(shard_params, params=cpu)": lambda s: offload(shard_params(s), "cpu", params=True),
    "amp(shard_params)": lambda s: amp(shard_params(s)),
    "amp": amp,
}


# ---------------------------------------------------------------- the losses, on a forward and parameters


def mlp_penalised(forward, weights, batch, kind):
    """MSE plus a gradient penalty: WGAN-GP's on the input gradient (``kind="input"``), or the squared
    gradient of the MSE with respect to ``weights`` (``"param"``)."""
    x = batch["x"].clone().requires_grad_(kind == "input")
    out = forward(x)
    mse = ((out - batch["y"]) ** 2).mean()
    if kind == "input":
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return mse + PENALTY * (g.norm(dim=1) - 1).square().mean()
    grads = torch.autograd.grad(mse, weights, create_graph=True)
    return mse + PENALTY * sum(g.square().sum() for g in grads)


def llama_penalised(model_call, embedding, ids):
    """Next-token cross-entropy plus the squared gradient with respect to the input embeddings. (``model_call``
    runs without a key/value cache, which a recompute under ``remat`` would append to twice.)"""
    emb = F.embedding(ids, embedding)
    logits = model_call(emb)
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    (g,) = torch.autograd.grad(ce, emb, create_graph=True)
    return ce + PENALTY * g.square().sum(-1).mean()


def zoo_penalised(forward, weights, batch):
    """Next-token cross-entropy plus the squared gradient of it with respect to ``weights``."""
    logits = forward(batch[:, :-1])
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    grads = torch.autograd.grad(ce, weights, create_graph=True)
    return ce + PENALTY * sum(g.square().sum() for g in grads)


def llama():
    return tiny_llama(attn_implementation="eager")  # torch's CPU sdpa kernel has no double backward


def llama_batch(step, n):
    return torch.randint(64, (n, 8), generator=torch.Generator().manual_seed(step))


def _zerofn_loss(model, kind):
    if model == "mlp":
        _, apply, _ = make_mlp()
        return apply, lambda p, b: mlp_penalised(lambda x: apply(p, x), [p[n] for n in PENALISED], b, kind)
    if model == "zoo":
        _, apply, _ = make_model()
        return apply, lambda p, b: zoo_penalised(lambda x: apply(p, x), [p[n] for n in ZOO_PENALISED], b)
    apply = zf.functional(llama())
    return apply, lambda p, ids: llama_penalised(
        lambda e: apply(p, inputs_embeds=e, use_cache=False).logits, p["model.embed_tokens.weight"], ids
    )


def _batches(model):
    return {"mlp": mlp_batch, "zoo": batch_for, "llama": llama_batch}[model]


def _train(model, kind, composition, world, rank):
    apply, loss_fn = _zerofn_loss(model, kind)
    accumulate = 2 if "accumulate_steps=2" in composition else 1
    step = COMPOSITIONS[composition](zf.train_step(loss_fn, zf.optim.adamw(LR), accumulate))
    state, metrics = train(step, step.init(apply.params), _batches(model), STEPS, GLOBAL_BATCH, world, rank)
    assert bool(torch.isfinite(metrics["loss"])) and not bool(metrics["skipped"])
    return {k: v.float() for k, v in step.full_params(state).items()}


def _rank_cases(cases):
    world, rank = dist.get_world_size(), dist.get_rank()
    return [_train(*case, world, rank) for case in cases]


def torch_reference(model, kind, world):
    """Plain torch on one process: the concatenated batch, its loss the mean over the ranks' slices."""
    if model == "mlp":
        module, _, _ = make_mlp()
        named = dict(module.named_parameters())
        loss = lambda b: mlp_penalised(module, [named[n] for n in PENALISED], b, kind)  # noqa: E731
    elif model == "zoo":
        module, _, _ = make_model()
        named = dict(module.named_parameters())
        loss = lambda b: zoo_penalised(module, [named[n] for n in ZOO_PENALISED], b)  # noqa: E731
    else:
        module = llama()
        loss = lambda ids: llama_penalised(  # noqa: E731
            lambda e: module(inputs_embeds=e, use_cache=False).logits, module.model.embed_tokens.weight, ids
        )
    opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    for i in range(STEPS):
        batch = _batches(model)(i, GLOBAL_BATCH)
        total = sum(loss(rank_slice(batch, r, world)) for r in range(world)) / world
        opt.zero_grad()
        total.backward()
        opt.step()
    return {k: v.detach() for k, v in module.state_dict().items() if k in dict(module.named_parameters())}


def _check(ranks, world, cases, tol=1e-5):
    refs = {(m, k): torch_reference(m, k, world) for m, k, _ in cases}
    for rank, results in enumerate(ranks(world).run(_rank_cases, cases)):
        for (model, kind, composition), params in zip(cases, results):
            ref = refs[(model, kind)]
            diff = max_abs_diff({k: params[k] for k in ref}, ref)
            assert diff <= tol, f"{composition} {model} {kind} world={world} rank={rank}: {diff:.3g}"
    for model, kind in refs:  # it trained: the penalty's gradient moved the parameters
        initial = _zerofn_loss(model, kind)[0].params
        assert max_abs_diff({k: initial[k] for k in refs[(model, kind)]}, refs[(model, kind)]) > 1e-3


WORLDS = pytest.mark.parametrize("world", [1, 2])


@WORLDS
def test_untransformed_step_trains_a_gradient_penalty_as_torch(ranks, world):
    _check(ranks, world, [("mlp", "input", "train_step"), ("mlp", "param", "train_step")])


@WORLDS
def test_shard_optimizer_trains_a_gradient_penalty_as_torch(ranks, world):
    _check(
        ranks,
        world,
        [
            ("mlp", "input", "shard_optimizer"),
            ("mlp", "param", "shard_optimizer"),
            ("mlp", "param", "offload(shard_optimizer)"),
        ],
    )


@WORLDS
def test_shard_grads_trains_a_gradient_penalty_as_torch(ranks, world):
    _check(ranks, world, [("mlp", "input", "shard_grads"), ("mlp", "param", "shard_grads")])


@WORLDS
def test_shard_params_trains_a_gradient_penalty_as_torch(ranks, world):
    """The inner grad runs through units released after the forward: it gathers them again, and the graph it
    builds reads them in the step's backward."""
    _check(
        ranks,
        world,
        [
            ("mlp", "input", "shard_params"),
            ("mlp", "param", "shard_params"),
            ("mlp", "input", "shard_params(prefetch=0)"),
            ("mlp", "input", "shard_params, accumulate_steps=2"),  # an input penalty is per item: the split is free
            ("llama", "input", "shard_params"),
            ("zoo", "param", "shard_params"),
        ],
    )


@WORLDS
def test_shard_params_with_remat_and_offload_trains_a_gradient_penalty_as_torch(ranks, world):
    _check(
        ranks,
        world,
        [
            ("mlp", "input", "remat(shard_params)"),
            ("mlp", "param", "remat(shard_params)"),
            ("mlp", "input", "offload(shard_params, params=cpu)"),
            ("llama", "input", "remat(shard_params)"),
        ],
    )


def _rank_amp():
    world, rank = dist.get_world_size(), dist.get_rank()
    return [_train("mlp", kind, c, world, rank) for kind in ("input", "param") for c in ("amp(shard_params)", "amp")]


def test_amp_shard_params_trains_a_gradient_penalty_as_amp_alone(ranks):
    """bf16 compute: amp(shard_params) against amp on the same ranks (DDP), and near the fp32 reference."""
    world = 2
    for rank, (in_sp, in_amp, par_sp, par_amp) in enumerate(ranks(world).run(_rank_amp)):
        for kind, sharded, alone in (("input", in_sp, in_amp), ("param", par_sp, par_amp)):
            assert max_abs_diff(sharded, alone) <= 1e-6, (kind, rank)
            assert max_abs_diff(sharded, torch_reference("mlp", kind, world)) <= 5e-2, (kind, rank)


def _rank_traffic():
    world, rank = dist.get_world_size(), dist.get_rank()
    out = []
    for kind in ("none", "input", "param"):
        apply, loss_fn = _zerofn_loss("mlp", kind)
        if kind == "none":
            loss_fn = make_mlp()[2]
        step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(LR)))
        _, metrics = train(step, step.init(apply.params), mlp_batch, 2, GLOBAL_BATCH, world, rank)
        out.append(int(metrics["comm_bytes"]))
    return out


def test_shard_params_gradient_penalty_adds_no_traffic(ranks):
    """The inner grad's gather of a unit takes the place of the backward's (the unit stays gathered for it)."""
    for plain, on_input, on_param in ranks(2).run(_rank_traffic):
        assert on_input == plain and on_param == plain, (plain, on_input, on_param)
