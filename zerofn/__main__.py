"""Command line: ``python -m zerofn {run, plan, consolidate, verify} ...``.

- ``run``: a thin front over torchrun (``zerofn.launch.cli``), with the
  flags DeepSpeed's launcher users know.
- ``plan``: what fits where (``zerofn.plan``).
- ``consolidate PATH OUT [--dtype bf16] [--max-shard-size 5GB]``: a
  checkpoint's full model as safetensors (:func:`zerofn.checkpoint.consolidate`).
- ``verify PATH``: every file of a checkpoint against its manifest.
"""

from __future__ import annotations

import argparse
import os
import sys

from zerofn.plan import parse_size

_DTYPES = {
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}


def _size(text: str) -> int:
    return int(parse_size(text))  # the planner's parser of sizes (5GB, 500MiB, 1TB)


def _check_paths(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The paths of ``consolidate`` and ``verify``, before anything is read: a usage error (exit status 2)
    that says what to pass. ``consolidate``'s output goes in a directory that must exist (with
    ``--max-shard-size`` the output is itself a directory, made there)."""
    if os.path.isfile(args.path):
        p.error(f"{args.path} is a file; pass the checkpoint's directory (the one that holds its manifest.json)")
    if not os.path.isdir(args.path):
        p.error(
            f"{args.path}: no such checkpoint directory; pass a directory zf.checkpoint.save wrote (the one that "
            "holds its manifest.json; zf.checkpoint.latest(DIR) gives the newest under DIR)"
        )
    if args.command == "consolidate":
        where = os.path.dirname(os.path.abspath(args.out))
        if args.max_shard_size is None and os.path.isdir(args.out):
            p.error(f"{args.out} is a directory; pass the .safetensors file to write (or --max-shard-size to split)")
        if not os.path.isdir(where):
            p.error(
                f"{args.out}: the directory it goes in, {where}, does not exist; create it (mkdir -p {where}) or "
                "write into an existing directory"
            )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("run", "plan"):  # their own parsers, with torchrun's and the planner's flags
        if argv[0] == "run":
            from zerofn.launch.cli import main as run
        else:
            from zerofn.plan.cli import main as run
        return run(argv[1:])
    p = argparse.ArgumentParser(prog="python -m zerofn", description="zerofn's command line tools")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="launch a training script on N ranks (torchrun's flags; --num_gpus, --num_nodes too)")
    sub.add_parser(
        "plan",
        help="bytes per GPU, CPU RAM and NVMe for each ZeRO stage, in GPU memory or moved to CPU or NVMe; what fits",
    )
    c = sub.add_parser("consolidate", help="write a checkpoint's full model as one safetensors file")
    c.add_argument("path", help="a checkpoint directory (made by zf.checkpoint.save)")
    c.add_argument("out", help="the .safetensors file to write (a directory when sharded)")
    c.add_argument(
        "--dtype",
        choices=sorted(_DTYPES),
        default=None,
        help="cast floating tensors (default: as saved; fp32 master weights where the checkpoint has them)",
    )
    c.add_argument(
        "--max-shard-size",
        type=_size,
        default=None,
        help="split into files of at most this size, with an index (e.g. 5GB)",
    )
    v = sub.add_parser("verify", help="check every file of a checkpoint against its manifest")
    v.add_argument("path")
    args = p.parse_args(argv)
    _check_paths(p, args)

    import torch

    from zerofn import checkpoint

    try:
        if args.command == "consolidate":
            dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
            for f in checkpoint.consolidate(args.path, args.out, dtype=dtype, max_shard_bytes=args.max_shard_size):
                print(f)
        else:
            m = checkpoint.verify(args.path)
            print(
                f"{args.path}: complete, {len(m['files'])} files verified, update count {m['count']}, saved by {m['chain']} on {m['world_size']} rank(s)"
            )
    except (ValueError, OSError) as e:  # CheckpointError, IntegrityError, a missing file
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
