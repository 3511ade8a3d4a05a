"""shard_params' units for any module tree, the size policy, and meta-device initialisation of a Hugging
Face model through its own _init_weights (real gloo ranks where a step runs)."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from helpers import MLP, TinyTransformer, max_abs_diff, rank_slice
from torch import nn
from zerofn.transforms import shard_params
from zerofn.transforms._units import ROOT, MinUnitBytes, assign_units, materialise_device, natural_blocks, unit_names

import zerofn as zf

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


def block(width=8):
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


def sequential_mlp(width=8, depth=16):
    return nn.Sequential(*[block(width) for _ in range(depth)])


class Wrapper(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body


class Stage(nn.Module):
    def __init__(self, width, depth):
        super().__init__()
        self.down = nn.Linear(width, width)
        self.blocks = nn.Sequential(*[block(width) for _ in range(depth)])


class Stages(nn.Module):
    """timm-like: a stem, then stages of blocks; the last stage holds most of the parameters."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.stages = nn.Sequential(Stage(8, 1), Stage(8, 1), Stage(8, 6))
        self.head = nn.Linear(8, 2)


class Edges(nn.Module):
    """An empty container, one of parameter-free modules, and a shared block."""

    def __init__(self):
        super().__init__()
        self.empty = nn.ModuleList()
        self.acts = nn.ModuleList([nn.Tanh(), nn.ReLU()])
        shared = block()
        self.blocks = nn.ModuleList([block(), shared, block(), shared])
        self.again = nn.ModuleDict({"x": shared, "y": block()})


class NoContainers(nn.Module):
    def __init__(self, n=4, width=8):
        super().__init__()
        for i in range(n):
            setattr(self, f"l{i}", nn.Linear(width, width))


def _llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=64,
        intermediate_size=64,
    )


def _llama():
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(_llama_config())


def _gpt():
    spec = importlib.util.spec_from_file_location("gpt_example", os.path.join(EXAMPLES, "gpt.py"))
    gpt = sys.modules.setdefault(spec.name, importlib.util.module_from_spec(spec))  # dataclasses look it up
    spec.loader.exec_module(gpt)
    return gpt.GPT(gpt.GPTConfig())


def _n(prefix, k):
    return [f"{prefix}{i}" for i in range(k)]


UNITS = {  # model -> its default units
    "plain Sequential of 16 blocks": (sequential_mlp, _n("", 16)),
    "wrapper holding a Sequential": (lambda: Wrapper(sequential_mlp(depth=4)), _n("body.", 4)),
    "Hugging Face Llama": (_llama, _n("model.layers.", 2)),
    "ModuleDict of blocks": (lambda: Wrapper(nn.ModuleDict({k: block() for k in "ab"})), ["body.a", "body.b"]),
    "Sequential of one ModuleList": (lambda: nn.Sequential(nn.ModuleList(block() for _ in range(3))), _n("0.", 3)),
    "Sequential of embedding, ModuleList, head": (
        lambda: nn.Sequential(nn.Embedding(5, 8), nn.ModuleList(block() for _ in range(3)), nn.Linear(8, 5)),
        ["0", "1.0", "1.1", "1.2", "2"],
    ),
    "containers of containers": (
        lambda: Wrapper(nn.Sequential(nn.Sequential(sequential_mlp(depth=3)))),
        _n("body.0.0.", 3),
    ),
    "timm-like stages, the last one dominant": (
        Stages,
        ["stages.0", "stages.1", "stages.2.down", *_n("stages.2.blocks.", 6)],
    ),
    "empty, parameter-free and shared": (Edges, ["blocks.0", "blocks.1", "blocks.2", "again.y"]),
    "TinyTransformer (unchanged)": (TinyTransformer, _n("blocks.", 2)),
    "MLP (unchanged, a layer of 52%)": (MLP, _n("layers.", 3)),
    "examples/gpt.py GPT (unchanged)": (_gpt, _n("blocks.", 4)),
    # one block holding most of the model is cut into its layers
    "TinyTransformer with one block": (
        lambda: TinyTransformer(layers=1, extras=False),
        ["blocks.0.ln", "blocks.0.qkv", "blocks.0.proj", "blocks.0.fc", "blocks.0.out"],
    ),
}


@pytest.mark.parametrize("case", UNITS)
def test_default_units_are_the_natural_blocks(case):
    make, expected = UNITS[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of them is one unit
        assert unit_names(make(), None) == expected


def test_tied_weight_across_units_goes_to_the_root():
    model = nn.Sequential(nn.Embedding(5, 8), *[block() for _ in range(3)], nn.Linear(8, 5, bias=False))
    model[4].weight = model[0].weight
    names = unit_names(model, None)
    assert names == ["0", "1", "2", "3", "4"]
    unit_of = assign_units(zf.functional(model), dict(model.named_parameters()), names)
    assert unit_of["0.weight"] == ROOT and unit_of["1.0.weight"] == "1"


def test_one_unit_warns_and_names_the_option():
    with pytest.warns(UserWarning, match=r"is one unit.*Pass units=.*MinUnitBytes\(n\)"):
        assert unit_names(NoContainers(), None) == []
    with pytest.warns(UserWarning, match=r"is one unit.*chose \['0'\]"):  # everything in a single unit
        assert unit_names(nn.Sequential(NoContainers()), lambda path, module: path == "0") == ["0"]
    with pytest.warns(UserWarning, match=r"MinUnitBytes\(min_bytes=1000000\) finds no finer cut"):
        unit_names(NoContainers(), MinUnitBytes(10**6))
    with pytest.warns(UserWarning, match="chose no module"):
        unit_names(NoContainers(), lambda path, module: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert unit_names(nn.Linear(3, 3), None) == []  # nothing to cut
        assert unit_names(nn.Sequential(nn.Linear(3, 3)), None) == ["0"]
        assert unit_names(NoContainers(), []) == []  # an explicit list is the user's choice
        assert natural_blocks(nn.Sequential()) == []


def test_min_unit_bytes_is_the_finest_cut_of_at_least_that_size():
    model = Stages()
    linear = 8 * 8 * 4 + 8 * 4  # bytes of one Linear(8, 8)
    # every Linear(8, 8) is a unit; the stem and head (smaller) go to the root
    assert unit_names(model, MinUnitBytes(linear)) == [
        n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features == 8 and m.out_features == 8
    ]
    # a block (two Linears) is the smallest module holding 2 Linears' bytes; a stage's down Linear is smaller
    assert unit_names(model, MinUnitBytes(2 * linear)) == [
        "stages.0.blocks.0",
        "stages.1.blocks.0",
        *_n("stages.2.blocks.", 6),
    ]
    assert unit_names(model, MinUnitBytes(3 * linear)) == ["stages.0", "stages.1", "stages.2.blocks"]
    assert MinUnitBytes(64) == MinUnitBytes(64) and hash(MinUnitBytes(64)) == hash(MinUnitBytes(64))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="min_bytes must be an int > 0"):
            MinUnitBytes(bad)


def test_min_unit_bytes_through_shard_params():
    model = NoContainers(n=6)
    apply = zf.functional(model)
    base = zf.train_step(lambda p, x: apply(p, x).square().mean(), zf.optim.sgd(0.1))
    step = shard_params(base, units=MinUnitBytes(8 * 8 * 4))
    assert shard_params(step, units=MinUnitBytes(8 * 8 * 4)) is step  # the same options: the same step
    with pytest.raises(ValueError, match="shard_params"):
        shard_params(step, units=MinUnitBytes(1024))
    state = step.init(apply.params, keep_module=True)  # the module builds a second state below
    assert [u.name for u in state.spec.layout.units] == [*_n("l", 6)][::-1] + [ROOT]  # backward order, root last
    with pytest.warns(UserWarning, match="is one unit"):
        one = shard_params(base).init(apply.params)
    assert [u.name for u in one.spec.layout.units] == [ROOT]


# ---------------------------------------------------------------- memory of a Sequential without units=

WIDTH, DEPTH, GLOBAL_BATCH = 96, 16, 8
# SGD with momentum, not Adam: among 300k gradient elements some are near zero, where Adam turns
# reduction-order noise into steps of about lr (docs/design.md), which no 1e-6 tolerance survives
OPT = zf.optim.sgd(0.1, momentum=0.9)


class Residual(nn.Module):
    """x + block(x): gradients that do not vanish through 16 blocks (near-zero ones would let Adam turn
    reduction-order noise into whole steps, see docs/design.md)."""

    def __init__(self, width):
        super().__init__()
        self.f = block(width)

    def forward(self, x):
        return x + self.f(x)


def _make_sequential():
    torch.manual_seed(0)
    apply = zf.functional(nn.Sequential(*[Residual(WIDTH) for _ in range(DEPTH)]))

    def loss_fn(params, batch):
        return ((apply(params, batch["x"]) - batch["y"]) ** 2).mean()

    return apply, loss_fn


def _batch(i):
    x = torch.randn(GLOBAL_BATCH, WIDTH, generator=torch.Generator().manual_seed(i))
    return {"x": x, "y": torch.sin(x)}


def _rank_sequential_memory(units):
    world, rank = dist.get_world_size(), dist.get_rank()
    apply, loss_fn = _make_sequential()
    step = shard_params(zf.train_step(loss_fn, OPT), units=units)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # units=[] is one unit on purpose
        state = step.init(apply.params)
    state, _ = step(state, rank_slice(_batch(0), rank, world))
    with zf.memory.track() as t:
        state, _ = step(state, rank_slice(_batch(1), rank, world))
    layout = state.spec.layout
    return dict(
        peak=t.peak,
        block=sum(p.numel() * 4 for p in apply.module[0].parameters()),
        partition=sum(b.nbytes // b.shards for b in layout.buckets),
        full=sum(b.numel * 4 for b in layout.buckets),
        units=sum(1 for u in layout.units if u.buckets or u.frozen),
        # autograd keeps about 3 activations of (rows, WIDTH) per block; 4 for slack
        activations=DEPTH * (GLOBAL_BATCH // world) * WIDTH * 4 * 4,
        params=step.full_params(state),
    )


def _bound(r, prefetch=1):
    """As test_shard_params' bound: the gradient partition, (prefetch + 2) x a block's full parameters
    and gradient bucket, and this tiny batch's activations (+ a few scalars)."""
    return r["partition"] + (prefetch + 2) * 2 * r["block"] + r["activations"] + 8192


def test_sequential_without_units_is_gathered_per_block(ranks):
    apply, loss_fn = _make_sequential()
    step = zf.train_step(loss_fn, OPT)
    state = step.init(apply.params)
    for i in range(2):
        state, _ = step(state, _batch(i))
    reference = step.full_params(state)
    pool = ranks(4)
    for rank, r in enumerate(pool.run(_rank_sequential_memory, None)):
        assert r["units"] == DEPTH  # one per block; the root holds nothing
        bound = _bound(r)
        assert bound < 2 * r["full"]  # all full parameters and gradients alive at once would fail it
        assert r["peak"] <= bound, (rank, r["peak"], bound, r["peak"] / r["full"])
        assert max_abs_diff(r["params"], reference) <= 1e-6, rank
    assert max_abs_diff(reference, _make_sequential()[0].params) > 1e-3  # it trained
    # the same model as one unit (the old default for a Sequential) breaks the bound
    whole = pool.run(_rank_sequential_memory, [])[0]
    assert whole["units"] == 1 and whole["peak"] > _bound(whole)


# ---------------------------------------------------------------- Hugging Face initialisation from meta

SEED = 3


def _hf_initialise(model, seed):
    """Hugging Face's own initialisation pass over a built model (what it runs for weights a checkpoint
    lacks), with the flags that mark modules as already initialised cleared."""
    for t in [*model.modules(), *model.parameters(), *model.buffers()]:
        t.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    model.initialize_weights()


def _ids():
    return torch.randint(64, (4, 9), generator=torch.Generator().manual_seed(0))


def _rank_llama_meta():
    from transformers import LlamaForCausalLM

    world, rank = dist.get_world_size(), dist.get_rank()
    # the reference: the model built whole, then initialised by its own _init_weights with the same seed
    ref = LlamaForCausalLM(_llama_config()).to(materialise_device())
    _hf_initialise(ref, SEED)
    with torch.no_grad():
        ref_loss = float(ref(input_ids=_ids(), labels=_ids()).loss)
    ref_params = {k: v.detach().cpu().clone() for k, v in ref.named_parameters()}
    ref_apply = zf.functional(ref)
    ref_step = shard_params(zf.train_step(lambda p, ids: ref_apply(p, input_ids=ids).logits.sum(), zf.optim.sgd(0.1)))
    ref_shards = [s.cpu() for s in ref_step.init(ref_apply.params).params]

    meta = _llama()
    apply = zf.functional(meta)
    step = shard_params(zf.train_step(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, zf.optim.adamw(1e-3)))
    torch.manual_seed(SEED)
    state = step.init(apply.params)
    shards = [s.cpu().clone() for s in state.params]
    full = {k: v.cpu() for k, v in step.full_params(state).items()}
    buffers = {n: b.device.type for n, b in meta.named_buffers()}
    state, m = step(state, rank_slice(_ids(), rank, world))  # equal token counts: the ranks' mean is the batch's
    return shards, ref_shards, full, ref_params, buffers, float(m["loss"]), ref_loss


def test_meta_hugging_face_model_uses_its_own_init(ranks):
    std = _llama_config().initializer_range
    for rank, (shards, ref_shards, full, ref_params, buffers, loss, ref_loss) in enumerate(
        ranks(2).run(_rank_llama_meta)
    ):
        # each rank's shards are its slices of the reference: init equals Hugging Face's own pass
        assert len(shards) == len(ref_shards) > 0
        assert all(torch.equal(a, b) for a, b in zip(shards, ref_shards)), rank
        assert max_abs_diff(full, ref_params) == 0
        # what that init is: norm scales one, projections and embeddings N(0, initializer_range)
        norms = [v for k, v in full.items() if k.endswith("norm.weight")]
        weights = torch.cat([v.reshape(-1) for k, v in full.items() if not k.endswith("norm.weight")])
        assert len(norms) == 5 and all(torch.equal(v, torch.ones_like(v)) for v in norms)
        assert weights.std().item() == pytest.approx(std, rel=0.05) and abs(weights.mean().item()) < std / 20
        # the rotary frequencies (buffers) are materialised too, so a step runs on the model built on meta
        assert buffers and all(d != "meta" for d in buffers.values()), buffers
        assert loss == pytest.approx(ref_loss, rel=1e-5)


def _shifted():
    """A Hugging Face model with a module that holds a parameter and a buffer its model's init sets."""
    from transformers import PretrainedConfig, PreTrainedModel

    class ShiftedConfig(PretrainedConfig):
        model_type = "zerofn_test_shifted"

    class Shifted(nn.Linear):
        def __init__(self, n):
            super().__init__(n, n)
            self.register_buffer("shift", torch.empty(n), persistent=False)

        def forward(self, x):
            return super().forward(x) + self.shift

    class ShiftedModel(PreTrainedModel):
        config_class = ShiftedConfig

        def __init__(self, config):
            super().__init__(config)
            self.emb, self.mix, self.head = nn.Embedding(64, 8), Shifted(8), nn.Linear(8, 64)
            self.post_init()

        def _init_weights(self, module):
            super()._init_weights(module)
            if isinstance(module, Shifted):
                with torch.no_grad():
                    module.shift.copy_(torch.arange(8.0) / 8)

        def forward(self, input_ids, labels):
            logits = self.head(torch.tanh(self.mix(self.emb(input_ids))))
            return SimpleNamespace(loss=nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()))

    with torch.device("meta"):
        return ShiftedModel(ShiftedConfig())


def _rank_hf_meta_load(root: str, kind: str):
    def build():
        meta = _llama() if kind == "llama" else _shifted()
        apply = zf.functional(meta)
        step = shard_params(
            zf.train_step(lambda p, ids: apply(p, input_ids=ids, labels=ids).loss, zf.optim.adamw(1e-3))
        )
        return step, meta

    world, rank = dist.get_world_size(), dist.get_rank()
    batch = rank_slice(_ids(), rank, world)
    step, _ = build()
    torch.manual_seed(SEED)
    state, _ = step(step.init(step.model().params), batch)
    zf.checkpoint.save(state, f"{root}/{kind}")
    saved = {k: v.clone() for k, v in step.full_params(state).items()}
    _, m = step(state, batch)
    # A fresh model built on meta, loaded into.
    step, meta = build()
    torch.manual_seed(7)
    loaded = zf.checkpoint.load(f"{root}/{kind}", step, rng=False)
    drawn = not torch.equal(torch.rand(4), torch.random.manual_seed(7) and torch.rand(4))
    buffers = {n: b.to("cpu", copy=True) for n, b in meta.named_buffers() if b.device.type != "meta"}
    full = step.full_params(loaded)
    _, m2 = step(loaded, batch)
    return drawn, buffers, max_abs_diff(full, saved), float(m["loss"]), float(m2["loss"])


@pytest.mark.parametrize("kind", ["llama", "shifted"])
def test_a_load_into_a_meta_hugging_face_model_initialises_only_what_it_must(ranks, tmp_path, kind):
    for drawn, buffers, diff, loss, loaded_loss in ranks(2).run(_rank_hf_meta_load, str(tmp_path), kind):
        # The buffers the model's init sets are materialised, to its values: Llama's rotary frequencies (in a
        # module of their own), the shift of a module with a parameter (whose parameters are then initialised
        # with it, the load overwriting them) ...
        if kind == "llama":
            assert {n.rsplit(".", 1)[-1] for n in buffers} == {"inv_freq", "original_inv_freq"}, buffers
        else:
            assert set(buffers) == {"mix.shift"} and torch.equal(buffers["mix.shift"], torch.arange(8.0) / 8)
        # ... and no parameter of Llama's is initialised: the load draws no random numbers.
        assert not drawn or kind == "shifted", "the load ran the model's initialisation of its parameters"
        assert diff == 0 and loaded_loss == loss


# ---------------------------------------------------------------- errors and init_fn


class Scaled(nn.Module):
    """A parameter of its own and no reset_parameters."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.lin(x) * self.scale


class HalfReset(nn.Linear):
    def reset_parameters(self):
        nn.init.zeros_(self.weight)  # forgets the bias


def _meta_step(make, **options):
    with torch.device("meta"):
        model = make()
    apply = zf.functional(model)
    options = {"units": [], **options}  # one unit on purpose: no warning
    return shard_params(zf.train_step(lambda p, x: apply(p, x).sum(), zf.optim.sgd(0.1)), **options), apply


def test_meta_parameters_nothing_initialises_raise_with_a_correct_suggestion():
    step, apply = _meta_step(Scaled)
    with pytest.raises(ValueError, match=r"'scale'.*has no reset_parameters\(\).*init_fn=.*meta.dim\(\) > 1"):
        step.init(apply.params)
    step, apply = _meta_step(lambda: HalfReset(3, 3))
    with pytest.raises(ValueError, match=r"'bias'.*left it unset after reset_parameters\(\)"):
        step.init(apply.params)


def test_init_fn_initialises_every_meta_parameter():
    def init_fn(name, meta):
        return torch.full(meta.shape, 2.0) if meta.dim() > 1 else torch.zeros(meta.shape)

    step, apply = _meta_step(Scaled, init_fn=init_fn)
    full = step.full_params(step.init(apply.params))
    assert torch.equal(full["lin.weight"], torch.full((3, 3), 2.0)) and torch.equal(full["scale"], torch.zeros(3))
    assert apply.module.lin.weight.device.type == "meta"  # the module keeps its meta parameters
