"""Pipelines against ZeRO-3 on 4 gloo ranks: a Hugging Face Llama of 99.5 M parameters cut into 4 stages
(``pipeline_parallel``) under each schedule, 4 and 16 micro-batches a step, against ``shard_params`` over the
same 4 ranks.

    python examples/bench_pipeline.py                            # a Llama of 99.5 M parameters, 16 x 32 tokens a step
    python examples/bench_pipeline.py --batch 32 --seq 64        # ... a larger batch
    python examples/bench_pipeline.py --quick --json pp.json     # tiny, as CI runs it

It starts its ranks itself (``zf.RankPool``), so run it with plain ``python``. The systems, each training the
same ``LlamaForCausalLM`` (fp32, AdamW, from the same seed) on the same global batch of ``--batch`` rows of
``--seq`` tokens a step, in the same processes, taking turns round by round (each round a loop of ``--steps``
consecutive steps per system, the order rotated by one each round, after ``--warmup`` steps each):

- ``zero3``: ``shard_params(step)`` over the 4 ranks, each rank feeding its ``batch / 4`` rows;
- ``1f1b m=M``: ``pipeline_parallel(step, 4, microbatches=M)``, one stage of 2 blocks a rank (the first with
  the embedding, the last with the final norm, the head and the loss);
- ``interleaved m=M``: ``schedule="interleaved", virtual_stages=2``: 8 stages of one block, rank ``r`` running
  stages ``r`` and ``r + 4``;
- ``zero_bubble m=M``: ``schedule="zero_bubble", virtual_stages=2``: as interleaved, the backward split into the
  input's gradient (sent at once) and the weights' (run in the bubbles).

The 4 pipeline ranks are one data-parallel rank: each feeds the whole batch, which the step cuts into ``M``
micro-batches. A system that fails to build or to run its warm-up steps is reported as such, with its error.

Reported per system: the median step time over the rounds (each round's the slowest rank's loop over its steps),
its fastest and slowest round, the median over the rounds of the loop's time over ``zero3``'s in the same round,
the bytes each rank sent in a step (``metrics["comm_bytes"]``) beside the pipeline's formula (below), the
measured bubble of each rank (``metrics["pipeline_idle"]``: the share of the schedule's wall time the rank's
stages waited, median over the timed steps) beside the schedule's formula, the loss after the last step and its
difference from ``zero3``'s (the same sums: equal to rounding), and how much of the machine's CPU other
processes used during the loops (``zerofn.bench.harness.machine_busy``).

The bubble formulas (``p`` stages, ``v`` stages a rank, ``m`` micro-batches, every stage equally long):
1F1B ``(p - 1) / (m + p - 1)``; interleaved 1F1B ``(p - 1) / (v m + p - 1)``; zero bubble: the zero-bubble
paper's ZB-H1 count (https://arxiv.org/abs/2401.10241), whose bubble is ``(p - 1) (T_F + T_B - T_W)`` against
1F1B's ``(p - 1) (T_F + T_B + T_W)``: with the forward, the input's gradient and the weights' gradient equally
long, a third of interleaved's bubble time, ``(p - 1) / (3 v m + p - 1)``; its ideal is 0. The Llama's stages
are not equally long: the last also runs the head over the vocabulary (as many flops a token as about 4 blocks
here) and the loss, so the other ranks wait for it beyond the formula.

Bytes a pipeline rank sends in a step, as ``metrics["comm_bytes"]`` counts them: each of its stages but the
model's last sends its output (``batch x seq x hidden x 4`` bytes in fp32 over the ``m`` micro-batches), each but
the first the gradient of its input (as many); then ``2 x 8 x 3`` bytes for the loss brought to every stage
(loss, count and a check, float64, an all-reduce counted twice) and ``2 x 8`` for the gradient's sum of squares
over the stages: ``(2 v - [first rank] - [last rank]) x batch x seq x hidden x 4 + 64``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_paths import output_file  # noqa: E402

# schedule -> stages a rank (virtual stages)
SCHEDULES = {"1f1b": 1, "interleaved": 2, "zero_bubble": 2}
QUICK = dict(
    hidden=32,
    intermediate=64,
    layers=8,
    heads=4,
    kv_heads=2,
    vocab=64,
    batch=16,
    seq=8,
    steps=2,
    rounds=1,
    warmup=0,
    microbatches=[4, 8],
)
# What a pipeline rank sends beside the activations each step: the loss vector (loss, count, check: 3 float64)
# and the gradient's sum of squares (1 float64), each all-reduced over the pipeline and counted twice.
SMALL_BYTES = 2 * 8 * 3 + 2 * 8


def systems(microbatches: list[int], schedules: list[str] | None = None, split: list[int] | None = None) -> dict:
    """name -> (schedule, virtual stages, micro-batches, split), None for ZeRO-3; ``split``: 1F1B cut there too
    (``pipeline_parallel(..., split=)``: e.g. the last stage the head alone)."""
    out: dict[str, tuple | None] = {"zero3": None}
    for schedule, v in SCHEDULES.items():
        if schedules and schedule not in schedules:
            continue
        for m in microbatches:
            out[f"{schedule} m={m}"] = (schedule, v, m, None)
    for m in microbatches if split else ():
        out[f"1f1b split={','.join(map(str, split))} m={m}"] = ("1f1b", 1, m, tuple(split))
    return out


def bubble_formula(schedule: str, p: int, v: int, m: int) -> float:
    """The schedule's bubble, a share of the step (see the module)."""
    if schedule == "1f1b":
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (3 * v * m + p - 1)  # zero bubble: ZB-H1's count, T_F = T_B = T_W


def sent_formula(rank: int, p: int, v: int, batch: int, seq: int, hidden: int) -> int:
    """Bytes pipeline rank ``rank`` of ``p`` sends a step (fp32 hidden states; see the module)."""
    sends = 2 * v - (rank == 0) - (rank == p - 1)
    return sends * batch * seq * hidden * 4 + SMALL_BYTES


# ---------------------------------------------------------------- a rank's run


def _config(args: dict):
    import transformers
    from transformers import LlamaConfig

    transformers.logging.set_verbosity_error()
    return LlamaConfig(
        vocab_size=args["vocab"],
        hidden_size=args["hidden"],
        intermediate_size=args["intermediate"],
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"],
        max_position_embeddings=max(args["seq"], 64),
        tie_word_embeddings=False,
    )


def _loss_fn(apply):
    def loss_fn(params, batch):
        return apply(params, input_ids=batch["input_ids"], labels=batch["labels"]).loss

    return loss_fn


def _corpus(args: dict):
    """Global batch ``i``: ``batch`` rows of ``seq`` tokens from a random Markov chain (4 choices a token)."""
    import torch

    vocab = args["vocab"]
    table = torch.randint(vocab, (vocab, 4), generator=torch.Generator().manual_seed(0))

    def sample(i: int) -> dict:
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.empty(args["batch"], args["seq"], dtype=torch.long)
        ids[:, 0] = torch.randint(vocab, (args["batch"],), generator=g)
        for t in range(1, args["seq"]):
            ids[:, t] = table[ids[:, t - 1], torch.randint(4, (args["batch"],), generator=g)]
        return {"input_ids": ids, "labels": ids}

    return sample


def _rank(args: dict) -> dict:
    import torch
    from transformers import LlamaForCausalLM
    from zerofn.transforms import pipeline_parallel, shard_params

    import zerofn as zf
    from zerofn import collectives as C
    from zerofn.bench.harness import machine_busy

    torch.set_num_threads(args["threads"])
    rank, world = C.rank(), C.world_size()
    sample = _corpus(args)
    data = [sample(i) for i in range(args["warmup"] + args["rounds"] * args["steps"])]
    rows = args["batch"] // world

    def batch(run: dict, i: int) -> dict:
        if run["how"] is None:  # ZeRO-3: this rank's rows of the global batch
            return {k: t[rank * rows : (rank + 1) * rows] for k, t in data[i].items()}
        return data[i]  # a pipeline: every stage is given the whole batch

    def build(how) -> dict:
        torch.manual_seed(0)
        model = LlamaForCausalLM(_config(args)).float()
        params = sum(p.numel() for p in model.parameters())
        apply = zf.functional(model)
        step = zf.train_step(_loss_fn(apply), zf.optim.adamw(args["lr"]))
        if how is None:
            step = shard_params(step)
        else:
            schedule, v, m, split = how
            step = pipeline_parallel(step, world, microbatches=m, schedule=schedule, virtual_stages=v, split=split)
        run = {"how": how, "step": step, "state": step.init(apply.params), "params": params}
        run.update(times=[], load=[], idle=[], losses=[])
        for i in range(args["warmup"]):
            run["state"], _ = step(run["state"], batch(run, i))
        return run

    runs, skipped = {}, {}
    for name, how in systems(args["microbatches"], args["schedules"], args["split"]).items():
        error, run = None, None
        try:
            run = build(how)
        except Exception as e:  # reported as the system's result (every rank fails alike: a bad size, a cut)
            error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        errors = [e for e in C.gather_objects(error) if e]
        if errors:
            skipped[name] = errors[0]
            continue
        runs[name] = run

    def loop(run: dict, lo: int) -> None:
        C.barrier()
        t0, own, busy = time.perf_counter(), time.process_time(), machine_busy()
        out = []
        for i in range(lo, lo + args["steps"]):
            run["state"], metrics = run["step"](run["state"], batch(run, i))
            out.append(metrics)
        C.barrier()  # gloo's barrier also waits for what the last step left in flight
        wall, after = time.perf_counter() - t0, machine_busy()
        run["times"].append(wall / args["steps"])
        run["load"].append((wall, time.process_time() - own, None if busy is None or after is None else after - busy))
        run["idle"] += [float(m.get("pipeline_idle", math.nan)) for m in out]
        run["losses"] += [float(m["loss"]) for m in out]
        run["comm"] = int(out[-1]["comm_bytes"])

    order, at = list(runs), args["warmup"]
    for r in range(args["rounds"]):
        for name in order[r % len(order) :] + order[: r % len(order)]:  # each round starting one later
            loop(runs[name], at)
        at += args["steps"]
    figures = {
        name: {
            "times": run["times"],
            "load": run["load"],
            "idle": run["idle"],
            "losses": run["losses"],
            "comm": run["comm"],
            "params": run["params"],
            "state": zf.memory.state_bytes(run["state"])["total"],
        }
        for name, run in runs.items()
    }
    return {"figures": figures, "skipped": skipped, "cores": os.cpu_count()}


# ---------------------------------------------------------------- the report


def _others(loads: list[tuple], cores: int) -> float | None:
    """The share of the machine's CPU time other processes used during one loop, from every rank's (wall, own
    CPU, machine busy) of it (as ``zerofn.bench.harness`` counts it)."""
    if loads[0][2] is None:
        return None
    wall = max(w for w, _, _ in loads)
    own = sum(c for _, c, _ in loads)
    return min(1.0, max(0.0, loads[0][2] - own) / (cores * wall))


def main(argv=None, pool=None) -> dict:
    """Run the benchmark (``argv``: its command line) on ``pool``, 4 live ranks (``zf.RankPool(4)``; None: started
    here and closed after); print the table and return the results."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8, help="blocks (interleaved and zero bubble need 8 for 4 x 2)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=16, help="rows of the global batch (a multiple of each M and 4)")
    p.add_argument("--seq", type=int, default=32, help="tokens a row")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 16])
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=2, help="consecutive steps in a timed loop")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads a rank")
    p.add_argument("--schedules", nargs="+", choices=list(SCHEDULES), default=None, help="these only (default all)")
    p.add_argument(
        "--split", type=int, nargs="+", default=None, help="also 1F1B cut at these blocks (3 6 8: the head alone)"
    )
    p.add_argument("--quick", action="store_true", help="a tiny run (CI)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    a = p.parse_args(argv)
    output_file(p, "--json", a.json)
    args = vars(a) | (QUICK if a.quick else {})
    if args["steps"] < 1 or args["rounds"] < 1:
        p.error("--steps and --rounds must be at least 1")

    import zerofn as zf

    world = 4
    started = time.time()
    if pool is None:
        with zf.RankPool(world) as own:
            per_rank = own.run(_rank, args)
    else:
        per_rank = pool.run(_rank, args)
    seconds = time.time() - started
    first = per_rank[0]
    cores = first["cores"]
    names = list(first["figures"])
    rounds = {n: [max(r["figures"][n]["times"][k] for r in per_rank) for k in range(args["rounds"])] for n in names}
    shares = [
        _others([r["figures"][n]["load"][k] for r in per_rank], cores) for n in names for k in range(args["rounds"])
    ]
    shares = [s for s in shares if s is not None]
    ref = rounds.get("zero3")
    ref_loss = first["figures"]["zero3"]["losses"][-1] if "zero3" in names else None
    rows = {}
    for n in names:
        how = systems(args["microbatches"], args["schedules"], args["split"])[n]
        mine = [r["figures"][n] for r in per_rank]
        row = {
            "step_ms": 1e3 * statistics.median(rounds[n]),
            "fastest_ms": 1e3 * min(rounds[n]),
            "slowest_ms": 1e3 * max(rounds[n]),
            "round_ms": [1e3 * t for t in rounds[n]],
            "vs_zero3": statistics.median(t / z for t, z in zip(rounds[n], ref)) if ref else None,
            "sent_bytes": [f["comm"] for f in mine],
            "state_bytes": [f["state"] for f in mine],
            "loss": mine[0]["losses"][-1],
            "losses": mine[0]["losses"],
            "loss_diff": abs(mine[0]["losses"][-1] - ref_loss) if ref_loss is not None else None,
            "params": mine[0]["params"],
            "others_cpu": [
                _others([r["figures"][n]["load"][k] for r in per_rank], cores) for k in range(args["rounds"])
            ],
        }
        if how is not None:
            schedule, v, m, split = how
            row.update(
                split=split,
                schedule=schedule,
                virtual_stages=v,
                microbatches=m,
                bubble=[statistics.median(f["idle"]) for f in mine],
                bubble_formula=bubble_formula(schedule, world, v, m),
                sent_formula=[
                    sent_formula(r, world, v, args["batch"], args["seq"], args["hidden"]) for r in range(world)
                ],
            )
        rows[n] = row
    params = next(iter(rows.values()))["params"] if rows else 0
    busy = (
        f"other processes used {100 * statistics.median(shares):.0f} % of the machine's CPU during a loop (median; "
        f"at most {100 * max(shares):.0f} %)"
        if shares
        else "no /proc/stat: how busy the machine was is unknown"
    )
    print(
        f"{world} gloo ranks on {cores} cores, LlamaForCausalLM of {params:,} parameters (fp32, AdamW; hidden "
        f"{args['hidden']}, {args['layers']} layers, vocabulary {args['vocab']}), global batch {args['batch']} x "
        f"{args['seq']} tokens, {args['rounds']} rounds of {args['steps']}-step loops after {args['warmup']} warm-up "
        f"step(s) ({seconds:.0f} s); {busy}"
    )
    print(
        f"{'system':17} {'step ms':>9} {'(fastest-slowest)':>19} {'vs zero3':>8} {'sent MB/step, ranks 0-3':>27} "
        f"{'bubble, ranks 0-3':>23} {'formula':>7} {'loss':>9} {'diff':>8}"
    )
    for n, r in rows.items():
        sent = " ".join(f"{b / 1e6:6.2f}" for b in r["sent_bytes"])
        bubble = " ".join(f"{b:5.2f}" for b in r["bubble"]) if "bubble" in r else "-"
        formula = f"{r['bubble_formula']:.3f}" if "bubble" in r else "-"
        ratio = f"{r['vs_zero3']:.3f}" if r["vs_zero3"] is not None else "-"
        diff = f"{r['loss_diff']:.1e}" if r["loss_diff"] is not None else "-"
        print(
            f"{n:17} {r['step_ms']:9.0f} {r['fastest_ms']:9.0f}-{r['slowest_ms']:<9.0f} {ratio:>8} {sent:>27} "
            f"{bubble:>23} {formula:>7} {r['loss']:9.5f} {diff:>8}"
        )
    for n, why in first["skipped"].items():
        print(f"{n:17} failed: {why}")
    off = [n for n, r in rows.items() if "sent_formula" in r and r["sent_formula"] != r["sent_bytes"]]
    print(
        "bytes sent: (2 v - [first rank] - [last rank]) x batch x seq x hidden x 4 + 64 on every pipeline rank"
        if not off
        else f"bytes sent differ from (2 v - [first] - [last]) x batch x seq x hidden x 4 + 64: {', '.join(off)}"
    )
    result = {"args": args, "world": world, "cores": cores, "seconds": seconds, "rows": rows}
    result["skipped"] = first["skipped"]
    result["others_cpu"] = (statistics.median(shares), max(shares)) if shares else None
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
