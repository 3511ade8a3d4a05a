"""Mixtures of experts: ``expert_parallel(shard_params(step), ranks)`` against ``shard_params(step)`` (ZeRO-3).

    python examples/bench_ep.py                                  # 102.6 M parameters (88.1 M in experts), 4 ranks
    python examples/bench_ep.py --quick --out ep.json            # tiny, as CI runs it (2 ranks)

It starts its ranks itself (``zf.spawn``, one thread each), so run it with plain ``python``. A Mixtral-shaped
Hugging Face model built from a ``transformers.MixtralConfig`` (nothing downloaded; by default hidden 512, 8
layers, 8 heads, 4 key/value heads, 8 experts of intermediate 896 in every layer, top-2 routing, vocabulary
8000, an untied head: 102.6 M parameters, 86 % of them in the experts), fp32, AdamW, the model's own loss
(``labels``). Every step trains on a global batch of random tokens, ``--batch`` sequences of ``--seq`` tokens
per rank, the same for both systems, each rank feeding its slice (``zf.collectives.data_rank(step)`` of
``zf.collectives.world_size(step.group)`` data ranks). The systems, on the same ranks, in the same processes:

- ``shard_params``: ZeRO-3 over all the ranks: every step gathers every parameter, every expert of every
  layer included, forward and backward, and reduce-scatters every gradient (``3 x params x 4`` bytes per
  rank and step in fp32, less one gather of the root and the last block, kept gathered into backward);
- ``expert_parallel``: ``expert_parallel(shard_params(step), --ep)`` (``--ep`` defaults to ``--ranks``):
  each rank holds ``E / ep`` experts of every MoE layer whole; the tokens each rank routed travel to the
  ranks holding their experts by all-to-all and back; ZeRO-3 shards the non-expert parameters over all the
  ranks and the experts over the ``ranks / ep`` ranks holding the same ones (none to gather at ep = ranks).

For each system: ``--warmup`` steps, then one step inside ``zf.memory.track()`` (its peak: the tensor bytes
the step allocates on top of the state), then ``--rounds`` rounds, each a loop of ``--steps`` consecutive
steps per system, the systems taking turns (shard_params, expert_parallel, shard_params, ...) so that a
change in the machine's load falls on both. Reported per system: the bytes a step moves per rank
(``metrics["comm_bytes"]``, its mean over the steps after the warm-up on each rank; the largest and the
mean over the ranks, beside the formula's), the bytes its state holds between steps per rank
(``zf.memory.state_bytes``, the largest over the ranks), the tracked step's peak (the largest over the
ranks), and the step time: the median of the timed steps (each the slowest rank's) and the loops' total
over their steps. Then the ratios expert_parallel / shard_params against the goals (bytes <= 0.3 x, step
time <= 0.6 x), and the losses of every step side by side: expert_parallel is exact (the same sums in
another order), so they agree to rounding (their largest difference is printed, checked against 1e-5).
The load average before and after and the wall time are printed too: on a shared machine the step times
move with the load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_helpers import add_shape_args, proc_status  # noqa: E402
from cli_paths import output_file  # noqa: E402

ZERO3, EP = "shard_params", "expert_parallel"
QUICK = {
    "hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 256, "ranks": 2,
    "batch": 2, "seq": 32, "steps": 2, "rounds": 1,
}  # fmt: skip
GOALS = {"bytes": 0.3, "step_time": 0.6}  # expert_parallel / shard_params, at most
LOSS_TOL = 1e-5


def parse_args(argv=None):
    """The command line, its path checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, hidden=512, intermediate=896, layers=8, heads=8, kv_heads=4, vocab=8000)
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (every layer)")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--ranks", type=int, default=4, help="gloo ranks (processes) for both systems")
    p.add_argument("--ep", type=int, default=None, help="ranks per expert-parallel group (default: --ranks)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system first")
    p.add_argument("--steps", type=int, default=3, help="consecutive steps timed per system per round")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds, the systems taking turns in each")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--quick", action="store_true", help=f"a tiny run ({QUICK}), for CI")
    p.add_argument("--out", default=None, metavar="FILE", help="write every figure here (JSON)")
    args = p.parse_args(argv)
    if args.quick:
        given = {a.dest for a in p._actions if any(s in (argv or sys.argv[1:]) for s in a.option_strings)}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    if args.ep is None:
        args.ep = args.ranks
    if min(args.ranks, args.ep, args.batch, args.seq, args.steps, args.rounds, args.experts, args.top_k) < 1:
        p.error("--ranks, --ep, --batch, --seq, --steps, --rounds, --experts and --top-k must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.ranks % args.ep or args.experts % args.ep:
        p.error(f"--ep {args.ep} must divide --ranks ({args.ranks}) and --experts ({args.experts})")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    output_file(p, "--out", args.out)
    return args


def build_mixtral(args):
    """The same fp32 Mixtral (untied head) from the shape flags and seed 0; a fresh module each call
    (``expert_parallel`` cuts its experts)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.MixtralConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=max(args.seq, 128),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(cfg).float()


def count(args) -> dict[str, int]:
    """Parameter counts from the model on the meta device (nothing allocated): ``params``, ``experts`` (of
    them in the experts), and the two units ``shard_params`` keeps gathered from the forward into backward
    (gathered once a step, not twice): ``root`` (the embedding, the final norm, the head) and the last block
    (``last``, of which ``last_experts`` in its experts)."""
    import torch

    with torch.device("meta"):
        model = build_mixtral(args)
    named = dict(model.named_parameters())
    last = f"model.layers.{args.layers - 1}."
    return {
        "params": sum(p.numel() for p in named.values()),
        "experts": sum(p.numel() for n, p in named.items() if ".experts." in n),
        "root": sum(p.numel() for n, p in named.items() if not n.startswith("model.layers.")),
        "last": sum(p.numel() for n, p in named.items() if n.startswith(last)),
        "last_experts": sum(p.numel() for n, p in named.items() if n.startswith(last) and ".experts." in n),
    }


def formula(args, n: dict[str, int]) -> dict[str, int]:
    """The bytes a step moves per rank by the formulas (fp32, 4 bytes a parameter), without the few hundred
    bytes of the step's statistics. ZeRO-3: every parameter gathered in forward and in backward and its
    gradient reduce-scattered, ``3 x params x 4``, less one gather of the two units kept gathered into
    backward (the root and the last block). expert_parallel: the same over the non-expert parameters; the
    experts' ZeRO-3 over the ``ranks / ep`` ranks holding them (``3 x experts / ep x 4``, less the last
    block's; none at ep = ranks); and per MoE layer the counts (``E`` int64) and ``2 (T k + R) x hidden x 4``,
    ``R`` the rows received, here their mean over the ranks, ``T k``."""
    a = (3 * n["params"] - n["root"] - n["last"]) * 4
    dense, last_dense = n["params"] - n["experts"], n["last"] - n["last_experts"]
    b = (3 * dense - n["root"] - last_dense) * 4
    if args.ranks > args.ep:
        b += (3 * n["experts"] - n["last_experts"]) // args.ep * 4
    if args.ep > 1:
        tk = args.batch * args.seq * args.top_k
        b += args.layers * (args.experts * 8 + 2 * (tk + tk) * args.hidden * 4)
    return {ZERO3: a, EP: b}


def global_batch(args, i: int) -> dict:
    """Step ``i``'s global batch of random tokens (``ranks x batch`` sequences), the same for both systems."""
    import torch

    n = args.ranks * args.batch
    ids = torch.randint(0, args.vocab, (n, args.seq), generator=torch.Generator().manual_seed(1000 + i))
    return {"input_ids": ids, "labels": ids.clone()}


class System:
    """One system on this rank: its step, state, data rank and what it measured."""

    def __init__(self, args, label: str):
        from zerofn.transforms import expert_parallel, shard_params

        import zerofn as zf

        apply = zf.functional(build_mixtral(args))

        def loss_fn(params, batch):
            return apply(params, **batch).loss

        step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(args.lr, weight_decay=0.0)))
        if label == EP:
            step = expert_parallel(step, args.ep)
        self.args, self.label, self.step = args, label, step
        self.state = step.init(apply.params)  # the state owns the parameters from here
        self.here, self.data = zf.collectives.data_rank(step), zf.collectives.world_size(step.group)
        self.i = 0  # the next step's batch
        self.losses: list[float] = []
        self.comm: list[int] = []  # comm_bytes of every step after the warm-up
        self.times: list[float] = []  # every timed step, seconds
        self.loops: list[float] = []  # every timed loop, seconds

    def run(self, keep_comm: bool = True) -> None:
        import zerofn as zf

        batch = global_batch(self.args, self.i)
        rows = batch["input_ids"].shape[0] // self.data
        mine = {k: v[self.here * rows : (self.here + 1) * rows] for k, v in batch.items()}
        self.state, m = self.step(self.state, mine)
        zf.block_until_ready(self.state)
        self.losses.append(float(m["loss"]))
        if keep_comm:
            self.comm.append(int(m["comm_bytes"]))
        self.i += 1


def rank_fn(args) -> dict:
    """Both systems on this rank: the warm-up, the tracked step, then the rounds of timed loops."""
    import torch.distributed as dist

    import zerofn as zf

    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    systems = {label: System(args, label) for label in (ZERO3, EP)}
    out: dict = {"rank": dist.get_rank()}
    for s in systems.values():
        for _ in range(args.warmup):
            s.run(keep_comm=False)
    for label, s in systems.items():
        state = zf.memory.state_bytes(s.state)
        gc.collect()
        dist.barrier()
        with zf.memory.track() as tracker:
            s.run()
        out[label] = {"data_rank": s.here, "data_ranks": s.data, "state": state, "step_peak": tracker.peak}
    for _ in range(args.rounds):
        for s in systems.values():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.steps):
                t0 = time.perf_counter()
                s.run()
                s.times.append(time.perf_counter() - t0)
            s.loops.append(time.perf_counter() - start)
    for label, s in systems.items():
        out[label] |= {"losses": s.losses, "comm": s.comm, "times": s.times, "loops": s.loops, "name": s.step.name}
    out["peak_rss"] = proc_status("VmHWM")
    return out


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def summarize(args, ranks: list[dict]) -> dict:
    """Each system's figures over the ranks (the largest, and the mean where it says)."""
    out = {}
    for label in (ZERO3, EP):
        per = [r[label] for r in ranks]
        comm = [statistics.mean(p["comm"]) for p in per]  # each rank's mean over its steps
        times = [max(t) for t in zip(*(p["times"] for p in per))]  # each step: the slowest rank's
        loops = [max(t) for t in zip(*(p["loops"] for p in per))]
        out[label] = {
            "name": per[0]["name"],
            "ranks": len(ranks),
            "data_ranks": per[0]["data_ranks"],
            "comm_bytes_max": max(comm),
            "comm_bytes_mean": statistics.mean(comm),
            "comm_bytes_ranks": comm,
            "state_bytes": max(p["state"]["total"] for p in per),
            "state_bytes_ranks": [p["state"]["total"] for p in per],
            "state": per[0]["state"],
            "step_peak": max(p["step_peak"] for p in per),
            "step_peak_ranks": [p["step_peak"] for p in per],
            "step_s": statistics.median(times),
            "step_s_all": times,
            "loop_step_s": sum(loops) / (len(loops) * args.steps),
            "loops_s": loops,
            "losses": per[0]["losses"],
        }
    return out


def report(args, systems: dict, n: dict[str, int]) -> dict:
    """Print the table, the ratios against the goals and the losses; returns the ratios and goals."""
    a, b = systems[ZERO3], systems[EP]
    params, experts = n["params"], n["experts"]
    tokens = args.batch * args.seq
    print(
        f"Mixtral {params / 1e6:,.1f} M parameters ({experts / 1e6:,.1f} M in experts, {100 * experts / params:.0f} %; "
        f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads, {args.kv_heads} kv heads, {args.experts} "
        f"experts of intermediate {args.intermediate}, top-{args.top_k}, vocab {args.vocab}, untied head), fp32, "
        f"AdamW; {args.ranks} gloo ranks, ep {args.ep}, {args.batch} x {args.seq} = {tokens} tokens per rank a step "
        f"(the same global batch for both); step time: {args.rounds} round(s) of {args.steps} consecutive steps per "
        f"system after {args.warmup} warm-up step(s); {os.cpu_count()} CPU cores, one thread per rank"
    )
    ratios = {
        "bytes": b["comm_bytes_max"] / a["comm_bytes_max"],
        "state_bytes": b["state_bytes"] / a["state_bytes"],
        "step_peak": b["step_peak"] / a["step_peak"],
        "step_time": b["step_s"] / a["step_s"],
        "loop_step_time": b["loop_step_s"] / a["loop_step_s"],
    }
    print()
    print(
        "| system | ranks | bytes/step per rank | state bytes per rank | step peak | step s (median) | vs shard_params |"
    )
    print("|---|---|---|---|---|---|---|")
    for label, s in systems.items():
        vs = "1 x" if label == ZERO3 else (
            f"bytes {ratios['bytes']:.2f} x, state {ratios['state_bytes']:.2f} x, peak {ratios['step_peak']:.2f} x, "
            f"step {ratios['step_time']:.2f} x"
        )  # fmt: skip
        bytes_cell = mib(s["comm_bytes_max"])
        if s["comm_bytes_mean"] != s["comm_bytes_max"]:
            bytes_cell += f" (mean {mib(s['comm_bytes_mean'])})"
        print(
            f"| {s['name']} | {s['ranks']} | {bytes_cell} | {mib(s['state_bytes'])} | {mib(s['step_peak'])} | "
            f"{s['step_s']:.3f} | {vs} |"
        )
    print()
    expected = formula(args, n)
    for label, s in systems.items():
        print(
            f"{label}: bytes per step per rank {mib(s['comm_bytes_mean'])} (mean over ranks), the formula "
            f"{mib(expected[label])}; per rank: " + ", ".join(mib(c) for c in s["comm_bytes_ranks"])
        )
        print(
            f"{label}: step s, each the slowest rank's: " + ", ".join(f"{t:.3f}" for t in s["step_s_all"])
            + f"; loops' total / steps {s['loop_step_s']:.3f}"
        )  # fmt: skip
    n = min(len(a["losses"]), len(b["losses"]))
    diff = max(abs(x - y) for x, y in zip(a["losses"][:n], b["losses"][:n]))
    print("losses, step by step (shard_params / expert_parallel): "
          + ", ".join(f"{x:.6f} / {y:.6f}" for x, y in zip(a["losses"][:5], b["losses"][:5]))
          + (" ..." if n > 5 else ""))  # fmt: skip
    goals = {
        "bytes": {"ratio": ratios["bytes"], "goal": GOALS["bytes"], "met": ratios["bytes"] <= GOALS["bytes"]},
        "step_time": {
            "ratio": ratios["step_time"],
            "goal": GOALS["step_time"],
            "met": ratios["step_time"] <= GOALS["step_time"],
        },
        "losses": {"max_diff": diff, "steps": n, "tol": LOSS_TOL, "met": diff <= LOSS_TOL},
    }

    def met(ok: bool) -> str:
        return "met" if ok else "NOT met"

    print(f"largest loss difference over {n} steps: {diff:.2e} (expert_parallel is exact: <= {LOSS_TOL:g}): "
          f"{met(goals['losses']['met'])}")  # fmt: skip
    print(f"expert_parallel / shard_params: bytes per step per rank {ratios['bytes']:.3f} x (the largest rank's; "
          f"goal <= {GOALS['bytes']} x): {met(goals['bytes']['met'])}")  # fmt: skip
    print(f"expert_parallel / shard_params: state bytes per rank {ratios['state_bytes']:.3f} x, step peak "
          f"{ratios['step_peak']:.3f} x")  # fmt: skip
    print(f"expert_parallel / shard_params: step time {ratios['step_time']:.3f} x (medians; the loops' totals "
          f"{ratios['loop_step_time']:.3f} x; goal <= {GOALS['step_time']} x): {met(goals['step_time']['met'])}")  # fmt: skip
    return {"ratios": ratios, "goals": goals, "formula_bytes": expected}


def main(argv=None) -> None:
    args = parse_args(argv)
    import zerofn as zf

    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    ranks = zf.spawn(rank_fn, args.ranks, args)
    wall = time.perf_counter() - t0
    n = count(args)
    systems = summarize(args, ranks)
    summary = report(args, systems, n)
    load = (load_before, os.getloadavg()[0])
    print(f"load average {load[0]:.2f} before, {load[1]:.2f} after; wall time {wall:.0f} s")
    if args.out:
        out = {"args": vars(args), "parameters": n["params"], "expert_parameters": n["experts"], "counts": n}
        out["load_average"] = load
        with open(args.out, "w") as f:
            json.dump({**out, **summary, "wall_s": wall, "systems": systems, "ranks": ranks}, f, indent=1)


if __name__ == "__main__":
    main()
