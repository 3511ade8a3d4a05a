"""tensor_parallel(step, 1): a group of one splits nothing, and trains a Hugging Face Llama exactly as the
plain step does, in one process (no process group) as under torchrun."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from torch import nn
from zerofn.transforms import tensor_parallel

import zerofn as zf

pytest.importorskip("transformers")


def _train(tp: int | None) -> tuple[dict, list[float]]:
    apply = zf.functional(tiny_llama())

    def loss_fn(params, batch):
        logits = apply(params, input_ids=batch[:, :-1]).logits
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.1))
    step = tensor_parallel(step, tp) if tp else step
    state = step.init(apply.params)
    losses = []
    for i in range(3):
        batch = torch.randint(0, 64, (4, 13), generator=torch.Generator().manual_seed(i))
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    return step.full_params(state), losses


def test_a_group_of_one_trains_as_the_plain_step_bit_for_bit():
    want, want_losses = _train(None)
    got, losses = _train(1)  # the vocabulary head gave a DTensor over a mesh no group backs: it failed
    assert losses == want_losses
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k
