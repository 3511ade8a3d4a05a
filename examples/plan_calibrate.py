"""The planner's predicted communication of a step against the measured one: ZeRO-1, 2 and 3 on gloo ranks.

    python examples/plan_calibrate.py                                  # 4 ranks, 7 rounds (about a minute)
    python examples/plan_calibrate.py --rounds 9 --out hw.json --json results.json

It starts its ranks itself (``zf.RankPool``); run it with plain ``python``. In each round the ranks first
time zerofn's collectives of a few sizes (what ``python -m zerofn plan --calibrate`` does,
``zerofn.plan.calibrate.measure_collectives``), then run ``--steps`` steps of the bench's GPT (fp32, AdamW)
under each of ``shard_optimizer`` (ZeRO-1), ``shard_grads`` (ZeRO-2) and ``shard_params`` (ZeRO-3), the
systems taking turns.

Measured: the step's communication time, the summed wall time of the collectives that move its parameters
and gradients (every all-gather, reduce-scatter and all-reduce of at least 1 KiB; the few-byte agreement and
statistics all-reduces are left out of both sides), each made blocking and started after a barrier of its
group (not counted), so that each is timed from when every rank has reached it to its end, and not the
compute it would overlap. A step's figure is the mean over the ranks; the table gives the median over the
rounds' steps.

Predicted: ``zerofn.plan.fit`` over every round's collective timings (a bandwidth and a latency per kind),
then the planner's collectives of each composition (``zerofn.plan.step_speed``, from the model's parameter
count, root unit and block: the bytes and the number of collectives) costed with them: ``Speed.comm_s``, the
communication overlapped or not.
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

SMALL = 1024  # bytes: collectives below this are the step's agreement and statistics messages


def parse_args(argv=None):
    """The command line, its paths checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7, help="rounds of calibration and steps (medians over them)")
    p.add_argument("--steps", type=int, default=3, help="steps of each composition a round")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each collective and size a round")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank a step")
    p.add_argument("--out", help="write the fitted hardware file here (for python -m zerofn plan --hardware)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    output_file(p, "--out", args.out)
    output_file(p, "--json", args.json)
    if args.ranks < 2:
        p.error(f"--ranks {args.ranks}: the collectives need at least 2 ranks")
    return args


def _measure(cfg: dict, batch: int, sizes: tuple, repeats: int, rounds: int, steps: int) -> dict:
    """On every rank: the rounds of collective timings and of timed steps."""
    import resource

    import torch
    from zerofn.transforms import shard_grads, shard_optimizer, shard_params

    import zerofn as zf
    from zerofn import collectives as C
    from zerofn.bench.gpt import GPT, GPTConfig, loss_fn_for
    from zerofn.bench.harness import machine_busy
    from zerofn.plan.calibrate import measure_collectives

    systems = {}
    for name, transform in (("ZeRO-1", shard_optimizer), ("ZeRO-2", shard_grads), ("ZeRO-3", shard_params)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**cfg))
        apply = zf.functional(model)
        step = transform(zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-3)))
        systems[name] = [step, step.init(apply.params)]
    data = torch.randint(
        0, cfg["vocab"], (batch, cfg["seq_len"] + 1), generator=torch.Generator().manual_seed(C.rank())
    )

    log: list[tuple[str, int, float]] = []
    on = [False]

    def timed(kind: str, fn, full_arg: int):
        def wrapper(*args, **kw):
            t = args[full_arg]
            nbytes = t.numel() * t.element_size()
            if not on[0] or kw.get("control") or nbytes < SMALL:
                return fn(*args, **kw)
            async_op = kw.pop("async_op", False)
            C.barrier(group=kw.get("group"))  # every rank of the group is here: the collective's own time follows
            start = time.perf_counter()
            result = fn(*args, async_op=True, **kw).wait()
            log.append((kind, nbytes, time.perf_counter() - start))
            return C.Handle(None, result) if async_op else result

        return wrapper

    C.all_gather = timed("all_gather", C.all_gather, 0)  # (full, shard)
    C.reduce_scatter = timed("reduce_scatter", C.reduce_scatter, 1)  # (out, full)
    C.all_reduce = timed("all_reduce", C.all_reduce, 0)

    for pair in systems.values():  # warm up: buffers, allocator, the first step's checks
        for _ in range(2):
            pair[1], _m = pair[0](pair[1], data)
    samples, out = [], {name: [] for name in systems}
    C.barrier()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu0, wall0, busy0 = usage.ru_utime + usage.ru_stime, time.perf_counter(), machine_busy()
    for _ in range(rounds):
        samples += measure_collectives(sizes, repeats)
        for name, pair in systems.items():
            for _ in range(steps):
                log.clear()
                on[0] = True
                pair[1], _m = pair[0](pair[1], data)
                on[0] = False
                kinds = {}
                for kind, _, t in log:
                    kinds[kind] = kinds.get(kind, 0.0) + t
                out[name].append(
                    {
                        "seconds": sum(t for _, _, t in log),
                        "bytes": sum(b for _, b, _ in log),
                        "calls": len(log),
                        "by_kind": kinds,
                    }
                )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    wall, busy1 = time.perf_counter() - wall0, machine_busy()
    C.barrier()
    model = GPT(GPTConfig(**cfg))
    return {
        "busy_s": None if busy0 is None or busy1 is None else busy1 - busy0,
        "samples": samples,
        "steps": out,
        "cpu_s": usage.ru_utime + usage.ru_stime - cpu0,
        "wall_s": wall,
        "params": sum(p.numel() for p in model.parameters()),
        "block": sum(p.numel() for p in model.blocks[0].parameters()),
    }


def main(argv=None) -> int:
    args = parse_args(argv)

    import zerofn as zf
    from zerofn.plan import Composition, fit, load_hardware, step_speed, write_hardware
    from zerofn.plan.calibrate import DEFAULT_SIZES
    from zerofn.plan.hardware import Hardware

    cfg = dict(vocab=args.vocab, seq_len=args.seq, dim=args.dim, heads=args.heads, layers=args.layers)
    with zf.RankPool(args.ranks) as pool:
        results = pool.run(_measure, cfg, args.batch, DEFAULT_SIZES, args.repeats, args.rounds, args.steps)
    n = args.ranks
    # each run's time is its slowest rank's (the ranks list their runs in the same order)
    samples = [(r[0][0], r[0][1], max(x[2] for x in r)) for r in zip(*(res["samples"] for res in results))]
    costs = fit(samples, n)
    hw = Hardware(
        name=f"calibrated: {n} gloo ranks",
        tflops=1.0,
        hbm_bytes=1.0,
        hbm_gbps=1.0,
        intra_node_gbps=statistics.median(c.gbps for c in costs.values()),
        inter_node_gbps=statistics.median(c.gbps for c in costs.values()),
        gpus_per_node=n,
        collectives=costs,
    )
    params, block = results[0]["params"], results[0]["block"]
    root = params - args.layers * block
    rows = []
    for label, stage in (("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3)):
        predicted = step_speed(
            Composition(label, stage),
            hardware=hw,
            params=params,
            root=root,
            block=block,
            layers=args.layers,
            nodes=1,
            gpus_per_node=n,
            model_flops=1.0,
            tokens=1.0,
            mixed_precision=False,
        )
        steps = list(zip(*(res["steps"][label] for res in results)))  # per step, every rank's figure
        measured = [statistics.mean(r["seconds"] for r in ranks) for ranks in steps]
        by_kind = {}
        for c in predicted.comms:
            if c.full_bytes > 0:
                by_kind.setdefault(c.kind, [0.0, 0.0])[0] += c.seconds
        for kind in by_kind:
            by_kind[kind][1] = statistics.median(
                statistics.mean(r["by_kind"].get(kind, 0.0) for r in ranks) for ranks in steps
            )
        rows.append(
            {
                "composition": label,
                "collectives_predicted": sum(c.count for c in predicted.comms if c.full_bytes > 0),
                "collectives_measured": steps[0][0]["calls"],
                "bytes_predicted": sum(c.full_bytes for c in predicted.comms),
                "bytes_measured": steps[0][0]["bytes"],
                "predicted_s": predicted.comm_s,
                "measured_s": statistics.median(measured),
                "measured_min_s": min(measured),
                "measured_max_s": max(measured),
                "by_kind": by_kind,
            }
        )
    # the machine's busy CPU time over rank 0's rounds less the ranks' own: what other processes took
    ranks_cpu, busy, wall = sum(res["cpu_s"] for res in results), results[0]["busy_s"], results[0]["wall_s"]
    others = None if busy is None else max(0.0, (busy - ranks_cpu) / (wall * (os.cpu_count() or 1)))

    print(f"{n} gloo ranks, {os.cpu_count()} CPUs; GPT {cfg}, {args.batch} sequences a rank, fp32, AdamW")
    line = f"{args.rounds} rounds x {args.steps} steps per composition, {results[0]['wall_s']:.0f} s"
    print(line + (f"; other processes used {others:.0%} of the CPUs meanwhile" if others is not None else ""))
    print()
    print("| collective | bus bandwidth | latency |")
    print("|---|---:|---:|")
    for kind, c in costs.items():
        print(f"| {kind} | {c.gbps:.3g} GB/s | {c.latency_s * 1e3:.2f} ms |")
    print()
    print(
        "| composition | collectives a step (predicted / measured) | bytes a step, full tensors (predicted / measured) | predicted | measured (median; min-max) | predicted / measured |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['composition']} | {r['collectives_predicted']} / {r['collectives_measured']} | "
            f"{r['bytes_predicted'] / 1e6:.2f} MB / {r['bytes_measured'] / 1e6:.2f} MB | {r['predicted_s'] * 1e3:.1f} ms | "
            f"{r['measured_s'] * 1e3:.1f} ms ({r['measured_min_s'] * 1e3:.1f}-{r['measured_max_s'] * 1e3:.1f}) | "
            f"{r['predicted_s'] / r['measured_s']:.2f} |"
        )
    print()
    print("by kind, predicted / measured (median) per step:")
    for r in rows:
        parts = [f"{k} {p * 1e3:.1f} / {m * 1e3:.1f} ms" for k, (p, m) in r["by_kind"].items()]
        print(f"  {r['composition']}: " + ", ".join(parts))
    if args.out:
        write_hardware(hw, args.out)
        load_hardware(args.out)  # it reads back
        print(f"\nhardware file written to {args.out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": vars(args),
                    "rows": rows,
                    "others_cpu": others,
                    "costs": {k: [c.gbps, c.latency_s] for k, c in costs.items()},
                },
                f,
                indent=2,
            )
        print(f"figures written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
