"""examples/bench_gpu.py: its CPU smoke run (one child process per system) and its markdown table."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import zerofn.transforms

import zerofn as zf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "examples", "bench_gpu.py")
SMOKE = [
    "--device",
    "cpu",
    "--dim",
    "64",
    "--layers",
    "2",
    "--seq-len",
    "32",
    "--batch",
    "2",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--systems",
    "torch-amp",
    "zf-z3-amp",
    "fsdp2",
]  # zf-amp runs in test_bench_gpu_check's speed part, beside torch-amp
SMOKE_SYSTEMS = SMOKE[SMOKE.index("--systems") + 1 :]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _number(cell: str) -> float:
    return float(cell.replace(",", ""))


def test_cpu_smoke_run_lists_every_system_and_writes_markdown(tmp_path):
    out = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, SCRIPT, *SMOKE, "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    # the printed table: a header, a rule, one row per system in the order asked, each with tokens/s > 0
    lines = proc.stdout.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.startswith("system "))
    header = lines[head].split()
    assert header[:4] == ["system", "ranks", "step", "ms"], lines[head]
    rows = [ln.split() for ln in lines[head + 2 : head + 2 + len(SMOKE_SYSTEMS)]]
    assert [r[0] for r in rows] == SMOKE_SYSTEMS, proc.stdout
    for r in rows:
        assert r[1] == "1" and _number(r[2]) > 0 and _number(r[3]) > 0, (r, proc.stdout)
        assert r[5] == "n/a", r  # no peak to compare with on the CPU
    assert rows[0][-2:] == ["1.00x", "1.00x"]  # torch-amp against itself

    # the markdown: metadata, then a header row, its separator, one row per system with as many cells
    md = out.read_text()
    assert "torch: " + torch.__version__ in md and "device: cpu" in md and "command: `python " in md, md
    assert "--systems torch-amp zf-z3-amp fsdp2" in md, md
    table = [ln for ln in md.splitlines() if ln.startswith("|")]
    assert len(table) == 2 + len(SMOKE_SYSTEMS), md
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in table]
    assert cells[0][:4] == ["system", "ranks", "step ms", "tokens/s"], cells[0]
    assert all(set(c) <= set("-:") and c for c in cells[1]), cells[1]
    assert all(len(c) == len(cells[0]) for c in cells), cells
    body = {c[0]: c for c in cells[2:]}
    assert list(body) == SMOKE_SYSTEMS
    for name, c in body.items():
        assert _number(c[cells[0].index("tokens/s")]) > 0, (name, c)
        assert _number(c[cells[0].index("peak MiB")]) > 0, (name, c)


def test_systems_are_the_issue_s_and_every_zerofn_composition_runs():
    bench = _bench()
    assert set(bench.SYSTEMS) == {
        "torch-amp",
        "fsdp2",
        "deepspeed-z2",
        "deepspeed-z3",
        "deepspeed-z2-offload",
        "zf-amp",
        "zf-z1-amp",
        "zf-z2-amp",
        "zf-z3-amp",
        "zf-z2-amp-offload",
        "zf-z2-amp-offload-sync",
        "zf-z2-amp-offload-delay",
        "zf-z2-amp-offload-early",
        "zf-z3-amp-remat",
    }
    for name in ("amp", "shard_optimizer", "shard_grads", "shard_params", "offload", "remat"):
        assert callable(getattr(zerofn.transforms, name)), name
    for system in bench.ZF_SYSTEMS:  # each composition builds and trains one step on one rank
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        apply = zf.functional(model)
        step = zf.train_step(lambda p, b: apply(p, b).square().mean(), zf.optim.adamw(1e-3))  # noqa: B023 (used in this iteration)
        step = bench.zf_composition(system)(step)
        state = step.init(apply.params)
        state, metrics = step(state, torch.ones(2, 4))
        assert torch.isfinite(metrics["loss"]), system
        assert state.params[0].dtype == torch.bfloat16, system  # amp: bf16 parameters, fp32 master
        if "-offload" in system:  # overlapped, first, early, or one step late, as the name says
            options = step.extension("offload").options  # offload's HostOptions record
            overlap, delay, early = options.overlap, options.delay, options.early
            assert overlap == (not system.endswith("-sync")), system
            assert (delay, early) == (int(system.endswith("-delay")), system.endswith("-early")), system


def test_deepspeed_is_reported_not_run_when_missing_or_on_cpu():
    bench = _bench()
    args = bench.parse_args(["--device", "cpu", "--systems", "deepspeed-z2"])
    r = bench.run_system(args, "deepspeed-z3")
    want = "not installed" if importlib.util.find_spec("deepspeed") is None else "CUDA only"
    assert r == {"system": "deepspeed-z3", "skipped": want}
    header, body = bench.rows([r], None)
    assert body[0][0] == "deepspeed-z3" and want in body[0] and len(body[0]) == len(header)


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", None),
        ("NVIDIA GeForce RTX 4090", None),
    ],
)
def test_peak_lookup_and_model_flops(name, tflops):
    bench = _bench()
    assert bench.peak_tflops_for(name) == tflops
    assert bench.flops_per_token(1000, layers=2, seq_len=32, dim=64) == 6 * 1000 + 12 * 2 * 32 * 64


def test_a_cuda_run_without_a_gpu_says_so():
    bench = _bench()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit, match="no CUDA device"):
        bench.main(["--systems", "torch-amp"])
