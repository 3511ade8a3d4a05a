"""The report of ``python -m zerofn.bench.gpu_speed``: model FLOPs, the GPU's peak, and the rows of its table.

:func:`rows` turns the systems' results into the table's cells (speed and
peak memory against torch-amp, the fraction of the GPU's bf16 peak,
:func:`peak_tflops_for`), which :func:`format_table` prints and
:func:`format_markdown` writes with what was run.
"""

from __future__ import annotations

import datetime
import re

import torch

__all__ = ["PEAKS", "flops_per_token", "format_markdown", "format_table", "mib", "peak_tflops_for", "rows"]

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) by a pattern in torch.cuda.get_device_name().
PEAKS = ((r"H100 PCIe", 756.0), (r"H100|H200", 989.0), (r"A100", 312.0), (r"\bL4\b", 121.0))


def flops_per_token(n_params: int, layers: int, seq_len: int, dim: int) -> int:
    """Model FLOPs per trained token: 6 N for the matmuls (forward and backward) plus attention's scores."""
    return 6 * n_params + 12 * layers * seq_len * dim


def peak_tflops_for(name: str) -> float | None:
    for pattern, tflops in PEAKS:
        if re.search(pattern, name, re.IGNORECASE):
            return tflops
    return None


def mib(b: float) -> str:
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
                mib(r["peak_bytes"]),
                mib(r["held_bytes"]),
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
