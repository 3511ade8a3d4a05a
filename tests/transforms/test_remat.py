"""remat: the same numbers as without it, for every composition; activation memory of one block."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch
from helpers import compositions, max_abs_diff, tiny_llama, train
from torch import nn
from zerofn.transforms import amp, remat, shard_params

import zerofn as zf

COMPOSITIONS = compositions()


class Net(nn.Module):
    """Blocks with dropout and wide hidden activations; parameters are small next to them."""

    def __init__(self, width=32, depth=8, hidden=4, p=0.1):
        super().__init__()
        self.inp = nn.Linear(7, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, hidden * width), nn.GELU(), nn.Dropout(p), nn.Linear(hidden * width, width))
            for _ in range(depth)
        )
        self.out = nn.Linear(width, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return self.out(x)


def make(seed=0, **kw):
    torch.manual_seed(seed)
    model = Net(**kw)
    apply = zf.functional(model)

    def loss_fn(params, batch):
        return (apply(params, batch["x"]) - batch["y"]).square().mean()

    return model, apply, loss_fn


def batch(i, n, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + i)
    x = torch.randn(n, 7, generator=g)
    return {"x": x, "y": torch.sin(x[:, :3])}


def _run(name, with_remat, world, rank, steps=3):
    _, apply, loss_fn = make()
    step = COMPOSITIONS[name](zf.train_step(loss_fn, zf.optim.adamw(1e-2), accumulate_steps=2))
    step = remat(step) if with_remat else step
    torch.manual_seed(100 + rank)  # dropout draws the same on both runs
    state, metrics = train(step, step.init(apply.params), batch, steps, 8, world, rank)
    return step.full_params(state), float(metrics["loss"])


@pytest.mark.parametrize("name", list(COMPOSITIONS))
def test_remat_changes_no_number_on_one_process(name):
    with_remat, loss = _run(name, True, 1, 0)
    without, loss_ref = _run(name, False, 1, 0)
    assert max_abs_diff(with_remat, without) == 0 and loss == loss_ref
    assert remat(shard_params(zf.train_step(make()[2], zf.optim.sgd(0.1)))).name == "remat(shard_params(train_step))"


def _rank_pair(names):
    rank, world = zf.collectives.rank(), zf.collectives.world_size()
    return {n: max_abs_diff(_run(n, True, world, rank)[0], _run(n, False, world, rank)[0]) for n in names}


def test_remat_on_two_and_four_ranks(ranks):
    for diffs in ranks(2).run(_rank_pair, ["shard_grads", "shard_params"]):
        assert all(d <= 1e-6 for d in diffs.values()), diffs
    for diffs in ranks(4).run(_rank_pair, ["plain", "shard_params"]):
        assert all(d <= 1e-6 for d in diffs.values()), diffs


def test_remat_in_either_order_and_with_selective_saving():
    _, apply, loss_fn = make()
    base = zf.train_step(loss_fn, zf.optim.adamw(1e-2))
    assert remat(amp(base)).name == amp(remat(base)).name == "remat(amp(train_step))"
    saving = remat(base, policy=[torch.ops.aten.mm.default, torch.ops.aten.addmm.default])
    state = saving.init(apply.params, keep_module=True)  # the reference starts from the same module
    ref = base.init(apply.params)
    torch.manual_seed(5)
    state, _ = saving(state, batch(0, 8))
    torch.manual_seed(5)
    ref, _ = base(ref, batch(0, 8))
    assert max_abs_diff(saving.full_params(state), base.full_params(ref)) == 0
    with pytest.raises(TypeError, match="policy must be a predicate"):
        remat(base, policy="mm")


def _activation_peak(with_remat, depth, save=None):
    """Peak live bytes of a step at batch 256 less that at batch 8: what activations add."""
    peaks = []
    for n in (8, 256):
        _, apply, loss_fn = make(depth=depth, hidden=8)
        step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
        step = remat(step, policy=save) if with_remat else step
        state = step.init(apply.params)
        state, _ = step(state, batch(0, n))  # the first step allocates what later steps reuse
        with zf.memory.track() as t:
            state, _ = step(state, batch(0, n))
        peaks.append(t.peak)
    return peaks[1] - peaks[0]


def test_remat_keeps_about_one_block_of_activations():
    plain, rematted = _activation_peak(False, 8), _activation_peak(True, 8)
    one_block = _activation_peak(False, 1)  # a whole block's forward and backward, with the model's ends
    assert rematted <= plain / 8 + one_block, (plain, rematted, one_block)
    assert rematted < plain / 3  # and far below keeping every block's activations
    # saving the matmuls keeps their outputs: more than plain remat, still less than no remat
    saved = _activation_peak(True, 8, save=[torch.ops.aten.mm.default, torch.ops.aten.addmm.default])
    assert rematted < saved < plain


# ---------------------------------------------------------------- offload="cpu": block inputs held on the host

REMAT = sys.modules["zerofn.transforms.remat"]  # the module, not the function


class _Inputs:
    """What a step's forward passes each block and what offload's pack hook holds for it."""

    def __init__(self, monkeypatch, model):
        self.originals, self.held, self.unpacked, self.forward = [], [], [], False
        for b in model.blocks if hasattr(model, "blocks") else model.model.layers:
            b.register_forward_pre_hook(self._seen)
        pack, unpack = REMAT._HostCopies.pack, REMAT._HostCopies.unpack

        def packed(copies, t):
            out = pack(copies, t)
            if out is not t:
                self.held.append((t.data_ptr(), out))
            return out

        def unpacked(copies, held):
            if isinstance(held, REMAT._Held):
                self.unpacked.append(held)
            return unpack(copies, held)

        monkeypatch.setattr(REMAT._HostCopies, "pack", packed)
        monkeypatch.setattr(REMAT._HostCopies, "unpack", unpacked)

    def _seen(self, module, args):
        if self.forward:  # not the recompute in backward
            self.originals.append(weakref.ref(args[0]))

    def alive(self):
        """How many block inputs of the forward just run are still alive, with what the step holds."""
        gc.collect()
        return sum(w() is not None for w in self.originals)


def _train_llama(offload, wrap, monkeypatch):
    """Three AdamW steps of a tiny Llama under remat(wrap(step)): the parameters, the losses, at the end of
    each forward (how many layer inputs were alive, how many layers ran), and the watched inputs."""
    model = tiny_llama()
    apply = zf.functional(model)
    inputs = _Inputs(monkeypatch, model)
    alive = []

    def loss_fn(params, batch):
        inputs.forward, inputs.originals = True, []
        logits = apply(params, input_ids=batch[:, :-1]).logits
        inputs.forward = False
        alive.append((inputs.alive(), len(inputs.originals)))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    step = remat(wrap(zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.1))), offload=offload)
    state = step.init(apply.params)
    losses = []
    for i in range(3):
        state, m = step(state, torch.randint(0, 64, (4, 13), generator=torch.Generator().manual_seed(i)))
        losses.append(float(m["loss"]))
    return step.full_params(state), losses, alive, inputs


@pytest.mark.parametrize("wrap", ["plain", "shard_params", "amp", "amp+shard_params"])
def test_offloaded_checkpoints_train_a_llama_as_remat_does_bit_for_bit(wrap, monkeypatch):
    pytest.importorskip("transformers")
    wrap = {"amp+shard_params": lambda s: amp(shard_params(s)), **COMPOSITIONS}[wrap]
    want, want_losses, kept, _ = _train_llama(None, wrap, monkeypatch)
    monkeypatch.undo()  # the next run watches its own hooks
    got, losses, freed, inputs = _train_llama("cpu", wrap, monkeypatch)
    assert losses == want_losses
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # plain remat keeps both layers' inputs to the end of the forward; offloaded, none is left on the device
    assert kept == [(2, 2)] * 3 and freed == [(0, 2)] * 3, (kept, freed)
    assert len(inputs.held) == len(inputs.unpacked) == 2 * 3  # one hidden state a layer a step, back once


def test_offload_holds_host_copies_not_the_block_inputs(monkeypatch):
    _, apply, loss_fn = make(depth=4)
    inputs = _Inputs(monkeypatch, apply.module)
    ends = []

    def watched(params, batch):
        inputs.forward, inputs.originals, inputs.held = True, [], []
        loss = loss_fn(params, batch)
        inputs.forward = False
        ends.append((inputs.alive(), [held for _, held in inputs.held]))
        return loss

    step = remat(zf.train_step(watched, zf.optim.sgd(0.1)), offload="cpu")
    state, _ = step(step.init(apply.params), batch(0, 8))
    alive, held = ends[0]
    assert alive == 0 and len(held) == 4  # each block's input copied out, and the original released
    assert all(isinstance(h, REMAT._Held) and h.host.device.type == "cpu" for h in held)
    assert all(h.host.shape == (8, 32) and not h.host.requires_grad for h in held)
    assert all(ptr != h.host.data_ptr() for ptr, h in inputs.held)  # each a copy of its input, no alias
    assert [id(h) for h in inputs.unpacked] == [id(h) for h in reversed(held)]  # back in, last block first
    assert sum(h.host.untyped_storage().nbytes() for h in held) == 4 * 8 * 32 * 4


def test_offload_moves_keyword_inputs_that_need_a_gradient_and_leaves_the_rest():
    seen = []
    copies = REMAT._HostCopies()
    base = torch.randn(3, 4, requires_grad=True)
    x, mask = base * 2, torch.ones(3, 4)

    def call(a, *, scale, mask, extra=None):
        seen.append((a.data_ptr(), scale.data_ptr(), mask is not None, extra))
        return (a * scale * mask).tanh()

    out = REMAT._recomputed(None, copies, call, (mask,), {"scale": x, "mask": mask, "extra": "kept"})
    out.sum().backward()
    ref_base = base.detach().clone().requires_grad_()
    (mask * (ref_base * 2) * mask).tanh().sum().backward()
    assert torch.equal(base.grad, ref_base.grad)
    assert len(seen) == 2 and seen[0][2:] == (True, "kept") == seen[1][2:]  # forward, then the recompute
    assert seen[1][1] != seen[0][1]  # the recompute read the keyword input back from its host copy
    assert seen[1][0] == seen[0][0] == mask.data_ptr()  # the mask was left where it was


def test_offload_composes_with_the_selective_policy_and_shard_params_on_the_test_net():
    results = {}
    for offload in (None, "cpu"):
        _, apply, loss_fn = make()
        step = remat(
            amp(shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-2)))),
            policy=[torch.ops.aten.mm.default, torch.ops.aten.addmm.default],
            offload=offload,
        )
        torch.manual_seed(7)  # dropout draws the same on both runs
        state, metrics = train(step, step.init(apply.params), batch, 3, 8, 1, 0)
        results[offload] = (step.full_params(state), float(metrics["loss"]))
    assert max_abs_diff(results[None][0], results["cpu"][0]) == 0 and results[None][1] == results["cpu"][1]


def test_offload_refuses_other_places_and_reapplies_like_other_options():
    _, apply, loss_fn = make()
    base = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    for wrong in ("nvme", "CPU", "gpu", True):
        with pytest.raises(ValueError, match=r"offload must be one of \(None, 'cpu'\).*got " + repr(wrong)):
            remat(base, offload=wrong)
    step = remat(base, offload="cpu")
    assert remat(step, offload="cpu") is step and step.name == "remat(train_step)"
    with pytest.raises(ValueError, match="already recomputes activations"):
        remat(step)
    with pytest.raises(ValueError, match="already recomputes activations"):
        remat(remat(base), offload="cpu")


def _cuda_run(offload):
    """Three AdamW steps of a wider test net on the GPU: the parameters, the last loss, and the device bytes
    allocated at the end of the last forward."""
    torch.manual_seed(0)
    apply = zf.functional(Net(width=256, depth=8, hidden=4).cuda())
    at_end = []

    def loss_fn(params, b):
        out = apply(params, b["x"])
        torch.cuda.synchronize()
        at_end.append(torch.cuda.memory_allocated())
        return (out - b["y"]).square().mean()

    step = remat(zf.train_step(loss_fn, zf.optim.adamw(1e-3)), offload=offload)
    state = step.init(apply.params)
    torch.manual_seed(3)  # dropout draws the same on both runs
    for i in range(3):
        state, m = step(state, {k: v.cuda() for k, v in batch(i, 512).items()})
    return step.full_params(state), float(m["loss"]), at_end[-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_on_cuda_frees_the_block_inputs_on_the_device_bit_for_bit():
    """Pinned host copies on a side stream: the same numbers as plain remat, and at the end of the forward
    the device holds the block inputs' bytes less."""
    (want, want_loss, kept), (got, loss, held) = _cuda_run(None), _cuda_run("cpu")
    assert max_abs_diff(got, want) == 0 and loss == want_loss
    inputs = 8 * 512 * 256 * 4  # eight blocks' hidden states, fp32
    assert kept - held >= 0.9 * inputs, (kept, held, inputs)
