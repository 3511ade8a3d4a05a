"""The benchmark's report: a markdown table, notes on how each figure is made, and PNG plots.

:func:`write` puts ``report.md`` and, when matplotlib is installed (the
``plot`` extra), for each model shape ``step_time_<k>.png``, ``memory_<k>.png``
and ``traffic_<k>.png`` in a folder (k = 1, 2, ... in the order of the
shapes); the markdown links the plots by relative paths. Without matplotlib
the markdown says that the plots were not made.

Example:
    >>> from zerofn.bench.harness import Config, Measured, Results
    >>> m = Measured("torch DDP", 250.0, 1.0, 4, 8, 12, 6, 8, 3.5, round_ms=(240.0, 250.0, 270.0))
    >>> table(Results(Config(systems=("torch DDP",)), [m])).splitlines()[2].split(" | ")[:5]
    ['| torch DDP', '250.0', '240.0', '270.0', '1.00']
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys

import torch

import zerofn
from zerofn.bench.harness import BUSY, Measured, Results
from zerofn.bench.systems import DDP, DEEPSPEED, FSDP2, ZERO, composition_name

__all__ = ["PAIRS", "PLOTS", "busy", "machine", "markdown", "pairs", "plot", "shape", "table", "write"]

# file name stem -> what it shows (one file per model shape: <stem>_<k>.png)
PLOTS = {
    "step_time": "Step time (a loop of consecutive steps) against torch DDP, measured in the same rounds",
    "memory": "Bytes per rank: held between steps, and the most allocated during a step",
    "traffic": "Collective traffic per step per rank",
}

# Each zerofn stage against the peers that shard the same: (zerofn, peer).
PAIRS = tuple(
    (composition_name(stage), peer)
    for stage, peers in (
        ("train_step", (DDP,)),
        ("shard_optimizer", (DDP, ZERO, DEEPSPEED[0])),
        ("shard_grads", (DDP, DEEPSPEED[1])),
        ("shard_params", (FSDP2, DEEPSPEED[2])),
    )
    for peer in peers
)


def _deepspeed_version(runs: list[Results]) -> str:
    """ ", DeepSpeed <version>" when DeepSpeed's systems are in a table."""
    if not any(m.name in DEEPSPEED for r in runs for m in r.systems):
        return ""
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


def _r(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}"


def _ms(ms: float | None) -> str:
    return "n/a" if ms is None else f"{ms:.1f}"


def _mostly_busy(m: Measured) -> bool:
    """Whether more than half of the rounds with a reading of the machine were busy for this system."""
    read = sum(share is not None for share in m.round_others)
    return read > 0 and m.busy_rounds > read / 2


def busy(m: Measured) -> str:
    """The busy rounds of a system, in words: ``"1 of 6"`` (rounds with a reading of the machine), ``"n/a"``
    where there was none; marked ``†`` when more than half of them were busy."""
    read = sum(share is not None for share in m.round_others)
    if not read:
        return "n/a"
    return f"{m.busy_rounds} of {read}" + (" †" if _mostly_busy(m) else "")


def shape(results: Results) -> str:
    """The model and optimizer of a run, in words."""
    c = results.config
    n = c.parameters()
    unit, scale = _unit(results)
    return (
        f"GPT of {n:,} parameters ({4 * n / scale:.2f} {unit} in fp32): dim {c.dim}, {c.layers} layers, "
        f"{c.heads} heads, vocabulary {c.vocab}{'' if c.tie_embeddings else ' (output head untied)'}, "
        f"sequences of {c.seq_len}, {_n(c.batch, 'sequence')} per rank; "
        f"AdamW lr {c.lr:g}, betas ({c.betas[0]:g}, {c.betas[1]:g}), weight decay {c.weight_decay:g}"
    )


def table(results: Results) -> str:
    """The markdown table, one row per system that ran."""
    unit, scale = _unit(results)
    psi = 4 * results.config.parameters()  # the fp32 parameter bytes: the ZeRO paper's unit of traffic
    header = [
        "system",
        "step ms",
        "step ms min",
        "step ms max",
        "vs DDP",
        "vs DDP min",
        "vs DDP max",
        "busy rounds",
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
        lo, hi = m.ratio_range or (None, None)
        fastest, slowest = m.ms_range or (None, None)
        cells = [
            m.name,
            f"{m.ms:.1f}",
            _ms(fastest),
            _ms(slowest),
            _r(m.ratio),
            _r(lo),
            _r(hi),
            busy(m),
            *(f"{b / scale:.2f}" for b in (m.params, m.optimizer, m.other_held, m.peak_in_step, m.peak)),
            f"{m.traffic / scale:.2f}",
            f"{m.traffic / psi:.2f}",
            f"{m.loss:.6f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pairs(results: Results) -> str:
    """A markdown table of each zerofn stage against its peers (:data:`PAIRS`), round by round; "" when
    no pair ran."""
    by_name = {m.name: m for m in results.systems}
    rows = []
    for ours, peer in PAIRS:
        if ours in by_name and peer in by_name:
            med, lo, hi = by_name[ours].against(by_name[peer])
            rows.append(f"| `{ours}` | {peer} | {med:.2f} | {lo:.2f} | {hi:.2f} |")
    if not rows:
        return ""
    return "\n".join(["| zerofn | against | step time ratio | min | max |", "|---|---|---:|---:|---:|", *rows])


def _busy_rounds(results: Results) -> str:
    """Which threshold made a round busy, what the medians are over, and which systems were mostly timed on
    a busy machine, in words."""
    medians = (
        "Step times and ratios are the median, smallest and largest over every round "
        f"({results.config.rounds} here), busy ones included."
    )
    if not any(share is not None for m in results.systems for share in m.round_others):
        return f"**busy rounds** is n/a: the machine's CPU time could not be read (no `/proc/stat`). {medians}"
    words = [
        f"A round is busy for a system when other processes used more than {100 * BUSY:g} % of the machine's "
        f"CPU time during its loop (**busy rounds**). {medians}"
    ]
    mostly = [f"`{m.name}`" for m in results.systems if _mostly_busy(m)]
    if mostly:
        words.append(
            f"† More than half of the rounds were busy for {', '.join(mostly)}: "
            f"{'its' if len(mostly) == 1 else 'their'} figures were measured on a loaded machine."
        )
    return "\n\n".join(words)


def _loss_spread(results: Results) -> str:
    """The largest difference between the final losses of the fp32 systems, in words."""
    fp32 = [m for m in results.systems if "amp(" not in m.name]
    if len(fp32) < 2:
        return ""
    lo, hi = min(fp32, key=lambda m: m.loss), max(fp32, key=lambda m: m.loss)
    if f"{lo.loss:.6f}" == f"{hi.loss:.6f}":
        return f"The fp32 systems' final losses agree to 6 decimals ({lo.loss:.6f})."
    return (
        f"The fp32 systems' final losses lie within {hi.loss - lo.loss:.1e} of each other "
        f"({lo.loss:.6f}, {lo.name}, to {hi.loss:.6f}, {hi.name})."
    )


def _noise(results: Results) -> str:
    """How far the rounds' ratios to DDP spread, in words."""
    words = []
    if results.others_cpu is not None:
        median, most = results.others_cpu
        words.append(
            f"Other processes used {100 * median:.0f} % of the machine's CPU time during the median timed loop "
            f"(at most {100 * most:.0f} %)."
        )
    ddp = next((m for m in results.systems if m.name == DDP and m.ratio_range), None)
    if ddp is not None:
        lo, hi = ddp.ratio_range
        words.append(
            f"torch DDP against the reference, the same system, measured {ddp.ratio:.2f} ({lo:.2f} to {hi:.2f} "
            "over the rounds): the noise floor of every ratio."
        )
    spreads = [m.ratio_range[1] - m.ratio_range[0] for m in results.systems if m.ratio_range]
    if spreads and results.config.rounds > 1:
        words.append(
            f"Over the {results.config.rounds} rounds a system's ratio spread by "
            f"{statistics.median(spreads):.2f} (max - min, the median over the systems; the widest "
            f"{max(spreads):.2f})."
        )
    return " ".join(words)


def markdown(
    results: Results | list[Results],
    command: str,
    plots: list[list[str]] | list[str] | None,
    no_plots: str = "",
) -> str:
    """The whole report: one section per model shape (``results``: one run per shape); ``plots`` are the
    PNG file names written beside it, per shape (None: none were)."""
    runs = [results] if isinstance(results, Results) else list(results)
    if plots and isinstance(plots[0], str):
        plots = [plots]
    c = runs[0].config
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    seconds = sum(r.seconds for r in runs)
    lines = [
        "# Benchmark: zerofn's compositions against torch DDP, ZeroRedundancyOptimizer and FSDP2",
        "",
        f"Generated {now} in {seconds:.0f} s. To regenerate it, from the repository root:",
        "",
        f"    {command}",
        "",
        "| | |",
        "|---|---|",
        f"| machine | {machine()} |",
        f"| software | torch {torch.__version__}, Python {platform.python_version()}, zerofn {zerofn.__version__}"
        f"{_deepspeed_version(runs)} |",
        f"| ranks | {c.world} gloo ranks on this machine, {_n(c.threads, 'intra-op thread')} each |",
        f"| models | {_n(len(runs), 'shape')} of the GPT of `zerofn.bench.gpt`, below; the same batch at every "
        "step; AdamW, no gradient clipping; one seed for all systems |",
        f"| timing | {_n(c.warmup, 'warm-up step')}, then {_n(c.rounds, 'round')}; in each round every system "
        f"in turn (each round starting one system later) runs a loop of {_n(c.steps, 'consecutive step')}, "
        "timed as a whole, beside a loop of the reference (a second torch DDP) run just before or just after "
        "it |",
        "",
    ]
    for k, run in enumerate(runs):
        lines += [f"## {k + 1}. {shape(run)}", "", table(run), "", _busy_rounds(run), ""]
        if run.skipped:
            lines += ["Not measured here:", ""] + [f"- {name}: {why}" for name, why in run.skipped.items()] + [""]
        against = pairs(run)
        if against:
            lines += ["Each zerofn stage against the peers that shard the same (loop step time, round by round):", ""]
            lines += [against, ""]
        words = " ".join(w for w in (_noise(run), _loss_spread(run)) if w)
        if words:
            lines += [words, ""]
        if plots:
            lines += [f"![{PLOTS[p.rsplit('_', 1)[0]]}]({p})\n" for p in plots[k]]
    if not plots:
        lines += [f"No plots: {no_plots or 'matplotlib is not installed'} (`pip install zerofn[plot]`).", ""]
    lines += [
        "How each figure is made (per rank; where the ranks differ, the largest):",
        "",
        "- **step ms**: what a training loop waits for. In each round a system runs its steps back to back, "
        "with a barrier before the first and after the last (gloo's barrier also waits for the collectives "
        "still in flight, such as zerofn's publish all-gather of stages 1 and 2, which the next forward "
        "waits for) and nothing in between; the loop's wall time over its steps, the slowest rank's, "
        "is the round's figure. **step ms** is the median over the rounds, **step ms min** and **max** the "
        "smallest and largest round. **vs DDP** is the median over "
        "the rounds of the round's figure over the reference's beside it: a second torch DDP, built like the "
        "one in the table, whose loop runs right before the system's (every other turn right after it), so "
        "that both see the machine in the same state; torch DDP's own row is DDP against that second DDP, "
        "the noise floor. **vs DDP min** and **max** are the smallest and largest of those ratios, which say "
        "how noisy the machine was. The zerofn-against-peer ratios are the rounds' ratios of ratios.",
        "- **busy rounds**: the rounds in which processes other than the ranks used more than "
        f"{100 * BUSY:g} % of the machine's CPU time during the system's loop: the CPU time the whole machine "
        "spent busy (`/proc/stat`) less the ranks' own, over what all its cores could spend in the loop's "
        "wall time. `/proc/stat` counts whole clock ticks (10 ms on most Linux machines), so the share in a "
        "loop only a few ticks long is rough (and capped at 100 %). The medians include the busy rounds; on a "
        "shared machine every figure moves with them, so a system marked † (more than half of its rounds "
        "busy) was timed mostly on a loaded machine.",
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
        "ring each rank sends (N-1)/N of that. **traffic / Ψ** is that over the fp32 parameter bytes Ψ: "
        "the paper gives 2 for DDP, ZeRO-1 and ZeRO-2, 3 for ZeRO-3. "
        "All of it is counted, none computed from a formula: zerofn's steps count their own "
        '(`metrics["comm_bytes"]`); for torch (and DeepSpeed) the harness wraps torch.distributed\'s '
        "collective functions for one step, on a second instance of the system built only for counting "
        "(DDP's there gets torch's `allreduce_hook`, so that its bucket all-reduces pass through them; "
        "DeepSpeed's on the timed engine itself, with no second engine in the process).",
        "- **loss**: the last timed step's, mean over ranks (taken after the timed steps, so that no step "
        "waits for it). Every fp32 system trains the same model on the same batch for the same number of "
        "steps with the same AdamW and no gradient clipping, so their losses agree to rounding; bf16 ones "
        "differ a little. DeepSpeed clips the global gradient norm to `gradient_clipping`, 1.0 when its config "
        "leaves it out (DeepSpeed 0.19.8's default), so the harness sets it to 0; DeepSpeed's fused Adam then "
        "matches torch's AdamW step for step (with the default, its loss leaves the others' once a gradient's "
        "norm exceeds 1). The batch does not change from step to step, so the loss "
        "falls below what the corpus allows: it shows that the systems agree, not how well they learn.",
        "",
    ]
    return "\n".join(lines)


def _colour(name: str) -> str:
    return "#7f7f7f" if name.startswith(("torch", "DeepSpeed")) else "#1f77b4"


def plot(results: Results, out: str, k: int = 1) -> list[str]:
    """Write the PNGs of ``PLOTS`` for the ``k``-th shape into ``out`` (``<stem>_<k>.png``); returns their
    file names. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unit, scale = _unit(results)
    systems = results.systems
    names = [m.name for m in systems]
    colours = [_colour(n) for n in names]
    height = 1.2 + 0.32 * len(names)
    psi = 4 * results.config.parameters()
    c = results.config
    model = f"GPT {c.parameters() / 1e6:.2f} M, vocabulary {c.vocab}, {c.seq_len} tokens"

    def figure(stem: str, xlabel: str):
        fig, ax = plt.subplots(figsize=(8, height))
        ax.set_title(f"{PLOTS[stem]}\n{model}", fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
        return fig, ax

    def save(fig, stem: str) -> str:
        name = f"{stem}_{k}.png"
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=100)
        plt.close(fig)
        return name

    written = []
    fig, ax = figure("step_time", "step time / torch DDP's, median and range over the rounds (lower is faster)")
    ratios = [m.ratio or 0.0 for m in systems]
    spans = [m.ratio_range or (r, r) for m, r in zip(systems, ratios)]
    err = [[r - lo for r, (lo, _) in zip(ratios, spans)], [hi - r for r, (_, hi) in zip(ratios, spans)]]
    ax.barh(range(len(names)), ratios, color=colours, xerr=err, error_kw=dict(lw=0.8, capsize=2))
    ax.axvline(1.0, color="black", lw=0.8)
    for i, (r, (_, hi)) in enumerate(zip(ratios, spans)):
        ax.text(hi, i, f" {r:.2f}", va="center", fontsize=7)
    written.append(save(fig, "step_time"))

    fig, ax = figure("memory", unit)
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
    written.append(save(fig, "memory"))

    fig, ax = figure("traffic", f"{unit} per step")
    ax.barh(range(len(names)), [m.traffic / scale for m in systems], color=colours)
    for times in (2, 3):
        ax.axvline(times * psi / scale, color="black", lw=0.8, ls="--")
        ax.text(times * psi / scale, -0.6, f" {times}Ψ", fontsize=7)
    written.append(save(fig, "traffic"))
    return written


def write(results: Results | list[Results], out: str, command: str) -> str:
    """Write ``report.md`` (and the plots, when matplotlib is there) into ``out`` for one run per model
    shape; returns the report's path."""
    runs = [results] if isinstance(results, Results) else list(results)
    os.makedirs(out, exist_ok=True)
    try:
        plots, why = [plot(r, out, k + 1) for k, r in enumerate(runs)], ""
    except ImportError as e:
        plots, why = None, f"matplotlib could not be imported ({e})"
        print(f"zerofn.bench: {why}; writing the report without plots", file=sys.stderr)
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write(markdown(runs, command, plots, why))
    return path
