"""``python -m zerofn run``: torchrun, with the flags DeepSpeed's launcher users know.

    python -m zerofn run --nproc_per_node 2 train.py --deepspeed ds_config.json
    python -m zerofn run --num_gpus 8 train.py ...                    # DeepSpeed's spelling
    python -m zerofn run --nnodes 2 --node_rank 0 --master_addr host0 --master_port 29500 \\
        --nproc_per_node 8 train.py ...                               # on each machine

A thin front, not a launcher of its own: it rewrites DeepSpeed's flag names
to torchrun's (``--num_gpus`` to ``--nproc_per_node``, ``--num_nodes`` to
``--nnodes``), adds ``--standalone`` on one machine when no rendezvous is
given, and hands everything to ``torch.distributed.run`` in this process,
so every torchrun flag (``--max-restarts``, ``--rdzv-endpoint``, ...) works
as it does there. Two settings differ from torchrun's defaults:

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set): each restart
  attempt gets a fresh rendezvous store. With the shared one, workers
  restarted by ``--max-restarts`` find the dead workers' addresses there
  and gloo fails to connect about half the time (pytorch/pytorch#135712).
- ``OMP_NUM_THREADS``: 1 when unset, as torchrun sets it, without
  torchrun's warning banner.

DeepSpeed's ``--hostfile``, ``--include`` and ``--exclude`` start ranks on
other machines over ssh; torchrun does not, and neither does this: run the
same command on each machine with ``--nnodes``, ``--node_rank``,
``--master_addr`` and ``--master_port``, as DeepSpeed's
``--no_ssh`` mode does.

Example:
    >>> from zerofn.launch.cli import torchrun_args
    >>> torchrun_args(["--num_gpus", "2", "train.py", "--deepspeed", "ds.json"])
    ['--nproc_per_node', '2', '--standalone', 'train.py', '--deepspeed', 'ds.json']
"""

from __future__ import annotations

import os
import sys

__all__ = ["main", "torchrun_args"]

ALIASES = {
    "--num_gpus": "--nproc_per_node",
    "--num-gpus": "--nproc_per_node",
    "--num_nodes": "--nnodes",
    "--num-nodes": "--nnodes",
}
UNSUPPORTED = {
    "--hostfile": "ssh to the hosts it lists",
    "--include": "select hosts and GPUs from a hostfile",
    "--exclude": "select hosts and GPUs from a hostfile",
    "--launcher": "choose pdsh, openmpi or slurm",
}
RENDEZVOUS = ("--standalone", "--rdzv-endpoint", "--rdzv_endpoint", "--master-addr", "--master_addr")


def _flags() -> tuple[set[str], set[str]]:
    """torchrun's flags: those that take a value, and those that do not."""
    from torch.distributed.run import get_args_parser

    valued, boolean = set(), set()
    for action in get_args_parser()._actions:
        for opt in action.option_strings:
            (boolean if action.nargs == 0 else valued).add(opt)
    return valued, boolean


def torchrun_args(argv: list[str]) -> list[str]:
    """torchrun's command line for ``python -m zerofn run`` ``argv``."""
    flags, script = _translate(argv)
    return flags + script


def _translate(argv: list[str]) -> tuple[list[str], list[str]]:
    """torchrun's flags for ``argv``, and the script with its own arguments."""
    valued, boolean = _flags()
    out: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("-"):
            break  # the script: it and what follows are the script's own
        name, eq, value = tok.partition("=")
        if name in UNSUPPORTED:
            raise SystemExit(
                f"python -m zerofn run: {name} (DeepSpeed's launcher: {UNSUPPORTED[name]}) is not supported; "
                "run the same command on each machine with --nnodes N --node_rank R --master_addr HOST "
                "--master_port PORT --nproc_per_node G"
            )
        name = ALIASES.get(name, name)
        if name not in valued and name not in boolean:
            raise SystemExit(
                f"python -m zerofn run: unknown flag {tok!r} before the script; the flags are torchrun's "
                "(python -m torch.distributed.run --help) plus --num_gpus and --num_nodes"
            )
        out.append(name + eq + value if eq else name)
        if name in valued and not eq:
            if i + 1 >= len(argv):
                raise SystemExit(f"python -m zerofn run: {tok} needs a value")
            out.append(argv[i + 1])
            i += 1
        i += 1
    script = argv[i:]
    if not script:
        raise SystemExit("python -m zerofn run: no script given: python -m zerofn run --nproc_per_node N train.py ...")
    nnodes = "1"
    for j, tok in enumerate(out):
        if tok == "--nnodes" and j + 1 < len(out):
            nnodes = out[j + 1]
        elif tok.startswith("--nnodes="):
            nnodes = tok.split("=", 1)[1]
    named = {t.partition("=")[0] for t in out}
    if nnodes in ("1", "1:1") and not named & set(RENDEZVOUS):
        out.append("--standalone")  # one machine: a local rendezvous on a free port
    return out, script


def _missing_script(flags: list[str], script: list[str]) -> str | None:
    """What is wrong with the script's path (None: nothing), before torchrun starts ranks that fail on it."""
    if {t.partition("=")[0] for t in flags} & {"-m", "--module", "--no-python", "--no_python"}:
        return None  # a module's name, or a program found on PATH
    path = script[0]
    if os.path.isdir(path):
        return f"python -m zerofn run: {path} is a directory; pass the training script (a .py file) to run"
    if not os.path.isfile(path):
        return (
            f"python -m zerofn run: {path}: no such script; pass the path of the training script to run "
            "(or -m MODULE for a module)"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with ``argv`` translated; returns its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("Example:")[0].strip())
        return 0
    flags, script = _translate(argv)
    problem = _missing_script(flags, script)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    args = flags + script
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning banner
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(args)
    except ChildFailedError as e:
        print(f"python -m zerofn run: {e.name} failed; see the ranks' errors above", file=sys.stderr)
        return 1
    return 0
