"""Command line: ``python -m zerofn.bench --all [--quick] [--out docs/bench] ...``; see ``zerofn.bench``."""

from __future__ import annotations

import argparse
import shlex
import sys

from zerofn.bench.harness import QUICK, Config, Results, run
from zerofn.bench.report import write
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
    p.add_argument("--world", type=int, default=defaults.world, help="gloo ranks on this machine")
    p.add_argument("--dim", type=int, help=f"model width (default {defaults.dim}; --quick {QUICK['dim']})")
    p.add_argument("--layers", type=int, help=f"blocks (default {defaults.layers}; --quick {QUICK['layers']})")
    p.add_argument("--heads", type=int, help=f"attention heads (default {defaults.heads})")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence (default {defaults.seq_len})")
    p.add_argument("--batch", type=int, help=f"sequences per rank (default {defaults.batch})")
    p.add_argument("--steps", type=int, help=f"timed steps per system per round (default {defaults.steps})")
    p.add_argument("--rounds", type=int, help=f"rounds of timed steps (default {defaults.rounds})")
    p.add_argument("--warmup", type=int, help=f"untimed steps per system first (default {defaults.warmup})")
    p.add_argument("--threads", type=int, default=defaults.threads, help="intra-op threads per rank")
    p.add_argument("--bucket-mb", type=float, default=defaults.bucket_mb, help="gradient bucket size (MiB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p.parse_args(argv)


def config(args: argparse.Namespace) -> Config:
    """The Config the arguments ask for: --quick's sizes, then any size given explicitly."""
    if args.all:
        systems = ALL + (DEEPSPEED if deepspeed_installed() else ())
    else:
        systems = tuple(args.systems)
    sizes = dict(QUICK) if args.quick else {}
    for key in ("dim", "layers", "heads", "seq_len", "batch", "steps", "rounds", "warmup"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    return Config(
        systems=systems,
        world=args.world,
        threads=args.threads,
        bucket_mb=args.bucket_mb,
        progress=not args.no_progress,
        **sizes,
    )


def summary(results: Results) -> str:
    """A plain-text table for the terminal."""
    lines = [f"{'system':<46}{'step ms':>9}{'vs DDP':>8}{'held MiB':>10}{'peak MiB':>10}{'traffic MiB':>13}{'loss':>9}"]
    for m in results.systems:
        ratio = "n/a" if m.ratio is None else f"{m.ratio:.2f}"
        lines.append(
            f"{m.name:<46}{m.ms:>9.1f}{ratio:>8}{m.held / 2**20:>10.2f}"
            f"{m.peak / 2**20:>10.2f}{m.traffic / 2**20:>13.2f}{m.loss:>9.4f}"
        )
    lines += [f"{name}: not measured ({why})" for name, why in results.skipped.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Results | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.list:
        print("\n".join(SYSTEMS))
        return None
    cfg = config(args)
    if not args.all and "torch DDP" not in cfg.systems:
        print("zerofn.bench: torch DDP is not among the systems, so the report has no ratios", file=sys.stderr)
    results = run(cfg)
    path = write(results, args.out, " ".join(["python -m zerofn.bench", *map(shlex.quote, argv)]))
    print(summary(results))
    print(f"wrote {path} ({results.seconds:.0f} s)")
    return results


if __name__ == "__main__":
    main()
