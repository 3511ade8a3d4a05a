"""Hybrid sharding (``replicate=``): 4 ranks as 2 "nodes" x 2, every ZeRO stage sharded within a node and
replicated across, train as one process over the whole batch (with amp, offload and accumulation too);
the state per rank is the node's share, the traffic per mesh axis is the formula's, and a state saved under
it loads under plain shard_params on 2 and 4 ranks and on one process."""

from __future__ import annotations

import pytest
import torch
from helpers import make_transformer, rank_slice, refusals, stats_bytes, transformer_batch
from zerofn.transforms import amp, offload, shard_grads, shard_optimizer, shard_params

import zerofn as zf
from zerofn import collectives as C

STEPS, BATCH = 4, 8
STAGES = {"shard_optimizer": shard_optimizer, "shard_grads": shard_grads, "shard_params": shard_params}


def _build(stage: str, replicate: int | None, extra: str = "", seed: int = 0):
    _, apply, loss_fn = make_transformer(seed, extras=extra != "amp")  # its extras do not run in bf16
    k = 2 if extra == "accumulate" else 1
    step = zf.train_step(loss_fn, zf.optim.adamw(1e-2, weight_decay=0.1), accumulate_steps=k)
    if stage:
        step = STAGES[stage](step, replicate=replicate)
    if extra == "amp":
        step = amp(step, torch.bfloat16)
    if extra == "offload":
        step = offload(step, "cpu")
    return step, apply


def _data(step) -> tuple[int, int]:
    if step.mesh is not None:
        return zf.collectives.data_rank(step), step.mesh.data_size
    return C.rank(), C.world_size()


def _train(step, state, lo: int, hi: int):
    rank, world = _data(step)
    k = step.accumulate_steps
    m = None
    for i in range(lo, hi):
        local = rank_slice(transformer_batch(i, BATCH), rank, world)
        for j in range(k):
            state, m = step(state, rank_slice(local, j, k))
    return state, m


def _run(case: tuple) -> dict:
    stage, replicate, extra = case
    step, apply = _build(stage, replicate, extra)
    state, m = _train(step, step.init(apply.params), 0, STEPS)
    lay = state.spec.layout
    return {
        "name": step.name,
        "mesh": repr(step.mesh),
        "params": step.full_params(state),
        "loss": float(m["loss"]),
        "comm": int(m["comm_bytes"]),
        "axes": dict(m["comm_bytes_by_axis"]),
        "held": zf.memory.state_bytes(state),
        "trainable_bytes": sum(b.padded * b.dtype.itemsize for b in lay.buckets),
        "shard_bytes": sum(b.shard_numel * b.dtype.itemsize for b in lay.buckets),
        "replicate": {b.replicate for b in lay.buckets},
        "n_params": len(lay.trainable_names),
    }


def _runs(cases: list) -> dict:
    return {c: _run(c) for c in cases}


REFS: dict = {}


def _reference(extra: str) -> dict:
    key = "amp" if extra == "amp" else "plain"
    if key not in REFS:
        REFS[key] = _run(("", None, "amp" if key == "amp" else ""))
    return REFS[key]


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


CASES = [
    ("shard_optimizer", 2, ""),
    ("shard_grads", 2, ""),
    ("shard_params", 2, ""),
    ("shard_grads", 2, "accumulate"),  # stage 2 carries its reduced partition: summed across once
    ("shard_params", 2, "accumulate"),
    ("shard_optimizer", 2, "amp"),
    ("shard_params", 2, "amp"),
    ("shard_optimizer", 2, "offload"),
    ("shard_params", 2, "offload"),
    ("shard_params", 4, ""),  # four replicas of one rank: each holds the whole, as DDP
]


def test_hybrid_sharding_trains_as_one_process_on_two_nodes_of_two(ranks):
    results = ranks(4).run(_runs, CASES)
    plain2 = ranks(2).run(_runs, [(s, None, "") for s in STAGES])  # each stage on one "node" alone
    for case in CASES:
        stage, replicate, extra = case
        ref = _reference(extra)
        for r in results:
            got = r[case]
            assert stage + "(" in got["name"], got["name"]
            assert got["mesh"] == f"Mesh(dp_replicate={replicate}, dp_shard={4 // replicate})", got["mesh"]
            assert got["replicate"] == {"dp_replicate"}
            tol = 2e-2 if extra == "amp" else 1e-5
            assert _worst(got["params"], ref["params"]) <= tol, (case, _worst(got["params"], ref["params"]))
            if extra != "accumulate":  # (there the loss is the last micro-batch's)
                assert abs(got["loss"] - ref["loss"]) <= tol, (case, got["loss"], ref["loss"])
    # State per rank: the node's share (1/2 of each bucket), as a 2-rank ZeRO holds; the same on each node.
    for stage in STAGES:
        mine, alone = results[0][(stage, 2, "")], plain2[0][(stage, None, "")]
        assert mine["held"]["optimizer"] == alone["held"]["optimizer"], (stage, mine["held"], alone["held"])
        assert mine["held"]["params"] == alone["held"]["params"], (stage, mine["held"], alone["held"])
        assert mine["shard_bytes"] * 2 == mine["trainable_bytes"]
    # Traffic per mesh axis: within the node (dp_shard) what the stage moves on 2 ranks; across the nodes
    # (dp_replicate) one all-reduce of each reduced shard a step (counted 2 x its bytes); on the group of
    # all 4 the statistics, and under shard_params the ranks' 32-byte agreements on the units they run.
    for r in results:
        for stage in STAGES:
            got, alone = r[(stage, 2, "")], plain2[0][(stage, None, "")]
            stats4, stats2 = stats_bytes(got["n_params"], 4), stats_bytes(got["n_params"], 2)
            agreed = got["axes"]["dp_replicate x dp_shard"] - stats4
            assert agreed == 0 if stage != "shard_params" else 0 < agreed < 1024, (stage, got["axes"])
            assert got["axes"]["dp_shard"] + agreed == alone["comm"] - stats2, (stage, got["axes"], alone["comm"])
            assert got["axes"]["dp_replicate"] == 2 * got["shard_bytes"], (stage, got["axes"])
            assert got["comm"] == sum(got["axes"].values())
        if_stage1 = r[("shard_optimizer", 2, "")]
        assert if_stage1["axes"]["dp_shard"] == 2 * if_stage1["trainable_bytes"]  # reduce-scatter + all-gather
        whole = r[("shard_params", 4, "")]  # one rank a node: nothing within it, the whole gradient across
        assert whole["axes"]["dp_shard"] == 0
        agreed = whole["axes"]["dp_replicate"] - 2 * whole["trainable_bytes"] - stats_bytes(whole["n_params"], 4)
        assert 0 < agreed < 1024, whole["axes"]  # the whole gradient all-reduced, the statistics, the agreements


# ---------------------------------------------------------------- checkpoints


def _save(root: str) -> dict:
    step, apply = _build("shard_params", 2)
    state, _ = _train(step, step.init(apply.params), 0, 3)
    zf.checkpoint.save(state, f"{root}/hsdp")
    return {"params": step.full_params(state)}


def _resume(root: str, stage: str, replicate: int | None) -> dict:
    step, _ = _build(stage, replicate, seed=3 + C.rank())  # each rank a different fresh model
    state = zf.checkpoint.load(f"{root}/hsdp", step)
    loaded = step.full_params(state)
    state, _ = _train(step, state, 3, STEPS + 2)
    return {"loaded": loaded, "final": step.full_params(state), "count": int(state.count)}


def test_a_state_saved_under_hybrid_sharding_loads_under_plain_zero_on_2_and_4_ranks(ranks, tmp_path):
    root = str(tmp_path)
    step, apply = _build("", None)
    reference, _ = _train(step, step.init(apply.params), 0, STEPS + 2)
    reference = step.full_params(reference)
    saved = ranks(4).run(_save, root)[0]["params"]
    targets = [(4, "shard_params", None), (2, "shard_params", None), (4, "shard_grads", 2), (2, "shard_optimizer", 2)]
    for world, stage, replicate in targets:
        for r in ranks(world).run(_resume, root, stage, replicate):
            assert _worst(r["loaded"], saved) == 0.0, (world, stage, replicate)
            assert r["count"] == STEPS + 2
            assert _worst(r["final"], reference) <= 1e-5, (world, stage, replicate, _worst(r["final"], reference))
    alone = _resume(root, "", None)  # one process
    assert _worst(alone["loaded"], saved) == 0.0
    assert _worst(alone["final"], reference) <= 1e-5


# ---------------------------------------------------------------- refusals


def _refusals() -> dict:
    out = refusals(
        {
            "divide": lambda: shard_params(_build("", None)[0], replicate=3),
            "zero": lambda: shard_grads(_build("", None)[0], replicate=0),
            "bool": lambda: shard_optimizer(_build("", None)[0], replicate=True),
            "differ": lambda: shard_params(shard_optimizer(_build("", None)[0], replicate=2), replicate=4),
        }
    )
    kept = shard_params(shard_optimizer(_build("", None)[0], replicate=2))  # a later stage keeps the replicas
    out["kept"] = (kept.reduction.replicas, repr(kept.mesh))
    return out


def test_bad_replicate_is_refused_with_the_fix(ranks):
    for r in ranks(4).run(_refusals):
        assert "does not divide the world size 4" in r["divide"], r["divide"]
        assert "replicate must be an int >= 1" in r["zero"] and "replicate must be an int >= 1" in r["bool"]
        assert "already holds 2 replicas" in r["differ"], r["differ"]
        assert r["kept"] == (2, "Mesh(dp_replicate=2, dp_shard=2)")


@pytest.mark.parametrize("stage", list(STAGES))
def test_one_process_replicate_1_is_the_plain_stage(stage):
    step, apply = _build(stage, 1)
    assert step.mesh is None and step.reduction.replicas == 1
    state, m = _train(step, step.init(apply.params), 0, 2)
    assert m["comm_bytes_by_axis"] == {"dp_shard": 0}


# ---------------------------------------------------------------- beside tensor and context parallelism


def _llama_run(case: str) -> dict:
    from helpers import tiny_llama
    from zerofn.transforms import context_parallel, tensor_parallel

    apply = zf.functional(tiny_llama(max_position_embeddings=64))
    step = zf.train_step(lambda p, b: apply(p, **b).loss, zf.optim.adamw(1e-3, eps=1e-4))
    if case == "tp":  # tp 2 inside each replica: dp_replicate 2 x tp 2
        step = tensor_parallel(shard_params(step, replicate=2), 2)
    elif case == "cp":  # the sequence split over cp 2 inside each replica: ZeRO-2 over the cp ranks
        step = context_parallel(shard_grads(step, replicate=2), 2)
    state = step.init(apply.params)
    here, data = (zf.collectives.data_rank(step), step.mesh.data_size) if step.mesh is not None else (0, 1)
    for i in range(STEPS):
        ids = torch.randint(0, 64, (BATCH, 16), generator=torch.Generator().manual_seed(100 + i))
        state, m = step(state, rank_slice({"input_ids": ids, "labels": ids}, here, data))
    return {"params": step.full_params(state), "mesh": repr(step.mesh), "axes": dict(m["comm_bytes_by_axis"])}


def _llama_runs(cases: list) -> dict:
    return {c: _llama_run(c) for c in cases}


def test_hybrid_sharding_beside_tensor_and_context_parallelism(ranks):
    pytest.importorskip("transformers")
    ref = _llama_run("")
    for r in ranks(4).run(_llama_runs, ["tp", "cp"]):
        assert r["tp"]["mesh"] == "Mesh(dp_replicate=2, dp_shard=1, tp=2)"
        assert r["cp"]["mesh"] == "Mesh(dp_replicate=2, dp_shard=1, cp=2)"
        for case in ("tp", "cp"):
            assert _worst(r[case]["params"], ref["params"]) <= 1e-5, case
            assert r[case]["axes"]["dp_replicate"] > 0, r[case]["axes"]  # each shard's gradient across
