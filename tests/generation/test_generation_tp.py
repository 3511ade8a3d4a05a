"""zf.generate under tensor_parallel: a grouped-query Llama split over 2 ranks (tp 2) and over 4 (tp 4) generates
the greedy tokens of one process (Hugging Face's generate on the unsplit model), left-padded prompts included,
and each call moves only activations on the tensor-parallel group: two all-reduces per block of
batch x new positions x hidden fp32 values, whatever the weights weigh. Under shard_params across the data
axis (tp 2 x dp 2) it generates those tokens per call and gathered once (one gather of each bucket in all)."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llama
from zerofn.transforms import tensor_parallel
from zerofn.transforms.tensor_parallel import mesh

import zerofn as zf

pytest.importorskip("transformers")

NEW, LAYERS, HIDDEN = 16, 2, 64
# two prompts of different lengths, left-padded (pad 0, masked out)
PROMPTS = torch.tensor([[0, 0, 5, 17, 33, 2], [7, 41, 9, 60, 12, 3]])
MASK = (PROMPTS != 0).long()


def _llama():
    return tiny_llama(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,  # 8 heads sharing 4 key/value heads: whole heads at size 2 and 4
        num_key_value_heads=4,
        max_position_embeddings=64,
    ).eval()


class _Counted:
    """The step with its ``apply`` counted: the bytes and calls each one issues on ``group``."""

    def __init__(self, step, group):
        self.step, self.group, self.calls = step, group, []

    def apply(self, state, *args, **kwargs):
        with zf.collectives.counting(group=self.group) as c:
            out = self.step.apply(state, *args, **kwargs)
        self.calls.append((c.bytes, dict(c.calls)))
        return out

    def __getattr__(self, name):
        return getattr(self.step, name)


def _generate(size: int) -> dict:
    model = _llama()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    apply = zf.functional(model)

    def loss_fn(params, ids):
        return apply(params, input_ids=ids, labels=ids).loss

    step = tensor_parallel(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), size)
    state = step.init(apply.params)
    group = mesh(size).group("tp")
    counted = _Counted(step, group)
    got = zf.generate(counted, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, pad_token_id=0)
    with zf.collectives.counting(group=group) as whole:  # the whole call, apart (counters nested alike clash)
        again = zf.generate(step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, pad_token_id=0)
    assert torch.equal(again, got)
    with torch.no_grad():
        want = _llama().generate(PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    held = sum(t.numel() * t.element_size() for t in zf.tree.tree_leaves(step.full_params(state, local=True)))
    # 2 all-reduces per block (attention's output, the MLP's down), and one more where the embedding is split
    # over the vocabulary (each rank looks up its rows, the lookups summed)
    reduces = 2 * LAYERS + int(model.get_input_embeddings().weight.shape[0] < 64)
    # a head split over the vocabulary gathers its logits whole without gradients: one all-gather of the
    # last position's (generate keeps only those), batch x 64 fp32
    head = model.get_output_embeddings().weight.shape[0] < 64
    return {
        "got": got,
        "want": want,
        "calls": counted.calls,
        "bytes": whole.bytes,
        "weights": weights,
        "held": held,
        "reduces": reduces,
        "head": head,
    }


def _activations(batch: int, positions: int, reduces: int) -> int:
    """What one call counts on the tensor-parallel group: ``reduces`` all-reduces of batch x positions x
    hidden fp32 values, each counted as 2 x its bytes (zf.collectives.all_reduce)."""
    return reduces * (2 * batch * positions * HIDDEN * 4)


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_generates_one_processes_tokens_moving_activations_only(ranks, size):
    out = ranks(size).run(_generate, size)
    batch, prompt = PROMPTS.shape
    for rank, r in enumerate(out):
        assert r["got"].shape == (batch, prompt + NEW)
        assert torch.equal(r["got"], r["want"]), (rank, r["got"], r["want"])
        assert len(set(r["got"][:, prompt:].flatten().tolist())) > 2  # the model says something, not one token
        # the prompt's call, then one call per token after the first, each feeding one new position per row
        n = r["reduces"]
        logits = batch * 64 * 4 if r["head"] else 0
        kinds = {"all_reduce": n, **({"all_gather": 1} if r["head"] else {})}
        assert len(r["calls"]) == NEW
        assert r["calls"][0] == (_activations(batch, prompt, n) + logits, kinds), r["calls"][0]
        for call in r["calls"][1:]:
            assert call == (_activations(batch, 1, n) + logits, kinds), call
        # nothing else on the group (apply runs no batch check), and a token costs far less than the weights
        assert r["bytes"] == _activations(batch, prompt, n) + (NEW - 1) * _activations(batch, 1, n) + NEW * logits
        assert _activations(batch, 1, n) * 50 < r["weights"], (_activations(batch, 1, n), r["weights"])
        assert r["held"] < r["weights"]  # each rank holds its slices of the split layers only


def _under_shard_params() -> dict:
    """tp 2 x dp 2 under shard_params: tokens per call and gathered once, and the data axis' bytes of each."""
    from zerofn.transforms import shard_params

    model = _llama()
    apply = zf.functional(model)

    def loss_fn(params, ids):
        return apply(params, input_ids=ids, labels=ids).loss

    step = tensor_parallel(shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3))), 2)
    state = step.init(apply.params)
    out = {}
    for once in (False, True):
        with zf.collectives.counting(group=step.group) as c:  # the data-parallel axis, where units are gathered
            out[once] = zf.generate(
                step, state, PROMPTS, attention_mask=MASK, max_new_tokens=NEW, pad_token_id=0, gather_once=once
            )
        out[once, "gathers"] = c.calls.get("all_gather", 0)
    with torch.no_grad():
        out["want"] = _llama().generate(
            PROMPTS, attention_mask=MASK, max_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
    layout = state.spec.layout
    out["buckets"] = len(layout.buckets) + len(layout.frozen_buckets)
    return out


def test_tp2_by_dp2_under_shard_params_generates_per_call_and_gathered_once(ranks):
    for rank, r in enumerate(ranks(4).run(_under_shard_params)):
        assert torch.equal(r[False], r["want"]) and torch.equal(r[True], r["want"]), rank
        assert r[False, "gathers"] == NEW * r["buckets"] and r[True, "gathers"] == r["buckets"], (rank, r)
