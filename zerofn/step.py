"""``zf.train_step`` and the Step protocol that transforms rewrite.

A Step is a pure function from the outside, ``step(state, batch) -> (state,
metrics)``, with ``step.init(params) -> state``. Inside, one call runs these
phases, and a transform replaces some of them (``Phases``):

1. ``layout``     group trainable parameters into flat buckets (at init).
2. ``opt_view``   what the optimizer updates: a bucket's buffer, or a slice.
3. forward and backward on ``torch.autograd`` over fresh leaves that view
   the buckets; a post-accumulate-grad hook copies each gradient into its
   bucket's gradient buffer and frees it.
4. ``reduce``     launched per bucket, in bucket order, as soon as backward
   has filled it (overlapping the rest of backward): all-reduce for the
   plain step (DDP semantics), reduce-scatter under ``shard_optimizer``.
5. gradient processing and the optimizer update, in place on the buffers
   the state owns (the input state is donated).
6. ``publish``    make updated parameters visible on every rank (nothing
   for the plain step, an all-gather per bucket when the update was
   sharded).

Collectives per step of the plain ``train_step`` on N > 1 ranks: one
all-reduce per bucket (2 x parameter bytes), plus two tiny ones (batch-shape
agreement, and loss / gradient norm / finiteness).

Example:
    >>> import torch, zerofn as zf
    >>> model = torch.nn.Linear(4, 1)
    >>> apply = zf.functional(model)
    >>> def loss_fn(params, batch):
    ...     return ((apply(params, batch["x"]) - batch["y"]) ** 2).mean()
    >>> step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    >>> state = step.init(apply.params)
    >>> batch = {"x": torch.ones(8, 4), "y": torch.zeros(8, 1)}
    >>> state, metrics = step(state, batch)
    >>> sorted(metrics)
    ['comm_bytes', 'grad_norm', 'loss', 'skipped']
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from zerofn import collectives as C
from zerofn import optim as O
from zerofn import tree as T
from zerofn.functional import Functional
from zerofn.state import Bucket, Layout, StateSpec, TrainState

__all__ = ["Phases", "Step", "train_step", "find_functional", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # torch DDP's default bucket_cap_mb

# Innermost first, for naming: the shard transforms, then amp, then offload.
_NAME_ORDER = {"shard_optimizer": 0, "shard_grads": 0, "shard_params": 0, "amp": 1, "offload": 2}


class Phases(NamedTuple):
    """The pieces of a step a transform may replace.

    Attributes:
        shards: world_size -> how many shards each bucket is split into.
        opt_view: (flat, bucket, rank) -> the tensor the optimizer updates.
        reduce: (grad_flat, bucket, rank, out) -> Handle whose wait() gives
            the reduced gradient matching ``opt_view`` (summed over ranks),
            written into ``out`` when it is not None.
        grads_replicated: True when every rank ends with the same reduced
            gradient (so one rank's norm is the global norm).
        publish: (flats, layout, rank) -> None; make the updated parameters
            whole on every rank.
        reduce_every_micro: reduce on every accumulation micro-step and carry
            the reduced partition (sharded gradients), instead of carrying
            full local sums and reducing once.
    """

    shards: Callable[[int], int]
    opt_view: Callable[[torch.Tensor, Bucket, int], torch.Tensor]
    reduce: Callable[[torch.Tensor, Bucket, int, torch.Tensor | None], C.Handle]
    grads_replicated: bool
    publish: Callable[[tuple, Layout, int], None]
    reduce_every_micro: bool = False
    # Whole-step overrides for transforms that change how parameters are held
    # (shard_params): init_state(step, params, named, trainable, treedef) ->
    # state; bind(step, state, sink) -> context manager yielding the params
    # tree loss_fn sees, alive through backward; full_params(step, state);
    # apply(step, state, args, kwargs).
    init_state: Callable | None = None
    bind: Callable | None = None
    full_params: Callable | None = None
    apply: Callable | None = None
    # Mixed precision (amp): parameters are held and used in param_dtype (the
    # forward runs under autocast to it), gradients are reduced in grad_dtype,
    # and new_loss_scale() -> pytree gives a fresh state's loss scale.
    param_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None
    new_loss_scale: Callable | None = None
    # (order, optimizer -> optimizer) wrappers, applied innermost-first by order.
    wrap_optimizer: tuple = ()
    # Parameter shards live in host memory and are copied in per unit (offload(params=True)).
    host_params: bool = False


def _replicated_reduce(grad: torch.Tensor, bucket: Bucket, rank: int, out: torch.Tensor | None) -> C.Handle:
    if out is not None:
        raise ValueError("a replicated (all-reduce) bucket is reduced in place; it takes no out tensor")
    return C.all_reduce(grad, "sum", async_op=True)


DDP_PHASES = Phases(
    shards=lambda world: 1,
    opt_view=lambda flat, bucket, rank: flat,
    reduce=_replicated_reduce,
    grads_replicated=True,
    publish=lambda flats, layout, rank: None,
)


@dataclass(frozen=True)
class Step:
    """A training step ``step(state, batch) -> (state, metrics)``; see module docs.

    Build one with :func:`train_step` and rewrite it with the transforms in
    ``zerofn.transforms``.
    """

    loss_fn: Callable
    optimizer: O.GradientTransformation
    accumulate_steps: int = 1
    donate: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    transforms: tuple[str, ...] = ()
    phases: Phases = DDP_PHASES

    # ------------------------------------------------------------ naming

    @property
    def name(self) -> str:
        """The chain, in a canonical order: transforms that commute name the same step either way."""
        out = "train_step"
        for t in sorted(self.transforms, key=lambda t: _NAME_ORDER.get(t, len(_NAME_ORDER))):
            out = f"{t}({out})"
        return out

    def __repr__(self) -> str:
        return f"<Step {self.name}, accumulate_steps={self.accumulate_steps}, donate={self.donate}>"

    def replace(self, **changes: Any) -> "Step":
        return dataclasses.replace(self, **changes)

    @property
    def effective_optimizer(self) -> O.GradientTransformation:
        """The user's optimizer inside the transforms' wrappers, innermost first whatever the
        order the transforms were applied in (amp's fp32 master weights, then offload's placement)."""
        opt = self.optimizer
        for _, wrap in sorted(self.phases.wrap_optimizer, key=lambda w: w[0]):
            opt = wrap(opt)
        return opt

    # ------------------------------------------------------------ init

    def init(self, params: Any) -> TrainState:
        """Build the state for ``params`` (a tree of tensors, e.g. ``apply.params``).

        Tensors with ``requires_grad=False`` (or a non-float dtype) are frozen:
        no gradient, no optimizer state.
        """
        named, trainable, treedef = self._split_params(params)
        dtype = self.phases.param_dtype
        if dtype is not None:  # parameters live (and run) in the low-precision dtype
            named = {k: _cast(v, dtype) for k, v in named.items()}
            trainable = {k: named[k] for k in trainable}
        if self.phases.host_params and self.phases.init_state is None:
            raise ValueError(
                f"{self.name}.init: offload(params=True) keeps parameter shards on the host and brings them in "
                "per unit, which needs shard_params: offload(shard_params(step), params=True)"
            )
        if self.phases.init_state is not None:
            return self.phases.init_state(self, params, named, trainable, treedef)
        frozen = {k: v.detach().clone() for k, v in named.items() if k not in trainable}
        layout = Layout.build(
            trainable,
            shards=self.phases.shards(C.world_size()),
            bucket_bytes=self.bucket_bytes,
            names=tuple(named),
            frozen=tuple(frozen),
        )
        flats = []
        for b in layout.buckets:
            flat = torch.zeros(b.padded, dtype=b.dtype, device=b.device)
            for s in b.slots:
                flat[s.offset : s.offset + s.numel].copy_(trainable[s.name].detach().reshape(-1))
            flats.append(flat)
        return self.make_state(tuple(flats), frozen, layout, treedef)

    def _split_params(self, params: Any) -> tuple[dict, dict, Any]:
        """name -> tensor for every leaf, the trainable ones in registration order, and the treedef."""
        paths, leaves, treedef = T.tree_flatten_with_path(params)
        if not leaves:
            raise ValueError(f"{self.name}.init: params holds no tensors; pass apply.params from zf.functional(model)")
        named: dict[str, torch.Tensor] = {}
        for path, leaf in zip(paths, leaves):
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{self.name}.init: params leaf {T.keystr(path)} is a {type(leaf).__name__}, expected a "
                    "torch.Tensor. Pass a tree of tensors such as apply.params."
                )
            named[T.keystr(path)] = leaf
        trainable = {k: v for k, v in named.items() if v.requires_grad and v.is_floating_point()}
        if isinstance(params, dict):
            # Flattening sorts dict keys ("layers.10" before "layers.2"); buckets follow
            # registration order instead, which is the reverse of backward's.
            position = {T.keystr((k,)): i for i, k in enumerate(params)}
            trainable = dict(sorted(trainable.items(), key=lambda kv: position.get(kv[0], -1)))
        return named, trainable, treedef

    def make_state(self, flats: tuple, frozen: Any, layout: Layout, treedef: Any, context: Any = None) -> TrainState:
        """A fresh TrainState around parameter buffers laid out by ``layout`` (for transforms' init)."""
        world, rank = C.world_size(), C.rank()
        opt_state = self.effective_optimizer.init(self._opt_params(flats, layout, rank))
        return TrainState(
            params=flats,
            frozen=frozen,
            opt_state=opt_state,
            count=torch.zeros((), dtype=torch.int64),
            micro=torch.zeros((), dtype=torch.int64),
            grad_accum=None,
            loss_scale=self.phases.new_loss_scale() if self.phases.new_loss_scale else None,
            spec=StateSpec(self.name, world, layout, treedef, context),
        )

    def _opt_params(self, flats, layout: Layout, rank: int) -> dict[str, torch.Tensor]:
        return {f"b{i}": self.phases.opt_view(f, b, rank) for i, (f, b) in enumerate(zip(flats, layout.buckets))}

    # ------------------------------------------------------------ views

    def full_params(self, state: TrainState) -> Any:
        """The full parameters (a new tree shaped like the ``init`` input) on every rank."""
        self._check_state(state)
        if self.phases.full_params is not None:
            return self.phases.full_params(self, state)
        return self._params_tree(state, lambda t: t.detach().clone())

    def apply(self, state: TrainState, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on the current parameters, without gradients (evaluation, generation).

        Under ``shard_params`` it gathers one unit at a time, so it runs models
        larger than one rank; otherwise it calls the model found through
        ``zf.functional`` with ``full_params``-free views of the state.
        """
        self._check_state(state)
        with self._autocast(state.spec.layout):
            if self.phases.apply is not None:
                return self.phases.apply(self, state, args, kwargs)
            functional = find_functional(self.loss_fn)
            with torch.no_grad():
                return functional(self._params_tree(state, lambda t: t), *args, **kwargs)

    def _params_tree(self, state: TrainState, trainable_fn: Callable) -> Any:
        views = state.spec.layout.views(state.params)
        leaves = [
            trainable_fn(views[name]) if name in views else state.frozen[name] for name in state.spec.layout.names
        ]
        return T.tree_unflatten(state.spec.treedef, leaves)

    # ------------------------------------------------------------ checks

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, TrainState):
            raise TypeError(
                f"{self.name}(state, batch): state is a {type(state).__name__}, expected the TrainState made by "
                f"this step's init: state = step.init(apply.params)"
            )
        spec = state.spec  # raises DonatedStateError on a donated state
        world = C.world_size()
        if spec.chain != self.name or spec.world_size != world:
            raise ValueError(
                f"{self.name}(state, batch): state was made by {spec.chain} on world size {spec.world_size}, "
                f"but this step is {self.name} on world size {world}. Build the state with this step's init: "
                f"state = step.init(params), or carry the parameters over: "
                f"state = step.init(other_step.full_params(old_state))."
            )

    def _check_batch(self, batch: Any) -> None:
        """All ranks must feed batches of one structure, shapes and dtypes."""
        if C.world_size() == 1:
            return
        digest = T.treespec_digest(batch) & ((1 << 52) - 1)
        probe = torch.tensor([digest, -digest], dtype=torch.int64)
        C.all_reduce(probe, "max")
        if int(probe[0]) == -int(probe[1]):
            return
        shapes = T.tree_map(T.describe_leaf, batch)
        everyone = C.gather_objects(shapes)
        lines = "\n".join(f"  rank {r}: {s}" for r, s in enumerate(everyone))
        raise ValueError(
            f"{self.name}(state, batch): ranks fed batches of different shapes or structure "
            f"(world size {C.world_size()}); every rank must feed a micro-batch of the same shapes:\n{lines}\n"
            "Drop or pad the last partial batch (for example DataLoader(..., drop_last=True))."
        )

    # ------------------------------------------------------------ the step

    def __call__(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        self._check_state(state)
        with C.counting() as counter:
            self._check_batch(batch)
            if not self.donate:
                state = T.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)
            new_state, metrics = self._run(state, batch)
        metrics["comm_bytes"] = counter.bytes
        if self.donate:
            state._donate()
        return new_state, metrics

    def _run(self, state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        spec = state.spec
        layout = spec.layout
        world, rank = spec.world_size, C.rank()
        phases = self.phases
        k = self.accumulate_steps
        last = int(state.micro) + 1 == k
        # Between micro-steps a state carries either full local gradient sums
        # (reduced once, on the last micro-step) or, when gradients are sharded,
        # this rank's reduced partition (reduced on every micro-step).
        reduce_now = last or phases.reduce_every_micro
        carried = state.grad_accum
        if phases.reduce_every_micro:
            sink = _GradSink(layout, phases, rank, None, reduce_now, reduced_sums=carried)
        else:
            sink = _GradSink(layout, phases, rank, carried, reduce_now)

        bind = phases.bind or _bind_views
        scale = float(state.loss_scale.scale) if state.loss_scale is not None else 1.0
        with bind(self, state, sink) as params:
            with self._autocast(layout):
                out = self.loss_fn(params, batch)
            loss, aux = self._split_loss(out)
            loss = loss.float()
            if loss.requires_grad:
                (loss * scale if scale != 1.0 else loss).backward()
            del params, out

        if not reduce_now:
            stats = self._stats(loss.detach(), aux, None, world, rank)
            new = state.replace(grad_accum=sink.full_buffers(), micro=state.micro + 1)
            return new, self._metrics(stats, aux, skipped=False, grad_norm=math.nan, loss_scale=state.loss_scale)

        reduced = sink.finish()
        if not last:
            stats = self._stats(loss.detach(), aux, None, world, rank)
            new = state.replace(grad_accum=tuple(reduced.values()), micro=state.micro + 1)
            return new, self._metrics(stats, aux, skipped=False, grad_norm=math.nan, loss_scale=state.loss_scale)

        if phases.param_dtype is not None:  # the optimizer works in fp32 (the master weights)
            reduced = {k: v.float() for k, v in reduced.items()}
        # Average over ranks and micro-steps and undo the loss scale: one fused multiply.
        factors = [d / (world * k * scale) for d in sink.predivide]
        torch._foreach_mul_(list(reduced.values()), factors)
        stats = self._stats(loss.detach(), aux, reduced, world, rank)
        grad_norm = math.sqrt(stats["sumsq"]) if stats["sumsq"] >= 0 else math.nan
        finite = math.isfinite(stats["loss"]) and math.isfinite(stats["sumsq"])
        zero = torch.zeros((), dtype=torch.int64)
        loss_scale = state.loss_scale.adjust(finite) if state.loss_scale is not None else None
        if not finite:
            new = state.replace(grad_accum=None, micro=zero, loss_scale=loss_scale)
            return new, self._metrics(stats, aux, skipped=True, grad_norm=grad_norm, loss_scale=loss_scale)

        opt_params = self._opt_params(state.params, layout, rank)
        with torch.no_grad():
            opt_state = O.update_params(
                self.effective_optimizer, reduced, state.opt_state, opt_params, grad_norm=torch.tensor(grad_norm)
            )
            del reduced
            phases.publish(state.params, layout, rank)
        new = state.replace(
            opt_state=opt_state, count=state.count + 1, micro=zero, grad_accum=None, loss_scale=loss_scale
        )
        return new, self._metrics(stats, aux, skipped=False, grad_norm=grad_norm, loss_scale=loss_scale)

    # ------------------------------------------------------------ helpers

    def _split_loss(self, out: Any) -> tuple[torch.Tensor, dict]:
        aux: dict = {}
        if isinstance(out, tuple):
            if len(out) != 2 or not isinstance(out[1], dict):
                raise TypeError(
                    f"{self.name}: loss_fn returned a tuple of {len(out)} items; expected a scalar loss "
                    "or (loss, aux_dict)"
                )
            out, aux = out
        if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
            got = (
                f"a tensor of shape {list(out.shape)} and dtype {out.dtype}"
                if isinstance(out, torch.Tensor)
                else f"a {type(out).__name__}"
            )
            raise ValueError(
                f"{self.name}: loss_fn must return a scalar (0-dim) floating-point tensor, got {got}. "
                "Reduce it first, for example return loss.mean()."
            )
        return out, aux

    def _stats(self, loss, aux, reduced, world, rank) -> dict[str, float]:
        """One small all-reduce: loss (mean over ranks), gradient sum of squares, scalar aux values."""
        scalars = {k: v for k, v in sorted(aux.items()) if _is_scalar(v)}
        if reduced is None:
            sumsq = torch.zeros((), dtype=torch.float64)
        elif self.phases.grads_replicated and rank != 0:
            sumsq = torch.zeros((), dtype=torch.float64)
        else:
            norms = torch._foreach_norm(list(reduced.values())) if reduced else []
            sumsq = sum((n.double() ** 2 for n in norms), torch.zeros((), dtype=torch.float64))
        vec = torch.stack(
            [loss.double().cpu(), sumsq.cpu()] + [torch.as_tensor(v, dtype=torch.float64).cpu() for v in scalars.values()]
        )
        C.all_reduce(vec, "sum")
        vals = vec.tolist()
        out = {"loss": vals[0] / world, "sumsq": vals[1]}
        out["aux"] = {k: v / world for k, v in zip(scalars, vals[2:])}
        return out

    def _autocast(self, layout: Layout):
        dtype = self.phases.param_dtype
        if dtype is None:
            return contextlib.nullcontext()
        device = layout.buckets[0].device if layout.buckets else "cpu"
        return torch.autocast(device_type=torch.device(device).type, dtype=dtype)

    def _metrics(self, stats, aux, *, skipped: bool, grad_norm: float, loss_scale: Any = None) -> dict[str, Any]:
        m: dict[str, Any] = {
            "loss": torch.tensor(stats["loss"], dtype=torch.float32),
            "grad_norm": torch.tensor(grad_norm, dtype=torch.float32),
            "skipped": skipped,
        }
        if loss_scale is not None:
            m["loss_scale"] = torch.tensor(float(loss_scale.scale), dtype=torch.float32)
            m["consecutive_skips"] = int(loss_scale.skips)
        for k, v in aux.items():
            m[k] = torch.tensor(stats["aux"][k], dtype=torch.float32) if k in stats["aux"] else v
        return m


class _GradSink:
    """Gradient buckets that backward fills and that are reduced as they complete.

    A bucket's buffer is allocated when its first gradient arrives. When
    ``reduce`` is set, a completed bucket is reduced at once, in bucket order
    (so every rank issues the same collectives in the same order), while
    backward goes on. A sharded reduction writes a new partition-sized
    tensor, so its full bucket is dropped as soon as it lands; at most one
    such reduction is in flight, which bounds the full-size gradient memory
    to two buckets (the one in flight and the one filling) plus the
    gradient autograd is handing over.
    """

    def __init__(self, layout: Layout, phases: Phases, rank: int, carried, reduce: bool, reduced_sums=None):
        n = len(layout.buckets)
        # Reduced partitions from earlier micro-steps, which each reduction updates
        # in place: only one partition is ever alive.
        self.sums = list(reduced_sums) if reduced_sums is not None else None
        self.layout, self.phases, self.rank, self.reduce = layout, phases, rank, reduce
        self.buffers: list[torch.Tensor | None] = list(carried) if carried is not None else [None] * n
        self.views: dict[str, torch.Tensor] = {}
        self.where = {s.name: i for i, b in enumerate(layout.buckets) for s in b.slots}
        self.remaining = [len(b.slots) for b in layout.buckets]
        self.handles: list[C.Handle | None] = [None] * n
        self.results: list[torch.Tensor | None] = [None] * n
        self.launched = 0
        self.release = not phases.grads_replicated
        # fp16 gradients are divided by the world size before the reduction, so that
        # summing N ranks' scaled gradients does not overflow fp16's range.
        world = C.world_size()
        self.predivide = [
            world if (phases.grad_dtype or b.dtype) == torch.float16 else 1 for b in layout.buckets
        ]

    def buffer(self, i: int) -> torch.Tensor:
        buf = self.buffers[i]
        if buf is None:
            b = self.layout.buckets[i]
            dtype = self.phases.grad_dtype or b.dtype
            buf = self.buffers[i] = torch.zeros(b.padded, dtype=dtype, device=b.device)
        if self.layout.buckets[i].slots[0].name not in self.views:
            self.views.update(self.layout.bucket_views(i, buf))
        return buf

    def hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def on_grad(leaf: torch.Tensor) -> None:
            i = self.where[name]
            self.buffer(i)
            view = self.views[name]
            view.add_(leaf.grad.reshape(view.shape))
            leaf.grad = None
            self.remaining[i] -= 1
            if self.reduce and self.remaining[i] == 0:
                j = self.launched
                while j < len(self.remaining) and self.remaining[j] == 0:
                    j += 1
                self._launch_upto(j)

        return on_grad

    def _launch_upto(self, upto: int) -> None:
        while self.launched < upto:
            i = self.launched
            if self.release and i > 0:
                self._settle(i - 1)
            bucket, out = self.layout.buckets[i], None
            if self.predivide[i] != 1:
                self.buffer(i).mul_(1.0 / self.predivide[i])
            if self.sums is not None:
                # Fold the running sum into this rank's own slice of the input: the
                # reduction then lands the new total in place, with no temporary.
                lo, hi = bucket.shard_range(self.rank)
                self.buffer(i)[lo:hi].add_(self.sums[i])
                out = self.sums[i]
            self.handles[i] = self.phases.reduce(self.buffer(i), bucket, self.rank, out)
            self.launched += 1

    def _settle(self, i: int) -> None:
        if self.results[i] is None and self.handles[i] is not None:
            self.results[i] = self.handles[i].wait()
            self.handles[i] = None
            if self.release:
                self.buffers[i] = None
                for s in self.layout.buckets[i].slots:
                    self.views.pop(s.name, None)

    def finish(self) -> dict[str, torch.Tensor]:
        """Reduce what is left (a bucket with an unused parameter keeps zeros there); return every result."""
        self._launch_upto(len(self.layout.buckets))
        for i in range(len(self.layout.buckets)):
            self._settle(i)
        out = {f"b{i}": r for i, r in enumerate(self.results)}
        self.results = []  # the caller owns them now: they die when it lets go
        return out

    def full_buffers(self) -> tuple[torch.Tensor, ...]:
        return tuple(self.buffer(i) for i in range(len(self.layout.buckets)))


@contextlib.contextmanager
def _bind_views(step: "Step", state: TrainState, sink: "_GradSink"):
    """Fresh leaves viewing the full parameter buckets; each hook hands its gradient to the sink."""
    layout = state.spec.layout
    leaves: dict[str, torch.Tensor] = {}
    hooks = []
    for name, v in layout.views(state.params).items():
        leaf = v.detach().requires_grad_(True)
        hooks.append(leaf.register_post_accumulate_grad_hook(sink.hook(name)))
        leaves[name] = leaf
    tree_leaves = [leaves[n] if n in leaves else state.frozen[n] for n in layout.names]
    try:
        yield T.tree_unflatten(state.spec.treedef, tree_leaves)
    finally:
        for h in hooks:
            h.remove()


def find_functional(loss_fn: Callable) -> Functional:
    """The ``zf.functional`` apply that ``loss_fn`` calls (found in its closure or globals)."""
    found = _functionals_in(loss_fn, depth=2)
    if len(found) == 1:
        return found[0]
    what = "no zf.functional apply" if not found else f"{len(found)} different zf.functional applies"
    raise ValueError(
        f"could not find the model: loss_fn {getattr(loss_fn, '__qualname__', loss_fn)!r} refers to {what}. "
        "Write loss_fn to call apply = zf.functional(model), defined in the enclosing scope or at module level."
    )


def _functionals_in(fn: Any, depth: int) -> list:
    import inspect

    out: list = []
    try:
        cv = inspect.getclosurevars(fn)
    except TypeError:
        return out
    for v in list(cv.nonlocals.values()) + list(cv.globals.values()):
        if isinstance(v, Functional) and all(v is not o for o in out):
            out.append(v)
        elif depth > 0 and inspect.isfunction(v):
            out.extend(x for x in _functionals_in(v, depth - 1) if all(x is not o for o in out))
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if not t.is_floating_point() or t.dtype == dtype:
        return t
    return t.detach().to(dtype).requires_grad_(t.requires_grad)


def _is_scalar(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def train_step(
    loss_fn: Callable,
    optimizer: O.GradientTransformation,
    accumulate_steps: int = 1,
    *,
    donate: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Step:
    """Build a Step from a loss function and an optimizer.

    Args:
        loss_fn: ``loss_fn(params, batch)`` returning a scalar loss tensor or
            ``(loss, aux_dict)``; scalar aux values are averaged over ranks
            into the metrics.
        optimizer: a ``zf.optim`` GradientTransformation, e.g. ``zf.optim.adamw(3e-4)``.
        accumulate_steps: apply the update on every K-th call; the result
            equals one step on the K micro-batches concatenated.
        donate: reuse the input state's buffers for the new state (default);
            the input state then raises if used again. ``False`` copies it
            first and leaves it untouched.
        bucket_bytes: gradient bucket size for the reduction during backward.

    Returns:
        A :class:`Step`: ``state = step.init(params)``, ``state, metrics =
        step(state, batch)``, ``step.full_params(state)``. ``metrics`` has
        ``loss`` (mean over ranks), ``grad_norm`` (global, before clipping),
        ``comm_bytes`` (this rank's collective traffic), ``skipped`` (a
        non-finite loss or gradient: no update) and the aux values. Under N
        ranks gradients are averaged across ranks (DDP semantics).

    Raises:
        TypeError / ValueError: a non-callable loss_fn, a bad optimizer, or
            ``accumulate_steps`` < 1.
    """
    if not callable(loss_fn):
        raise TypeError(f"train_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
        raise TypeError(
            f"train_step: optimizer must be a zf.optim GradientTransformation (init, update), got "
            f"{type(optimizer).__name__}. For example zf.optim.adamw(lr=3e-4)."
        )
    if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise ValueError(f"train_step: accumulate_steps must be an int >= 1, got {accumulate_steps!r}")
    return Step(loss_fn, optimizer, accumulate_steps, donate, bucket_bytes)
