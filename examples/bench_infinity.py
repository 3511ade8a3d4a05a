"""ZeRO-Infinity on one machine: a GPT larger than RAM trained with its parameters and optimizer state in files.

    python examples/bench_infinity.py --dim 2048 --layers 42 --path /mnt/nvme/tmp     # about 2.1 B parameters

The GPT is built on the meta device and its shards written to files as they
are filled (no process ever holds it), then trained for ``--steps`` steps
under ``offload(shard_params(step), "nvme", path=..., params=...)``. Printed,
all from the same run:

- the model state (parameters, gradient, Adam's two moments: 16 bytes per
  parameter in fp32) against the machine's RAM;
- the peak RSS of training (VmHWM from before ``step.init`` to the end),
  and the allocator settings it ran under: the C allocator's defaults
  unless ``MALLOC_*`` variables are set (none is needed: offload's host
  buffers come from pools sized by its options, see the offload page of
  the docs);
- the bytes a step must move: the parameter shards read for the forward and
  again for backward, each gradient written as backward lands it and read by
  the update, the optimizer state and the parameters read and written by the
  update (from the state's own file sizes);
- the step time, as the wall time of consecutive steps over their number;
- the disk bound: those bytes over the sequential read and write bandwidth
  of the same directory, measured here first (a file written in 64 MiB
  requests and fsynced, then read back after its pages were dropped from the
  page cache), and the step time's ratio to it.

``--params cpu`` keeps the parameter shards in RAM instead (the optimizer
state stays in files), for comparison.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_helpers import proc_status  # noqa: E402
from cli_paths import existing_dir  # noqa: E402

CHUNK = 64 * 2**20


def parse_args(argv=None):
    """The command line, its path checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=2, help="timed steps, after a first one")
    p.add_argument("--params", choices=("nvme", "cpu"), default="nvme", help="where the parameter shards rest")
    p.add_argument("--sub-group-mb", type=float, default=64.0, help="the update's sub-group, in MiB")
    p.add_argument("--probe-mb", type=int, default=2048, help="the size of the file the disk is measured with")
    p.add_argument(
        "--path",
        default=tempfile.gettempdir(),
        help="an existing directory on the disk to train from (a temporary directory is made in it and removed)",
    )
    args = p.parse_args(argv)
    existing_dir(
        p,
        "--path",
        args.path,
        f"create it first (mkdir -p {args.path}) on the disk to train from, or leave --path out to use the system's "
        "temporary directory",
    )
    return args


if __name__ == "__main__":
    parse_args()  # a wrong command line or path fails here, before torch is imported

import shutil  # noqa: E402

import torch  # noqa: E402
from zerofn.transforms import offload, shard_params  # noqa: E402

import zerofn as zf  # noqa: E402
from zerofn.bench.gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for  # noqa: E402


def _ram_bytes() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def _init(name: str, meta: torch.Tensor) -> torch.Tensor:
    """GPT's initialisation, one parameter at a time (the model is on the meta device)."""
    if meta.dim() > 1:
        return torch.randn(meta.shape) * 0.02
    return torch.zeros(meta.shape) if name.endswith("bias") else torch.ones(meta.shape)


def allocator_settings() -> str:
    """The C allocator's settings this process runs under, as the peak RSS line prints them."""
    found = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_"))
    return "allocator: " + (", ".join(found) if found else "the C allocator's defaults")


def disk_bandwidth(root: str, nbytes: int) -> tuple[float, float]:
    """Sequential write (fsynced) and read (after dropping the file's cached pages) of ``nbytes`` under
    ``root``, in bytes per second."""
    path = os.path.join(root, "bandwidth.bin")
    block = torch.randint(0, 256, (CHUNK,), dtype=torch.uint8).numpy()
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for offset in range(0, nbytes, CHUNK):
            os.pwrite(fd, memoryview(block), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    write = nbytes / (time.perf_counter() - t0)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages: the read comes from the disk
        t0 = time.perf_counter()
        for offset in range(0, nbytes, CHUNK):
            os.preadv(fd, [memoryview(block)], offset)
        read = nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
        os.unlink(path)
    return write, read


def moved_per_step(state) -> tuple[int, int]:
    """Bytes a step reads and writes in files: shards read for the forward and for backward, the gradient
    written as it lands and read by the update, the optimizer state and (in files) the parameters read and
    written by the update."""
    params = sum(f.nbytes for f in state.params if hasattr(f, "path"))
    frozen = sum(f.nbytes for f in state.frozen if hasattr(f, "path"))
    opt = state.opt_state
    optimizer, grads = opt.files.nbytes, opt.grads.nbytes
    reads = 2 * (params + frozen) + grads + optimizer + params
    writes = grads + optimizer + params
    return reads, writes


def main(argv=None) -> None:
    args = parse_args(argv)
    root = tempfile.mkdtemp(dir=args.path, prefix="zerofn-infinity-")
    try:
        write_bw, read_bw = disk_bandwidth(root, args.probe_mb * 2**20)
        cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, dim=args.dim, heads=args.heads, layers=args.layers)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(cfg)
        n = sum(p.numel() for p in model.parameters())
        apply = zf.functional(model)
        del model
        step = zf.train_step(loss_fn_for(apply), zf.optim.adamw(1e-4, weight_decay=0.1))
        sub_group = int(args.sub_group_mb * 2**20)
        step = offload(
            shard_params(step, init_fn=_init), "nvme", path=root, params=args.params, sub_group_bytes=sub_group
        )
        batches = MarkovCorpus(args.vocab).sample(args.batch * (args.steps + 1), args.seq_len + 1, seed=1)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM from here
        base = proc_status("VmRSS")
        t0 = time.perf_counter()
        state = step.init(apply.params)
        t_init = time.perf_counter() - t0
        state, m = step(state, batches[: args.batch])
        first = float(m["loss"])
        t0 = time.perf_counter()
        for i in range(1, args.steps + 1):
            state, m = step(state, batches[i * args.batch : (i + 1) * args.batch])
        zf.block_until_ready(state)
        t_step = (time.perf_counter() - t0) / args.steps
        last = float(m["loss"])
        peak = proc_status("VmHWM")
        reads, writes = moved_per_step(state)
        bound = reads / read_bw + writes / write_bw
        ram = _ram_bytes()
        print(
            f"GPT {n / 1e6:,.1f} M parameters (dim {args.dim}, {args.layers} layers, vocab {args.vocab}), batch "
            f"{args.batch} x {args.seq_len} tokens, parameters in {args.params}, optimizer state in files: model "
            f"state {16 * n / 1e9:.1f} GB = {16 * n / ram:.2f} x RAM ({ram / 2**30:.1f} GiB)"
        )
        print(
            f"peak RSS {peak / 2**30:.2f} GiB ({(peak - base) / 2**30:.2f} GiB above the process before init, "
            f"{allocator_settings()}); init {t_init:.1f} s; loss {first:.4f} -> {last:.4f}"
        )
        print(
            f"moved per step: {reads / 1e9:.2f} GB read, {writes / 1e9:.2f} GB written; disk {read_bw / 2**20:,.0f} "
            f"MiB/s read, {write_bw / 2**20:,.0f} MiB/s write: bound {bound:.2f} s"
        )
        print(f"step {t_step:.2f} s (mean of {args.steps} consecutive): {t_step / bound:.2f} x the disk bound")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
