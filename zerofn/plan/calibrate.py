"""``python -m zerofn plan --calibrate FILE.json``: this machine's links, measured on local gloo ranks and
written as a hardware file (:func:`calibrate`, :func:`fit`, :func:`measure_collectives`).

:func:`calibrate` starts ``ranks`` gloo ranks on the CPU (``zf.spawn``) and times zerofn's all-gather,
reduce-scatter, all-reduce and all-to-all (``zerofn.collectives``) of fp32 tensors of a few sizes, each run
after a barrier so that it starts when every rank is there; a run's time is the slowest rank's, a size's
the median of its runs. :func:`fit` then fits, per kind, the planner's cost model to them:

    seconds = latency + ring_bytes(kind, size, ranks) / bandwidth

(:func:`~zerofn.plan.speed.ring_bytes`: the bytes a ring moves through each rank's link, so the bandwidth is
nccl-tests' bus bandwidth), by least squares on the relative error (every size weighs alike), the latency
held at 0 when the unconstrained fit would make it negative. Each rank also times an fp32 matmul and a
memory copy with every rank running at once, for ``tflops`` and ``hbm_gbps``; ``hbm_bytes`` is the RAM
over the ranks. The ranks share one machine, one "node": the file's inter-node fields repeat the
intra-node fit (nothing across nodes was measured).
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import time

from zerofn.plan.hardware import COLLECTIVES, Hardware, LinkCost
from zerofn.plan.speed import ring_bytes

__all__ = ["DEFAULT_SIZES", "calibrate", "fit", "measure_collectives", "measure_machine", "write_hardware"]

DEFAULT_SIZES = (2**12, 2**16, 2**18, 2**20, 2**22, 2**24)  # 4 KiB to 16 MiB
DEFAULT_RANKS = 4
DEFAULT_REPEATS = 5


def measure_collectives(sizes, repeats: int, kinds=COLLECTIVES) -> list[tuple[str, int, float]]:
    """On every rank of the current group at once: ``(kind, bytes, seconds)`` of ``repeats`` runs of each
    collective kind on a full fp32 tensor of each size (rounded down to whole elements a rank), each after a
    barrier, after one run that is not timed; this rank's times."""
    import torch

    from zerofn import collectives as C

    n = C.world_size()
    out = []
    for kind in kinds:
        for size in sizes:
            numel = max(n, int(size) // 4 // n * n)
            full = torch.ones(numel)
            part = torch.ones(numel // n)
            recv = torch.empty(numel)
            for i in range(repeats + 1):
                C.barrier()
                t = time.perf_counter()
                if kind == "all_gather":
                    C.all_gather(full, part)
                elif kind == "reduce_scatter":
                    C.reduce_scatter(part, full)
                elif kind == "all_reduce":
                    C.all_reduce(full)
                else:
                    C.all_to_all(recv, full)
                if i:
                    out.append((kind, numel * 4, time.perf_counter() - t))
    return out


def measure_machine(seconds: float = 0.2) -> dict:
    """On every rank at once: this rank's fp32 matmul rate (FLOP/s, 256 x 256 matrices) and memory copy
    rate (bytes read and written per second, 32 MiB), each over about ``seconds``."""
    import torch

    from zerofn import collectives as C

    a, b = torch.randn(256, 256), torch.randn(256, 256)
    C.barrier()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        torch.mm(a, b)
        count += 1
    flops = count * 2 * 256**3 / (time.perf_counter() - t0)
    x, y = torch.ones(2**23), torch.empty(2**23)
    C.barrier()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        y.copy_(x)
        count += 1
    copy = count * 2 * x.numel() * 4 / (time.perf_counter() - t0)
    return {"flops": flops, "copy_bytes_per_s": copy}


def _rank(sizes, repeats: int, seconds: float) -> dict:
    """What each rank of :func:`calibrate` runs."""
    return {"samples": measure_collectives(sizes, repeats), "machine": measure_machine(seconds)}


def _slowest(per_rank: list[list[tuple[str, int, float]]]) -> list[tuple[str, int, float]]:
    """Each run's time as its slowest rank saw it (the ranks list their runs in the same order)."""
    return [(runs[0][0], runs[0][1], max(r[2] for r in runs)) for runs in zip(*per_rank)]


def _weighted_line(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b x`` by least squares on the relative error, with ``a >= 0`` and ``b > 0``."""
    w = [1.0 / (t * t) for t in ts]
    s, sx, st = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * t for wi, t in zip(w, ts))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxt = sum(wi * x * t for wi, x, t in zip(w, xs, ts))
    den = s * sxx - sx * sx
    if den > 0:
        b = (s * sxt - sx * st) / den
        a = (st - b * sx) / s
    else:
        a, b = 0.0, sxt / sxx
    if a < 0:  # held at 0: the line through the origin
        a, b = 0.0, sxt / sxx
    if b <= 0:  # the time does not grow with the size here: the best throughput seen, and the rest as latency
        b = min(t / x for x, t in zip(xs, ts))
        a = max(0.0, min(t - b * x for x, t in zip(xs, ts)))
    return a, b


def fit(samples: list[tuple[str, int, float]], ranks: int) -> dict[str, LinkCost]:
    """Per collective kind, the :class:`~zerofn.plan.hardware.LinkCost` (bus bandwidth and latency) whose
    ``latency + ring_bytes(kind, size, ranks) / bandwidth`` fits the medians of ``samples`` (``(kind,
    full bytes, seconds)``) best, relative error weighed alike at every size.

    Example:
        >>> from zerofn.plan import fit
        >>> runs = [("all_gather", b, 1e-3 + b * 3 / 4 / 1e9) for b in (1e6, 4e6, 16e6)]   # 1 ms + 1 GB/s
        >>> c = fit(runs, ranks=4)["all_gather"]
        >>> round(c.gbps, 6), round(c.latency_s * 1e3, 6)
        (1.0, 1.0)
    """
    by: dict[tuple[str, int], list[float]] = {}
    for kind, nbytes, t in samples:
        by.setdefault((kind, int(nbytes)), []).append(t)
    out = {}
    for kind in COLLECTIVES:
        points = sorted((b, statistics.median(ts)) for (k, b), ts in by.items() if k == kind)
        points = [(ring_bytes(kind, b, ranks), t) for b, t in points if t > 0]
        points = [(x, t) for x, t in points if x > 0]
        if not points:
            continue
        a, b = _weighted_line([x for x, _ in points], [t for _, t in points])
        out[kind] = LinkCost(gbps=1.0 / (b * 1e9), latency_s=a)
    return out


def _ram_bytes() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


def calibrate(
    *, ranks: int = DEFAULT_RANKS, sizes=DEFAULT_SIZES, repeats: int = DEFAULT_REPEATS, seconds: float = 0.2
) -> tuple[Hardware, dict]:
    """Measure this machine's collectives on ``ranks`` local gloo ranks (see the module docs).

    Returns:
        The fitted :class:`~zerofn.plan.hardware.Hardware` (one node of ``ranks`` "GPUs") and the
        calibration's record: the sizes, each kind's median seconds per size, the rates measured.

    Raises:
        ValueError: fewer than 2 ranks, no size, or fewer than 1 repeat.
    """
    from zerofn.launch import spawn

    if ranks < 2:
        raise ValueError(f"calibrate: a collective needs at least 2 ranks, got ranks={ranks}")
    if not sizes or repeats < 1:
        raise ValueError(f"calibrate: give at least one size and one repeat, got sizes={sizes!r}, repeats={repeats}")
    results = spawn(_rank, ranks, tuple(int(s) for s in sizes), int(repeats), float(seconds))
    samples = _slowest([r["samples"] for r in results])
    costs = fit(samples, ranks)
    flops = statistics.median(r["machine"]["flops"] for r in results)
    copy = statistics.median(r["machine"]["copy_bytes_per_s"] for r in results)
    gbps = statistics.median(c.gbps for c in costs.values())
    latency_us = statistics.median(c.latency_s for c in costs.values()) * 1e6
    medians: dict[str, list] = {}
    for kind, nbytes, t in samples:
        medians.setdefault(kind, {}).setdefault(nbytes, []).append(t)
    record = {
        "ranks": ranks,
        "backend": "gloo",
        "device": "cpu",
        "dtype": "float32",
        "host": socket.gethostname(),
        "repeats": repeats,
        "cpus": os.cpu_count(),
        "median_seconds": {
            k: {str(b): statistics.median(ts) for b, ts in sorted(v.items())} for k, v in medians.items()
        },
        "matmul_flops_per_rank": flops,
        "copy_bytes_per_s_per_rank": copy,
    }
    hw = Hardware(
        name=f"calibrated: {ranks} gloo ranks on the CPU of {socket.gethostname()}",
        tflops=flops / 1e12,
        hbm_bytes=_ram_bytes() / ranks or 1.0,
        hbm_gbps=copy / 1e9,
        intra_node_gbps=gbps,
        inter_node_gbps=gbps,
        gpus_per_node=ranks,
        intra_node_latency_us=latency_us,
        inter_node_latency_us=latency_us,
        collectives=costs,
        notes=(
            "measured by python -m zerofn plan --calibrate: tflops is an fp32 matmul's rate a rank with every rank "
            "running, hbm_gbps a memory copy's, hbm_bytes the RAM over the ranks; one node, so the inter-node "
            "fields repeat the median of the collectives' fits"
        ),
    )
    return hw, record


def _rounded(x):
    """Floats at 6 significant digits, at any depth, for the file."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def write_hardware(hw: Hardware, path: str, calibration: dict | None = None) -> dict:
    """Write ``hw`` as a hardware file at ``path`` (with a calibration's record under ``calibration``);
    returns what was written."""
    d = hw.to_dict()
    if calibration is not None:
        d["calibration"] = calibration
    d = _rounded(d)
    with open(path, "w") as f:
        json.dump(d, f, indent=2)
        f.write("\n")
    return d
