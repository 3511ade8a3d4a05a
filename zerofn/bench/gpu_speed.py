"""GPU throughput, fraction of bf16 peak and peak memory: torch AMP, FSDP2, DeepSpeed and zerofn.

The speed half of ``python -m zerofn.bench gpu`` (which picks the pairs it
compares), and a command of its own for any subset of systems
(``examples/bench_gpu.py`` runs it too). It builds the GPT of
:mod:`zerofn.bench.gpt` at the size given on the command line and trains it
with each system in a fresh process of its own (one process per rank: plain
python for one rank, ``python -m torch.distributed.run --standalone`` for
more), so that no system inherits another's allocator state, compiled
kernels or memory. Each child prints one JSON line; the parent collects them
and prints a table side by side.

On a GPU box (one H100/H200/A100/L4 is recognised; otherwise pass --peak-tflops):

    python -m zerofn.bench.gpu_speed --dim 2048 --layers 24 --seq-len 1024 --batch 16
    python -m zerofn.bench.gpu_speed --dim 2048 --layers 24 --seq-len 1024 --batch 8 --nproc 8 --out bench.md
    python -m zerofn.bench.gpu_speed --systems torch-amp fsdp2 zf-z3-amp --steps 50 --warmup 10

A smoke run on the CPU (fraction of peak reported as n/a; DeepSpeed skipped):

    python -m zerofn.bench.gpu_speed --device cpu --dim 64 --layers 2 --seq-len 32 --batch 2 --steps 2 --warmup 1 \\
        --systems torch-amp zf-amp zf-z3-amp fsdp2

Systems (the same model from the same seed, the same data, AdamW with the
same hyper-parameters, no gradient clipping):

- ``torch-amp``: the plain module (DDP over more than one rank) under
  ``torch.autocast(bf16)``, fused ``torch.optim.AdamW`` on fp32 parameters.
- ``fsdp2``: ``fully_shard`` on every block and on the root, with
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, fused AdamW.
- ``deepspeed-z2``, ``deepspeed-z3``: ``deepspeed.initialize`` with bf16 and
  ZeRO stage 2 / 3 and torch's fused AdamW over DeepSpeed's fp32 partitions
  (the Adam kernel of every other row; no gradient clipping, DeepSpeed's
  default being 1.0), when ``import deepspeed`` works (otherwise
  reported as "not installed"; CUDA only); ``deepspeed-z2-offload``: stage 2
  with ``offload_optimizer`` to pinned CPU memory and DeepSpeed's CPU Adam
  (ZeRO-Offload).
- zerofn: ``zf-amp`` = amp(train_step), ``zf-z1-amp`` (+ shard_optimizer),
  ``zf-z2-amp`` (+ shard_grads), ``zf-z3-amp`` (+ shard_params),
  ``zf-z2-amp-offload`` (+ offload("cpu"): the host update overlapping the
  next forward), ``zf-z2-amp-offload-sync`` (overlap=False: the update
  before the step returns), ``zf-z2-amp-offload-early`` (early=True: each
  bucket's update starts during backward, speculatively),
  ``zf-z2-amp-offload-delay`` (delay=1, which changes the numbers),
  ``zf-z3-amp-remat`` (+ remat).

Reported per system: the step time of a loop of --steps consecutive steps
after --warmup (the device synchronised before and after the loop only, as a
training loop waits; the fastest of --rounds loops, each loop's time the
slowest rank's), tokens/s over all ranks, model FLOPs per token
= 6 x parameters + 12 x layers x seq_len x dim (the attention scores; the
recomputation under remat is not counted, as is usual for MFU), the fraction
of peak = achieved FLOP/s / (peak x ranks), peak memory per rank (CUDA:
torch.cuda.max_memory_allocated over set-up and steps, the largest rank;
CPU: zf.memory.track() over set-up and warm-up, which counts every live
tensor), the memory held between steps, zerofn's own count of its state
(``zf.memory.state_bytes``, on the device), the final loss, and speed and peak
memory against torch-amp. Memory an offloaded system keeps in host RAM is
not in the CUDA figures.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time

import torch

LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1
TORCH_SYSTEMS = ("torch-amp", "fsdp2")
DEEPSPEED_SYSTEMS = ("deepspeed-z2", "deepspeed-z3", "deepspeed-z2-offload")
ZF_SYSTEMS = (
    "zf-amp",
    "zf-z1-amp",
    "zf-z2-amp",
    "zf-z3-amp",
    "zf-z2-amp-offload",
    "zf-z2-amp-offload-sync",
    "zf-z2-amp-offload-early",
    "zf-z2-amp-offload-delay",
    "zf-z3-amp-remat",
)
SYSTEMS = TORCH_SYSTEMS + DEEPSPEED_SYSTEMS + ZF_SYSTEMS
RESULT_TAG = "BENCH_GPU_RESULT "
MODULE = "zerofn.bench.gpu_speed"  # what a child runs (``python -m``)
# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) by a pattern in torch.cuda.get_device_name().
PEAKS = ((r"H100 PCIe", 756.0), (r"H100|H200", 989.0), (r"A100", 312.0), (r"\bL4\b", 121.0))


def zf_composition(name: str):
    """``step -> step`` for a zerofn system name (``zf-...``)."""
    from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

    shard = {
        "zf-amp": lambda s: s,
        "zf-z1-amp": shard_optimizer,
        "zf-z2-amp": shard_grads,
        "zf-z3-amp": shard_params,
        "zf-z3-amp-remat": shard_params,
    }.get(name, shard_grads)

    def compose(step):
        step = amp(shard(step), torch.bfloat16)
        if "-offload" in name:  # overlapped (the default), updated first, started during backward, one step late
            step = offload(
                step,
                "cpu",
                overlap=not name.endswith("-sync"),
                delay=int(name.endswith("-delay")),
                early=name.endswith("-early"),
            )
        if name.endswith("-remat"):
            step = remat(step)
        return step

    return compose


def gpt_params(cfg) -> int:
    """Parameters of the GPT of ``cfg`` (a ``GPTConfig``), counted on the meta device: the tied head once."""
    from zerofn.bench.gpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def flops_per_token(n_params: int, layers: int, seq_len: int, dim: int) -> int:
    """Model FLOPs per trained token: 6 N for the matmuls (forward and backward) plus attention's scores."""
    return 6 * n_params + 12 * layers * seq_len * dim


def peak_tflops_for(name: str) -> float | None:
    for pattern, tflops in PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            return tflops
    return None


# ---------------------------------------------------------------- one system, one process per rank


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


def _build_torch(system, cfg, device, world):
    import torch.nn.functional as F

    model = _model(cfg, device)
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        net = fully_shard(model, mesh=mesh, mp_policy=mp)
        autocast = False  # the policy casts the parameters per module
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        autocast = True
    else:
        net, autocast = model, True
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def step(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = net(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _build_deepspeed(system, cfg, device, batch_per_rank):
    if device.type == "cuda" and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        # DeepSpeed compiles its CPU Adam at first use; for this GPU only, not for every architecture
        # torch lists (a newer CUDA compiler refuses the oldest of them)
        os.environ["TORCH_CUDA_ARCH_LIST"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
    import deepspeed
    import torch.nn.functional as F

    model = _model(cfg, device)
    config = {
        "train_micro_batch_size_per_gpu": batch_per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; no other system clips
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": int(system[len("deepspeed-z")])},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    adamw = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
    if system.endswith("-offload"):  # ZeRO-Offload: its CPU Adam on pinned host state
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = {"type": "AdamW", "params": {**adamw, "betas": list(BETAS)}}
        optimizer = None
    else:
        # torch's fused AdamW over DeepSpeed's fp32 partitions: the kernel every other GPU row runs, so
        # that the rows compare ZeRO and not two Adam kernels (and no compiler is needed at first use)
        config["zero_allow_untested_optimizer"] = True
        optimizer = torch.optim.AdamW(model.parameters(), **adamw, fused=device.type == "cuda")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, config=config
    )

    def step(batch):
        logits = engine(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _build_zf(system, cfg, device):
    import zerofn as zf
    from zerofn.bench.gpt import loss_fn_for

    apply = zf.functional(_model(cfg, device))
    step = zf.train_step(loss_fn_for(apply), zf.optim.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD))
    step = zf_composition(system)(step)
    box = [step.init(apply.params)]

    def run(batch):
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    run.state_bytes = lambda: zf.memory.state_bytes(box[0])["by_placement"]
    return run


def _model(cfg, device: torch.device):
    """The GPT from seed 0, its weights drawn on ``device`` (a 1.4 B model's CPU initialisation would take
    longer than its benchmark); every system of one run draws the same ones."""
    from zerofn.bench.gpt import GPT

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(cfg)


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
        if args.one in ZF_SYSTEMS:
            step = _build_zf(args.one, cfg, device)
        elif args.one in DEEPSPEED_SYSTEMS:
            step = _build_deepspeed(args.one, cfg, device, args.batch)
        else:
            step = _build_torch(args.one, cfg, device, world)
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


# ---------------------------------------------------------------- the parent: one child per system


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


def _last_error(text: str) -> str:
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
    why = f"failed (exit {proc.returncode}): {_last_error(text)}"
    return {"system": system, "skipped": why, "output_tail": text[-6000:]}


def _mib(b: float) -> str:
    return f"{b / 2**20:.1f}"


def rows(results: list[dict], peak_tflops: float | None) -> tuple[list[str], list[list[str]]]:
    header = [
        "system",
        "ranks",
        "step ms",
        "tokens/s",
        "TFLOP/s/rank",
        "of peak",
        "peak MiB",
        "held MiB",
        "loss",
        "speed vs torch-amp",
        "peak vs torch-amp",
    ]
    base = next((r for r in results if r["system"] == "torch-amp" and "skipped" not in r), None)
    out = []
    for r in results:
        if "skipped" in r:
            out.append([r["system"], *[""] * 8, r["skipped"], ""])
            continue
        per_rank = r["achieved_tflops"] / r["world"]
        frac = f"{100 * per_rank / peak_tflops:.1f}%" if peak_tflops else "n/a"
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        mem = f"{r['peak_bytes'] / base['peak_bytes']:.2f}x" if base and base["peak_bytes"] else ""
        out.append(
            [
                r["system"],
                str(r["world"]),
                f"{1e3 * r['step_s']:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{per_rank:.3g}",
                frac,
                _mib(r["peak_bytes"]),
                _mib(r["held_bytes"]),
                f"{r['loss']:.4f}",
                speed,
                mem,
            ]
        )
    return header, out


def format_table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [header, *body]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_markdown(header, body, *, gpu: str, command: str, notes: list[str]) -> str:
    esc = [[c.replace("|", "\\|") for c in row] for row in [header, *body]]
    rule = "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"  # numbers right-aligned
    table = ["| " + " | ".join(esc[0]) + " |", rule]
    table += ["| " + " | ".join(row) + " |" for row in esc[1:]]
    meta = [
        "# zerofn GPU benchmark",
        "",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- device: {gpu}",
        f"- torch: {torch.__version__}",
        f"- command: `{command}`",
        *[f"- {n}" for n in notes],
        "",
    ]
    return "\n".join(meta + table) + "\n"


def gpu_name(device: str) -> str:
    """The CUDA device's name ("cpu" for the CPU form); exits saying so when CUDA is asked for and absent."""
    if device != "cuda":
        return "cpu"
    # asked in a child so that this process holds no CUDA context while the systems run
    code = "import torch; print(torch.cuda.get_device_name(0))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(
            f"gpu benchmark: no CUDA device ({_last_error(proc.stderr)}); use --device cpu for a smoke run"
        )
    return proc.stdout.strip()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: dim // 128, at least 1)")
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per step per rank")
    p.add_argument("--steps", type=int, default=20, help="consecutive steps timed as one loop")
    p.add_argument("--rounds", type=int, default=2, help="timed loops (the fastest is reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument(
        "--systems",
        nargs="+",
        default=list(SYSTEMS),
        choices=SYSTEMS,
        metavar="SYSTEM",
        help=f"a subset of: {' '.join(SYSTEMS)} (default: all)",
    )
    p.add_argument("--nproc", type=int, default=1, help="ranks (processes, one GPU each) per system")
    p.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="the GPU's dense bf16 peak (TFLOP/s); known: H100/H200 SXM 989, H100 PCIe 756, A100 312, L4 121",
    )
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a smoke run (fraction of peak n/a)")
    p.add_argument("--out", default=None, metavar="FILE.md", help="also write the table as markdown")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per system before it is given up")
    p.add_argument("--verbose", action="store_true", help="print a failed system's output")
    p.add_argument("--one", default=None, choices=SYSTEMS, help=argparse.SUPPRESS)  # a child: run one system
    args = p.parse_args(argv)
    if args.heads is None:
        args.heads = max(1, args.dim // 128)
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if (
        min(args.dim, args.layers, args.vocab, args.seq_len, args.batch, args.steps, args.rounds, args.nproc) < 1
        or args.warmup < 0
    ):
        p.error("sizes, --steps and --nproc must be at least 1, --warmup at least 0")
    if args.out is not None:  # checked before the run, which takes minutes
        where = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out):
            p.error(f"--out {args.out} is a directory; pass the name of a file to write")
        if not os.path.isdir(where):
            p.error(
                f"--out {args.out}: the directory it goes in, {where}, does not exist; create it (mkdir -p "
                f"{where}) or pass a file in an existing directory"
            )
    return args


def main(argv=None) -> list[dict] | None:
    args = parse_args(argv)
    if args.one:
        result = run_one(args)
        if result is not None:
            print(RESULT_TAG + json.dumps(result), flush=True)
        return None
    gpu = gpu_name(args.device)
    peak = args.peak_tflops
    if args.device == "cuda" and peak is None:
        peak = peak_tflops_for(gpu)
        if peak is None:
            raise SystemExit(f"gpu benchmark: unknown bf16 peak for {gpu!r}; pass --peak-tflops")
    if args.device == "cpu":
        peak = None  # no meaningful peak
    from zerofn.bench.gpt import GPTConfig

    cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers)
    n_params = gpt_params(cfg)
    fpt = flops_per_token(n_params, args.layers, args.seq_len, args.dim)
    print(
        f"GPT {n_params / 1e6:,.1f} M parameters (dim {args.dim}, {args.layers} layers, {args.heads} heads, "
        f"vocab {args.vocab}), {fpt / 1e9:.3g} GFLOP/token; {args.nproc} rank(s) x batch {args.batch} x seq "
        f"{args.seq_len}; {gpu}" + (f", bf16 peak {peak:g} TFLOP/s per rank" if peak else ""),
        flush=True,
    )
    results = []
    for system in args.systems:
        t0 = time.perf_counter()
        r = run_system(args, system)
        results.append(r)
        what = r.get("skipped") or f"{r['tokens_per_s']:,.0f} tokens/s, {_mib(r['peak_bytes'])} MiB peak"
        print(f"  {system}: {what} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    header, body = rows(results, peak)
    print(format_table(header, body))
    if args.out:
        given = sys.argv[1:] if argv is None else list(argv)
        command = shlex.join(["python", "-m", MODULE, *given])
        notes = [
            f"model: GPT {n_params:,} parameters, dim {args.dim}, {args.layers} layers, {args.heads} heads, "
            f"vocab {args.vocab}, seq_len {args.seq_len}; {args.batch} sequences per rank per step, "
            f"{args.nproc} rank(s)",
            f"fastest of {args.rounds} loops of {args.steps} consecutive steps after {args.warmup} warm-up steps; model FLOPs per token "
            f"6 N + 12 L T d = {fpt:,}" + (f"; bf16 peak {peak:g} TFLOP/s per rank" if peak else "; peak: n/a on cpu"),
            "peak memory: "
            + (
                "torch.cuda.max_memory_allocated, largest rank"
                if args.device == "cuda"
                else "zf.memory.track() over set-up and warm-up (live tensor bytes)"
            ),
        ]
        with open(args.out, "w") as f:
            f.write(format_markdown(header, body, gpu=gpu, command=command, notes=notes))
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
