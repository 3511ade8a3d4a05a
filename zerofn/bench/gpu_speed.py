"""GPU throughput, fraction of bf16 peak and peak memory: torch AMP, FSDP2, DeepSpeed and zerofn.

The speed half of ``python -m zerofn.bench gpu`` (which picks the pairs it
compares), and a command of its own for any subset of systems
(``examples/bench_gpu.py`` runs it too). It builds the GPT of
:mod:`zerofn.bench.gpt` at the size given on the command line and trains it
with each system in a fresh process of its own (one process per rank: plain
python for one rank, ``python -m torch.distributed.run --standalone`` for
more), so that no system inherits another's allocator state, compiled
kernels or memory. Each child prints one JSON line; the parent collects them
and prints a table side by side.

This module is the command line (:func:`parse_args`, :func:`main`) and
re-exports the names of its parts: ``_speed_systems`` the systems and their
builders, ``_speed_run`` one system in processes of its own (the parent's
child per system, and :func:`run_one` in the child), ``_speed_rows`` the
model FLOPs, the GPU's peak and the rows of the table.

On a GPU box (one H100/H200/A100/L4 is recognised; otherwise pass --peak-tflops):

    python -m zerofn.bench.gpu_speed --dim 2048 --layers 24 --seq-len 1024 --batch 16
    python -m zerofn.bench.gpu_speed --dim 2048 --layers 24 --seq-len 1024 --batch 8 --nproc 8 --out bench.md
    python -m zerofn.bench.gpu_speed --systems torch-amp fsdp2 zf-z3-amp --steps 50 --warmup 10

A smoke run on the CPU (fraction of peak reported as n/a; DeepSpeed skipped):

    python -m zerofn.bench.gpu_speed --device cpu --dim 64 --layers 2 --seq-len 32 --batch 2 --steps 2 --warmup 1 \\
        --systems torch-amp zf-amp zf-z3-amp fsdp2

Systems (the same model from the same seed, the same data, AdamW with the
same hyper-parameters, no gradient clipping):

- ``torch-amp``: the plain module (DDP over more than one rank) under
  ``torch.autocast(bf16)``, fused ``torch.optim.AdamW`` on fp32 parameters.
- ``fsdp2``: ``fully_shard`` on every block and on the root, with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fused AdamW.
- ``deepspeed-z2``, ``deepspeed-z3``: ``deepspeed.initialize`` with bf16 and
  ZeRO stage 2 / 3 and torch's fused AdamW over DeepSpeed's fp32 partitions
  (the Adam kernel of every other row; no gradient clipping, DeepSpeed's
  default being 1.0), when ``import deepspeed`` works (otherwise
  reported as "not installed"; CUDA only); ``deepspeed-z2-offload``: stage 2
  with ``offload_optimizer`` to pinned CPU memory and DeepSpeed's CPU Adam
  (ZeRO-Offload).
- zerofn: ``zf-amp`` = amp(train_step), ``zf-z1-amp`` (+ shard_optimizer),
  ``zf-z2-amp`` (+ shard_grads), ``zf-z3-amp`` (+ shard_params),
  ``zf-z2-amp-offload`` (+ offload("cpu"): the host update overlapping the
  next forward), ``zf-z2-amp-offload-sync`` (overlap=False: the update
  before the step returns), ``zf-z2-amp-offload-early`` (early=True: each
  bucket's update starts during backward, speculatively),
  ``zf-z2-amp-offload-delay`` (delay=1, which changes the numbers),
  ``zf-z3-amp-remat`` (+ remat).

Reported per system: the step time of a loop of --steps consecutive steps
after --warmup (the device synchronised before and after the loop only, as a
training loop waits; the fastest of --rounds loops, each loop's time the
slowest rank's), tokens/s over all ranks, model FLOPs per token
= 6 x parameters + 12 x layers x seq_len x dim (the attention scores; the
recomputation under remat is not counted, as is usual for MFU), the fraction
of peak = achieved FLOP/s / (peak x ranks), peak memory per rank (CUDA:
torch.cuda.max_memory_allocated over set-up and steps, the largest rank;
CPU: zf.memory.track() over set-up and warm-up, which counts every live
tensor), the memory held between steps, zerofn's own count of its state
(``zf.memory.state_bytes``, on the device), the final loss, and speed and peak
memory against torch-amp. Memory an offloaded system keeps in host RAM is
not in the CUDA figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

from zerofn.bench._speed_rows import (
    PEAKS,
    flops_per_token,
    format_markdown,
    format_table,
    mib,
    peak_tflops_for,
    rows,
)
from zerofn.bench._speed_run import MODULE, RESULT_TAG, gpu_name, run_one, run_system
from zerofn.bench._speed_systems import (
    BETAS,
    DEEPSPEED_SYSTEMS,
    EPS,
    LR,
    SYSTEMS,
    TORCH_SYSTEMS,
    WD,
    ZF_SYSTEMS,
    gpt_params,
    zf_composition,
)

__all__ = [
    "BETAS",
    "DEEPSPEED_SYSTEMS",
    "EPS",
    "LR",
    "MODULE",
    "PEAKS",
    "RESULT_TAG",
    "SYSTEMS",
    "TORCH_SYSTEMS",
    "WD",
    "ZF_SYSTEMS",
    "flops_per_token",
    "format_markdown",
    "format_table",
    "gpt_params",
    "gpu_name",
    "main",
    "parse_args",
    "peak_tflops_for",
    "rows",
    "run_one",
    "run_system",
    "zf_composition",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: dim // 128, at least 1)")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per step per rank")
    p.add_argument("--steps", type=int, default=20, help="consecutive steps timed as one loop")
    p.add_argument("--rounds", type=int, default=2, help="timed loops (the fastest is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        choices=SYSTEMS,
        metavar="SYSTEM",
        help=f"a subset of: {' '.join(SYSTEMS)} (default: all)",
    )
    p.add_argument("--nproc", type=int, default=1, help="ranks (processes, one GPU each) per system")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's dense bf16 peak (TFLOP/s); known: H100/H200 SXM 989, H100 PCIe 756, A100 312, L4 121",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (fraction of peak n/a)")
    p.add_argument("--out", default=None, metavar="FILE.md", help="also write the table as markdown")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per system before it is given up")
    p.add_argument("--verbose", action="store_true", help="print a failed system's output")
    p.add_argument("--one", default=None, choices=SYSTEMS, help=argparse.SUPPRESS)  # a child: run one system
    args = p.parse_args(argv)
    if args.heads is None:
        args.heads = max(1, args.dim // 128)
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if (
        min(args.dim, args.layers, args.vocab, args.seq_len, args.batch, args.steps, args.rounds, args.nproc) < 1
        or args.warmup < 0
    ):
        p.error("sizes, --steps and --nproc must be at least 1, --warmup at least 0")
    if args.out is not None:  # checked before the run, which takes minutes
        where = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out):
            p.error(f"--out {args.out} is a directory; pass the name of a file to write")
        if not os.path.isdir(where):
            p.error(
                f"--out {args.out}: the directory it goes in, {where}, does not exist; create it (mkdir -p "
                f"{where}) or pass a file in an existing directory"
            )
    return args


def main(argv=None) -> list[dict] | None:
    args = parse_args(argv)
    if args.one:
        result = run_one(args)
        if result is not None:
            print(RESULT_TAG + json.dumps(result), flush=True)
        return None
    gpu = gpu_name(args.device)
    peak = args.peak_tflops
    if args.device == "cuda" and peak is None:
        peak = peak_tflops_for(gpu)
        if peak is None:
            raise SystemExit(f"gpu benchmark: unknown bf16 peak for {gpu!r}; pass --peak-tflops")
    if args.device == "cpu":
        peak = None  # no meaningful peak
    from zerofn.bench.gpt import GPTConfig

    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers)
    n_params = gpt_params(cfg)
    fpt = flops_per_token(n_params, args.layers, args.seq_len, args.dim)
    print(
        f"GPT {n_params / 1e6:,.1f} M parameters (dim {args.dim}, {args.layers} layers, {args.heads} heads, "
        f"vocab {args.vocab}), {fpt / 1e9:.3g} GFLOP/token; {args.nproc} rank(s) x batch {args.batch} x seq "
        f"{args.seq_len}; {gpu}" + (f", bf16 peak {peak:g} TFLOP/s per rank" if peak else ""),
        flush=True,
    )
    results = []
    for system in args.systems:
        t0 = time.perf_counter()
        r = run_system(args, system)
        results.append(r)
        what = r.get("skipped") or f"{r['tokens_per_s']:,.0f} tokens/s, {mib(r['peak_bytes'])} MiB peak"
        print(f"  {system}: {what} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    header, body = rows(results, peak)
    print(format_table(header, body))
    if args.out:
        given = sys.argv[1:] if argv is None else list(argv)
        command = shlex.join(["python", "-m", MODULE, *given])
        notes = [
            f"model: GPT {n_params:,} parameters, dim {args.dim}, {args.layers} layers, {args.heads} heads, "
            f"vocab {args.vocab}, seq_len {args.seq_len}; {args.batch} sequences per rank per step, "
            f"{args.nproc} rank(s)",
            f"fastest of {args.rounds} loops of {args.steps} consecutive steps after {args.warmup} warm-up steps; model FLOPs per token "
            f"6 N + 12 L T d = {fpt:,}" + (f"; bf16 peak {peak:g} TFLOP/s per rank" if peak else "; peak: n/a on cpu"),
            "peak memory: "
            + (
                "torch.cuda.max_memory_allocated, largest rank"
                if args.device == "cuda"
                else "zf.memory.track() over set-up and warm-up (live tensor bytes)"
            ),
        ]
        with open(args.out, "w") as f:
            f.write(format_markdown(header, body, gpu=gpu, command=command, notes=notes))
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
