"""pipeline_parallel: a Hugging Face Llama and a GPT-2 (its head tied to the input embedding) cut into stages
train as one process over the whole batch, with each schedule, at pp 2 and pp 4, beside shard_optimizer,
shard_grads, tensor_parallel, remat and offload; amp's overflow skips on every stage alike; the loss, a
zf.Mean, aux values, the global gradient norm and clipping hold across stages; comm_bytes counts the
activations each rank sends; bad settings and batches are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rank_slice, refusals, tiny_llama, tiny_lora_llama
from torch import nn
from zerofn.transforms import (
    amp,
    context_parallel,
    expert_parallel,
    offload,
    pipeline_parallel,
    quantize,
    remat,
    shard_grads,
    shard_optimizer,
    tensor_parallel,
)
from zerofn.transforms.pipeline_parallel import Parts

import zerofn as zf

pytest.importorskip("transformers")

STEPS, ROWS, SEQ = 4, 8, 16


def _model(kind: str, layers: int = 4) -> nn.Module:
    if kind == "llama":
        return tiny_llama(num_hidden_layers=layers)
    if kind == "lora":
        return tiny_lora_llama(num_hidden_layers=layers)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg = GPT2Config(vocab_size=64, n_positions=32, n_embd=64, n_layer=layers, n_head=4, eos_token_id=0, **no_dropout)
    return GPT2LMHeadModel(cfg).float()


def _batch(i: int, pad: bool = False) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, 64, (ROWS, SEQ), generator=g)
    labels = ids.clone()
    if pad:  # rows of unequal counts: a zf.Mean weighs each token once (a mean per micro-batch would not)
        labels[1, :5] = -100
    return {"input_ids": ids, "labels": labels, "boom": torch.ones(ROWS)}


def _loss_fn(apply, loss: str):
    def model_loss(params, batch):
        batch = dict(batch)
        boom = batch.pop("boom").max()  # inf: every gradient of the step inf
        return apply(params, **batch).loss * boom

    def mean_loss(params, batch):  # a loss of its own: zf.Mean, with an aux value
        out = apply(params, input_ids=batch["input_ids"])
        logits = out.logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        labels = batch["labels"][:, 1:]
        total = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(), reduction="sum")
        return zf.Mean(total, (labels != -100).sum()), {"tokens": (labels != -100).float().mean()}

    return {"model": model_loss, "mean": mean_loss}[loss]


COMPOSE = {
    "plain": lambda s: s,
    "shard_optimizer": shard_optimizer,
    "shard_grads": shard_grads,
    "remat": remat,
    "offload": lambda s: offload(shard_optimizer(s), "cpu"),
    "tp": lambda s: tensor_parallel(s, 2),
    "amp": lambda s: amp(s, torch.float16, init_scale=2.0**8),
    "cp": lambda s: context_parallel(s, 2),
    "qlora": lambda s: quantize(s, "nf4"),  # the frozen base held in nf4 on each stage
    "tp+shard_optimizer": lambda s: tensor_parallel(shard_optimizer(s), 2),
}
ONE_PROCESS = {"amp": "amp", "qlora": "qlora"}  # the reference's composition: one process's same numbers


def _train(case: tuple) -> dict:
    """``case``: (model, layers, pp, schedule, virtual stages, microbatches, composition, loss, overflow steps,
    clip); pp 0: one process over the whole batch."""
    kind, layers, pp, schedule, v, m, compose, loss, overflows, clip, split = case
    apply = zf.functional(_model(kind, layers))
    opt = zf.optim.adamw(1e-3, eps=1e-4, weight_decay=0.1)
    if clip:
        opt = zf.optim.chain(zf.optim.clip_by_global_norm(clip), opt)
    accumulate = 2 if compose == "accumulate" else 1
    step = zf.train_step(_loss_fn(apply, loss), opt, accumulate_steps=accumulate)
    step = COMPOSE.get(compose, lambda s: s)(step)
    if pp:
        step = pipeline_parallel(step, pp, microbatches=m, schedule=schedule, virtual_stages=v, split=split)
    state = step.init(apply.params)
    here, data = zf.collectives.data_rank(step), (step.mesh.data_size if step.mesh is not None else 1)
    out: dict = {"losses": [], "norms": [], "skipped": [], "scales": [], "tokens": [], "in_flight": 0}
    for i in range(STEPS * accumulate):
        batch = _batch(i // accumulate, pad=loss == "mean")
        if i in overflows:
            batch["boom"] = torch.full((ROWS,), float("inf"))
        if accumulate > 1:  # two calls of half the rows each
            batch = rank_slice(batch, i % accumulate, accumulate)
        state, met = step(state, rank_slice(batch, here, data))
        if (i + 1) % accumulate:
            continue
        out["in_flight"] = max(out["in_flight"], int(met.get("pipeline_in_flight", 0)))
        out["losses"].append(float(met["loss"]))
        out["norms"].append(float(met["grad_norm"]))
        out["skipped"].append(bool(met["skipped"]))
        out["scales"].append(float(met.get("loss_scale", 1.0)))
        out["tokens"].append(float(met.get("tokens", 0.0)))
    if kind == "llama" and compose == "plain" and loss == "model":  # evaluation: step.apply, the whole model
        out["logits"] = step.apply(state, input_ids=_batch(0)["input_ids"]).logits
    params = step.full_params(state)
    return out | {
        "params": {k: v.detach().clone() for k, v in params.items()},
        "comm": int(met["comm_bytes"]),
        "name": step.name,
        "count": int(state.count),
        "idle": float(met["pipeline_idle"]) if pp else 0.0,
    }


def _cases(cases: list) -> dict:
    return {c: _train(c) for c in cases}


REFS: dict = {}


def _reference(case: tuple) -> dict:
    kind, layers, _, _, _, m, compose, loss, overflows, clip, _ = case
    key = (kind, layers, ONE_PROCESS.get(compose, "plain"), loss, overflows, clip)
    if key not in REFS:
        REFS[key] = _train((kind, layers, 0, None, 1, m, key[2], loss, overflows, clip, None))
    return REFS[key]


def _check(results: list, case: tuple, tol: float = 1e-5) -> None:
    ref = _reference(case)
    for r in results:
        got = r[case]
        assert got["name"].startswith("pipeline_parallel("), got["name"]
        mine = got["params"]
        # each rank holds its stage's parameters (full_params gathers the tp slices, not the other stages)
        assert mine and set(mine) <= set(ref["params"]), case
        worst, name = max((float((mine[k] - ref["params"][k]).abs().max()), k) for k in mine)
        assert worst <= tol, (case, name, worst)
        # (an accumulating step reports its last call's loss: half the batch)
        for key in ("norms",) if case[6] == "accumulate" else ("losses", "norms"):
            assert max(abs(a - b) for a, b in zip(got[key], ref[key])) <= max(tol, 1e-5) * 10, (case, key, got[key])
        assert got["skipped"] == ref["skipped"] and got["scales"] == ref["scales"], (case, got["skipped"])
        assert got["count"] == ref["count"], case
        assert got["tokens"] == pytest.approx(ref["tokens"], abs=1e-6), case
        if "logits" in ref and "logits" in got:
            assert float((got["logits"] - ref["logits"]).abs().max()) <= 1e-4, case
    # together the stages hold every parameter of the model
    held = set().union(*(set(r[case]["params"]) for r in results))
    assert held == set(ref["params"]), (case, set(ref["params"]) - held)


def _case(
    kind="llama",
    layers=4,
    pp=2,
    schedule="1f1b",
    v=1,
    m=4,
    compose="plain",
    loss="model",
    overflows=(),
    clip=0,
    split=None,
):
    return (kind, layers, pp, schedule, v, m, compose, loss, tuple(overflows), clip, split)


def test_pp2_trains_as_one_process_with_each_schedule(ranks):
    cases = [
        _case(),
        _case(kind="gpt2"),  # the head tied to the embedding: lent to the last stage, its gradient returned
        _case(schedule="interleaved", v=2),
        _case(kind="gpt2", schedule="interleaved", v=2),
        _case(schedule="zero_bubble", v=2),
        _case(kind="gpt2", schedule="zero_bubble"),
        _case(loss="mean"),  # a zf.Mean over rows of unequal counts, and an aux value
        _case(clip=0.5),  # clipping by the norm over every stage
        _case(compose="remat", m=2),
        _case(compose="offload", loss="mean"),
        _case(compose="accumulate"),  # accumulate_steps=2: two pipelined calls per update
        _case(kind="lora", compose="qlora"),  # QLoRA: each stage's frozen base in nf4, its adapters trained
        _case(compose="amp", overflows=(1,)),  # fp16: an overflow skips on every stage, the scale backs off
    ]
    results = ranks(2).run(_cases, cases)
    for case in cases:
        _check(results, case, 2e-3 if case[6] == "amp" else 1e-5)
    for message in ranks(2).run(_hybrid_refused):
        assert "does not run beside hybrid sharding (replicate=, hpz=)" in message and "leave replicate=" in message
    # 1F1B holds the activations of p - s micro-batches on stage s (at most m): 2 on the first, 1 on the last
    assert [r[cases[0]]["in_flight"] for r in results] == [2, 1]
    amp_case = cases[-1]
    assert results[0][amp_case]["skipped"] == [False, True, False, False]
    # Traffic of the plain Llama: each micro-batch's hidden states (rows/m x seq x 64 fp32) go forward from
    # stage 0 and their gradient back from stage 1; the loss and the norm cross the pipeline (3 + 1 float64,
    # all-reduced: twice); no gradient reduction (one rank per stage).
    hidden = ROWS * SEQ * 64 * 4
    for r in results:
        assert r[cases[0]]["comm"] == hidden + 2 * 8 * (3 + 1), r[cases[0]]["comm"]
    # GPT-2: the tied weight (64 x 64) goes to the last stage and its gradient back
    for r in results:
        assert r[cases[1]]["comm"] == hidden + 64 * 64 * 4 + 2 * 8 * (3 + 1), r[cases[1]]["comm"]


def test_pp4_and_pp2_beside_data_and_tensor_parallelism(ranks):
    cases = [
        _case(pp=4, m=4),
        _case(kind="gpt2", pp=4, m=8),
        _case(layers=8, pp=4, schedule="interleaved", v=2, m=4),
        _case(kind="gpt2", pp=4, schedule="zero_bubble", m=4),
        _case(pp=4, split=(2, 3, 4)),  # the last stage the final norm, the head and the loss alone
        _case(kind="gpt2", pp=4, split=(0, 2, 3)),  # the first the embeddings alone (the tied one lent on)
        _case(compose="shard_optimizer", loss="mean"),  # pp 2 x dp 2: DeepSpeed's pipeline with ZeRO-1
        _case(kind="gpt2", compose="shard_grads"),
        _case(compose="tp"),  # pp 2 x tp 2
        _case(compose="cp", m=2),  # pp 2 x cp 2: each micro-batch's sequence cut over the cp ranks
    ]
    results = ranks(4).run(_cases, cases)
    for case in cases:
        _check(results, case)
    # 1F1B at pp 4: stage s holds min(4 - s, m) micro-batches' activations
    assert [r[cases[0]]["in_flight"] for r in results] == [4, 3, 2, 1]


def test_pp2_tp2_dp2_on_eight_ranks(ranks):
    """A 3-D mesh: pipeline x tensor x ZeRO-1 data parallelism (DeepSpeed's and Megatron's layout)."""
    case = _case(compose="tp+shard_optimizer", loss="mean")
    results = ranks(8).run(_cases, [case])
    _check(results, case)


def _hybrid_refused() -> str:
    apply = zf.functional(_model("llama", 2))
    step = shard_optimizer(zf.train_step(_loss_fn(apply, "model"), zf.optim.sgd(0.1)), replicate=2)
    return refusals({"hybrid": lambda: pipeline_parallel(step, 1, microbatches=2).init(apply.params)})["hybrid"]


def _refused() -> dict:
    apply = zf.functional(_model("llama", 2))
    step = zf.train_step(_loss_fn(apply, "model"), zf.optim.sgd(0.1))
    calls = {
        "stages": lambda: pipeline_parallel(step, 0, microbatches=2),
        "microbatches": lambda: pipeline_parallel(step, 1, microbatches=0),
        "schedule": lambda: pipeline_parallel(step, 1, microbatches=2, schedule="gpipe"),
        "1f1b virtual": lambda: pipeline_parallel(step, 1, microbatches=2, virtual_stages=2),
        "interleaved one": lambda: pipeline_parallel(step, 1, microbatches=2, schedule="interleaved"),
        "too few blocks": lambda: pipeline_parallel(
            step, 1, microbatches=2, schedule="zero_bubble", virtual_stages=3
        ).init(apply.params),
        "split": lambda: pipeline_parallel(
            step, 1, microbatches=2, schedule="zero_bubble", virtual_stages=2, split=[5]
        ).init(apply.params),
    }
    plain = zf.functional(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    calls["no parts"] = lambda: pipeline_parallel(
        zf.train_step(lambda p, b: plain(p, b).sum(), zf.optim.sgd(0.1)), 1, microbatches=2
    ).init(plain.params)
    calls["expert_parallel"] = lambda: pipeline_parallel(expert_parallel(step, 1), 1, microbatches=2).init(apply.params)
    piped = pipeline_parallel(step, 1, microbatches=3)
    state = piped.init(apply.params)
    calls["rows"] = lambda: piped(state, _batch(0))
    return refusals(calls)


def test_refusals_say_what_to_do():
    got = _refused()
    assert "int >= 1" in got["stages"] and "int >= 1" in got["microbatches"]
    assert "'1f1b', 'interleaved', 'zero_bubble'" in got["schedule"]
    assert "schedule='interleaved'" in got["1f1b virtual"] and "virtual_stages=2" in got["interleaved one"]
    assert "2 blocks" in got["too few blocks"] and "stages x virtual_stages <= blocks" in got["too few blocks"]
    assert "split=" in got["split"] and "non-decreasing block indices" in got["split"]
    assert "parts=Parts(" in got["no parts"] and "Sequential" in got["no parts"]
    assert "microbatches=3" in got["rows"] and "[8]" in got["rows"]
    assert "does not run beside expert_parallel" in got["expert_parallel"]


def test_parts_name_a_model_of_its_own(ranks):
    """A model whose parts have other names cuts where ``parts`` says, and trains as one process."""
    results = ranks(2).run(_custom)
    ref = _custom(pp=False)
    for r in results:
        worst = max(float((r[k] - ref[k]).abs().max()) for k in r)
        assert worst <= 1e-5, worst


class _Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(16, 16)

    def forward(self, x):  # a block takes the hidden states and returns them
        return x + torch.tanh(self.mix(x))


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList(_Residual() for _ in range(4))
        self.final = nn.LayerNorm(16)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.final(x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = _Body()
        self.out = nn.Linear(16, 32)

    def forward(self, ids):
        return self.out(self.body(ids))


def _custom(pp: bool = True) -> dict:
    apply = zf.functional(_Net())

    def loss_fn(params, ids):
        return F.cross_entropy(apply(params, ids).flatten(0, 1), ids.flatten())

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    if pp:
        parts = Parts(blocks="body.blocks", embedding="body.embed", norm="body.final")
        step = pipeline_parallel(step, 2, microbatches=2, parts=parts, split=[1])
    state = step.init(apply.params)
    for i in range(3):
        state, _ = step(state, torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(i)))
    return {k: v.clone() for k, v in step.full_params(state).items()}
