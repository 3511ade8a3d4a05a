"""zerofn.optim against torch.optim: numerics, donation, state structure, errors."""

from __future__ import annotations

import math

import pytest
import torch

from zerofn import optim
from zerofn.tree import tree_leaves, tree_map, tree_structure

STEPS = 100
RTOL = 1e-6

# name -> (shape, dtype): matrices, vectors, 0-dim scalars, in two dtypes.
SHAPES = {
    "w1": ((8, 5), torch.float32),
    "b1": ((5,), torch.float32),
    "gain": ((), torch.float32),
    "w2": ((3, 4), torch.float64),
    "b2": ((4,), torch.float64),
    "temp": ((), torch.float64),
}


def make_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=gen, dtype=dtype) for k, (shape, dtype) in SHAPES.items()}


def make_grads(params: dict[str, torch.Tensor], step: int, gain: float = 1.0) -> dict[str, torch.Tensor]:
    """Deterministic pseudo-random gradients that also depend on the params."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {k: gain * (torch.randn(p.shape, generator=gen, dtype=p.dtype) + 0.1 * p) for k, p in params.items()}


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start=None) -> float:
    """Max over leaves of max|a - b| relative to the leaf's magnitude.

    The magnitude is max|b|, or max(|b|, |start|) given the leaf's starting
    value: a 0-dim param that wanders near zero would otherwise turn an error
    of one float32 ulp at its natural scale into a large "relative" error.
    """
    worst = 0.0
    for k in b:
        scale = b[k].abs().max().item()
        if start is not None:
            scale = max(scale, start[k].abs().max().item())
        worst = max(worst, (a[k] - b[k]).abs().max().item() / max(scale, 1e-30))
    return worst


def run_pair(opt, make_torch_opt, *, grad_gain=1.0, before_torch_step=None, extra_fn=None):
    """Run ``opt`` and a torch optimizer side by side; return (ours, theirs, torch_opt, state, p0)."""
    params = make_params()
    p0 = tree_map(torch.clone, params)
    ref = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    torch_opt, scheduler = make_torch_opt(list(ref.values()))
    state = opt.init(params)
    for step in range(STEPS):
        grads = make_grads(params, step, grad_gain)
        ref_grads = make_grads(ref, step, grad_gain)
        for k, p in ref.items():
            p.grad = ref_grads[k]
        if before_torch_step is not None:
            before_torch_step(list(ref.values()))
        torch_opt.step()
        if scheduler is not None:
            scheduler.step()
        extra = extra_fn(grads) if extra_fn else {}
        updates, state = opt.update(grads, state, params, **extra)
        optim.apply_updates(params, updates)
    theirs = {k: p.detach() for k, p in ref.items()}
    return params, theirs, torch_opt, state, p0


def assert_matches(ours, theirs, p0):
    diff = max_rel_diff(ours, theirs, start=p0)
    assert diff <= RTOL, f"max relative difference {diff:.3g} > {RTOL}"
    moved = max_rel_diff(theirs, p0)
    assert moved > 1e-3, f"params barely moved ({moved:.3g}); the test is vacuous"


def torch_state(torch_opt, name: str) -> dict[str, torch.Tensor]:
    params = torch_opt.param_groups[0]["params"]
    return {k: torch_opt.state[p][name] for k, p in zip(SHAPES, params)}


def only(cls):
    return lambda ps, **kw: (cls(ps, foreach=True, **kw), None)


# --------------------------------------------------------------------------- #
# Equivalence with torch.optim
# --------------------------------------------------------------------------- #

SGD_CASES = {
    "plain": dict(lr=0.05),
    "momentum": dict(lr=0.05, momentum=0.9),
    "nesterov": dict(lr=0.05, momentum=0.9, nesterov=True),
    "weight_decay": dict(lr=0.05, weight_decay=0.1),
    "momentum+wd": dict(lr=0.05, momentum=0.8, weight_decay=0.05),
}


@pytest.mark.parametrize("kw", SGD_CASES.values(), ids=SGD_CASES.keys())
def test_sgd_matches_torch(kw):
    ours, theirs, torch_opt, state, p0 = run_pair(
        optim.sgd(**kw), lambda ps: (torch.optim.SGD(ps, foreach=True, **kw), None)
    )
    assert_matches(ours, theirs, p0)
    if kw.get("momentum"):
        (trace_state,) = [s for s in state if isinstance(s, optim.TraceState)]
        diff = max_rel_diff(trace_state.trace, torch_state(torch_opt, "momentum_buffer"))
        assert diff <= RTOL


ADAM_CASES = {
    "adam": (optim.adam, torch.optim.Adam, dict(lr=1e-2)),
    "adam+wd": (optim.adam, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    "adam-betas-eps": (optim.adam, torch.optim.Adam, dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6)),
    "adamw": (optim.adamw, torch.optim.AdamW, dict(lr=1e-2)),
    "adamw+wd": (optim.adamw, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.3)),
}


@pytest.mark.parametrize("case", ADAM_CASES.values(), ids=ADAM_CASES.keys())
def test_adam_matches_torch(case):
    ours_fn, torch_cls, kw = case
    ours, theirs, torch_opt, state, p0 = run_pair(ours_fn(**kw), lambda ps: (torch_cls(ps, foreach=True, **kw), None))
    assert_matches(ours, theirs, p0)
    (adam_state,) = [s for s in state if isinstance(s, optim.ScaleByAdamState)]
    assert int(adam_state.count) == STEPS
    assert max_rel_diff(adam_state.mu, torch_state(torch_opt, "exp_avg")) <= RTOL
    assert max_rel_diff(adam_state.nu, torch_state(torch_opt, "exp_avg_sq")) <= RTOL


def test_adamw_warmup_cosine_matches_lambda_lr():
    sched = optim.warmup_cosine_decay_schedule(1e-4, 2e-2, warmup_steps=10, decay_steps=80, end_value=1e-3)

    def make(ps):
        opt = torch.optim.AdamW(ps, lr=1.0, weight_decay=0.1, foreach=True)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, sched)

    ours, theirs, *_rest, p0 = run_pair(optim.adamw(sched, weight_decay=0.1), make)
    assert_matches(ours, theirs, p0)


def test_sgd_with_python_schedule_matches_lambda_lr():
    sched = lambda count: 0.1 / (1 + count)  # noqa: E731

    def make(ps):
        opt = torch.optim.SGD(ps, lr=1.0, momentum=0.9, foreach=True)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, sched)

    ours, theirs, *_rest, p0 = run_pair(optim.sgd(sched, momentum=0.9), make)
    assert_matches(ours, theirs, p0)


@pytest.mark.parametrize("gain", [30.0, 0.01], ids=["clipping", "not-clipping"])
def test_clip_then_adamw_matches_torch(gain):
    max_norm = 1.0
    opt = optim.chain(optim.clip_by_global_norm(max_norm), optim.adamw(1e-2, weight_decay=0.1))
    clip = lambda ps: torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=True)  # noqa: E731
    ours, theirs, *_rest, p0 = run_pair(
        opt,
        lambda ps: (torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True), None),
        grad_gain=gain,
        before_torch_step=clip,
    )
    assert_matches(ours, theirs, p0)


def test_clip_uses_given_grad_norm():
    grads = make_grads(make_params(), 0)
    local = optim.global_norm(grads).item()
    given = 4.0 * local
    expected = tree_map(lambda g: g * (2.0 / (given + 1e-6)), grads)
    opt = optim.clip_by_global_norm(2.0)
    for norm in (given, torch.tensor(given)):
        u, _ = opt.update(tree_map(torch.clone, grads), opt.init(grads), grad_norm=norm)
        assert max_rel_diff(u, expected) <= 1e-6
    # A given norm under max_norm leaves the updates alone, whatever the local norm.
    u, _ = opt.update(tree_map(torch.clone, grads), opt.init(grads), grad_norm=0.5)
    assert max_rel_diff(u, grads) == 0.0


def test_chain_passes_grad_norm_to_clip():
    """Shard-style: each half of the tree clipped by the norm of the whole."""
    max_norm = 1.0
    grads = make_grads(make_params(), 3, gain=10.0)
    full_norm = optim.global_norm(grads)
    whole = optim.chain(optim.clip_by_global_norm(max_norm), optim.scale(-1.0))
    expected, _ = whole.update(tree_map(torch.clone, grads), whole.init(grads))
    keys = list(grads)
    for half in (keys[:3], keys[3:]):
        shard = {k: grads[k].clone() for k in half}
        u, _ = whole.update(shard, whole.init(shard), grad_norm=full_norm, unknown_kwarg=1)
        assert max_rel_diff(u, {k: expected[k] for k in half}) <= 1e-6


def test_global_norm_matches_torch():
    tree = {
        "a": torch.randn(7, 3),
        "b": torch.randn((), dtype=torch.float64),
        "c": torch.randn(5).to(torch.bfloat16),
    }
    norm = optim.global_norm(tree)
    assert norm.dtype == torch.float32 and norm.dim() == 0
    expected = math.sqrt(sum(t.double().pow(2).sum().item() for t in tree.values()))
    assert math.isclose(norm.item(), expected, rel_tol=1e-6)
    assert optim.global_norm({}).item() == 0.0


# --------------------------------------------------------------------------- #
# Schedules
# --------------------------------------------------------------------------- #


def test_schedule_values():
    assert optim.constant_schedule(0.3)(0) == 0.3
    assert optim.constant_schedule(0.3)(10**6) == 0.3

    lin = optim.linear_schedule(1.0, 0.0, 4)
    assert [lin(c) for c in (0, 1, 2, 4, 9)] == [1.0, 0.75, 0.5, 0.0, 0.0]
    lin_begin = optim.linear_schedule(0.0, 1.0, 2, transition_begin=3)
    assert [lin_begin(c) for c in (0, 3, 4, 5, 6)] == [0.0, 0.0, 0.5, 1.0, 1.0]

    cos = optim.cosine_decay_schedule(2.0, 10, alpha=0.1)
    assert cos(0) == pytest.approx(2.0)
    assert cos(5) == pytest.approx(2.0 * (0.9 * 0.5 + 0.1))
    assert cos(10) == pytest.approx(0.2)
    assert cos(50) == pytest.approx(0.2)

    wc = optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=4, decay_steps=14, end_value=0.2)
    assert [wc(c) for c in (0, 1, 2, 4)] == [0.0, 0.25, 0.5, 1.0]
    assert wc(9) == pytest.approx(0.2 + 0.8 * 0.5)
    assert wc(14) == pytest.approx(0.2)
    assert wc(100) == pytest.approx(0.2)
    # Counts may arrive as the state's int64 tensor.
    assert wc(torch.tensor(2)) == 0.5


def test_schedule_sees_count_from_zero():
    seen = []
    opt = optim.scale_by_learning_rate(lambda c: seen.append(c) or 1.0)
    state = opt.init({"w": torch.zeros(1)})
    for _ in range(3):
        _, state = opt.update({"w": torch.ones(1)}, state)
    assert seen == [0, 1, 2]
    assert int(state.count) == 3


# --------------------------------------------------------------------------- #
# Donation and state structure
# --------------------------------------------------------------------------- #

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd-momentum-wd": lambda: optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
    "sgd-nesterov-schedule": lambda: optim.sgd(optim.linear_schedule(0.1, 0.0, 10), momentum=0.9, nesterov=True),
    "adam": lambda: optim.adam(1e-3, weight_decay=0.1),
    "adamw-schedule": lambda: optim.adamw(optim.cosine_decay_schedule(1e-3, 10)),
    "clip-adamw": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)),
}


@pytest.mark.parametrize("make", OPTIMIZERS.values(), ids=OPTIMIZERS.keys())
def test_donation_and_state_structure(make):
    opt = make()
    params = make_params()
    state = opt.init(params)
    init_leaves = tree_leaves(state)
    init_spec = tree_structure(state)
    for step in range(3):
        before = tree_leaves(state)
        grads = make_grads(params, step)
        grad_leaves = tree_leaves(grads)
        updates, state = opt.update(grads, state, params, some_unknown_extra=step)
        after = tree_leaves(state)
        assert len(before) == len(after)
        assert all(a is b for a, b in zip(before, after)), "state leaves were replaced, not updated in place"
        assert all(a is b for a, b in zip(tree_leaves(updates), grad_leaves)), "updates were reallocated"
        out = optim.apply_updates(params, updates)
        assert out is params
    assert tree_structure(state) == init_spec
    for a, b in zip(init_leaves, tree_leaves(state)):
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)


def test_counts_are_int64_cpu_scalars():
    opt = optim.chain(optim.scale_by_adam(), optim.scale_by_learning_rate(lambda c: 0.1))
    state = opt.init(make_params())
    for s in state:
        assert s.count.dtype == torch.int64 and s.count.dim() == 0 and s.count.device.type == "cpu"
    assert isinstance(state[0], optim.ScaleByAdamState)
    assert isinstance(state[1], optim.ScaleByScheduleState)
    for k, (shape, dtype) in SHAPES.items():
        assert state[0].mu[k].shape == shape and state[0].nu[k].dtype == dtype


def test_params_requiring_grad_are_updated_without_autograd():
    params = {k: torch.nn.Parameter(v) for k, v in make_params().items()}
    opt = optim.adamw(1e-2)
    state = opt.init(params)
    grads = make_grads(make_params(), 0)
    updates, state = opt.update(grads, state, params)
    optim.apply_updates(params, updates)
    assert all(u.grad_fn is None for u in tree_leaves(updates))
    assert all(p.requires_grad and p.grad_fn is None for p in params.values())


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #


def test_error_schedule_returns_non_number():
    opt = optim.sgd(lambda c: "fast")
    state = opt.init({"w": torch.zeros(2)})
    with pytest.raises(TypeError, match=r"returned str 'fast' at count 0; expected a Python float"):
        opt.update({"w": torch.ones(2)}, state, {"w": torch.zeros(2)})


def test_error_schedule_returns_negative_lr():
    opt = optim.adam(lambda c: -1e-3)
    params = {"w": torch.zeros(2)}
    with pytest.raises(ValueError, match=r"returned -0.001 at count 0; a learning rate must be >= 0"):
        opt.update({"w": torch.ones(2)}, opt.init(params), params)


def test_error_mismatched_structure():
    opt = optim.adam(1e-3)
    state = opt.init({"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"scale_by_adam.update: updates has tree structure"):
        opt.update({"a": torch.ones(2)}, state)


def test_error_mismatched_shape():
    opt = optim.sgd(0.1, momentum=0.9)
    state = opt.init({"a": torch.zeros(2)})
    with pytest.raises(
        ValueError, match=r"updates at a is float32\[3\] but state.trace there is float32\[2\]; shapes must match"
    ):
        opt.update({"a": torch.ones(3)}, state)


def test_error_mismatched_dtype():
    opt = optim.adamw(1e-3)
    params = {"w": torch.zeros(4)}
    with pytest.raises(
        ValueError,
        match=r"updates at w is bfloat16\[4\] but state.mu there is float32\[4\]; dtypes must match.*cast the gradients first",
    ):
        opt.update({"w": torch.ones(4, dtype=torch.bfloat16)}, opt.init(params), params)


def test_error_apply_updates_mismatch():
    with pytest.raises(ValueError, match=r"apply_updates: updates has tree structure"):
        optim.apply_updates({"a": torch.zeros(2)}, {"b": torch.zeros(2)})


@pytest.mark.parametrize(
    "build, exc, match",
    [
        (lambda: optim.adam(-1e-3), ValueError, r"lr must be in \[0, inf\], got -0.001"),
        (lambda: optim.adam(1e-3, eps=-1.0), ValueError, r"eps must be in \[0, inf\], got -1.0"),
        (lambda: optim.adam(1e-3, betas=(1.0, 0.999)), ValueError, r"b1 must be in \[0, 1\), got 1.0"),
        (lambda: optim.adamw(1e-3, betas=0.9), TypeError, r"betas must be a pair"),
        (lambda: optim.adamw(1e-3, weight_decay=-0.1), ValueError, r"weight_decay must be in"),
        (lambda: optim.sgd(0.1, momentum=-0.9), ValueError, r"momentum must be in"),
        (lambda: optim.sgd(0.1, nesterov=True), ValueError, r"Nesterov momentum needs momentum > 0"),
        (lambda: optim.sgd("0.1"), TypeError, r"lr must be a real number, got str"),
        (lambda: optim.clip_by_global_norm(0.0), ValueError, r"max_norm must be in \(0, inf\]"),
        (lambda: optim.chain(optim.scale_by_adam), TypeError, r"did you forget to call it"),
        (lambda: optim.cosine_decay_schedule(1.0, 0), ValueError, r"decay_steps must be an int > 0"),
        (
            lambda: optim.warmup_cosine_decay_schedule(0.0, 1.0, 10, 5),
            ValueError,
            r"decay_steps must be an int > warmup_steps=10",
        ),
    ],
    ids=[
        "negative-lr",
        "negative-eps",
        "beta-one",
        "betas-not-pair",
        "negative-wd",
        "negative-momentum",
        "nesterov-no-momentum",
        "lr-string",
        "zero-max-norm",
        "uncalled-transform",
        "zero-decay-steps",
        "decay-before-warmup",
    ],
)
def test_error_bad_hyperparameters(build, exc, match):
    with pytest.raises(exc, match=match):
        build()


def test_error_chain_state_length():
    opt = optim.adamw(1e-3)
    with pytest.raises(
        ValueError, match=r"expected a tuple of 3 states \(one per transform\), got a tuple of length 1"
    ):
        opt.update({"w": torch.ones(1)}, (optim.EmptyState(),), {"w": torch.ones(1)})


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: optim.adam(1e-3, weight_decay=0.1), r"add_decayed_weights.update: weight_decay=0.1 needs the params"),
        (lambda: optim.adamw(1e-3, weight_decay=0.1), r"decay_weights.update: decay_weights needs the params"),
    ],
    ids=["adam", "adamw"],
)
def test_error_weight_decay_needs_params(make, match):
    opt = make()
    params = {"w": torch.ones(1)}
    with pytest.raises(ValueError, match=match + r"; call update\(updates, state, params\)"):
        opt.update({"w": torch.ones(1)}, opt.init(params))


def test_error_bad_grad_norm():
    opt = optim.clip_by_global_norm(1.0)
    g = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match=r"grad_norm must be a float or a 0-dim tensor, got str"):
        opt.update(g, opt.init(g), grad_norm="big")


def test_error_non_tensor_leaf():
    opt = optim.scale(2.0)
    with pytest.raises(TypeError, match=r"updates at w is float 1.0"):
        opt.update({"w": 1.0}, opt.init({"w": 1.0}))


# --------------------------------------------------------------------------- #
# The fused in-place path (update_params) against the chain and torch
# --------------------------------------------------------------------------- #


def _fused_case(make_opt, torch_cls, steps=100, **torch_kwargs):
    gen = torch.Generator().manual_seed(7)
    shapes = [(33, 17), (5,), (), (64,)]
    params = {f"p{i}": torch.randn(s, generator=gen) for i, s in enumerate(shapes)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(steps)]
    opt = make_opt()
    fused_p = {k: v.clone() for k, v in params.items()}
    chain_p = {k: v.clone() for k, v in params.items()}
    fs, cs = opt.init(fused_p), opt.init(chain_p)
    ref = [torch.nn.Parameter(v.clone()) for v in params.values()]
    topt = torch_cls(ref, fused=True, **torch_kwargs)
    for g in grads:
        fs = optim.update_params(opt, {k: v.clone() for k, v in g.items()}, fs, fused_p)
        u, cs = opt.update({k: v.clone() for k, v in g.items()}, cs, chain_p)
        optim.apply_updates(chain_p, u)
        for r, v in zip(ref, g.values()):
            r.grad = v.clone()
        topt.step()
    return fused_p, chain_p, {k: r.detach() for k, r in zip(params, ref)}, fs, cs, params


@pytest.mark.parametrize(
    "name, make_opt, torch_cls, kwargs",
    [
        ("adamw", lambda: optim.adamw(1e-2, weight_decay=0.1), torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        ("adam_l2", lambda: optim.adam(1e-2, weight_decay=0.1), torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
        ("adam", lambda: optim.adam(3e-3), torch.optim.Adam, dict(lr=3e-3)),
    ],
)
def test_fused_path_matches_chain_and_torch_fused(name, make_opt, torch_cls, kwargs):
    fused, chained, ref, fs, cs, init = _fused_case(make_opt, torch_cls, **kwargs)
    for k in fused:
        scale = max(init[k].abs().max().item(), fused[k].abs().max().item(), 1e-3)
        assert (fused[k] - ref[k]).abs().max().item() / scale <= 1e-6, (name, k)
        assert (fused[k] - chained[k]).abs().max().item() / scale <= 1e-6, (name, k)
        assert (fused[k] - init[k]).abs().max().item() > 1e-3  # it trained
    # both paths advance the same counts and moments
    for a, b in zip(_leaves(fs), _leaves(cs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _leaves(tree):
    from zerofn.tree import tree_leaves

    return tree_leaves(tree)


def test_fused_path_follows_a_schedule_and_a_clip():
    sched = optim.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 40)
    opt = optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(sched, weight_decay=0.1))
    assert opt.update_in_place is not None
    gen = torch.Generator().manual_seed(3)
    p1 = {"w": torch.randn(40, generator=gen), "b": torch.randn(3, generator=gen)}
    p2 = {k: v.clone() for k, v in p1.items()}
    s1, s2 = opt.init(p1), opt.init(p2)
    for _ in range(40):
        g = {k: torch.randn(v.shape, generator=gen) for k, v in p1.items()}
        s1 = optim.update_params(opt, {k: v.clone() for k, v in g.items()}, s1, p1)
        u, s2 = opt.update({k: v.clone() for k, v in g.items()}, s2, p2)
        optim.apply_updates(p2, u)
    for k in p1:
        torch.testing.assert_close(p1[k], p2[k], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_leaves(s1)[0], _leaves(s2)[0])


def test_fused_path_falls_back_on_mixed_dtypes():
    """A parameter whose gradient has another dtype cannot take the kernel: the chain runs instead."""
    opt = optim.adamw(1e-2)
    p = {"w": torch.ones(4, dtype=torch.float64)}
    s = opt.init(p)
    with pytest.raises(ValueError, match="dtype"):
        optim.update_params(opt, {"w": torch.ones(4, dtype=torch.float32)}, s, p)
