"""zf.optim.lamb against LAMB written out per parameter in one process: alone on a tree of whole parameters,
and under every stage on 1, 2 and 3 real gloo ranks, whose shards cut parameters apart."""

from __future__ import annotations

import pytest
import torch
from helpers import MLP, max_abs_diff, mlp_batch, rank_slice, train
from torch import nn
from zerofn.transforms import offload, shard_grads, shard_optimizer, shard_params

import zerofn as zf
from zerofn import optim
from zerofn.optim.lamb import lamb, scale_by_trust_ratio
from zerofn.optim.view import ParamView, StepInfo


class ReferenceLamb:
    """LAMB, one parameter at a time: optax.lamb's formulas, DeepSpeed's optional clamp of the ratio, and
    torch's rule for a parameter without a gradient (no update, its own step count stays)."""

    def __init__(
        self,
        lr,
        betas=(0.9, 0.999),
        eps=1e-6,
        weight_decay=0.0,
        *,
        decays=None,
        bias_correction=True,
        min_trust_ratio=None,
        max_trust_ratio=None,
    ):
        self.lr, (self.b1, self.b2), self.eps, self.wd = lr, betas, eps, weight_decay
        self.decays, self.bias_correction = decays, bias_correction
        self.low, self.high = min_trust_ratio, max_trust_ratio
        self.m, self.v, self.t, self.count = {}, {}, {}, 0

    @torch.no_grad()
    def step(self, params: dict, grads: dict) -> None:
        """``grads[name]`` is None (or absent) for a parameter that got no gradient."""
        lr = self.lr(self.count) if callable(self.lr) else self.lr
        self.count += 1
        for name, w in params.items():
            g = grads.get(name)
            if g is None:
                continue
            m = self.m.setdefault(name, torch.zeros_like(w))
            v = self.v.setdefault(name, torch.zeros_like(w))
            t = self.t[name] = self.t.get(name, 0) + 1
            m.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            if self.bias_correction:
                u = (m / (1 - self.b1**t)) / ((v / (1 - self.b2**t)).sqrt() + self.eps)
            else:
                u = m / (v.sqrt() + self.eps)
            if self.wd and (self.decays is None or name in self.decays):
                u = u + self.wd * w
            w_norm, u_norm = torch.linalg.vector_norm(w).item(), torch.linalg.vector_norm(u).item()
            ratio = 1.0
            if w_norm > 0 and u_norm > 0:
                ratio = w_norm / u_norm
                ratio = max(ratio, self.low) if self.low is not None else ratio
                ratio = min(ratio, self.high) if self.high is not None else ratio
            w.sub_(lr * ratio * u)


def _decays(params: dict) -> set:
    """The parameters optim.decay_mask() decays (nanoGPT's rule: two or more dimensions)."""
    return {n for n, p in params.items() if p.ndim >= 2}


# --------------------------------------------------------------------------- #
# On a tree of whole parameters (unbound)
# --------------------------------------------------------------------------- #

SHAPES = {  # matrices, vectors, a 0-dim scalar, a parameter that starts at zero (||w|| = 0), two dtypes
    "w1": ((8, 5), torch.float32),
    "b1": ((5,), torch.float32),
    "gain": ((), torch.float32),
    "zero": ((6,), torch.float32),
    "w2": ((3, 4), torch.float64),
    "b2": ((4,), torch.float64),
}
TREE_STEPS = 30


def _tree(seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    out = {k: torch.randn(s, generator=gen, dtype=d) for k, (s, d) in SHAPES.items()}
    out["zero"].zero_()
    return out


def _grads(params: dict, step: int) -> dict:
    gen = torch.Generator().manual_seed(1000 + step)
    return {k: torch.randn(p.shape, generator=gen, dtype=p.dtype) + 0.1 * p for k, p in params.items()}


def _missing(step: int) -> frozenset:
    """Parameters that get no gradient on ``step``: ``b1`` on steps 3 to 5, ``gain`` on every third step."""
    return frozenset(({"b1"} if 3 <= step <= 5 else set()) | ({"gain"} if step % 3 == 0 else set()))


TREE_CASES = {
    "defaults": dict(lr=1e-2),
    "decay+mask": dict(lr=1e-2, weight_decay=0.1, mask=optim.decay_mask()),
    "decay-all+betas": dict(lr=2e-2, betas=(0.8, 0.99), eps=1e-5, weight_decay=0.05),
    "no-bias-correction": dict(lr=1e-2, weight_decay=0.1, bias_correction=False),
    "clamped": dict(lr=1e-2, min_trust_ratio=0.9, max_trust_ratio=1.1),
    "schedule": dict(lr=optim.linear_schedule(1e-2, 1e-3, TREE_STEPS), weight_decay=0.1),
}


def _reference_of(kw: dict, params: dict) -> ReferenceLamb:
    kw = dict(kw)
    mask = kw.pop("mask", None)
    return ReferenceLamb(decays=_decays(params) if mask is not None else None, **kw)


def _run_tree(kw: dict, *, with_missing: bool):
    params, ref_params = _tree(), _tree()
    start = {k: p.clone() for k, p in params.items()}
    ref = _reference_of(kw, params)
    opt = lamb(**kw)
    state = opt.init(params)
    for step in range(TREE_STEPS):
        missing = _missing(step) if with_missing else frozenset()
        grads = _grads(params, step)
        ref_grads = _grads(ref_params, step)
        for n in missing:  # as a step hands them over: zeros, and the parameter named in info.missing
            grads[n].zero_()
            ref_grads[n] = None
        info = StepInfo(missing, {n: ref.t.get(n, 0) for n in params}, step)
        before = {n: params[n].clone() for n in missing}
        updates, state = opt.update(grads, state, params, info=info)
        for n in missing:
            assert torch.equal(updates[n], torch.zeros_like(updates[n])), f"step {step}: {n} got an update"
        optim.apply_updates(params, updates)
        for n in missing:
            assert torch.equal(params[n], before[n])
        ref.step(ref_params, ref_grads)
    return params, ref_params, start, ref, state


@pytest.mark.parametrize("kw", TREE_CASES.values(), ids=TREE_CASES.keys())
def test_unbound_equals_reference(kw):
    """On a plain tree (no step, no view), lamb is the per-parameter reference, missing gradients included."""
    params, ref_params, start, ref, state = _run_tree(kw, with_missing=True)
    diff = max_abs_diff(params, ref_params)
    assert diff <= 1e-6, f"max abs param diff {diff:.3g}"
    adam = state[0]
    assert max_abs_diff(adam.mu, ref.m) <= 1e-6 and max_abs_diff(adam.nu, ref.v) <= 1e-6
    assert int(adam.count) == TREE_STEPS  # the chain's count; each parameter's own count is the step's to keep
    assert max_abs_diff(params, start) > 1e-2  # it trained


def test_trust_ratio_is_what_differs_from_adam():
    """Not vacuous: the same chain without the trust ratio ends elsewhere, and a zero parameter still moves."""
    params = _run_tree(dict(lr=1e-2), with_missing=False)[0]
    adam = optim.adam(1e-2, eps=1e-6)
    plain = _tree()
    state = adam.init(plain)
    for step in range(TREE_STEPS):
        state = optim.update_params(adam, _grads(plain, step), state, plain)
    assert max_abs_diff(params, plain) > 1e-2
    assert params["zero"].abs().max() > 1e-2  # ||w|| = 0 on the first step: ratio 1, not 0


def test_scale_by_trust_ratio_formula():
    """optax's options: min_norm, trust_coefficient, eps; the clamp; a zero norm gives a ratio of 1."""
    p = {"w": torch.tensor([3.0, 4.0]), "z": torch.zeros(2), "s": torch.tensor([1e-8, 0.0])}
    u = {"w": torch.tensor([0.0, 2.0]), "z": torch.ones(2), "s": torch.zeros(2)}

    def run(**kw):
        opt = scale_by_trust_ratio(**kw)
        out, _ = opt.update({k: v.clone() for k, v in u.items()}, opt.init(p), p)
        return {k: v.tolist() for k, v in out.items()}

    assert run() == {"w": [0.0, 5.0], "z": [1.0, 1.0], "s": [0.0, 0.0]}
    r = run(trust_coefficient=0.5, eps=0.5)["w"][1] / 2.0
    assert r == pytest.approx(0.5 * 5.0 / (2.0 + 0.5))
    assert run(max_ratio=2.0)["w"] == [0.0, 4.0] and run(max_ratio=2.0)["z"] == [1.0, 1.0]
    assert run(min_norm=10.0)["w"] == pytest.approx([0.0, 2.0])  # both norms raised to 10: ratio 1
    with pytest.raises(ValueError, match="max_ratio must be in"):
        scale_by_trust_ratio(min_ratio=2.0, max_ratio=1.0)
    with pytest.raises(ValueError, match="needs the params"):
        scale_by_trust_ratio().update(u, ())


def test_leaf_the_view_does_not_describe_raises():
    """Bound to a step's view, a leaf cut otherwise (offload('nvme')'s sub-groups) is refused, not guessed."""
    view = ParamView.of_tree({"b0": torch.zeros(6)})
    opt = optim.bind(lamb(1e-2), view)
    x = {"x": torch.ones(3)}
    with pytest.raises(ValueError, match=r"leaf 'x' \(3 elements\) is not one its view describes"):
        opt.update({"x": torch.ones(3)}, opt.init(x), x)


# --------------------------------------------------------------------------- #
# Under a step, on 1, 2 and 3 ranks
# --------------------------------------------------------------------------- #

GLOBAL_BATCH = 12  # world x (rows per rank) for world 1, 2, 3
STEPS = 4


class AuxMLP(MLP):
    """The test MLP and a head used on odd steps only: on even steps no rank gives it a gradient."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Linear(3, 3)

    def forward(self, x, use_aux):
        x = super().forward(x)
        return self.aux(x) if use_aux else x


def _model(name: str):
    torch.manual_seed(0)
    model = AuxMLP() if name == "aux" else MLP()
    apply = zf.functional(model)

    def loss_fn(params, batch):
        args = (batch["x"], bool(batch["aux"][0])) if name == "aux" else (batch["x"],)
        return ((apply(params, *args) - batch["y"]) ** 2).mean()

    return model, apply, loss_fn


def _batch(step: int, n: int) -> dict:
    return {**mlp_batch(step, n), "aux": torch.full((n,), step % 2)}


STAGES = {
    "plain": lambda s: s,
    "shard_optimizer": shard_optimizer,
    "shard_grads": shard_grads,
    "shard_params": shard_params,
    "offload": lambda s: offload(s, "cpu"),
    "offload(shard_optimizer)": lambda s: offload(shard_optimizer(s), "cpu"),
}
CONFIGS = {
    "lamb": dict(lr=2e-2),
    "lamb+decay+mask": dict(lr=2e-2, weight_decay=0.1, mask=optim.decay_mask()),
}
STAGE_NAMES = ("plain", "shard_optimizer", "shard_grads", "shard_params")
CASES = [  # (stage, config, bucket_bytes, model)
    *[(s, "lamb+decay+mask", 1 << 20, "mlp") for s in STAGE_NAMES],  # decay and no decay: two buckets, cut by shards
    *[(s, "lamb", 256, "mlp") for s in STAGE_NAMES],  # a bucket per parameter (shards cut most of them)
    *[(s, "lamb+decay+mask", 1 << 20, "aux") for s in STAGE_NAMES],  # a parameter missing on alternate steps
    *[(s, "lamb+decay+mask", 256, "mlp") for s in ("offload", "offload(shard_optimizer)")],  # updated on the host
]
TRAFFIC_STAGES = ("plain", "shard_optimizer", "shard_params")


def _train_zf(case: tuple, world: int, rank: int) -> dict:
    stage, config, bucket_bytes, name = case
    _, apply, loss_fn = _model(name)
    step = STAGES[stage](zf.train_step(loss_fn, lamb(**CONFIGS[config]), bucket_bytes=bucket_bytes))
    state = step.init(apply.params)
    state, _ = train(step, state, _batch, STEPS, GLOBAL_BATCH, world, rank)
    return step.full_params(state)


def _traffic(stage: str, world: int, rank: int) -> dict:
    """One step's collectives under lamb and under adam (the same chain without the trust ratio)."""
    out = {}
    for name, opt in (("lamb", lamb(1e-2)), ("adam", optim.adam(1e-2, eps=1e-6))):
        _, apply, loss_fn = _model("mlp")
        step = STAGES[stage](zf.train_step(loss_fn, opt, bucket_bytes=256))
        state = step.init(apply.params)
        with zf.collectives.counting() as counter:
            state, metrics = step(state, rank_slice(_batch(0, GLOBAL_BATCH), rank, world))
        out[name] = (int(metrics["comm_bytes"]), counter.calls.get("all_reduce", 0))
    return out


def _on_worker_thread(world: int, rank: int) -> float:
    """offload's overlapped update would run on its worker thread, where the trust ratio's all-reduce could
    cross the next step's collectives: an optimizer that communicates says so, and offload updates in the
    step instead. The max difference from the same step without offload."""
    out = []
    for wrap in (lambda s: offload(s, "cpu", overlap=True), lambda s: s):
        _, apply, loss_fn = _model("mlp")
        step = wrap(shard_optimizer(zf.train_step(loss_fn, lamb(1e-2))))
        state = step.init(apply.params)
        state, _ = train(step, state, _batch, 2, GLOBAL_BATCH, world, rank)
        out.append(step.full_params(state))
    return max_abs_diff(*out)


def _rank_all(cases):
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    params = [_train_zf(case, world, rank) for case in cases]
    traffic = {stage: _traffic(stage, world, rank) for stage in TRAFFIC_STAGES}
    return params, traffic, _on_worker_thread(world, rank) if world == 2 else None


def _reference(config: str, name: str) -> dict:
    """The one-process reference: torch autograd on the module over the whole batch, LAMB per parameter."""
    model, _, _ = _model(name)
    params = dict(model.named_parameters())
    kw = dict(CONFIGS[config])
    ref = ReferenceLamb(decays=_decays(params) if kw.pop("mask", None) is not None else None, **kw)
    for i in range(STEPS):
        batch = _batch(i, GLOBAL_BATCH)
        out = model(batch["x"], bool(batch["aux"][0])) if name == "aux" else model(batch["x"])
        model.zero_grad(set_to_none=True)
        ((out - batch["y"]) ** 2).mean().backward()
        ref.step({n: p.data for n, p in params.items()}, {n: p.grad for n, p in params.items()})
    return {n: p.detach() for n, p in params.items()}


@pytest.fixture(scope="module")
def references():
    return {(config, name): _reference(config, name) for config in CONFIGS for name in ("mlp", "aux")}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_under_every_stage_equals_one_process(ranks, references, world):
    """Every stage (shards cutting parameters across ranks, buckets of one parameter each, weight decay with
    a mask, a parameter no rank uses on alternate steps) ends where the one-process reference does."""
    results = ranks(world).run(_rank_all, CASES) if world > 1 else [_rank_all(CASES)]
    init = {n: p.detach() for n, p in _model("aux")[0].named_parameters()}
    assert max_abs_diff(references["lamb", "mlp"], {n: init[n] for n in references["lamb", "mlp"]}) > 1e-2
    for rank, (params, traffic, on_worker) in enumerate(results):
        for case, got in zip(CASES, params):
            ref = references[case[1], case[3]]
            diff = max_abs_diff(got, ref)
            assert diff <= 1e-6, f"{case} world={world} rank={rank}: max abs param diff {diff:.3g}"
            if case[3] == "aux":
                assert max_abs_diff({"w": got["aux.weight"]}, {"w": init["aux.weight"]}) > 1e-3  # trained on odd steps
        # the trust ratio's one all-reduce: 2 float64 per parameter (6 here), counted twice, where shards cut them
        for stage, t in traffic.items():
            extra_bytes, extra_calls = t["lamb"][0] - t["adam"][0], t["lamb"][1] - t["adam"][1]
            sharded = world > 1 and stage != "plain"
            assert (extra_bytes, extra_calls) == ((2 * 2 * 6 * 8, 1) if sharded else (0, 0)), (stage, world, t)
        if world == 2:
            assert on_worker == 0.0, on_worker
