"""Run the systems on local gloo ranks and measure them: time, memory, traffic, loss.

:func:`run` starts ``Config.world`` ranks with ``zf.spawn`` (:func:`run_all`: once for several
configs, one after the other); each rank runs
:func:`bench_rank`, which builds every chosen system in turn (the same GPT
from the same seed, the same data), warms it up, measures the memory it holds
and allocates, counts one step's traffic, and then times all the systems in
rounds: each round runs every system in turn (each round starting from the
next system), so that a machine that slows down for a while slows them alike
and the ratios between systems come from one run. :func:`run` gathers what
the ranks measured into one :class:`Measured` per system.

A system's turn in a round is one timed loop: ``steps`` consecutive steps,
as a training loop runs them, with a barrier before the first and after the
last and nothing in between; the round's step time is the loop's wall time
over ``steps``. What a step leaves in flight (zerofn's publish all-gather,
which the next forward waits for) is paid inside the loop, where a user pays
it. Right before the loop (or, every other turn, right after it) the
*reference*, a second torch DDP built like the one in the table, runs a loop
of its own; a system's ratio is its loop over the reference loop beside it,
so that a machine whose load changes from second to second moves both
alike. The reference trains steps of its own: every system in the table
trains the same number of steps. A system's figures are the median over the
rounds, with the smallest and the largest beside it.

The loss is the last step's, as a tensor, averaged over the ranks after the
timed steps, so that no step waits for it.

How busy the machine was: during every loop the ranks read the CPU time the
whole machine spent busy (``/proc/stat``, where there is one) and their own
(``time.process_time``); what is left is other processes', as a share of the
machine's CPU time: per round and system for the system's loop
(:attr:`Measured.round_others`; a round above :data:`BUSY` counts as busy),
and over every loop of the run (:attr:`Results.others_cpu`).

Memory is measured with ``zf.memory.track``, which counts every live tensor
storage made inside a block (on the CPU too); see :mod:`zerofn.memory`.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

import zerofn as zf
from zerofn import collectives as C
from zerofn.bench.gpt import GPT, GPTConfig, MarkovCorpus
from zerofn.bench.systems import DDP, DEEPSPEED, SYSTEMS, AdamWConfig, build

__all__ = [
    "BUSY",
    "QUICK",
    "SHAPES",
    "Config",
    "Measured",
    "Results",
    "bench_rank",
    "gather_results",
    "machine_busy",
    "run",
    "run_all",
]


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
    tie_embeddings: bool = True  # the output head shares the token embedding
    batch: int = 8  # sequences per rank
    lr: float = 1e-3  # AdamW's, for every system
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.1
    steps: int = 4  # consecutive steps per system per round, timed as one loop (beside a loop of the reference)
    rounds: int = 6  # short rounds: a busy spell of the machine falls on every system alike
    warmup: int = 3
    threads: int = 1  # intra-op threads per rank
    bucket_mb: float = 25.0  # gradient bucket size of zerofn and DDP
    progress: bool = True  # progress bars on rank 0 (stderr)

    def model(self) -> GPTConfig:
        return GPTConfig(
            vocab=self.vocab,
            seq_len=self.seq_len,
            dim=self.dim,
            heads=self.heads,
            layers=self.layers,
            tie_embeddings=self.tie_embeddings,
        )

    def adamw(self) -> AdamWConfig:
        return AdamWConfig(lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)

    def parameters(self) -> int:
        """The model's parameter count (the tied embedding once)."""
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(self.model()).parameters())


# --quick: a tiny model and one short round, for CI and for trying the harness out (the sizes of each shape).
QUICK = dict(dim=32, layers=2, heads=4, seq_len=16, batch=2, steps=2, rounds=1, warmup=1)

# A round is busy for a system when other processes used more than this share of the machine's CPU time
# during the system's loop: a few percent.
BUSY = 0.05

# The model shapes the report compares on: Config fields over the defaults. The first is the defaults'
# (3.19 M parameters); the second (3.45 M) has a larger vocabulary with an output head of its own, longer
# sequences and AdamW as GPT-style training sets it.
SHAPES: dict[str, dict] = {
    "v64": {},
    "v512": dict(vocab=512, seq_len=128, tie_embeddings=False, betas=(0.9, 0.95), weight_decay=0.01),
}


@dataclass
class Measured:
    """One system's figures. Bytes and times are per rank: the largest over the ranks.

    Attributes:
        name: the system.
        ms: the step time of a loop of consecutive steps, in milliseconds: per round, the slowest
            rank's wall time of the loop over its steps; the median over the rounds.
        ratio: the median over the rounds of the loop's time over the reference's beside it (a torch
            DDP run just before or just after it), None when nothing was timed.
        params: parameter bytes held between steps.
        optimizer: optimizer-state bytes held between steps.
        held: every byte the system keeps between steps (measured).
        peak_in_step: the most bytes allocated at once during one step, beyond ``held``.
        traffic: collective bytes of one step, in the ZeRO paper's units.
        loss: the loss of the last timed step (mean over ranks).
        ratio_range: the smallest and the largest of the rounds' ratios.
        round_ms: each round's loop step time (ms).
        round_ratios: each round's ratio to the reference: ratios to any other system, round by round.
        round_others: per round, the share (0 to 1) of the machine's CPU time that processes other than
            the ranks used during this system's loop; None for a round where ``/proc/stat`` could not be
            read. A round above :data:`BUSY` is busy (:attr:`busy_rounds`).
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
    ratio_range: tuple[float, float] | None = None
    round_ms: tuple[float, ...] = ()
    round_ratios: tuple[float, ...] = ()
    round_others: tuple[float | None, ...] = ()

    def against(self, other: Measured) -> tuple[float, float, float]:
        """This system's loop step time over ``other``'s, round by round, each through the reference loop
        beside it: (median, smallest, largest)."""
        ratios = [a / b for a, b in zip(self.round_ratios, other.round_ratios)]
        return statistics.median(ratios), min(ratios), max(ratios)

    @property
    def ms_range(self) -> tuple[float, float] | None:
        """The smallest and the largest of the rounds' loop step times (None when no round was timed)."""
        return (min(self.round_ms), max(self.round_ms)) if self.round_ms else None

    @property
    def busy_rounds(self) -> int:
        """The rounds in which other processes used more than :data:`BUSY` of the machine's CPU time during
        this system's loop (rounds without a reading are not counted)."""
        return sum(share > BUSY for share in self.round_others if share is not None)

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
    """What a run measured: one :class:`Measured` per system.

    Attributes:
        others_cpu: the CPU time that processes other than the ranks used during the timed loops, as a
            share of the machine's (all its cores over the loop's wall time): the median and the largest
            over every loop of the run; None where ``/proc/stat`` cannot be read.
    """

    config: Config
    systems: list[Measured]
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it did not run
    seconds: float = 0.0  # wall time of the whole run
    others_cpu: tuple[float, float] | None = None


def machine_busy() -> float | None:
    """Seconds of CPU time the whole machine has spent busy since boot, all cores (None: not on Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


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


def _torch_functions() -> dict[str, Any]:
    """``torch.nn.functional``'s functions, by name: what every system's model calls."""
    return {k: v for k, v in vars(F).items() if callable(v) and not k.startswith("_")}


def _check_torch_kept(name: str, before: dict[str, Any]) -> None:
    """Raise if building ``name`` replaced a function of ``torch.nn.functional``: every system in these ranks
    would then run the replacement in its timed steps."""
    after = _torch_functions()
    changed = sorted(k for k in before if after.get(k) is not before[k])
    if changed:
        raise RuntimeError(
            f"building {name!r} replaced torch.nn.functional.{', '.join(changed)} for the whole process, so every "
            "system in these ranks would time that instead of torch's own; turn the replacement off in that "
            "system's configuration (DeepSpeed ZeRO-3: zero_optimization.memory_efficient_linear = false), or "
            "benchmark it in a run of its own"
        )


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
        system = build(name, model_cfg, bucket, cfg.batch, cfg.adamw())
        for _ in range(cfg.warmup):
            system.step(batch)
        return system

    torch_functions = _torch_functions()  # every build is checked against them: one that changes any raises
    for name in tqdm(cfg.systems, desc="build and measure", disable=not show, leave=False):
        with zf.memory.track() as t:
            system, error = _try_build(name, functools.partial(warmed_up, name))
        if error:
            skipped[name] = error
            continue
        _check_torch_kept(name, torch_functions)
        held = t.current  # set-up and warm-up: what stays allocated between steps
        with zf.memory.track() as t:
            system.step(batch)
        traffic = system.count(batch)
        systems[name] = system
        figures[name] = dict(held=held, peak_in_step=t.peak, traffic=traffic, **system.state())

    # The reference: another torch DDP, built like the one in the table, that runs a loop beside every
    # system's loop (before it in one round, after it in the next), so that each ratio compares loops
    # seconds apart, not a round apart. It trains steps of its own: every system in the table trains the
    # same number of steps, so that their losses can be compared.
    reference = warmed_up(DDP) if systems else None
    loops: dict[str, list[float]] = {name: [] for name in systems}  # per round: the loop's time per step
    beside: dict[str, list[float]] = {name: [] for name in systems}  # per round: the reference's, beside it
    # per round: (wall, own CPU, machine busy) in seconds, of the system's loop and of the reference's beside it
    load: dict[str, list[tuple]] = {name: [] for name in systems}
    load_beside: dict[str, list[tuple]] = {name: [] for name in systems}
    last: dict[str, torch.Tensor] = {}

    def loop(name: str, system) -> float:
        C.barrier()
        t0, own, busy = time.perf_counter(), time.process_time(), machine_busy()
        for _ in range(cfg.steps):
            out = system.step(batch)
        C.barrier()  # gloo's barrier also waits for what the last step left in flight
        wall, after = time.perf_counter() - t0, machine_busy()
        reading = (wall, time.process_time() - own, None if busy is None or after is None else after - busy)
        if system is reference:
            load_beside[name].append(reading)
        else:
            load[name].append(reading)
            last[name] = out
        return wall / cfg.steps

    with tqdm(total=cfg.rounds * len(systems), desc="timing", disable=not show, leave=False) as bar:
        order = list(systems)
        for r in range(cfg.rounds):
            for k, name in enumerate(order[r % len(order) :] + order[: r % len(order)]):  # each round one later
                system = systems[name]
                if (r + k) % 2 == 0:
                    beside[name].append(loop(name, reference))
                    loops[name].append(loop(name, system))
                else:
                    loops[name].append(loop(name, system))
                    beside[name].append(loop(name, reference))
                bar.update()
    for name in systems:
        loss = float(C.all_reduce(last[name].detach().float().clone(), "mean"))
        figures[name].update(
            loops=loops[name],
            beside=beside[name],
            load=load[name],
            load_beside=load_beside[name],
            loss=loss,
            cores=os.cpu_count(),
        )
    return figures, skipped


def _bench_ranks(cfgs: list[Config]) -> list[tuple[dict[str, dict], dict[str, str], float]]:
    out = []
    for cfg in cfgs:
        start = time.perf_counter()
        figures, skipped = bench_rank(cfg)
        out.append((figures, skipped, time.perf_counter() - start))
    return out


def run(cfg: Config) -> Results:
    """Run ``cfg`` on ``cfg.world`` local gloo ranks and gather the figures of every system."""
    return run_all([cfg])[0]


def run_all(cfgs: list[Config]) -> list[Results]:
    """Run every config of ``cfgs`` (one per model shape) in turn on the same ranks, started once."""
    for cfg in cfgs:
        if cfg.steps < 1 or cfg.rounds < 1:
            raise ValueError(f"steps and rounds must be at least 1, got steps={cfg.steps}, rounds={cfg.rounds}")
        unknown = [n for n in cfg.systems if n not in SYSTEMS]
        if unknown:
            raise ValueError(f"unknown systems {unknown}; the systems are: {', '.join(SYSTEMS)}")
    worlds = {cfg.world for cfg in cfgs}
    if len(worlds) != 1:
        raise ValueError(
            f"the configs ask for different numbers of ranks ({sorted(worlds)}); run_all starts one set of "
            "ranks for all of them: give every config the same world, or call run() once per world"
        )
    per_rank = zf.spawn(_bench_ranks, worlds.pop(), list(cfgs))
    return [gather_results(cfg, [r[k] for r in per_rank]) for k, cfg in enumerate(cfgs)]


def gather_results(cfg: Config, per_rank: list[tuple[dict[str, dict], dict[str, str], float]]) -> Results:
    """One :class:`Results` from what every rank measured of ``cfg``: per rank, (figures by system,
    skipped systems, seconds), as :func:`bench_rank` measures them (with the seconds it took)."""
    figures = [f for f, _, _ in per_rank]
    names = [n for n in cfg.systems if n in figures[0]]
    # A loop's time is its slowest rank's.
    rounds = {n: [1e3 * max(ts) for ts in zip(*(f[n]["loops"] for f in figures))] for n in names}
    beside = {n: [1e3 * max(ts) for ts in zip(*(f[n]["beside"] for f in figures))] for n in names}

    def ratios(n):
        rs = [a / b for a, b in zip(rounds[n], beside[n])]
        return (statistics.median(rs), (min(rs), max(rs)), tuple(rs)) if rs else None

    measured = []
    for n in names:
        ratio = ratios(n)
        measured.append(
            Measured(
                name=n,
                ms=statistics.median(rounds[n]),
                ratio=None if ratio is None else ratio[0],
                loss=figures[0][n]["loss"],
                **{
                    k: max(f[n][k] for f in figures) for k in ("params", "optimizer", "held", "peak_in_step", "traffic")
                },
                ratio_range=None if ratio is None else ratio[1],
                round_ms=tuple(rounds[n]),
                round_ratios=() if ratio is None else ratio[2],
                round_others=tuple(_others_share(loop, figures[0][n]["cores"]) for loop in _loops(figures, n, "load")),
            )
        )
    return Results(
        config=cfg,
        systems=measured,
        skipped=per_rank[0][1],
        seconds=max(r[2] for r in per_rank),
        others_cpu=_others_cpu(figures, names),
    )


def _loops(figures: list[dict], name: str, key: str) -> list[tuple[tuple, ...] | None]:
    """The readings of ``name``'s loops under ``key`` (``"load"``: the system's, ``"load_beside"``: the
    reference's), one tuple of every rank's (wall, own CPU, machine busy) per loop; one ``None`` per round
    where the ranks recorded none."""
    loads = [f[name].get(key) for f in figures]
    if any(x is None for x in loads):
        return [None] * len(figures[0][name]["loops"])
    return list(zip(*loads))


def _others_share(per_rank: tuple[tuple, ...] | None, cores: int) -> float | None:
    """The share of the machine's CPU time (``cores`` over the loop's wall time) that processes other than
    the ranks used during one loop, from every rank's (wall, own CPU, machine busy) of it; None without a
    machine reading."""
    if per_rank is None or per_rank[0][2] is None:
        return None
    busy = per_rank[0][2]  # every rank read the same machine; rank 0's reading
    wall = max(w for w, _, _ in per_rank)
    own = sum(c for _, c, _ in per_rank)
    # /proc/stat counts whole clock ticks: over a loop only a few ticks long the difference can exceed what
    # the cores could spend in the loop's wall time
    return min(1.0, max(0.0, busy - own) / (cores * wall))


def _others_cpu(figures: list[dict], names: list[str]) -> tuple[float, float] | None:
    """The median and largest share of the machine's CPU time that other processes used in a loop, over every
    loop of the run: the systems' and the reference's beside them."""
    shares = [
        _others_share(loop, figures[0][n]["cores"])
        for n in names
        for key in ("load", "load_beside")
        for loop in _loops(figures, n, key)
    ]
    if any(s is None for s in shares):
        return None
    return (statistics.median(shares), max(shares)) if shares else None
