"""context_parallel: a Hugging Face Llama (grouped-query attention) and a Qwen3 whose sequence is split over
cp ranks train as one process over the whole sequence, with Ulysses and ring attention, padding, zf.Mean,
under shard_params over dp x cp and beside tensor_parallel; comm_bytes is Ulysses' formula; bad sequences,
sizes and batches are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import TINY_DECODER, rank_slice, refusals, stats_bytes, tiny_llama, tiny_lora_llama
from torch import nn
from zerofn.transforms import (
    amp,
    context_parallel,
    offload,
    quantize,
    remat,
    shard_grads,
    shard_optimizer,
    shard_params,
    tensor_parallel,
)

import zerofn as zf

pytest.importorskip("transformers")

STEPS, BATCH, SEQ = 4, 4, 16


def _model(kind: str) -> nn.Module:
    if kind == "llama":
        return tiny_llama(max_position_embeddings=256)
    if kind == "lora":
        return tiny_lora_llama(max_position_embeddings=256)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**TINY_DECODER, head_dim=16, max_position_embeddings=256)).float()


def _batch(i: int, pad: bool, seq: int = SEQ) -> dict:
    g = torch.Generator().manual_seed(100 + i)
    ids = torch.randint(0, 64, (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    if pad:  # right padding on two rows, left padding on one (its first real token unscored: no label before it)
        mask[0, -5:] = 0
        mask[2, -1:] = 0
        mask[1, :3] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if pad:
        labels[1, 3] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _shifted(batch: dict) -> torch.Tensor:
    if "shift_labels" in batch:
        return batch["shift_labels"]
    labels = batch["labels"]
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)


def _loss_fn(apply, loss: str):
    def model_loss(params, batch):  # the model's own loss, from the labels it is given
        return apply(params, **batch).loss

    def mean_loss(params, batch):  # a loss of its own over this rank's tokens: zf.Mean
        out = apply(params, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        labels = _shifted(batch)
        logits = out.logits
        if hasattr(logits, "full_tensor"):  # tensor_parallel's vocabulary-split logits
            logits = logits.full_tensor()
        total = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")
        return zf.Mean(total, (labels != -100).sum())

    def hidden_loss(params, batch):  # the docs' recipe: the head's loss by chunks, from the last hidden states
        out = apply(
            params,
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            output_hidden_states=True,
            logits_to_keep=1,
        )
        labels = _shifted(batch)
        head = params["lm_head.weight"]
        total = zf.losses.chunked_cross_entropy(out.hidden_states[-1], head, labels, reduction="sum")
        return zf.Mean(total, (labels != -100).sum())

    return {"model": model_loss, "mean": mean_loss, "hidden": hidden_loss}[loss]


COMPOSE = {
    "plain": lambda s: s,
    "shard_optimizer": shard_optimizer,
    "shard_grads": shard_grads,
    "shard_params": shard_params,
    "remat": lambda s: remat(shard_params(s)),
    "amp": lambda s: amp(s, torch.bfloat16),
    "offload": lambda s: offload(shard_params(s), "cpu"),
    "qlora": lambda s: quantize(shard_params(s), "nf4"),  # long-context QLoRA: the frozen base held in nf4
}


def _train(case: tuple) -> dict:
    """``case``: (model, cp, method, tp, composition, loss, pad); cp 0: one process over the whole batch."""
    kind, cp, method, tp, compose, loss, pad = case
    apply = zf.functional(_model(kind))
    step = COMPOSE[compose](zf.train_step(_loss_fn(apply, loss), zf.optim.adamw(1e-3, eps=1e-4, weight_decay=0.1)))
    if tp:
        step = tensor_parallel(step, tp)
    if cp:
        step = context_parallel(step, cp, method=method)
    state = step.init(apply.params)
    here, data = zf.collectives.data_rank(step), (step.mesh.data_size if step.mesh is not None else 1)
    losses = []
    for i in range(STEPS):
        state, m = step(state, rank_slice(_batch(i, pad), here, data))
        losses.append(float(m["loss"]))
    buffers = sum(b.nbytes for b in apply.module.buffers() if b.is_floating_point())  # averaged over the group
    out = {"params": step.full_params(state), "losses": losses, "comm": int(m["comm_bytes"]), "name": step.name}
    return out | {"buffers": buffers}


def _cases(cases: list) -> dict:
    return {c: _train(c) for c in cases}


REFS: dict = {}


def _reference(kind: str, loss: str, pad: bool, compose: str = "plain") -> dict:
    key = (kind, loss, pad, compose)
    if key not in REFS:
        REFS[key] = _train((kind, 0, None, 0, compose, loss, pad))
    return REFS[key]


def _check(results: list, case: tuple, tol: float = 1e-5) -> None:
    kind, _, _, _, compose, loss, pad = case
    ref = _reference(kind, loss, pad, compose if compose in ("amp", "qlora") else "plain")
    for r in results:
        got = r[case]
        assert got["name"].startswith("context_parallel("), got["name"]
        worst = max(float((got["params"][k] - ref["params"][k]).abs().max()) for k in ref["params"])
        assert worst <= tol, (case, worst)
        assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) <= tol, (
            case,
            got["losses"],
            ref["losses"],
        )


def test_cp2_trains_as_one_process_over_the_whole_sequence(ranks):
    cases = [
        ("llama", 2, "ulysses", 0, "plain", "model", False),
        ("llama", 2, "ulysses", 0, "plain", "model", True),  # padding: the model's loss counts every token once
        ("llama", 2, "ulysses", 0, "plain", "mean", True),  # a loss of its own: zf.Mean over this rank's tokens
        ("qwen3", 2, "ulysses", 0, "plain", "model", True),
        ("llama", 2, "ulysses", 0, "shard_params", "model", True),  # ZeRO-3 over the cp ranks
        ("llama", 2, "ulysses", 0, "remat", "mean", True),
        ("llama", 2, "ulysses", 0, "amp", "model", False),
        ("llama", 2, "ring", 0, "plain", "model", True),
        ("qwen3", 2, "ring", 0, "plain", "mean", True),
        ("llama", 2, "ring", 0, "shard_params", "model", False),
        ("llama", 2, "ulysses", 0, "offload", "model", True),
        ("llama", 2, "ring", 0, "shard_params", "hidden", True),
        ("lora", 2, "ring", 0, "qlora", "model", True),
        ("llama", 2, "ring", 0, "plain", "model", False),  # last: its traffic is checked below
    ]
    results = ranks(2).run(_cases, cases)
    for case in cases:
        _check(results, case, 2e-2 if case[4] == "amp" else 1e-5)
    # Traffic, counted on every group the step uses: the gradients' all-reduce over the cp ranks (the step's
    # group: 2 x their bytes), the step's statistics (stats_bytes), the float buffers' average (the rotary
    # frequencies, as on any step's group) and attention's, per layer:
    # - Ulysses: q, k, v and the output cross once in forward and once in backward, this rank's tokens of each
    #   (2 key/value heads, which 2 ranks split: none repeated);
    # - ring: (cp - 1) k + v blocks in forward, as many in backward plus cp trips of the fp32 dk/dv accumulator.
    rows, tokens, layers, cp = BATCH, SEQ // 2, 2, 2
    q, kv = rows * tokens * 4 * 16 * 4, rows * tokens * 2 * 16 * 4  # fp32: 4 query and 2 key/value heads of 16
    params = results[0][cases[0]]["params"]
    grads = 2 * sum(p.numel() for p in params.values()) * 4 + stats_bytes(len(params), 2)
    grads += 2 * results[0][cases[0]]["buffers"]
    ulysses = layers * 2 * (q + 2 * kv + q)
    ring = layers * ((cp - 1) * 2 * kv + (cp - 1) * 2 * kv + cp * 2 * kv)
    for r in results:
        assert r[cases[0]]["comm"] == grads + ulysses, (r[cases[0]]["comm"], grads + ulysses)
        assert r[cases[-1]]["comm"] == grads + ring, (r[cases[-1]]["comm"], grads + ring)


def test_cp4_cp2_by_dp2_and_tp2_by_cp2_train_as_one_process(ranks):
    cases = [
        ("llama", 4, "ulysses", 0, "plain", "model", True),  # 2 key/value heads repeated for 4 ranks
        ("qwen3", 4, "ulysses", 0, "plain", "mean", True),
        # dp 2 x cp 2: ZeRO-3 over all 4 ranks; zf.Mean: one process over the concatenated batch's tokens
        ("llama", 2, "ulysses", 0, "shard_params", "mean", True),
        ("llama", 2, "ulysses", 0, "shard_grads", "mean", False),
        ("llama", 2, "ulysses", 2, "plain", "model", True),  # tp 2 x cp 2: 2 query heads a rank, cut over cp
        ("llama", 2, "ulysses", 2, "shard_optimizer", "mean", True),
        ("llama", 4, "ring", 0, "plain", "model", True),
        ("qwen3", 2, "ring", 0, "shard_params", "mean", True),
        ("llama", 2, "ring", 2, "plain", "model", False),
    ]
    results = ranks(4).run(_cases, cases)
    for case in cases:
        _check(results, case)


def test_tp2_by_cp2_by_dp2_on_eight_ranks_trains_as_one_process(ranks):
    # the 3-D mesh dp_shard x cp x tp: ZeRO-3 over the 4 ranks of each tensor-parallel slice (dp x cp), heads
    # split over tp, the sequence over cp; zf.Mean: one process over the concatenated batch's tokens
    cases = [
        ("llama", 2, "ulysses", 2, "shard_params", "mean", True),
        ("llama", 2, "ring", 2, "shard_grads", "mean", True),
    ]
    results = ranks(8).run(_cases, cases)
    for case in cases:
        _check(results, case)


def _refusals() -> dict:
    apply = zf.functional(_model("llama"))
    step = context_parallel(zf.train_step(_loss_fn(apply, "model"), zf.optim.adamw(1e-3)), 2, method="ring")
    state = step.init(apply.params)
    out = refusals(
        {
            "length": lambda: step(state, _batch(0, False, seq=14)),
            "tuple": lambda: step(state, (torch.zeros(2, 16, dtype=torch.long),)),
            "size": lambda: context_parallel(zf.train_step(_loss_fn(apply, "model"), zf.optim.adamw(1e-3)), 3),
            "method": lambda: context_parallel(
                zf.train_step(_loss_fn(apply, "model"), zf.optim.adamw(1e-3)), 2, method="x"
            ),
            "labels": lambda: _labels_read(apply),
            "plain": lambda: context_parallel(zf.train_step(lambda p, b: p["w"].sum(), zf.optim.sgd(0.1)), 2).init(
                {"w": torch.ones(2)}
            ),
        },
        (ValueError, KeyError),
    )
    out["count"] = int(state.count)
    return out


def _labels_read(apply) -> None:
    def loss_fn(params, batch):
        logits = apply(params, input_ids=batch["input_ids"]).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    step = context_parallel(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), 2)
    step(step.init(apply.params), _batch(0, False))


def test_bad_sequences_sizes_and_batches_are_refused(ranks):
    for out in ranks(2).run(_refusals):
        assert "the sequence has 14 tokens" in out["length"] and "pad it to 16 tokens" in out["length"], out
        assert "cuts a batch given as a mapping" in out["tuple"], out["tuple"]
        assert "size 3 does not divide the world size 2" in out["size"], out["size"]
        assert "method must be one of ['ulysses', 'ring']" in out["method"], out["method"]
        assert "batch['shift_labels']" in out["labels"], out["labels"]
        assert "transformers' attention interface" in out["plain"], out["plain"]
        assert out["count"] == 0  # nothing was updated by the refused steps


def _checkpoint_case(root: str) -> dict:
    """A state saved at cp 2 (ZeRO-3 over the cp ranks) loads under plain ZeRO-3, without any parallelism and
    at cp 1: parameters are whole along cp, so every checkpoint loads at any cp size."""
    apply = zf.functional(_model("llama"))
    step = context_parallel(shard_params(zf.train_step(_loss_fn(apply, "model"), zf.optim.adamw(1e-3))), 2)
    state, _ = step(step.init(apply.params), _batch(0, True))
    zf.checkpoint.save(state, f"{root}/cp2")
    want = step.full_params(state)
    out = {}
    for name, make in {"plain": lambda s: s, "shard_params": shard_params}.items():
        other = zf.functional(_model("llama"))
        s = make(zf.train_step(_loss_fn(other, "model"), zf.optim.adamw(1e-3)))
        got = s.full_params(zf.checkpoint.load(f"{root}/cp2", s))
        out[name] = max(float((got[k] - want[k]).abs().max()) for k in want)
    return out


def test_a_state_saved_at_cp2_loads_without_context_parallelism(ranks, tmp_path):
    for out in ranks(2).run(_checkpoint_case, str(tmp_path)):
        assert out == {"plain": 0.0, "shard_params": 0.0}, out


def _split_checkpoint_case(root: str) -> float:
    """tp 2 x cp 2 under shard_params: each tensor-parallel part saved by its step's group (dp x cp), loaded
    back into a fresh state of the same composition."""
    made = []
    for _ in range(2):
        apply = zf.functional(_model("llama"))
        step = shard_params(zf.train_step(_loss_fn(apply, "model"), zf.optim.adamw(1e-3)))
        made.append((apply, context_parallel(tensor_parallel(step, 2), 2)))
    (apply, step), (other, again) = made
    state, _ = step(step.init(apply.params), rank_slice(_batch(0, True), zf.collectives.data_rank(step), 1))
    zf.checkpoint.save(state, f"{root}/tp2_cp2")
    want, got = step.full_params(state), again.full_params(zf.checkpoint.load(f"{root}/tp2_cp2", again))
    return max(float((got[k] - want[k]).abs().max()) for k in want)


def test_a_state_saved_at_tp2_by_cp2_loads_back(ranks, tmp_path):
    assert ranks(4).run(_split_checkpoint_case, str(tmp_path)) == [0.0] * 4


def _long(chunked: bool, tiles: int | None) -> tuple[dict, int, list, bool]:
    """One process (cp 1) on a sequence long enough that the logits and the MLPs' activations lead."""
    from helpers import tiny_llama

    apply = zf.functional(tiny_llama(vocab_size=2048, intermediate_size=512, max_position_embeddings=1024))
    seen = []

    def loss_fn(params, batch):
        out = apply(params, **batch)
        seen.append(out.logits is None)
        return out.loss

    # SGD: the parameters move by the gradients themselves (Adam would scale their rounding up to its step)
    step = context_parallel(zf.train_step(loss_fn, zf.optim.sgd(0.1)), 1, chunked_loss=chunked, mlp_tiles=tiles)
    state = step.init(apply.params)
    ids = torch.randint(0, 2048, (1, 512), generator=torch.Generator().manual_seed(0))
    state, m = step(state, {"input_ids": ids, "labels": ids})  # the optimizer's state exists after the first
    with zf.memory.track() as t:
        state, m = step(state, {"input_ids": ids, "labels": ids})
    return step.full_params(state), t.peak, [float(m["loss"])], all(seen)


def test_the_chunked_loss_and_tiled_mlps_lower_the_peak_and_change_no_number():
    whole, whole_peak, whole_loss, none_whole = _long(False, None)
    chunked, chunked_peak, chunked_loss, none_chunked = _long(True, None)
    tiled, tiled_peak, tiled_loss, _ = _long(True, 4)
    assert not none_whole and none_chunked  # the model's logits are never made under the chunked loss
    for got, loss in ((chunked, chunked_loss), (tiled, tiled_loss)):
        assert max(float((got[k] - whole[k]).abs().max()) for k in whole) <= 1e-5
        assert abs(loss[0] - whole_loss[0]) <= 1e-5
    # the model's fp32 logits (512 x 2048 x 4 bytes: 4 MiB), kept for backward beside their log-softmax, are
    # never made: the chunks (one here, 64 MiB of logits a chunk) hold the softmax in place and the gradients
    logits = 512 * 2048 * 4
    assert chunked_peak <= whole_peak - logits, (chunked_peak, whole_peak)
    assert tiled_peak < chunked_peak, (tiled_peak, chunked_peak)
