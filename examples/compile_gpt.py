"""Step time of the examples' GPT with its blocks compiled (``block.compile()``) against the same GPT in eager,
under each zerofn composition, on local gloo ranks.

    python examples/compile_gpt.py                       # 2 ranks, inductor, every composition
    python examples/compile_gpt.py --stages plain shard_params --steps 10 --rounds 5
    python examples/compile_gpt.py --backend aot_eager   # dynamo and AOTAutograd without code generation
    python examples/compile_gpt.py --whole               # also the model compiled whole (model.compile())

For each composition both models are built from the same seed in the same ranks and warmed up (the compiled one
compiles there), then take turns in rounds: each times a loop of ``--steps`` consecutive steps (synchronised only
before and after it; ms per step = the loop's wall time over its steps), and the ratio compiled / eager is taken
round by round (so that a noisy machine slows both alike); the table shows the medians. It also counts what
dynamo did during the timed rounds (graphs compiled, graph breaks, calls it skipped), which should all be 0, and
the difference of the final losses. Dynamo's caches are kept from one composition to the next, as in one training
process (a composition whose graph is already compiled compiles nothing).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import zerofn as zf
from zerofn import collectives as C

STAGES = (
    "plain",
    "shard_optimizer",
    "shard_grads",
    "shard_params",
    "amp",
    "remat",
    "offload",
    "shard_params+amp+remat",
)


@dataclasses.dataclass(frozen=True)
class Config:
    stages: tuple = STAGES
    backend: str = "inductor"
    whole: bool = False
    dim: int = 128
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    vocab: int = 64
    batch: int = 8
    steps: int = 10
    rounds: int = 5
    warmup: int = 3
    threads: int = 1


def composition(stage: str):
    from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

    return {
        "plain": lambda s: s,
        "shard_optimizer": shard_optimizer,
        "shard_grads": shard_grads,
        "shard_params": shard_params,
        "amp": lambda s: amp(s, torch.bfloat16),
        "remat": remat,
        "offload": lambda s: offload(s, "cpu"),
        "shard_params+amp+remat": lambda s: amp(remat(shard_params(s)), torch.bfloat16),
    }[stage]


def build(cfg: Config, stage: str, variant: str):
    """(step, state) of ``stage`` over a GPT from seed 0: eager, its blocks compiled, or compiled whole."""
    from zerofn.bench.gpt import GPT, GPTConfig, loss_fn_for

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=cfg.vocab, seq_len=cfg.seq_len, dim=cfg.dim, heads=cfg.heads, layers=cfg.layers))
    if variant == "blocks":
        for block in model.blocks:  # before zf.functional and step.init: the order that works (docs/compile.md)
            block.compile(backend=cfg.backend)
    elif variant == "whole":
        model.compile(backend=cfg.backend)
    apply = zf.functional(model)
    step = composition(stage)(zf.train_step(loss_fn_for(apply), zf.optim.adamw(3e-4, weight_decay=0.1)))
    return [step, step.init(apply.params)]


def rank_main(cfg: Config) -> list[dict]:
    from torch._dynamo.utils import counters

    from zerofn.bench.gpt import MarkovCorpus

    torch.set_num_threads(cfg.threads)
    world, rank = C.world_size(), C.rank()
    corpus = MarkovCorpus(vocab=cfg.vocab)
    batches = [
        corpus.sample(cfg.batch * world, cfg.seq_len + 1, seed=i)[rank * cfg.batch :][: cfg.batch] for i in range(4)
    ]
    rows = []
    for stage in cfg.stages:
        variants = ["eager", "blocks"] + (["whole"] if cfg.whole and "remat" not in stage else [])
        runs = {v: build(cfg, stage, v) for v in variants}
        loss = {}
        for v, run in runs.items():
            for i in range(cfg.warmup):
                run[1], m = run[0](run[1], batches[i % len(batches)])
            loss[v] = float(m["loss"])
        before = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        skipped = sum(counters["unimplemented"].values())
        ms: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(cfg.rounds):
            for v in variants if r % 2 == 0 else reversed(variants):
                step, state = runs[v]
                C.barrier()
                t0 = time.perf_counter()
                for i in range(cfg.steps):
                    state, m = step(state, batches[i % len(batches)])
                float(m["loss"])
                C.barrier()
                ms[v].append((time.perf_counter() - t0) / cfg.steps * 1e3)
                runs[v][1] = state
        after = (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()))
        row = {"stage": stage, "eager_ms": statistics.median(ms["eager"])}
        for v in variants[1:]:
            row[f"{v}_ms"] = statistics.median(ms[v])
            row[f"{v}_ratio"] = statistics.median(c / e for c, e in zip(ms[v], ms["eager"]))
            row[f"{v}_loss_diff"] = abs(loss[v] - loss["eager"])
        row["graphs_timed"], row["breaks_timed"] = after[0] - before[0], after[1] - before[1]
        row["skipped_timed"] = sum(counters["unimplemented"].values()) - skipped
        rows.append(row)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = Config()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    p.add_argument("--backend", default=defaults.backend, help="torch.compile backend (inductor, aot_eager, ...)")
    p.add_argument("--whole", action="store_true", help="also the model compiled whole (not under remat)")
    for name in ("dim", "layers", "heads", "seq_len", "vocab", "batch", "steps", "rounds", "warmup", "threads"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    args = p.parse_args(argv)
    cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config) if hasattr(args, f.name)})
    cfg = dataclasses.replace(cfg, stages=tuple(args.stages))
    rows = zf.spawn(rank_main, args.world, cfg, timeout=3600)[0]
    print(
        f"GPT dim {cfg.dim}, {cfg.layers} blocks, {cfg.seq_len} tokens x {cfg.batch} per rank, {args.world} rank(s), "
        f"{cfg.threads} thread(s) each; blocks compiled with {cfg.backend}; {cfg.steps} steps x {cfg.rounds} rounds"
    )
    whole = any("whole_ms" in r for r in rows)
    head = f"{'composition':<24} {'eager ms':>9} {'compiled ms':>12} {'ratio':>6}"
    head += f" {'whole ms':>9} {'ratio':>6}" if whole else ""
    print(head + f" {'graphs':>6} {'breaks':>6} {'skipped':>7} {'|loss diff|':>11}")
    for r in rows:
        line = f"{r['stage']:<24} {r['eager_ms']:>9.1f} {r['blocks_ms']:>12.1f} {r['blocks_ratio']:>6.2f}"
        if whole:
            line += f" {r['whole_ms']:>9.1f} {r['whole_ratio']:>6.2f}" if "whole_ms" in r else f" {'-':>9} {'-':>6}"
        print(
            line
            + f" {r['graphs_timed']:>6} {r['breaks_timed']:>6} {r['skipped_timed']:>7} {r['blocks_loss_diff']:>11.2g}"
        )


if __name__ == "__main__":
    main()
