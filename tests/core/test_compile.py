"""torch.compile under zerofn, on 2 real gloo ranks: blocks compiled one by one (``block.compile()``, torchtitan's
way) train under every composition with no graph break and no recompilation after the second step, equal to the
same model in eager; zerofn's own hooks stay outside the compiled regions (its unit hooks and remat's checkpoint run
around a compiled block's call, in eager code), and nothing stays on the model's modules after a step, one that
raises included. A model compiled whole trains too, without recompiling. And shard_params' agreement on the unit
order, which stays in flight while the forward follows the order the last step recorded, still makes ranks that
run different units raise together, fast, with their process groups in step.

Dynamo is counted with ``torch._dynamo.utils.counters``: ``graph_break`` and ``unimplemented`` (a call dynamo
skips, such as a ``torch.compiler.disable``'d function, lands there) must stay empty, and ``stats.unique_graphs``
(one per compilation, recompilations included) must not grow after the second step. The backend is ``aot_eager``
(dynamo and AOTAutograd, no code generation): what breaks or recompiles is decided before the backend runs, and it
keeps this file fast; inductor's step times are measured by ``examples/compile_gpt.py`` (docs/compile.md).

Every case runs in one ``ranks(2).run``, the ranks that diverge in a second one on the same pool (they stay in
step, which the case checks).
"""

from __future__ import annotations

import time

import pytest
import torch
from helpers import groups_in_step
from torch import nn

import zerofn as zf
from zerofn import collectives as C

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 16
TOL = 1e-6  # compiled against eager, fp32 (amp: its fp32 masters); measured: 0 (aot_eager runs the same kernels)
STAGES = (
    "plain",
    "shard_optimizer",
    "shard_grads",
    "shard_params",
    "amp",
    "remat",
    "offload",
    "shard_params+amp+remat",
    "shard_params+amp(param)+remat",
)
WHOLE = "shard_params"  # the composition a model compiled whole trains under here (zerofn's hooks inside it)
DIVERGE_LIMIT_S = 10.0  # ranks that diverge raise within this (each collective may wait ZEROFN_TIMEOUT_S)


def _composition(stage: str):
    from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

    return {
        "plain": lambda s: s,
        "shard_optimizer": shard_optimizer,
        "shard_grads": shard_grads,
        "shard_params": shard_params,
        "amp": lambda s: amp(s, torch.bfloat16),
        "remat": remat,
        "offload": lambda s: offload(s, "cpu"),
        "shard_params+amp+remat": lambda s: amp(remat(shard_params(s)), torch.bfloat16),
        # the parameters in bf16, no autocast: amp's casts are hooks on the norms inside the compiled blocks
        "shard_params+amp(param)+remat": lambda s: amp(remat(shard_params(s)), torch.bfloat16, compute="param"),
    }[stage]


# ---------------------------------------------------------------- the model and what a step leaves on it


def _gpt(compile_: str | None):
    """The examples' GPT at 2 blocks, its blocks compiled (``"blocks"``), the model compiled whole (``"model"``) or
    neither; a flag makes its forward raise after the first block."""
    from zerofn.bench.gpt import GPT, GPTConfig

    class Failing(GPT):
        fail = False

        def forward(self, idx):
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for i, block in enumerate(self.blocks):
                x = block(x)
                if self.fail and i == 0:
                    raise KeyError("the model raised after its first block")
            return self.head(self.ln(x))

    torch.manual_seed(0)
    model = Failing(GPTConfig(vocab=32, seq_len=SEQ, dim=32, heads=2, layers=2))
    if compile_ == "blocks":
        for block in model.blocks:
            block.compile(backend=_counted)
    elif compile_ == "model":
        model.compile(backend=_counted)
    return model


RUNS = [0]  # calls of compiled graphs in this process


def _counted(gm, example_inputs):
    """The aot_eager backend, counting each call of what it compiled (so that a fallback to eager shows)."""
    from torch._dynamo.backends.registry import lookup_backend

    compiled = lookup_backend("aot_eager")(gm, example_inputs)

    def run(*args):
        RUNS[0] += 1
        return compiled(*args)

    return run


def _batch(i: int) -> torch.Tensor:
    from zerofn.bench.gpt import MarkovCorpus

    world, rank = C.world_size(), C.rank()
    full = MarkovCorpus(vocab=32).sample(GLOBAL_BATCH, SEQ + 1, seed=i)
    n = GLOBAL_BATCH // world
    return full[rank * n : (rank + 1) * n]


def _snapshot(model: nn.Module) -> dict:
    """What a step must leave as it found on each module: its instance attributes that name a call (forward,
    the compiled call), its hook dicts, its parameter dict (type and tensors), and torch's global module hooks."""
    out = {}
    for name, m in model.named_modules():
        out[name] = (
            m.__dict__.get("forward"),
            m.__dict__.get("_compiled_call_impl"),
            type(m._parameters),
            {k: id(v) for k, v in m._parameters.items()},
            *(tuple(getattr(m, h)) for h in ("_forward_pre_hooks", "_forward_hooks", "_backward_hooks")),
        )
    hooks = torch.nn.modules.module
    out["<global>"] = (len(hooks._global_forward_pre_hooks), len(hooks._global_forward_hooks))
    return out


def _changed(before: dict, after: dict) -> list[str]:
    return [name for name in before if before[name] != after[name]]


# ---------------------------------------------------------------- one composition on the ranks


def _train(stage: str, compile_: str | None) -> dict:
    """``STEPS`` steps of ``stage`` on this rank's half of each batch; dynamo's counters after each step (counted
    afresh; dynamo's caches are kept from the compositions before, as one process that builds several models keeps
    them, and the recompile limit of each code object counts them all); what changed on the modules after each
    step; the final parameters."""
    from torch._dynamo.utils import counters

    from zerofn.bench.gpt import loss_fn_for

    counters.clear()
    model = _gpt(compile_)
    apply = zf.functional(model)
    step = _composition(stage)(zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-3, weight_decay=0.1)))
    state = step.init(apply.params)
    before = _snapshot(model)
    graphs, runs, losses, changed = [], [], [], []
    for i in range(STEPS):
        start = RUNS[0]
        state, metrics = step(state, _batch(i))
        losses.append(float(metrics["loss"]))
        graphs.append(counters["stats"]["unique_graphs"])
        runs.append(RUNS[0] - start)
        changed += _changed(before, _snapshot(model))
    masters = "amp" in stage
    params = step.full_params(state, master=True) if masters else step.full_params(state)
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in params.items()},
        "graphs": graphs,
        "runs": runs,
        "breaks": {k: sum(counters[k].values()) for k in ("graph_break", "unimplemented")},
        "changed": changed,
    }


def _raising(stage: str) -> dict:
    """A step whose model raises after its first (compiled) block, then a step that does not: the error, what the
    raising step left on the modules, and that the next step trains (the ranks still in step)."""
    from zerofn.bench.gpt import loss_fn_for

    model = _gpt("blocks")
    apply = zf.functional(model)
    step = _composition(stage)(zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-3)))
    state = step.init(apply.params)
    state, _ = step(state, _batch(0))
    before = _snapshot(model)
    model.fail = True
    try:
        step(state, _batch(1))
        error = None
    except KeyError as err:
        error = str(err)
    changed = _changed(before, _snapshot(model))
    model.fail = False
    state, metrics = step(state, _batch(1))
    return {
        "error": error,
        "changed": changed,
        "after": float(metrics["loss"]),
        "changed_after": _changed(before, _snapshot(model)),
    }


def _remat_whole() -> str | None:
    from zerofn.transforms import remat

    from zerofn.bench.gpt import loss_fn_for

    model = _gpt("model")
    apply = zf.functional(model)
    step = remat(zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-3)))
    state = step.init(apply.params)
    try:
        step(state, _batch(0))
    except ValueError as err:
        return str(err)
    return None


def _rank_cases() -> dict:
    out: dict = {}
    for stage in STAGES:
        out[stage, "blocks"] = _train(stage, "blocks")
        out[stage, None] = _train(stage, None)
    out[WHOLE, "model"] = _train(WHOLE, "model")
    out["raising"] = _raising("shard_params+amp+remat")
    out["remat whole"] = _remat_whole()
    return out


@pytest.fixture(scope="module")
def results(ranks):
    return ranks(2).run(_rank_cases, timeout=240)


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("stage", STAGES)
def test_compiled_blocks_train_without_breaks_or_recompiles(results, stage):
    """Each block compiled with ``block.compile()``: no graph break, nothing dynamo skipped, compiled code ran on
    every step (counted by the backend), at most the second step compiles anew (shard_optimizer and shard_grads: the parameters
    then arrive through the publish's waiting dict) and no step after it does; the losses and parameters equal
    the eager model's (measured: equal to the bit), on both ranks alike."""
    for rank, out in enumerate(results):
        got, ref = out[stage, "blocks"], out[stage, None]
        assert got["breaks"] == {"graph_break": 0, "unimplemented": 0}, (stage, rank, got["breaks"])
        assert got["graphs"][1:] == [got["graphs"][1]] * (STEPS - 1), (stage, got["graphs"])
        assert all(n >= 2 for n in got["runs"]), (stage, got["runs"])  # each block's compiled graph, every step
        assert ref["graphs"] == [0] * STEPS and ref["runs"] == [0] * STEPS  # the eager model compiled nothing
        zf.testing.assert_trees_all_close(got["losses"], ref["losses"], rtol=TOL, atol=TOL)
        zf.testing.assert_trees_all_close(got["params"], ref["params"], rtol=TOL, atol=TOL)
        zf.testing.assert_trees_all_close(got["params"], results[0][stage, "blocks"]["params"], rtol=0, atol=0)
        assert ref["losses"][-1] < ref["losses"][0]  # it trains


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_leaves_the_modules_as_it_found_them(results, stage):
    """After every step, compiled or eager: no module has a ``forward`` or compiled call of its own that it did not
    have, its hooks and parameter dict are the ones it had, and torch has no global module hooks."""
    for out in results:
        for compile_ in ("blocks", None):
            assert out[stage, compile_]["changed"] == [], (stage, compile_, out[stage, compile_]["changed"])


def test_a_step_that_raises_leaves_nothing_and_the_next_trains(results):
    """shard_params, amp and remat, the blocks compiled: the model raises after its first block; nothing stays on
    the modules, and the next step trains on both ranks (their agreements and gathers still pair up)."""
    for out in results:
        got = out["raising"]
        assert got["error"] is not None and "raised after its first block" in got["error"], got
        assert got["changed"] == [] and got["changed_after"] == [], got
        assert got["after"] == got["after"]  # a number: the step after it ran (nan never equals itself)


def test_a_model_compiled_whole_trains_without_recompiling(results):
    """``model.compile()`` under shard_params: no graph is compiled after the second step and compiled code runs on
    every step; dynamo skips the model's forward, whose loop over the blocks calls zerofn's unit hooks (kept out of
    the graph with ``torch.compiler.disable``: the skip shows in ``unimplemented``, never in ``graph_break``), and
    compiles each block's forward instead. Equal to eager."""
    for out in results:
        got, ref = out[WHOLE, "model"], out[WHOLE, None]
        assert got["breaks"]["graph_break"] == 0 and got["breaks"]["unimplemented"] > 0, got["breaks"]
        assert got["graphs"][1:] == [got["graphs"][1]] * (STEPS - 1), got["graphs"]
        assert all(n >= 2 for n in got["runs"]), got["runs"]
        zf.testing.assert_trees_all_close(got["params"], ref["params"], rtol=TOL, atol=TOL)
        assert got["changed"] == []


def test_remat_refuses_blocks_inside_a_model_compiled_whole(results):
    for out in results:
        msg = out["remat whole"]
        assert msg is not None and "remat: block 'blocks.0'" in msg and "compiled as a whole" in msg, msg


# ---------------------------------------------------------------- ranks that diverge after an order is recorded


class _Planned(nn.Module):
    """Three blocks run in the order ``plan[rank]``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.plan = {0: [0, 1, 2], 1: [0, 1, 2]}

    def forward(self, x):
        for i in self.plan[C.rank()]:
            x = torch.tanh(self.blocks[i](x))
        return x


# Rank 1's order on the second step (rank 0 keeps [0, 1, 2], the order the first step recorded on both).
PLANS = {"swapped": [0, 2, 1], "skipped": [0, 2], "repeated": [0, 1, 2, 1], "another first": [1, 0, 2]}
DIVERGE_CASES = [
    (plan, prefetch, with_remat) for plan in PLANS for prefetch in (0, 1, 2) for with_remat in (False, True)
]


def _square_loss(apply):
    return lambda params, x: apply(params, x).square().mean()


def _rank_diverging(cases: list) -> list:
    """For each case: one step in step, then rank 1 runs its blocks in another order: (the error, seconds until
    it was raised, whether both process groups still pair this rank's collectives with the other's after it)."""
    from zerofn.transforms import remat, shard_params

    out = []
    for n, (plan, prefetch, with_remat) in enumerate(cases):
        torch.manual_seed(0)
        model = _Planned()
        apply = zf.functional(model)
        step = shard_params(zf.train_step(_square_loss(apply), zf.optim.sgd(0.1)), prefetch=prefetch)
        step = remat(step) if with_remat else step
        state, _ = step(step.init(apply.params), torch.randn(4, 6))
        model.plan[1] = PLANS[plan]
        C.barrier()
        start = time.monotonic()
        try:
            step(state, torch.randn(4, 6))
            msg = None
        except RuntimeError as err:
            msg = f"{type(err).__name__}: {err}"
        seconds = time.monotonic() - start
        out.append((msg, seconds, groups_in_step(n)))
    return out


def test_ranks_that_leave_the_recorded_order_raise_together(ranks, results):
    """The forward's agreement on each unit stays in flight while a rank follows the recorded order; a rank whose
    second step swaps, skips, repeats or starts with another block raises the agreement's error with the other, in
    seconds, under every prefetch and under remat, and the process groups are still in step after it (so the
    gathers every rank issued at each point were the same)."""
    per_rank = ranks(2).run(_rank_diverging, DIVERGE_CASES, timeout=120)
    for rank, outcomes in enumerate(per_rank):
        for case, (msg, seconds, in_step) in zip(DIVERGE_CASES, outcomes, strict=True):
            assert msg is not None and msg.startswith("RuntimeError: shard_params: ranks gathered different units"), (
                case,
                rank,
                msg,
            )
            assert "blocks." in msg or "ended the model's forward" in msg, (case, rank, msg)
            assert seconds < DIVERGE_LIMIT_S, (case, rank, seconds)
            assert in_step, (case, rank)
