"""Offload figures, each a ratio measured in one run.

    python examples/bench_offload.py [--params 16000000] [--path /mnt/nvme/tmp]

1. CPU update throughput: zerofn's offloaded AdamW (host copies of
   gradients and parameters, torch's fused kernel on the host) against
   ``torch.optim.AdamW(fused=True)`` stepping CPU tensors in place; same
   process, interleaved.
2. NVMe streaming: bytes per second the offloaded update reads and writes,
   against a plain sequential write and read of the same number of bytes in
   files on the same disk.
3. The GPT example with ``offload(..., "nvme")`` against no offload: step
   time, and peak RSS of each (fresh processes).
4. The host update alongside the forward: the GPT with ``offload("cpu")``
   updating before the step returns (``overlap=False``), on a worker thread
   alongside the next forward (``overlap=True``), started during backward
   as each gradient lands (``early=True``), one step late (``delay=1``),
   and without offload; one process with one compute thread
   (so that a core is free for the host update, as a GPU machine's host
   cores are free while the GPU computes), the systems taking turns in
   rounds of a few steps, each round ending when its last update has.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_paths import existing_dir  # noqa: E402


def parse_args(argv=None):
    """The command line, its path checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=16_000_000)
    p.add_argument(
        "--path",
        default=tempfile.gettempdir(),
        help="an existing directory on the disk to stream from (temporary files are made in it and removed)",
    )
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--only-overlap", action="store_true", help="run the fourth measurement alone")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="the fourth measurement's bucket size")
    p.add_argument("--batch", type=int, default=8, help="the fourth measurement's sequences per step")
    args = p.parse_args(argv)
    existing_dir(
        p,
        "--path",
        args.path,
        f"create it first (mkdir -p {args.path}) on the disk to measure, or leave --path out to use the system's "
        "temporary directory",
    )
    return args


if __name__ == "__main__":
    parse_args()  # a wrong command line or path fails here, before torch is imported

import torch  # noqa: E402
from zerofn.transforms import offload  # noqa: E402

import zerofn as zf  # noqa: E402


def _median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_update(n: int, repeat: int) -> None:
    torch.manual_seed(0)
    p_ref = torch.nn.Parameter(torch.randn(n))
    grad = torch.randn(n)
    ref = torch.optim.AdamW([p_ref], lr=1e-3, fused=True)
    params = {"b0": torch.randn(n)}
    opt = offload(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)), "cpu").effective_optimizer
    state = [opt.init(params)]

    def zf_step():
        state[0] = zf.optim.update_params(opt, {"b0": grad}, state[0], params)

    def torch_step():
        p_ref.grad = grad
        ref.step()

    def host_update():  # the update on the host state alone, without the copies in and out
        s = state[0]
        state[0] = s._replace(inner=zf.optim.update_params(opt_inner, s.grads, s.inner, s.params))

    opt_inner = zf.optim.adamw(1e-3)
    for f in (zf_step, torch_step, host_update):
        f()
    runs: dict = {f: [] for f in (zf_step, torch_step, host_update)}
    for _ in range(repeat):
        for f in runs:
            runs[f].append(_median_time(f, 1))
    a, b, c = (statistics.median(runs[f]) for f in (zf_step, torch_step, host_update))
    print(
        f"1. CPU update, {n:,} parameters: torch AdamW(fused) {n / b / 1e6:,.0f} M params/s; offloaded AdamW's "
        f"host update {n / c / 1e6:,.0f} M params/s (ratio {b / c:.2f}); with the copies of gradients in and "
        f"parameters out {n / a / 1e6:,.0f} M params/s (ratio {b / a:.2f})"
    )


def nvme_stream(n: int, path: str, repeat: int) -> None:
    root = tempfile.mkdtemp(dir=path)
    opt = offload(zf.train_step(lambda p, b: 0, zf.optim.adamw(1e-3)), "nvme", path=root).effective_optimizer
    params = {"b0": torch.randn(n)}
    state = [opt.init(params)]
    grad = {"b0": torch.randn(n)}

    def update():
        state[0] = zf.optim.update_params(opt, grad, state[0], params)

    update()
    moved = 2 * n * 4 * 2 + n * 4 * 2  # moments read + written, parameters staged out and back
    blob = torch.randn(moved // 2 // 4)
    raw = os.path.join(root, "raw.bin")

    def plain():
        with open(raw, "wb") as f:
            f.write(memoryview(blob.numpy()))
        with open(raw, "rb") as f:
            f.readinto(memoryview(blob.numpy()))

    plain()
    t_up = statistics.median(_median_time(update, 1) for _ in range(repeat))
    t_raw = statistics.median(_median_time(plain, 1) for _ in range(repeat))
    print(
        f"2. NVMe streaming, {moved / 2**20:,.0f} MiB moved per update: offloaded update "
        f"{moved / t_up / 2**20:,.0f} MiB/s, plain sequential write+read {moved / t_raw / 2**20:,.0f} MiB/s: "
        f"ratio {t_raw / t_up:.2f}"
    )


def _gpt_rank(where, path, steps):
    from gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for

    torch.manual_seed(0)
    apply = zf.functional(GPT(GPTConfig(vocab=64, dim=256, layers=4)))
    step = zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-3))
    if where == "nvme":
        step = offload(step, "nvme", path=tempfile.mkdtemp(dir=path))
    state = step.init(apply.params)
    batch = MarkovCorpus(64).sample(8, 65, seed=1)
    state, _ = step(state, batch)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, float(m["loss"])


def gpt(path: str, steps: int) -> None:
    base = zf.spawn(_gpt_rank, 1, None, path, steps)[0]
    nvme = zf.spawn(_gpt_rank, 1, "nvme", path, steps)[0]
    print(
        f"3. GPT (3.2 M parameters): step {1e3 * base[0]:.1f} ms without offload, {1e3 * nvme[0]:.1f} ms with "
        f"offload(nvme) (ratio {nvme[0] / base[0]:.2f}); peak RSS {base[1] / 2**20:.0f} MiB against "
        f"{nvme[1] / 2**20:.0f} MiB; loss {base[2]:.4f} and {nvme[2]:.4f}"
    )


OVERLAP_SYSTEMS = {
    "no offload": None,
    "offload, update first": dict(overlap=False),
    "offload, overlapped": dict(overlap=True),
    "offload, early": dict(overlap=True, early=True),
    "offload, delay=1": dict(delay=1),
}


def _overlap_rank(rounds, per_round, bucket_bytes, batch_size):
    from gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for

    systems = {}
    for name, options in OVERLAP_SYSTEMS.items():
        torch.manual_seed(0)
        apply = zf.functional(GPT(GPTConfig(vocab=64, dim=256, layers=4)))
        step = zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-3), bucket_bytes=bucket_bytes)
        if options is not None:
            step = offload(step, "cpu", **options)
        systems[name] = [step, step.init(apply.params)]
    batch = MarkovCorpus(64).sample(batch_size, 65, seed=1)
    times: dict = {name: [] for name in systems}
    names = list(systems)
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step, state = systems[name]
            t0 = time.perf_counter()
            for _ in range(per_round):
                state, m = step(state, batch)
            _ = state.opt_state  # reading it waits: the round ends when its last update has
            if r:
                times[name].append((time.perf_counter() - t0) / per_round)
            systems[name][1] = state
    return {name: statistics.median(t) for name, t in times.items()}


def overlap(rounds: int, bucket_bytes: int, batch_size: int = 8, per_round: int = 3) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # every thread of the child, the update's worker too
    t = zf.spawn(_overlap_rank, 1, rounds, per_round, bucket_bytes, batch_size)[0]
    first = t["offload, update first"]
    cells = ", ".join(f"{name} {1e3 * v:.1f} ms ({v / first:.2f})" for name, v in t.items())
    print(
        f"4. The host update alongside the forward (GPT 3.2 M, batch {batch_size} x 64 tokens, one compute "
        f"thread; ratio to updating first): {cells}"
    )


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)
    if not args.only_overlap:
        cpu_update(args.params, args.repeat)
        nvme_stream(args.params, args.path, args.repeat)
        gpt(args.path, args.steps)
    overlap(args.steps, int(args.bucket_mb * 2**20), args.batch)


if __name__ == "__main__":
    main()
