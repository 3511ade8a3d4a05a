"""Tensor parallelism: tp 2 x dp 2 (``tensor_parallel(shard_params(step), 2)``) against dp 4 (``shard_params``).

    torchrun --nproc_per_node 4 examples/bench_tp.py                        # about 20 M parameters, CPU, gloo
    torchrun --nproc_per_node 4 examples/bench_tp.py --layers 2 --hidden 64 --intermediate 128 --steps 1

A Llama-shaped Hugging Face model built from a config (nothing downloaded;
grouped-query attention, an untied head), AdamW, fp32. Two systems on the
same ranks and the same global batch, trained in the same process, taking
turns:

- ``dp 4``: ``shard_params(step)`` (ZeRO-3) over all the ranks; each rank
  feeds ``global batch / world`` sequences;
- ``tp 2 x dp 2``: ``tensor_parallel(shard_params(step), 2)``: each block's
  projections, the embedding and the head split over 2 consecutive ranks
  (Megatron's pairing), ZeRO-3 over the ``world / 2`` data-parallel ranks;
  the 2 ranks of a tensor-parallel group feed the same ``global batch /
  (world / 2)`` sequences (``zf.collectives.data_rank(step)`` picks them).

Printed per rank, from the same run: the bytes its state holds
(``zf.memory.state_bytes``), the collective bytes of one step
(``metrics["comm_bytes"]``, with the tensor-parallel all-reduces among
them, counted apart on the tensor-parallel group), the peak of the tensor
bytes a step allocates (``zf.memory.track`` over one untimed step) and the
step time: the wall time of ``--steps`` consecutive steps over their number,
a loop per system per round after a warm-up round, the systems taking turns
in each round (in a rotated order) so that the noise of a shared machine
falls on both alike; the median over the rounds. Then the tp / dp ratios
(the step time's: the median of the rounds' ratios, each taken between
loops run side by side), what the step's tensor-parallel all-reduces take
timed alone (the same count and sizes, back to back), and the check that
both reach the same loss after the same steps (the same math on the same
global batch: within ``--loss-tol``; exit status 1 otherwise). ``--json FILE`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_helpers import add_shape_args, build_llama, proc_status  # noqa: E402
from cli_paths import output_file  # noqa: E402

DP, TP = "dp", "tp"


def parse_args(argv=None):
    """The command line, its path checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, hidden=512, intermediate=1408, layers=4, heads=8, kv_heads=4, vocab=8000)
    p.add_argument("--tp", type=int, default=2, help="ranks per tensor-parallel group")
    p.add_argument("--global-batch", type=int, default=8, help="sequences per step over all the ranks")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=3, help="consecutive steps timed per system per round")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds, after a warm-up round")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--loss-tol", type=float, default=1e-4, help="the two systems' last losses may differ by this")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure here (rank 0)")
    args = p.parse_args(argv)
    if min(args.steps, args.rounds, args.global_batch, args.seq_len, args.tp) < 1:
        p.error("--steps, --rounds, --global-batch, --seq-len and --tp must be at least 1")
    output_file(p, "--json", args.json)
    return args


if __name__ == "__main__":
    parse_args()  # a wrong command line or path fails here, before torch and transformers are imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402
from zerofn.transforms import shard_params, tensor_parallel  # noqa: E402

import zerofn as zf  # noqa: E402
import zerofn.mesh  # noqa: E402
from zerofn.bench.gpt import MarkovCorpus  # noqa: E402


def build_model(args):
    """The same Llama on every rank and for both systems (a fresh module each: tensor_parallel splits its layers)."""
    return build_llama(args, args.seq_len)


def build_step(name: str, apply, args):
    def loss_fn(params, batch):
        logits = apply(params, input_ids=batch[:, :-1], use_cache=False).logits  # a DTensor split on the vocabulary
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))  # under tp

    step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(args.lr, weight_decay=0.0)))
    return tensor_parallel(step, args.tp) if name == TP else step


def label(name: str, args, world: int) -> str:
    return f"tp {args.tp} x dp {world // args.tp}" if name == TP else f"dp {world}"


def all_reduce_s(args, group, rows: int) -> float:
    """Seconds the tensor-parallel all-reduces of one step take alone: ``4 x layers + 2`` all-reduces of a
    data-parallel rank's activations (``rows x seq-len x hidden`` fp32) on the tensor-parallel group, timed
    back to back (the median of three loops, after one untimed)."""
    x = torch.randn(rows, args.seq_len, args.hidden)
    runs = []
    for _ in range(4):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        for _ in range(4 * args.layers + 2):
            torch.distributed.all_reduce(x, group=group)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[1:])


def main(argv=None) -> None:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    zf.collectives.init()
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    if world % args.tp or args.global_batch % world:
        raise SystemExit(
            f"bench_tp.py: --tp {args.tp} must divide the {world} ranks, and the {world} ranks --global-batch "
            f"{args.global_batch}"
        )
    corpus = MarkovCorpus(vocab=args.vocab, seed=0)
    n_batches = (args.rounds + 1) * args.steps + 1  # every round's loop, then the tracked step
    data = corpus.sample(n_batches * args.global_batch, args.seq_len + 1, seed=1)
    tensor_group = zerofn.mesh.make(tp=args.tp).group("tp")

    systems, figures, n, feeds = {}, {}, 0, {}
    for name in (DP, TP):
        model = build_model(args)
        n = sum(p.numel() for p in model.parameters())
        apply = zf.functional(model)
        step = build_step(name, apply, args)
        t0 = time.perf_counter()
        state = step.init(apply.params)
        t_init = time.perf_counter() - t0
        del model
        here, dp = zf.collectives.data_rank(step), zf.collectives.world_size(step.group)
        feeds[name] = (here, dp)
        held = zf.memory.state_bytes(state)
        figures[name] = {
            "label": label(name, args, world),
            "state": {k: v for k, v in held.items() if k != "by_placement"},
            "data_rank": here,
            "data_ranks": dp,
            "rows": args.global_batch // dp,
            "init_s": t_init,
        }
        systems[name] = [step, state]

    def batch(name: str, i: int) -> torch.Tensor:
        rows = data[i * args.global_batch : (i + 1) * args.global_batch]
        here, dp = feeds[name]
        per = args.global_batch // dp
        return rows[here * per : (here + 1) * per]

    load_before = os.getloadavg()[0]
    names = list(systems)
    times: dict = {name: [] for name in names}
    bar = tqdm(total=(args.rounds + 1) * len(names), desc="rounds", disable=rank != 0 or args.quiet, leave=False)
    for r in range(args.rounds + 1):  # round 0 warms up
        bar.set_description(f"round {r} of {args.rounds}" if r else "warm-up round")
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, state = systems[name]
            zf.block_until_ready(state)
            t0 = time.perf_counter()
            for k in range(args.steps):
                state, m = step(state, batch(name, r * args.steps + k))
                if r == 0 and k == 0:  # untimed round
                    figures[name]["first_loss"] = float(m["loss"])
            zf.block_until_ready(state)
            elapsed = time.perf_counter() - t0
            if r:
                times[name].append(elapsed / args.steps)
            systems[name][1] = state
            bar.update(1)
    bar.close()
    for name in names:  # one more step each, untimed: its traffic and the peak of what it allocates
        step, state = systems[name]
        with zf.collectives.counting(group=tensor_group) if tensor_group is not None else _none() as tensor_c:
            with zf.memory.track() as tracker:
                state, m = step(state, batch(name, (args.rounds + 1) * args.steps))
            zf.block_until_ready(state)
        systems[name][1] = state
        f = figures[name]
        f["comm_bytes"] = int(m["comm_bytes"])
        f["tensor_comm_bytes"] = tensor_c.bytes if name == TP and tensor_c is not None else 0
        f["step_peak"] = tracker.peak
        f["last_loss"] = float(m["loss"])
        f["step_s"] = statistics.median(times[name])
        f["step_s_all"] = times[name]
    load = (load_before, os.getloadavg()[0])
    if tensor_group is not None:  # what the activations' all-reduces cost a step, timed alone
        figures[TP]["all_reduce_s"] = all_reduce_s(args, tensor_group, figures[TP]["rows"])
    every = [None] * world
    torch.distributed.all_gather_object(every, {"figures": figures, "peak_rss": proc_status("VmHWM"), "times": times})
    ok = True
    if rank == 0:
        ratios, ok = report(args, every, n, load)
        if args.json:
            out = {"args": vars(args), "parameters": n, "load_average": load, "same_loss": ok}
            with open(args.json, "w") as f:
                json.dump({**out, "ranks": every, "ratios": ratios}, f, indent=1)
    flag = torch.tensor([0 if ok else 1])
    torch.distributed.broadcast(flag, 0)
    torch.distributed.destroy_process_group()
    if int(flag):
        raise SystemExit(1)


class _none:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def report(args, every: list, n: int, load: tuple) -> tuple[dict, bool]:
    """Print the figures of every rank, the tp / dp ratios and the loss check; returns the ratios and the check."""
    mib = 2**20
    world = len(every)
    f0 = every[0]["figures"]
    print(
        f"Llama {n / 1e6:,.1f} M parameters (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"{args.kv_heads} kv heads, intermediate {args.intermediate}, vocab {args.vocab}, untied head), AdamW fp32; "
        f"{world} ranks, global batch {args.global_batch} x {args.seq_len} tokens ({f0[DP]['rows']} sequences per "
        f"rank under {f0[DP]['label']}, {f0[TP]['rows']} per data-parallel rank under {f0[TP]['label']}); step time: "
        f"{args.steps} consecutive steps per round, median (and best) of {args.rounds} rounds; load average "
        f"{load[0]:.2f} before, {load[1]:.2f} after"
    )
    print(
        f"{'system':<14}{'rank':>5}{'params MiB':>12}{'optimizer MiB':>15}{'state MiB':>11}{'comm MiB/step':>15}"
        f"{'of which tp':>13}{'step peak MiB':>15}{'step s':>15}{'loss':>22}"
    )
    for name in (DP, TP):
        for r, out in enumerate(every):
            f = out["figures"][name]
            step_s = f"{f['step_s']:.2f} ({min(out['times'][name]):.2f})"
            print(
                f"{f['label']:<14}{r:>5}{f['state']['params'] / mib:>12.2f}{f['state']['optimizer'] / mib:>15.2f}"
                f"{f['state']['total'] / mib:>11.2f}{f['comm_bytes'] / mib:>15.1f}{f['tensor_comm_bytes'] / mib:>13.1f}"
                f"{f['step_peak'] / mib:>15.1f}{step_s:>15}{f['first_loss']:>11.5f} ->{f['last_loss']:>8.5f}"
            )
    print("peak RSS per rank: " + ", ".join(f"{out['peak_rss'] / 2**30:.2f} GiB" for out in every))
    ratios = {}
    for r, out in enumerate(every):
        a, b = out["figures"][TP], out["figures"][DP]
        per_round = [x / y for x, y in zip(out["times"][TP], out["times"][DP])]  # taken side by side
        ratio = {
            "params": a["state"]["params"] / b["state"]["params"],
            "optimizer": a["state"]["optimizer"] / b["state"]["optimizer"],
            "state": a["state"]["total"] / b["state"]["total"],
            "comm_bytes": a["comm_bytes"] / b["comm_bytes"],
            "step_peak": a["step_peak"] / b["step_peak"],
            "step_s": statistics.median(per_round),
            "step_s_rounds": per_round,
        }
        ratios[f"rank {r}"] = ratio
        print(
            f"{a['label']} / {b['label']}, rank {r}: state {ratio['state']:.3f} (params {ratio['params']:.3f}, "
            f"optimizer {ratio['optimizer']:.3f}), comm {ratio['comm_bytes']:.2f}, step peak {ratio['step_peak']:.2f}, "
            f"step time {ratio['step_s']:.2f} (median of the rounds' ratios, {min(per_round):.2f} to "
            f"{max(per_round):.2f}); the tensor-parallel all-reduces alone {1e3 * a.get('all_reduce_s', 0):.0f} ms a step"
        )
    steps = (args.rounds + 1) * args.steps + 1
    diff = max(abs(out["figures"][TP]["last_loss"] - out["figures"][DP]["last_loss"]) for out in every)
    ok = diff <= args.loss_tol
    print(
        f"loss after {steps} steps: {f0[DP]['label']} {f0[DP]['last_loss']:.6f}, {f0[TP]['label']} "
        f"{f0[TP]['last_loss']:.6f}: {'the same' if ok else 'NOT the same'} within {args.loss_tol:g} "
        f"(largest difference on any rank {diff:.2e})"
    )
    return ratios, ok


if __name__ == "__main__":
    main()
