"""Where a step's time goes: torch DDP and FSDP2 against zerofn's stages, phase by phase, on gloo ranks (2 unless --world says otherwise).

    python examples/bench_phases.py                       # the benchmark's v512 shape, 40 rounds
    python examples/bench_phases.py --shape v64 --rounds 20 --json phases.json
    python examples/bench_phases.py --world 1 --systems zf2 zf3 --dim 32 --layers 4 --seq-len 16 --batch 2 --steps 100 --rounds 7

It starts its ranks itself (``zf.spawn``); run it with plain ``python``. The
systems, built as ``python -m zerofn.bench`` builds them (the same GPT, batch
and AdamW; DDP with 25 MiB buckets and foreach AdamW), take turns in rounds:
each runs ``--steps`` consecutive steps with a barrier before and after the
loop only. Besides ``ddp`` and ``zf1`` (``shard_optimizer``) there are
``zf0`` (zerofn's plain step: an all-reduce instead of the reduce-scatter
and all-gather), ``ddp-nosync`` (DDP's backward under ``no_sync()``: no
all-reduce, so what the all-reduce costs DDP is the difference),
``ddp-fused`` (DDP with ``torch.optim.AdamW(fused=True)``, the kernel
zerofn's AdamW runs), ``torch`` (the model alone with that AdamW: no DDP, no
collective; at ``--world 1`` what a step costs beyond it is a system's own
overhead), ``zf2`` (``shard_grads``), ``zf3`` (``shard_params``)
and ``fsdp2`` (torch's ``fully_shard`` on every block and the root, phased
as DDP is: forward, backward with its reduce-scatters, optimizer step).
``shard_params``' own phases are its gathers (``Runner.gather``, the
launch; the waits are under ``wait for all_gather``) and its agreement
on the units (``Agreement.agree``, the launch of a 16-byte max-reduce, and
``Agreement.settled``, the wait for it).

zerofn's phases are timed by wrapping, from outside, the functions of the
step that do them, where the step's call looks them up (``zerofn.step._call``
and ``zerofn.step._checks``; any that a version of zerofn lacks is left out):
``check_batch`` (the batch-shape check, one small blocking all-reduce), the
forward (the ``loss_fn``), backward with the gradient sink's work in it (the
bucket buffer and the gradients written into it, the launch of each
reduction), the wait for the reductions after backward (``GradSink.finish``),
``unscale``, the statistics' all-reduce (the loss and gradient norm: its
launch, ``start_stats``, and the wait for it, ``_stats._read``; one blocking
``gather_stats`` in a zerofn before 2026-12-06), the update and the publish;
and every wait on a collective by its kind. Each phase has its wall time and
the CPU time of the rank's main thread (``time.thread_time``): on a shared
machine the CPU time moves far less than the wall time.

``--no-phases`` wraps and times nothing inside a step (the loops alone): a
step's own overhead at ``--world 1`` without the wrappers' share of it.
``--in-process`` (``--world 1`` only) runs the one rank in this process, its
gloo group initialised directly as under torchrun, instead of in a rank that
``zf.spawn`` starts: the same calls have timed differently in the two kinds
of process (docs/benchmarks.md).

Rounds in which other processes used more than ``--quiet`` of the
machine's CPU time (``/proc/stat`` less the ranks' own, in any system's
loop) are left out of the medians when at least 3 rounds remain; the script
says how many it kept.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import resource
import statistics
import time

import torch
import torch.nn.functional as F

import zerofn as zf
from zerofn import collectives as C
from zerofn.bench import SHAPES, Config
from zerofn.bench.gpt import GPT, MarkovCorpus, loss_fn_for

try:
    from zerofn.bench.harness import machine_busy
except ImportError:  # a zerofn from before the harness's reader: the script times older versions too

    def machine_busy() -> None:
        return None


from zerofn.bench.systems import fully_sharded

SYSTEMS = ("ddp", "zf1", "zf0", "ddp-nosync", "ddp-fused", "zf2", "zf3", "fsdp2", "torch")
WALL: dict[str, float] = collections.defaultdict(float)
CPU: dict[str, float] = collections.defaultdict(float)
CURRENT = ["zf1"]  # the system whose phases the wrappers are timing
PHASES = [True]  # False (--no-phases): nothing wrapped or timed inside a step, each system's loop alone


def _add(label: str, wall: float, cpu: float) -> None:
    WALL[f"{CURRENT[0]}: {label}"] += wall
    CPU[f"{CURRENT[0]}: {label}"] += cpu


def _timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(label, time.perf_counter() - t, time.thread_time() - c)

    return wrapper


def _wrap(owner, name: str, label: str) -> None:
    fn = getattr(owner, name, None)
    if fn is not None:
        setattr(owner, name, _timed(label, fn))


def _patch() -> None:
    from zerofn.transforms.shard_optimizer import ShardedReduction

    import zerofn.optim as O
    from zerofn import reduction, storage
    from zerofn.step import _call, _checks, _stats

    _wrap(_checks, "check_batch", "check_batch (batch-shape all-reduce, blocking)")
    _wrap(_call, "forward_backward", "forward + backward")
    _wrap(reduction.GradSink, "buffer", "  in backward: bucket buffer (pending gradients copied in, gaps zeroed)")
    _wrap(reduction.GradSink, "_add", "  in backward: gradient add_ into the bucket")
    _wrap(reduction.Reduction, "reduce", "  in backward: launch all-reduce")
    _wrap(ShardedReduction, "reduce", "  in backward: launch reduce-scatter")
    _wrap(reduction.GradSink, "finish", "wait for the reductions after backward")
    _wrap(_call, "unscale", "unscale + bucket norms")
    _wrap(_call, "gather_stats", "stats all-reduce (loss, gradient norm; blocking)")  # a zerofn before 2026-12-06
    _wrap(_call, "start_stats", "stats all-reduce (loss, gradient norm): launch")
    _wrap(_stats, "_read", "stats all-reduce: wait for it (blocking)")
    _wrap(O, "update_params", "update")
    _wrap(storage.Storage, "publish", "publish (launch the all-gathers)")
    from zerofn.transforms.shard_params._agreement import Agreement
    from zerofn.transforms.shard_params._runner import Runner

    _wrap(Runner, "gather", "  in forward and backward: launch a unit's all-gathers")
    _wrap(Agreement, "agree", "  in forward and backward: the units' agreement (launch)")
    _wrap(Agreement, "settled", "  in forward and backward: the units' agreement (wait)")
    wait = C.Handle.wait

    def timed_wait(self):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return wait(self)
        finally:
            kind = getattr(self, "_kind", getattr(self, "kind", "collective"))
            _add(f"  (inside the above) wait for {kind}", time.perf_counter() - t, time.thread_time() - c)

    C.Handle.wait = timed_wait


def _usage() -> tuple[float, int]:
    """This process's CPU seconds in the kernel (system calls: gloo's socket copies; page faults) and its
    minor page faults so far (memory the allocator took from the system afresh, zeroed by the kernel)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_stime, ru.ru_minflt


def _phases(prefix: str, parts) -> None:
    if not PHASES[0]:
        for _, fn in parts:
            fn()
        return
    for label, fn in parts:
        t, c = time.perf_counter(), time.thread_time()
        fn()
        WALL[f"{prefix}: {label}"] += time.perf_counter() - t
        CPU[f"{prefix}: {label}"] += time.thread_time() - c


def _ddp(cfg: Config, name: str):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = GPT(cfg.model())
    if name == "fsdp2":  # as python -m zerofn.bench runs it
        ddp = fully_sharded(model)
    elif name == "torch":  # the model alone: torch's own forward, backward and (fused) update, no collective
        ddp = model
    else:
        ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb)
    kind = {"fused": True} if name in ("ddp-fused", "torch") else {"foreach": True}
    opt = torch.optim.AdamW(model.parameters(), **cfg.adamw().torch_kwargs(), **kind)

    def backward(loss):
        if name == "ddp-nosync":
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()

    def step(batch):
        box = {}

        def forward():
            logits = ddp(batch[:, :-1])
            box["loss"] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

        _phases(
            name,
            [
                ("forward", forward),
                (
                    "backward (FSDP2's gathers and reduce-scatters inside)"
                    if name == "fsdp2"
                    else "backward"
                    if name == "torch"
                    else "backward (DDP's all-reduce inside)",
                    lambda: backward(box["loss"]),
                ),
                ("optimizer.step", opt.step),
                ("zero_grad", lambda: opt.zero_grad(set_to_none=True)),
            ],
        )

    return step


def _zerofn(cfg: Config, name: str):
    from zerofn.transforms import shard_grads, shard_optimizer, shard_params

    torch.manual_seed(0)
    apply = zf.functional(GPT(cfg.model()))
    loss_fn = loss_fn_for(apply)
    if PHASES[0]:
        loss_fn = _timed("  forward (inside forward + backward)", loss_fn)
    step = zf.train_step(loss_fn, zf.optim.adamw(**cfg.adamw().torch_kwargs()), bucket_bytes=int(cfg.bucket_mb * 2**20))
    step = {"zf1": shard_optimizer, "zf2": shard_grads, "zf3": shard_params}.get(name, lambda s: s)(step)
    box = [step.init(apply.params)]

    def run(batch):
        CURRENT[0] = name
        t, c = time.perf_counter(), time.thread_time()
        box[0], _ = step(box[0], batch)
        _add("step", time.perf_counter() - t, time.thread_time() - c)

    def bare(batch):
        box[0], _ = step(box[0], batch)

    return run if PHASES[0] else bare


def rank_fn(cfg: Config, names: list[str], phases: bool = True) -> dict:
    torch.set_num_threads(cfg.threads)
    PHASES[0] = phases
    if phases:
        _patch()
    rank, world = C.rank(), C.world_size()
    data = MarkovCorpus(vocab=cfg.vocab).sample(cfg.batch * world, cfg.seq_len + 1, seed=1)
    batch = data[rank * cfg.batch : (rank + 1) * cfg.batch]
    systems = {n: (_zerofn if n.startswith("zf") else _ddp)(cfg, n) for n in names}
    for run in systems.values():
        for _ in range(cfg.warmup):
            run(batch)
    out = {
        n: {"loop": [], "proc": [], "thread": [], "kernel": [], "faults": [], "busy": [], "phases": []} for n in systems
    }
    order = list(systems)
    for r in range(cfg.rounds):
        for n in order[r % len(order) :] + order[: r % len(order)]:
            WALL.clear()
            CPU.clear()
            C.barrier()
            t0, p0, b0, u0 = time.perf_counter(), time.process_time(), machine_busy(), _usage()
            c0 = time.thread_time()
            for _ in range(cfg.steps):
                systems[n](batch)
            c1 = time.thread_time()
            C.barrier()
            b1, u1 = machine_busy(), _usage()
            out[n]["thread"].append((c1 - c0) / cfg.steps)
            out[n]["loop"].append((time.perf_counter() - t0) / cfg.steps)
            out[n]["proc"].append((time.process_time() - p0) / cfg.steps)
            out[n]["kernel"].append((u1[0] - u0[0]) / cfg.steps)
            out[n]["faults"].append((u1[1] - u0[1]) / cfg.steps)
            out[n]["busy"].append(None if b0 is None or b1 is None else (b1 - b0) / cfg.steps)
            out[n]["phases"].append({k: (WALL[k] / cfg.steps, CPU[k] / cfg.steps) for k in WALL})
    return out


def _median(figures: dict, key: str, kept: list[int], scale: float = 1.0) -> float:
    return scale * statistics.median(figures[key][i] for i in kept)


def report(per_rank: list[dict], quiet: float) -> str:
    names = list(per_rank[0])
    rounds = len(per_rank[0][names[0]]["loop"])
    cores = os.cpu_count() or 1

    def others(n, i):
        busy = per_rank[0][n]["busy"][i]
        if busy is None:
            return 0.0
        wall = max(p[n]["loop"][i] for p in per_rank)
        return max(0.0, busy - sum(p[n]["proc"][i] for p in per_rank)) / (cores * wall)

    kept = [i for i in range(rounds) if all(others(n, i) <= quiet for n in names)]
    if len(kept) < 3:
        kept = list(range(rounds))
    loop = {n: [1e3 * max(p[n]["loop"][i] for p in per_rank) for i in kept] for n in names}
    ref = names[0]
    lines = [
        f"{len(kept)} of {rounds} rounds kept (other processes under {100 * quiet:.0f} % of the machine's CPU "
        "in every system's loop, or all rounds when fewer than 3 were)",
        "",
        f"{'system':<12}{'loop ms/step':>14}{'vs ' + ref:>10}{'min':>7}{'max':>7}   process CPU ms/step per rank "
        "(of it in the kernel; minor page faults per step)",
    ]
    for n in names:
        ratios = [a / b for a, b in zip(loop[n], loop[ref])]
        cpu = ", ".join(
            f"{_median(p[n], 'proc', kept, 1e3):.1f} ({_median(p[n], 'kernel', kept, 1e3):.1f}; "
            f"{_median(p[n], 'faults', kept):.0f})"
            for p in per_rank
        )
        lines.append(
            f"{n:<12}{statistics.median(loop[n]):>14.1f}{statistics.median(ratios):>10.3f}"
            f"{min(ratios):>7.3f}{max(ratios):>7.3f}   {cpu}"
        )
    lines += ["", "Main thread's CPU ms per step, each rank (over the torch system's, the model alone, where it ran):"]
    for n in names:
        cells = []
        for p in per_rank:
            mine = _median(p[n], "thread", kept, 1e3)
            over = f" ({mine - _median(p['torch'], 'thread', kept, 1e3):+.2f})" if "torch" in names else ""
            cells.append(f"{mine:.2f}{over}")
        lines.append(f"  {n:<12}" + ", ".join(cells))
    lines += ["", "Phases, ms per step, the median over the kept rounds: wall time (main thread's CPU time)"]
    for n in names:
        keys = sorted({k for p in per_rank for i in kept for k in p[n]["phases"][i]})
        for k in keys:
            cells = []
            for p in per_rank:
                wall = statistics.median(p[n]["phases"][i].get(k, (0.0, 0.0))[0] for i in kept)
                cpu = statistics.median(p[n]["phases"][i].get(k, (0.0, 0.0))[1] for i in kept)
                cells.append(f"{1e3 * wall:8.2f} ({1e3 * cpu:6.2f})")
            lines.append(f"  {k:<72}" + "   ".join(cells))
    return "\n".join(lines)


def _in_process(cfg: Config, names: list[str], phases: bool) -> dict:
    """:func:`rank_fn` as the only rank, in this process, over a gloo group of one made here."""
    import tempfile

    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
        try:
            return rank_fn(cfg, names, phases)
        finally:
            dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="v512")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS[:4]))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--steps", type=int, default=3, help="consecutive steps per system per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dim", type=int, help="model width (default: the shape's)")
    p.add_argument("--layers", type=int, help="blocks (default: the shape's)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the shape's)")
    p.add_argument("--batch", type=int, help="sequences per rank (default 8)")
    p.add_argument("--world", type=int, default=2, help="gloo ranks (default 2; 1 shows a step's own overhead alone)")
    p.add_argument("--bucket-mb", type=float, help="gradient bucket size of both, MiB (default: the benchmark's)")
    p.add_argument("--quiet", type=float, default=0.15, help="the largest share of the machine others may use")
    p.add_argument("--json", help="write every rank's figures here")
    p.add_argument(
        "--no-phases", action="store_true", help="time each system's loop alone: no phase wrapped or timed in a step"
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="--world 1 only: run the rank here, its gloo group initialised directly as torchrun leaves it",
    )
    args = p.parse_args(argv)
    if args.in_process and args.world != 1:
        p.error(f"--in-process runs one rank in this process, so it needs --world 1 (got --world {args.world})")
    sizes = dict(SHAPES[args.shape])
    for key in ("dim", "layers", "seq_len", "batch", "bucket_mb"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    cfg = Config(systems=(), rounds=args.rounds, steps=args.steps, warmup=args.warmup, world=args.world, **sizes)
    if args.in_process:
        per_rank = [_in_process(cfg, list(args.systems), not args.no_phases)]
    else:
        per_rank = zf.spawn(rank_fn, cfg.world, cfg, list(args.systems), not args.no_phases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(per_rank, f)
    print(f"GPT {cfg.parameters():,} parameters, {cfg.world} gloo ranks, batch {cfg.batch} x {cfg.seq_len} per rank")
    print(report(per_rank, args.quiet))


if __name__ == "__main__":
    main()
