"""pipeline_parallel over shard_params (ZeRO-3 within each stage, as torchtitan composes FSDP2 with a pipeline):
a Hugging Face Llama and a GPT-2 (its head tied to the input embedding, lent from the first stage to the last)
at pp 2 x dp 2 train as one process over the whole batch, with 1F1B, interleaved and zero-bubble schedules.
Each unit is gathered for every micro-batch's forward and backward (or, with reshard_between_microbatches=False,
once a step), its gradient accumulates over the micro-batches and is reduce-scattered once a step."""

from __future__ import annotations

import pytest
import torch
from helpers import rank_slice, tiny_llama
from torch import nn
from zerofn.transforms import pipeline_parallel, shard_params

import zerofn as zf

pytest.importorskip("transformers")

STEPS, ROWS, SEQ, M = 4, 8, 16, 4


def _model(kind: str, layers: int = 4) -> nn.Module:
    if kind == "llama":
        return tiny_llama(num_hidden_layers=layers)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=layers, n_head=4, eos_token_id=0, **no_dropout)
    return GPT2LMHeadModel(cfg).float()


def _batch(i: int) -> dict:
    ids = torch.randint(0, 64, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + i))
    return {"input_ids": ids, "labels": ids}


def _pipelined(step, schedule: str, v: int, reshard: bool):
    kw = dict(microbatches=M, schedule=schedule, virtual_stages=v)
    return pipeline_parallel(step, 2, reshard_between_microbatches=reshard, **kw)


def _train(case: tuple) -> dict:
    """``case``: (model, schedule, virtual stages, reshard between micro-batches); schedule None: one process
    over the whole batch."""
    kind, schedule, v, reshard = case
    apply = zf.functional(_model(kind))
    step = zf.train_step(lambda p, b: apply(p, **b).loss, zf.optim.adamw(1e-3, eps=1e-4, weight_decay=0.1))
    if schedule is not None:
        step = _pipelined(shard_params(step), schedule, v, reshard)
    state = step.init(apply.params)
    here, data = zf.collectives.data_rank(step), (step.mesh.data_size if step.mesh is not None else 1)
    group = step.mesh.data_group if step.mesh is not None else None
    out: dict = {"losses": [], "calls": {}}
    for i in range(STEPS):
        with zf.collectives.counting(group) as counted:
            state, met = step(state, rank_slice(_batch(i), here, data))
        out["losses"].append(float(met["loss"]))
        out["calls"] = counted.calls  # the last step's collectives over the stage's data-parallel ranks
    out["buckets"] = len(state.spec.layout.buckets)
    out["params"] = {k: t.detach().clone() for k, t in step.full_params(state).items()}
    out["name"] = step.name
    return out


def _cases(cases: list) -> dict:
    return {c: _train(c) for c in cases}


def _check(results: list, case: tuple, ref: dict) -> None:
    for r in results:
        got = r[case]
        assert got["name"] == "pipeline_parallel(shard_params(train_step))", got["name"]
        mine = got["params"]
        assert mine and set(mine) <= set(ref["params"]), case
        worst, name = max((float((mine[k] - ref["params"][k]).abs().max()), k) for k in mine)
        assert worst <= 1e-5, (case, name, worst)
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= 1e-5, (case, got["losses"])
        # each unit's gradient, summed over the micro-batches, reduce-scattered once a step
        assert got["calls"]["reduce_scatter"] == got["buckets"], (case, got["calls"])
    held = set().union(*(set(r[case]["params"]) for r in results))
    assert held == set(ref["params"]), case


def test_pp2_over_shard_params_trains_as_one_process(ranks):
    cases = [
        ("llama", "1f1b", 1, True),
        ("llama", "1f1b", 1, False),
        ("gpt2", "1f1b", 1, True),  # the tied head: gathered from its unit on the first stage, lent to the last
        ("llama", "interleaved", 2, True),
        ("gpt2", "interleaved", 2, False),
        ("gpt2", "zero_bubble", 2, True),  # weight gradients written to .grad without hooks
    ]
    results = ranks(4).run(_cases, cases)
    refs = {kind: _train((kind, None, 1, True)) for kind in ("llama", "gpt2")}
    for case in cases:
        _check(results, case, refs[case[0]])
    for r in results:
        # kept gathered through the step: each unit's buckets gathered once (the tied head's unit too, gathered
        # to lend it)
        for case in (cases[1], cases[4]):
            assert r[case]["calls"]["all_gather"] == r[case]["buckets"], (case, r[case]["calls"])
        # released between micro-batches: a stage's first block gathered for each micro-batch's forward and
        # backward, its last block and the root (kept from a forward into its backward) once per micro-batch
        each = r[cases[0]]
        assert each["calls"]["all_gather"] == M * (2 + 1 + 1), each["calls"]
