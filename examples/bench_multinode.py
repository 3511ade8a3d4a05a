"""Two "nodes" on one machine: ZeRO-3 over every rank against HSDP, hpZ and qwZ + qgZ, with the link between
the nodes slowed to a chosen bandwidth.

    python examples/bench_multinode.py                          # 4 ranks as 2 nodes of 2, a 4.2 M GPT
    python examples/bench_multinode.py --hardware hw.json       # ... and the planner's figures beside
    python examples/bench_multinode.py --quick --out mn.json    # tiny, as CI runs it

It starts its ranks itself (``zf.RankPool``), so run it with plain ``python``. Four gloo ranks on one machine
share one link; this emulates a slower one between the two halves (ranks ``0 .. k-1`` are node 0, ``k ..
2k-1`` node 1, one NIC a rank of ``--inter-mbps`` MB/s): every tensor collective on a group that spans both
nodes completes no sooner than its bytes across have gone through this rank's NIC, transfers queueing on it
one after another from their issue. The bytes across are the planner's (``zerofn.plan.link_bytes``): for an
all-gather or reduce-scatter of a full tensor of ``B`` bytes over ``n`` ranks on ``N`` nodes, this rank's
``1 / (n / N)`` of the ring's ``B (N - 1) / N`` (a hierarchical collective: each GPU's NIC carries its share),
twice that for an all-reduce; an all-to-all sends what is bound for the other nodes' ranks directly, ``B (N -
1) / N``. The wait falls on the collective's ``wait()``, so compute issued in between overlaps it, as a real
link's transfer would. Within a node the machine's own speed stands.

The systems, each ``shard_params`` over the 4 ranks of the example GPT (fp32, AdamW), in the same processes,
taking turns round by round (each round a loop of ``--steps`` consecutive steps per system, after
``--warmup`` steps):

- ``zero3``: ``shard_params(step)``: every gather and reduce-scatter over all 4 ranks, across the link;
- ``hsdp``: ``shard_params(step, replicate=2)``: within each node, and one all-reduce of each shard across;
- ``hpz``: ``shard_params(step, hpz=2)``: the forward's gathers and the reduce-scatter across, backward's
  gathers within the node;
- ``qwz+qgz``: ``shard_params(step, gather_dtype="int8", reduce_dtype="int8")``: ZeRO-3's collectives as
  int8 blocks.

Reported per system: the median step time over the rounds (each the slowest rank's loop / steps), its
fastest and slowest round, ``metrics["comm_bytes_by_axis"]`` (rank 0, one step), the bytes that crossed the
link per step by the emulation's count, the losses' largest difference from ``zero3``'s, and, beside them,
``python -m zerofn plan``'s predictions for a machine described as this one (``--hardware``: a file from
``python -m zerofn plan --calibrate``, its inter-node bandwidth replaced by ``--inter-mbps``), when given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_paths import output_file  # noqa: E402

SYSTEMS = {
    "zero3": {},
    "hsdp": {"replicate": 2},
    "hpz": {"hpz": 2},
    "qwz+qgz": {"gather_dtype": "int8", "reduce_dtype": "int8"},
}
QUICK = {"dim": 32, "layers": 2, "vocab": 64, "seq": 16, "batch": 4, "steps": 2, "rounds": 1, "warmup": 1}


# ---------------------------------------------------------------- the slow link (inside each rank)


class _Late:
    """A collective's work that completes no sooner than ``deadline``."""

    def __init__(self, work, deadline: float):
        self.work, self.deadline = work, deadline

    def wait(self, *args, **kwargs):
        out = self.work.wait(*args, **kwargs)
        left = self.deadline - time.monotonic()
        if left > 0:
            time.sleep(left)
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)


LINK: dict = {"bytes_per_s": None, "free": 0.0}  # the emulated link (None: the machine's own), free from


def slow_link(ranks_per_node: int) -> dict:
    """Slow every tensor collective on a group spanning nodes to ``LINK["bytes_per_s"]`` (see the module);
    returns the running count of bytes that crossed, ``{"bytes": n}``."""
    import torch.distributed as dist

    from zerofn.collectives import _ops, _quantized

    crossed = {"bytes": 0}

    def span(group) -> tuple[int, int]:
        ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
        return len(ranks), len({r // ranks_per_node for r in ranks})

    def wrap(fn, size, kind):
        def call(*args, group=None, async_op=False, **kwargs):
            n, nodes = span(group)
            work = fn(*args, group=group, async_op=True, **kwargs)
            if nodes > 1 and LINK["bytes_per_s"] is not None:
                b = size(*args)
                # the planner's model (zerofn.plan.link_bytes): a ring's traffic across nodes leaves on every
                # GPU's own NIC for its 1 / (ranks a node) of the tensor; an all-to-all sends what is bound for
                # the other nodes' ranks directly
                across = b * (nodes - 1) / nodes * (1 if kind == "all_to_all" else nodes / n)
                across *= 2 if kind == "all_reduce" else 1
                crossed["bytes"] += int(across)
                # one NIC a rank: transfers queue on it, each starting when the one before has gone
                start = max(time.monotonic(), LINK["free"])
                LINK["free"] = start + across / LINK["bytes_per_s"]
                work = _Late(work, LINK["free"])
            if async_op:
                return work
            work.wait()
            return None

        return call

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    gather = wrap(_ops._all_gather_single, lambda out, inp: nbytes(out), "all_gather")
    _ops._all_gather_single = _quantized._all_gather_single = gather
    _ops._reduce_scatter_single = wrap(_ops._reduce_scatter_single, lambda out, inp, **_: nbytes(inp), "reduce")
    dist.all_reduce = wrap(dist.all_reduce, lambda t, **_: nbytes(t), "all_reduce")
    dist.all_to_all_single = wrap(dist.all_to_all_single, lambda out, inp, *a, **_: nbytes(inp), "all_to_all")
    return crossed


# ---------------------------------------------------------------- a rank's run


def _rank(args: dict) -> dict:
    import torch
    from zerofn.transforms import shard_params

    import zerofn as zf
    from zerofn.bench.gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for

    crossed = slow_link(args["ranks_per_node"])
    cfg = GPTConfig(vocab=args["vocab"], seq_len=args["seq"], dim=args["dim"], heads=4, layers=args["layers"])
    runs = {}
    for name, kw in SYSTEMS.items():
        torch.manual_seed(0)
        apply = zf.functional(GPT(cfg))
        step = shard_params(zf.train_step(loss_fn_for(apply), zf.optim.adamw(3e-3)), **kw)
        runs[name] = {"step": step, "state": step.init(apply.params), "times": [], "fast": [], "losses": []}
        runs[name]["params"] = sum(p.numel() for p in apply.params.values())
        runs[name]["block"] = sum(p.numel() for p in apply.module.blocks[0].parameters())
    corpus = MarkovCorpus(cfg.vocab, seed=0)
    rank, world = zf.collectives.rank(), zf.collectives.world_size()
    n = args["batch"]

    def batch(i: int):
        return corpus.sample(n * world, cfg.seq_len + 1, seed=i)[rank * n : (rank + 1) * n]

    def loop(run: dict, lo: int, steps: int) -> float:
        zf.collectives.barrier()
        start = time.perf_counter()
        for i in range(lo, lo + steps):
            run["state"], m = run["step"](run["state"], batch(i))
            run["losses"].append(float(m["loss"]))
            run["metrics"] = m
        return time.perf_counter() - start

    LINK["bytes_per_s"] = args["inter_mbps"] * 1e6
    for run in runs.values():
        loop(run, 0, args["warmup"])
    at = args["warmup"]
    for _ in range(args["rounds"]):
        for run in runs.values():  # over the slow link, then the machine's own (what the link costs)
            LINK["bytes_per_s"] = args["inter_mbps"] * 1e6
            before = crossed["bytes"]
            run["times"].append(loop(run, at, args["steps"]) / args["steps"])
            run["crossed"] = (crossed["bytes"] - before) / args["steps"]
            LINK["bytes_per_s"] = None
            run["fast"].append(loop(run, at + args["steps"], args["steps"]) / args["steps"])
        at += 2 * args["steps"]
    return {
        name: {
            "times": run["times"],
            "fast": run["fast"],
            "block": run["block"],
            "losses": run["losses"],
            "by_axis": dict(run["metrics"]["comm_bytes_by_axis"]),
            "comm": int(run["metrics"]["comm_bytes"]),
            "crossed": run["crossed"],
            "params": run["params"],
            "state": zf.memory.state_bytes(run["state"])["total"],
        }
        for name, run in runs.items()
    }


# ---------------------------------------------------------------- the report


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank")
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--inter-mbps", type=float, default=10.0, help="the emulated link between nodes, MB/s")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--hardware", default=None, help="a hardware JSON (zerofn plan --calibrate) for predictions")
    p.add_argument("--quick", action="store_true", help="a tiny run (CI)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    args = vars(a) | (QUICK if a.quick else {})
    output_file(p, "--out", a.out)
    out_path = a.out

    import zerofn as zf

    world = args["nodes"] * args["ranks_per_node"]
    started = time.time()
    with zf.RankPool(world) as pool:
        per_rank = pool.run(_rank, args)
    rows = {}
    ref = per_rank[0]["zero3"]["losses"]
    for name in SYSTEMS:
        times = [max(r[name]["times"][k] for r in per_rank) for k in range(args["rounds"])]
        fast = [max(r[name]["fast"][k] for r in per_rank) for k in range(args["rounds"])]
        mine = per_rank[0][name]
        rows[name] = {
            "step_ms": 1e3 * statistics.median(times),
            "fast_ms": 1e3 * statistics.median(fast),
            "link_ms": 1e3 * statistics.median(t - f for t, f in zip(times, fast)),
            "block": mine["block"],
            "fastest_ms": 1e3 * min(times),
            "slowest_ms": 1e3 * max(times),
            "comm_bytes": mine["comm"],
            "by_axis": mine["by_axis"],
            "crossed_bytes": mine["crossed"],
            "state_bytes": mine["state"],
            "loss_diff": max(abs(x - y) for x, y in zip(mine["losses"], ref)),
            "params": mine["params"],
        }
    base = rows["zero3"]["step_ms"]
    print(
        f"{world} gloo ranks as {args['nodes']} nodes of {args['ranks_per_node']}, link between nodes "
        f"{args['inter_mbps']:g} MB/s, GPT of {rows['zero3']['params'] / 1e6:.1f} M parameters (fp32), "
        f"{args['batch']} x {args['seq']} tokens per rank, {args['rounds']} rounds of {args['steps']} steps "
        f"({time.time() - started:.0f} s)"
    )
    print(
        f"{'system':10} {'step ms':>9} {'(fastest-slowest)':>18} {'vs zero3':>9} {'no link ms':>11} {'link ms':>8} "
        f"{'crossed MB':>11} {'state MB':>9}  by axis (MB)"
    )
    for name, r in rows.items():
        axes = ", ".join(f"{k}: {v / 1e6:.2f}" for k, v in r["by_axis"].items() if v)
        print(
            f"{name:10} {r['step_ms']:9.1f} {r['fastest_ms']:8.1f}-{r['slowest_ms']:<8.1f} {r['step_ms'] / base:9.3f} "
            f"{r['fast_ms']:11.1f} {r['link_ms']:8.1f} {r['crossed_bytes'] / 1e6:11.2f} {r['state_bytes'] / 1e6:9.2f}  "
            f"{axes}"
        )
    result = {"args": args, "rows": rows}
    if a.hardware:
        result["predicted"] = _predictions(args, rows, a.hardware)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    return result


def _predictions(args: dict, rows: dict, hardware: str) -> dict:
    """The planner's figures beside the measured ones: ``zerofn.plan.step_speed`` of each system on this
    machine's links (``hardware``, from ``python -m zerofn plan --calibrate``) with the link between the nodes
    set to ``--inter-mbps``: its bytes and seconds across the nodes, and the whole step's communication."""
    import dataclasses

    from zerofn.plan import Composition, load_hardware, step_speed

    hw = dataclasses.replace(
        load_hardware(hardware),
        inter_node_gbps=args["inter_mbps"] / 1e3,
        inter_node_latency_us=0.0,
        gpus_per_node=args["ranks_per_node"],
    )
    kinds = {
        "zero3": Composition("ZeRO-3", 3),
        "hsdp": Composition("HSDP", 3, replicate=True),
        "hpz": Composition("hpZ", 3, hpz=True),
        "qwz+qgz": Composition("ZeRO-3 + qwZ + qgZ", 3, int8_gather=True, int8_reduce=True),
    }
    out = {}
    print(f"{'predicted':10} {'crossed MB':>11} {'link ms':>8} {'measured':>9} {'all comm ms':>12}")
    for name, comp in kinds.items():
        r = rows[name]
        params, block = r["params"], r["block"]
        sp = step_speed(
            comp,
            hardware=hw,
            params=params,
            root=params - args["layers"] * block,
            block=block,
            layers=args["layers"],
            nodes=args["nodes"],
            gpus_per_node=args["ranks_per_node"],
            model_flops=1.0,
            tokens=1.0,
            mixed_precision=False,
        )
        across = sum(c.inter_bytes for c in sp.comms)
        link = sum(c.inter_s for c in sp.comms)
        out[name] = {"crossed_bytes": across, "link_ms": 1e3 * link, "comm_ms": 1e3 * sp.comm_s}
        print(f"{name:10} {across / 1e6:11.2f} {1e3 * link:8.1f} {r['link_ms']:9.1f} {1e3 * sp.comm_s:12.1f}")
    return out


if __name__ == "__main__":
    main()
