"""``zf.Mean(total, count)`` on real gloo ranks: a Hugging Face masked LM (labels -100 outside the masked positions)
and a causal LM fine-tuned on responses only (labels -100 on the prompt and the right padding), with a different
number of label tokens on every rank and every micro-step (one micro-batch with none), accumulate_steps=2 and AdamW.
Under every composition, and through ``from_deepspeed``, the parameters equal one process fed the concatenated batch
(zerofn's, and torch's own AdamW driving the module on sum / count), and so do the reported loss and count. Without
``zf.Mean`` (each rank's own token mean) the step trains something else: the mean of the micro-batches' means."""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import compositions, max_abs_diff

import zerofn as zf

pytest.importorskip("transformers")

LR, WD, EPS = 1e-2, 0.1, 1e-8
WORLD, ACCUM, MICRO, STEPS = 2, 2, 2, 3  # ranks, micro-steps per update, rows per micro-batch, updates
ROWS, SEQ, VOCAB, PAD, MASK = WORLD * ACCUM * MICRO, 12, 64, 0, 1
# Items (label tokens) in each row of each update's global batch, in the order the ranks feed them: rank 0's
# micro-steps 0 and 1, then rank 1's (MICRO rows each). Per micro-batch: 3, 13, 0, 11 / 15, 2, 6, 11 / 3, 7, 16, 2.
ITEMS = (
    (1, 2, 6, 7, 0, 0, 3, 8),
    (8, 7, 1, 1, 4, 2, 5, 6),
    (2, 1, 3, 4, 8, 8, 1, 1),
)
MODELS = ("bert", "gpt2")
STAGES = ("plain", "shard_optimizer", "shard_grads", "shard_params", "offload", "offload_early", "remat")


# ---------------------------------------------------------------- the models, their data and their losses


def _model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """The same tiny Hugging Face model (values included) on every call."""
    import transformers
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "bert":
        cfg = BertConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=SEQ,
            type_vocab_size=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        model = BertForMaskedLM(cfg)
    else:
        # GPT-2, not Llama: Llama's RMSNorm computes in float32 whatever the parameters' dtype, which leaves a
        # float64 run float32's rounding (a gradient 1e-7 off, relative; Adam makes it 2e-5 after 3 updates)
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=16,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = GPT2LMHeadModel(cfg)
    return model.to(dtype).train()


def _row(kind: str, items: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) of one row holding ``items`` label tokens."""
    ids = torch.randint(2, VOCAB, (SEQ,), generator=g)
    labels = torch.full((SEQ,), -100)
    attention = torch.ones(SEQ, dtype=torch.int64)
    if kind == "bert":  # masked LM: the masked positions are the items
        where = torch.randperm(SEQ, generator=g)[:items]
        labels[where] = ids[where]
        ids[where] = MASK
    else:  # SFT: a prompt (not learned), a response of ``items`` tokens (learned), right padding
        prompt = int(torch.randint(1, SEQ - items + 1, (), generator=g))
        end = prompt + items
        labels[prompt:end] = ids[prompt:end]
        ids[end:], attention[end:] = PAD, 0
    return ids, attention, labels


@functools.cache
def _global_batch(kind: str, i: int) -> dict:
    """Update ``i``'s global batch (ROWS rows), the same on every rank."""
    g = torch.Generator().manual_seed(1000 * MODELS.index(kind) + i)
    rows = [_row(kind, n, g) for n in ITEMS[i]]
    ids, attention, labels = (torch.stack(t) for t in zip(*rows))
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


def _micro(batch: dict, rank: int, m: int) -> dict:
    """Rank ``rank``'s ``m``-th micro-batch of a global batch."""
    lo = (rank * ACCUM + m) * MICRO
    return {k: v[lo : lo + MICRO] for k, v in batch.items()}


def _sum_count(kind: str, forward, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hugging Face way: the summed cross-entropy over the label tokens, and how many there are (the causal
    LM's logits at t predict the token at t + 1)."""
    logits = forward(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    if kind == "gpt2":
        logits, labels = logits[:, :-1], labels[:, 1:]
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return total, (labels != -100).sum()


def _loss_fn(kind: str, apply, mean: bool, int_count: bool = False):
    """zerofn's loss_fn: ``zf.Mean`` over the label tokens (``int_count``: the count a Python int, not a tensor), or
    (``mean=False``) this micro-batch's own token mean (count clamped at 1: a micro-batch without labels
    contributes 0, not nan)."""

    def loss_fn(params, batch):
        forward = lambda **kw: apply(params, **kw, **({"use_cache": False} if kind == "gpt2" else {}))  # noqa: E731
        total, count = _sum_count(kind, forward, batch)
        if not mean:
            return total / count.clamp(min=1)
        return zf.Mean(total, int(count) if int_count else count)

    return loss_fn


def _items(i: int, micro: int | None = None) -> int:
    """Label tokens in update ``i``'s global batch (``micro``: in the ranks' ``micro``-th micro-batches only)."""
    spans = [(r * ACCUM + m) * MICRO for r in range(WORLD) for m in range(ACCUM) if micro is None or m == micro]
    return sum(sum(ITEMS[i][lo : lo + MICRO]) for lo in spans)


# ---------------------------------------------------------------- zerofn on the ranks


def _stage(name: str):
    """helpers' compositions, offload(early=True) and remat, by name."""
    from zerofn.transforms import offload, remat

    extra = {"offload_early": lambda s: offload(s, "cpu", early=True), "remat": remat}
    return extra[name] if name in extra else compositions()[name]


def _optimizer():
    return zf.optim.adamw(LR, eps=EPS, weight_decay=WD)


def _zf_run(kind: str, stage: str, mean: bool) -> dict:
    """STEPS updates on this rank's micro-batches: the full parameters (amp's fp32 masters) and each micro-step's
    (loss, count) metrics."""
    dtype = torch.float32 if stage == "amp" else torch.float64
    apply = zf.functional(_model(kind, dtype))
    step = _stage(stage)(zf.train_step(_loss_fn(kind, apply, mean), _optimizer(), ACCUM))
    return _drive(step, step.init(apply.params), kind, master=stage == "amp")


def _drive(step, state, kind: str, master: bool = False) -> dict:
    rank = zf.collectives.rank()
    seen = []
    for i in range(STEPS):
        for m in range(ACCUM):
            state, metrics = step(state, _micro(_global_batch(kind, i), rank, m))
            count = float(metrics["count"]) if "count" in metrics else None
            seen.append((float(metrics["loss"]), count, bool(metrics["skipped"])))
    return {"params": step.full_params(state, master=master), "metrics": seen, "name": step.name}


def _zf_deepspeed(kind: str) -> dict:
    """The same run built by from_deepspeed: ZeRO-3 with the optimizer state in CPU RAM."""
    config = {
        "train_batch_size": ROWS,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ACCUM,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": WD, "betas": [0.9, 0.999]}},
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    }
    apply = zf.functional(_model(kind, torch.float64))
    step, batch = zf.from_deepspeed(config, _loss_fn(kind, apply, True, int_count=True))
    out = _drive(step, step.init(apply.params), kind)
    out["sizes"] = (step.accumulate_steps, batch.micro_batch_size)
    return out


def _run_case(case: tuple):
    kind, stage, mean = case
    return _zf_deepspeed(kind) if stage == "deepspeed" else _zf_run(kind, stage, mean)


def _rank_cases(cases: list) -> dict:
    return {case: _run_case(case) for case in cases}


CASES = (
    [(kind, stage, True) for kind in MODELS for stage in (*STAGES, "amp")]
    + [(kind, stage, False) for kind in MODELS for stage in ("plain", "amp")]
    + [("gpt2", "deepspeed", True)]
)


@pytest.fixture(scope="module")
def results(ranks) -> list[dict]:
    """Each rank's {case: result}: every case in one run of the 2 ranks."""
    return ranks(WORLD).run(_rank_cases, CASES)


# ---------------------------------------------------------------- the references, on this process


@functools.cache
def _one_process(kind: str, dtype: torch.dtype = torch.float64) -> dict:
    """zerofn on one process (world 1): a plain step (amp's, for float32), accumulate_steps=1, fed each whole
    global batch, the loss a zf.Mean over it."""
    assert zf.collectives.world_size() == 1
    from zerofn.transforms import amp

    apply = zf.functional(_model(kind, dtype))
    step = zf.train_step(_loss_fn(kind, apply, True), _optimizer())
    step = amp(step, torch.bfloat16) if dtype == torch.float32 else step
    state, seen = step.init(apply.params), []
    for i in range(STEPS):
        state, metrics = step(state, _global_batch(kind, i))
        seen.append((float(metrics["loss"]), float(metrics["count"])))
    return {"params": step.full_params(state, master=dtype == torch.float32), "metrics": seen}


@functools.cache
def _torch_reference(kind: str, weighting: str = "tokens") -> dict:
    """torch.optim.AdamW driving the module itself. ``weighting="tokens"``: the loss is sum / count over each whole
    global batch (one process over the concatenated batch); ``"micro"``: the mean over the ranks' micro-batches of
    each one's own token mean (what N ranks train without zf.Mean). Also the loss over the ranks' first
    micro-batches at each update's parameters (what the first micro-step reports)."""
    module = _model(kind, torch.float64)
    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS, weight_decay=WD, foreach=False)
    kw = {"use_cache": False} if kind == "gpt2" else {}
    forward = lambda **k: module(**k, **kw)  # noqa: E731
    losses, first = [], []
    for i in range(STEPS):
        batch = _global_batch(kind, i)
        parts = [_sum_count(kind, forward, _micro(batch, r, m)) for r in range(WORLD) for m in range(ACCUM)]
        if weighting == "tokens":
            loss = sum(t for t, _ in parts) / sum(n for _, n in parts)
        else:
            loss = sum(t / n.clamp(min=1) for t, n in parts) / len(parts)
        with torch.no_grad():
            firsts = [parts[r * ACCUM] for r in range(WORLD)]
            first.append(float(sum(t for t, _ in firsts) / sum(n for _, n in firsts)))
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in module.named_parameters()}, "loss": losses, "first": first}


AMP_STEPS_OFF, AMP_SHARE = 2, 0.01


def _amp_check(a: dict, b: dict) -> tuple[float, float]:
    """How far two fp32 master trees of bf16 runs are: (max(|a - b| - tolerance), <= 0 if within it, nan if any is
    nan; the share of elements more than half an Adam step apart). The tolerance is 2 bf16 ulp of the values plus
    AMP_STEPS_OFF Adam steps: each rank rounds its gradient to bf16 before the reduction, one process the whole
    batch's, and an element whose gradient is that rounding's size steps another way (test_amp's bound is one step
    for 8 updates of a model without such elements; measured here after 3 updates: 1.0 on the BERT, 1.64 on GPT-2,
    0.1% and 0.3% of the elements beyond half a step). Without zf.Mean both fail: 3.7 and 3.8 steps past the bound,
    over half the elements more than half a step away."""
    assert a.keys() == b.keys()
    eps, worst, far, total = torch.finfo(torch.bfloat16).eps, -1.0, 0, 0
    for k in a:
        x, y = a[k].double(), b[k].double()
        diff = (x - y).abs()
        excess = (diff - (2 * eps * torch.maximum(x.abs(), y.abs()) + AMP_STEPS_OFF * LR)).max().item()
        if math.isnan(excess):
            return math.nan, math.nan
        worst = max(worst, excess)
        far, total = far + int((diff > LR / 2).sum()), total + diff.numel()
    return worst, far / total


def _same_on_every_rank(results: list[dict], case: tuple) -> None:
    for other in results[1:]:
        assert max_abs_diff(other[case]["params"], results[0][case]["params"]) == 0, case
        assert other[case]["metrics"] == results[0][case]["metrics"], case


# ---------------------------------------------------------------- the tests


def test_the_data_has_a_different_count_on_every_rank_and_micro_step():
    """What the tests below rest on: no two micro-batches of an update hold as many label tokens, one holds none,
    and the batches hold exactly the items ITEMS says."""
    for kind in MODELS:
        for i in range(STEPS):
            batch = _global_batch(kind, i)
            labels = batch["labels"][:, 1:] if kind == "gpt2" else batch["labels"]
            assert (labels != -100).sum(1).tolist() == list(ITEMS[i])
            counts = [int((_micro({"l": labels}, r, m)["l"] != -100).sum()) for r in range(WORLD) for m in range(ACCUM)]
            assert len(set(counts)) == len(counts), counts
            assert sum(counts) == _items(i) and sum(counts[::ACCUM]) == _items(i, 0)
        if kind == "gpt2":  # the prompt is masked: the first label follows at least one prompt token
            assert bool((batch["labels"][:, 0] == -100).all()) and bool((batch["attention_mask"] == 0).any())
    assert 0 in [sum(ITEMS[i][j : j + MICRO]) for i in range(STEPS) for j in range(0, ROWS, MICRO)]


@pytest.mark.parametrize("kind", MODELS)
def test_one_process_reference_equals_torch_adamw(kind):
    """The one-process zerofn reference itself against torch.optim.AdamW on sum / count (both over the whole
    global batch), so that the rank results below are held to torch too."""
    ref, ours = _torch_reference(kind), _one_process(kind)
    diff = max_abs_diff(ours["params"], ref["params"])
    assert diff <= 1e-6, f"{kind}: max |zerofn one process - torch| {diff:.3g}"
    assert [loss for loss, _ in ours["metrics"]] == pytest.approx(ref["loss"], abs=1e-6, rel=0)
    assert [n for _, n in ours["metrics"]] == [_items(i) for i in range(STEPS)]
    init = {n: p.detach() for n, p in _model(kind, torch.float64).named_parameters()}
    assert max_abs_diff(ref["params"], init) > 1e-3  # the updates moved the parameters


def _check_equals_one_process(results: list[dict], case: tuple) -> dict:
    """float64: within 1e-6 of zerofn on one process and of torch's AdamW over the concatenated batch; the last
    micro-step's loss is that process's loss and its count the global count, the first micro-step's the same over
    the ranks' first micro-batches; every rank alike."""
    kind = case[0]
    got, ref, one = results[0][case], _torch_reference(kind), _one_process(kind)
    diff_one, diff_torch = max_abs_diff(got["params"], one["params"]), max_abs_diff(got["params"], ref["params"])
    assert diff_one <= 1e-6, f"{case}: max |2 ranks - one process| {diff_one:.3g}"
    assert diff_torch <= 1e-6, f"{case}: max |2 ranks - torch| {diff_torch:.3g}"
    losses = max(abs(got["metrics"][(i + 1) * ACCUM - 1][0] - ref["loss"][i]) for i in range(STEPS))
    print(f"{case}: max |2 ranks - one process| {diff_one:.3g}, |2 ranks - torch| {diff_torch:.3g}, loss {losses:.3g}")
    for i in range(STEPS):
        (first, n_first, skipped0), (last, n_last, skipped1) = got["metrics"][i * ACCUM : (i + 1) * ACCUM]
        assert not skipped0 and not skipped1, (case, i)
        assert n_first == _items(i, 0) and n_last == _items(i) == one["metrics"][i][1], (case, i, n_first, n_last)
        assert last == pytest.approx(one["metrics"][i][0], abs=1e-6, rel=0), (case, i)
        assert last == pytest.approx(ref["loss"][i], abs=1e-6, rel=0), (case, i)
        assert first == pytest.approx(ref["first"][i], abs=1e-6, rel=0), (case, i)
    _same_on_every_rank(results, case)
    return got


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("stage", STAGES)
def test_mean_on_two_ranks_equals_one_process_over_the_concatenated_batch(results, kind, stage):
    """Every composition, float64 (see _check_equals_one_process). offload's host update takes each bucket as it
    lands, so the count reaches it through a scalar all-reduce of its own that overlaps backward; with
    early=True that update also starts speculatively as each bucket lands."""
    _check_equals_one_process(results, (kind, stage, True))


def test_mean_through_from_deepspeed(results):
    """A DeepSpeed config (ZeRO-3, optimizer state in CPU RAM, 2 micro-steps of 2 rows per update) with a zf.Mean
    loss whose count is a Python int: the same as the Mean cases above."""
    got = _check_equals_one_process(results, ("gpt2", "deepspeed", True))
    assert got["sizes"] == (ACCUM, MICRO)
    assert got["name"] == "offload(shard_params(train_step))", got["name"]


@pytest.mark.parametrize("kind", MODELS)
def test_mean_under_amp_equals_amp_on_one_process(results, kind):
    """amp (bf16 compute and traffic, fp32 masters) with zf.Mean on 2 ranks against amp on one process over the
    concatenated batch: within _amp_check's bounds; the loss within bf16's rounding, the count exact."""
    case = (kind, "amp", True)
    got, one = results[0][case], _one_process(kind, torch.float32)
    excess, share = _amp_check(got["params"], one["params"])
    assert excess <= 0, f"{case}: {excess:.3g} beyond the amp tolerance"
    print(f"{case}: excess {excess:.3g}, {share:.2%} half a step apart")
    assert share <= AMP_SHARE, f"{case}: {share:.2%} of the elements half an Adam step or more apart"
    # the check tells the weighting: amp without zf.Mean on the same ranks is outside it
    wrong = _amp_check(results[0][(kind, "amp", False)]["params"], one["params"])
    assert wrong[0] > 0 and wrong[1] > 10 * AMP_SHARE, wrong
    losses = [(got["metrics"][(i + 1) * ACCUM - 1][0], one["metrics"][i][0]) for i in range(STEPS)]
    print(f"{case}: without zf.Mean {wrong}; losses (2 ranks, one process) {losses}")
    for i in range(STEPS):
        last, n_last, skipped = got["metrics"][(i + 1) * ACCUM - 1]
        assert not skipped and n_last == _items(i), (case, i)
        assert last == pytest.approx(one["metrics"][i][0], abs=2e-3, rel=0), (case, i)  # measured 1.6e-4
    _same_on_every_rank(results, case)


@pytest.mark.parametrize("kind", MODELS)
def test_without_mean_each_rank_trains_its_own_token_mean(results, kind):
    """Each rank returning its own micro-batch's token mean: the step trains the mean of the 4 micro-batches'
    means (torch driven on that loss agrees within 1e-6), far from one process over the concatenated batch,
    at 100 x the tolerance the Mean cases meet. What zf.Mean fixes."""
    case = (kind, "plain", False)
    got = results[0][case]
    per_micro, tokens = _torch_reference(kind, "micro"), _torch_reference(kind)
    diff = max_abs_diff(got["params"], per_micro["params"])
    assert diff <= 1e-6, f"{case}: max |2 ranks - torch on the mean of means| {diff:.3g}"
    off = max_abs_diff(got["params"], tokens["params"])
    assert off > 1e-4, f"{case}: only {off:.3g} from one process over the concatenated batch"
    print(f"{case}: max |2 ranks - torch on the mean of means| {diff:.3g}, from one process {off:.3g}")
    assert all(m[1] is None for m in got["metrics"])  # no zf.Mean, no count
    _same_on_every_rank(results, case)
