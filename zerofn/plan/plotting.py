"""``python -m zerofn plan --plot``: bytes per GPU by composition as stacked bars (:func:`plot`)."""

from __future__ import annotations

from zerofn.plan.estimates import Estimate
from zerofn.plan.text import fmt_bytes

__all__ = ["plot"]


def plot(rows: list[Estimate], gpu: float, path: str, title: str = "") -> None:
    """Stacked bars of bytes per GPU by composition, with the GPU memory as a line (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "python -m zerofn plan --plot needs matplotlib, which is not installed: pip install zerofn[plot] "
            "(or pip install matplotlib)"
        ) from None
    labels = [e.label.replace(" + ", "\n+ ") for e in rows]
    parts = [
        ("parameters", [e.params for e in rows]),
        ("gradients", [e.grads for e in rows]),
        ("optimizer state", [e.optimizer for e in rows]),
        ("activations, gathered units, update", [max(e.activations + e.gathered, e.update) for e in rows]),
    ]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(rows)), 5.5))
    bottom = [0.0] * len(rows)
    for name, vals in parts:
        gb = [v / 1e9 for v in vals]
        ax.bar(range(len(rows)), gb, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, gb)]
    ax.axhline(gpu / 1e9, color="black", linestyle="--", label=f"GPU memory ({fmt_bytes(gpu)})")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_ylabel("GB per GPU")
    top = max(bottom)
    if top > 20 * gpu / 1e9:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
