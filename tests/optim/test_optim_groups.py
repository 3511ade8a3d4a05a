"""Weight-decay masks and parameter groups against torch.optim's param_groups driving the module itself, on real
gloo ranks: nanoGPT's two groups and the Hugging Face Trainer's on a small GPT and a Hugging Face Llama, per-group
learning rates and schedules, torch's rule for parameters without a gradient (and its traffic), bf16 moments."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import counting, make_transformer, max_abs_diff, rank_slice, train, transformer_batch
from torch import nn

import zerofn as zf
from zerofn import optim

# eps: an element whose gradient is near zero (1e-8 where others are 1e-3) gets an Adam step of lr x g / (|g| + eps),
# whose direction on 4 ranks is the rounding of gloo's sum over the ranks (another order than one process's); at
# torch's default 1e-8 such a step differs by up to 1e-6 after 4 steps (measured 9.3e-7 on the Llama), at 1e-6 by
# lr x that rounding / eps.
LR, WD, EPS = 3e-3, 0.1, 1e-6
GLOBAL_BATCH, STEPS = 8, 4
STAGES = ("plain", "shard_optimizer", "shard_grads", "shard_params", "offload")


def _stage(name: str, units=None):
    """The composition by name (``units``: shard_params's)."""
    from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

    return {
        "plain": lambda s: s,
        "shard_optimizer": shard_optimizer,
        "shard_grads": shard_grads,
        "shard_params": lambda s: shard_params(s, units=units),
        "offload": lambda s: offload(s, "cpu"),
        "amp": lambda s: amp(s, torch.bfloat16),
        "amp+shard_params": lambda s: amp(shard_params(s), torch.bfloat16),
    }[name]


# ---------------------------------------------------------------- the models, as zerofn and torch see them


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=True,
        mlp_bias=True,  # biases, which the Hugging Face grouping leaves out of the decay
    )


def _model(name: str) -> nn.Module:
    """The same module (values included) each call."""
    if name.startswith("gpt"):  # tied embeddings, LayerNorms; "gpt": a frozen, a float64 and a scalar parameter too
        return make_transformer(extras=name == "gpt")[0]
    import transformers
    from transformers import LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return LlamaForCausalLM(_llama_config()).float()


def _loss(name: str, forward):
    """The model's next-token loss given its forward (the module, or zerofn's apply with the params bound)."""
    if name.startswith("gpt"):

        def loss(batch):
            logits = forward(batch[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

        return loss
    return lambda batch: forward(input_ids=batch, labels=batch, use_cache=False).loss


def _zf_model(name: str):
    """(module, apply, loss_fn) for zerofn."""
    module = _model(name)
    apply = zf.functional(module)
    return module, apply, lambda params, batch: _loss(name, lambda *a, **k: apply(params, *a, **k))(batch)


def _decays(name: str, grouping: str, module: nn.Module) -> set[str]:
    """The names of the parameters torch's recipe puts in its decaying group (as named_parameters gives them)."""
    if grouping == "huggingface":
        from transformers import Trainer

        return set(Trainer.get_decay_parameter_names(None, module))  # the Trainer's own rule
    return {n for n, p in module.named_parameters() if p.dim() >= 2}  # nanoGPT's configure_optimizers


def _param_groups(name: str, grouping: str, module: nn.Module, wd: float = WD, everywhere: bool = False) -> list:
    """torch's two groups, the decaying one first (``everywhere``: both decay, the grouping lost)."""
    decays = _decays(name, grouping, module)
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in trainable if n in decays], "weight_decay": wd},
        {"params": [p for n, p in trainable if n not in decays], "weight_decay": wd if everywhere else 0.0},
    ]
    assert all(g["params"] for g in groups), "both groups hold parameters"
    return groups


def _nanogpt_labels(params):
    return {n: "decay" if p.ndim >= 2 else "no_decay" for n, p in params.items()}


def _optimizer(grouping: str, module: nn.Module, wd: float = WD):
    """zerofn's way of writing each recipe."""
    if grouping == "nanogpt":
        return optim.adamw(LR, eps=EPS, weight_decay=wd, mask=optim.decay_mask())
    if grouping == "nanogpt_multi":
        return optim.multi_transform(
            {
                "decay": optim.adamw(LR, eps=EPS, weight_decay=wd),
                "no_decay": optim.adamw(LR, eps=EPS, weight_decay=0.0),
            },
            _nanogpt_labels,
        )
    if grouping == "nanogpt_trainable":  # the mask as nanoGPT's groups are built: over the trainable parameters
        mask = {n: p.ndim >= 2 for n, p in module.named_parameters() if p.requires_grad}
        return optim.adamw(LR, eps=EPS, weight_decay=wd, mask=mask)
    if grouping == "nanogpt_multi_trainable":
        return optim.multi_transform(
            {
                "decay": optim.adamw(LR, eps=EPS, weight_decay=wd),
                "no_decay": optim.adamw(LR, eps=EPS, weight_decay=0.0),
            },
            {n: "decay" if p.ndim >= 2 else "no_decay" for n, p in module.named_parameters() if p.requires_grad},
        )
    assert grouping == "huggingface", grouping
    return optim.adamw(LR, eps=EPS, weight_decay=wd, mask=optim.decay_mask("huggingface", module))


def _torch_train(name: str, module: nn.Module, opt, steps: int, world: int, autocast=False, scheduler=None) -> dict:
    """``opt`` driving ``module`` over ``steps`` batches, each step's gradient the mean of the gradients of
    ``world`` equal slices of the batch, summed in rank order (DDP's on that many ranks; 1: the whole batch)."""
    loss = _loss(name, module)
    params = [p for g in opt.param_groups for p in g["params"]]
    for i in range(steps):
        opt.zero_grad()
        grads = []
        for r in range(world):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                value = loss(rank_slice(transformer_batch(i, GLOBAL_BATCH), r, world))
            grads.append(torch.autograd.grad(value, params))
        for j, p in enumerate(params):
            total = grads[0][j]
            for g in grads[1:]:
                total = total + g[j]
            p.grad = total / world
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


@functools.cache
def _torch_run(
    name: str,
    grouping: str,
    steps: int = STEPS,
    *,
    world: int = 1,
    autocast: bool = False,
    wd: float = WD,
    everywhere: bool = False,
) -> dict:
    """torch.optim.AdamW(param_groups, fused=True) driving the module, fp32 parameters (see :func:`_torch_train`).

    ``autocast``: the forward under torch.autocast to bf16, the parameters starting from the values amp holds
    (rounded to bf16: amp's masters start from them, as DeepSpeed's do).
    """
    module = _model(name)
    if autocast:
        with torch.no_grad():
            for p in module.parameters():
                p.copy_(p.bfloat16())
    opt = torch.optim.AdamW(_param_groups(name, grouping, module, wd, everywhere), lr=LR, eps=EPS, fused=True)
    return _torch_train(name, module, opt, steps, world, autocast)


def _zf_run(name: str, grouping: str, stage: str, steps: int = STEPS, wd: float = WD) -> dict:
    """zerofn's run of the same recipe on this rank's share of each batch: the full parameters (amp's masters)."""
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    module, apply, loss_fn = _zf_model(name)
    step = _stage(stage)(zf.train_step(loss_fn, _optimizer(grouping, module, wd)))
    state, _ = train(step, step.init(apply.params), transformer_batch, steps, GLOBAL_BATCH, world, rank)
    return step.full_params(state, master=stage.startswith("amp"))


# ---------------------------------------------------------------- two groups, each with its own schedule


def _schedules():
    return (
        optim.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=6, end_value=1e-3),  # decaying group
        optim.linear_schedule(3e-3, 5e-4, transition_steps=5),  # the others
    )


@functools.cache
def _torch_schedules_run(steps: int, world: int = 1) -> dict:
    """torch's two nanoGPT groups at lr 1.0, scaled by a LambdaLR with one lambda per group."""
    module = _model("gpt")
    opt = torch.optim.AdamW(_param_groups("gpt", "nanogpt", module), lr=1.0, eps=EPS, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, list(_schedules()))
    return _torch_train("gpt", module, opt, steps, world, scheduler=scheduler)


def _zf_schedules_run(stage: str, steps: int) -> dict:
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    decay, other = _schedules()
    opt = optim.multi_transform(
        {
            "decay": optim.adamw(decay, eps=EPS, weight_decay=WD),
            "no_decay": optim.adamw(other, eps=EPS, weight_decay=0.0),
        },
        _nanogpt_labels,
    )
    _, apply, loss_fn = _zf_model("gpt")
    step = _stage(stage)(zf.train_step(loss_fn, opt))
    state, _ = train(step, step.init(apply.params), transformer_batch, steps, GLOBAL_BATCH, world, rank)
    return step.full_params(state)


# ---------------------------------------------------------------- parameters without a gradient

BRANCHES = ("never", "alternate", "one_rank", "one_micro")
UNUSED_BATCH, UNUSED_STEPS = 8, 6  # 2 ranks x 2 micro-steps x 2 rows


class Branchy(nn.Module):
    """A trunk and a head every sample uses, and four branches each taken only for the rows its flag marks
    (not called at all when no row of the batch marks it: its parameters then get no gradient)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 12)
        self.head = nn.Linear(12, 3)
        for b in BRANCHES:
            setattr(self, b, nn.Linear(12, 3))

    def forward(self, x, use):
        h = torch.tanh(self.trunk(x))
        out = self.head(h)
        for j, b in enumerate(BRANCHES):
            flag = use[:, j]
            if bool(flag.any()):
                out = out + flag[:, None] * getattr(self, b)(h)
        return out


# shard_params's units: the trunk and the head; the branches are gathered with the rest of the model. (A branch in a
# unit of its own that one rank runs and another does not is an error: every rank must gather the same units.)
BRANCHY_UNITS = ["trunk", "head"]


def _branchy() -> nn.Module:
    torch.manual_seed(0)
    return Branchy()


def _branchy_batch(i: int, n: int) -> dict:
    """Step ``i``'s global batch of ``n`` rows; rows [n/2, n) are rank 1's on 2 ranks, and of each rank's
    half the second quarter is its second micro-step's under accumulate_steps=2."""
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(n, 6, generator=g)
    use = torch.zeros(n, len(BRANCHES))
    # never: no row, on no step
    use[:, 1] = float(i % 2 == 0)  # alternate: every row of the even steps
    use[n // 2 :, 2] = 1.0  # one_rank: rank 1's rows only, every step
    use[n // 4 : n // 2, 3] = 1.0  # one_micro: rank 0's second micro-step only
    return {"x": x, "y": torch.sin(x[:, :3]), "use": use}


def _unused_optimizer(kind: str, torch_params=None):
    if kind == "adamw":
        if torch_params is not None:
            return torch.optim.AdamW(torch_params, lr=1e-2, weight_decay=0.1, fused=True)
        return optim.adamw(1e-2, weight_decay=0.1)
    if torch_params is not None:
        return torch.optim.SGD(torch_params, lr=0.05, momentum=0.9, weight_decay=0.1)
    return optim.sgd(0.05, momentum=0.9, weight_decay=0.1)


@functools.cache
def _torch_unused_run(kind: str, zeros: bool = False) -> tuple[dict, dict]:
    """torch on one process over each whole batch: (parameters, per-parameter step counts). ``zeros``: a
    parameter without a gradient gets a zero one instead (what torch's rule is not)."""
    module = _branchy()
    opt = _unused_optimizer(kind, module.parameters())
    for i in range(UNUSED_STEPS):
        b = _branchy_batch(i, UNUSED_BATCH)
        loss = ((module(b["x"], b["use"]) - b["y"]) ** 2).mean()
        opt.zero_grad()  # set_to_none: a parameter the forward did not use has grad None, and step skips it
        loss.backward()
        if zeros:
            for p in module.parameters():
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        opt.step()
    steps = {
        n: int(opt.state[p]["step"]) if "step" in opt.state.get(p, {}) else 0 for n, p in module.named_parameters()
    }
    return {n: p.detach().clone() for n, p in module.named_parameters()}, steps


def _zf_unused_run(kind: str, stage: str, accumulate: int) -> tuple[dict, dict]:
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    apply = zf.functional(_branchy())

    def loss_fn(params, b):
        return ((apply(params, b["x"], b["use"]) - b["y"]) ** 2).mean()

    step = _stage(stage, BRANCHY_UNITS)(zf.train_step(loss_fn, _unused_optimizer(kind), accumulate))
    state = step.init(apply.params)
    state, _ = step(state, rank_slice(rank_slice(_branchy_batch(0, UNUSED_BATCH), rank, world), 0, accumulate))
    first = (lambda i, n: _branchy_batch(0, n)) if accumulate > 1 else None  # the rest of the first update
    with counting() as reads:  # parameters without a gradient are told to the optimizer on the device
        if first is not None:
            local = rank_slice(_branchy_batch(0, UNUSED_BATCH), rank, world)
            for m in range(1, accumulate):
                state, _ = step(state, rank_slice(local, m, accumulate))
        state, _ = train(
            step, state, lambda i, n: _branchy_batch(i + 1, n), UNUSED_STEPS - 1, UNUSED_BATCH, world, rank
        )
    counts = dict(zip(state.spec.layout.trainable_names, state.param_steps.tolist()))
    return step.full_params(state), counts, reads.n


def _traffic(stage: str) -> dict:
    """comm_bytes of steps where every rank gave every parameter a gradient, and of steps where some did not."""
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    apply = zf.functional(_branchy())

    def loss_fn(params, b):
        return ((apply(params, b["x"], b["use"]) - b["y"]) ** 2).mean()

    step = _stage(stage, BRANCHY_UNITS)(zf.train_step(loss_fn, optim.adamw(1e-2, weight_decay=0.1)))
    state = step.init(apply.params)
    every = _branchy_batch(0, UNUSED_BATCH)
    every["use"].fill_(1.0)  # every branch on every row
    one_rank = copy.deepcopy(every)
    one_rank["use"][: UNUSED_BATCH // 2, 2] = 0.0  # rank 0 leaves one_rank out
    no_rank = copy.deepcopy(every)
    no_rank["use"][:, 0] = 0.0  # no rank takes never
    comm = {}
    state, _ = step(state, rank_slice(every, rank, world))  # a step's first call also agrees on the batch shapes
    for name, batch in (("every", every), ("one_rank", one_rank), ("every_again", every), ("no_rank", no_rank)):
        state, metrics = step(state, rank_slice(batch, rank, world))
        comm[name] = metrics["comm_bytes"]
    layout = state.spec.layout
    comm["trainable"] = len(layout.trainable_names)
    comm["padded_bytes"] = sum(b.nbytes for b in layout.buckets)
    comm["param_bytes"] = sum(p.numel() * p.element_size() for p in apply.params.values())
    return comm


# ---------------------------------------------------------------- bf16 moments


def _moments(stage: str, root: str | None) -> dict:
    """state_bytes with fp32, bf16 first and bf16 first and second moments; with ``root``, each resumed from
    a checkpoint after 2 of 4 steps against the run that never stopped."""
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    out = {}
    for label, dtypes in (
        ("fp32", {}),
        ("mu", {"mu_dtype": torch.bfloat16}),
        ("mu_nu", {"mu_dtype": torch.bfloat16, "nu_dtype": torch.bfloat16}),
    ):

        def build(dtypes=dtypes):
            _, apply, loss_fn = make_transformer()
            opt = optim.adamw(LR, weight_decay=WD, mask=optim.decay_mask(), **dtypes)
            return _stage(stage)(zf.train_step(loss_fn, opt)), apply

        step, apply = build()
        state = step.init(apply.params)
        layout = state.spec.layout
        result = {
            "optimizer": zf.memory.state_bytes(state)["optimizer"],
            # what each moment holds on this rank: (elements, their dtype's bytes) per bucket
            "held": [(b.padded // b.shards, b.dtype.itemsize) for b in layout.buckets],
            "dtypes": sorted({str(t.dtype) for t in zf.tree.tree_leaves(state.opt_state) if t.dim() > 0}),
        }
        if root is not None:
            state, _ = train(step, state, transformer_batch, 2, GLOBAL_BATCH, world, rank)
            path = f"{root}/{stage}-{label}"
            zf.checkpoint.save(state, path)
            state, _ = _train_from(step, state, 2, 4, world, rank)
            straight = (step.full_params(state), [t.clone() for t in zf.tree.tree_leaves(state.opt_state)])
            step2, _ = build()
            loaded = zf.checkpoint.load(path, step2)
            loaded, _ = _train_from(step2, loaded, 2, 4, world, rank)
            resumed = (step2.full_params(loaded), zf.tree.tree_leaves(loaded.opt_state))
            result["resumed_equal"] = all(torch.equal(straight[0][k], resumed[0][k]) for k in straight[0]) and all(
                torch.equal(a, b) for a, b in zip(straight[1], resumed[1], strict=True)
            )
            result["moved"] = any(not torch.equal(straight[0][k], v) for k, v in make_transformer()[1].params.items())
        out[label] = result
    return out


def _train_from(step, state, lo: int, hi: int, world: int, rank: int):
    metrics = None
    for i in range(lo, hi):
        state, metrics = step(state, rank_slice(transformer_batch(i, GLOBAL_BATCH), rank, world))
    return state, metrics


# ---------------------------------------------------------------- every case of a world size, in one run


def _run_case(case: tuple):
    kind, *args = case
    return {
        "groups": _zf_run,
        "schedules": _zf_schedules_run,
        "unused": _zf_unused_run,
        "traffic": _traffic,
        "moments": _moments,
    }[kind](*args)


def _rank_cases(cases: list) -> dict:
    return {case: _run_case(case) for case in cases}


AMP_WD, AMP_STEPS = 3.0, 4
UNUSED_CASES = [
    ("unused", kind, stage, k)
    for kind in ("adamw", "sgd")
    for stage in ("plain", "shard_optimizer", "shard_grads", "shard_params")
    for k in (1, 2)
]


TRAINABLE_CASES = [  # a mask or labels over the trainable parameters alone (the GPT has a frozen one)
    ("groups", "gpt", grouping, stage, STEPS, WD)
    for grouping in ("nanogpt_trainable", "nanogpt_multi_trainable")
    for stage in ("shard_optimizer", "shard_grads", "shard_params")
]


def _cases(world: int, root: str) -> list:
    groups = [
        ("groups", name, grouping, stage, STEPS, WD)
        for name in ("gpt", "llama")
        for grouping in ("nanogpt", "nanogpt_multi", "huggingface")
        for stage in STAGES
    ]
    amp_cases = [
        ("groups", name, grouping, stage, AMP_STEPS, AMP_WD)
        for name in ("gpt_amp", "llama")
        for grouping in ("nanogpt", "huggingface")
        for stage in ("amp", "amp+shard_params")
    ]
    schedules = [("schedules", stage, 6) for stage in STAGES]
    moments = [("moments", "plain" if world == 1 else "shard_optimizer", root)]
    if world == 1:
        return groups + amp_cases + schedules + moments
    if world == 2:
        traffic = [("traffic", stage) for stage in ("plain", "shard_optimizer", "shard_grads", "shard_params")]
        return groups + amp_cases + schedules + moments + UNUSED_CASES + traffic + TRAINABLE_CASES
    # 4 ranks: the GPT (importing transformers costs each rank 6-7 s of CPU; the Llama runs on 1 and 2 ranks)
    return [c for c in groups if c[1] == "gpt"]


@pytest.fixture(scope="module")
def results(ranks, tmp_path_factory):
    """world size -> {case: each rank's result}: every case of a world size in one run of its ranks."""
    cache: dict[int, list] = {}

    def get(world: int) -> list[dict]:
        if world not in cache:
            root = str(tmp_path_factory.mktemp(f"groups{world}"))
            cases = _cases(world, root)
            cache[world] = [_rank_cases(cases)] if world == 1 else ranks(world).run(_rank_cases, cases)
        return cache[world]

    return get


# ---------------------------------------------------------------- the tests


def _cases_of(per_rank: list[dict], kind: str) -> list[tuple]:
    return [c for c in per_rank[0] if c[0] == kind]


def _same_on_every_rank(per_rank: list[dict], case: tuple) -> None:
    first = per_rank[0][case]
    first = first[0] if isinstance(first, tuple) else first
    for r in per_rank[1:]:
        other = r[case][0] if isinstance(r[case], tuple) else r[case]
        assert max_abs_diff(other, first) == 0, case


@pytest.mark.parametrize("world", [1, 2, 4])
def test_groups_equal_torch_adamw_with_param_groups(results, world):
    """nanoGPT's groups (a mask, and multi_transform of two adamw) and the Hugging Face Trainer's, on a small GPT and
    a Llama: torch.optim.AdamW(param_groups, fused=True) driving the module, bit for bit on one process (every stage)
    and within 1e-6 on 2 ranks and (the GPT) 4, where torch's gradient is DDP's (the mean of the ranks' slices').
    Measured: bit for bit on 2 ranks too, 1.2e-7 (an ulp) on 4."""
    per_rank = results(world)
    cases = [c for c in _cases_of(per_rank, "groups") if not c[3].startswith("amp") and c not in TRAINABLE_CASES]
    assert len(cases) == (2 if world < 4 else 1) * 3 * len(STAGES)
    for case in cases:
        _, name, grouping, stage, steps, wd = case
        ref = _torch_run(name, grouping.removesuffix("_multi"), steps, world=world, wd=wd)
        got = per_rank[0][case]
        if world == 1:
            differ = [k for k in ref if not torch.equal(got[k], ref[k])]
            assert not differ, f"{case}: not bit for bit with torch at {differ[:4]} ({max_abs_diff(got, ref):.3g})"
        else:
            diff = max_abs_diff(got, ref)
            assert diff <= 1e-6, f"{case} on {world} ranks: max |zerofn - torch| {diff:.3g}"
        _same_on_every_rank(per_rank, case)
    # the grouping shows at that tolerance: decaying every parameter, or none, lands 10x the tolerance away
    for name in ("gpt", "llama"):
        for grouping in ("nanogpt", "huggingface"):
            ref = _torch_run(name, grouping)
            assert max_abs_diff(_torch_run(name, grouping, everywhere=True), ref) > 1e-5
            assert max_abs_diff(_torch_run(name, grouping, wd=0.0), ref) > 1e-5
            assert max_abs_diff(ref, {n: p.detach() for n, p in _model(name).named_parameters()}) > 1e-3


def test_mask_and_labels_over_the_trainable_parameters_equal_torch_param_groups(results):
    """A mask and labels built as nanoGPT builds its groups, from ``named_parameters()`` where ``requires_grad``
    (no entry for the frozen parameter), on 2 ranks under each shard transform: torch.optim.AdamW with the same
    two param groups, within 1e-6 (as the tree-wide mask is)."""
    per_rank = results(2)
    for case in TRAINABLE_CASES:
        _, name, grouping, stage, steps, wd = case
        ref = _torch_run(name, "nanogpt", steps, world=2, wd=wd)
        diff = max_abs_diff(per_rank[0][case], ref)
        assert diff <= 1e-6, f"{case} on 2 ranks: max |zerofn - torch| {diff:.3g}"
        _same_on_every_rank(per_rank, case)


def _frozen_gpt_step(opt):
    _, apply, loss_fn = _zf_model("gpt")
    step = zf.train_step(loss_fn, opt)
    return step, apply.params


@pytest.mark.parametrize("what", ["mask", "labels"])
def test_mask_or_labels_lacking_a_trainable_parameter_or_naming_none_are_refused(what):
    """Over the trainable parameters is enough; one that lacks a trainable parameter, or has an entry that no
    parameter has, is refused at init with the names."""
    module = _model("gpt")
    trainable = {n: p for n, p in module.named_parameters() if p.requires_grad}
    assert "frozen_proj" not in trainable and "frozen_proj" in dict(module.named_parameters())

    def build(entries):
        if what == "mask":
            return optim.adamw(LR, weight_decay=WD, mask={n: p.ndim >= 2 for n, p in entries.items()})
        labels = {n: "a" if p.ndim >= 2 else "b" for n, p in entries.items()}
        return optim.multi_transform({"a": optim.adamw(LR, weight_decay=WD), "b": optim.adamw(LR)}, labels)

    step, params = _frozen_gpt_step(build(trainable))
    step.init(params)  # accepted
    step, params = _frozen_gpt_step(build(dict(module.named_parameters())))  # the frozen one's entry too
    step.init(params)
    lacking = {n: p for n, p in trainable.items() if n != "pos"}
    step, params = _frozen_gpt_step(build(lacking))
    with pytest.raises(ValueError, match=r"every trainable parameter.*it lacks \['pos'\]"):
        step.init(params)
    typo = {**lacking, "poss": trainable["pos"]}
    step, params = _frozen_gpt_step(build(typo))
    with pytest.raises(ValueError, match=r"it lacks \['pos'\]; it has entries no parameter has: \['poss'\]"):
        step.init(params)


def _amp_excess(a: dict, b: dict) -> float:
    """max(|a - b| - tolerance) over every element, <= 0 if within it (nan if any is nan): 2 bf16 ulp of the
    values plus three Adam steps (test_amp's bound is one step, for amp on N ranks against amp on one process;
    against autocast with fp32 parameters the forward rounds other values, and an element whose gradient is
    rounding noise may step the other way: measured 1.8 steps on the Llama, 0.85 on the GPT after 4 updates, on 1
    and 2 ranks; a parameter in the wrong group is 6.7 steps off)."""
    assert a.keys() == b.keys()
    eps, worst = torch.finfo(torch.bfloat16).eps, -1.0
    for k in a:
        x, y = a[k].double(), b[k].double()
        excess = ((x - y).abs() - (2 * eps * torch.maximum(x.abs(), y.abs()) + 3 * LR)).max().item()
        if math.isnan(excess):
            return math.nan
        worst = max(worst, excess)
    return worst


@pytest.mark.parametrize("world", [1, 2])
def test_groups_under_amp_equal_torch_autocast(results, world):
    """amp(step, bf16) and amp(shard_params(step), bf16) with the groups: their fp32 masters against torch.autocast
    to bf16 with fp32 parameters and the same param_groups. The decay is large (3.0) so that a parameter in the
    wrong group lands outside the tolerance (checked on torch's side)."""
    per_rank = results(world)
    cases = [c for c in _cases_of(per_rank, "groups") if c[3].startswith("amp")]
    assert len(cases) == 8
    for case in cases:
        _, name, grouping, stage, steps, wd = case
        ref = _torch_run(name, grouping, steps, world=world, autocast=True, wd=wd)
        excess = _amp_excess(per_rank[0][case], ref)
        assert excess <= 0, f"{case} on {world} ranks: {excess:.3g} beyond the amp tolerance"
        _same_on_every_rank(per_rank, case)
        wrong = _torch_run(name, grouping, steps, world=world, autocast=True, wd=wd, everywhere=True)
        assert _amp_excess(wrong, ref) > 0, "the tolerance cannot tell a parameter in the wrong group"


@pytest.mark.parametrize("world", [1, 2])
def test_two_groups_with_their_own_schedules_equal_lambda_lr(results, world):
    """multi_transform of two adamw, each with its own learning-rate schedule, against torch's param_groups
    scaled by LambdaLR with one lambda per group: bit for bit on one process, within 1e-6 on 2 ranks."""
    per_rank = results(world)
    cases = _cases_of(per_rank, "schedules")
    assert len(cases) == len(STAGES)
    for case in cases:
        ref = _torch_schedules_run(case[2], world)
        got = per_rank[0][case]
        if world == 1:
            assert all(torch.equal(got[k], ref[k]) for k in ref), (case, max_abs_diff(got, ref))
        else:
            assert max_abs_diff(got, ref) <= 1e-6, (case, max_abs_diff(got, ref))
        _same_on_every_rank(per_rank, case)
    one_schedule = _torch_run("gpt", "nanogpt", 6)  # the schedules matter at that tolerance
    assert max_abs_diff(one_schedule, _torch_schedules_run(6)) > 1e-4


def test_unused_parameters_follow_torchs_rule(results):
    """A branch never taken, one taken on alternate steps, one on one rank only, and one on one micro-step only
    (accumulate_steps=2): AdamW (weight decay 0.1) and SGD with momentum (and L2 decay) on 2 ranks, every stage,
    against torch on one process over the whole batch, which skips a parameter whose grad is None (no decay, no
    moment update, no step count)."""
    per_rank = results(2)
    init = {n: p.detach() for n, p in _branchy().named_parameters()}
    assert _cases_of(per_rank, "unused") == UNUSED_CASES
    _, steps = _torch_unused_run("adamw")  # each parameter's own update count (torch's state["step"])
    for case in UNUSED_CASES:
        _, kind, stage, k = case
        ref, _ = _torch_unused_run(kind)
        got, counts, _ = per_rank[0][case]
        # the model's own reads (which branches to run: one per branch and forward) and no other: which
        # parameters got no gradient is told to the optimizer on the device
        forwards = (UNUSED_STEPS * k - 1) * len(BRANCHES)
        assert all(r[case][2] == forwards for r in per_rank), (case, [r[case][2] for r in per_rank])
        diff = max_abs_diff(got, ref)
        assert diff <= 1e-6, f"{case}: max |zerofn - torch| {diff:.3g}"
        assert all(torch.equal(got[f"never.{w}"], init[f"never.{w}"]) for w in ("weight", "bias")), case
        assert counts == steps, (case, counts)
        _same_on_every_rank(per_rank, case)
    assert steps["never.weight"] == 0 and steps["alternate.weight"] == UNUSED_STEPS // 2
    assert steps["one_rank.weight"] == steps["one_micro.weight"] == steps["trunk.weight"] == UNUSED_STEPS
    for kind in ("adamw", "sgd"):  # a zero gradient instead of none moves the branches: the rule shows
        assert max_abs_diff(_torch_unused_run(kind, zeros=True)[0], _torch_unused_run(kind)[0]) > 1e-4


def test_which_rank_gave_a_gradient_costs_a_few_bits_per_parameter(results):
    """Every update's statistics carry, packed into float64s, how many ranks gave each trainable parameter a
    gradient: 2 bits a parameter on 2 ranks (26 in a float64), 8 bytes for the 12 here, counted twice as
    every all-reduce is; a step where some rank gave some parameter none costs nothing more (no second
    collective, so that a rank that saw every parameter decides on the device without asking the others)."""
    per_rank = results(2)
    for case in _cases_of(per_rank, "traffic"):
        for comm in per_rank:
            comm = comm[case]
            assert comm["trainable"] == 12
            seen = 2 * 8 * math.ceil(comm["trainable"] / 26)
            assert comm["every_again"] == comm["every"] == comm["one_rank"] == comm["no_rank"], (case, comm)
            scalars = 2 * 8 * 5  # the stats: loss, sumsq, ranks lacking one, the batch digest and its square
            if case[1] == "plain":
                assert comm["every"] == 2 * comm["param_bytes"] + scalars + seen, comm
            if case[1] == "shard_optimizer":
                assert comm["every"] == 2 * comm["padded_bytes"] + scalars + seen, comm


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_moments_state_bytes_and_resume(results, world):
    """adamw(mu_dtype=bf16) and (mu_dtype, nu_dtype=bf16): the optimizer state falls by exactly each narrowed
    moment's elements x (their dtype's bytes - 2), and a run resumed from a checkpoint continues bit for bit."""
    per_rank = results(world)
    (case,) = _cases_of(per_rank, "moments")
    for out in per_rank:
        out = out[case]
        saved = sum(n * (item - 2) for n, item in out["fp32"]["held"])
        assert saved > 0
        assert out["fp32"]["optimizer"] - out["mu"]["optimizer"] == saved
        assert out["fp32"]["optimizer"] - out["mu_nu"]["optimizer"] == 2 * saved
        assert "torch.bfloat16" not in out["fp32"]["dtypes"]
        assert "torch.bfloat16" in out["mu"]["dtypes"] and "torch.bfloat16" in out["mu_nu"]["dtypes"]
        for label in ("fp32", "mu", "mu_nu"):
            assert out[label]["resumed_equal"] and out[label]["moved"], (world, label)
