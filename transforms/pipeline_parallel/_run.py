"""One step's forward and backward under a pipeline: the micro-batches run by a schedule of
``torch.distributed.pipelining`` over this rank's stages, the gradients handed to the step's sink once every
micro-batch's backward has added to them, a weight tied across stages lent and its gradient returned, and
the loss (with ``loss_fn``'s scalar aux values) brought to every stage.

The stages and the schedule are made once per run and shape of micro-batch (kept in ``state.run``), as the
model's modules are: the first step infers the shapes the stages send (``PipelineStage``'s dynamic mode),
later ones reuse them.
"""

from __future__ import annotations

import contextlib
import functools
import time
import zlib
from typing import Any

import torch
from torch import nn
from zerofn.transforms.pipeline_parallel._cut import Stages, Stopped, assign, find_parts, patched

from zerofn import collectives as C
from zerofn import tree as T
from zerofn.functional import ACTIVE_RUN, PendingParams
from zerofn.losses import Mean

__all__ = ["SCHEDULES", "Runner", "local_stages", "stages_of"]

SCHEDULES = {
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zero_bubble": "ScheduleInterleavedZeroBubble",
}

_KEY = "pipeline_parallel"  # the state.run entry: what the run keeps


def local_stages(options: Any, mesh: Any) -> list[int]:
    """The stages this rank runs: ``r, r + p, r + 2 p, ...`` (``p`` pipeline ranks, ``r`` this one's
    coordinate), ``virtual_stages`` of them: the loop order of torch's interleaved schedules."""
    p, r = options.stages, mesh.coordinate("pp")
    return [r + k * p for k in range(options.virtual_stages)]


def stages_of(model: nn.Module, options: Any, where: str) -> Stages:
    """How ``model`` is cut for ``options`` (its parts found or given)."""
    parts = options.parts or find_parts(model)
    if parts is None:
        raise ValueError(
            f"{where}: cannot find where to cut {type(model).__name__} into stages: no module of it holds a "
            "ModuleList of blocks beside an input embedding and a final norm under the names pipeline_parallel "
            "knows (Llama's model.layers/embed_tokens/norm, GPT-2's transformer.h/wte/ln_f). Name its parts: "
            "pipeline_parallel(step, stages, microbatches=m, parts=Parts(blocks='body.blocks', "
            "embedding='body.embed', norm='body.final_norm', first=('body.pos',)))"
        )
    return assign(model, parts, options.stages * options.virtual_stages, options.split, where)


@functools.cache
def _stage_class() -> type:
    """``PipelineStage`` with the micro-batch told to its module, made on first use: importing
    ``torch.distributed.pipelining`` imports dynamo and DTensor (1.5 s), which no step without a pipeline needs."""
    from torch.distributed import pipelining

    class _Stage(pipelining.PipelineStage):
        """A stage that tells its module which micro-batch it runs (the module reads that micro-batch's other
        inputs: the token ids, masks and labels every stage is given)."""

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any):
            self.submod.chunk = fwd_chunk_id
            with self.submod.kept.busy():
                out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            runner = self.submod.kept.runner  # micro-batches whose activations this rank holds for backward
            runner.in_flight = max(runner.in_flight, sum(len(s.fwd_cache) for s in self.submod.kept.stages))
            return out

        def backward_one_chunk(self, *args: Any, **kwargs: Any):
            with self.submod.kept.busy():
                return super().backward_one_chunk(*args, **kwargs)

        def backward_weight_one_chunk(self, *args: Any, **kwargs: Any):
            with self.submod.kept.busy():
                return super().backward_weight_one_chunk(*args, **kwargs)

    return _Stage


class _Module(nn.Module):
    """What a stage runs: stage ``index`` of the model on the micro-batch the stage says (see
    :meth:`Runner.forward`); the parameters it trains are its own (``PipelineStage``'s weight gradients,
    zero bubble's, are taken over them)."""

    def __init__(self, kept: _Kept, index: int):
        super().__init__()
        self.kept, self.index, self.chunk = kept, index, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kept.runner.forward(self.index, self.chunk, x)

    def hold(self, leaves: list[torch.Tensor]) -> None:
        """Make ``leaves`` (this step's) the module's parameters."""
        self._parameters.clear()
        for i, leaf in enumerate(leaves):
            self._parameters[f"p{i}"] = leaf


class _Kept:
    """What a run keeps for one shape of micro-batch: its stages' modules, the stages and the schedule, and
    the runner of the step under way."""

    def __init__(self, runner: Runner, mine: list[int], stages: Stages, options: Any, mesh: Any, device: Any):
        self.runner = runner
        count = stages.count
        self.modules = [_Module(self, s) for s in mine]
        group = mesh.group("pp")
        from torch.distributed import pipelining

        made = [_stage_class()(m, s, count, device, group=group) for m, s in zip(self.modules, mine)]
        kind = getattr(pipelining, SCHEDULES[options.schedule])
        loss = self._loss
        if options.schedule == "1f1b":
            self.schedule = kind(made[0], options.microbatches, loss_fn=loss, scale_grads=False)
        else:
            self.schedule = kind(made, options.microbatches, loss_fn=loss, scale_grads=False)
        self.stages = made

    @contextlib.contextmanager
    def busy(self):
        """Count the time inside as this rank's work (forward, backward, the weights' gradient); the rest of
        the schedule's time it waited for its neighbours: the bubble."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.runner.busy += time.perf_counter() - start

    def _loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """The schedule's loss of a micro-batch: the last stage's output, scaled for backward."""
        return output * self.runner.factor


class _Sink:
    """The step's sink, reached once a parameter's gradient holds every micro-batch's part: on its
    ``micro``-th accumulation (1F1B's backward), or after the schedule for what is left (zero bubble's
    weight gradients, written without the hook; a tied weight, whose lent part comes back first)."""

    def __init__(self, sink: Any, micro: int, hold: set):
        self.inner, self.micro, self.hold = sink, micro, hold
        self.calls: dict[str, int] = {}
        self.sent: set = set()

    def leaf(self, name: str, view: torch.Tensor, then: Any = None) -> tuple[torch.Tensor, list]:
        """``GradSink.leaf``, its gradient hook through :meth:`take` (``shard_params``' leaves, made by its
        runner over the units' gathered buffers): a parameter's gradient accumulates in its leaf over the
        micro-batches. ``then(leaf)`` runs after every one of them."""
        leaf = view.detach().requires_grad_(True)
        hooks = [leaf.register_post_accumulate_grad_hook(C.with_current_group(lambda t: self.take(name, t)))]
        if then is not None:
            hooks.append(leaf.register_post_accumulate_grad_hook(C.with_current_group(then)))
        return leaf, hooks

    def take(self, name: str, leaf: torch.Tensor) -> None:
        n = self.calls[name] = self.calls.get(name, 0) + 1
        if n == self.micro and name not in self.hold:
            self.sent.add(name)
            self.inner.take(name, leaf)

    def rest(self, leaves: dict) -> None:
        """Hand over every gradient not handed over yet, in bucket order."""
        for name, leaf in leaves.items():
            if name not in self.sent and leaf.grad is not None:
                self.sent.add(name)
                self.inner.take(name, leaf)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Runner:
    """One step's forward and backward on this rank's stages (see the module); made by the extension's
    ``runs`` for each step."""

    def __init__(self, step: Any, state: Any, sink: Any, scale: Any, options: Any, mesh: Any):
        self.step, self.state, self.options, self.mesh = step, state, options, mesh
        self.scale = scale
        self.functional = step.model()
        entry = state.run.get(_KEY, dict)
        if "stages" not in entry:
            entry["stages"] = stages_of(self.functional.module, options, step.name)
        self.entry = entry
        self.plan: Stages = entry["stages"]
        self.mine = local_stages(options, mesh)
        self.last = self.plan.count - 1
        layout = state.spec.layout
        own = set(layout.names)
        self.lent = sorted(n for n in own if any(self.plan.owner[n] == s for s in self.mine) and self._readers_away(n))
        self.borrowed = sorted({n for s in self.mine for n in self.plan.borrowed(s)} - own)
        self.sink = _Sink(sink, options.microbatches, set(self.lent))
        self.factor: Any = 1.0
        self.records: dict = {}
        self.sent: dict[int, int] = {}  # stage -> bytes of the hidden states it sends per micro-batch
        self.received: dict[int, int] = {}  # stage -> bytes of the hidden states it receives per micro-batch

    def _readers_away(self, name: str) -> bool:
        """Whether a stage of another rank reads parameter ``name`` (a tied weight lent to it)."""
        p = self.options.stages
        here = self.mesh.coordinate("pp")
        return any(s % p != here for s in self.plan.readers[name])

    # ------------------------------------------------------------ the step's forward and backward

    def __call__(self, params: Any, batch: Any) -> Any:
        opts = self.options
        m = opts.microbatches
        self.micro = _microbatches(batch, m, self.step.name)
        leaves = _leaves(params)
        if isinstance(params, PendingParams):  # what is lent must be whole: its publish (ZeRO) waited for
            for name in self.lent:
                params.on_read(name)
        lent = self._lend(leaves)
        self.params = self._all_params(params, lent)
        self.sink.backward_started = True
        self.busy, self.idle, self.in_flight = 0.0, 0.0, 0
        if opts.stages == 1:  # every stage on this rank: the micro-batches one after another, no schedule
            self._in_turn()
        else:
            self._scheduled(leaves, lent)
        self._return(lent, leaves)
        self.sink.rest({n: leaves[n] for n in self._bucket_order() if n in leaves})
        self._account()
        return self._result()

    def _in_turn(self) -> None:
        """One rank runs every stage: each micro-batch's forward through them, then its backward."""
        self.in_flight = 1
        for chunk in range(self.options.microbatches):
            x = torch.zeros(())
            for s in self.mine:
                x = self.forward(s, chunk, x)
            (x * self.factor).backward()

    def _scheduled(self, leaves: dict, lent: dict) -> None:
        """The micro-batches through the stages by the schedule, this rank's part of it."""
        opts, plan, m = self.options, self.plan, self.options.microbatches
        key = tuple((tuple(t.shape), t.dtype) for t in T.tree_leaves(self.micro[0]) if isinstance(t, torch.Tensor))
        kept = self.entry.get(key)
        if kept is None:
            device = self.params_device()
            kept = self.entry[key] = _Kept(self, self.mine, plan, opts, self.mesh, device)
        kept.runner = self
        for module, s in zip(kept.modules, self.mine):
            module.hold(
                [leaves[n] for n in plan.names(s) if n in leaves] + [lent[n] for n in lent if s in plan.readers[n]]
            )
        index = torch.arange(m)
        args = (index,) if 0 in self.mine else ()
        target = index if self.last in self.mine else None
        self.busy, start = 0.0, time.perf_counter()
        try:
            kept.schedule.step(*args, target=target, return_outputs=False)
        finally:
            for module in kept.modules:
                module.hold([])
        self.idle = max(0.0, 1.0 - self.busy / max(time.perf_counter() - start, 1e-9))

    def forward(self, stage: int, chunk: int, x: torch.Tensor) -> torch.Tensor:
        """Stage ``stage`` on micro-batch ``chunk``: ``loss_fn`` with the model cut to the stage; a stage
        before the last returns the hidden states that reached the final norm, the last the loss."""
        batch = self.micro[chunk]
        for e in self.step.extensions:  # context parallelism's slice of the sequence, per micro-batch
            if e.feed is not None:
                batch = e.feed(batch)
        module = self.functional.module
        if stage > 0:
            self.received[stage] = x.numel() * x.element_size()
        with patched(module, self.plan, stage, None if stage == 0 else x):
            try:
                out = self.step.loss_fn(self.params, batch)
            except Stopped as stop:
                if stage == self.last:
                    raise
                self.sent[stage] = stop.hidden.numel() * stop.hidden.element_size()
                return stop.hidden
        if stage != self.last:
            raise ValueError(
                f"{self.step.name}: loss_fn returned on stage {stage} of {self.plan.count} without reaching the final "
                f"norm ({self.plan.parts.norm}), where a stage before the last ends. Name the module the blocks' "
                "output enters first: pipeline_parallel(..., parts=Parts(..., norm=...))"
            )
        return self._record(out, chunk)

    def _record(self, out: Any, chunk: int) -> torch.Tensor:
        """Keep the last stage's loss of micro-batch ``chunk`` (detached), its count and aux (once: the first
        step's shape inference runs the first micro-batch twice); return what backward starts from."""
        aux: dict = {}
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict):
            out, aux = out
        full = getattr(out, "full_tensor", None)  # tensor parallelism's loss over vocabulary-split logits
        if callable(full) and hasattr(out, "placements"):
            out = full()
        if isinstance(out, Mean):
            loss, count = out.total, out.counted(out.total.device)
            self.factor = self.scale
        else:
            if not isinstance(out, torch.Tensor) or out.dim() != 0 or not out.is_floating_point():
                raise ValueError(
                    f"{self.step.name}: loss_fn must return a scalar (0-dim) floating-point tensor, a zf.Mean or "
                    "(loss, aux_dict)"
                )
            loss, count = out, None
            self.factor = self.scale / self.options.microbatches
        self.records[chunk] = (loss.detach().float(), count, aux)
        return loss.float()

    # ------------------------------------------------------------ weights read by two stages

    def _lend(self, leaves: dict) -> dict:
        """Send the weights this rank holds that a stage of another rank reads; receive those it reads and
        another holds (a head tied to the input embedding), as leaves of their own."""
        run = ACTIVE_RUN.get()  # shard_params' runner: the units gathered for every micro-batch
        if run is not None:
            run.run_microbatches(self.options.microbatches, reshard=self.options.reshard_between_microbatches)
        if not self.lent and not self.borrowed:
            return {}
        p, group, handles = self.options.stages, self.mesh.group("pp"), []
        for name in self.lent:
            # under shard_params the leaf views its unit's buffer, gathered only while the unit runs
            value = run.whole(name) if run is not None else leaves[name].detach()
            for to in sorted({s % p for s in self.plan.readers[name]} - {self.mesh.coordinate("pp")}):
                handles.append(C.send(value, to, async_op=True, group=group))
        out = {}
        for name in self.borrowed:
            like = self.functional.params[name]
            dtype = self.step.precision.cast(torch.empty(0, dtype=like.dtype), self.functional.owner(name)).dtype
            device = self.params_device()
            buf = torch.empty(like.shape, dtype=dtype, device=device)
            handles.append(C.recv(buf, self.plan.owner[name] % p, async_op=True, group=group))
            out[name] = buf
        for h in handles:
            h.wait()
        return {n: t.requires_grad_(True) for n, t in out.items()}

    def _return(self, lent: dict, leaves: dict) -> None:
        """The lent weights' gradients back to their holder, added to its own (DeepSpeed's tied layers sum
        theirs the same way)."""
        if not self.lent and not self.borrowed:
            return
        p, group, handles, back = self.options.stages, self.mesh.group("pp"), [], []
        for name in self.borrowed:
            g = lent[name].grad
            g = torch.zeros_like(lent[name]) if g is None else g
            handles.append(C.send(g, self.plan.owner[name] % p, async_op=True, group=group))
        for name in self.lent:
            for frm in sorted({s % p for s in self.plan.readers[name]} - {self.mesh.coordinate("pp")}):
                buf = torch.empty_like(leaves[name])
                handles.append(C.recv(buf, frm, async_op=True, group=group))
                back.append((name, buf))
        for h in handles:
            h.wait()
        for name, g in back:
            leaf = leaves[name]
            leaf.grad = g if leaf.grad is None else leaf.grad.add_(g)

    # ------------------------------------------------------------ after the schedule

    def _bucket_order(self) -> list[str]:
        return [s.name for b in self.state.spec.layout.buckets for s in b.slots]

    def _account(self) -> None:
        """Count the hidden states and their gradients this rank's stages sent to another rank."""
        p, m, total = self.options.stages, self.options.microbatches, 0
        here = self.mesh.coordinate("pp")
        for s in self.mine:
            if s != self.last and (s + 1) % p != here:
                total += m * self.sent.get(s, 0)  # forward: the hidden states
            if s != 0 and (s - 1) % p != here:
                total += m * self.received.get(s, 0)  # backward: their gradient, as large
        C.account("pipeline", total, group=self.mesh.group("pp"))

    def _result(self) -> Any:
        """What ``loss_fn`` would have returned over the whole batch, on every stage alike: the last stage's
        micro-batch losses combined, with their scalar aux values, sent over the pipeline's ranks."""
        records, self.records = [self.records[k] for k in sorted(self.records)], {}
        structure = None
        if records:
            mean = records[0][1] is not None
            scalars = tuple(sorted(k for k, v in records[0][2].items() if _scalar(v)))
            structure = (mean, scalars)
        apart = self.options.stages > 1  # the last stage on another rank: its result sent over the pipeline
        group = self.mesh.group("pp") if apart else None
        known = self.entry.get("structure") if apart else structure
        if known is None:
            known = self.entry["structure"] = C.broadcast_object(
                structure, src=self.last % self.options.stages, group=group
            )
        mean, scalars = known
        dev = self.params_device()
        vec = torch.zeros(3 + len(scalars), dtype=torch.float64, device=dev)
        if records:
            losses = torch.stack([r[0].double() for r in records])
            if mean:
                vec[0] = losses.sum()
                vec[1] = torch.stack([r[1].double() for r in records]).sum()
            else:
                vec[0] = losses.mean()
            for j, k in enumerate(scalars):
                vals = [r[2][k] for r in records if k in r[2]]
                vec[2 + j] = torch.stack(
                    [torch.as_tensor(v, dtype=torch.float64, device=dev).reshape(()) for v in vals]
                ).mean()
            vec[-1] = _signature(structure)
        if apart:
            C.all_reduce(vec, "sum", group=group)
        if (self.last in self.mine and structure != known) or float(vec[-1]) != _signature(known):
            raise ValueError(
                f"{self.step.name}: loss_fn's result changed form between steps ({known} before); under "
                "pipeline_parallel every step's loss_fn returns the same kind of loss (a scalar or a zf.Mean) with "
                "the same scalar aux keys"
            )
        aux = {k: vec[2 + j].float() for j, k in enumerate(scalars)}
        aux["pipeline_idle"] = self.idle
        aux["pipeline_in_flight"] = self.in_flight
        if records:  # aux values that are not scalars stay on the last stage
            aux.update({k: v for k, v in records[-1][2].items() if k not in aux})
        loss = vec[0].float()
        out = Mean(loss, vec[1]) if mean else loss
        return out, aux

    def params_device(self) -> torch.device:
        b = self.state.spec.layout.buckets
        return torch.device(b[0].device if b else "cpu")

    def _all_params(self, params: Any, lent: dict) -> Any:
        """The params ``loss_fn`` is given on this rank: its stages' (and the weights lent to them), the
        placeholders of the parameters other ranks hold elsewhere (never read: their modules do not run)."""
        run = ACTIVE_RUN.get()
        if run is not None:  # shard_params' stand-ins, which gather unit by unit: as they are, with the lent
            run.lend(lent)
            return params
        held = self.functional.params
        rest = {n: t for n, t in held.items() if n not in params and n not in lent}
        if isinstance(params, PendingParams):
            mine = {n: params.peek(n) for n in dict.keys(params)}
            return PendingParams({**rest, **mine, **lent}, params.on_read)
        return {**rest, **dict(params), **lent}


def _leaves(params: Any) -> dict:
    """name -> the tensor the step bound for each trainable parameter (read without waiting); under
    ``shard_params`` its runner's leaves (``params`` are placeholders), which view the units' buffers."""
    run = ACTIVE_RUN.get()
    if run is not None:
        return {n: t for n, t in run.leaves.items() if t.requires_grad}
    if isinstance(params, PendingParams):
        return {n: params.peek(n) for n in dict.keys(params) if params.peek(n).requires_grad}
    return {n: t for n, t in params.items() if isinstance(t, torch.Tensor) and t.requires_grad}


def _microbatches(batch: Any, m: int, where: str) -> list:
    """``batch`` cut into ``m`` micro-batches along the first dimension of every tensor in it."""
    leaves, spec = T.tree_flatten(batch)
    rows = {t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(rows) != 1 or next(iter(rows)) % m:
        raise ValueError(
            f"{where}: pipeline_parallel cuts each batch into microbatches={m} along its first dimension; this "
            f"batch's tensors have {sorted(rows)} rows. Feed a batch whose rows divide by {m} (every tensor the "
            "same number of rows), or choose microbatches that divide them."
        )
    cut = [t.chunk(m, 0) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * m for t in leaves]
    return [T.tree_unflatten(spec, [c[i] for c in cut]) for i in range(m)]


def _scalar(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.numel() == 1
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _signature(structure: Any) -> float:
    """A number that differs between two forms of ``loss_fn``'s result (exact in float64)."""
    return float(zlib.crc32(repr(structure).encode()) % (1 << 24) + 1)
