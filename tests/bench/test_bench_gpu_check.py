"""``python -m zerofn.bench gpu``: the GPU check starts, runs its parts and writes its report. CI has no GPU, so
this runs its CPU form (tiny shapes, gloo, no sync counts) on a few cases; on a machine with a GPU the same
command is the check docs/bench/gpu/ keeps the report of."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from zerofn.bench import gpu, gpu_checks


def test_the_cpu_form_checks_compositions_against_torch_and_writes_the_report(tmp_path):
    out = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "zerofn.bench", "gpu", "--device", "cpu", "--out", str(out)]
    cmd += ["--cases", "shard_params", "amp_fp16_overflow", "tensor_parallel_1", "--systems", "torch-amp", "zf-amp"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    checks = {r["case"]: r for r in report["checks"]}
    assert list(checks) == ["shard_params", "amp_fp16_overflow", "tensor_parallel_1"], checks
    assert all(r["correct"] is True for r in checks.values()), checks
    assert checks["shard_params"]["bitwise"] and checks["shard_params"]["max_abs_diff"] == 0.0
    assert checks["amp_fp16_overflow"]["skipped_steps"] == [5]  # the forced overflow, and only it
    assert [r["system"] for r in report["speed"]] == ["torch-amp", "zf-amp"]
    assert all(r["tokens_per_s"] > 0 and r["peak_bytes"] > 0 for r in report["speed"])
    (pair,) = report["comparisons"]  # zf-amp against torch-amp; no bf16 peak on the CPU
    assert pair["zerofn"] == "zf-amp" and pair["peer"] == "torch-amp" and pair["time_ratio"] > 0
    md = (out / "report.md").read_text()
    assert "| shard_params | yes | bit for bit | 0 |" in md, md
    assert "| zf-amp | torch-amp |" in md and "n/a (CPU)" in md
    assert (out / "log.txt").exists() and (out / "checks.jsonl").exists()


def test_a_case_that_fails_is_reported_with_where_not_raised():
    """A case that raises (here: a composition the check cannot build) is a finding in the report."""
    ctx = gpu_checks.Ctx(torch.device("cpu"), tiny=True)
    real = gpu_checks._compositions

    def broken():
        cases = real()
        cases["train_step"] = lambda ctx, record: (_ for _ in ()).throw(ValueError("no such composition"))
        return cases

    gpu_checks._compositions = broken
    try:
        r = gpu_checks.run_case("train_step", ctx)
    finally:
        gpu_checks._compositions = real
    assert r["correct"] is False and r["error"] == "ValueError: no such composition", r
    assert any("test_bench_gpu_check.py" in w or "gpu_checks.py" in w for w in r["where"]), r


def test_every_pair_names_systems_the_speed_part_runs():
    systems = set(gpu.speed_systems(deepspeed=True))
    for mine, peer, goal in gpu.PAIRS:
        assert mine in systems and peer in systems and 0 < goal <= 1.0
    assert "deepspeed-z2" not in gpu.speed_systems(deepspeed=False)


def test_the_long_context_case_runs_in_its_cpu_form():
    """context_parallel_1 (the chunked loss, tiled MLPs, remat's checkpoints in host memory) against torch on the
    whole logits, in the tiny CPU form; on a GPU the same case runs remat's pinned side-stream copies."""
    ctx = gpu_checks.Ctx(torch.device("cpu"), tiny=True)
    r = gpu_checks.run_case("context_parallel_1", ctx)
    assert r["correct"] is True, r
    # 2 % of lr: AdamW's first update amplifies the chunked loss's rounding where a gradient is near eps
    assert r["tolerance"] == 2e-5 and r["max_abs_diff"] <= 2e-5 and r["syncs"] == "n/a (CPU)", r
