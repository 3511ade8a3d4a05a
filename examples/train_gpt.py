"""Train a small GPT on a synthetic Markov corpus with zerofn's transforms.

One process:

    python examples/train_gpt.py

Two ranks on this machine (gloo on CPU, nccl on GPUs), ZeRO stage 1, 2 or 3:

    torchrun --nproc_per_node=2 examples/train_gpt.py --zero 1
    torchrun --nproc_per_node=2 examples/train_gpt.py --zero 2 --accumulate 2
    torchrun --nproc_per_node=2 examples/train_gpt.py --zero 3 --amp bf16 --remat
    torchrun --nproc_per_node=4 examples/train_gpt.py --zero 3 --replicate 2     # HSDP: 2 "nodes" of 2

Every rank feeds its own slice of the global batch; the result equals one
process fed the whole batch. The loss should fall far below the corpus's
unigram entropy (what a model that ignores context can reach) towards the
chain's conditional entropy (the floor); both are printed.

With --ckpt-dir it saves a checkpoint every --save-every steps (in the
background, keeping the newest --keep) and, started again (by hand, or by
torchrun --max-restarts after a rank died), resumes from the newest one to
the same parameters, bit for bit, as a run that never stopped:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc_per_node=2 --max-restarts=3 examples/train_gpt.py --ckpt-dir c

(without that variable torchrun's restarted workers find the dead ones'
addresses in the store they share with the first attempt, and gloo often
fails to connect: pytorch/pytorch#135712).

To train in parts (stop at step 100, later go on to 150), give every part
the whole run's learning-rate schedule:

    python examples/train_gpt.py --ckpt-dir c --steps 100 --schedule-steps 150
    python examples/train_gpt.py --ckpt-dir c --steps 150

From a DeepSpeed config instead (zf.from_deepspeed: its ZeRO stage,
precision, optimizer, scheduler, clipping and batch sizes):

    torchrun --nproc_per_node=2 examples/train_gpt.py --deepspeed examples/ds_config.json
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_paths import existing_file, output_dir, output_file  # noqa: E402

DEFAULT_SAVE_EVERY = 50


def parse_args(argv=None):
    """The command line, its paths checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (0 = plain data parallel)")
    p.add_argument(
        "--replicate",
        type=int,
        default=None,
        metavar="N",
        help="with --zero 1-3: hybrid sharding, N replicas (nodes) each sharding over its ranks",
    )
    p.add_argument(
        "--hpz",
        type=int,
        default=None,
        metavar="K",
        help="with --zero 3: ZeRO++'s hpZ, backward gathers within nodes of K ranks",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="ZeRO++'s int8 collectives: gradients reduce-scattered as int8 (--zero 2, 3; qgZ), "
        "parameters gathered as int8 (--zero 3; qwZ)",
    )
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences), split over ranks")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per update on each rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--amp", choices=["bf16", "fp16"], default=None, help="mixed precision (fp32 master weights)")
    p.add_argument("--remat", action="store_true", help="recompute each block's activations in backward")
    p.add_argument("--quiet", action="store_true", help="no progress bar or report (returns the held-out loss)")
    p.add_argument("--constant-lr", action="store_true", help="--lr throughout, no warmup or decay")
    p.add_argument(
        "--schedule-steps",
        type=int,
        default=None,
        metavar="N",
        help="length of the learning-rate schedule (default: --steps); set it to the whole run's length when "
        "training in parts with --ckpt-dir and a growing --steps",
    )
    p.add_argument("--ckpt-dir", default=None, metavar="DIR", help="save checkpoints here and resume from the newest")
    p.add_argument(
        "--save-every",
        type=int,
        default=None,
        metavar="K",
        help=f"steps between checkpoints (default {DEFAULT_SAVE_EVERY}; the last step is always saved)",
    )
    p.add_argument("--keep", type=int, default=2, metavar="N", help="checkpoints to keep (the newest N)")
    p.add_argument(
        "--deepspeed",
        default=None,
        metavar="JSON",
        help="build the step from this DeepSpeed config (zf.from_deepspeed): its ZeRO stage, fp16/bf16, "
        "activation checkpointing, optimizer, scheduler, clipping and batch sizes win over --zero, --amp, --remat, "
        "--accumulate, --batch, --lr and --schedule-steps, which are then ignored (e.g. examples/ds_config.json)",
    )
    p.add_argument("--out", default=None, metavar="FILE", help="write the final state_dict here (torch.save)")
    p.add_argument(
        "--jsonl",
        default=None,
        metavar="FILE",
        help="append rank 0's metrics here, one JSON line every 10 steps and on the last",
    )
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write rank 0's metrics to TensorBoard here (needs pip install tensorboard)",
    )
    p.add_argument(
        "--die-at-step",
        type=int,
        default=None,
        metavar="S",
        help="test hook: on torchrun's first attempt, rank 1 (rank 0 alone) kills itself (SIGKILL) after step S",
    )
    args = p.parse_args(argv)
    if args.save_every is not None and args.ckpt_dir is None:
        p.error("--save-every needs --ckpt-dir")
    if args.save_every is None:
        args.save_every = DEFAULT_SAVE_EVERY
    if args.save_every < 1 or args.keep < 1:
        p.error("--save-every and --keep must be at least 1")
    if args.schedule_steps is None:
        args.schedule_steps = args.steps
    existing_file(p, "--deepspeed", args.deepspeed, "pass a DeepSpeed config JSON file (e.g. examples/ds_config.json)")
    output_dir(p, "--ckpt-dir", args.ckpt_dir)
    output_file(p, "--out", args.out)
    output_file(p, "--jsonl", args.jsonl)
    output_dir(p, "--tensorboard", args.tensorboard)
    return args


if __name__ == "__main__":
    parse_args()  # a wrong command line or path fails here, before torch is imported

import torch  # noqa: E402
from gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for, unigram_entropy  # noqa: E402
from zerofn.transforms import amp, remat, shard_grads, shard_optimizer, shard_params  # noqa: E402

import zerofn as zf  # noqa: E402

STAGES = {0: lambda s: s, 1: shard_optimizer, 2: shard_grads, 3: shard_params}


def first_attempt() -> bool:
    """False when torchrun restarted the workers (--max-restarts) after a failure."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def build_step(args, apply):
    """The step the command-line flags ask for."""
    total = args.schedule_steps
    schedule = (
        args.lr
        if args.constant_lr
        else zf.optim.warmup_cosine_decay_schedule(0.0, args.lr, total // 10, total, args.lr / 10)
    )
    optimizer = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(schedule, weight_decay=0.1))
    options = {}  # multi-node options of the ZeRO stages (docs/transforms/multinode.md)
    if args.replicate is not None:
        options["replicate"] = args.replicate
    if args.hpz is not None:
        options["hpz"] = args.hpz
    if args.int8 and args.zero >= 2:
        options["reduce_dtype"] = "int8"
    if args.int8 and args.zero == 3:
        options["gather_dtype"] = "int8"
    if options and args.zero == 0:
        raise SystemExit("--replicate, --hpz and --int8 are options of a ZeRO stage: give --zero 1, 2 or 3")
    step = STAGES[args.zero](zf.train_step(loss_fn_for(apply), optimizer, args.accumulate), **options)
    if args.amp:
        step = amp(step, {"bf16": torch.bfloat16, "fp16": torch.float16}[args.amp])
    if args.remat:
        step = remat(step)
    return step


def main(argv=None) -> float:
    args = parse_args(argv)
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=4, layers=args.layers)
    model = GPT(cfg)
    apply = zf.functional(model)
    if args.deepspeed:
        step, ds_batch = zf.from_deepspeed(args.deepspeed, loss_fn_for(apply))
        # The config's batch sizes win: each rank feeds its micro-batch, accumulate_steps of them per update.
        args.accumulate = step.accumulate_steps
        args.batch = ds_batch.micro_batch_size * step.accumulate_steps * world
    else:
        step = build_step(args, apply)
    if args.batch % (world * args.accumulate):
        raise SystemExit(f"--batch {args.batch} must split evenly over {world} ranks x {args.accumulate} micro-batches")
    latest = zf.checkpoint.latest(args.ckpt_dir) if args.ckpt_dir and os.path.isdir(args.ckpt_dir) else None
    if latest is not None:
        state = zf.checkpoint.load(latest, step)  # every rank; optimizer moments, count, loss scale, RNG
    else:
        state = step.init(apply.params)
    first = int(state.count)  # the batch of step i depends on i and the seed only, so a resumed run goes on alike
    if first > args.steps:
        raise SystemExit(f"{latest} holds step {first}, past --steps {args.steps}")

    corpus = MarkovCorpus(vocab=args.vocab, seed=args.seed)
    local = args.batch // world
    micro = local // args.accumulate
    loud = rank == 0 and not args.quiet
    if loud:
        n = sum(p.numel() for p in apply.params.values())
        print(f"{step.name} on {world} rank(s): {n:,} parameters, global batch {args.batch} x {args.seq_len} tokens")
        if latest is not None:
            print(f"resumed from {latest} at step {first}")
        print(state)
    log = zf.metrics.Logger(
        args.steps,
        start=first,
        tokens_per_step=args.batch * args.seq_len,
        every=10,
        jsonl=args.jsonl,
        tensorboard=args.tensorboard,
        desc="train",
        bar=loud,
    )
    tokens = 0
    metrics = None
    saving = None  # the checkpoint being written in the background
    die = args.die_at_step is not None and first_attempt() and rank == min(1, world - 1)
    start = time.perf_counter()
    sample = corpus.sample(args.batch * 4, args.seq_len + 1, seed=10_000)
    for i in range(first, args.steps):
        batch = corpus.sample(args.batch, args.seq_len + 1, seed=args.seed * 1_000_003 + i)
        mine = batch[rank * local : (rank + 1) * local]
        for m in range(args.accumulate):
            state, metrics = step(state, mine[m * micro : (m + 1) * micro])
        tokens += args.batch * args.seq_len
        log.log(i, metrics)  # reads the loss every 10 steps and on the last, on rank 0
        done = i + 1  # == int(state.count): updates applied
        if args.ckpt_dir and (done % args.save_every == 0 or done == args.steps):
            if saving is not None:
                saving.wait()  # one write at a time
            path = os.path.join(args.ckpt_dir, f"step_{done:06d}")
            saving = zf.checkpoint.save(state, path, blocking=False, keep=args.keep)  # collective
        if die and done == args.die_at_step:
            os.kill(os.getpid(), signal.SIGKILL)  # as a crashed host would: no cleanup, no message
    log.close()
    if saving is not None:
        saving.wait()
    elapsed = time.perf_counter() - start
    if args.out:
        full = step.state_dict(state)  # collective: every rank gathers, rank 0 writes
        if rank == 0:
            torch.save(full, args.out)
    logits = step.apply(state, sample[:, :-1])  # per unit under ZeRO-3: no rank holds the whole model
    eval_loss = float(
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), sample[:, 1:].reshape(-1))
    )
    if loud:
        print(f"unigram entropy      {unigram_entropy(sample, args.vocab):.3f} nats (no context)")
        print(f"conditional entropy  {corpus.conditional_entropy():.3f} nats (the floor)")
        if metrics is not None:
            print(f"final train loss     {float(metrics['loss']):.3f}")
        print(f"held-out loss        {eval_loss:.3f}")
        if args.steps > first:
            ran = args.steps - first
            print(f"throughput           {tokens / elapsed:,.0f} tokens/s over {ran} steps ({elapsed:.1f} s)")
        print(f"state on rank 0      {zf.memory.state_bytes(state)['total'] / 2**20:.2f} MiB")
    return eval_loss


if __name__ == "__main__":
    main()
