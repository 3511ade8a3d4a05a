"""Run the systems on local gloo ranks and measure them: time, memory, traffic, loss.

:func:`run` starts ``Config.world`` ranks with ``zf.spawn``; each rank runs
:func:`bench_rank`, which builds every chosen system in turn (the same GPT
from the same seed, the same data), warms it up, measures the memory it holds
and allocates, counts one step's traffic, and then times all the systems in
rounds: each round runs ``steps`` steps of every system in turn (each round
starting from the next system), so that a machine that slows down for a
while slows them alike and the ratios between systems come from one run. :func:`run` gathers what the ranks measured into
one :class:`Measured` per system.

Memory is measured with ``zf.memory.track``, which counts every live tensor
storage made inside a block (on the CPU too); see :mod:`zerofn.memory`.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import zerofn as zf
from zerofn import collectives as C
from zerofn.bench.gpt import GPT, GPTConfig, MarkovCorpus
from zerofn.bench.systems import DDP, DEEPSPEED, SYSTEMS, build

__all__ = ["QUICK", "Config", "Measured", "Results", "bench_rank", "run"]


@dataclass(frozen=True)
class Config:
    """What to run and on what: the systems, the ranks, the model, the batch and the timing.

    Example:
        >>> Config(systems=("torch DDP",)).model().dim
        256
        >>> Config(systems=("torch DDP",), **QUICK).model().dim
        32
    """

    systems: tuple[str, ...]
    world: int = 2
    dim: int = 256
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    vocab: int = 64
    batch: int = 8  # sequences per rank
    steps: int = 5  # timed steps per system per round
    rounds: int = 6  # short rounds: a busy spell of the machine falls on every system alike
    warmup: int = 3
    threads: int = 1  # intra-op threads per rank
    bucket_mb: float = 25.0  # gradient bucket size of zerofn and DDP
    progress: bool = True  # progress bars on rank 0 (stderr)

    def model(self) -> GPTConfig:
        return GPTConfig(vocab=self.vocab, seq_len=self.seq_len, dim=self.dim, heads=self.heads, layers=self.layers)

    def parameters(self) -> int:
        """The model's parameter count (the tied embedding once)."""
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(self.model()).parameters())


# --quick: a tiny model and one short round, for CI and for trying the harness out.
QUICK = dict(dim=32, layers=2, heads=4, seq_len=16, batch=2, steps=2, rounds=1, warmup=1)


@dataclass
class Measured:
    """One system's figures. Bytes and times are per rank: the largest over the ranks.

    Attributes:
        name: the system.
        ms: the slowest rank's median step time, in milliseconds.
        ratio: ``ms`` over torch DDP's ``ms`` in the same run (None without DDP).
        params: parameter bytes held between steps.
        optimizer: optimizer-state bytes held between steps.
        held: every byte the system keeps between steps (measured).
        peak_in_step: the most bytes allocated at once during one step, beyond ``held``.
        traffic: collective bytes of one step, in the ZeRO paper's units.
        loss: the loss of the last timed step (mean over ranks).
    """

    name: str
    ms: float
    ratio: float | None
    params: int
    optimizer: int
    held: int
    peak_in_step: int
    traffic: int
    loss: float

    @property
    def peak(self) -> int:
        """The most bytes live at once during a step: what is held plus the step's own peak."""
        return self.held + self.peak_in_step

    @property
    def other_held(self) -> int:
        """Bytes held between steps besides parameters and optimizer state (DDP's gradient buckets)."""
        return max(0, self.held - self.params - self.optimizer)


@dataclass
class Results:
    config: Config
    systems: list[Measured]
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it did not run
    seconds: float = 0.0  # wall time of the whole run


def _try_build(name, make):
    """``make()``, or the error for a DeepSpeed system that cannot run here (agreed by all ranks)."""
    error, value = None, None
    try:
        value = make()
    except Exception as e:  # only a DeepSpeed system may fail to build (not installed, no accelerator)
        if name not in DEEPSPEED:
            raise
        error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    errors = [e for e in C.gather_objects(error) if e]
    return (None, errors[0]) if errors else (value, None)


def bench_rank(cfg: Config) -> tuple[dict[str, dict], dict[str, str]]:
    """Measure every system of ``cfg`` on this rank; returns (figures by system, skipped systems)."""
    rank, world = C.rank(), C.world_size()
    torch.set_num_threads(cfg.threads)
    model_cfg, bucket = cfg.model(), int(cfg.bucket_mb * 2**20)
    data = MarkovCorpus(vocab=cfg.vocab).sample(cfg.batch * world, cfg.seq_len + 1, seed=1)
    batch = data[rank * cfg.batch : (rank + 1) * cfg.batch]
    show = cfg.progress and rank == 0
    systems, figures, skipped = {}, {}, {}

    def warmed_up(name):
        system = build(name, model_cfg, bucket, cfg.batch)
        for _ in range(cfg.warmup):
            system.step(batch)
        return system

    for name in tqdm(cfg.systems, desc="build and measure", disable=not show, leave=False):
        with zf.memory.track() as t:
            system, error = _try_build(name, functools.partial(warmed_up, name))
        if error:
            skipped[name] = error
            continue
        held = t.current  # set-up and warm-up: what stays allocated between steps
        with zf.memory.track() as t:
            system.step(batch)
        traffic = system.count(batch)
        systems[name] = system
        figures[name] = dict(held=held, peak_in_step=t.peak, traffic=traffic, **system.state())

    times: dict[str, list[float]] = {name: [] for name in systems}
    losses: dict[str, float] = {}
    with tqdm(total=cfg.rounds * len(systems), desc="timing", disable=not show, leave=False) as bar:
        order = list(systems)
        for r in range(cfg.rounds):
            for name in order[r % len(order) :] + order[: r % len(order)]:  # each round starts one later
                system = systems[name]
                for _ in range(cfg.steps):
                    C.barrier()
                    t0 = time.perf_counter()
                    losses[name] = float(system.step(batch))
                    times[name].append(time.perf_counter() - t0)
                bar.update()
    for name in systems:
        figures[name].update(median=statistics.median(times[name]), loss=losses[name])
    return figures, skipped


def run(cfg: Config) -> Results:
    """Run ``cfg`` on ``cfg.world`` local gloo ranks and gather the figures of every system."""
    if cfg.steps < 1 or cfg.rounds < 1:
        raise ValueError(f"steps and rounds must be at least 1, got steps={cfg.steps}, rounds={cfg.rounds}")
    unknown = [n for n in cfg.systems if n not in SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; the systems are: {', '.join(SYSTEMS)}")
    start = time.perf_counter()
    per_rank = zf.spawn(bench_rank, cfg.world, cfg)
    figures = [f for f, _ in per_rank]
    names = [n for n in cfg.systems if n in figures[0]]
    ms = {n: 1e3 * max(f[n]["median"] for f in figures) for n in names}
    measured = [
        Measured(
            name=n,
            ms=ms[n],
            ratio=ms[n] / ms[DDP] if DDP in ms else None,
            loss=figures[0][n]["loss"],
            **{k: max(f[n][k] for f in figures) for k in ("params", "optimizer", "held", "peak_in_step", "traffic")},
        )
        for n in names
    ]
    return Results(config=cfg, systems=measured, skipped=per_rank[0][1], seconds=time.perf_counter() - start)
