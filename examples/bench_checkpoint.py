"""Checkpoint save and load: zerofn's zf.checkpoint against torch DCP and torch.save.

Systems, each with AdamW, trained a few steps before every measurement:

- zf shard_params (ZeRO-3) and zf shard_optimizer (ZeRO-1):
  ``zf.checkpoint.save`` (``blocking=True``, and ``blocking=False`` then
  ``wait()``), ``zf.checkpoint.load``;
- torch DCP: the model under FSDP2 (``fully_shard`` per block + root),
  ``get_state_dict`` of model and optimizer, ``dcp.save``, ``dcp.async_save``
  (on its own gloo group), and ``dcp.load`` + ``set_state_dict``;
- torch.save: the model under DDP (replicated), rank 0 writes
  ``{"model": ..., "optim": ...}`` to one file (fsync'ed, as DCP and zerofn
  make theirs durable) and every rank ``torch.load``s it.

    python examples/bench_checkpoint.py              # 2 gloo ranks on this machine
    python examples/bench_checkpoint.py --rounds 9 --models 64x2 128x5 256x8
    python examples/bench_checkpoint.py --dir /mnt/nvme/tmp

Models: the GPT of examples/gpt.py, given as DIMxLAYERS; the defaults are
train_gpt.py's model (dim 64, 2 layers, 0.11 M parameters) and one about 10x
larger (dim 128, 5 layers, 1.0 M parameters).

All systems run in the same ranks; their measurements are interleaved in
rounds (after one unmeasured warm-up round) so that a noisy machine slows
them alike. Every time is the slowest rank's (a checkpoint is done when every
rank is), and the median over rounds is reported. Before every timed call the
ranks flush the page cache's dirty pages (``os.sync()``, untimed), so that
one system's fsyncs never pay for another's writes or deletions; loads read
files just written, from the page cache, for every system alike. Reported
per system:

- blocking save s: the blocking save, until it returns (committed);
- async blocked s: how long the asynchronous save kept the caller
  (zerofn: until ``save(..., blocking=False)`` returns; DCP: until
  ``get_state_dict`` + ``async_save`` return; torch.save has none);
- async total s: from the call until the checkpoint is committed
  (``h.wait()``, the future's ``result()``);
- load s: ``zf.checkpoint.load(path, step, params=...)``, a fresh state
  built from fresh parameters as a restarted process does (a line under the
  table gives ``load(..., state=state)`` into the live state, and the async
  save's own ``h.blocked_s``); ``get_state_dict`` + ``dcp.load`` +
  ``set_state_dict`` into the live model; ``torch.load`` + ``load_state_dict``
  on every rank;
- written MiB/rank: the bytes of the files a rank wrote (the most over ranks;
  zerofn's ``h.bytes_written``, DCP's ``__<rank>_*.distcp`` files with the
  ``.metadata`` on rank 0, torch.save's one file on rank 0);
- held MiB/rank: the training state a rank holds (``zf.memory.state_bytes``;
  for torch, its local parameters and optimizer state);

with each time's ratio to DCP's. Every load is checked against the state that
was saved (every round, the state is trained one more step before loading),
and once per system an asynchronous save is overlapped with a training step
before its ``wait()`` and then loaded and checked, so a snapshot that the
step changed would fail the run.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_paths import existing_dir  # noqa: E402


def parse_args(argv=None):
    """The command line, its paths checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--models", nargs="+", default=["64x2", "128x5"], help="GPT sizes as DIMxLAYERS")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--train-steps", type=int, default=3, help="steps before the first checkpoint")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup-rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--systems", nargs="*", default=None, help="only systems whose name contains one of these")
    p.add_argument(
        "--dir",
        default=None,
        help="an existing directory to write in (a temporary folder is made in it and removed; default: the "
        "system's temporary directory)",
    )
    args = p.parse_args(argv)
    if args.dir is not None:
        existing_dir(
            p,
            "--dir",
            args.dir,
            f"create it first (mkdir -p {args.dir}), or leave --dir out to write in the system's temporary directory",
        )
    return args


if __name__ == "__main__":
    parse_args()  # a wrong command line or path fails here, before torch is imported

import torch  # noqa: E402
from gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for  # noqa: E402
from zerofn.transforms import shard_optimizer, shard_params  # noqa: E402

import zerofn as zf  # noqa: E402

LR, WD = 1e-3, 0.1
VOCAB = 32


def _digest(tensors) -> list[float]:
    """Sum and sum of squares of each tensor (local shards), to check a load restored the state."""
    out = []
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            d = t.detach().double()
            out += [float(d.sum()), float((d * d).sum())]
    return out


def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


class _System:
    """One way to train and checkpoint; ``save`` returns (blocked s, total s, bytes written by this rank)."""

    has_async = True

    def train(self, batch, n: int = 1) -> None:
        raise NotImplementedError

    def save(self, path: str, blocking: bool) -> tuple[float, float, int]:
        raise NotImplementedError

    def load(self, path: str) -> float:
        raise NotImplementedError

    def held_bytes(self) -> int:
        raise NotImplementedError

    def digest(self) -> list[float]:
        raise NotImplementedError

    def check_overlap(self, path: str, batch) -> None:
        """An asynchronous save with a training step before its wait(), then loaded: the snapshot must hold."""


class ZfSystem(_System):
    def __init__(self, cfg, transform):
        torch.manual_seed(0)
        self.apply = zf.functional(GPT(cfg))
        self.shapes = {k: (v.shape, v.dtype, v.requires_grad) for k, v in self.apply.params.items()}
        step = zf.train_step(loss_fn_for(self.apply), zf.optim.adamw(LR, weight_decay=WD))
        self.step = transform(step)
        self.state = self.step.init(self.apply.params)
        self.last_blocked_s = float("nan")  # h.blocked_s of the last asynchronous save

    def train(self, batch, n=1):
        for _ in range(n):
            self.state, _ = self.step(self.state, batch)

    def save(self, path, blocking):
        t0 = time.perf_counter()
        h = zf.checkpoint.save(self.state, path, blocking=blocking)
        blocked = time.perf_counter() - t0
        h.wait()
        total = time.perf_counter() - t0
        if not blocking:
            self.last_blocked_s = float(h.blocked_s)
        return (total if blocking else blocked), total, int(h.bytes_written)

    def load(self, path):
        # As a restarted process does: a fresh state from fresh parameters (here plain tensors, as
        # the model's own are held by the live state), filled from the checkpoint.
        fresh = {k: torch.empty(shape, dtype=dtype).requires_grad_(rg) for k, (shape, dtype, rg) in self.shapes.items()}
        t0 = time.perf_counter()
        self.state = zf.checkpoint.load(path, self.step, params=fresh)
        return time.perf_counter() - t0

    def load_into(self, path):
        """Load into the live state (``state=``), as DCP loads into the live model."""
        t0 = time.perf_counter()
        self.state = zf.checkpoint.load(path, self.step, state=self.state)
        return time.perf_counter() - t0

    def held_bytes(self):
        return zf.memory.state_bytes(self.state)["total"]

    def digest(self):
        s = self.state
        leaves = zf.tree.tree_leaves((s.params, s.frozen, s.buffers, s.opt_state, s.count))
        return _digest(leaves)

    def check_overlap(self, path, batch):
        want = self.digest()
        h = zf.checkpoint.save(self.state, path, blocking=False)
        self.train(batch)  # the step donates the state and updates its buffers in place
        h.wait()
        self.load(path)
        assert self.digest() == want, "zf: an asynchronous checkpoint does not hold the state it was called with"


class _TorchSystem(_System):
    """A torch.nn model (``self.model``, called through ``self.fwd``) and its ``self.opt``."""

    def train(self, batch, n=1):
        for _ in range(n):
            logits = self.fwd(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def _tensors(self):
        yield from self.model.parameters()
        for s in self.opt.state.values():
            yield from (v for v in s.values() if isinstance(v, torch.Tensor))

    def held_bytes(self):
        return _nbytes(self._tensors())

    def digest(self):
        return _digest(self._tensors())


class DcpSystem(_TorchSystem):
    """FSDP2 (fully_shard per block + root) with torch.distributed.checkpoint."""

    def __init__(self, cfg):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        self.model = GPT(cfg)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        self.fwd = fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WD, foreach=True)
        # async_save's background collectives on their own group, as torchtitan does, so they never
        # interleave with training's collectives on the default group.
        self.async_group = dist.new_group(backend="gloo")

    def _state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(self.model, self.opt)
        return {"model": msd, "optim": osd}

    def save(self, path, blocking):
        import torch.distributed.checkpoint as dcp

        t0 = time.perf_counter()
        sd = self._state_dict()
        if blocking:
            dcp.save(sd, checkpoint_id=path)
            blocked = time.perf_counter() - t0
        else:
            fut = dcp.async_save(sd, checkpoint_id=path, process_group=self.async_group)
            blocked = time.perf_counter() - t0
            fut = getattr(fut, "upload_completion", fut)  # AsyncSaveResponse when a stager is asked for
            fut.result()
        total = time.perf_counter() - t0
        rank = zf.collectives.rank()
        files = glob.glob(os.path.join(path, f"__{rank}_*.distcp"))
        if rank == 0:
            files.append(os.path.join(path, ".metadata"))
        return blocked, total, sum(os.path.getsize(f) for f in files)

    def load(self, path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        t0 = time.perf_counter()
        sd = self._state_dict()
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return time.perf_counter() - t0

    def check_overlap(self, path, batch):
        import torch.distributed.checkpoint as dcp

        want = self.digest()
        fut = dcp.async_save(self._state_dict(), checkpoint_id=path, process_group=self.async_group)
        self.train(batch)
        getattr(fut, "upload_completion", fut).result()
        self.load(path)
        assert self.digest() == want, "DCP: async_save's checkpoint does not hold the state it was called with"


class TorchSaveSystem(_TorchSystem):
    """DDP (every rank holds everything); rank 0 torch.saves the model and optimizer state_dicts."""

    has_async = False

    def __init__(self, cfg):
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(0)
        self.model = GPT(cfg)
        self.fwd = DDP(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WD, foreach=True)

    def save(self, path, blocking):
        # Rank 0 alone writes; the other ranks would wait for it at the next collective, so the
        # time rank 0 spends is what the save costs every rank.
        if zf.collectives.rank() != 0:
            return 0.0, 0.0, 0
        t0 = time.perf_counter()
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "state.pt"), "wb") as f:
            torch.save({"model": self.model.state_dict(), "optim": self.opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        total = time.perf_counter() - t0
        return total, total, os.path.getsize(os.path.join(path, "state.pt"))

    def load(self, path):
        t0 = time.perf_counter()
        sd = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=True)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])
        return time.perf_counter() - t0


SYSTEMS = {
    "zf shard_params (ZeRO-3)": lambda cfg: ZfSystem(cfg, shard_params),
    "zf shard_optimizer (ZeRO-1)": lambda cfg: ZfSystem(cfg, shard_optimizer),
    "torch DCP (FSDP2)": DcpSystem,
    "torch.save (DDP, rank 0)": TorchSaveSystem,
}
ANCHOR = "torch DCP (FSDP2)"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _settle() -> None:
    """Flush every dirty page (others' files, deletions) before a timed call, so that its fsyncs
    pay for its own writes only; then line the ranks up."""
    os.sync()
    zf.collectives.barrier()


def bench_rank(args, root):
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    torch.set_num_threads(args.threads)
    chosen = {n: m for n, m in SYSTEMS.items() if not args.systems or any(s in n for s in args.systems)}
    corpus = MarkovCorpus(vocab=VOCAB)
    results = {}
    for spec in args.models:
        dim, layers = (int(x) for x in spec.split("x"))
        cfg = GPTConfig(vocab=VOCAB, seq_len=args.seq_len, dim=dim, heads=4, layers=layers)
        batches = [
            corpus.sample(args.batch * world, args.seq_len + 1, seed=i)[rank * args.batch :][: args.batch]
            for i in range(2)
        ]
        systems = {}
        for name, make in chosen.items():
            systems[name] = make(cfg)
            systems[name].train(batches[0], args.train_steps)
        times = {
            name: {k: [] for k in ("blocking", "blocked", "total", "load", "load_into", "reported")} for name in systems
        }
        written = {name: 0 for name in systems}
        for r in range(-args.warmup_rounds, args.rounds):
            for name, sysm in systems.items():
                where = os.path.join(root, spec, _slug(name), f"round{r + args.warmup_rounds}")
                want = sysm.digest()
                _settle()
                blocking, _, nbytes = sysm.save(os.path.join(where, "blocking"), blocking=True)
                _settle()
                if sysm.has_async:
                    blocked, total, _ = sysm.save(os.path.join(where, "async"), blocking=False)
                    reported = getattr(sysm, "last_blocked_s", float("nan"))
                else:
                    blocked = total = reported = float("nan")
                sysm.train(batches[1])  # untimed: the load must restore what was saved, not what is there
                _settle()
                source = "async" if sysm.has_async and r % 2 else "blocking"
                load = sysm.load(os.path.join(where, source))
                if sysm.digest() != want:
                    raise AssertionError(
                        f"{name} {spec}: round {r}: loading the {source} checkpoint did not restore the saved state"
                    )
                if hasattr(sysm, "load_into"):  # zerofn: again, into the live state
                    sysm.train(batches[1])
                    _settle()
                    load_into = sysm.load_into(os.path.join(where, source))
                    if sysm.digest() != want:
                        raise AssertionError(
                            f"{name} {spec}: round {r}: loading the {source} checkpoint into "
                            f"the live state did not restore the saved state"
                        )
                else:
                    load_into = float("nan")
                if r >= 0:
                    for k, v in (
                        ("blocking", blocking),
                        ("blocked", blocked),
                        ("total", total),
                        ("load", load),
                        ("load_into", load_into),
                        ("reported", reported),
                    ):
                        times[name][k].append(v)
                written[name] = nbytes
                zf.collectives.barrier()
                if rank == 0:
                    shutil.rmtree(where, ignore_errors=True)
        for name, sysm in systems.items():  # the overlap check, once per system
            where = os.path.join(root, spec, _slug(name), "overlap")
            zf.collectives.barrier()
            sysm.check_overlap(where, batches[1])
            zf.collectives.barrier()
            if rank == 0:
                shutil.rmtree(where, ignore_errors=True)
        results[spec] = {
            name: dict(times=times[name], written=written[name], held=systems[name].held_bytes()) for name in systems
        }
        del systems
    return results


def _fmt(x: float, anchor: float) -> str:
    if x != x:  # nan
        return f"{'-':>17}"
    return f"{x:>10.4f} {x / anchor:>5.2f}x"


def report(results: list, args) -> list[str]:
    """The table, one block per model: each figure the median over rounds of the slowest rank's time."""
    lines = [
        f"{args.world} gloo ranks, {args.threads} thread(s) each, AdamW, median of {args.rounds} rounds "
        f"(after {args.warmup_rounds} warm-up); times in s, each with its ratio to DCP's"
    ]
    for spec in args.models:
        dim, layers = (int(x) for x in spec.split("x"))
        model = GPT(GPTConfig(vocab=VOCAB, seq_len=args.seq_len, dim=dim, heads=4, layers=layers))
        n = sum(p.numel() for p in model.parameters())
        lines.append("")
        lines.append(f"GPT dim {dim}, {layers} layers: {n:,} parameters")
        lines.append(
            f"{'system':<30}{'blocking save':>17}{'async blocked':>17}{'async total':>17}{'load':>17}"
            f"{'written MiB/rank':>18}{'held MiB/rank':>15}"
        )
        per = results[0][spec]
        med = {}
        for name in per:
            med[name] = {}
            for k in ("blocking", "blocked", "total", "load", "load_into", "reported"):
                rounds = zip(*(res[spec][name]["times"][k] for res in results))  # each round: every rank's time
                med[name][k] = statistics.median(max(ts) for ts in rounds)
        anchor = med.get(ANCHOR, next(iter(med.values())))
        for name in per:
            m = med[name]
            wrote = max(res[spec][name]["written"] for res in results)
            held = max(res[spec][name]["held"] for res in results)
            cells = "".join(_fmt(m[k], anchor[k]) for k in ("blocking", "blocked", "total", "load"))
            lines.append(f"{name:<30}{cells}{wrote / 2**20:>18.3f}{held / 2**20:>15.3f}")
        for name in per:
            if name.startswith("zf"):
                m = med[name]
                lines.append(
                    f"  {name}: async h.blocked_s {m['reported']:.4f} s; load into the live state "
                    f"(state=) {m['load_into']:.4f} s, {m['load_into'] / anchor['load']:.2f}x DCP's load"
                )
    return lines


def main(argv=None):
    args = parse_args(argv)
    root = tempfile.mkdtemp(prefix="zf-bench-ckpt-", dir=args.dir)
    try:
        results = zf.spawn(bench_rank, args.world, args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n".join(report(results, args)))
    return results


if __name__ == "__main__":
    main()
