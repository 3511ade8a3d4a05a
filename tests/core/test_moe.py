"""A mixture-of-experts router's load-balancing loss on 2 real gloo ranks: Hugging Face's own (each rank's term on
its own micro-batch) trains the DDP objective, the mean over ranks of the per-rank terms, which differs from one
process; ``zf.moe.load_balancing_loss`` trains the one-process term over the concatenated batch, on every stage.
At world size 1 it is Hugging Face's ``load_balancing_loss_func``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import compositions, max_abs_diff, rank_slice

import zerofn as zf
from zerofn import collectives as C
from zerofn import moe

VOCAB, EXPERTS, TOP_K, LAYERS, COEF = 64, 4, 2, 2, 0.02
GLOBAL_BATCH, SEQ, STEPS = 4, 8, 3
LR, EPS, WD = 1e-2, 1e-6, 0.01
STAGES = ("plain", "shard_optimizer", "shard_grads", "shard_params", "offload")
TOL = 1e-6  # against Hugging Face's own loss, whose aux term rounds to float32
F64_TOL = 1e-10  # against the float64 term: float64 rounding, amplified by Adam's eps


def _mixtral():
    """The same tiny float64 Mixtral (values included) each call; eager experts (grouped_mm takes no float64)."""
    import transformers
    from transformers import MixtralConfig, MixtralForCausalLM

    transformers.logging.set_verbosity_error()
    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=16,
        router_aux_loss_coef=COEF,
        output_router_logits=True,
        experts_implementation="eager",
    )
    torch.manual_seed(0)
    return MixtralForCausalLM(config).double()


def _batch(i: int, n: int = GLOBAL_BATCH) -> torch.Tensor:
    return torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(100 + i))


def _hf_loss(forward, ids):
    """Hugging Face's own loss: next-token cross-entropy + coef x its aux loss over this (micro-)batch."""
    return forward(input_ids=ids, labels=ids, use_cache=False).loss


def _exact_loss(forward, ids):
    """The same objective with the aux term over the global micro-batch (the cross-entropy is a plain mean over
    the tokens: every rank holds as many)."""
    out = forward(input_ids=ids, use_cache=False)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return ce + COEF * zf.moe.load_balancing_loss(out.router_logits, EXPERTS, TOP_K)


def _reference_aux(layers, mask=None):
    """Hugging Face's load-balancing term written out in float64 (its own rounds to float32)."""
    w = torch.ones(layers[0].shape[0], dtype=torch.float64) if mask is None else mask.reshape(-1).double()
    counts = probs = 0
    for logits in layers:
        p = torch.softmax(logits.double(), dim=-1)
        chosen = F.one_hot(torch.topk(p, TOP_K, dim=-1).indices, EXPERTS).sum(1).double()
        counts = counts + (chosen * w[:, None]).sum(0)
        probs = probs + (p * w[:, None]).sum(0)
    kept = w.sum() * len(layers)
    return EXPERTS * torch.sum(counts / kept * probs / kept)


# ---------------------------------------------------------------- what the ranks run


def _train(kind: str, stage: str, accumulate: int = 1):
    """3 AdamW steps of the Mixtral on this rank's share of each batch: the full parameters and each step's
    loss metric."""
    world, rank = C.world_size(), C.rank()
    module = _mixtral()
    apply = zf.functional(module)
    loss = {"hf": _hf_loss, "exact": _exact_loss}[kind]

    def loss_fn(params, ids):
        return loss(lambda **kw: apply(params, **kw), ids)

    opt = zf.optim.adamw(LR, eps=EPS, weight_decay=WD)
    step = compositions()[stage](zf.train_step(loss_fn, opt, accumulate_steps=accumulate))
    state, losses = step.init(apply.params), []
    for i in range(STEPS):
        local = rank_slice(_batch(i), rank, world)
        for m in range(accumulate):
            state, metrics = step(state, rank_slice(local, m, accumulate))
        losses.append(float(metrics["loss"]))
    return step.full_params(state), losses


def _logits_and_mask():
    """Router logits of a global batch (2 layers, float64) and a padding mask that keeps 13 of rank 0's 16 tokens
    and 6 of rank 1's."""
    g = torch.Generator().manual_seed(7)
    layers = [torch.randn(GLOBAL_BATCH * SEQ, EXPERTS, generator=g, dtype=torch.float64) for _ in range(LAYERS)]
    lengths = torch.tensor([8, 5, 2, 4])  # rows of 8 tokens: rank 0 holds the first two, rank 1 the last two
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    return layers, mask


def _direct():
    """The term and its gradient with respect to this rank's router logits, and the bytes it sent, with and
    without the mask; the gradient divided by the world size, as the step averages."""
    world, rank = C.world_size(), C.rank()
    layers, mask = _logits_and_mask()
    rows = layers[0].shape[0] // world
    out = {}
    for name, m in (("plain", None), ("masked", rank_slice(mask, rank, world))):
        local = [t[rank * rows : (rank + 1) * rows].clone().requires_grad_() for t in layers]
        with C.counting() as c:
            value = moe.load_balancing_loss(tuple(local), EXPERTS, TOP_K, m)
        value.backward()
        out[name] = (value.detach(), [t.grad / world for t in local], c.bytes)
    return out


def _rank_cases(cases: list) -> dict:
    return {case: _train(*case[1:]) if case[0] == "train" else _direct() for case in cases}


CASES = (
    [("direct",)]
    + [("train", kind, stage) for kind in ("hf", "exact") for stage in STAGES]
    + [("train", "exact", "plain", 2)]
)


@pytest.fixture(scope="module")
def per_rank(ranks):
    """{case: result} of each rank, every case in one run of 2 ranks."""
    return ranks(2).run(_rank_cases, CASES)


# ---------------------------------------------------------------- one-process references


def _float64_loss(forward, ids):
    """Hugging Face's loss with its aux term in float64 (:func:`_reference_aux`), free of its float32 rounding."""
    out = forward(input_ids=ids, use_cache=False)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    return ce + COEF * _reference_aux(out.router_logits)


def _torch_train(batches, loss=_hf_loss) -> tuple[dict, list[float]]:
    """torch.optim.AdamW driving the module itself; each step's gradient is the mean of the gradients of
    ``loss`` (Hugging Face's) over ``batches(i)`` (the 2 ranks' slices: DDP; the whole batch: one process)."""
    module = _mixtral()
    params = list(module.parameters())
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS, weight_decay=WD)
    losses = []
    for i in range(STEPS):
        parts = batches(i)
        values = [loss(module, ids) for ids in parts]
        grads = [torch.autograd.grad(v, params) for v in values]
        for j, p in enumerate(params):
            p.grad = sum(g[j] for g in grads) / len(parts)
        opt.step()
        losses.append(sum(float(v.detach()) for v in values) / len(parts))
    return {n: p.detach().clone() for n, p in module.named_parameters()}, losses


@pytest.fixture(scope="module")
def references():
    def ddp(i):
        return [rank_slice(_batch(i), r, 2) for r in range(2)]

    def micro(i):  # accumulate_steps=2: micro-step m's global batch is the ranks' m-th halves, concatenated
        return [torch.cat([rank_slice(part, m, 2) for part in ddp(i)]) for m in range(2)]

    return {
        "ddp": _torch_train(ddp),
        "one": _torch_train(lambda i: [_batch(i)]),
        "one64": _torch_train(lambda i: [_batch(i)], _float64_loss),
        "micro64": _torch_train(micro, _float64_loss),
    }


# ---------------------------------------------------------------- the tests


def _same_on_both_ranks(per_rank, case) -> None:
    assert max_abs_diff(per_rank[0][case][0], per_rank[1][case][0]) == 0, case


def test_hugging_faces_aux_loss_trains_the_ddp_objective(per_rank, references):
    """Hugging Face's own loss (aux included) on 2 ranks equals, on every stage, one process whose gradient is the
    mean over the 2 ranks' slices of that loss (what DDP and DeepSpeed train too), and lands measurably away
    from one process over the concatenated batch (measured 4.7e-2 after 3 steps)."""
    ddp, one = references["ddp"][0], references["one"][0]
    gap = max_abs_diff(ddp, one)
    print(f"Hugging Face's aux on 2 ranks against one process after {STEPS} steps: max |diff| {gap:.3g}")
    assert gap > 100 * TOL, f"the per-rank aux should train another model than one process, got {gap:.3g}"
    for stage in STAGES:
        case = ("train", "hf", stage)
        got = per_rank[0][case][0]
        diff = max_abs_diff(got, ddp)
        print(f"{stage}: Hugging Face's loss on 2 ranks against the DDP objective: {diff:.3g}")
        assert diff <= TOL, f"{stage}: {diff:.3g} from the DDP objective"
        assert max_abs_diff(got, one) > 100 * TOL, stage
        _same_on_both_ranks(per_rank, case)


def test_zf_load_balancing_loss_equals_one_process_over_the_concatenated_batch(per_rank, references):
    """Cross-entropy + coef x zf.moe.load_balancing_loss on 2 ranks equals, on every stage, one process running
    Hugging Face's own loss over the concatenated batch (within 1e-6: its aux rounds to float32, measured 3e-7
    after 3 steps) and, to float64 rounding, that loss with its aux in float64; every step's loss metric (the
    mean over ranks, reported in float32) is the one-process loss."""
    one, one_losses = references["one"]
    one64 = references["one64"][0]
    hf_rounding = max_abs_diff(one, one64)
    print(f"Hugging Face's float32 aux against float64 on one process: max |diff| {hf_rounding:.3g}")
    for stage in STAGES:
        case = ("train", "exact", stage)
        got, losses = per_rank[0][case]
        diff, diff64 = max_abs_diff(got, one), max_abs_diff(got, one64)
        print(f"{stage}: zf.moe on 2 ranks against one process: {diff:.3g} (float64 aux: {diff64:.3g})")
        assert diff <= TOL, f"{stage}: {diff:.3g} from one process over the concatenated batch"
        assert diff64 <= F64_TOL, f"{stage}: {diff64:.3g} from one process with a float64 aux"
        assert max(abs(a - b) for a, b in zip(losses, one_losses)) <= TOL, (stage, losses, one_losses)
        assert max_abs_diff(got, references["ddp"][0]) > 100 * TOL, stage
        _same_on_both_ranks(per_rank, case)


def test_under_accumulation_each_micro_step_is_the_term_over_its_global_batch(per_rank, references):
    """accumulate_steps=2: the update averages the terms over each micro-step's global batch (the ranks' m-th
    halves concatenated), as one process running those 2 micro-batches does."""
    got, _ = per_rank[0][("train", "exact", "plain", 2)]
    diff = max_abs_diff(got, references["micro64"][0])
    assert diff <= F64_TOL, f"{diff:.3g} from one process accumulating the global micro-batches"
    assert max_abs_diff(got, references["one64"][0]) > 100 * TOL  # not the term over the whole step's batch


def test_value_and_mean_gradient_equal_the_global_term_with_a_padding_mask(per_rank):
    """On unequal kept-token counts (13 and 6): every rank's value is the global term, the ranks' gradients
    averaged (each over its own logits) are the global term's gradient, to float64 rounding, and it cost one
    all-reduce of 2 x experts + 1 float64 values (counted twice, as an all-reduce is)."""
    layers, mask = _logits_and_mask()
    for name, m in (("plain", None), ("masked", mask)):
        full = [t.clone().requires_grad_() for t in layers]
        want = _reference_aux(full, m)
        want.backward()
        want, want_grads = float(want.detach()), [t.grad for t in full]
        for r in range(2):
            value, _, sent = per_rank[r][("direct",)][name]
            assert abs(float(value) - want) <= 1e-12, (name, r, float(value), want)
            assert sent == 2 * 8 * (2 * EXPERTS + 1), (name, sent)
        for layer, w in enumerate(want_grads):
            got = torch.cat([per_rank[r][("direct",)][name][1][layer] for r in range(2)])
            assert (got - w).abs().max() <= 1e-12, (name, layer, float((got - w).abs().max()))
    # the per-rank terms averaged (Hugging Face's on 2 ranks) are another objective, by much more than rounding
    rows = layers[0].shape[0] // 2
    per_rank_terms = [
        _reference_aux([t[r * rows : (r + 1) * rows] for t in layers], rank_slice(mask, r, 2)) for r in range(2)
    ]
    gap = abs(float(sum(per_rank_terms) / 2) - float(_reference_aux(layers, mask)))
    print(f"the mean of the 2 ranks' terms against the global term (masked): {gap:.3g}")
    assert gap > 1e-3, gap


@pytest.mark.parametrize("masked", [False, True])
def test_world_size_one_is_hugging_faces_load_balancing_loss_func(masked):
    """One process, no collective: bit for bit Hugging Face's value for float32 logits; for float64 logits the
    float64 term (Hugging Face's, which rounds to float32, within its rounding)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    layers, mask = _logits_and_mask()
    m = mask if masked else None
    single = tuple(t.float() for t in layers)
    hf = load_balancing_loss_func(single, EXPERTS, TOP_K, m)
    ours = moe.load_balancing_loss(single, EXPERTS, TOP_K, m)
    assert ours.dtype == torch.float32 and abs(float(ours) - float(hf)) <= 1e-12, (float(ours), float(hf))
    double = moe.load_balancing_loss(tuple(layers), EXPERTS, TOP_K, m)
    assert double.dtype == torch.float64
    assert abs(float(double) - float(_reference_aux(layers, m))) <= 1e-12
    assert abs(float(double) - float(load_balancing_loss_func(tuple(layers), EXPERTS, TOP_K, m))) <= 1e-6
    if masked:  # the mask weighs: the padded tokens' logits move the unmasked term
        assert abs(float(moe.load_balancing_loss(single, EXPERTS, TOP_K)) - float(hf)) > 1e-3


def test_the_errors_say_what_to_pass():
    logits = (torch.randn(6, EXPERTS),)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        moe.load_balancing_loss(None, EXPERTS)
    for wrong in (logits[0], (), [logits[0].tolist()]):
        with pytest.raises(TypeError, match="non-empty tuple or list of per-layer tensors"):
            moe.load_balancing_loss(wrong, EXPERTS)
    with pytest.raises(ValueError, match="num_experts must be an int >= 1"):
        moe.load_balancing_loss(logits, 0)
    with pytest.raises(ValueError, match="top_k must be an int in 1..num_experts"):
        moe.load_balancing_loss(logits, EXPERTS, top_k=EXPERTS + 1)
    with pytest.raises(ValueError, match="one token count for every layer"):
        moe.load_balancing_loss((logits[0], torch.randn(5, EXPERTS)), EXPERTS)
    with pytest.raises(ValueError, match="one token count for every layer"):
        moe.load_balancing_loss(logits, EXPERTS + 1)
    with pytest.raises(ValueError, match="attention_mask has 4 elements"):
        moe.load_balancing_loss(logits, EXPERTS, attention_mask=torch.ones(2, 2))
