"""The benchmark's report: a markdown table, notes on how each figure is made, and PNG plots.

:func:`write` puts ``report.md`` and, when matplotlib is installed (the
``plot`` extra), ``step_time.png``, ``memory.png`` and ``traffic.png`` in a
folder; the markdown links the plots by relative paths. Without matplotlib
the markdown says that the plots were not made.

Example:
    >>> from zerofn.bench.harness import Config, Measured, Results
    >>> r = Results(Config(systems=("torch DDP",)), [Measured("torch DDP", 250.0, 1.0, 4, 8, 12, 6, 8, 3.5)])
    >>> table(r).splitlines()[2].split(" | ")[:3]
    ['| torch DDP', '250.0', '1.00']
"""

from __future__ import annotations

import datetime
import os
import platform
import sys

import torch

import zerofn
from zerofn.bench.harness import Results

__all__ = ["PLOTS", "machine", "markdown", "plot", "table", "write"]

# file name -> what it shows
PLOTS = {
    "step_time.png": "Step time against torch DDP, measured in the same run",
    "memory.png": "Bytes per rank: held between steps, and the most allocated during a step",
    "traffic.png": "Collective traffic per step per rank",
}


def _deepspeed_version() -> str:
    """ ", DeepSpeed <version>" when DeepSpeed is installed (its systems are then in the table)."""
    try:
        from importlib.metadata import version

        return f", DeepSpeed {version('deepspeed')}"
    except Exception:  # noqa: BLE001 - not installed, or no metadata
        return ""


def machine() -> str:
    """The CPU model and core count of this machine (from /proc/cpuinfo where there is one)."""
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _n(count: int, noun: str) -> str:
    """``"1 round"``, ``"3 rounds"``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _unit(results: Results) -> tuple[str, int]:
    """MiB, or KiB for a model under a MiB of fp32 parameters (the quick mode's)."""
    return ("MiB", 2**20) if 4 * results.config.parameters() >= 2**20 else ("KiB", 2**10)


def table(results: Results) -> str:
    """The markdown table, one row per system that ran."""
    unit, scale = _unit(results)
    psi = 4 * results.config.parameters()  # the fp32 parameter bytes: the ZeRO paper's unit of traffic
    header = [
        "system",
        "step ms",
        "vs DDP",
        f"params {unit}",
        f"optimizer {unit}",
        f"other held {unit}",
        f"peak in step {unit}",
        f"peak {unit}",
        f"traffic {unit}/step",
        "traffic / Ψ",
        "loss",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for m in results.systems:
        cells = [
            m.name,
            f"{m.ms:.1f}",
            "n/a" if m.ratio is None else f"{m.ratio:.2f}",
            *(f"{b / scale:.2f}" for b in (m.params, m.optimizer, m.other_held, m.peak_in_step, m.peak)),
            f"{m.traffic / scale:.2f}",
            f"{m.traffic / psi:.2f}",
            f"{m.loss:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown(results: Results, command: str, plots: list[str] | None, no_plots: str = "") -> str:
    """The whole report; ``plots`` are the PNG file names written beside it (None: none were)."""
    c = results.config
    n = c.parameters()
    unit, scale = _unit(results)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark: zerofn's compositions against torch DDP, ZeroRedundancyOptimizer and FSDP2",
        "",
        f"Generated {now} in {results.seconds:.0f} s. To regenerate it, from the repository root:",
        "",
        f"    {command}",
        "",
        "| | |",
        "|---|---|",
        f"| machine | {machine()} |",
        f"| software | torch {torch.__version__}, Python {platform.python_version()}, zerofn {zerofn.__version__}"
        f"{_deepspeed_version()} |",
        f"| ranks | {c.world} gloo ranks on this machine, {_n(c.threads, 'intra-op thread')} each |",
        f"| model | the GPT of `zerofn.bench.gpt`: {n:,} parameters ({4 * n / scale:.2f} {unit} in fp32), "
        f"dim {c.dim}, {c.layers} layers, {c.heads} heads, vocabulary {c.vocab}, sequences of {c.seq_len} |",
        f"| batch | {_n(c.batch, 'sequence')} per rank, the same at every step; AdamW; one seed for all systems |",
        f"| timing | {_n(c.warmup, 'warm-up step')}, then {_n(c.rounds, 'round')} of {_n(c.steps, 'timed step')} "
        "per system; the systems take turns within each round |",
        "",
        table(results),
        "",
    ]
    if results.skipped:
        lines += ["Not measured here:", ""] + [f"- {name}: {why}" for name, why in results.skipped.items()] + [""]
    lines += [
        "How each figure is made (per rank; where the ranks differ, the largest):",
        "",
        "- **step ms**: each rank's median step time over the timed steps (every step starts at a barrier), "
        "the slowest rank's. **vs DDP**: that over torch DDP's, both from this run.",
        "- **params**, **optimizer**: bytes of the distinct tensor storages held between steps, counted from "
        "the state: `zf.memory.state_bytes` for zerofn; the parameters and the optimizer's state tensors "
        "(a DTensor's local shard) for the others. Gradients are not held between steps by any system "
        "(zerofn's state carries none; the torch systems set them to None).",
        "- **other held**: every byte the system keeps between steps, measured by `zf.memory.track` over "
        "set-up and warm-up, less params and optimizer: DDP's gradient buckets (as large as the parameters), "
        "for example. `offload`'s optimizer column is all of its host state: Adam's moments and host copies "
        "of this rank's parameter and gradient partitions (on a GPU machine that is CPU RAM, not GPU memory).",
        "- **peak in step**: the most bytes allocated at once during one step beyond what is held "
        "(`zf.memory.track`): activations, gradients, gathered parameters. **peak** = held + peak in step.",
        "- **traffic**: bytes of collectives in one step, in the ZeRO paper's units (an all-reduce of n bytes "
        "counts 2n, a reduce-scatter or all-gather of a full tensor of n bytes counts n, a broadcast n); in a "
        f"ring each rank sends (N-1)/N of that. **traffic / Ψ** is that over the fp32 parameter bytes, "
        f"Ψ = {4 * n / scale:.2f} {unit}: the paper gives 2 for DDP, ZeRO-1 and ZeRO-2, 3 for ZeRO-3. "
        "All of it is counted, none computed from a formula: zerofn's steps count their own "
        '(`metrics["comm_bytes"]`); for torch (and DeepSpeed) the harness wraps torch.distributed\'s '
        "collective functions for one step, on a second instance of the system built only for counting "
        "(DDP's there gets torch's `allreduce_hook`, so that its bucket all-reduces pass through them; "
        "DeepSpeed's on the timed engine itself, with no second engine in the process).",
        "- **loss**: the last timed step's, mean over ranks. Every fp32 system trains the same model on the "
        "same batch for the same number of steps, so their losses agree to a few digits; bf16 ones differ a "
        "little, and DeepSpeed's drift apart over the run (its fused Adam rounds differently from torch's "
        "AdamW, which zerofn's matches bit for bit; on a small model they agree step by step to 3 digits "
        "over the first 15 steps). The batch does not change from step to step, so the loss falls below what the corpus allows: "
        "it shows that the systems agree, not how well they learn.",
        "",
    ]
    if plots:
        lines += [f"![{PLOTS[p]}]({p})\n" for p in plots]
    else:
        lines += [f"No plots: {no_plots or 'matplotlib is not installed'} (`pip install zerofn[plot]`).", ""]
    return "\n".join(lines)


def _colour(name: str) -> str:
    return "#7f7f7f" if name.startswith(("torch", "DeepSpeed")) else "#1f77b4"


def plot(results: Results, out: str) -> list[str]:
    """Write the PNGs of ``PLOTS`` into ``out``; returns their file names. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = _unit(results)
    systems = results.systems
    names = [m.name for m in systems]
    colours = [_colour(n) for n in names]
    height = 1.2 + 0.32 * len(names)
    psi = 4 * results.config.parameters()

    def figure(title: str, xlabel: str):
        fig, ax = plt.subplots(figsize=(8, height))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        return fig, ax

    def save(fig, name: str) -> str:
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=100)
        plt.close(fig)
        return name

    written = []
    fig, ax = figure(PLOTS["step_time.png"], "step time / torch DDP's (lower is faster)")
    ratios = [m.ratio or 0.0 for m in systems]
    ax.barh(range(len(names)), ratios, color=colours)
    ax.axvline(1.0, color="black", lw=0.8)
    for i, r in enumerate(ratios):
        ax.text(r, i, f" {r:.2f}", va="center", fontsize=7)
    written.append(save(fig, "step_time.png"))

    fig, ax = figure(PLOTS["memory.png"], unit)
    left = [0.0] * len(names)
    parts = (
        ("params", lambda m: m.params),
        ("optimizer state", lambda m: m.optimizer),
        ("other held", lambda m: m.other_held),
        ("peak in step", lambda m: m.peak_in_step),
    )
    for label, get in parts:
        widths = [get(m) / scale for m in systems]
        ax.barh(range(len(names)), widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths)]
    ax.legend(fontsize=7, loc="lower right")
    written.append(save(fig, "memory.png"))

    fig, ax = figure(PLOTS["traffic.png"], f"{unit} per step")
    ax.barh(range(len(names)), [m.traffic / scale for m in systems], color=colours)
    for k in (2, 3):
        ax.axvline(k * psi / scale, color="black", lw=0.8, ls="--")
        ax.text(k * psi / scale, -0.6, f" {k}Ψ", fontsize=7)
    written.append(save(fig, "traffic.png"))
    return written


def write(results: Results, out: str, command: str) -> str:
    """Write ``report.md`` (and the plots, when matplotlib is there) into ``out``; returns the report's path."""
    os.makedirs(out, exist_ok=True)
    try:
        plots, why = plot(results, out), ""
    except ImportError as e:
        plots, why = None, f"matplotlib could not be imported ({e})"
        print(f"zerofn.bench: {why}; writing the report without plots", file=sys.stderr)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write(markdown(results, command, plots, why))
    return path
