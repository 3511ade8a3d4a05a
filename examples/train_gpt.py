"""Train a small GPT on a synthetic Markov corpus with zerofn's transforms.

One process:

    python examples/train_gpt.py

Two ranks on this machine (gloo on CPU, nccl on GPUs), ZeRO stage 1, 2 or 3:

    torchrun --nproc_per_node=2 examples/train_gpt.py --zero 1
    torchrun --nproc_per_node=2 examples/train_gpt.py --zero 2 --accumulate 2
    torchrun --nproc_per_node=2 examples/train_gpt.py --zero 3 --amp bf16 --remat

Every rank feeds its own slice of the global batch; the result equals one
process fed the whole batch. The loss should fall far below the corpus's
unigram entropy (what a model that ignores context can reach) towards the
chain's conditional entropy (the floor); both are printed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zerofn as zf  # noqa: E402
from gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for, unigram_entropy  # noqa: E402
from zerofn.transforms import amp, remat, shard_grads, shard_optimizer, shard_params  # noqa: E402

STAGES = {0: lambda s: s, 1: shard_optimizer, 2: shard_grads, 3: shard_params}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero", type=int, default=0, choices=sorted(STAGES), help="ZeRO stage (0 = plain data parallel)")
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
    return p.parse_args(argv)


def main(argv=None) -> float:
    args = parse_args(argv)
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    if args.batch % (world * args.accumulate):
        raise SystemExit(f"--batch {args.batch} must split evenly over {world} ranks x {args.accumulate} micro-batches")
    torch.manual_seed(args.seed)
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=4, layers=args.layers)
    model = GPT(cfg)
    apply = zf.functional(model)
    schedule = zf.optim.warmup_cosine_decay_schedule(0.0, args.lr, args.steps // 10, args.steps, args.lr / 10)
    optimizer = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(schedule, weight_decay=0.1))
    step = STAGES[args.zero](zf.train_step(loss_fn_for(apply), optimizer, args.accumulate))
    if args.amp:
        step = amp(step, {"bf16": torch.bfloat16, "fp16": torch.float16}[args.amp])
    if args.remat:
        step = remat(step)
    state = step.init(apply.params)

    corpus = MarkovCorpus(vocab=args.vocab, seed=args.seed)
    local = args.batch // world
    micro = local // args.accumulate
    loud = rank == 0 and not args.quiet
    if loud:
        n = sum(p.numel() for p in apply.params.values())
        print(f"{step.name} on {world} rank(s): {n:,} parameters, global batch {args.batch} x {args.seq_len} tokens")
        print(state)
    bar = tqdm(range(args.steps), disable=not loud, desc="train", dynamic_ncols=True)
    tokens = 0
    start = time.perf_counter()
    sample = corpus.sample(args.batch * 4, args.seq_len + 1, seed=10_000)
    for i in bar:
        batch = corpus.sample(args.batch, args.seq_len + 1, seed=args.seed * 1_000_003 + i)
        mine = batch[rank * local : (rank + 1) * local]
        for m in range(args.accumulate):
            state, metrics = step(state, mine[m * micro : (m + 1) * micro])
        tokens += args.batch * args.seq_len
        if i % 10 == 0 or i == args.steps - 1:
            rate = tokens / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{float(metrics['loss']):.3f}", tok_s=f"{rate:,.0f}")
    elapsed = time.perf_counter() - start
    logits = step.apply(state, sample[:, :-1])  # per unit under ZeRO-3: no rank holds the whole model
    eval_loss = float(
        torch.nn.functional.cross_entropy(logits.float().reshape(-1, args.vocab), sample[:, 1:].reshape(-1))
    )
    if loud:
        print(f"unigram entropy      {unigram_entropy(sample, args.vocab):.3f} nats (no context)")
        print(f"conditional entropy  {corpus.conditional_entropy():.3f} nats (the floor)")
        print(f"final train loss     {float(metrics['loss']):.3f}")
        print(f"held-out loss        {eval_loss:.3f}")
        print(f"throughput           {tokens / elapsed:,.0f} tokens/s over {args.steps} steps ({elapsed:.1f} s)")
        print(f"state on rank 0      {zf.memory.state_bytes(state)['total'] / 2**20:.2f} MiB")
    return eval_loss


if __name__ == "__main__":
    main()
