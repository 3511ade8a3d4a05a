"""A pipeline's placements and what reads them: a tiny GPT-2 (its head tied to the input embedding) and a tiny
Llama, trained at pp 2 and saved, load at pp 1 on one process, under shard_optimizer on 2 ranks, at pp 2 (as
saved, and beside a data-parallel pair under shard_optimizer) and at pp 4 with their parameters and AdamW moments
exact and train on as the uninterrupted run; ``full_params`` and ``state_dict`` give the whole model on every
rank, ``consolidate`` writes it. The placement itself (``zerofn.sharding.Stage``) is checked on one process."""

from __future__ import annotations

import pytest
import torch
from helpers import rank_slice, tiny_llama
from zerofn.transforms import pipeline_parallel, shard_optimizer

import zerofn as zf
from zerofn import collectives as C
from zerofn.checkpoint.parts import layouts, state_parts
from zerofn.sharding import Replicate, Shard, Stage, cut, holds, join, parse, pieces, whole_shape

KINDS = ("gpt2", "llama")
SAVED_AT, STEPS = 2, 3  # saved after 2 updates; the uninterrupted run makes one more
TOL = 1e-6  # a pipeline's sums run in another order than one process's (measured: 6e-8)


def _model(kind: str) -> torch.nn.Module:
    if kind == "llama":
        return tiny_llama(num_hidden_layers=4)
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=4, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    return GPT2LMHeadModel(config).float()


def _build(kind: str, pp: int = 0, sharded: bool = False):
    apply = zf.functional(_model(kind))
    step = zf.train_step(lambda p, b: apply(p, **b).loss, zf.optim.adamw(1e-3, eps=1e-4, weight_decay=0.1))
    if sharded:
        step = shard_optimizer(step)
    if pp:
        step = pipeline_parallel(step, pp, microbatches=4)
    return step, apply


def _batch(i: int) -> dict:
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(100 + i))
    return {"input_ids": ids, "labels": ids}


def _train(step, state, lo: int, hi: int):
    rank = zf.collectives.data_rank(step) if step.mesh is not None else C.rank(group=step.group)
    world = step.mesh.data_size if step.mesh is not None else C.world_size(group=step.group)
    for i in range(lo, hi):
        state, _ = step(state, rank_slice(_batch(i), rank, world))
    return state


def _held_moments(step, state) -> list:
    """This rank's pieces of the optimizer's parameter-shaped state, by (quantity, parameter name)."""
    out = []
    with C.group_scope(step.group):
        lays = layouts(state)
        held = state_parts(state, C.rank(), lays)
    for part in held.parts:
        if not part.key.startswith("opt:"):
            continue
        flat = part.value.detach().reshape(-1)
        for s in lays[part.kind][part.bucket].slots:
            a, b = max(part.lo, s.offset), min(part.hi, s.offset + s.numel)
            if a < b:
                out.append((part.key, s.name, s.numel, a - s.offset, flat[a - part.lo : b - part.lo].clone()))
    return out


def _moments(step, state) -> dict:
    """The whole moments of every parameter, put together from every rank's pieces (collective)."""
    out: dict = {}
    everyone = C.gather_objects(_held_moments(step, state)) if C.world_size() > 1 else [_held_moments(step, state)]
    for held in everyone:
        for key, name, numel, start, values in held:
            t = out.setdefault((key, name), torch.full((numel,), float("nan")))
            t[start : start + values.numel()] = values
    return out


def _loaded(step, path: str, train: bool = True) -> dict:
    """Load ``path`` for ``step``; what it holds then, and (``train``) after training on to the end."""
    state = zf.checkpoint.load(path, step)
    out = {"params": step.full_params(state), "moments": _moments(step, state), "count": int(state.count)}
    out["param_steps"] = set(state.param_steps.tolist())
    if train:
        out["final"] = step.full_params(_train(step, state, SAVED_AT, STEPS))
    return out


def _at_two(root: str) -> dict:
    """On 2 ranks: train at pp 2 and save; load it back at pp 2 and under shard_optimizer; consolidate."""
    out = {}
    for kind in KINDS:
        path = f"{root}/{kind}/pp2"
        step, apply = _build(kind, 2)
        state = _train(step, step.init(apply.params), 0, SAVED_AT)
        zf.checkpoint.save(state, path)
        got = {"saved": step.full_params(state), "moments": _moments(step, state)}
        local = step.full_params(state, local=True)
        got["local"] = sorted(local)
        state_dict = step.state_dict(state)
        got["state_dict"] = {k: v.clone() for k, v in state_dict.items()}
        got["local_state_dict"] = sorted(step.state_dict(state, local=True))
        got["model_names"] = list(_model(kind).state_dict())
        got["placements"] = {n: tuple(str(p) for p in ps) for n, ps in state.spec.placements}
        got["held"] = sorted(state.spec.layout.names)
        got["final"] = step.full_params(_train(step, state, SAVED_AT, STEPS))
        if kind == "gpt2":  # (the Llama at pp 1 and 4 only: the test's time)
            got["resumed"] = _loaded(_build(kind, 2)[0], path)
            got["sharded"] = _loaded(_build(kind, 0, sharded=True)[0], path)
        if C.rank() == 0:
            from safetensors.torch import load_file

            got["verified"] = len(zf.checkpoint.verify(path)["files"])  # every part's files
            zf.checkpoint.consolidate(path, f"{root}/{kind}/model.safetensors")
            got["consolidated"] = load_file(f"{root}/{kind}/model.safetensors")
        out[kind] = got
    return out


def _at_four(root: str) -> dict:
    """On 4 ranks: the pp 2 checkpoints load at pp 4, and at pp 2 beside a data-parallel pair (shard_optimizer)."""
    return {
        kind: {
            "pp4": _loaded(_build(kind, 4)[0], f"{root}/{kind}/pp2"),
            # beside a data-parallel pair under shard_optimizer: each half of the batch on a pair of stages
            "pp2_dp2": _loaded(_build(kind, 2, sharded=True)[0], f"{root}/{kind}/pp2"),
        }
        if kind == "gpt2"
        else {"pp4": _loaded(_build(kind, 4)[0], f"{root}/{kind}/pp2")}
        for kind in KINDS
    }


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)))[:5]
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_pipeline_checkpoint_loads_at_pp_1_2_4_and_under_zero(ranks, tmp_path):
    root = str(tmp_path)
    two = ranks(2).run(_at_two, root)
    four = ranks(4).run(_at_four, root)
    for kind in KINDS:
        step, apply = _build(kind)  # one process: the reference, and pp 1 loading the pipeline's checkpoint
        state = _train(step, step.init(apply.params), 0, SAVED_AT)
        one_saved = step.full_params(state)
        one_final = step.full_params(_train(step, state, SAVED_AT, STEPS))
        alone = _loaded(_build(kind)[0], f"{root}/{kind}/pp2")
        saved, moments, final = two[0][kind]["saved"], two[0][kind]["moments"], two[0][kind]["final"]
        assert not any(v.isnan().any() for v in moments.values())  # every element of every moment held somewhere
        assert {key for key, _ in moments} == {"opt:0/1/*", "opt:0/2/*"}  # AdamW's mu and nu
        for r, got in enumerate(two):
            g = got[kind]
            # the whole model on every rank, as one process trains it; this rank's stage alone with local=True
            assert list(g["saved"]) == list(one_saved) and _worst(g["saved"], one_saved) <= TOL, (kind, r)
            assert _same(g["saved"], saved) and _same(g["moments"], moments)
            assert g["local"] == g["held"] and 0 < len(g["held"]) < len(saved), (kind, r, g["local"])
            assert set(g["placements"]) == set(saved)  # every parameter placed, held here or not
            assert {p for ps in g["placements"].values() for p in ps} == {"Stage(0)", "Stage(1)", "R"}
            assert list(g["state_dict"]) == g["model_names"]  # tied weights under each name, for load_state_dict
            assert all(torch.equal(v, saved[k]) for k, v in g["state_dict"].items() if k in saved)
            assert set(g["local_state_dict"]) < set(g["model_names"])
            if kind != "gpt2":
                continue
            # the same layout: bit for bit, parameters, moments and what training makes of them
            res = g["resumed"]
            assert _same(res["params"], saved) and _same(res["moments"], moments), (kind, r)
            assert _same(res["final"], final), (kind, r)
            # under shard_optimizer on 2 ranks, each holding half of every moment
            sh = g["sharded"]
            assert _same(sh["params"], saved) and _same(sh["moments"], moments), (kind, r)
            assert _worst(sh["final"], final) <= TOL, (kind, r, _worst(sh["final"], final))
        for where, res in [("pp1", alone)] + [(k, v) for got in four for k, v in got[kind].items()]:
            assert _same(res["params"], saved) and _same(res["moments"], moments), (kind, where)
            assert res["count"] == SAVED_AT and res["param_steps"] == {SAVED_AT}, (kind, where)
            if "final" in res:
                assert _worst(res["final"], final) <= TOL, (kind, where, _worst(res["final"], final))
                assert _worst(res["final"], one_final) <= TOL, (kind, where, _worst(res["final"], one_final))
        # consolidate writes the whole model from the stages' parts, tied weights under each name
        assert two[0][kind]["verified"] == 2, kind  # a data file per stage, each written by its one rank
        written = two[0][kind]["consolidated"]
        assert _same(written, two[0][kind]["state_dict"]), kind
        _model(kind).load_state_dict(written, strict=True)


def test_a_stage_placement_is_whole_at_its_coordinate_and_absent_elsewhere():
    w = torch.arange(24.0).view(4, 6)
    held = Stage(1)
    assert str(held) == "Stage(1)" and parse("Stage(1)") == held and parse(str(held)) == held
    assert pieces((held,), (3,)) == [(1,)] and [holds((held,), (c,)) for c in range(3)] == [False, True, False]
    assert torch.equal(cut(w, (held,), (3,), (1,)), w) and torch.equal(join({(1,): w}, (held,), (3,)), w)
    assert whole_shape((4, 6), (held,), (3,)) == (4, 6)
    with pytest.raises(ValueError, match="holds none of the tensor"):
        cut(w, (held,), (3,), (0,))
    with pytest.raises(ValueError, match="no coordinate 3 on an axis of 2 ranks"):
        pieces((Stage(3),), (2,))
    with pytest.raises(ValueError, match="not a placement"):
        parse("Stage(-1)")
    # beside a tensor-parallel cut: the stage's ranks hold the slices, the others nothing
    both, sizes = (held, Shard(1)), (2, 3)
    slices = {c: cut(w, both, sizes, c) for c in [(1, 0), (1, 1), (1, 2)]}
    assert pieces(both, sizes) == list(slices) and torch.equal(join(slices, both, sizes), w)
    assert not holds(both, (0, 2)) and holds((Replicate(), Shard(0)), (0, 1))
