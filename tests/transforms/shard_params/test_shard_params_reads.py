"""Parameters read outside their unit under shard_params, on 2 real gloo ranks, against torch on one process.

shard_params hands ``loss_fn`` placeholders and gathers a unit's parameters only around that unit's module calls.
A parameter can still be read elsewhere: directly in ``loss_fn`` (an L2 penalty, a head tied to the embedding but
computed outside the model) or inside the model's forward outside its block (a block's weight reused after the
block ran). Such a read gathers the unit if it is not gathered, and its gradient flows into the unit's bucket before
the unit's reduce-scatter. The tests check the resulting parameters against torch.optim.AdamW driving the module on
the concatenated batch (every composition), the traffic such a read costs, and that ranks which run different units
fail together within seconds instead of waiting out ZEROFN_TIMEOUT_S.

Every equality and traffic case runs in one ``ranks(2).run``; the divergence cases run in one call of ranks of their
own (started with ZEROFN_TIMEOUT_S=600, closed after: the session's shared pool never sees a failed step).
"""

from __future__ import annotations

import functools
import math
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import compositions, groups_in_step, max_abs_diff, rank_slice
from torch import nn

import zerofn as zf
from zerofn import collectives as C

LR, WD, EPS = 1e-2, 0.01, 1e-8
STEPS, GLOBAL_BATCH = 3, 8
PENALTY = 1e-1  # the L2 penalty's coefficient: large enough that its gradient shows at the tolerance (checked)
TOL = 1e-6
# float64, compared to 1e-6; remat's recompute in backward swaps the unit's leaves into the model again
STAGES = ("plain", "shard_optimizer", "shard_grads", "shard_params", "offload", "remat+shard_params")
# The ranks' agreement before a gather: a max-reduce of (a code for the point of the step, -code), two int64, on the
# control group; an all-reduce of n bytes counts 2n (zerofn.collectives).
AGREEMENT_BYTES = 2 * (2 * torch.empty(0, dtype=torch.int64).element_size())
DIVERGE_TIMEOUT_S = 600  # ZEROFN_TIMEOUT_S for the diverging ranks: a hang would wait this long
DIVERGE_LIMIT_S = 30.0  # the diverging ranks must raise within this


# ---------------------------------------------------------------- the models


def _mlp(dtype=torch.float64) -> nn.Module:
    """A 3-layer MLP as a plain Sequential: units "0", "2" and "4" (the Tanh modules hold nothing)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 11), nn.Tanh(), nn.Linear(11, 3)).to(dtype)


FIRST, LAST = "0", "4"  # the MLP's first and last block


class TiedOutside(nn.Module):
    """An embedding and residual blocks; the head (the embedding's transpose) is applied by loss_fn, not here."""

    def __init__(self, vocab=17, dim=8, layers=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return x


class UsedOutside(nn.Module):
    """The first block's weight used again after the second block ran, in the model's own forward (outside its
    unit: the call is the root's)."""

    def __init__(self, dim=6):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))

    def forward(self, x):
        return F.linear(self.blocks[1](self.blocks[0](x)), self.blocks[0].weight)


def _tied() -> nn.Module:
    torch.manual_seed(1)
    return TiedOutside().double()


def _outside() -> nn.Module:
    torch.manual_seed(2)
    return UsedOutside().double()


MODELS = {"mlp": _mlp, "tied": _tied, "outside": _outside}


def _batch(model: str, i: int, n: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(100 * i + 7)
    if model == "tied":
        return torch.randint(17, (n, 6), generator=g)
    x = torch.randn(n, 7 if model == "mlp" else 6, generator=g, dtype=torch.float64).to(dtype)
    return {"x": x, "y": torch.sin(2 * x[:, :3]) if model == "mlp" else torch.cos(x)}


def _loss(model: str, forward, param, penalise: str | None):
    """``loss(batch)`` given the model's forward and ``param(name)``, how a parameter is read: the same function for
    torch (the module and its attributes) and for zerofn (apply with the params, and ``params[name]``).

    mlp: mean squared error plus ``PENALTY`` x the squared norm of ``penalise``'s weight (None: no penalty);
    tied: next-token cross-entropy of the hidden states against the embedding; outside: mean squared error."""

    def loss(batch):
        if model == "tied":
            logits = F.linear(forward(batch[:, :-1]), param("emb.weight"))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        value = ((forward(batch["x"]) - batch["y"]) ** 2).mean()
        if penalise is not None:
            value = value + PENALTY * param(f"{penalise}.weight").square().sum()
        return value

    return loss


# ---------------------------------------------------------------- torch on one process


@functools.cache
def _torch_run(model: str, penalise: str | None = None, detach_head: bool = False) -> dict:
    """torch.optim.AdamW driving the module over ``STEPS`` whole global batches.

    ``detach_head``: the tied head's read carries no gradient (what a read that loses its gradient would give)."""
    module = MODELS[model]()
    named = dict(module.named_parameters())

    def param(name):
        return named[name].detach() if detach_head else named[name]

    opt = torch.optim.AdamW(module.parameters(), lr=LR, eps=EPS, weight_decay=WD)
    loss = _loss(model, module, param, penalise)
    for i in range(STEPS):
        opt.zero_grad()
        loss(_batch(model, i, GLOBAL_BATCH)).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ---------------------------------------------------------------- zerofn on the ranks


def _zf_step(model: str, stage: str, penalise: str | None):
    """The step and apply of ``model`` under ``stage``; amp's in float32, whose inputs autocast casts (it leaves
    float64 ones as they are, which bf16 weights then refuse)."""
    module = MODELS[model]().to(torch.float32 if stage == "amp" else torch.float64)
    apply = zf.functional(module)

    def loss_fn(params, batch):
        return _loss(model, lambda *a: apply(params, *a), params.__getitem__, penalise)(batch)

    step = _composition(stage)(zf.train_step(loss_fn, zf.optim.adamw(LR, eps=EPS, weight_decay=WD)))
    return step, apply


def _composition(stage: str):
    from zerofn.transforms import remat, shard_params

    if stage == "remat+shard_params":
        return lambda s: remat(shard_params(s))
    return compositions()[stage]


def _zf_run(model: str, stage: str, penalise: str | None) -> dict:
    """zerofn's ``STEPS`` steps on this rank's half of each batch: the full parameters (amp's masters), the losses."""
    world, rank = C.world_size(), C.rank()
    step, apply = _zf_step(model, stage, penalise)
    state = step.init(apply.params)
    dtype = torch.float32 if stage == "amp" else torch.float64
    losses = []
    for i in range(STEPS):
        state, metrics = step(state, rank_slice(_batch(model, i, GLOBAL_BATCH, dtype), rank, world))
        losses.append(float(metrics["loss"]))
    params = step.full_params(state, master=True) if stage == "amp" else step.full_params(state)
    return {"params": {k: v.detach().clone() for k, v in params.items()}, "losses": losses}


def _unit_bytes(layout) -> dict:
    """Bytes one all-gather of each unit moves, by unit name: its padded buffers (trainable and frozen)."""
    out = {}
    for unit in layout.units:
        buckets = [layout.buckets[i] for i in unit.buckets] + [layout.frozen_buckets[i] for i in unit.frozen]
        out[unit.name] = sum(b.padded * b.dtype.itemsize for b in buckets)
    return out


def _traffic() -> dict:
    """comm_bytes of the same two steps (same batches, same start) without a penalty, with one on the first block
    and with one on the last, under shard_params; and what one gather of each unit moves."""
    world, rank = C.world_size(), C.rank()
    out = {}
    for label, penalise in (("none", None), ("first", FIRST), ("last", LAST)):
        step, apply = _zf_step("mlp", "shard_params", penalise)
        state = step.init(apply.params)
        comm = []
        for i in range(2):  # the first step prefetches in registration order, the second in the recorded one
            state, metrics = step(state, rank_slice(_batch("mlp", i, GLOBAL_BATCH), rank, world))
            comm.append(int(metrics["comm_bytes"]))
        out[label] = comm
        out["units"] = _unit_bytes(state.spec.layout)
    return out


def _cases() -> list[tuple]:
    """Every case of the shared run; those under shard_params last (see :func:`_rank_cases`)."""
    cases = [("run", "mlp", stage, p) for stage in [*compositions(), STAGES[-1]] for p in (FIRST, LAST)]
    cases += [("run", "tied", stage, None) for stage in STAGES]
    cases += [("run", "outside", stage, None) for stage in STAGES]
    cases.append(("traffic",))
    return sorted(cases, key=lambda c: c[0] == "traffic" or c[2].endswith("shard_params"))


def _rank_cases(cases: list) -> dict:
    """Each case's result, or the error it raised (as text): a case that fails must not hide the others'. A case
    that raised may leave collectives unmatched, so the cases that read sharded parameters outside their unit run
    after the others, and the fixture has the pool start fresh ranks afterwards."""
    out = {}
    for case in cases:
        try:
            out[case] = _zf_run(*case[1:]) if case[0] == "run" else _traffic()
        except Exception as err:  # reported by the test that reads the case
            out[case] = f"{type(err).__name__}: {err}"
    return out


def _fail_run():
    raise RuntimeError("restart the pool: an earlier case raised and may have left collectives unmatched")


@pytest.fixture(scope="module")
def results(ranks):
    """{case: result} of each rank, from one run of the shared 2-rank pool."""
    pool = ranks(2)
    per_rank = pool.run(_rank_cases, _cases(), timeout=300)
    if any(isinstance(r, str) for out in per_rank for r in out.values()):
        with pytest.raises(zf.RankError):  # a failed run makes the pool start fresh ranks for later tests
            pool.run(_fail_run)
    return per_rank


def _result(per_rank: list[dict], case: tuple) -> dict:
    """Rank 0's result of ``case``, after checking it did not raise on any rank and is the same on both."""
    for rank, out in enumerate(per_rank):
        assert not isinstance(out[case], str), f"{case} raised on rank {rank}: {out[case]}"
    got = per_rank[0][case]
    assert max_abs_diff(per_rank[1][case]["params"], got["params"]) == 0, f"{case}: the ranks' parameters differ"
    return got


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("penalise", [FIRST, LAST])
def test_l2_penalty_read_in_loss_fn_equals_torch(results, stage, penalise):
    """``loss_fn`` adds ``PENALTY * params[name].square().sum()`` on a weight of the first block (released after
    its forward: the read gathers it again) or of the last one (still gathered into backward): after 3 AdamW steps
    the parameters equal torch's on the whole batch with the same penalty within 1e-6 (measured: 5.6e-17, float64
    rounding, on every stage), and the penalty's gradient shows at that tolerance (torch without it lands 0.06
    away)."""
    got = _result(results, ("run", "mlp", stage, penalise))
    ref = _torch_run("mlp", penalise)
    diff = max_abs_diff(got["params"], ref)
    assert diff <= TOL, f"{stage}, penalty on block {penalise}: max |zerofn - torch| {diff:.3g}"
    assert max_abs_diff(_torch_run("mlp", None), ref) > 100 * TOL


@pytest.mark.parametrize("penalise", [FIRST, LAST])
def test_l2_penalty_under_amp_trains(results, penalise):
    """amp (bf16 compute, fp32 masters; the model in float32) with the penalty read in loss_fn: the masters moved,
    stay within 2 bf16 ulp plus 3 Adam steps of torch's float64 run, and the penalised weight is nearer torch's
    with the penalty than torch's without it by more than 10x (measured: 60x on the first block, 80x on the last),
    so a penalty whose gradient was lost shows."""
    got = _result(results, ("run", "mlp", "amp", penalise))["params"]
    ref, without = _torch_run("mlp", penalise), _torch_run("mlp", None)
    init = {n: p.detach() for n, p in _mlp().named_parameters()}
    assert max_abs_diff(got, init) > LR, "amp's masters did not move"
    eps = torch.finfo(torch.bfloat16).eps
    for name, value in got.items():
        x, y = value.double(), ref[name]
        excess = ((x - y).abs() - (2 * eps * torch.maximum(x.abs(), y.abs()) + 3 * LR)).max().item()
        assert not math.isnan(excess) and excess <= 0, f"amp, penalty on {penalise}: {name} {excess:.3g} too far"
    weight = f"{penalise}.weight"
    near, far = ((got[weight].double() - r[weight]).abs().max().item() for r in (ref, without))
    assert 10 * near < far, f"amp, penalty on {penalise}: {near:.3g} from torch with it, {far:.3g} without"


@pytest.mark.parametrize("stage", STAGES)
def test_head_tied_outside_the_model_equals_torch(results, stage):
    """The logits are ``F.linear(apply(params, x), params["emb.weight"])`` in loss_fn: the embedding (the root
    unit's) gets both its gradients, within 1e-6 of torch (measured: 1.1e-16); a read that carried no gradient
    lands 0.06 away."""
    got = _result(results, ("run", "tied", stage, None))
    ref = _torch_run("tied")
    diff = max_abs_diff(got["params"], ref)
    assert diff <= TOL, f"{stage}: max |zerofn - torch| {diff:.3g}"
    assert max_abs_diff(_torch_run("tied", detach_head=True), ref) > 100 * TOL


@pytest.mark.parametrize("stage", STAGES)
def test_block_weight_used_outside_its_block_equals_torch(results, stage):
    """``F.linear(blocks[1](blocks[0](x)), blocks[0].weight)`` in the model's forward: the first block's weight,
    read by the root after the second block opened (its unit released), within 1e-6 of torch (measured: 5.6e-17)."""
    got = _result(results, ("run", "outside", stage, None))
    diff = max_abs_diff(got["params"], _torch_run("outside"))
    assert diff <= TOL, f"{stage}: max |zerofn - torch| {diff:.3g}"


def test_a_read_costs_one_gather_of_its_unit_when_it_is_released(results):
    """What a read in loss_fn costs in traffic, under shard_params, for the same two steps (the first prefetches
    in registration order, the second in the order the first recorded):

    - on the first block's weight, after the forward: that unit was released when the next block opened, so the
      read gathers it once more: ``units["0"]`` bytes (its padded buffer, all-gathered: the full tensor's bytes)
      plus the unit-order agreement that travels with every gather (``AGREEMENT_BYTES``). Its gradient goes into
      the unit's bucket, reduce-scattered with the rest: no further traffic.
    - on the last block's weight: the forward's last block stays gathered into backward, so the read gathers
      nothing and the step costs exactly what it costs without the penalty.
    """
    (case,) = [c for c in results[0] if c[0] == "traffic"]
    for rank, out in enumerate(results):
        comm = out[case]
        assert not isinstance(comm, str), f"traffic raised on rank {rank}: {comm}"
        gather_first = comm["units"][FIRST] + AGREEMENT_BYTES
        for i in range(2):
            assert comm["first"][i] - comm["none"][i] == gather_first, (rank, i, comm)
            assert comm["last"][i] - comm["none"][i] == 0, (rank, i, comm)


# ---------------------------------------------------------------- ranks that run different units


class Diverging(nn.Module):
    """Each rank runs a block of its own: rank r runs only ``blocks[r]``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        return self.blocks[C.rank()](x)


def _rank_diverging(prefetch: int, with_remat: bool):
    """One step of the diverging model: (the error's text or None, seconds until it was raised)."""
    from zerofn.transforms import remat, shard_params

    torch.manual_seed(0)
    apply = zf.functional(Diverging())
    step = shard_params(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(0.1)), prefetch=prefetch)
    if with_remat:
        step = remat(step)
    state = step.init(apply.params)
    C.barrier()  # both ranks start the step together
    start = time.monotonic()
    try:
        step(state, torch.randn(4, 6))
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return None, time.monotonic() - start


class FrozenFirst(nn.Module):
    """A frozen first block under trainable ones: backward runs through it where its input needs a gradient."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.blocks[0].requires_grad_(False)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x


def _rank_backward_diverging():
    """One step where only rank 0's input needs a gradient, so only rank 0's backward runs through the frozen
    first block: (the error's text or None, seconds until it was raised)."""
    from zerofn.transforms import shard_params

    torch.manual_seed(0)
    apply = zf.functional(FrozenFirst())

    def loss_fn(params, x):
        return apply(params, x.requires_grad_(C.rank() == 0)).square().mean()

    step = shard_params(zf.train_step(loss_fn, zf.optim.sgd(0.1)))
    state = step.init(apply.params)
    C.barrier()
    start = time.monotonic()
    try:
        step(state, torch.randn(4, 6))
    except RuntimeError as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return None, time.monotonic() - start


def _rank_all_diverging(cases: list) -> list:
    """Every diverging case in turn on the same ranks, each followed by the check that the ranks are still in step:
    [(error text, seconds, in step after it)], and the collectives' timeout these ranks have."""
    out = []
    for i, case in enumerate(cases):
        msg, seconds = _rank_diverging(*case) if case != BACKWARD_CASE else _rank_backward_diverging()
        out.append((msg, seconds, groups_in_step(i)))
    return out, C.timeout_s()


BACKWARD_CASE = "backward"  # ranks whose backward needs different units (the frozen block on rank 0 only)


DIVERGE_CASES = [(0, False), (1, False), (2, False), (1, True), BACKWARD_CASE]


def test_ranks_that_run_different_units_raise_together_within_seconds(monkeypatch):
    """``forward(x) = blocks[rank](x)`` under shard_params with prefetch 0, 1 and 2, and under remat: every rank
    raises the unit-order agreement's RuntimeError within 30 s although each collective may wait 600 s, and the
    ranks' process groups are still in step after it (the next collectives pair up), so a caller that catches it
    can go on. The cases run on ranks of their own, closed after (the session's pool never sees a failed step); a
    case that hangs fails the test when those ranks are stopped, 90 s after they started, instead of wedging the
    session."""
    monkeypatch.setenv("ZEROFN_TIMEOUT_S", str(DIVERGE_TIMEOUT_S))  # the ranks inherit it as they start
    for rank, (outcomes, timeout) in enumerate(zf.spawn(_rank_all_diverging, 2, DIVERGE_CASES, timeout=90)):
        assert timeout == DIVERGE_TIMEOUT_S, (rank, timeout)
        for case, (msg, seconds, in_step) in zip(DIVERGE_CASES, outcomes, strict=True):
            if case == BACKWARD_CASE:
                label = "backward through a frozen block on rank 0 only"
                assert msg is not None, f"{label}: rank {rank} ran the step without an error"
                assert "expecting backward to gather different units" in msg, f"{label}, rank {rank}: {msg}"
                if rank == 0:
                    assert "gathers ['blocks.1', 'blocks.0']" in msg, msg
            else:
                prefetch, with_remat = case
                label = f"prefetch={prefetch}" + (" under remat" if with_remat else "")
                assert msg is not None, f"{label}: rank {rank} ran the step without an error"
                assert msg.startswith("RuntimeError: shard_params: ranks"), f"{label}, rank {rank}: {msg}"
                assert "ranks gathered different units" in msg and "blocks." in msg, f"{label}, rank {rank}: {msg}"
            assert seconds < DIVERGE_LIMIT_S, f"{label}: rank {rank} raised after {seconds:.1f} s"
            assert in_step, f"{label}: after the error rank {rank}'s collectives no longer pair with the other's"
