"""Step time and memory of zerofn's steps against torch DDP and ZeroRedundancyOptimizer.

Systems: torch DDP, torch ZeroRedundancyOptimizer (ZeRO-1), torch FSDP2
(fully_shard on every block and the root), zerofn's plain step,
shard_optimizer (ZeRO-1), shard_grads (ZeRO-2) and shard_params (ZeRO-3);
with --amp each zerofn stage again under amp(bf16), with --remat each again
under remat, beside torch DDP with torch.utils.checkpoint on every block.

    python examples/bench.py                 # 2 gloo ranks on this machine
    python examples/bench.py --world 2 --steps 30 --dim 256 --layers 4
    python examples/bench.py --remat         # activation checkpointing's memory and cost

Every system trains the same GPT on the same data from the same seed, in the
same ranks; timed steps of the systems are interleaved in rounds so that a
noisy machine slows them alike. Reported per system: median step time and
its ratio to DDP's, optimizer-state bytes on rank 0, and peak live tensor
bytes during one step (zf.memory.track), all measured in this one run.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import zerofn as zf  # noqa: E402
from gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for  # noqa: E402
from zerofn.transforms import amp, remat, shard_grads, shard_optimizer, shard_params  # noqa: E402

LR, WD = 1e-3, 0.1


def _torch_system(cfg, zero: bool = False, fsdp: bool = False, checkpointed: bool = False):
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    model = GPT(cfg)
    if checkpointed:  # every block's activations recomputed in backward, as zf's remat does
        for block in model.blocks:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        ddp = fully_shard(model, mesh=mesh)
    else:
        ddp = DDP(model) if dist.is_initialized() else model
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=WD)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def step(batch):
        logits = ddp(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return zf.collectives.all_reduce(loss.detach(), "mean")  # zerofn reports the mean over ranks too

    def opt_bytes():
        states = opt.optim.state if zero else opt.state
        local = [getattr(t, "_local_tensor", t) for s in states.values() for t in s.values()]  # DTensor shards
        return sum(t.numel() * t.element_size() for t in local if isinstance(t, torch.Tensor))

    return step, opt_bytes


def _zf_system(cfg, transform, bucket_bytes):
    torch.manual_seed(0)
    apply = zf.functional(GPT(cfg))
    step = zf.train_step(loss_fn_for(apply), zf.optim.adamw(LR, weight_decay=WD), bucket_bytes=bucket_bytes)
    step = transform(step)
    box = [step.init(apply.params)]

    def run(batch):
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    return run, lambda: zf.memory.state_bytes(box[0])["optimizer"]


def _amp_system(cfg, mb, transform):
    return _zf_system(cfg, lambda s: amp(transform(s), torch.bfloat16), mb)


def _remat_system(cfg, mb, make):
    """The zerofn system ``make`` builds, under remat (its step is wrapped once more)."""
    original = zf.train_step

    def with_remat(*a, **k):
        return remat(original(*a, **k))

    zf.train_step = with_remat  # the systems build their step through zf.train_step
    try:
        return make(cfg, mb)
    finally:
        zf.train_step = original


SYSTEMS = {
    "torch DDP": lambda cfg, mb: _torch_system(cfg),
    "torch ZeRO-1 (ZeroRedundancyOptimizer)": lambda cfg, mb: _torch_system(cfg, zero=True),
    "torch FSDP2 (fully_shard per block + root)": lambda cfg, mb: _torch_system(cfg, fsdp=True),
    "zf train_step": lambda cfg, mb: _zf_system(cfg, lambda s: s, mb),
    "zf shard_optimizer": lambda cfg, mb: _zf_system(cfg, shard_optimizer, mb),
    "zf shard_grads": lambda cfg, mb: _zf_system(cfg, shard_grads, mb),
    "zf shard_params": lambda cfg, mb: _zf_system(cfg, shard_params, mb),
}


def bench_rank(args):
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab=64, seq_len=args.seq_len, dim=args.dim, heads=4, layers=args.layers)
    corpus = MarkovCorpus(vocab=64)
    data = corpus.sample(args.batch * world, args.seq_len + 1, seed=1)
    batch = data[rank * args.batch : (rank + 1) * args.batch]
    chosen = dict(SYSTEMS)
    if args.amp:  # each zerofn stage again in bf16 against fp32 master weights
        for name, tr in (("train_step", lambda s: s), ("shard_optimizer", shard_optimizer),
                         ("shard_grads", shard_grads), ("shard_params", shard_params)):  # fmt: skip
            chosen[f"zf {name} + amp bf16"] = functools.partial(_amp_system, transform=tr)
    if args.remat:  # each zerofn stage again under remat, and torch's checkpointing as the anchor
        for name in [n for n in chosen if n.startswith("zf ")]:
            chosen[f"{name} + remat"] = functools.partial(_remat_system, make=chosen[name])
        chosen["torch DDP + checkpoint"] = lambda cfg, mb: _torch_system(cfg, checkpointed=True)
    peaks, losses = {}, {}
    systems, setup, held = {}, {}, {}
    for name, make in chosen.items():  # build, warm up, and one tracked step each
        with zf.memory.track() as t:
            systems[name] = make(cfg, int(args.bucket_mb * 2**20))
            setup[name] = t.current  # after set-up: the model, the state (torch: no optimizer state yet)
            for _ in range(args.warmup):
                systems[name][0](batch)
        held[name] = t.current  # between steps, once everything is allocated
        with zf.memory.track() as t:
            systems[name][0](batch)
        peaks[name] = t.peak
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, (step, _) in systems.items():
            for _ in range(args.steps):
                zf.collectives.barrier()
                t0 = time.perf_counter()
                losses[name] = float(step(batch))
                times[name].append(time.perf_counter() - t0)
    return {
        name: dict(
            median=statistics.median(ts),
            opt_bytes=systems[name][1](),
            setup=setup[name],
            held=held[name],
            peak=peaks[name],
            loss=losses[name],
        )
        for name, ts in times.items()
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--steps", type=int, default=10, help="timed steps per system per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="zerofn's gradient bucket size (MiB)")
    p.add_argument("--amp", action="store_true", help="add every zerofn stage under amp(bf16)")
    p.add_argument("--remat", action="store_true", help="add every zerofn system under remat, and torch checkpoint")
    args = p.parse_args(argv)
    results = zf.spawn(bench_rank, args.world, args)
    r0 = results[0]
    n = sum(p.numel() for p in GPT(GPTConfig(vocab=64, seq_len=args.seq_len, dim=args.dim, layers=args.layers)).parameters())
    print(f"GPT {n:,} parameters, {args.world} gloo ranks, batch {args.batch} x {args.seq_len} per rank")
    print(f"{'system':<46}{'step ms':>9}{'vs DDP':>8}{'opt state MiB':>15}{'set-up MiB':>12}{'held MiB':>10}"
          f"{'peak in step':>14}{'peak MiB':>10}{'loss':>8}")  # fmt: skip
    ms = {name: max(res[name]["median"] for res in results) for name in r0}
    for name, r in r0.items():
        print(
            f"{name:<46}{1e3 * ms[name]:>9.1f}{ms[name] / ms['torch DDP']:>8.3f}{r['opt_bytes'] / 2**20:>15.2f}"
            f"{r['setup'] / 2**20:>12.2f}{r['held'] / 2**20:>10.2f}{r['peak'] / 2**20:>14.2f}"
            f"{(r['held'] + r['peak']) / 2**20:>10.2f}{r['loss']:>8.4f}"
        )
    if args.remat:
        cost = {n[: -len(" + remat")]: ms[n] / ms[n[: -len(" + remat")]] for n in ms if n.endswith(" + remat")}
        line = ", ".join(f"{n} {c:.2f}x" for n, c in cost.items())
        print(f"remat's step time against the same system without it: {line}; "
              f"torch checkpoint against DDP: {ms['torch DDP + checkpoint'] / ms['torch DDP']:.2f}x")  # fmt: skip
    return results


if __name__ == "__main__":
    main()
