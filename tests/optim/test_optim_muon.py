"""zf.optim.muon against torch.optim.Muon: on whole parameters, and through a step on 1 and 2 gloo ranks under
every stage (muon for the matrices, adamw for the rest through multi_transform, against torch's Muon + AdamW)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from helpers import max_abs_diff, train
from torch import nn
from zerofn.transforms import shard_grads, shard_optimizer, shard_params

import zerofn as zf
from zerofn.optim.muon import MuonState, muon

GLOBAL_BATCH = 8
STEPS = 4
MUON_LR, ADAMW_LR = 0.02, 3e-3


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, hidden, bias=False)  # wide: (hidden, dim)
        self.proj = nn.Linear(hidden, dim)  # tall: (dim, hidden), and a bias

    def forward(self, x):
        return x + self.proj(torch.tanh(self.fc(self.norm(x))))


class Net(nn.Module):
    """Matrices tall and wide, biases, norms, blocks (units for shard_params) and a branch used on even steps."""

    def __init__(self, dim=24):
        super().__init__()
        self.inp = nn.Linear(7, dim)
        self.blocks = nn.ModuleList([Block(dim, 16), Block(dim, 29)])
        self.branch = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, 3)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = b(h)
        if use_branch:  # not taken on odd steps: no gradient, so neither optimizer touches it there
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def make_net(dtype=torch.float32):
    torch.manual_seed(0)
    return Net().to(dtype)


def batch_for(step, n, dtype=torch.float32):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 7, generator=g).to(dtype)
    return {"x": x, "y": torch.sin(x[:, :3] * 2)}


def is_matrix(params):
    return {n: "muon" if p.ndim == 2 else "adamw" for n, p in params.items()}


def _schedule(count):
    return MUON_LR * (count + 1) / STEPS


def _muon_opt(nesterov, schedule):
    return muon(_schedule if schedule else MUON_LR, nesterov=nesterov)


def _groups(nesterov=True, schedule=False, all_adamw=False):
    matrices = zf.optim.adamw(ADAMW_LR, weight_decay=0.1) if all_adamw else _muon_opt(nesterov, schedule)
    return zf.optim.multi_transform({"muon": matrices, "adamw": zf.optim.adamw(ADAMW_LR, weight_decay=0.01)}, is_matrix)


def torch_reference(nesterov, schedule, dtype, steps=STEPS):
    """torch.optim.Muon for the matrices, torch.optim.AdamW for the rest, on the whole batch."""
    model = make_net(dtype)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    muon_opt = torch.optim.Muon(matrices, lr=MUON_LR, nesterov=nesterov)
    # fused: the kernel zf.optim.adamw runs (torch's foreach AdamW rounds otherwise on some CPUs, e.g. AVX2 against
    # AVX-512, in the last bits of a float32 update)
    adamw_opt = torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=0.01, fused=True)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(muon_opt, lambda c: _schedule(c) / MUON_LR) if schedule else None
    for i in range(steps):
        b = batch_for(i, GLOBAL_BATCH, dtype)
        loss = ((model(b["x"], use_branch=i % 2 == 0) - b["y"]) ** 2).mean()
        muon_opt.zero_grad()
        adamw_opt.zero_grad()
        loss.backward()
        muon_opt.step()
        adamw_opt.step()
        if lr_sched is not None:
            lr_sched.step()
    return {k: v.detach() for k, v in model.named_parameters()}


# ---------------------------------------------------------------- whole parameters, one process


def _matrices():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13, bias=False), nn.Tanh(), nn.Linear(13, 3, bias=False))


def _grads_of(model, params, batch):
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = ((torch.func.functional_call(model, leaves, (batch["x"],)) - batch["y"]) ** 2).mean()
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


@pytest.mark.parametrize(
    "options",
    [{}, {"nesterov": False}, {"adjust_lr_fn": "match_rms_adamw", "momentum": 0.5}, {"weight_decay": 0.0}],
    ids=["defaults", "no-nesterov", "match_rms_adamw", "no-decay"],
)
def test_equals_torch_muon_bit_for_bit_on_whole_matrices(options):
    """update_params on a tree of whole matrices (a tall one and a wide one) lands where torch.optim.Muon does,
    to the bit, momentum buffers too; the pure update, added, lands there within rounding."""
    model = _matrices()
    ref = copy.deepcopy(model)
    torch_opt = torch.optim.Muon(ref.parameters(), lr=MUON_LR, **options)
    opt = muon(MUON_LR, **options)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    state = opt.init(params)
    first_update = None
    for i in range(STEPS):
        b = batch_for(i, 16)
        torch_opt.zero_grad()
        ((ref(b["x"]) - b["y"]) ** 2).mean().backward()
        torch_opt.step()
        grads = _grads_of(model, params, b)
        if i == 0:
            first_update, _ = opt.update({k: g.clone() for k, g in grads.items()}, opt.init(params), params)
            first_update = {k: params[k] + u for k, u in first_update.items()}
        state = zf.optim.update_params(opt, grads, state, params)
        if i == 0:
            assert max_abs_diff(first_update, params) <= 1e-7
    for k, v in ref.named_parameters():
        assert torch.equal(params[k], v.detach()), (k, (params[k] - v).abs().max().item())
        assert torch.equal(state.momentum[k], torch_opt.state[v]["momentum_buffer"]), k
    assert int(state.count) == STEPS


def test_step_on_a_module_of_matrices_equals_torch_muon():
    """zf.train_step with muon on an nn.Module of Linear(bias=False) layers equals torch.optim.Muon driving it."""
    model = _matrices()
    ref = copy.deepcopy(model)
    apply = zf.functional(model)

    def loss_fn(params, batch):
        return ((apply(params, batch["x"]) - batch["y"]) ** 2).mean()

    step = zf.train_step(loss_fn, muon(MUON_LR))
    state = step.init(apply.params)
    torch_opt = torch.optim.Muon(ref.parameters(), lr=MUON_LR)
    for i in range(STEPS):
        b = batch_for(i, GLOBAL_BATCH)
        state, _ = step(state, b)
        torch_opt.zero_grad()
        ((ref(b["x"]) - b["y"]) ** 2).mean().backward()
        torch_opt.step()
    assert max_abs_diff(step.full_params(state), {k: v.detach() for k, v in ref.named_parameters()}) == 0.0


def test_refuses_parameters_that_are_not_matrices_and_bad_options():
    with pytest.raises(ValueError, match=r"(?s)'b' has shape \(3,\).*2-D parameters only.*multi_transform"):
        muon().init({"w": torch.zeros(2, 3), "b": torch.zeros(3)})
    _, apply, loss_fn = _model_step_parts()
    text = r"(?s)parameters 'blocks.0.norm.bias' \(shape \(24,\)\), .* and 5 more are not 2-D.*\"muon\" if p.ndim == 2"
    with pytest.raises(ValueError, match=text):
        zf.train_step(loss_fn, muon()).init(apply.params)
    with pytest.raises(ValueError, match=r"ns_steps must be an int in \[0, 100\), got 100"):
        muon(ns_steps=100)
    with pytest.raises(ValueError, match="adjust_lr_fn must be one of"):
        muon(adjust_lr_fn="nope")
    with pytest.raises(TypeError, match="ns_coefficients must be three real numbers"):
        muon(ns_coefficients=(1.0, 2.0))
    with pytest.raises(ValueError, match=r"momentum must be in \[0, inf\]"):
        muon(momentum=-0.1)
    with pytest.raises(ValueError, match="schedule returned -1.0 at count 0"):
        opt = muon(lambda count: -1.0)
        p = {"w": torch.zeros(2, 2)}
        zf.optim.update_params(opt, {"w": torch.ones(2, 2)}, opt.init(p), p)


def test_state_keeps_its_structure_and_dtypes():
    p = {"w": torch.zeros(3, 2), "v": torch.zeros(2, 5, dtype=torch.float64)}
    opt = muon()
    s0 = opt.init(p)
    shapes = zf.tree.tree_map(lambda t: (t.shape, t.dtype), s0)
    s1 = zf.optim.update_params(opt, {"w": torch.ones(3, 2), "v": torch.ones(2, 5, dtype=torch.float64)}, s0, p)
    assert isinstance(s1, MuonState) and zf.tree.tree_map(lambda t: (t.shape, t.dtype), s1) == shapes


def _model_step_parts(dtype=torch.float32, accumulate=1):
    """The Net, its apply, and a loss that takes the branch on even steps (of ``accumulate`` micro-steps each)."""
    model = make_net(dtype)
    apply = zf.functional(model)
    calls = [0]

    def loss_fn(params, batch):
        use_branch = calls[0] // accumulate % 2 == 0
        calls[0] += 1
        return ((apply(params, batch["x"], use_branch=use_branch) - batch["y"]) ** 2).mean()

    return model, apply, loss_fn


# ---------------------------------------------------------------- through a step, every stage, 1 and 2 ranks
#
# In float64. Newton-Schulz starts by rounding the direction to bfloat16, and the iteration amplifies a difference
# there: in float32 a gradient summed in another order (over ranks, or over micro-batches: torch's own
# accumulation against its full batch) crosses a bfloat16 rounding boundary now and then, and moves a matrix by up
# to 3e-3 after 4 steps at lr 0.02 (torch against torch). In float64 the orders differ by 1e-17 and never cross
# one, so the comparison tests the sharded update itself. In float32, without accumulation, each stage on one rank
# is bit for bit.

COMPOSITIONS = {
    "plain": lambda s: s,
    "shard_optimizer": shard_optimizer,
    "shard_grads": shard_grads,
    "shard_params": shard_params,
    "shard_optimizer(shard_params(shard_grads))": lambda s: shard_optimizer(shard_params(shard_grads(s))),
}
CASES = [  # (composition, accumulate, bucket_bytes, nesterov, schedule); GLOBAL_BATCH splits into world x accumulate
    ("plain", 1, None, True, False),
    ("plain", 2, 1024, False, True),
    ("shard_optimizer", 1, None, True, False),
    ("shard_optimizer", 1, 1024, False, True),  # many buckets: a gather in flight while another is orthogonalised
    ("shard_grads", 2, None, True, False),
    ("shard_params", 1, None, True, True),
    ("shard_optimizer(shard_params(shard_grads))", 2, 2048, True, False),
]
TRAFFIC_CASE = CASES[2]
EXACT = [(c, 1, None, True, False) for c in COMPOSITIONS]  # float32, one rank: bit for bit


def _train(composition, accumulate, bucket_bytes, nesterov, schedule, world, rank, dtype, all_adamw=False):
    _, apply, loss_fn = _model_step_parts(dtype, accumulate)
    kw = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    step = zf.train_step(loss_fn, _groups(nesterov, schedule, all_adamw), accumulate, **kw)
    step = COMPOSITIONS[composition](step)
    state = step.init(apply.params)
    state, metrics = train(step, state, lambda i, n: batch_for(i, n, dtype), STEPS, GLOBAL_BATCH, world, rank)
    layout = state.spec.layout
    muon_bytes = sum(2 * b.padded for b in layout.buckets if all(len(s.shape) == 2 for s in b.slots))
    return step.full_params(state), int(metrics["comm_bytes"]), muon_bytes


def _rank_cases(cases, exact):
    world, rank = dist.get_world_size(), dist.get_rank()
    out = [_train(*case, world, rank, torch.float64) for case in cases]
    # the traffic muon adds: one bf16 all-gather of each muon bucket (2 bytes per padded element) when sharded
    adamw_only = _train(*TRAFFIC_CASE, world, rank, torch.float64, all_adamw=True)[1]
    exact_out = [_train(*case, world, rank, torch.float32)[0] for case in exact]
    return out, out[CASES.index(TRAFFIC_CASE)][1] - adamw_only, exact_out


@pytest.mark.parametrize("world", [1, 2])
def test_every_stage_equals_torch_muon_and_adamw(ranks, world):
    """muon for the matrices and adamw for the rest, under every stage, equal torch.optim.Muon + torch.optim.AdamW."""
    refs = {(n, s): torch_reference(n, s, torch.float64) for n, s in {(c[3], c[4]) for c in CASES}}
    ref32 = torch_reference(True, False, torch.float32)
    init = {k: v.detach() for k, v in make_net(torch.float64).named_parameters()}
    exact = EXACT if world == 1 else []
    for rank, (results, extra_bytes, exact_out) in enumerate(ranks(world).run(_rank_cases, CASES, exact)):
        for case, (params, _, _) in zip(CASES, results):
            diff = max_abs_diff(params, refs[case[3], case[4]])
            assert diff <= 1e-5, f"{case} world={world} rank={rank}: max abs param diff {diff:.3g}"
            assert all((params[k] - init[k]).abs().max() > 1e-3 for k in init), case  # every parameter moved
        for case, params in zip(exact, exact_out):
            assert max_abs_diff(params, ref32) == 0.0, case
        # traffic: none on one rank; else one all-gather of each muon bucket per step, in bfloat16
        expected = 0 if world == 1 else results[CASES.index(TRAFFIC_CASE)][2]
        assert extra_bytes == expected, (world, extra_bytes, expected)
    assert len(exact_out) == (len(COMPOSITIONS) if world == 1 else 0)


def test_missing_parameter_keeps_its_momentum():
    """A matrix without a gradient on a step: its weight and momentum stay exactly as they were."""
    _, apply, loss_fn = _model_step_parts()
    step = zf.train_step(loss_fn, _groups())
    state = step.init(apply.params)
    state, _ = step(state, batch_for(0, GLOBAL_BATCH))  # branch used
    before = step.full_params(state)["branch.weight"].clone()
    momentum = state.opt_state.inner_states["muon"].momentum
    moments = {k: v.clone() for k, v in momentum.items()}
    state, _ = step(state, batch_for(1, GLOBAL_BATCH))  # branch not used
    assert torch.equal(step.full_params(state)["branch.weight"], before)
    slot = next(s for b in state.spec.layout.buckets for s in b.slots if s.name == "branch.weight")
    key = next(f"b{i}" for i, b in enumerate(state.spec.layout.buckets) if slot in b.slots)
    after = state.opt_state.inner_states["muon"].momentum[key]
    sl = slice(slot.offset, slot.offset + slot.numel)
    assert torch.equal(after[sl], moments[key][sl])
    assert not torch.equal(after, moments[key])  # the other matrices' momentum moved
