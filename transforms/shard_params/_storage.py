"""The storage part of a ``shard_params`` step (:class:`UnitStorage`): the state's parameter shards at
rest (on the device, in host memory or in files), built unit by unit at init, and gathered per unit by a
:class:`~zerofn.transforms.shard_params._runner.Runner` around the model's calls; and the held state of
a :func:`~zerofn.transforms.shard_params.gathered` block (:class:`HeldWhole`), whose forwards run on the
whole parameters gathered once."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from zerofn.transforms._param_files import ShardFiles
from zerofn.transforms._units import ROOT, Materialiser, Unit, assign_units, unit_buckets, unit_names
from zerofn.transforms.shard_params._runner import ORDER, Runner

from zerofn import alloc, counters
from zerofn import collectives as C
from zerofn import tree as T
from zerofn._io import FileTensor
from zerofn.functional import ACTIVE_RUN, Functional
from zerofn.reduction import GradSink, bucket_rank
from zerofn.state import Bucket, Layout, TrainState
from zerofn.storage import Held, ParamSplit, Storage, to_host, whole_params


@dataclass(frozen=True)
class HeldWhole:
    """A state's units, every one gathered, for :func:`gathered`'s block: the model's params tree on them."""

    state: TrainState
    functional: Functional
    params: Any


# The block of gathered(...) now running, if any: its state's forwards run on HELD_WHOLE.get().params.
HELD_WHOLE: contextvars.ContextVar = contextvars.ContextVar("zerofn_shard_params_held", default=None)


@dataclass(frozen=True)
class UnitStorage(Storage):
    """Parameter shards at rest, gathered per unit around the module's calls (see the package docs)."""

    units: Any = None

    @property
    def gathers_units(self) -> bool:
        return True

    prefetch: int = 1
    init_fn: Any = None
    gather_dtype: str | None = None  # "int8": qwZ, the gathers block-quantized
    hpz: int | None = None  # hpZ: ranks a node, within which backward gathers from a secondary copy

    def init(self, split: ParamSplit, *, shards: int, bucket_bytes: int, model: Callable) -> Held:
        functional = model()
        named, trainable = split.named, split.trainable
        world, rank = C.world_size(), C.rank()
        names = unit_names(functional.module, self.units)
        unit_of = assign_units(functional, named, names)
        buckets: list[Bucket] = []
        frozen_buckets: list[Bucket] = []
        units: list[Unit] = []
        # Backward meets the last unit first and the root last: buckets in that order.
        for uname in list(reversed(names)) + [ROOT]:
            mine_t = {k: v for k, v in trainable.items() if unit_of[k] == uname}
            mine_f = {k: v for k, v in named.items() if unit_of[k] == uname and k not in trainable}
            tb = unit_buckets(mine_t, shards, split.labels, split.apart, split.cut, split.replicate)
            fb = unit_buckets(mine_f, shards, apart=split.apart, cut=split.cut, replicate=split.replicate)
            units.append(
                Unit(
                    uname,
                    tuple(range(len(buckets), len(buckets) + len(tb))),
                    tuple(range(len(frozen_buckets), len(frozen_buckets) + len(fb))),
                )
            )
            buckets.extend(tb)
            frozen_buckets.extend(fb)
        layout = Layout(
            tuple(buckets),
            tuple(named),
            tuple(k for k in named if k not in trainable),
            frozen_buckets=tuple(frozen_buckets),
            units=tuple(units),
        )
        fill = Materialiser(functional.module, named, self.init_fn).fill
        every = buckets + frozen_buckets
        shards: list = [None] * len(every)
        if self.param_placement == "nvme":  # shards at rest in files, each written as soon as it is filled
            files = ShardFiles(self.param_path, buckets, frozen_buckets, rank, world)
            fill(every, rank, done=lambda i, t: shards.__setitem__(i, files.store(i, t)))
            files.done()
        elif self.param_placement == "cpu":  # in host memory, each moved there as soon as it is filled
            pin = torch.cuda.is_available()
            fill(every, rank, done=lambda i, t: shards.__setitem__(i, _host_shard(t, every[i], rank, pin)))
        else:
            shards = fill(every, rank)
        flats, frozen = tuple(shards[: len(buckets)]), tuple(shards[len(buckets) :])
        return Held(flats, frozen, layout, {ORDER: counters.new_like(())})

    @contextlib.contextmanager
    def bind(self, state: TrainState, sink: GradSink, model: Callable, extra: dict):
        runner = self.runner(state, model(), sink)
        token = ACTIVE_RUN.set(runner)
        failed = False
        try:
            yield runner.placeholders()
        except BaseException:
            failed = True
            raise
        finally:
            ACTIVE_RUN.reset(token)
            runner.close(failed)
            if runner.forward_order:
                extra[ORDER] = counters.new_like(runner.record(failed))

    def runner(self, state: TrainState, functional: Functional, sink: GradSink | None = None) -> Runner:
        """A runner of ``state``'s units on ``functional``'s model; ``sink``: where the gradients go (None: a
        forward with no backward)."""
        return Runner(
            state,
            functional,
            self.prefetch,
            sink,
            self.param_placement != "device",
            self.gather_dtype,
            # hpZ needs a backward and more than one node (nodes are the mesh's dp_replicate)
            self.hpz is not None
            and sink is not None
            and any(a == "dp_replicate" and n > 1 for a, n, _ in state.spec.mesh),
        )

    def adopt(self, functional: Functional, state: TrainState, share: bool, updates_late: bool = False) -> None:
        functional.adopt({})  # the state holds shards: every parameter becomes a placeholder

    def opt_view(self, flat: torch.Tensor, bucket: Bucket, rank: int) -> torch.Tensor:
        return flat  # the state holds shards already

    def publish(self, flats: tuple, layout: Layout, rank: int, inflight: Any) -> None:
        return None  # updated in place, gathered when used

    def forward(self, state: TrainState, model: Callable, args: tuple, kwargs: dict) -> Any:
        held = HELD_WHOLE.get()
        if held is not None and held.state is state and held.functional is model():  # inside gathered(...)
            with torch.no_grad():
                return held.functional(held.params, *args, **kwargs)
        runner = self.runner(state, model())
        try:
            with torch.no_grad():
                return runner.run(args, kwargs)
        finally:
            runner.close()

    def full_params(self, state: TrainState, model: Callable, masters: tuple | None = None) -> Any:
        layout = state.spec.layout
        dtype = masters[0].dtype if masters else None
        frozen = (f.to(dtype) if dtype is not None and f.is_floating_point() else f for f in _resident(state.frozen))
        # One unit's buffer at a time (and a shard in a file read only when its bucket's turn comes).
        out = whole_params(_resident(masters or state.params), layout.buckets, to_device=True)
        out.update(whole_params(frozen, layout.frozen_buckets, to_device=True))
        return T.tree_unflatten(state.spec.treedef, [out[n] for n in layout.names])


def _host_shard(shard: torch.Tensor | None, bucket: Bucket, rank: int, pin: bool) -> torch.Tensor:
    """A filled shard in its own host buffer; None (nothing written: a state to be loaded into): a buffer."""
    if shard is not None:
        return to_host(shard, pin)
    lo, hi = bucket.shard_range(bucket_rank(bucket, rank))
    return alloc.zeros(hi - lo, dtype=bucket.dtype, device="cpu", pin_memory=pin)


def _resident(pieces: Any) -> Any:
    """``pieces`` with each shard that rests in a file read in, one at a time as they are taken."""
    return (p.read() if isinstance(p, FileTensor) else p for p in pieces)
