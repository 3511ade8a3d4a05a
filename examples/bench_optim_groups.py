"""Parameter groups, Muon and bf16 moments: step time, bytes and loss, each against a reference in the same run.

    python examples/bench_optim_groups.py                  # 2 gloo ranks, about 4 minutes on 2 cores
    python examples/bench_optim_groups.py --json figures.json
    python examples/bench_optim_groups.py --stages shard_params --rounds 40 --skip-moments

It starts its ranks itself (``zf.spawn``), so run it with plain ``python``,
not under ``torchrun``. The figures and how they were made:
docs/bench/optim_groups.md.

1. Groups: the examples' GPT (``zerofn.bench.gpt``) trained with two-group AdamW, written both ways
   (``adamw(..., mask=zf.optim.decay_mask())`` and ``multi_transform`` of
   an AdamW with decay and one without), against one group (plain
   ``adamw``), under each stage: ``train_step``, ``shard_optimizer``,
   ``shard_grads``, ``shard_params``. Also the number of buckets each
   layout has (``state.spec.layout.buckets``): parameters of different
   labels go to different buckets. Plain AdamW built a second time
   (``adamw again``) shows how far the machine's noise alone moves a ratio.
2. Muon: ``muon`` on the matrices (``p.ndim == 2``) and AdamW on the rest,
   combined with ``multi_transform``, against plain AdamW, under each stage:
   step time, optimizer-state bytes per rank
   (``zf.memory.state_bytes(state)["optimizer"]``) and one step's collective
   traffic (``metrics["comm_bytes"]``); and the update alone in one process,
   zerofn's against ``torch.optim.Muon`` with ``torch.optim.AdamW`` for the
   rest. Skipped when ``zerofn.optim.muon`` cannot be imported.
3. bf16 moments: ``examples/train_gpt.py``'s model, optimizer and schedule
   (clip 1.0, AdamW with weight decay 0.1, warmup and cosine decay) for 200
   steps with ``mu_dtype=torch.bfloat16``, and with ``nu_dtype`` too,
   against fp32 moments, in one process from the same seed on the same
   batches: the final loss, the largest difference between the loss
   curves, and the optimizer-state bytes.

Parts 1 and 2 build every system in the same ranks (the same GPT from the
same seed, the same batch) and time them in rounds. A round runs
``--steps`` consecutive steps of every system in turn (one barrier before
each system's loop, none between its steps): stage after stage, the
optimizers of a stage one after another, both orders starting one later
each round, so that a busy spell of a shared machine slows a system and
its reference alike. A round's time of a system is the slowest rank's; its
ratio is taken against the reference of the same stage in the same round,
and the table shows the median over the rounds (and the smallest and
largest ratio). The cpu ratio is the same for the CPU time of all ranks
together, which a busy machine moves less than the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import zerofn as zf
from zerofn import collectives as C
from zerofn.bench.gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for

LR, WD = 1e-3, 0.1
STAGES = ("train_step", "shard_optimizer", "shard_grads", "shard_params")
REFERENCE = "adamw"
# "adamw again" is the reference built a second time: its ratio shows how far the machine's noise alone goes.
OPTIMIZERS = ("adamw", "adamw again", "adamw(mask=decay_mask())", "multi_transform(adamw, adamw)", "muon + adamw")


def have_muon() -> bool:
    try:
        from zerofn.optim.muon import muon  # noqa: F401
    except ImportError:
        return False
    return True


def make_optimizer(name: str) -> zf.optim.GradientTransformation:
    """The optimizer ``name`` of ``OPTIMIZERS``: one group, nanoGPT's two groups written two ways, or Muon."""
    if name in ("adamw", "adamw again"):
        return zf.optim.adamw(LR, weight_decay=WD)
    if name == "adamw(mask=decay_mask())":
        return zf.optim.adamw(LR, weight_decay=WD, mask=zf.optim.decay_mask())
    if name == "multi_transform(adamw, adamw)":
        decays = zf.optim.decay_mask()
        return zf.optim.multi_transform(
            {"decay": zf.optim.adamw(LR, weight_decay=WD), "no_decay": zf.optim.adamw(LR, weight_decay=0.0)},
            lambda params: {n: "decay" if d else "no_decay" for n, d in decays(params).items()},
        )
    if name == "muon + adamw":
        from zerofn.optim.muon import muon

        return zf.optim.multi_transform(
            {"muon": muon(lr=LR, weight_decay=WD), "adamw": zf.optim.adamw(LR, weight_decay=WD)},
            lambda params: {n: "muon" if p.ndim == 2 else "adamw" for n, p in params.items()},
        )
    raise ValueError(f"unknown optimizer {name!r}; the optimizers are {OPTIMIZERS}")


def make_step(stage: str, optimizer: zf.optim.GradientTransformation, apply) -> zf.Step:
    from zerofn import transforms

    step = zf.train_step(loss_fn_for(apply), optimizer)
    return step if stage == "train_step" else getattr(transforms, stage)(step)


def _rotated(items: tuple, r: int) -> tuple:
    return items[r % len(items) :] + items[: r % len(items)]


def round_order(stages: tuple[str, ...], optimizers: tuple[str, ...], r: int) -> list[tuple[str, str]]:
    """Round ``r``'s order: stage after stage, each stage's optimizers one after another (so that a ratio
    compares steps run seconds apart), both orders starting one later each round."""
    return [(stage, opt) for stage in _rotated(stages, r) for opt in _rotated(optimizers, r)]


def timing_rank(cfg: GPTConfig, stages, optimizers, batch_per_rank: int, warmup: int, rounds: int, steps: int):
    """Build every (stage, optimizer) system in this rank, then time them in interleaved rounds."""
    torch.set_num_threads(1)
    rank, world = C.rank(), C.world_size()
    data = MarkovCorpus(vocab=cfg.vocab).sample(batch_per_rank * world, cfg.seq_len + 1, seed=1)
    batch = data[rank * batch_per_rank : (rank + 1) * batch_per_rank]
    systems, figures = {}, {}
    for stage in stages:
        for opt in optimizers:
            torch.manual_seed(0)
            apply = zf.functional(GPT(cfg))
            step = make_step(stage, make_optimizer(opt), apply)
            state = step.init(apply.params)
            for _ in range(warmup):
                state, metrics = step(state, batch)
            figures[stage, opt] = dict(
                buckets=len(state.spec.layout.buckets),
                optimizer=zf.memory.state_bytes(state)["optimizer"],
                comm=int(metrics["comm_bytes"]),
                loss=float(metrics["loss"]),
            )
            systems[stage, opt] = [step, state]
    times: dict = {key: [] for key in systems}
    for r in range(rounds):
        for key in round_order(stages, optimizers, r):
            step, state = systems[key]
            C.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                state, metrics = step(state, batch)
            float(metrics["loss"])
            _ = state.params, state.opt_state  # the loop ends when its last step's values are whole
            times[key].append(((time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps))
            systems[key][1] = state
    return figures, times


def model_config(args) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=4, layers=args.layers)


def _per_round(per_rank: list[list[tuple[float, float]]]) -> tuple[list[float], list[float]]:
    rounds = list(zip(*per_rank))
    return [max(w for w, _ in r) for r in rounds], [sum(c for _, c in r) for r in rounds]


def measure_groups(args, optimizers: tuple[str, ...]) -> dict:
    cfg = model_config(args)
    stages = tuple(args.stages)
    per_rank = zf.spawn(
        timing_rank, args.world, cfg, stages, optimizers, args.batch, args.warmup, args.rounds, args.steps
    )
    figures = per_rank[0][0]
    rows = {}
    for (stage, opt), fig in figures.items():
        # per round: the slowest rank's wall time, and the CPU time of all ranks together
        wall, cpu = _per_round([times[stage, opt] for _, times in per_rank])
        ref_wall, ref_cpu = _per_round([times[stage, REFERENCE] for _, times in per_rank])
        ratios = [a / b for a, b in zip(wall, ref_wall)]
        rows[f"{stage}/{opt}"] = dict(
            stage=stage,
            optimizer=opt,
            ms=1e3 * statistics.median(wall),
            ratio=statistics.median(ratios),
            ratios=ratios,
            cpu_ratio=statistics.median(a / b for a, b in zip(cpu, ref_cpu)),
            buckets=fig["buckets"],
            optimizer_bytes=max(f[stage, opt]["optimizer"] for f, _ in per_rank),
            comm_bytes=max(f[stage, opt]["comm"] for f, _ in per_rank),
            loss=fig["loss"],
        )
    return rows


def moments_rank(steps: int, threads: int, variants: dict) -> dict:
    """examples/train_gpt.py's defaults in one process: the loss curve and optimizer bytes of each variant."""
    torch.set_num_threads(threads)
    vocab, seq_len, batch, lr, seed = 32, 64, 32, 3e-3, 0
    corpus = MarkovCorpus(vocab=vocab, seed=seed)
    batches = [corpus.sample(batch, seq_len + 1, seed=seed * 1_000_003 + i) for i in range(steps)]
    out = {}
    for name, dtypes in variants.items():
        torch.manual_seed(seed)
        apply = zf.functional(GPT(GPTConfig(vocab=vocab, seq_len=seq_len, dim=64, heads=4, layers=2)))
        schedule = zf.optim.warmup_cosine_decay_schedule(0.0, lr, steps // 10, steps, lr / 10)
        opt = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(schedule, weight_decay=0.1, **dtypes))
        step = zf.train_step(loss_fn_for(apply), opt)
        state = step.init(apply.params)
        losses = []
        for b in batches:
            state, metrics = step(state, b)
            losses.append(float(metrics["loss"]))
        out[name] = dict(losses=losses, optimizer_bytes=zf.memory.state_bytes(state)["optimizer"])
    return out


def update_rank(cfg: GPTConfig, rounds: int, repeat: int) -> dict:
    """The update alone (no forward or backward), one process: zerofn's Muon + AdamW and AdamW against
    torch.optim.Muon + torch.optim.AdamW and torch.optim.AdamW, on the GPT's parameters, interleaved."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(cfg)
    named = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) * 1e-2 for n, p in named.items()}

    def zerofn_update(name):
        opt, params = make_optimizer(name), {n: p.clone() for n, p in named.items()}
        box = [opt.init(params)]

        def run():
            box[0] = zf.optim.update_params(opt, {n: g.clone() for n, g in grads.items()}, box[0], params)

        return run

    def torch_update(muon):
        params = {n: torch.nn.Parameter(p.clone()) for n, p in named.items()}
        matrices = [p for p in params.values() if p.ndim == 2] if muon else []
        rest = [p for p in params.values() if not muon or p.ndim != 2]
        opts = [torch.optim.AdamW(rest, lr=LR, weight_decay=WD, foreach=True)]
        if matrices:
            opts.append(torch.optim.Muon(matrices, lr=LR, weight_decay=WD))

        def run():
            for n, p in params.items():
                p.grad = grads[n].clone()
            for o in opts:
                o.step()

        return run

    systems = {
        "zerofn adamw": zerofn_update("adamw"),
        "zerofn muon + adamw": zerofn_update("muon + adamw"),
        "torch AdamW": torch_update(False),
        "torch Muon + AdamW": torch_update(True),
    }
    times: dict = {name: [] for name in systems}
    for r in range(rounds + 1):  # round 0 warms up
        for name in _rotated(tuple(systems), r):
            t0 = time.perf_counter()
            for _ in range(repeat):
                systems[name]()
            if r:
                times[name].append((time.perf_counter() - t0) / repeat)
    return times


def measure_updates(args) -> dict:
    times = zf.spawn(update_rank, 1, model_config(args), args.rounds, args.steps)[0]
    counterpart = {"zerofn adamw": "torch AdamW", "zerofn muon + adamw": "torch Muon + AdamW"}

    def ratio(a, b):
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    out = {}
    for name, ts in times.items():
        ref = "zerofn adamw" if name.startswith("zerofn") else "torch AdamW"
        out[name] = dict(
            ms=1e3 * statistics.median(ts),
            ratio=ratio(name, ref),
            vs_torch=ratio(name, counterpart[name]) if name in counterpart else None,
        )
    return out


def print_updates(rows: dict) -> None:
    print(
        "The update alone (no forward or backward), one process; ratio: over the same library's AdamW; "
        "vs torch: over torch's same optimizer"
    )
    print(f"{'update':<24}{'ms':>8}{'ratio':>7}{'vs torch':>10}")
    for name, r in rows.items():
        vs = "" if r["vs_torch"] is None else f"{r['vs_torch']:.3f}"
        print(f"{name:<24}{r['ms']:>8.2f}{r['ratio']:>7.3f}{vs:>10}")


MOMENTS = {
    "fp32 moments": {},
    "mu_dtype=bf16": {"mu_dtype": torch.bfloat16},
    "mu_dtype=nu_dtype=bf16": {"mu_dtype": torch.bfloat16, "nu_dtype": torch.bfloat16},
}


def measure_moments(args) -> dict:
    runs = zf.spawn(moments_rank, 1, args.loss_steps, args.loss_threads, MOMENTS)[0]
    base = runs["fp32 moments"]
    for run in runs.values():
        run["final"] = run["losses"][-1]
        run["final_diff"] = abs(run["final"] - base["final"])
        run["max_diff"] = max(abs(a - b) for a, b in zip(run["losses"], base["losses"]))
        run["bytes_ratio"] = run["optimizer_bytes"] / base["optimizer_bytes"]
    return runs


def print_groups(rows: dict, args) -> None:
    params = sum(p.numel() for p in GPT(model_config(args)).parameters())
    print(
        f"GPT {params:,} parameters (dim {args.dim}, {args.layers} layers), {args.world} gloo ranks, batch "
        f"{args.batch} x {args.seq_len} per rank; {args.rounds} rounds of {args.steps} consecutive steps; "
        f"ratio: median over rounds of the step time over plain adamw's under the same stage (min-max: over "
        f"the rounds); cpu ratio: the same for the CPU time of all ranks"
    )
    print(
        f"{'stage':<17}{'optimizer':<31}{'step ms':>9}{'ratio':>7}{'min-max ratio':>15}{'cpu ratio':>11}"
        f"{'buckets':>9}{'opt MiB':>9}{'comm MiB':>10}{'loss':>8}"
    )
    for r in rows.values():
        spread = f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}"
        print(
            f"{r['stage']:<17}{r['optimizer']:<31}{r['ms']:>9.1f}{r['ratio']:>7.3f}{spread:>15}"
            f"{r['cpu_ratio']:>11.3f}{r['buckets']:>9}"
            f"{r['optimizer_bytes'] / 2**20:>9.3f}{r['comm_bytes'] / 2**20:>10.3f}{r['loss']:>8.4f}"
        )


def print_moments(runs: dict, steps: int) -> None:
    print(f"examples/train_gpt.py's GPT for {steps} steps, one process, same seed and batches")
    print(f"{'moments':<24}{'final loss':>11}{'|final diff|':>13}{'max |diff|':>12}{'opt bytes':>11}{'vs fp32':>9}")
    for name, r in runs.items():
        print(
            f"{name:<24}{r['final']:>11.4f}{r['final_diff']:>13.2e}{r['max_diff']:>12.2e}{r['optimizer_bytes']:>11,}{r['bytes_ratio']:>9.3f}"
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=4, help="consecutive timed steps per system per round")
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES), help="the stages to time")
    p.add_argument("--loss-steps", type=int, default=200, help="steps of the bf16-moments comparison")
    p.add_argument("--loss-threads", type=int, default=1, help="intra-op threads of the bf16-moments process")
    p.add_argument("--skip-groups", action="store_true", help="only the bf16-moments comparison")
    p.add_argument("--skip-moments", action="store_true", help="only the timed comparisons")
    p.add_argument("--json", default=None, metavar="FILE", help="also write every figure here")
    args = p.parse_args(argv)
    if args.json is not None:  # checked before the run, which takes minutes
        where = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json):
            p.error(f"--json {args.json} is a directory; pass the name of a file to write")
        if not os.path.isdir(where):
            p.error(
                f"--json {args.json}: the directory it goes in, {where}, does not exist; create it (mkdir -p "
                f"{where}) or pass a file in an existing directory"
            )
    start = time.perf_counter()
    results: dict = {"args": vars(args)}
    if not args.skip_groups:
        optimizers = OPTIMIZERS if have_muon() else OPTIMIZERS[:-1]
        if "muon + adamw" not in optimizers:
            print("zerofn.optim.muon cannot be imported: Muon is left out")
        results["groups"] = measure_groups(args, optimizers)
        print_groups(results["groups"], args)
        if "muon + adamw" in optimizers:
            results["updates"] = measure_updates(args)
            print_updates(results["updates"])
    if not args.skip_moments:
        results["moments"] = measure_moments(args)
        print_moments(results["moments"], args.loss_steps)
    print(f"{time.perf_counter() - start:.0f} s in all")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
