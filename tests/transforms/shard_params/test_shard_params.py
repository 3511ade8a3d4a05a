"""shard_params (ZeRO-3) on real gloo ranks: faithful, bounded memory, 3 x traffic, sharded init."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import agreements, max_abs_diff, stats_bytes, train
from torch import nn
from zerofn.transforms import shard_grads, shard_optimizer, shard_params

import zerofn as zf

GLOBAL_BATCH = 24
STEPS = 10
VOCAB, DIM, SEQ = 21, 10, 7


class LoRALinear(nn.Module):
    """A frozen base weight with a trainable low-rank update."""

    def __init__(self, d_in, d_out, rank=2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.weight.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = LoRALinear(dim, dim)
        self.fc = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, dim)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.out(torch.tanh(self.fc(x)))


class Model(nn.Module):
    """Tied embeddings, LoRA over frozen weights, a block used twice, odd sizes and a buffer."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        shared = Block(DIM, 13)
        self.blocks = nn.ModuleList([Block(DIM, 11), shared, Block(DIM, 17), shared])
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight
        self.register_buffer("scale", torch.tensor(0.7))

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x)) * self.scale


def make_model(seed=0):
    torch.manual_seed(seed)
    model = Model()
    apply = zf.functional(model)

    def loss_fn(params, batch):
        logits = apply(params, batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))

    return model, apply, loss_fn


def batch_for(step, n):
    return torch.randint(VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(step))


COMPOSITIONS = {
    "shard_params": shard_params,
    "shard_params(shard_grads)": lambda s: shard_params(shard_grads(s)),
    "shard_grads(shard_params)": lambda s: shard_grads(shard_params(s)),
    "shard_optimizer(shard_params(shard_grads))": lambda s: shard_optimizer(shard_params(shard_grads(s))),
}
CASES = [  # (composition, accumulate, clip); GLOBAL_BATCH splits into world x accumulate parts
    ("shard_params", 1, None),
    ("shard_params(shard_grads)", 2, 0.5),
    ("shard_grads(shard_params)", 1, 0.5),
    ("shard_optimizer(shard_params(shard_grads))", 2, None),
]


def _opt(clip):
    opt = zf.optim.adamw(3e-3, weight_decay=0.1)
    return zf.optim.chain(zf.optim.clip_by_global_norm(clip), opt) if clip else opt


def _train(composition, accumulate, clip, world, rank):
    _, apply, loss_fn = make_model()
    step = zf.train_step(loss_fn, _opt(clip), accumulate)
    step = COMPOSITIONS[composition](step) if composition else step
    state = step.init(apply.params)
    state, _ = train(step, state, batch_for, STEPS, GLOBAL_BATCH, world, rank)
    held_tensors = len(zf.tree.tree_leaves((state.params, state.frozen)))  # one shard per bucket, frozen ones too
    return step.full_params(state), step.name, zf.memory.state_bytes(state), held_tensors


def _rank_cases():
    world, rank = dist.get_world_size(), dist.get_rank()
    return [_train(c, k, clip, world, rank) for c, k, clip in CASES]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_composition_is_faithful(ranks, world):
    refs = {clip: _train(None, 1, clip, 1, 0)[0] for clip in {c for _, _, c in CASES}}
    _, apply, _ = make_model()
    full_bytes = sum(p.numel() * p.element_size() for p in apply.params.values())
    for rank, results in enumerate(ranks(world).run(_rank_cases)):
        assert len(results) == len(CASES)
        for (composition, k, clip), (params, name, held, held_tensors) in zip(CASES, results):
            assert name == "shard_params(train_step)"
            diff = max_abs_diff(params, refs[clip])
            assert diff <= 1e-5, f"{composition} accumulate={k} clip={clip} world={world} rank={rank}: {diff:.3g}"
            # between steps a rank holds 1/N of the parameters, frozen ones included (+ padding: a bucket is
            # padded to a multiple of N elements, so under one fp32 element per bucket on each rank)
            assert full_bytes / world <= held["params"] < full_bytes / world + 4 * held_tensors, (held, held_tensors)
    assert max_abs_diff(refs[None], apply.params) > 1e-3  # it trained


def test_compositions_are_one_step_and_bad_arguments():
    _, _, loss_fn = make_model()
    base = zf.train_step(loss_fn, zf.optim.adamw(1e-3))
    steps = [make(base) for make in COMPOSITIONS.values()]
    assert all(s.name == "shard_params(train_step)" for s in steps)
    assert shard_params(steps[0]) is steps[0] and shard_grads(steps[0]) is steps[0]
    with pytest.raises(ValueError, match="prefetch must be an int >= 0"):
        shard_params(base, prefetch=-1)
    with pytest.raises(ValueError, match="not a submodule"):
        shard_params(base, units=["nope"]).init(make_model()[1].params)


def test_apply_equals_the_module_and_refuses_other_params():
    model, apply, loss_fn = make_model()
    reference = copy.deepcopy(model)
    step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(apply.params)
    idx = batch_for(0, 5)[:, :-1]
    torch.testing.assert_close(step.apply(state, idx), reference(idx), rtol=0, atol=0)
    # the state holds the only copy: the module has placeholders and says what to use instead
    assert all(p.device.type == "meta" for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"(?s)held by a zerofn TrainState.*step.apply\(state"):
        model(idx)
    with pytest.raises(RuntimeError, match=r"(?s)module.state_dict\(\).*step.full_params\(state\)"):
        model.state_dict()

    _, apply, _ = make_model()

    def bad_loss(params, batch):
        return apply(dict(params), batch[:, :-1]).sum()

    bad = shard_params(zf.train_step(bad_loss, zf.optim.adamw(1e-3)))
    with pytest.raises(ValueError, match="call apply with the params the step passed to loss_fn"):
        bad(bad.init(apply.params), batch_for(0, 4))


def _rank_apply():
    model, apply, loss_fn = make_model()
    reference = copy.deepcopy(model)
    step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    state = step.init(apply.params)
    idx = batch_for(0, 5)[:, :-1]
    return (step.apply(state, idx) - reference(idx)).abs().max().item()


def test_apply_on_ranks_equals_the_unsharded_module(ranks):
    assert ranks(3).run(_rank_apply) == [0.0] * 3  # every rank (max() would drop a nan from rank 1 or 2)


# ---------------------------------------------------------------- memory and traffic


class Wide(nn.Module):
    """8 equal wide blocks; parameters dominate."""

    def __init__(self, width=192, depth=8):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _rank_memory(prefetch, units=None):
    torch.manual_seed(0)
    model = Wide()
    apply = zf.functional(model)
    block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())

    def loss_fn(params, x):
        return apply(params, x).square().mean()

    step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), prefetch=prefetch, units=units)
    state = step.init(apply.params)
    x = torch.randn(2, 192)
    state, m1 = step(state, x)
    with zf.memory.track() as t, agreements() as agreed:
        state, m2 = step(state, x)
    layout = state.spec.layout
    last = next((u for u in layout.units if u.name == f"blocks.{len(model.blocks) - 1}"), None)
    return dict(
        peak=t.peak,
        block=block_bytes,
        last_block=sum(layout.buckets[i].nbytes for i in last.buckets) if last else None,
        partition=sum(b.nbytes // b.shards for b in layout.buckets),
        full=sum(b.numel * 4 for b in layout.buckets),
        padded=sum(b.nbytes for b in layout.buckets),
        units=sum(1 for u in layout.units if u.buckets or u.frozen),
        comm=(m1["comm_bytes"], m2["comm_bytes"]),
        activations=8 * 2 * 192 * 4 * 3,
        trainable=len(layout.trainable_names),
        agreed=agreed,
    )


def _bound(r, prefetch):
    """Beyond the shards held between steps: the gradient partition, (prefetch + 2) x a block's full
    parameters and gradient bucket, and this tiny batch's activations (+ a few scalars)."""
    return r["partition"] + (prefetch + 2) * 2 * r["block"] + r["activations"] + 8192


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_peak_memory_is_shards_plus_a_few_blocks(ranks, prefetch):
    world = 4
    for rank, r in enumerate(ranks(world).run(_rank_memory, prefetch)):
        bound = _bound(r, prefetch)
        assert bound < 2 * r["full"]  # all full parameters and gradients alive at once would fail it
        assert r["peak"] <= bound, (prefetch, rank, r)
        # traffic: gathers in forward and backward, one reduce-scatter: 3 x (padded) parameter bytes, less
        # the backward gather of the forward's last block (kept gathered for backward, which starts with it),
        # plus 32 bytes of unit-order agreement per backward gather and at the forward's end, and the step's
        # statistics; the first step also agrees on each unit the forward opens, and on the batch shapes
        scalars = (r["units"] - 1) * 32 + 32 + stats_bytes(r["trainable"], world)
        steady = 3 * r["padded"] - r["last_block"] + scalars
        assert r["comm"] == (steady + r["units"] * 32 + 2 * 16, steady)
        # The second step's forward follows the order the first recorded without agreeing on any unit; backward
        # waits for no agreement before a gather: each of its gathers (every unit's but the last block's) leaves
        # its agreement in flight, settled when the gather itself is waited for.
        assert [a for a in r["agreed"] if a[0] != "BACKWARD"] == [("END", "waited")], r["agreed"]
        backward = [a for a in r["agreed"] if a[0] == "BACKWARD"]
        assert backward == [("BACKWARD", "posted")] * (r["units"] - 1), r["agreed"]


def test_memory_test_would_catch_gathering_everything(ranks):
    """One unit holding the whole model (every parameter gathered at once) breaks the same bound."""
    r = ranks(4).run(_rank_memory, 1, [])[0]
    assert r["units"] == 1 and r["peak"] > _bound(r, 1)


# ---------------------------------------------------------------- sharded initialisation


class Plain(nn.Module):
    """Every parameter comes from a module with reset_parameters."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM + 1), nn.LayerNorm(2 * DIM + 1)) for _ in range(3)
        )
        self.head = nn.Linear(2 * DIM + 1, VOCAB)

    def forward(self, idx):
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            x = b(x) if i == 0 else b(x[..., :DIM])
        return self.head(x)


def _meta_batch():
    return torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _rank_meta_init():
    torch.manual_seed(7)
    with torch.device("meta"):
        meta_model = Plain()
    meta_apply = zf.functional(meta_model)

    def loss_fn(params, batch):
        return meta_apply(params, batch).square().mean()

    step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    torch.manual_seed(7)
    with zf.memory.track() as t:
        state = step.init(meta_apply.params)
    shards = [s.clone() for s in state.params]
    full = step.full_params(state)
    state, m = step(state, _meta_batch())
    largest = max(p.numel() * 4 for p in Plain().parameters())
    shard_bytes = sum(s.numel() * 4 for s in shards)
    return full, shards, t.peak, shard_bytes, largest, float(m["loss"])


def test_meta_init_equals_full_init_sliced(ranks):
    torch.manual_seed(7)
    reference_model = Plain()
    reference = {k: v.detach() for k, v in reference_model.named_parameters()}
    with torch.no_grad():  # every rank feeds this batch: the mean loss is the full model's loss on it
        reference_loss = float(reference_model(_meta_batch()).square().mean())
    world = 3
    results = ranks(world).run(_rank_meta_init)
    for full, _shards, peak, shard_bytes, largest, loss in results:
        assert max_abs_diff(full, reference) == 0
        # one module's parameters at a time: the shards + the largest module's parameters (+ its clone)
        assert peak <= shard_bytes + 3 * largest + 4096, (peak, shard_bytes, largest)
        assert loss == pytest.approx(reference_loss, rel=1e-6)  # a step runs on the materialised shards
    # each rank's shards are its slices of the full flat buffers
    torch.manual_seed(7)
    _, apply_full, _ = (None, zf.functional(Plain()), None)
    # rebuild the layout on one process to slice the reference the same way
    step = shard_params(zf.train_step(lambda p, b: apply_full(p, b).sum(), zf.optim.sgd(0.1)))
    one = step.init(apply_full.params)
    for rank, (_, shards, *_rest) in enumerate(results):
        assert len(shards) == len(one.spec.layout.buckets) > 0
        for shard, bucket in zip(shards, one.spec.layout.buckets):
            lo, hi = -(-bucket.numel // world) * rank, -(-bucket.numel // world) * (rank + 1)
            flat = torch.zeros(-(-bucket.numel // world) * world)
            for s in bucket.slots:
                flat[s.offset : s.offset + s.numel] = reference[s.name].reshape(-1)
            assert torch.equal(shard, flat[lo:hi])


def _big_batch(i):
    return torch.randn(2, 128, generator=torch.Generator().manual_seed(i))


def _rank_big_model():
    """A model whose full parameters exceed what a rank may hold initialises and trains within it."""
    with torch.device("meta"):
        model = Wide(width=128, depth=32)
    apply = zf.functional(model)
    step = shard_params(zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(1e-2)))
    losses = []
    with zf.memory.track() as t:
        torch.manual_seed(0)
        state = step.init(apply.params)
        for i in range(2):
            state, m = step(state, _big_batch(i))
            losses.append(float(m["loss"]))
    full = sum(p.numel() * 4 for p in apply.params.values())
    return t.peak, full, losses


def test_model_larger_than_a_rank_initialises_and_trains(ranks):
    """The budget per rank is the model's full fp32 parameters: the full model could not even be loaded."""
    # the reference: the same model built whole on one process, two plain steps on the same batches
    torch.manual_seed(0)
    apply = zf.functional(Wide(width=128, depth=32))
    step = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(1e-2))
    state = step.init(apply.params)
    ref_losses = []
    for i in range(2):
        state, m = step(state, _big_batch(i))
        ref_losses.append(float(m["loss"]))
    for peak, full, losses in ranks(4).run(_rank_big_model):
        budget = full
        assert peak < budget, (peak, budget)
        assert losses == pytest.approx(ref_losses, rel=1e-5)  # the second loss: after a real update


# ---------------------------------------------------------------- divergent ranks


class Skippy(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

    def forward(self, x, skip):
        for i, b in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(b(x))
        return x


def _rank_divergent():
    import time

    rank = dist.get_rank()
    torch.manual_seed(0)
    apply = zf.functional(Skippy())
    step = shard_params(zf.train_step(lambda p, b: apply(p, b, skip=1 + rank).square().mean(), zf.optim.sgd(0.1)))
    state = step.init(apply.params)
    t0 = time.perf_counter()
    try:
        step(state, torch.randn(3, 6))
    except RuntimeError as e:
        return str(e), time.perf_counter() - t0
    return None, time.perf_counter() - t0


def test_ranks_that_run_different_units_fail_fast():
    # its own ranks: a failed step leaves collectives unmatched, which a shared pool must not inherit
    for msg, seconds in zf.spawn(_rank_divergent, 2, timeout=120):
        assert msg is not None and "ranks gathered different units" in msg and "blocks." in msg
        assert seconds < 30
