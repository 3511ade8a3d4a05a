"""Generation on 2 ranks: a Llama split by tensor_parallel(2) against ZeRO-3 gathering per call and gathering once.

    torchrun --nproc_per_node 2 examples/bench_generate.py                  # about 100 M parameters, CPU, gloo
    torchrun --nproc_per_node 2 examples/bench_generate.py --layers 2 --hidden 128 --intermediate 256 --tokens 4

A Llama-shaped Hugging Face model built from a config (nothing downloaded;
grouped-query attention, an untied head), in fp32, generating greedily with
``zf.generate`` at batch 1 from the same prompt on every rank. Three
systems, built in the same process, taking turns:

- ``tensor_parallel(2)``: ``tensor_parallel(step, 2)``; each rank holds its
  slices of the split layers (and its heads' key/value cache) and a token
  all-reduces activations over the two ranks;
- ``shard_params, per call``: ``shard_params(step)``; each rank holds half
  of every parameter, and each token's forward gathers every unit, one at a
  time, and releases it;
- ``shard_params, once``: the same step and state with
  ``zf.generate(..., gather_once=True)``: every unit gathered once before
  the first token, the whole model held on each rank while the tokens run.

Printed per rank: the time per token (the wall time of one ``zf.generate``
call of ``--tokens`` consecutive tokens from a ``--prompt``-token prompt,
over the tokens: the prompt's forward and, for ``once``, the gather are in
it), the median over ``--rounds`` rounds after a warm-up round, the
systems taking turns in each round in a rotated order so the noise of a
shared machine falls on all of them alike, and its ratio to
``tensor_parallel(2)``'s (the median of the rounds' ratios, each between
loops run side by side); the collective bytes of one call per token
(``zf.collectives.counting`` on the default group and on the
tensor-parallel group); the parameter bytes the state holds
(``zf.memory.state_bytes``) and the peak of the tensor bytes one call
allocates (``zf.memory.track``); and whether the tokens equal
``tensor_parallel(2)``'s. ``--json FILE`` writes every figure.
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

from bench_helpers import add_shape_args, build_llama  # noqa: E402
from cli_paths import output_file  # noqa: E402

SYSTEMS = ("tensor_parallel(2)", "shard_params, per call", "shard_params, once")


def parse_args(argv=None):
    """The command line, its path checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p, hidden=768, intermediate=2048, layers=12, heads=12, kv_heads=4, vocab=16000)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens (batch 1)")
    p.add_argument("--tokens", type=int, default=16, help="consecutive tokens generated per system per round")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, after a warm-up round")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), metavar="SYSTEM")
    p.add_argument("--json", default=None, metavar="FILE", help="write every figure here (rank 0)")
    args = p.parse_args(argv)
    if min(args.prompt, args.tokens, args.rounds) < 1:
        p.error("--prompt, --tokens and --rounds must be at least 1")
    if args.heads % 2 or args.kv_heads % 2:
        p.error("--heads and --kv-heads must be even: tensor_parallel(2) gives each rank half of them, whole")
    output_file(p, "--json", args.json)
    return args


if __name__ == "__main__":
    parse_args()  # a wrong command line or path fails here, before torch and transformers are imported

import torch  # noqa: E402
from zerofn.transforms import shard_params, tensor_parallel  # noqa: E402

import zerofn as zf  # noqa: E402
import zerofn.mesh  # noqa: E402


def build_model(args):
    """The same Llama on every rank and for every system (a fresh module each: tensor_parallel splits its layers)."""
    return build_llama(args, args.prompt + args.tokens).eval()


def build(name: str, args):
    model = build_model(args)
    n = sum(p.numel() for p in model.parameters())
    apply = zf.functional(model)

    def loss_fn(params, ids):
        return apply(params, input_ids=ids, labels=ids).loss

    step = zf.train_step(loss_fn, zf.optim.adamw(1e-4))
    step = tensor_parallel(step, 2) if name.startswith("tensor_parallel") else shard_params(step)
    return step, step.init(apply.params), n


def main(argv=None) -> None:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    zf.collectives.init()
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    if world != 2:
        raise SystemExit(f"bench_generate.py: run it on 2 ranks (torchrun --nproc_per_node 2), not {world}")
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    tensor_group = zerofn.mesh.make(tp=2).group("tp")
    systems, n, figures = {}, 0, {}
    for name in args.systems:
        if name == "shard_params, once" and "shard_params, per call" in systems:
            systems[name] = systems["shard_params, per call"]  # the same step and state, generating otherwise
        else:
            t0 = time.perf_counter()
            *systems[name], n = build(name, args)
            figures.setdefault(name, {})["init_s"] = time.perf_counter() - t0
        figures.setdefault(name, {})["params_held"] = zf.memory.state_bytes(systems[name][1])["params"]

    def generate(name: str) -> torch.Tensor:
        step, state = systems[name]
        return zf.generate(step, state, prompt, max_new_tokens=args.tokens, gather_once=name.endswith("once"))

    load_before = os.getloadavg()[0]
    names = list(systems)
    times: dict = {name: [] for name in names}
    tokens: dict = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            tokens[name] = generate(name)
            elapsed = time.perf_counter() - t0
            if r:
                times[name].append(elapsed / args.tokens)
    for name in names:  # one more call each, untimed: its traffic and the peak of what it allocates
        with zf.collectives.counting() as world_c, zf.collectives.counting(group=tensor_group) as tensor_c:
            with zf.memory.track() as tracker:
                generate(name)
        f = figures[name]
        f["comm_bytes_per_token"] = (world_c.bytes + tensor_c.bytes) / args.tokens
        f["comm_calls"] = {"default group": world_c.calls, "tensor-parallel group": tensor_c.calls}
        f["peak"] = tracker.peak
        f["token_s"] = statistics.median(times[name])
        f["token_s_all"] = times[name]
        f["tokens"] = tokens[name][0, args.prompt :].tolist()
    load = (load_before, os.getloadavg()[0])
    every = [None] * world
    torch.distributed.all_gather_object(every, {"figures": figures, "times": times})
    if rank == 0:
        ratios = report(args, every, n, load)
        if args.json:
            out = {"args": vars(args), "parameters": n, "load_average": load}
            with open(args.json, "w") as f:
                json.dump({**out, "ranks": every, "ratios": ratios}, f, indent=1)


def report(args, every: list, n: int, load: tuple) -> dict:
    """Print the figures of every rank and each system's time per token against tensor_parallel(2)'s."""
    mib = 2**20
    names = list(every[0]["figures"])
    base = SYSTEMS[0] if SYSTEMS[0] in names else names[0]
    print(
        f"Llama {n / 1e6:,.1f} M parameters fp32 (hidden {args.hidden}, {args.layers} layers, {args.heads} heads, "
        f"{args.kv_heads} kv heads, intermediate {args.intermediate}, vocab {args.vocab}); {len(every)} ranks, "
        f"batch 1, a {args.prompt}-token prompt, {args.tokens} tokens per call; time per token: median (and best) "
        f"of {args.rounds} rounds; load average {load[0]:.2f} before, {load[1]:.2f} after"
    )
    print(
        f"{'system':<24}{'rank':>5}{'ms per token':>16}{f'vs {base}':>24}{'comm KiB/token':>16}"
        f"{'params held MiB':>17}{'call peak MiB':>15}{'tokens equal':>14}"
    )
    ratios = {}
    for name in names:
        for r, out in enumerate(every):
            f, b = out["figures"][name], out["figures"][base]
            per_round = [x / y for x, y in zip(out["times"][name], out["times"][base])]  # taken side by side
            ratio = statistics.median(per_round)
            ratios[f"{name} / {base}, rank {r}"] = {"token_s": ratio, "token_s_rounds": per_round}
            token = f"{1e3 * f['token_s']:.1f} ({1e3 * min(f['token_s_all']):.1f})"
            vs = f"{ratio:.2f} ({min(per_round):.2f} - {max(per_round):.2f})"
            print(
                f"{name:<24}{r:>5}{token:>16}{vs:>24}{f['comm_bytes_per_token'] / 1024:>16.1f}"
                f"{f['params_held'] / mib:>17.1f}{f['peak'] / mib:>15.1f}{str(f['tokens'] == b['tokens']):>14}"
            )
    return ratios


if __name__ == "__main__":
    main()
