"""``python -m zerofn.bench --all --quick``: its report and plots are written and well formed.

The quick mode trains a tiny GPT for a few steps, so its times say little;
what it checks is that every system runs and that the figures the report
gives agree with what ZeRO predicts: optimizer state per rank halves on two
ranks, ZeRO-2 moves as many bytes as DDP (2 x parameter bytes) and ZeRO-3
half as many again (3 x).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from zerofn.bench.systems import ALL, DDP, composition_name, deepspeed_installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "zerofn.bench", "--all", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, (out / "report.md").read_text(), proc


def _table(text: str) -> tuple[list[str], dict[str, list[str]]]:
    rows = [line for line in text.splitlines() if line.startswith("| system |")]
    assert len(rows) == 1, "one table of systems"
    lines = text.splitlines()
    start = lines.index(rows[0])
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    body = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(header), line
        body[cells[0]] = cells[1:]
    return header, body


def _column(header: list[str], body: dict[str, list[str]], prefix: str) -> dict[str, float]:
    i = next(i for i, h in enumerate(header) if h.startswith(prefix)) - 1  # body rows lack the name
    return {name: float(cells[i]) for name, cells in body.items()}


def test_the_table_has_a_row_of_numbers_per_system(report):
    _, text, _ = report
    header, body = _table(text)
    expected = set(ALL)
    assert expected <= set(body), expected - set(body)
    extra = set(body) - expected  # DeepSpeed's stages, only where it is installed and runs
    assert all(n.startswith("DeepSpeed") for n in extra) and (deepspeed_installed() or not extra), extra
    for name, cells in body.items():
        for cell in cells:
            assert re.fullmatch(r"-?\d+(\.\d+)?", cell), (name, cell)
    assert _column(header, body, "vs DDP")[DDP] == 1.0
    assert body[DDP][header.index("vs DDP") - 1] == "1.00"


def test_the_figures_agree_with_zero(report):
    _, text, _ = report
    header, body = _table(text)
    optimizer = _column(header, body, "optimizer")
    traffic = _column(header, body, "traffic / Ψ")
    losses = _column(header, body, "loss")
    z1, z2, z3 = (composition_name(s) for s in ("shard_optimizer", "shard_grads", "shard_params"))
    assert optimizer[z1] < 0.6 * optimizer[DDP]  # optimizer state per rank ~ 1/N of DDP's on N = 2 ranks
    assert optimizer[composition_name("train_step")] == pytest.approx(optimizer[DDP], rel=0.01)
    assert traffic[DDP] == pytest.approx(2.0, abs=0.05)  # DDP's all-reduce: 2 x parameter bytes
    assert traffic[z2] == pytest.approx(traffic[DDP], rel=0.05)  # ZeRO-2: reduce-scatter + all-gather = 2 psi
    # ZeRO-3: one more all-gather (3 psi), less the backward gather of the blocks kept from the forward
    assert 1.1 * traffic[DDP] < traffic[z3] <= 1.5 * traffic[DDP] * 1.01
    fp32 = [n for n in body if "amp(" not in n and not n.startswith("DeepSpeed")]
    assert max(losses[n] for n in fp32) - min(losses[n] for n in fp32) < 1e-3  # the same training everywhere


def test_the_plots_are_pngs_linked_from_the_report(report):
    out, text, _ = report
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(links) == ["memory.png", "step_time.png", "traffic.png"]
    for name in links:
        data = (out / name).read_bytes()
        assert data.startswith(PNG), name
        assert len(data) > 5000, (name, len(data))  # a drawn chart, not an empty canvas


def test_the_report_says_how_to_regenerate_it_and_where_it_ran(report):
    out, text, proc = report
    assert f"python -m zerofn.bench --all --quick --out {out}" in text
    assert re.search(r"Generated \d{4}-\d\d-\d\d \d\d:\d\d UTC", text)
    assert "2 gloo ranks" in text and "torch " in text and "parameters" in text
    assert "wrote " in proc.stdout  # the terminal summary


def test_without_matplotlib_the_report_says_there_are_no_plots(tmp_path, monkeypatch):
    from zerofn.bench import Config, Measured, Results, write

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    results = Results(Config(systems=(DDP,)), [Measured(DDP, 100.0, 1.0, 4, 8, 16, 6, 8, 3.5)])
    text = open(write(results, str(tmp_path), "python -m zerofn.bench --systems 'torch DDP'")).read()
    assert "No plots: matplotlib could not be imported" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]
