"""The systems the benchmark trains, and how their collective traffic is counted.

A system is one way to train the GPT of :mod:`zerofn.bench.gpt` with AdamW
(the same :class:`AdamWConfig` everywhere, no gradient clipping): a zerofn
composition such as ``amp(shard_params(train_step), bf16)``, a torch peer
(DDP, ZeroRedundancyOptimizer, FSDP2) or, when ``import deepspeed`` works,
DeepSpeed's ZeRO stages. :func:`build` makes one by name, inside the ranks,
from the same seed; every system built from the same name trains the same
model on the same data.

Every fp32 system does the same math: torch's AdamW (zerofn's equals it,
DeepSpeed's fused Adam computes the same update) with the same
hyper-parameters and no clipping. DeepSpeed clips the global gradient norm
to ``gradient_clipping`` of its config, 1.0 when the config leaves it out
(``GRADIENT_CLIPPING_DEFAULT`` in ``deepspeed/runtime/constants.py`` of
DeepSpeed 0.19.8; older releases had 0), so :func:`deepspeed_config` sets it
to 0. With the default, DeepSpeed's rows trained another model: on the
benchmark's first GPT, 20 steps of ZeRO-1 ended at a loss of 2.4967 against
DDP's 2.6646 (the losses part at the third step), and the same with torch's
AdamW inside DeepSpeed (2.4967): the clipping, not the optimizer. With
clipping off, ZeRO-1, 2 and 3 match DDP to 1e-6 at every step.

Traffic is counted in the ZeRO paper's units, the ones ``zerofn.collectives``
uses: an all-reduce of n bytes counts 2n, a reduce-scatter or all-gather whose
full tensor has n bytes counts n, a broadcast or reduce of n bytes counts n.
zerofn steps count their own (``metrics["comm_bytes"]``). For the other
systems, :func:`counting` wraps torch.distributed's collective functions for
the duration of a block. DDP's gradient all-reduces, which its C++ reducer
issues without passing through Python, are seen by giving DDP torch's own
``allreduce_hook`` (the same all-reduce, issued from Python). The torch
systems are counted on a second instance, built only to be counted, so that
the timed instance runs as shipped.

Example:
    >>> "torch DDP" in SYSTEMS and "amp(shard_params(train_step), bf16)" in SYSTEMS
    True
    >>> composition_name("shard_optimizer", offload=True)
    'offload(shard_optimizer(train_step), "cpu")'
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import itertools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import zerofn as zf
from zerofn import collectives as C
from zerofn.bench.gpt import GPT, GPTConfig, loss_fn_for
from zerofn.placement import held_bytes

__all__ = [
    "ALL",
    "SYSTEMS",
    "AdamWConfig",
    "System",
    "build",
    "composition_name",
    "counting",
    "deepspeed_config",
    "deepspeed_installed",
    "fully_sharded",
]


@dataclass(frozen=True)
class AdamWConfig:
    """The AdamW every system trains with (torch's ``torch.optim.AdamW`` arguments).

    Example:
        >>> AdamWConfig(betas=(0.9, 0.95)).torch_kwargs()["betas"]
        (0.9, 0.95)
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.1

    def torch_kwargs(self) -> dict[str, Any]:
        return dict(lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay)


LR, WD = AdamWConfig.lr, AdamWConfig.weight_decay

DDP = "torch DDP"
ZERO = "torch ZeroRedundancyOptimizer"
FSDP2 = "torch FSDP2"
DDP_CHECKPOINT = "torch DDP + checkpoint"
DEEPSPEED = ("DeepSpeed ZeRO-1", "DeepSpeed ZeRO-2", "DeepSpeed ZeRO-3")
STAGES = ("train_step", "shard_optimizer", "shard_grads", "shard_params")


@dataclass
class System:
    """One system, built inside a rank.

    Attributes:
        step: trains one step on a batch and returns its loss as a tensor, without waiting for
            anything (the torch systems: this rank's loss; zerofn: the mean over ranks, which its
            step computes anyway); the harness averages the last one over the ranks.
        state: bytes this rank holds between steps, ``{"params", "optimizer"}``.
        count: trains one step like ``step`` and returns the collective bytes
            this rank moved in a step, in the ZeRO paper's units.
    """

    step: Callable[[torch.Tensor], torch.Tensor]
    state: Callable[[], dict[str, int]]
    count: Callable[[torch.Tensor], int]


# ---------------------------------------------------------------- counting torch.distributed traffic


class _Counter:
    def __init__(self) -> None:
        self.bytes = 0


_active: list[_Counter] = []

# torch.distributed function: (the argument whose tensor bytes count, times how many)
_UNITS = {
    "all_reduce": ("tensor", 2),
    "all_gather_single": ("output_tensor", 1),
    "all_gather_into_tensor": ("output_tensor", 1),
    "reduce_scatter_single": ("input", 1),
    "reduce_scatter_tensor": ("input", 1),
    "all_gather": ("tensor_list", 1),
    "reduce_scatter": ("input_list", 1),
    "broadcast": ("tensor", 1),
    "reduce": ("tensor", 1),
}


def _add(nbytes: int) -> None:
    for c in _active:
        c.bytes += nbytes


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(x) for x in obj)
    return 0


def _counted(fn: Callable, arg: str, times: int) -> Callable:
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        _add(times * _tensor_bytes(bound.arguments.get(arg)))
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def counting() -> Iterator[_Counter]:
    """Count the bytes of torch.distributed collectives called inside the block.

    Wraps the functions named in the module's table on ``torch.distributed``
    while the block runs. Calls that go through the C++ API directly, as
    DDP's reducer does, are not seen; DDP is counted with torch's
    ``allreduce_hook``, which issues the same all-reduce through Python.

    Example:
        >>> with counting() as c:
        ...     pass
        >>> c.bytes
        0
    """
    import torch.distributed as dist

    counter = _Counter()
    outermost = not _active
    saved = []
    if outermost:
        for name, (arg, times) in _UNITS.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                saved.append((dist, name, fn))
                setattr(dist, name, _counted(fn, arg, times))
        # DeepSpeed's communication backend keeps its own references to two of them, taken at start-up.
        backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
        for attr, arg in (("all_gather_function", "output_tensor"), ("reduce_scatter_function", "input")):
            fn = getattr(backend, attr, None)
            if fn is not None:
                saved.append((backend, attr, fn))
                setattr(backend, attr, _counted(fn, arg, 1))
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)
        for owner, name, fn in saved:
            setattr(owner, name, fn)


# ---------------------------------------------------------------- bytes held


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shard), counted as
    ``zf.memory.state_bytes`` counts a state's."""
    local = []
    for t in tensors:
        partition = getattr(t, "ds_tensor", None)  # DeepSpeed ZeRO-3 keeps this rank's partition there
        t = t if partition is None else partition
        local.append(getattr(t, "_local_tensor", t))  # DTensor
    return sum(held_bytes(local).values())


def _optimizer_state_bytes(opt) -> int:
    """Bytes of the state tensors of ``opt``, or of the torch optimizer it wraps."""
    for attr in ("optim", "optimizer"):  # ZeroRedundancyOptimizer's local optimizer, DeepSpeed's torch one
        inner = getattr(opt, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            opt = inner
    return _storage_bytes(t for s in opt.state.values() for t in s.values())


# ---------------------------------------------------------------- the systems


def _torch_step(forward, backward, update):
    def step(batch):
        logits = forward(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        backward(loss)
        update()
        return loss.detach()  # this rank's: no collective a torch user would not issue

    return step


def _count_here(step: Callable, batch: torch.Tensor) -> int:
    """One step's traffic, counted on the timed ``step`` itself (it trains that step as the others do)."""
    with counting() as c:
        step(batch)
    return c.bytes


def _count_on_twin(make: Callable[[], System], step: Callable, batch: torch.Tensor) -> int:
    """One step's traffic, counted on a second instance ``make()``; then one step of the timed ``step``."""
    twin = make()
    twin.step(batch)  # the first step may set things up (FSDP2's lazy initialisation)
    with counting() as c:
        twin.step(batch)
    step(batch)  # the timed instance trains as many steps as the others
    return c.bytes


def fully_sharded(model: GPT) -> torch.nn.Module:
    """``model`` under torch FSDP2 as the benchmark runs it: ``fully_shard`` on every block, then on the root,
    over a 1-D CPU mesh of the world."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _torch(
    kind: str,
    cfg: GPTConfig,
    bucket_bytes: int,
    batch_per_rank: int = 0,
    adamw: AdamWConfig = AdamWConfig(),
    *,
    counted: bool = False,
) -> System:
    """torch DDP (``"ddp"``), ZeroRedundancyOptimizer (``"zero"``), FSDP2 (``"fsdp2"``), or DDP with checkpoint."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.checkpoint import checkpoint

    C.ensure_initialized()
    torch.manual_seed(0)
    model = GPT(cfg)
    if kind == "checkpoint":  # every block's activations recomputed in backward, as zerofn's remat does
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    if kind == "fsdp2":
        wrapped = fully_sharded(model)
    else:
        wrapped = DistributedDataParallel(model, bucket_cap_mb=bucket_bytes / 2**20)
        if counted:  # torch's own all-reduce hook: the same reduction, issued through dist.all_reduce
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            wrapped.register_comm_hook(None, allreduce_hook)
    if kind == "zero":
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, **adamw.torch_kwargs())
    else:
        opt = torch.optim.AdamW(model.parameters(), **adamw.torch_kwargs(), foreach=True)

    def update():
        opt.step()
        opt.zero_grad(set_to_none=True)

    step = _torch_step(wrapped, lambda loss: loss.backward(), update)
    twin = functools.partial(_torch, kind, cfg, bucket_bytes, batch_per_rank, adamw, counted=True)
    return System(
        step=step,
        state=lambda: {"params": _storage_bytes(model.parameters()), "optimizer": _optimizer_state_bytes(opt)},
        count=functools.partial(_count_on_twin, twin, step),
    )


def deepspeed_config(stage: int, bucket_bytes: int, batch_per_rank: int, adamw: AdamWConfig) -> dict[str, Any]:
    """The DeepSpeed config of the benchmark's ZeRO ``stage``: fp32, DeepSpeed's AdamW with ``adamw``'s
    hyper-parameters, and no gradient clipping, as every other system.

    DeepSpeed clips the global gradient norm to ``gradient_clipping``, 1.0 when the config leaves it
    out (``GRADIENT_CLIPPING_DEFAULT`` in ``deepspeed/runtime/constants.py``); the config sets it to 0.

    ZeRO-3 replaces ``torch.nn.functional.linear`` for the whole process with its own autograd function
    (``zero_optimization.memory_efficient_linear``, on by default; DeepSpeed says it "will persist unless
    manually reset"). Every system in the benchmark's ranks would then run DeepSpeed's linear in its timed
    steps, and the systems built after it would reach another loss; the config turns it off, so every system,
    DeepSpeed's included, runs torch's linear.

    Example:
        >>> c = deepspeed_config(1, 2**20, 8, AdamWConfig())
        >>> c["gradient_clipping"], c["optimizer"]["params"]["weight_decay"]
        (0.0, 0.1)
        >>> deepspeed_config(3, 2**20, 8, AdamWConfig())["zero_optimization"]["memory_efficient_linear"]
        False
    """
    zero: dict[str, Any] = {"stage": stage, "reduce_bucket_size": bucket_bytes // 4}
    if stage == 3:
        zero["memory_efficient_linear"] = False  # it would replace torch's linear for every system
    return {
        "train_micro_batch_size_per_gpu": batch_per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": adamw.lr,
                "betas": list(adamw.betas),
                "eps": adamw.eps,
                "weight_decay": adamw.weight_decay,
            },
        },
        "steps_per_print": 10**9,
    }


def _deepspeed(
    stage: int, cfg: GPTConfig, bucket_bytes: int, batch_per_rank: int, adamw: AdamWConfig = AdamWConfig()
) -> System:
    """DeepSpeed ZeRO ``stage`` in fp32 with its AdamW, on the process group the ranks already have."""
    import deepspeed

    C.ensure_initialized()
    torch.manual_seed(0)
    model = GPT(cfg)
    config = deepspeed_config(stage, bucket_bytes, batch_per_rank, adamw)
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    step = _torch_step(engine, engine.backward, engine.step)
    return System(
        step=step,
        state=lambda: {"params": _storage_bytes(model.parameters()), "optimizer": _optimizer_state_bytes(opt)},
        # Counted on the timed engine itself (its collectives pass through torch.distributed's functions):
        # no second DeepSpeed engine, with its own buffers and communication set-up, in the process.
        count=functools.partial(_count_here, step),
    )


def composition_name(stage: str, *, amp: bool = False, offload: bool = False, remat: bool = False) -> str:
    """The name of a zerofn composition, written as the expression that builds it."""
    name = stage if stage == "train_step" else f"{stage}(train_step)"
    if amp:
        name = f"amp({name}, bf16)"
    if offload:
        name = f'offload({name}, "cpu")'
    if remat:
        name = f"remat({name})"
    return name


def _compose(stage: str, amp: bool, offload: bool, remat: bool) -> Callable:
    from zerofn import transforms

    def compose(step):
        if stage != "train_step":
            step = getattr(transforms, stage)(step)
        if amp:
            step = transforms.amp(step, torch.bfloat16)
        if offload:
            step = transforms.offload(step, "cpu")
        return transforms.remat(step) if remat else step

    return compose


def _zerofn(
    compose: Callable, cfg: GPTConfig, bucket_bytes: int, batch_per_rank: int = 0, adamw: AdamWConfig = AdamWConfig()
) -> System:
    torch.manual_seed(0)
    apply = zf.functional(GPT(cfg))
    optimizer = zf.optim.adamw(**adamw.torch_kwargs())
    step = compose(zf.train_step(loss_fn_for(apply), optimizer, bucket_bytes=bucket_bytes))
    box = [step.init(apply.params)]

    def run(batch):
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    def count(batch):
        box[0], metrics = step(box[0], batch)
        return metrics["comm_bytes"]

    def state():
        held = zf.memory.state_bytes(box[0])
        return {"params": held["params"], "optimizer": held["optimizer"]}

    return System(step=run, state=state, count=count)


# name -> builder(cfg, bucket_bytes, batch_per_rank, adamw) -> System
SYSTEMS: dict[str, Callable[[GPTConfig, int, int, AdamWConfig], System]] = {
    DDP: functools.partial(_torch, "ddp"),
    ZERO: functools.partial(_torch, "zero"),
    FSDP2: functools.partial(_torch, "fsdp2"),
    DDP_CHECKPOINT: functools.partial(_torch, "checkpoint"),
    **{name: functools.partial(_deepspeed, stage) for stage, name in enumerate(DEEPSPEED, start=1)},
    **{
        composition_name(stage, amp=a, offload=o, remat=r): functools.partial(_zerofn, _compose(stage, a, o, r))
        for stage, a, o, r in itertools.product(STAGES, (False, True), (False, True), (False, True))
    },
}


def deepspeed_installed() -> bool:
    """Whether ``deepspeed`` can be found (importing it may still fail; the ranks find out)."""
    return importlib.util.find_spec("deepspeed") is not None


# What ``--all`` runs: the torch peers, every zerofn stage in fp32 and under amp(bf16), the
# optimizer state offloaded to CPU RAM, and ZeRO-3 with activation checkpointing.
ALL = (
    DDP,
    ZERO,
    FSDP2,
    *(composition_name(s) for s in STAGES),
    *(composition_name(s, amp=True) for s in STAGES),
    composition_name("shard_optimizer", offload=True),
    composition_name("shard_params", remat=True),
)


def build(
    name: str, cfg: GPTConfig, bucket_bytes: int, batch_per_rank: int, adamw: AdamWConfig = AdamWConfig()
) -> System:
    """Build the system ``name`` (a key of ``SYSTEMS``) in this rank, training with ``adamw``."""
    try:
        make = SYSTEMS[name]
    except KeyError:
        raise ValueError(f"unknown system {name!r}; the systems are: {', '.join(SYSTEMS)}") from None
    return make(cfg, bucket_bytes, batch_per_rank, adamw)
