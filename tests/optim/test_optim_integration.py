"""Masks and groups with the rest of zerofn: NVMe offload (each sub-group bound to the parameters it holds),
checkpoints across groupings and world sizes, ``from_deepspeed`` with a grouped optimizer, and the planner's
count of bf16 moments."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from torch import nn
from zerofn.transforms import offload, shard_optimizer, shard_params

import zerofn as zf
from zerofn import collectives as C
from zerofn import keys
from zerofn import tree as T
from zerofn.optim.base import ScaleByAdamState
from zerofn.optim.groups import decay_mask, multi_transform
from zerofn.plan import estimate, optimizer_bytes

SUB_GROUP = 4096  # the smallest sub-group: 512 elements of Adam's fp32 moments, so sub-groups cut parameters


class Branchy(nn.Module):
    """Matrices and biases in several buckets per label, a LayerNorm, and two parameters that do not always get a
    gradient: ``never`` (a head no forward uses) and ``sometimes`` (used when the batch says so)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.norm = nn.LayerNorm(24)
        self.mid = nn.Linear(24, 24)
        self.sometimes = nn.Linear(24, 24)
        self.never = nn.Linear(24, 3)
        self.out = nn.Linear(24, 2)

    def forward(self, x: torch.Tensor, use: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid(self.norm(self.inp(x))))
        if bool(use):
            h = h + torch.tanh(self.sometimes(h))
        return self.out(h)


def _labels(params):
    return {n: "decay" if p.ndim >= 2 else "no_decay" for n, p in params.items()}


def _optimizer(name: str) -> zf.optim.GradientTransformation:
    if name == "adamw":
        return zf.optim.adamw(1e-2, weight_decay=0.1)
    if name == "mask":
        return zf.optim.adamw(1e-2, weight_decay=0.1, mask=decay_mask())
    if name == "groups":  # two AdamWs with their own learning rates
        return multi_transform(
            {"decay": zf.optim.adamw(1e-2, weight_decay=0.1), "no_decay": zf.optim.adamw(3e-2, weight_decay=0.0)},
            _labels,
        )
    if name == "same_groups":  # two groups, the same rule as "adamw"
        return multi_transform(
            {"decay": zf.optim.adamw(1e-2, weight_decay=0.1), "no_decay": zf.optim.adamw(1e-2, weight_decay=0.1)},
            _labels,
        )
    if name == "other_labels":  # "same_groups" under other labels
        return multi_transform(
            {"a": zf.optim.adamw(1e-2, weight_decay=0.1), "b": zf.optim.adamw(1e-2, weight_decay=0.1)},
            lambda params: {n: "a" if p.ndim >= 2 else "b" for n, p in params.items()},
        )
    if name == "adamw_sgd":  # groups whose states differ: moments for one, a momentum buffer for the other
        return multi_transform(
            {"decay": zf.optim.adamw(1e-2, weight_decay=0.1), "no_decay": zf.optim.sgd(1e-2, momentum=0.9)}, _labels
        )
    if name == "nodecay":  # "mask" without decay: AdamW alone, its parameters split in buckets by the mask
        return zf.optim.adamw(1e-2, weight_decay=0.0, mask=decay_mask())
    if name == "adamw0":
        return zf.optim.adamw(1e-2, weight_decay=0.0)
    raise KeyError(name)


def _model():
    torch.manual_seed(0)
    model = Branchy()
    apply = zf.functional(model)

    def loss_fn(params, batch):
        return ((apply(params, batch["x"], batch["use"]) - batch["y"]) ** 2).mean()

    return apply, loss_fn


def _batches(n: int, start: int = 0) -> list[dict]:
    """This rank's part of the batch of steps ``start`` .. ``start + n - 1``: the same 12 samples in all at any
    world size; ``sometimes`` used on odd steps, and on step 0 by rank 0 only (one rank's gradient)."""
    out = []
    world, rank = C.world_size(), C.rank()
    lo, hi = rank * 12 // world, (rank + 1) * 12 // world
    for t in range(start, start + n):
        g = torch.Generator().manual_seed(100 + t)
        x, y = torch.randn(12, 12, generator=g), torch.randn(12, 2, generator=g)
        use = t % 2 == 1 or (t == 0 and rank == 0)
        out.append({"x": x[lo:hi], "y": y[lo:hi], "use": torch.tensor(use)})
    return out


def _run(step, state, batches):
    for b in batches:
        state, _ = step(state, b)
    return state


# ---------------------------------------------------------------- NVMe offload


def _nvme_cases(root: str, names: list[str], params: str | bool = False) -> dict:
    """name -> (offloaded params equal the same step's without offload bit for bit, param_steps equal).
    ``params="nvme"``: ZeRO-3 with the parameter shards in files too."""
    out = {}
    for name in names:
        apply, loss_fn = _model()
        # ZeRO-3: the model whole is one unit (its control flow differs between ranks, which units may not)
        wrap = shard_params if params else shard_optimizer if C.world_size() > 1 else (lambda s: s)
        plain = wrap(zf.train_step(loss_fn, _optimizer(name)))
        ref = _run(plain, plain.init(apply.params, keep_module=True), _batches(4))
        path = os.path.join(root, f"{name}-{C.world_size()}-{params}")
        os.makedirs(path, exist_ok=True)
        nvme = offload(
            wrap(zf.train_step(loss_fn, _optimizer(name))), "nvme", path=path, sub_group_bytes=SUB_GROUP, params=params
        )
        got = _run(nvme, nvme.init(apply.params, keep_module=True), _batches(4))
        a, b = plain.full_params(ref), nvme.full_params(got)
        out[name] = (
            all(torch.equal(a[k], b[k]) for k in a),
            torch.equal(ref.param_steps, got.param_steps),
            ref.param_steps.tolist(),
        )
    return out


NVME_CASES = ["mask", "groups", "adamw_sgd"]


@pytest.mark.filterwarnings("ignore:shard_params. the model .* is one unit")
@pytest.mark.parametrize("params", [False, "nvme"])
@pytest.mark.parametrize("world", [1, 2])
def test_nvme_offload_equals_the_step_without_it_under_masks_and_groups(ranks, tmp_path, world, params):
    results = (
        _nvme_cases(str(tmp_path), NVME_CASES, params)
        if world == 1
        else ranks(2).run(_nvme_cases, str(tmp_path), NVME_CASES, params)[0]
    )
    for name in NVME_CASES:
        equal, steps_equal, steps = results[name]
        assert equal, f"{name} on {world} rank(s): offload('nvme') moved the parameters otherwise"
        assert steps_equal
        # `never` got no gradient on any step, `sometimes` on steps 0, 1 and 3 (step 0 on rank 0 only)
        assert sorted(set(steps)) == [0, 3, 4], steps


def test_nvme_sub_groups_are_bound_to_the_parameters_they_hold(tmp_path):
    # A mask keyed by name (no function of shapes) resolves only on the real parameters: each sub-group must
    # see which parameters it holds, or it would not find its names.
    apply, loss_fn = _model()
    by_name = {n: n.endswith("weight") and "norm" not in n for n in apply.params}
    opt = zf.optim.adamw(1e-2, weight_decay=0.5, mask=by_name)
    step = offload(zf.train_step(loss_fn, opt), "nvme", path=str(tmp_path), sub_group_bytes=SUB_GROUP)
    state = _run(step, step.init(apply.params, keep_module=True), _batches(2))
    plain = zf.train_step(loss_fn, opt)
    ref = _run(plain, plain.init(apply.params, keep_module=True), _batches(2))
    a, b = plain.full_params(ref), step.full_params(state)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["never.weight"], apply.params["never.weight"])  # no gradient: not decayed either


def test_nvme_gives_whole_buckets_to_an_optimizer_that_orthogonalises_matrices(tmp_path):
    from zerofn.optim.muon import muon

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 24, bias=False), nn.Tanh(), nn.Linear(24, 24, bias=False))
    apply = zf.functional(model)

    def loss_fn(params, batch):
        return apply(params, batch).square().mean()

    batches = [torch.randn(4, 24, generator=torch.Generator().manual_seed(t)) for t in range(2)]
    plain = zf.train_step(loss_fn, muon(1e-2))
    nvme = offload(zf.train_step(loss_fn, muon(1e-2)), "nvme", path=str(tmp_path), sub_group_bytes=SUB_GROUP)
    ref, got = (_run(s, s.init(apply.params, keep_module=True), batches) for s in (plain, nvme))
    a, b = plain.full_params(ref), nvme.full_params(got)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- checkpoints across groupings


def _save(root: str, name: str, stage: str) -> dict:
    apply, loss_fn = _model()
    step = zf.train_step(loss_fn, _optimizer(name))
    step = {"plain": step, "shard_optimizer": shard_optimizer(step), "shard_params": shard_params(step)}[stage]
    state = _run(step, step.init(apply.params, keep_module=True), _batches(3))
    zf.checkpoint.save(state, f"{root}/{name}-{stage}@{C.world_size()}")
    steps = state.param_steps.tolist()
    return {"steps": steps, "next": step.full_params(_run(step, state, _batches(2, 3)))}


def _resume(root: str, saved: str, name: str, stage: str) -> dict:
    apply, loss_fn = _model()
    step = zf.train_step(loss_fn, _optimizer(name))
    step = {"plain": step, "shard_optimizer": shard_optimizer(step), "shard_params": shard_params(step)}[stage]
    state = zf.checkpoint.load(f"{root}/{saved}", step)
    steps = state.param_steps.tolist()
    return {"steps": steps, "next": step.full_params(_run(step, state, _batches(2, 3)))}


def _close(a: dict, b: dict, tol: float) -> None:
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    assert worst <= tol, worst


def test_a_checkpoint_loads_under_another_grouping_and_world_size(ranks, tmp_path):
    root = str(tmp_path)
    # adamw on 2 ranks (shard_optimizer) -> the same rule in two groups, on 3 ranks (shard_params) and on 1
    saved = ranks(2).run(_save, root, "adamw", "shard_optimizer")[0]
    assert sorted(set(saved["steps"])) == [0, 2, 3]  # the parameters' own counts differ
    three = ranks(3).run(_resume, root, "adamw-shard_optimizer@2", "same_groups", "shard_params")[0]
    one = _resume(root, "adamw-shard_optimizer@2", "same_groups", "plain")
    for got in (three, one):
        assert got["steps"] == saved["steps"]
        _close(got["next"], saved["next"], 1e-6)
    # and back: two groups on 3 ranks -> adamw on 2 ranks, and -> the groups under other labels on 1
    saved = ranks(3).run(_save, root, "same_groups", "shard_params")[0]
    two = ranks(2).run(_resume, root, "same_groups-shard_params@3", "adamw", "shard_optimizer")[0]
    other = _resume(root, "same_groups-shard_params@3", "other_labels", "plain")
    for got in (two, other):
        assert got["steps"] == saved["steps"]
        _close(got["next"], saved["next"], 1e-6)


def _moments(state) -> dict:
    """name -> (mu, nu) of a one-process state, read from every Adam state in it (any grouping)."""
    out = {}
    found = T.tree_leaves(state.opt_state, is_leaf=lambda x: isinstance(x, ScaleByAdamState))
    for adam in (x for x in found if isinstance(x, ScaleByAdamState)):
        for k, mu in adam.mu.items():
            for s in state.spec.layout.buckets[keys.bucket_index(k)].slots:
                out[s.name] = (mu[s.offset : s.offset + s.numel], adam.nu[k][s.offset : s.offset + s.numel])
    return out


def test_a_checkpoint_loads_with_and_without_a_mask(tmp_path):
    apply, loss_fn = _model()
    for a, b in (("mask", "adamw"), ("adamw", "mask"), ("mask", "groups")):
        step = zf.train_step(loss_fn, _optimizer(a))
        state = _run(step, step.init(apply.params, keep_module=True), _batches(3))
        zf.checkpoint.save(state, f"{tmp_path}/{a}-{b}")
        other = zf.train_step(loss_fn, _optimizer(b))
        loaded = zf.checkpoint.load(f"{tmp_path}/{a}-{b}", other)
        buckets = {"mask": 2, "adamw": 1, "groups": 2}  # one per label: the moments move between layouts
        assert (len(state.spec.layout.buckets), len(loaded.spec.layout.buckets)) == (buckets[a], buckets[b])
        assert torch.equal(loaded.param_steps, state.param_steps)
        want, got = _moments(state), _moments(loaded)
        assert want.keys() == got.keys() == set(loaded.spec.layout.trainable_names)
        for name, (mu, nu) in want.items():
            assert torch.equal(got[name][0], mu) and torch.equal(got[name][1], nu), (a, b, name)
        assert any(mu.abs().sum() > 0 for mu, _ in want.values())


def test_group_counts_are_saved_per_group_and_moments_without_the_group(tmp_path):
    apply, loss_fn = _model()
    step = zf.train_step(loss_fn, _optimizer("groups"))
    state = _run(step, step.init(apply.params, keep_module=True), _batches(1))
    zf.checkpoint.save(state, f"{tmp_path}/c")
    with open(f"{tmp_path}/c/manifest.json") as f:
        saved = {r["key"] for r in json.load(f)["records"] if r["key"].startswith(keys.OPT)}
    assert saved == {"opt:[decay]/0/0", "opt:[no_decay]/0/0", "opt:0/1/*", "opt:0/2/*"}
    assert keys.unscoped("opt:[decay]/0/0") == "opt:0/0" == keys.unscoped(keys.opt((keys.scope("a/]"), 0, 0)))
    # a group's transformation that keeps other state (SGD's momentum instead of Adam's moments) does not load
    with pytest.raises(zf.checkpoint.CheckpointError, match="does not map"):
        zf.checkpoint.load(f"{tmp_path}/c", zf.train_step(loss_fn, _optimizer("adamw_sgd")))


# ---------------------------------------------------------------- from_deepspeed


def test_from_deepspeed_takes_a_grouped_optimizer(tmp_path):
    apply, loss_fn = _model()
    names = list(apply.params)
    groups = multi_transform(  # labels keyed by name: they resolve only on the real parameters
        {"decay": zf.optim.adamw(1e-2, weight_decay=0.1), "rest": zf.optim.sgd(1e-2, momentum=0.9)},
        {n: "decay" if n.endswith("weight") and "norm" not in n else "rest" for n in names},
    )
    config = {
        "train_batch_size": 4,
        "zero_optimization": {
            "stage": 1,
            "sub_group_size": 600,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
        },
    }
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step, _ = zf.from_deepspeed(config, loss_fn, optimizer=groups)
    # sub_group_size counts elements of the largest state: Adam's two fp32 moments
    assert step.extension("offload").options.sub_group_bytes == 600 * 8
    state = _run(step, step.init(apply.params, keep_module=True), _batches(3))
    plain = zf.train_step(loss_fn, groups)
    ref = _run(plain, plain.init(apply.params, keep_module=True), _batches(3))
    a, b = plain.full_params(ref), step.full_params(state)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the planner


def test_the_planner_counts_bf16_moments_as_the_state_holds_them():
    bf16 = zf.optim.adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)
    assert optimizer_bytes(bf16).per_element * 2 == optimizer_bytes(zf.optim.adamw(1e-3)).per_element == 8
    apply, loss_fn = _model()
    psi = sum(p.numel() for p in apply.params.values())
    fp32_moments = estimate(psi, mixed_precision=False, optimizer=zf.optim.adamw(1e-3)).optimizer
    half = estimate(psi, mixed_precision=False, optimizer=bf16)
    count = 8
    assert (half.optimizer - count) * 2 == fp32_moments - count
    assert estimate(psi, mixed_precision=False).optimizer == fp32_moments  # the default is Adam in fp32
    step = zf.train_step(loss_fn, bf16)
    state = step.init(apply.params, keep_module=True)
    assert zf.memory.state_bytes(state)["optimizer"] == half.optimizer == half.state - 4 * psi
    # mixed precision: fp32 masters (4) + bf16 moments (4) per parameter
    mixed = estimate(psi, mixed_precision=True, optimizer=bf16)
    amp_state = zf.transforms.amp(zf.train_step(loss_fn, bf16), torch.bfloat16).init(apply.params, keep_module=True)
    assert zf.memory.state_bytes(amp_state)["optimizer"] == mixed.optimizer == 8 * psi + count
