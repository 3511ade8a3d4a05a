"""Long sequences: the longest sequence each system trains under a per-rank memory budget.

    python examples/bench_context.py --budget 3GB                      # the 0.1 B Llama, plain torch, cp 1, 2, 4
    python examples/bench_context.py --quick --cp 1 2 --methods ulysses --out context.json   # tiny, as CI runs it
    python examples/bench_context.py --hidden 256 --ffn 704 --layers 4 --heads 8 --kv-heads 4 --budget 640MiB \
        --max-seq 16384 --steps 1 --out context.json    # 19 M parameters: docs/benchmarks.md's run, 2 CPU cores

It starts its ranks itself (``zf.spawn``, one thread each), a fresh set for every system, so that one
command measures every world size; run it with plain ``python``. A Llama-shaped Hugging Face model built from
a config (nothing downloaded; by default about 0.1 B parameters: hidden 768, 12 layers, 12 heads, 4
key/value heads, intermediate 2048, vocabulary 32000, an untied head), fp32 or ``--bf16`` (autocast under
torch, ``amp`` under zerofn), one sequence a step (``input_ids``, ``attention_mask`` and ``labels``, random
tokens), AdamW. The systems:

- ``plain torch``: the model with ``gradient_checkpointing_enable()``, ``torch.optim.AdamW``, one process,
  its own loss (whole fp32 logits). Every rank of a data-parallel group would hold the whole sequence, so
  its figure is what each rank needs;
- ``cp N`` (``--cp``, Ulysses): ``remat(context_parallel(shard_params(train_step), N), offload="cpu")`` on N
  ranks fed the same sequence: the model's own loss through ``zf.losses.chunked_cross_entropy`` (never the
  whole logits), each rank ``1 / N`` of the sequence from the embedding to the loss, each block's input kept
  in host memory until its recompute, and ZeRO-3 over the N ranks: of the stages it holds the least per rank
  (``16 Psi / N`` in fp32), so the most is left for activations. At N = 1 it shards nothing;
- ``cp N ring`` (``--methods ring``): the same at the largest ``--cp`` with ring attention.

For each system the sequence doubles from ``--start``. At each length: one step inside ``zf.memory.track()``
(after a first step at ``--start``, so the optimizer's state exists), whose peak plus the bytes the state
holds between steps (parameters and optimizer state; gradients live inside the step and are in the peak) is
the rank's peak, the largest over the ranks compared with ``--budget``; when it fits, ``--steps`` more
consecutive steps, timed one by one (their median). The doubling stops at the first length over the budget,
at ``--max-seq``, or after a length whose step took more than ``--max-step-s``; the longest length that fit is
reported with its step time, tokens per second and peak, and why the doubling stopped (when not by the budget,
the longest is a lower bound). Then: the longest ``cp N`` against plain torch's (the goal: 8 x at cp 4), and
at one common length (the longest cp 1 fits, or the longest all of them reached) the step time of each
``cp N`` over cp 1's (the goal: within 1.5 x; N ranks share the machine's cores, one thread each).

What is measured is tensor bytes (``zf.memory.track``: every storage a step allocates, on any device), not
the allocator's or the process's: on a CPU the host is the device, so the block inputs ``offload="cpu"``
holds are counted like any tensor (on a GPU they would leave its memory). The first losses of every system
(the same model and sequence) are printed side by side: fp32 systems agree to rounding.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_helpers import add_shape_args, build_llama, proc_status  # noqa: E402
from cli_paths import output_file  # noqa: E402

TORCH = "plain torch"
QUICK = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 4096}
QUICK_RUN = {"budget": "24MB", "start": 64, "max_seq": 1024}
RUN = {"budget": "3GB", "start": 512, "max_seq": 65536}


def parse_args(argv=None):
    """The command line, its sizes and path checked."""
    from zerofn.plan.cli import parse_size

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, hidden=768, intermediate=2048, layers=12, heads=12, kv_heads=4, vocab=32000)
    p.add_argument("--ffn", dest="intermediate", type=int, default=argparse.SUPPRESS, help="= --intermediate")
    p.add_argument("--quick", action="store_true", help=f"a tiny model ({QUICK}) and {QUICK_RUN}, for CI")
    p.add_argument("--bf16", action="store_true", help="bf16 compute: torch's autocast, zerofn's amp")
    p.add_argument("--budget", type=parse_size, default=None, help=f"bytes per rank (default {RUN['budget']})")
    p.add_argument("--start", type=int, default=None, help=f"the first sequence length (default {RUN['start']})")
    p.add_argument("--max-seq", type=int, default=None, help=f"the longest tried (default {RUN['max_seq']})")
    p.add_argument("--max-step-s", type=float, default=60.0, help="no longer sequence after a step this slow")
    p.add_argument("--steps", type=int, default=2, help="consecutive steps timed at each length that fits")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes (ranks)")
    p.add_argument("--methods", nargs="+", default=["ulysses", "ring"], choices=["ulysses", "ring"],
                   help="ulysses at every --cp size; ring at the largest")  # fmt: skip
    p.add_argument("--no-torch", action="store_true", help="leave the plain torch reference out")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--out", default=None, metavar="FILE", help="write every figure here (JSON)")
    args = p.parse_args(argv)
    for key, value in (QUICK_RUN if args.quick else RUN).items():
        if getattr(args, key) is None:
            setattr(args, key, parse_size(value) if key == "budget" else value)
    if args.quick:
        given = {a.dest for a in p._actions if any(s in (argv or sys.argv[1:]) for s in a.option_strings)}
        for key, value in QUICK.items():
            if key not in given:
                setattr(args, key, value)
    if min(args.steps, args.start, args.max_seq, *args.cp) < 1 or args.start > args.max_seq:
        p.error("--steps, --start, --max-seq and --cp must be at least 1, and --start at most --max-seq")
    output_file(p, "--out", args.out)
    return args


def systems(args) -> list[tuple[str, int, str | None]]:
    """(label, ranks, method) of every system, in the order they run; method None: plain torch."""
    out = [] if args.no_torch else [(TORCH, 1, None)]
    if "ulysses" in args.methods:
        out += [(f"cp {n}", n, "ulysses") for n in sorted(set(args.cp))]
    if "ring" in args.methods:
        out.append((f"cp {max(args.cp)} ring", max(args.cp), "ring"))
    return out


def sequence(seq: int, i: int, vocab: int) -> dict:
    """Step ``i``'s sequence of ``seq`` random tokens (the same on every rank and for every system)."""
    import torch

    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1000 * seq + i))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def held_torch(model, opt) -> int:
    """Bytes the plain torch system holds between steps: parameters and the optimizer's state."""
    import torch

    seen, total = set(), 0
    tensors = list(model.parameters()) + [
        v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def build(args, method: str | None, cp: int):
    """``(run, held)``: ``run(batch) -> loss`` trains one step; ``held()`` the bytes held between steps."""
    import torch
    import transformers
    from zerofn.transforms import amp, context_parallel, remat, shard_params

    import zerofn as zf

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    model = build_llama(args, args.max_seq)
    if method is None:
        model.gradient_checkpointing_enable()
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

        def run_torch(batch):
            with torch.autocast("cpu", torch.bfloat16, enabled=args.bf16):
                loss = model(**batch, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return run_torch, lambda: held_torch(model, opt)

    apply = zf.functional(model)

    def loss_fn(params, batch):
        return apply(params, **batch).loss

    step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(args.lr, weight_decay=0.0)))
    if args.bf16:
        step = amp(step, torch.bfloat16)
    chunked = {"chunked_loss": True} if "chunked_loss" in inspect.signature(context_parallel).parameters else {}
    step = remat(context_parallel(step, cp, method=method, **chunked), offload="cpu")
    box = [step.init(apply.params)]  # the state owns the parameters from here

    def run_zf(batch):
        box[0], m = step(box[0], batch)
        zf.block_until_ready(box[0])
        return float(m["loss"])

    return run_zf, lambda: zf.memory.state_bytes(box[0])["total"]


def rank_fn(args, label: str, method: str | None) -> dict:
    """One system on this rank's process group: the doubling, each length's figures (the peaks the largest
    over the ranks, the step times the slowest rank's)."""
    import torch
    import torch.distributed as dist

    import zerofn as zf

    cp = dist.get_world_size()
    run, held = build(args, method, cp)

    def largest(*xs: float) -> list[float]:
        t = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    first_loss = run(sequence(args.start, 0, args.vocab))  # the optimizer's state exists after it
    attempts, seq, stop, i = [], args.start, "max-seq", 1
    while seq <= args.max_seq:
        state = held()
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        with zf.memory.track() as tracker:
            loss = run(sequence(seq, i, args.vocab))
        tracked_s = time.perf_counter() - t0
        i += 1
        peak, state_max, tracked_s = largest(state + tracker.peak, state, tracked_s)
        every = [0] * cp
        dist.all_gather_object(every, state + tracker.peak)
        a = {"seq": seq, "peak": int(peak), "state": int(state_max), "step_peak": tracker.peak, "loss": loss}
        a["peak_ranks"] = every
        a["fits"] = peak <= args.budget
        a["tracked_step_s"] = tracked_s
        if a["fits"]:
            times = []
            for _ in range(args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                run(sequence(seq, i, args.vocab))
                times.append(time.perf_counter() - t0)
                i += 1
            times = largest(*times)
            a["step_s"], a["step_s_all"] = statistics.median(times), times
            a["tokens_s"] = seq / a["step_s"]
        attempts.append(a)
        if not a["fits"]:
            stop = "budget"
            break
        if a["step_s"] > args.max_step_s and seq * 2 <= args.max_seq:
            stop = "step time"
            break
        seq *= 2
    return {"label": label, "ranks": cp, "method": method, "first_loss": first_loss, "attempts": attempts,
            "stopped_by": stop, "peak_rss": proc_status("VmHWM")}  # fmt: skip


def longest(result: dict) -> dict | None:
    fit = [a for a in result["attempts"] if a["fits"]]
    return fit[-1] if fit else None


def at(result: dict, seq: int) -> dict | None:
    return next((a for a in result["attempts"] if a["seq"] == seq and a["fits"]), None)


def report(args, results: list[dict], n_params: int) -> dict:
    """Print the table, the goal lines and the per-length figures; returns the summary for the JSON."""
    unit, scale = ("GiB", 2**30) if args.budget >= 4 * 2**30 else ("MiB", 2**20)
    digits = 2 if unit == "GiB" else 0
    print(
        f"Llama {n_params / 1e6:,.1f} M parameters (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"{args.kv_heads} kv heads, intermediate {args.intermediate}, vocab {args.vocab}, untied head), "
        f"{'bf16' if args.bf16 else 'fp32'}, AdamW, 1 sequence a step; budget {args.budget / scale:.{digits}f} {unit} per rank; "
        f"sequences doubling from {args.start} to at most {args.max_seq}; step time: median of {args.steps} "
        f"consecutive steps; {os.cpu_count()} CPU cores, one thread per rank"
    )
    ref = next((r for r in results if r["label"] == TORCH), None)
    ref_best = longest(ref) if ref else None
    print()
    print(
        f"| system | ranks | longest sequence | stopped by | step s | tokens/s | peak per rank {unit} (state) | vs plain torch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    summary: dict = {"systems": {}}
    for r in results:
        best = longest(r)
        bound = "" if r["stopped_by"] == "budget" else ">= "
        vs = f"{bound}{best['seq'] / ref_best['seq']:.0f} x" if best and ref_best else "-"
        summary["systems"][r["label"]] = {
            "ranks": r["ranks"],
            "longest": best["seq"] if best else None,
            "stopped_by": r["stopped_by"],
            "step_s": best["step_s"] if best else None,
            "tokens_s": best["tokens_s"] if best else None,
            "peak": best["peak"] if best else None,
            "vs_torch": best["seq"] / ref_best["seq"] if best and ref_best else None,
        }
        if best is None:
            print(f"| {r['label']} | {r['ranks']} | none fits ({r['attempts'][0]['peak'] / scale:.{digits}f} {unit} at "
                  f"{args.start}) | budget | - | - | - | - |")  # fmt: skip
            continue
        print(
            f"| {r['label']} | {r['ranks']} | {bound}{best['seq']:,} | {r['stopped_by']} | {best['step_s']:.2f} | "
            f"{best['tokens_s']:,.0f} | {best['peak'] / scale:.{digits}f} ({best['state'] / scale:.{digits}f}) | {vs} |"
        )
    print()
    print(f"per length, peak per rank {unit} (step s); x: over the budget:")
    for r in results:
        cells = [
            f"{a['seq']}: {a['peak'] / scale:.{digits + 1}f}" + (f" ({a['step_s']:.2f})" if a["fits"] else " x")
            for a in r["attempts"]
        ]
        print(f"  {r['label']}: " + ", ".join(cells))
    losses = ", ".join(f"{r['label']} {r['first_loss']:.6f}" for r in results)
    print(f"first step's loss ({args.start} tokens, the same model and sequence): {losses}")

    cps = [r for r in results if r["method"] == "ulysses"]
    top = max((r for r in cps), key=lambda r: r["ranks"], default=None)
    if top and ref_best and longest(top):
        ratio = longest(top)["seq"] / ref_best["seq"]
        bound = "" if top["stopped_by"] == "budget" else "at least "
        summary["goal_longest"] = {"system": top["label"], "ratio": ratio, "lower_bound": bool(bound)}
        print(
            f"{top['label']} trains {bound}{ratio:.0f} x the longest sequence plain torch trains under the same "
            f"budget per rank (goal >= 8 x at cp 4): {'met' if ratio >= 8 else 'NOT met'}"
        )
    one = next((r for r in cps if r["ranks"] == 1), None)
    if one and longest(one):
        common = longest(one)["seq"]
        reached = [r for r in cps if at(r, common)]
        if len(reached) < len(cps):  # the longest every cp system timed
            common = min(longest(r)["seq"] for r in cps if longest(r))
            reached = [r for r in cps if at(r, common)]
        ratios = {r["label"]: at(r, common)["step_s"] / at(one, common)["step_s"] for r in reached if r is not one}
        summary["step_time_vs_cp1"] = {"seq": common, "ratios": ratios}
        if ratios:
            text = ", ".join(f"{k} {v:.2f} x" for k, v in ratios.items())
            worst = max(ratios.values())
            print(
                f"step time per token at {common:,} tokens against cp 1: {text} (goal within 1.5 x): "
                f"{'met' if worst <= 1.5 else 'NOT met'}"
            )
    return summary


def main(argv=None) -> None:
    args = parse_args(argv)
    import zerofn as zf

    load_before = os.getloadavg()[0]
    results, wall = [], {}
    for label, ranks, method in systems(args):
        t0 = time.perf_counter()
        results.append(zf.spawn(rank_fn, ranks, args, label, method)[0])
        wall[label] = time.perf_counter() - t0
        print(f"{label}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    n_params = sum(p.numel() for p in build_llama(args, 128).parameters())
    summary = report(args, results, n_params)
    load = (load_before, os.getloadavg()[0])
    print(f"load average {load[0]:.2f} before, {load[1]:.2f} after; wall time per system: "
          + ", ".join(f"{k} {v:.0f} s" for k, v in wall.items()))  # fmt: skip
    if args.out:
        out = {"args": {k: v for k, v in vars(args).items()}, "parameters": n_params, "load_average": load}
        with open(args.out, "w") as f:
            json.dump({**out, **summary, "wall_s": wall, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
