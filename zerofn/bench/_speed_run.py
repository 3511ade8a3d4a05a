"""One system of ``python -m zerofn.bench.gpu_speed`` in processes of its own, one per rank.

The parent (:func:`run_system`) starts a child for the system (plain python
for one rank, ``python -m torch.distributed.run --standalone`` for more),
so that no system inherits another's allocator state, compiled kernels or
memory, and reads back the one JSON line the child prints after
:data:`RESULT_TAG`; a child that fails is reported by the line that says
why (:func:`last_error`). In each child, :func:`run_one` joins the process
group, builds the system, times its steps and measures its memory, and
rank 0 gathers every rank's figures. :func:`gpu_name` asks a child for the
CUDA device's name, so that the parent holds no CUDA context.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time

import torch

from zerofn.bench._speed_rows import flops_per_token
from zerofn.bench._speed_systems import DEEPSPEED_SYSTEMS, build, gpt_params

__all__ = ["MODULE", "RESULT_TAG", "gpu_name", "last_error", "run_one", "run_system"]

RESULT_TAG = "BENCH_GPU_RESULT "
MODULE = "zerofn.bench.gpu_speed"  # what a child runs (``python -m``)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join_group(system: str, device: torch.device, world: int) -> None:
    """Join the default process group: always under torchrun, and alone for the systems that need one."""
    import torch.distributed as dist

    if world == 1 and not (system == "fsdp2" or system.startswith("deepspeed")):
        return  # zerofn and plain torch need no group on one rank
    if world == 1:  # a group of one, as torchrun would set it up
        for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(k, v)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def run_one(args) -> dict | None:
    """This rank's part of one system's benchmark; rank 0 returns the result, the others None."""
    import torch.distributed as dist

    from zerofn.bench.gpt import GPTConfig

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    _join_group(args.one, device, world)
    rank = dist.get_rank() if dist.is_initialized() else 0

    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers)
    n_params = gpt_params(cfg)
    g = torch.Generator().manual_seed(1)  # the same global batch for every system; each rank its slice
    data = torch.randint(args.vocab, (args.batch * world, args.seq_len + 1), generator=g)
    batch = data[rank * args.batch : (rank + 1) * args.batch].to(device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    tracker = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    else:
        import zerofn as zf

        tracker = zf.memory.track()
        tracker.__enter__()
    try:
        step = build(args.one, cfg, device, world, args.batch)
        for _ in range(max(args.warmup, 0 if cuda else 1)):  # on the CPU at least one tracked step
            step(batch)
        sync()
    finally:
        if tracker is not None:
            tracker.__exit__(None, None, None)
    held = torch.cuda.memory_allocated(device) if cuda else tracker.current  # between steps

    times, loss = [], None
    for _ in range(args.rounds):  # loops of consecutive steps: what a training loop waits for
        if world > 1:
            dist.barrier()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            loss = step(batch)
        sync()
        times.append((time.perf_counter() - t0) / args.steps)
    loss = float(loss) if loss is not None else float("nan")
    peak = torch.cuda.max_memory_allocated(device) if cuda else tracker.peak
    state = step.state_bytes() if hasattr(step, "state_bytes") else None

    mine = {"times": times, "peak": peak, "held": held, "state": state}
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if rank != 0:
        return None
    step_times = [max(r["times"][i] for r in everyone) for i in range(args.rounds)]  # the slowest rank's
    median = min(step_times)
    tokens = args.batch * args.seq_len * world
    fpt = flops_per_token(n_params, args.layers, args.seq_len, args.dim)
    return {
        "system": args.one,
        "world": world,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "params": n_params,
        "step_s": median,
        "tokens_per_s": tokens / median,
        "flops_per_token": fpt,
        "achieved_tflops": fpt * tokens / median / 1e12,
        "peak_bytes": max(r["peak"] for r in everyone),
        "held_bytes": max(r["held"] for r in everyone),
        "peak_source": "torch.cuda.max_memory_allocated" if cuda else "zf.memory.track",
        "state_bytes": everyone[0]["state"],
        "round_step_s": step_times,
        "loss": loss,
    }


def _child_argv(args, system: str) -> list[str]:
    flags = [
        "--one",
        system,
        "--device",
        args.device,
        "--dim",
        str(args.dim),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--vocab",
        str(args.vocab),
        "--seq-len",
        str(args.seq_len),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--rounds",
        str(args.rounds),
    ]
    if args.nproc == 1:
        return [sys.executable, "-m", MODULE, *flags]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc)]
    return [*launcher, "-m", MODULE, *flags]


def last_error(text: str) -> str:
    """The line that says why a child failed: its last exception line (``SomethingError: ...``), else the last
    line that mentions an error and is no log prefix or warning, else its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Interrupt|Exit)\b.*", ln):
            return ln[:200]
    for ln in reversed(lines):  # the exception line, not torchrun's summary
        if ("Error" in ln or "error" in ln) and not ln.startswith(("[", "torch.distributed", "Traceback", "=")):
            return ln[:200]
    quiet = [ln for ln in lines if "Warning" not in ln and "WARNING" not in ln]
    return (quiet or lines)[-1][:200] if lines else "no output"


def run_system(args, system: str) -> dict:
    """One system's result (from its own child processes), or ``{"system", "skipped": reason}``."""
    if system in DEEPSPEED_SYSTEMS:
        if importlib.util.find_spec("deepspeed") is None:
            return {"system": system, "skipped": "not installed"}
        if args.device != "cuda":
            return {"system": system, "skipped": "CUDA only"}
    try:
        proc = subprocess.run(_child_argv(args, system), capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"system": system, "skipped": f"timed out after {args.timeout:g} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    if args.verbose:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
    text = proc.stdout + proc.stderr
    why = f"failed (exit {proc.returncode}): {last_error(text)}"
    return {"system": system, "skipped": why, "output_tail": text[-6000:]}


def gpu_name(device: str) -> str:
    """The CUDA device's name ("cpu" for the CPU form); exits saying so when CUDA is asked for and absent."""
    if device != "cuda":
        return "cpu"
    # asked in a child so that this process holds no CUDA context while the systems run
    code = "import torch; print(torch.cuda.get_device_name(0))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"gpu benchmark: no CUDA device ({last_error(proc.stderr)}); use --device cpu for a smoke run")
    return proc.stdout.strip()
