"""Command line: ``python -m zerofn.bench --all [--quick] [--out docs/bench] ...``; see ``zerofn.bench``.

``python -m zerofn.bench gpu --out DIR [--quick]`` is the GPU check (:mod:`zerofn.bench.gpu`)."""

from __future__ import annotations

import argparse
import pickle
import shlex
import sys

from zerofn.bench.harness import QUICK, SHAPES, Config, Results, run_all
from zerofn.bench.report import busy, write
from zerofn.bench.systems import ALL, DEEPSPEED, SYSTEMS, deepspeed_installed


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = Config(systems=())
    p = argparse.ArgumentParser(
        prog="python -m zerofn.bench",
        description="Train the GPT with every zerofn composition and with torch DDP, ZeroRedundancyOptimizer "
        "and FSDP2 (and DeepSpeed when installed) on local gloo ranks; write a markdown report with plots.",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--all", action="store_true", help="every composition and every peer (DeepSpeed if installed)")
    which.add_argument("--systems", nargs="+", metavar="NAME", help="these systems only (see --list)")
    which.add_argument("--list", action="store_true", help="print the names of the systems and exit")
    p.add_argument("--quick", action="store_true", help="a tiny model, 1 round of 2 steps: a check of the harness")
    p.add_argument("--out", default="docs/bench", help="folder for report.md and the PNGs (default: docs/bench)")
    p.add_argument(
        "--shapes",
        nargs="+",
        choices=list(SHAPES),
        default=list(SHAPES),
        help="model shapes, each a section of the report (default: all; v64: vocabulary 64, sequences of 64, "
        "AdamW betas (0.9, 0.999), weight decay 0.1; v512: vocabulary 512 with an untied head, sequences of 128, "
        "betas (0.9, 0.95), "
        "weight decay 0.01); --dim etc. apply to every shape",
    )
    p.add_argument("--world", type=int, default=defaults.world, help="gloo ranks on this machine")
    p.add_argument("--dim", type=int, help=f"model width (default {defaults.dim}; --quick {QUICK['dim']})")
    p.add_argument("--layers", type=int, help=f"blocks (default {defaults.layers}; --quick {QUICK['layers']})")
    p.add_argument("--heads", type=int, help=f"attention heads (default {defaults.heads})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {defaults.seq_len})")
    p.add_argument("--vocab", type=int, help=f"vocabulary (default {defaults.vocab})")
    p.add_argument("--batch", type=int, help=f"sequences per rank (default {defaults.batch})")
    p.add_argument(
        "--steps",
        type=int,
        help=f"consecutive steps per system per round, timed as one loop (default {defaults.steps})",
    )
    p.add_argument("--rounds", type=int, help=f"rounds of timed steps (default {defaults.rounds})")
    p.add_argument("--warmup", type=int, help=f"untimed steps per system first (default {defaults.warmup})")
    p.add_argument("--threads", type=int, default=defaults.threads, help="intra-op threads per rank")
    p.add_argument("--bucket-mb", type=float, default=defaults.bucket_mb, help="gradient bucket size (MiB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--save", metavar="PATH", help="also pickle the measured Results (a list, one per shape) here")
    return p.parse_args(argv)


def configs(args: argparse.Namespace) -> list[Config]:
    """The Configs the arguments ask for, one per shape: the shape, then --quick's sizes, then any size
    given explicitly."""
    if args.all:
        systems = ALL + (DEEPSPEED if deepspeed_installed() else ())
    else:
        systems = tuple(args.systems)
    out = []
    for name in args.shapes:
        sizes = dict(SHAPES[name])
        if args.quick:
            sizes.update(QUICK)
        for key in (
            "dim",
            "layers",
            "heads",
            "seq_len",
            "vocab",
            "batch",
            "steps",
            "rounds",
            "warmup",
        ):
            if getattr(args, key) is not None:
                sizes[key] = getattr(args, key)
        out.append(
            Config(
                systems=systems,
                world=args.world,
                threads=args.threads,
                bucket_mb=args.bucket_mb,
                progress=not args.no_progress,
                **sizes,
            )
        )
    return out


def summary(results: Results) -> str:
    """A plain-text table for the terminal."""
    c = results.config
    lines = [
        f"GPT {c.parameters():,} parameters, vocabulary {c.vocab}, sequences of {c.seq_len}",
        f"{'system':<46}{'step ms':>9}{'vs DDP':>8}{'busy rounds':>13}{'held MiB':>10}{'peak MiB':>10}"
        f"{'traffic MiB':>13}{'loss':>11}",
    ]
    for m in results.systems:
        ratio = "n/a" if m.ratio is None else f"{m.ratio:.2f}"
        lines.append(
            f"{m.name:<46}{m.ms:>9.1f}{ratio:>8}{busy(m):>13}{m.held / 2**20:>10.2f}"
            f"{m.peak / 2**20:>10.2f}{m.traffic / 2**20:>13.2f}{m.loss:>11.6f}"
        )
    lines += [f"{name}: not measured ({why})" for name, why in results.skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Results] | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gpu"]:  # the GPU check: correctness, host syncs, speed against the peers
        from zerofn.bench import gpu

        gpu.main(argv[1:])
        return None
    args = parse_args(argv)
    if args.list:
        print("\n".join(SYSTEMS))
        return None
    cfgs = configs(args)
    if not args.all and "torch DDP" not in cfgs[0].systems:
        print("zerofn.bench: torch DDP is not among the systems, so the report has no ratios", file=sys.stderr)
    results = run_all(cfgs)
    if args.save:
        with open(args.save, "wb") as f:
            pickle.dump(results, f)
    path = write(results, args.out, " ".join(["python -m zerofn.bench", *map(shlex.quote, argv)]))
    print("\n\n".join(summary(r) for r in results))
    print(f"wrote {path} ({sum(r.seconds for r in results):.0f} s)")
    return results


if __name__ == "__main__":
    main()
