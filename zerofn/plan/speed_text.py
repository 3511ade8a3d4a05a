"""Text output of ``python -m zerofn plan --hardware``: the speed table (:func:`speed_text`)."""

from __future__ import annotations

from zerofn.plan.hardware import Hardware
from zerofn.plan.speed import Speed
from zerofn.plan.text import fmt_bytes

__all__ = ["calibration_text", "fmt_seconds", "speed_text"]

_WINDOWS = {"forward": "forward", "backward": "backward", "none": "no"}


def fmt_seconds(t: float) -> str:
    """Seconds for a reader: ``1.09 s``, ``818 ms``, ``9.3 ms``, ``0.41 ms``, ``-`` for none."""
    if t <= 0:
        return "-"
    if t >= 1:
        return f"{t:.3g} s"
    ms = t * 1e3
    return f"{ms:.3g} ms" if ms >= 1 else f"{ms:.2f} ms"


def _bytes(n: float) -> str:
    return fmt_bytes(n) if n > 0 else "-"


def _table(header: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    out = []
    for r in [header, *rows]:
        cells = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def speed_text(
    rows: list[Speed],
    *,
    hardware: Hardware,
    nodes: int,
    gpus_per_node: int,
    efficiency: float,
    gpu_memory: float,
    mixed_precision: bool = True,
    heading: str = "",
) -> str:
    """The speed table: one row per composition, fastest first among those that fit ``gpu_memory``; under
    it the fastest's collectives (what overlaps and what does not) and each composition's zerofn call."""
    lines = []
    if heading:
        lines.append(heading)
    hw = hardware
    lines.append(
        f"speed on {nodes} node(s) x {gpus_per_node} GPU(s), {hw.name}: {hw.tflops:g} TFLOPS dense bf16 each at "
        f"efficiency {efficiency:g}; within a node {hw.intra_node_gbps:g} GB/s per GPU, across nodes "
        f"{hw.inter_node_gbps:g} GB/s per GPU; HBM {hw.hbm_gbps:g} GB/s"
    )
    lines.append(
        "model FLOPs 6 N + 12 L w s per token (PaLM's; MFU counts these, remat's recompute aside); collectives as "
        "rings, hierarchical across nodes; ZeRO-3's gathers and reduce-scatters overlap compute but the first "
        "gather and the last reduce-scatter, DDP/ZeRO-1/2's reductions overlap backward but the last bucket, their "
        "publish and every update do not (docs/planning.md, Speed)"
    )
    lines.append("")
    header = [
        "composition",
        "remat",
        "compute",
        "intra-node",
        "intra s",
        "inter-node",
        "inter s",
        "overlapped",
        "exposed",
        "update",
        "codec",
        "step",
        "tokens/s",
        "MFU",
        "per GPU",
        "fits",
    ]
    body = []
    for s in rows:
        body.append(
            [
                s.label,
                "yes" if s.remat else "no",
                fmt_seconds(s.compute_s),
                _bytes(s.intra_bytes),
                fmt_seconds(s.intra_s),
                _bytes(s.inter_bytes),
                fmt_seconds(s.inter_s),
                fmt_seconds(s.overlapped_s),
                fmt_seconds(s.exposed_s),
                fmt_seconds(s.update_s),
                fmt_seconds(s.codec_s),
                fmt_seconds(s.step_s),
                f"{s.tokens_per_s:,.0f}",
                f"{100 * s.mfu:.1f}%",
                _bytes(s.memory) if s.memory is not None else "-",
                "yes" if s.fits else f"no: {', '.join(s.short)}",
            ]
        )
    lines += _table(header, body)
    lines.append("")
    lines.append(
        "intra-node / inter-node: bytes one GPU moves per step on each link and their seconds; overlapped and "
        "exposed: the communication hidden behind compute and the rest; update: the optimizer's, codec: int8 "
        "encoding and decoding (qwZ, qgZ); step = compute + exposed + update + codec"
    )
    fitting = [s for s in rows if s.fits]
    if not fitting:
        lines.append(f"fastest: none fits in {fmt_bytes(gpu_memory)} per GPU")
    else:
        best = fitting[0]
        lines.append(
            f"fastest: {best.label}{' + remat' if best.remat else ''}, {best.code}: {fmt_seconds(best.step_s)} a step, "
            f"{best.tokens_per_s:,.0f} tokens/s, MFU {100 * best.mfu:.1f}%"
        )
        lines.append("")
        lines.append(f"{best.label}'s collectives, per step:")
        header = ["collective", "kind", "ranks", "count", "intra-node", "intra s", "inter-node", "inter s", "overlaps"]
        body = [
            [
                c.what,
                c.kind,
                f"{c.ranks} ({c.per_node} a node)",
                str(c.count),
                _bytes(c.intra_bytes),
                fmt_seconds(c.intra_s),
                _bytes(c.inter_bytes),
                fmt_seconds(c.inter_s),
                _WINDOWS[c.window],
            ]
            for c in best.comms
        ]
        lines += _table(header, body, left=2)
        lines.append(
            f"compute: forward {fmt_seconds(best.forward_s)}, backward {fmt_seconds(best.backward_s)}"
            f"{' (with the recomputed forward)' if best.remat else ''}; exposed {fmt_seconds(best.exposed_s)} of "
            f"{fmt_seconds(best.comm_s)} of communication"
        )
    lines.append("")
    base = "amp(zf.train_step(...), torch.bfloat16)" if mixed_precision else "zf.train_step(...)"
    lines.append(f"the compositions, around step = {base}:")
    seen = set()
    for s in rows:
        if s.label not in seen:
            seen.add(s.label)
            lines.append(f"  {s.label}: {s.code}")
    return "\n".join(lines)


def calibration_text(hardware: Hardware, record: dict) -> str:
    """What ``--calibrate`` measured and fitted: per collective kind, the bandwidth and latency and the
    median seconds of each size."""
    lines = [
        f"{hardware.name}: fp32 matmul {record['matmul_flops_per_rank'] / 1e9:.3g} GFLOP/s a rank, memory copy "
        f"{record['copy_bytes_per_s_per_rank'] / 1e9:.3g} GB/s a rank (every rank running)",
        "",
    ]
    header = ["collective", "bus bandwidth", "latency", "median seconds by full tensor size"]
    body = []
    for kind, cost in hardware.collectives.items():
        sizes = record["median_seconds"].get(kind, {})
        body.append(
            [
                kind,
                f"{cost.gbps:.3g} GB/s",
                fmt_seconds(cost.latency_s) if cost.latency_s > 0 else "0",
                ", ".join(f"{fmt_bytes(int(b))}: {fmt_seconds(t)}" for b, t in sizes.items()),
            ]
        )
    lines += _table(header, body, left=1)
    lines.append(
        "fitted per kind: seconds = latency + ring bytes / bandwidth, ring bytes = size x (n - 1) / n (all-reduce "
        "twice that), n the ranks"
    )
    return "\n".join(lines)
