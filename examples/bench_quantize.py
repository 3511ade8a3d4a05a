"""QLoRA: a LoRA Llama with its frozen base in NF4 against the same model with a bf16 base, on 2 ranks.

    torchrun --nproc_per_node 2 examples/bench_quantize.py                  # about 100 M parameters, CPU, gloo
    torchrun --nproc_per_node 2 examples/bench_quantize.py --layers 2 --hidden 128 --intermediate 256 --steps 1

A Llama-shaped Hugging Face model built from a config (nothing downloaded;
grouped-query attention, an untied head), LoRA adapters (peft) on its seven
projections, the base frozen, AdamW on the adapters. Four systems, all
under ZeRO-3 (``shard_params``) with bf16 compute (``amp``), trained in the
same process, taking turns:

- ``bf16 base``: ``amp(shard_params(step), torch.bfloat16)``; the frozen
  weights held in bf16, 2 bytes per parameter;
- ``nf4 base``: ``quantize(amp(shard_params(step), torch.bfloat16), "nf4")``;
  every frozen projection weight held as NF4 codes and double-quantized
  block scales (0.52 bytes per parameter), dequantized to bf16 per call;
  the embedding, the norms and the head stay bf16;
- each again with ``offload(..., "cpu", params="cpu")``: the parameter
  shards and the optimizer state (with amp's fp32 masters) in host memory.

Printed per rank, from the same run: the bytes its state holds (parameters,
optimizer state, and where they rest: ``zf.memory.state_bytes``), the bytes
of the frozen base among them and of its projection weights alone, the
collective bytes of one step (``metrics["comm_bytes"]``), the peak of the
tensor bytes a step allocates (``zf.memory.track`` over one untimed step)
and the step time: the wall time of ``--steps`` consecutive steps over their
number, a loop per system per round after a warm-up round, the systems
taking turns in each round (in a rotated order) so that the noise of a
shared machine falls on all of them alike; the median over the rounds.
Then the NF4 / bf16 ratios of each pair (the step time's: the median of the
rounds' ratios, each taken between loops run side by side), and what
dequantizing the base in forward and again in backward costs a rank per
step (every quantized weight decoded on random weights of its shape, timed
alone). ``--json FILE`` writes every figure.
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

SYSTEMS = ("bf16 base", "nf4 base", "bf16 base, offloaded", "nf4 base, offloaded")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv=None):
    """The command line, its path checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, hidden=768, intermediate=2048, layers=12, heads=12, kv_heads=4, vocab=16000)
    p.add_argument("--lora", type=int, default=16, metavar="R", help="LoRA rank on the seven projections")
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=4, help="consecutive steps timed per system per round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, after a warm-up round")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), metavar="SYSTEM")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure here (rank 0)")
    args = p.parse_args(argv)
    if min(args.steps, args.rounds, args.batch, args.seq_len, args.lora) < 1:
        p.error("--steps, --rounds, --batch, --seq-len and --lora must be at least 1")
    output_file(p, "--json", args.json)
    return args


if __name__ == "__main__":
    parse_args()  # a wrong command line or path fails here, before torch and transformers are imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402
from zerofn.transforms import amp, offload, quantize, shard_params  # noqa: E402
from zerofn.transforms.quantize import quantized_layers  # noqa: E402

import zerofn as zf  # noqa: E402
from zerofn.bench.gpt import MarkovCorpus  # noqa: E402
from zerofn.placement import held_bytes  # noqa: E402


def build_model(args):
    """The same LoRA Llama on every rank and for every system (a fresh module each: quantize rewrites its layers)."""
    from peft import LoraConfig, get_peft_model

    model = build_llama(args, args.seq_len)
    n = sum(p.numel() for p in model.parameters())
    lora = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, target_modules=list(PROJECTIONS), lora_dropout=0.0)
    return get_peft_model(model, lora), n


def build_step(name: str, apply):
    def loss_fn(params, batch):
        logits = apply(params, input_ids=batch[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())

    step = amp(shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3, weight_decay=0.0))), torch.bfloat16)
    if name.endswith("offloaded"):
        step = offload(step, "cpu", params="cpu")  # the parameter shards in RAM, and the optimizer state with them
    if name.startswith("nf4"):
        step = quantize(step, "nf4")
    return step


def base_bytes(state) -> tuple[int, int]:
    """Bytes this rank holds of the frozen base: all of it, and the seven projections' weights alone (their
    share of each frozen bucket's shard; NF4's codes and scales under quantize)."""
    frozen = sum(held_bytes(state.frozen).values())
    proj = 0.0
    for bucket in state.spec.layout.frozen_buckets:
        for s in bucket.slots:
            if any(f"{p}.base_layer.weight" in s.name for p in PROJECTIONS):
                proj += s.numel * bucket.dtype.itemsize / bucket.shards
    return frozen, round(proj)


def dequantize_s(layers: dict) -> float:
    """Seconds to dequantize every quantized weight once, as a layer's forward does (timed on random weights
    of the same shapes and codec: each distinct shape decoded three times, the median, times its count)."""
    by_shape: dict = {}
    for q in layers.values():
        by_shape.setdefault((q.shape, q.dtype, q.compute_dtype), [q, 0])[1] += 1
    total = 0.0
    for q, count in by_shape.values():
        parts = q.codec.encode(torch.randn(q.shape, dtype=torch.float32).to(q.dtype) * 0.02)
        runs = []
        for _ in range(4):
            t0 = time.perf_counter()
            q.codec.decode(parts, q.shape, q.dtype).to(q.compute_dtype)
            runs.append(time.perf_counter() - t0)
        total += statistics.median(runs[1:]) * count
    return total


def main(argv=None) -> None:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    zf.collectives.init()
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    corpus = MarkovCorpus(vocab=args.vocab, seed=0)
    n_batches = (args.rounds + 1) * args.steps + 1  # every round's loop, then the tracked step
    data = corpus.sample(n_batches * world * args.batch, args.seq_len + 1, seed=1)
    per = world * args.batch

    def batch(i: int) -> torch.Tensor:
        rows = data[i * per : (i + 1) * per]
        return rows[rank * args.batch : (rank + 1) * args.batch]

    load_before = os.getloadavg()[0]
    systems, figures, n, trainable, layers = {}, {}, 0, 0, {}
    for name in args.systems:
        model, n = build_model(args)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        apply = zf.functional(model)
        step = build_step(name, apply)
        t0 = time.perf_counter()
        state = step.init(apply.params)
        t_init = time.perf_counter() - t0
        layers = layers or quantized_layers(model)
        del model
        held = zf.memory.state_bytes(state)
        frozen, proj = base_bytes(state)
        figures[name] = {
            "state": {k: v for k, v in held.items() if k != "by_placement"},
            "by_placement": held["by_placement"],
            "frozen_base": frozen,
            "projection_weights": proj,
            "init_s": t_init,
        }
        systems[name] = [step, state]
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
                state, m = step(state, batch(r * args.steps + k))
                if r == 0 and k == 0:  # untimed round
                    figures[name]["first_loss"] = float(m["loss"])
            zf.block_until_ready(state)
            elapsed = time.perf_counter() - t0
            if r:
                times[name].append(elapsed / args.steps)
            systems[name][1] = state
            figures[name]["comm_bytes"] = int(m["comm_bytes"])  # the same every step
            bar.update(1)
    bar.close()
    for name in names:  # one more step each, untimed: the peak of what a step allocates
        step, state = systems[name]
        with zf.memory.track() as tracker:
            state, m = step(state, batch((args.rounds + 1) * args.steps))
        zf.block_until_ready(state)
        systems[name][1] = state
        figures[name]["step_peak"] = tracker.peak
        figures[name]["last_loss"] = float(m["loss"])
        figures[name]["step_s"] = statistics.median(times[name])
        figures[name]["step_s_all"] = times[name]
    load = (load_before, os.getloadavg()[0])
    if layers:  # what dequantizing costs: every quantized weight in forward and again in backward
        for name in names:
            if name.startswith("nf4"):
                figures[name]["dequantize_s"] = 2 * dequantize_s(layers)
    every = [None] * world
    torch.distributed.all_gather_object(every, {"figures": figures, "peak_rss": proc_status("VmHWM"), "times": times})
    if rank == 0:
        ratios = report(args, every, n, trainable, load)
        if args.json:
            out = {"args": vars(args), "parameters": n, "trainable": trainable, "load_average": load}
            with open(args.json, "w") as f:
                json.dump({**out, "ranks": every, "ratios": ratios}, f, indent=1)


PAIRS = (("nf4 base", "bf16 base"), ("nf4 base, offloaded", "bf16 base, offloaded"))


def report(args, every: list, n: int, trainable: int, load: tuple) -> dict:
    """Print the figures of every rank and the NF4 / bf16 ratios; returns the ratios."""
    mib = 2**20
    names = list(every[0]["figures"])
    print(
        f"Llama {n / 1e6:,.1f} M parameters (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"{args.kv_heads} kv heads, intermediate {args.intermediate}, vocab {args.vocab}), LoRA r={args.lora} on "
        f"{len(PROJECTIONS)} projections: {trainable / 1e6:,.2f} M trained; {len(every)} ranks, batch {args.batch} "
        f"x {args.seq_len} tokens per rank; step time: {args.steps} consecutive steps per round, median (and best) "
        f"of {args.rounds} rounds; load average {load[0]:.2f} before, {load[1]:.2f} after"
    )
    print(
        f"{'system':<22}{'rank':>5}{'params MiB':>12}{'optimizer MiB':>15}{'frozen base MiB':>17}"
        f"{'projections MiB':>17}{'comm MiB/step':>15}{'step peak MiB':>15}{'step s':>15}{'loss':>17}"
    )
    for name in names:
        for r, out in enumerate(every):
            f = out["figures"][name]
            step_s = f"{f['step_s']:.2f} ({min(out['times'][name]):.2f})"
            print(
                f"{name:<22}{r:>5}{f['state']['params'] / mib:>12.1f}{f['state']['optimizer'] / mib:>15.1f}"
                f"{f['frozen_base'] / mib:>17.1f}{f['projection_weights'] / mib:>17.1f}"
                f"{f['comm_bytes'] / mib:>15.1f}{f['step_peak'] / mib:>15.1f}"
                f"{step_s:>15}"
                f"{f['first_loss']:>9.3f} ->{f['last_loss']:>6.3f}"
            )
    for r, out in enumerate(every):
        cells = "; ".join(
            f"{name} " + ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in out["figures"][name]["by_placement"].items())
            for name in names
        )
        print(f"rank {r}, held by placement: {cells}; peak RSS of the process {out['peak_rss'] / 2**30:.2f} GiB")
    ratios = {}
    for nf4, bf16 in PAIRS:
        if nf4 not in names or bf16 not in names:
            continue
        for r, out in enumerate(every):
            a, b = out["figures"][nf4], out["figures"][bf16]
            per_round = [x / y for x, y in zip(out["times"][nf4], out["times"][bf16])]  # taken side by side
            ratio = {
                "params": a["state"]["params"] / b["state"]["params"],
                "frozen_base": a["frozen_base"] / b["frozen_base"],
                "projection_weights": a["projection_weights"] / b["projection_weights"],
                "comm_bytes": a["comm_bytes"] / b["comm_bytes"],
                "step_peak": a["step_peak"] / b["step_peak"],
                "step_s": statistics.median(per_round),
                "step_s_rounds": per_round,
            }
            ratios[f"{nf4} / {bf16}, rank {r}"] = ratio
            print(
                f"{nf4} / {bf16}, rank {r}: params held {ratio['params']:.2f}, frozen base {ratio['frozen_base']:.2f}, "
                f"projection weights {ratio['projection_weights']:.3f}, comm {ratio['comm_bytes']:.2f}, step peak "
                f"{ratio['step_peak']:.2f}, step time {ratio['step_s']:.2f} (median of the rounds' ratios, "
                f"{min(per_round):.2f} to {max(per_round):.2f}); dequantizing the base in forward and backward "
                f"{1e3 * a['dequantize_s']:.0f} ms a step"
            )
    return ratios


if __name__ == "__main__":
    main()
