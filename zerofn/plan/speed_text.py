"""Text output of ``python -m zerofn plan --hardware``: the speed table (:func:`speed_text`)."""

from __future__ import annotations

from zerofn.plan.hardware import Hardware
from zerofn.plan.pipeline import PipelineParallelPlan
from zerofn.plan.speed import Speed
from zerofn.plan.text import fmt_bytes

__all__ = ["calibration_text", "fmt_seconds", "speed_text"]

_WINDOWS = {"forward": "forward", "backward": "backward", "pipeline": "next micro-batch", "none": "no"}


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
    pipeline: PipelineParallelPlan | None = None,
) -> str:
    """The speed table: one row per composition, fastest first among those that fit ``gpu_memory``; under
    it the fastest's collectives (what overlaps and what does not) and each composition's zerofn call.
    ``pipeline``: the memory estimate's pipeline (:class:`~zerofn.plan.PipelineParallelPlan`), said above the
    table, with a bubble column."""
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
    if pipeline is not None:
        p = pipeline
        lines.append(
            f"pipeline: {p.size} stages, {p.name}, {p.microbatches} micro-batches a step"
            f"{f', {p.virtual} chunks a GPU' if p.virtual > 1 else ''}: compute is the slowest stage's (the most "
            "blocks; the last adds the head's FLOPs) for every micro-batch, and the bubble idles the GPUs "
            f"{p.bubble_formula} = {p.bubble:.1%} of the step (compute x bubble / (1 - bubble)); each send to a "
            "neighbour stage overlaps the next micro-batch's compute, but those of the fill and drain, "
            f"2 x {p.hops} of one micro-batch's output, which are exposed; ZeRO-3 gathers and reduce-scatters its "
            "blocks once a micro-batch, DDP/ZeRO-1/2 reduce the accumulated gradients once a step, over the stage's "
            "own parameters; HSDP and hpZ are not modelled with --pp"
        )
    lines.append("")
    staged = any(s.bubble_s for s in rows)
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
        *(["bubble"] if staged else []),
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
                *([fmt_seconds(s.bubble_s)] if staged else []),
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
        "encoding and decoding (qwZ, qgZ)"
        + (
            "; bubble: the pipeline's idle fill and drain; step = compute + bubble + exposed + update + codec"
            if staged
            else "; step = compute + exposed + update + codec"
        )
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
            + (
                f" (the pipeline's fill and drain sends {fmt_seconds(best.fill_s)}); bubble {fmt_seconds(best.bubble_s)}"
                if best.bubble_s
                else ""
            )
        )
    lines.append("")
    base = "amp(zf.train_step(...), torch.bfloat16)" if mixed_precision else "zf.train_step(...)"
    if pipeline is not None:
        how = f', schedule="{pipeline.schedule}"' if pipeline.schedule != "1f1b" else ""
        how += f", virtual_stages={pipeline.virtual}" if pipeline.virtual > 1 else ""
        lines.append(
            f"the compositions, around step = {base}, each then cut into stages (outermost): "
            f"pipeline_parallel(..., {pipeline.size}, microbatches={pipeline.microbatches}{how}):"
        )
    else:
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
