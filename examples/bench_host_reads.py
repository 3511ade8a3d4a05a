"""Step time with the update decided on the device against the same step reading its decision on the host.

A step reads nothing on the host: whether the update applies, the loss scale and the counts are decided on
the device (docs/design.md, "What a step reads on the host"). ``ZEROFN_CHECK_EACH_UPDATE=1`` brings back
one read per update (the debugging switch). This times both in one process, alternating, as loops of
consecutive steps synchronised only before and after, for AdamW in fp32 and under ``amp`` fp16 (dynamic
loss scale), on the CPU or a GPU (``--device cuda``). On the CPU a read waits for nothing, so the ratio
there only shows that deciding on the device costs nothing; on a GPU the read stops the host from running
ahead of the device.

    python examples/bench_host_reads.py [--device cuda] [--dim 512 --layers 8 --seq-len 256 --batch 16]
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="steps per timed loop")
    p.add_argument("--rounds", type=int, default=3, help="timed loops of each path, alternating")
    args = p.parse_args()

    import torch
    from zerofn.transforms import amp

    import zerofn as zf
    from zerofn.bench.gpt import GPT, GPTConfig, loss_fn_for

    device = torch.device(args.device)
    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers)
    batch = torch.randint(args.vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = batch.to(device)
    rows = []
    for name, wrap in (("adamw fp32", lambda s: s), ("adamw amp fp16", lambda s: amp(s, torch.float16))):
        torch.manual_seed(0)
        apply = zf.functional(GPT(cfg).to(device))
        step = wrap(zf.train_step(loss_fn_for(apply), zf.optim.adamw(3e-4, weight_decay=0.1)))
        state = step.init(apply.params)
        times: dict[str, list[float]] = {"device": [], "host": []}
        for _ in range(args.rounds):
            for path in ("device", "host"):
                if path == "host":
                    os.environ["ZEROFN_CHECK_EACH_UPDATE"] = "1"
                try:
                    state, _ = step(state, batch)  # a warm-up step on this path
                    zf.block_until_ready(state)
                    start = time.perf_counter()
                    for _ in range(args.steps):
                        state, metrics = step(state, batch)
                    zf.block_until_ready(state)
                    times[path].append((time.perf_counter() - start) / args.steps)
                finally:
                    os.environ.pop("ZEROFN_CHECK_EACH_UPDATE", None)
        on_device, on_host = min(times["device"]), min(times["host"])
        rows.append((name, on_device * 1e3, on_host * 1e3, on_device / on_host, float(metrics["loss"])))
    print(f"device {device}, GPT dim {args.dim} x {args.layers} layers, {args.batch} x {args.seq_len} tokens")
    print("| step | decided on the device, ms | read on the host, ms | device / host | loss |")
    print("|---|---|---|---|---|")
    for name, d, h, r, loss in rows:
        print(f"| {name} | {d:.3f} | {h:.3f} | {r:.3f} | {loss:.4f} |")


if __name__ == "__main__":
    main()
