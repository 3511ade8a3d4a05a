"""step.full_params and step.state_dict give one process's parameters under every composition: whole tensors,
in the dtypes the model was built in (amp's bf16 parameters come back as the model's fp32), equal on 2 gloo ranks to the same composition trained on one process over the concatenated batch;
``local=True`` gives them as this rank's model holds them (amp's dtype). tensor_parallel's compositions:
tests/transforms/tensor_parallel/test_tensor_parallel.py; the README's block with each transform on: tests/test_readme.py."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_transformer, train, transformer_batch
from zerofn.transforms import amp, offload, quantize, remat, shard_grads, shard_optimizer, shard_params

import zerofn as zf

STEPS, GLOBAL_BATCH = 3, 8
BF16 = torch.bfloat16


def _compositions(path: str) -> dict:
    return {
        "train_step": lambda s: s,
        "shard_optimizer": shard_optimizer,
        "shard_grads": shard_grads,
        "shard_params": shard_params,
        "amp": lambda s: amp(s, BF16),
        "amp(shard_params)": lambda s: amp(shard_params(s), BF16),
        "offload": lambda s: offload(shard_optimizer(s), "cpu"),
        "offload_nvme": lambda s: offload(amp(shard_optimizer(s), BF16), "nvme", path=path),
        "remat": remat,
        "quantize": lambda s: quantize(s, "int8", block_size=2),
    }


def _model():
    """TinyTransformer (tied embedding and head) with frozen Linear weights, which quantize holds as int8."""
    model, apply, loss_fn = make_transformer(extras=False)
    for b in model.blocks:
        b.qkv.weight.requires_grad_(False)
        b.fc.weight.requires_grad_(False)
    return model, zf.functional(model), loss_fn


def _run(name: str, path: str, world: int = 1, rank: int = 0) -> dict:
    model, apply, _ = _model()
    dtypes = {k: v.dtype for k, v in apply.params.items()}  # the model's own
    names = list(model.state_dict())  # before init, which takes the module's parameters over

    def loss_fn(params, batch):
        logits = apply(params, batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    os.makedirs(f"{path}/{name}", exist_ok=True)
    step = _compositions(f"{path}/{name}")[name](zf.train_step(loss_fn, zf.optim.adamw(3e-3, weight_decay=0.1)))
    state = step.init(apply.params)
    state, _ = train(step, state, transformer_batch, STEPS, GLOBAL_BATCH, world, rank)
    full = step.full_params(state)
    return {
        "name": step.name,
        "dtypes": dtypes,
        "full": full,
        "local": step.full_params(state, local=True),
        "master": step.full_params(state, master=True),
        "state_dict": step.state_dict(state),
        "names": names if name != "quantize" else None,  # quantize's: the parts in place of the weights
    }


def _all(path: str) -> dict:
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    return {name: _run(name, path, world, rank) for name in _compositions(path)}


@pytest.fixture(scope="module")
def on_two_ranks(ranks, tmp_path_factory):
    return ranks(2).run(_all, str(tmp_path_factory.mktemp("ranks")))


@pytest.mark.parametrize("name", list(_compositions("")))
def test_full_params_are_one_processes_in_the_models_dtypes(on_two_ranks, tmp_path, name):
    ref = _run(name, str(tmp_path))
    mixed = "amp" in name or "nvme" in name
    tol = 2e-2 if mixed else 1e-5  # amp: bf16 sums split over the ranks round otherwise than one process's
    for out in (r[name] for r in on_two_ranks):
        full, local = out["full"], out["local"]
        assert full.keys() == ref["full"].keys() == local.keys()
        for k, v in ref["full"].items():
            want = out["dtypes"].get(k, v.dtype)  # quantize's parts: as held
            assert full[k].dtype == v.dtype == want, (name, k, full[k].dtype, want)
            assert full[k].shape == v.shape, (name, k)
            assert torch.allclose(full[k].double(), v.double(), atol=tol, rtol=0), (name, k)
        for k, v in local.items():  # as held: amp's bf16, the masters rounded
            if mixed:
                assert v.dtype == BF16 and torch.equal(v, full[k].to(BF16)), (name, k, v.dtype)
            else:
                assert torch.equal(v, full[k]), (name, k)
            # master=True: what the optimizer updates (amp's fp32 masters), the same numbers as full_params
            assert torch.equal(out["master"][k].to(full[k].dtype), full[k]), (name, k)
            assert out["master"][k].dtype == (torch.float32 if mixed else full[k].dtype), (name, k)
        # state_dict: the model's own names (the tied head under both), the full parameters' values
        sd = out["state_dict"]
        if out["names"] is not None:
            assert list(sd) == out["names"], name
            assert torch.equal(sd["head.weight"], sd["tok.weight"]) and torch.equal(
                sd["tok.weight"], full["tok.weight"]
            )
        for k, v in full.items():
            if k in sd:
                assert torch.equal(sd[k], v), (name, k)
