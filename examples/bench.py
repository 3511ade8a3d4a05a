"""Step time and memory of zerofn's steps against torch DDP, ZeroRedundancyOptimizer and FSDP2.

A front for the package's harness (``python -m zerofn.bench``, which also
writes the report in docs/bench/) that prints its table to the terminal.

Systems: torch DDP, torch ZeroRedundancyOptimizer (ZeRO-1), torch FSDP2
(fully_shard on every block and the root), zerofn's plain step,
shard_optimizer (ZeRO-1), shard_grads (ZeRO-2) and shard_params (ZeRO-3);
with --amp each zerofn stage again under amp(bf16), with --remat each zerofn
system again under remat, beside torch DDP with torch.utils.checkpoint on
every block.

    python examples/bench.py                 # 2 gloo ranks on this machine
    python examples/bench.py --world 2 --steps 30 --dim 256 --layers 4
    python examples/bench.py --shape v512    # vocabulary 512, 128 tokens, AdamW betas (0.9, 0.95), decay 0.01
    python examples/bench.py --remat         # activation checkpointing's memory and cost

Every system trains the same GPT on the same data from the same seed, in the
same ranks; the systems take turns in rounds so that a noisy machine slows
them alike. Reported per system: the step time of a loop of --steps
consecutive steps (synchronised only before and after it; the median over
the rounds) and its ratio to DDP's round by round, the fastest and slowest
round's step time, the rounds in which other processes used more than a few
percent of the machine's CPU (zerofn.bench.harness.BUSY), optimizer-state
bytes per rank, bytes held between steps and peak live tensor bytes during
one step (zf.memory.track), the collective traffic of one step and the
final loss, all measured in this one run.
"""

from __future__ import annotations

import argparse

from zerofn.bench import SHAPES, Config, run
from zerofn.bench.systems import DDP, DDP_CHECKPOINT, FSDP2, STAGES, ZERO, composition_name


def systems(amp: bool, remat: bool) -> tuple[str, ...]:
    zf = [composition_name(s) for s in STAGES]
    if amp:  # each zerofn stage again in bf16 against fp32 master weights
        zf += [composition_name(s, amp=True) for s in STAGES]
    if remat:  # each zerofn system again under remat, and torch's checkpointing as the anchor
        zf += [f"remat({name})" for name in zf]
    return (DDP, ZERO, FSDP2, *zf, *([DDP_CHECKPOINT] if remat else []))


def main(argv=None):
    defaults = Config(systems=())
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=defaults.world)
    p.add_argument("--shape", choices=list(SHAPES), default=next(iter(SHAPES)), help="vocabulary, length, AdamW")
    p.add_argument("--dim", type=int, default=defaults.dim)
    p.add_argument("--layers", type=int, default=defaults.layers)
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the shape's)")
    p.add_argument("--batch", type=int, default=defaults.batch, help="sequences per rank")
    p.add_argument("--steps", type=int, default=defaults.steps, help="timed steps per system per round")
    p.add_argument("--rounds", type=int, default=defaults.rounds)
    p.add_argument("--warmup", type=int, default=defaults.warmup)
    p.add_argument("--threads", type=int, default=defaults.threads, help="intra-op threads per rank")
    p.add_argument("--bucket-mb", type=float, default=defaults.bucket_mb, help="gradient bucket size (MiB)")
    p.add_argument("--amp", action="store_true", help="add every zerofn stage under amp(bf16)")
    p.add_argument("--remat", action="store_true", help="add every zerofn system under remat, and torch checkpoint")
    args = p.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    if args.seq_len is not None:
        shape["seq_len"] = args.seq_len
    cfg = Config(
        systems=systems(args.amp, args.remat),
        world=args.world,
        dim=args.dim,
        layers=args.layers,
        **shape,
        batch=args.batch,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        threads=args.threads,
        bucket_mb=args.bucket_mb,
    )
    results = run(cfg)
    print(f"GPT {cfg.parameters():,} parameters, {cfg.world} gloo ranks, batch {cfg.batch} x {cfg.seq_len} per rank")
    print(
        f"{'system':<46}{'step ms':>9}{'vs DDP':>8}{'min ms':>9}{'max ms':>9}{'busy rounds':>13}"
        f"{'opt state MiB':>15}{'held MiB':>10}{'peak in step':>14}{'peak MiB':>10}{'traffic MiB':>13}{'loss':>11}"
    )
    for m in results.systems:
        fastest, slowest = m.ms_range
        print(
            f"{m.name:<46}{m.ms:>9.1f}{m.ratio:>8.3f}{fastest:>9.1f}{slowest:>9.1f}{m.busy_rounds:>13}"
            f"{m.optimizer / 2**20:>15.2f}{m.held / 2**20:>10.2f}{m.peak_in_step / 2**20:>14.2f}"
            f"{m.peak / 2**20:>10.2f}{m.traffic / 2**20:>13.2f}{m.loss:>11.6f}"
        )
    if args.remat:
        ms = {m.name: m.ms for m in results.systems}
        cost = {n[len("remat(") : -1]: ms[n] / ms[n[len("remat(") : -1]] for n in ms if n.startswith("remat(")}
        line = ", ".join(f"{n} {c:.2f}x" for n, c in cost.items())
        print(
            f"remat's step time against the same system without it: {line}; "
            f"torch checkpoint against DDP: {ms[DDP_CHECKPOINT] / ms[DDP]:.2f}x"
        )
    return results


if __name__ == "__main__":
    main()
