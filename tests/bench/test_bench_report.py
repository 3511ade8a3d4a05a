"""``python -m zerofn.bench --all --quick``: its report and plots are written and well formed.

The quick mode trains a tiny GPT of each shape for a few steps, so its times
say little; what it checks is that every system runs, that the figures the
report gives agree with what ZeRO predicts (optimizer state per rank halves
on two ranks, ZeRO-2 moves as many bytes as DDP, 2 x parameter bytes, and
ZeRO-3 half as many again, 3 x) and that every fp32 system, DeepSpeed's
where it is installed, does the same math: the same final loss to rounding.
The harness's arithmetic (slowest rank, ratios round by round, the share of
the CPU other processes used and the busy rounds it marks) is checked
against figures made up by hand.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from zerofn.bench.systems import (
    ALL,
    DDP,
    DEEPSPEED,
    AdamWConfig,
    composition_name,
    deepspeed_config,
    deepspeed_installed,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "zerofn.bench", "--all", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, (out / "report.md").read_text(), proc


def _tables(text: str, shapes: int = 2) -> list[tuple[list[str], dict[str, list[str]]]]:
    """Every table of systems in the report (one per model shape): (header, cells by system)."""
    lines = text.splitlines()
    tables = []
    for start, row in enumerate(lines):
        if not row.startswith("| system |"):
            continue
        header = [c.strip() for c in row.strip("|").split("|")]
        body = {}
        for line in lines[start + 2 :]:
            if not line.startswith("|"):
                break
            cells = [c.strip() for c in line.strip("|").split("|")]
            assert len(cells) == len(header), line
            body[cells[0]] = cells[1:]
        tables.append((header, body))
    assert len(tables) == shapes, "one table of systems per model shape"
    return tables


def _column(header: list[str], body: dict[str, list[str]], prefix: str) -> dict[str, float]:
    i = next(i for i, h in enumerate(header) if h.startswith(prefix)) - 1  # body rows lack the name
    return {name: float(cells[i]) for name, cells in body.items()}


def test_the_table_has_a_row_of_numbers_per_system(report):
    _, text, _ = report
    for header, body in _tables(text):
        expected = set(ALL)
        assert expected <= set(body), expected - set(body)
        extra = set(body) - expected  # DeepSpeed's stages, only where it is installed and runs
        assert all(n.startswith("DeepSpeed") for n in extra) and (deepspeed_installed() or not extra), extra
        for name, cells in body.items():
            busy = header.index("busy rounds") - 1  # body rows lack the name
            assert re.fullmatch(r"[01] of 1( †)?|n/a", cells[busy]), (name, cells[busy])  # --quick: one round
            for cell in cells[:busy] + cells[busy + 1 :]:
                assert re.fullmatch(r"-?\d+(\.\d+)?", cell), (name, cell)
        ms, fastest, slowest = (_column(header, body, c) for c in ("step ms", "step ms min", "step ms max"))
        assert all(fastest[n] == ms[n] == slowest[n] for n in body), body  # one round: its median is itself
        ratio, lo, hi = (_column(header, body, c) for c in ("vs DDP", "vs DDP min", "vs DDP max"))
        assert all(0 < lo[n] <= ratio[n] <= hi[n] for n in body), body  # the median lies in the rounds' range
    assert "torch DDP against the reference, the same system, measured" in text  # the noise floor, in words
    assert "barrier step" not in text and "started at a barrier" not in text  # one timing only: the loop's
    assert "median, smallest and largest over every round (1 here)" in text


def test_the_figures_agree_with_zero(report):
    _, text, _ = report
    for header, body in _tables(text):
        optimizer = _column(header, body, "optimizer")
        traffic = _column(header, body, "traffic / Ψ")
        z1, z2, z3 = (composition_name(s) for s in ("shard_optimizer", "shard_grads", "shard_params"))
        assert optimizer[z1] < 0.6 * optimizer[DDP]  # optimizer state per rank ~ 1/N of DDP's on N = 2 ranks
        assert optimizer[composition_name("train_step")] == pytest.approx(optimizer[DDP], rel=0.01)
        assert traffic[DDP] == pytest.approx(2.0, abs=0.05)  # DDP's all-reduce: 2 x parameter bytes
        assert traffic[z2] == pytest.approx(traffic[DDP], rel=0.05)  # ZeRO-2: reduce-scatter + all-gather = 2 psi
        # ZeRO-3: one more all-gather (3 psi), less the backward gather of the blocks kept from the forward
        assert 1.1 * traffic[DDP] < traffic[z3] <= 1.5 * traffic[DDP] * 1.01


def test_every_fp32_system_reaches_the_same_loss(report):
    # The same model, batch, steps and AdamW, no clipping: torch, zerofn (offload and remat included) and
    # DeepSpeed agree to rounding (DeepSpeed's with the harness's gradient_clipping 0; see the test below).
    # bf16 rows differ by more than rounding and are left out.
    _, text, _ = report
    for header, body in _tables(text):
        losses = _column(header, body, "loss")
        fp32 = {n: v for n, v in losses.items() if "amp(" not in n}
        assert len(fp32) >= 9 + 3 * deepspeed_installed(), fp32
        assert max(fp32.values()) - min(fp32.values()) <= 1e-5, fp32


def test_deepspeed_trains_with_the_others_optimizer_and_no_clipping():
    adamw = AdamWConfig(lr=3e-4, betas=(0.9, 0.95), eps=1e-7, weight_decay=0.01)
    config = deepspeed_config(2, 2**20, 4, adamw)
    assert config["gradient_clipping"] == 0.0  # DeepSpeed's default clips the global norm to 1.0
    assert config["optimizer"]["type"] == "AdamW"
    params = dict(config["optimizer"]["params"], betas=tuple(config["optimizer"]["params"]["betas"]))
    assert params == adamw.torch_kwargs()  # what torch.optim.AdamW gets in the torch systems
    assert config["zero_optimization"]["stage"] == 2 and config["train_micro_batch_size_per_gpu"] == 4
    assert len(DEEPSPEED) == 3
    # ZeRO-3's default replaces torch.nn.functional.linear for the whole process (every system's timed steps)
    assert deepspeed_config(3, 2**20, 4, adamw)["zero_optimization"]["memory_efficient_linear"] is False


def test_a_system_that_replaces_a_torch_function_is_refused(monkeypatch):
    """A system whose building replaces a function of torch.nn.functional would have every other system in the
    ranks time the replacement: the harness says which system and which function, and what to do."""
    import torch.nn.functional as F

    from zerofn.bench import harness

    before = harness._torch_functions()
    harness._check_torch_kept("torch DDP", before)  # nothing replaced
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: x @ w.t())
    with pytest.raises(RuntimeError, match=r"'DeepSpeed ZeRO-3' replaced torch.nn.functional.linear.*turn"):
        harness._check_torch_kept("DeepSpeed ZeRO-3", before)


def _zero3_linear() -> tuple[bool, bool]:
    import torch.nn.functional as F

    from zerofn.bench.gpt import GPTConfig
    from zerofn.bench.systems import build

    linear = F.linear
    build(DEEPSPEED[2], GPTConfig(dim=32, layers=1, seq_len=16), 2**20, 2, AdamWConfig())
    return F.linear is linear, getattr(F.linear, "__module__", "").startswith("torch")


@pytest.mark.skipif(not deepspeed_installed(), reason="DeepSpeed is not installed")
def test_deepspeed_zero3_leaves_torchs_linear_in_place():
    import zerofn as zf

    assert zf.spawn(_zero3_linear, 1)[0] == (True, True)


def _clipped_and_unclipped(steps: int) -> dict[str, list[float]]:
    """In each rank: the losses of ``steps`` steps of torch DDP, and of DeepSpeed ZeRO-1 with the harness's
    config and with DeepSpeed's default gradient clipping."""
    import deepspeed
    import torch

    from zerofn import collectives as C
    from zerofn.bench.gpt import GPT, GPTConfig, MarkovCorpus
    from zerofn.bench.systems import _torch_step, build

    torch.set_num_threads(1)
    cfg, adamw, bucket = GPTConfig(dim=64, layers=2, seq_len=32), AdamWConfig(lr=3e-3), 2**20
    rank, world = C.rank(), C.world_size()
    batch = MarkovCorpus(vocab=cfg.vocab).sample(4 * world, cfg.seq_len + 1, seed=1)[4 * rank : 4 * rank + 4]

    def losses(step):
        return [float(C.all_reduce(step(batch).detach().float().clone(), "mean")) for _ in range(steps)]

    out = {"ddp": losses(build(DDP, cfg, bucket, 4, adamw).step)}
    harness = deepspeed_config(1, bucket, 4, adamw)
    default = {k: v for k, v in harness.items() if k != "gradient_clipping"}
    for name, config in (("harness", harness), ("default", default)):
        torch.manual_seed(0)
        model = GPT(cfg)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        out[name] = losses(_torch_step(engine, engine.backward, engine.step))
        out[name + ": clipping"] = [engine.gradient_clipping()]
    return out


@pytest.mark.skipif(not deepspeed_installed(), reason="DeepSpeed is not installed")
def test_deepspeeds_default_gradient_clipping_is_what_moved_its_loss():
    # DeepSpeed clips the global gradient norm to 1.0 when its config leaves gradient_clipping out
    # (deepspeed/runtime/constants.py); the harness sets it to 0. With the default its loss leaves DDP's
    # once a step's gradient norm exceeds 1; without, its fused Adam matches torch's AdamW step for step.
    import zerofn as zf

    out = zf.spawn(_clipped_and_unclipped, 2, 6)[0]
    assert out["harness: clipping"] == [0.0] and out["default: clipping"] == [1.0]
    assert out["harness"] == pytest.approx(out["ddp"], rel=1e-5), out
    assert max(abs(a - b) for a, b in zip(out["default"], out["ddp"])) > 1e-3, out


def _figures(loops, beside, load=None, load_beside=None):
    out = dict(loops=loops, beside=beside, loss=1.0, cores=2)
    out.update(params=4, optimizer=8, held=12, peak_in_step=6, traffic=8)
    return out if load is None else dict(out, load=load, load_beside=load_beside)


def test_step_times_are_the_slowest_ranks_against_the_reference_beside_them():
    from zerofn.bench.harness import Config, gather_results

    ours = composition_name("shard_optimizer")
    # Seconds per step of each round's loop, and of the reference loop run beside it, per rank.
    rank0 = {
        DDP: _figures([0.100, 0.200, 0.100], [0.100, 0.190, 0.100]),
        ours: _figures([0.090, 0.150, 0.120], [0.110, 0.200, 0.100]),
    }
    rank1 = {
        DDP: _figures([0.110, 0.100, 0.100], [0.100, 0.200, 0.105]),
        ours: _figures([0.080, 0.210, 0.100], [0.100, 0.150, 0.100]),
    }
    results = gather_results(Config(systems=(DDP, ours), rounds=3), [(rank0, {}, 1.0), (rank1, {}, 1.0)])
    ddp, zero1 = results.systems
    assert zero1.round_ms == pytest.approx((90.0, 210.0, 120.0))  # each loop's slowest rank
    assert zero1.ms == pytest.approx(120.0)  # the median of the rounds
    assert zero1.ms_range == pytest.approx((90.0, 210.0)) and ddp.ms_range == pytest.approx((100.0, 200.0))
    # against the reference beside each loop (slowest ranks 110, 200, 100): 90/110, 210/200, 120/100
    assert zero1.ratio == pytest.approx(210 / 200)  # the median of the rounds' ratios, not 120 / 110
    assert zero1.ratio_range == pytest.approx((90 / 110, 1.2))
    assert ddp.round_ratios == pytest.approx((110 / 100, 200 / 200, 100 / 105))  # DDP against the reference
    assert ddp.ratio == pytest.approx(1.0) and ddp.ratio_range == pytest.approx((100 / 105, 1.1))
    ratios = [a / b for a, b in zip((90 / 110, 210 / 200, 120 / 100), (1.1, 1.0, 100 / 105))]
    assert zero1.against(ddp) == pytest.approx((sorted(ratios)[1], min(ratios), max(ratios)))
    assert results.others_cpu is None  # no CPU readings
    assert zero1.round_others == (None, None, None) and zero1.busy_rounds == 0


def test_the_machines_other_load_is_its_busy_time_less_the_ranks():
    from zerofn.bench.harness import Config, gather_results

    # One round: the system's loop and the reference's beside it, 0.4 s each. In the system's the machine
    # (2 cores) was busy 0.8 s and the ranks 0.3 s each: others took 0.2 s of 2 x 0.4 s, 25 %. In the
    # reference's the ranks were all of it.
    def rank():
        return {DDP: _figures([0.1], [0.1], [(0.4, 0.3, 0.8)], [(0.4, 0.35, 0.7)])}, {}, 1.0

    results = gather_results(Config(systems=(DDP,), rounds=1, steps=4), [rank(), rank()])
    assert results.others_cpu == pytest.approx((0.125, 0.25))  # (median, largest) over every loop
    assert results.systems[0].round_others == pytest.approx((0.25,))  # the system's own loop only
    assert results.systems[0].busy_rounds == 1


def _busy_results():
    """Six rounds of three systems: busy in 4 of them, in 3, and none read, by hand."""
    from zerofn.bench.harness import BUSY, Config, Measured, Results

    ours, zero = composition_name("shard_optimizer"), "torch ZeroRedundancyOptimizer"
    above, below = 2 * BUSY, BUSY / 2

    def measured(name, others):
        ms = (100.0, 120.0, 90.0, 110.0, 105.0, 95.0)
        return Measured(name, 102.5, 1.0, 4, 8, 16, 6, 8, 3.5, (0.9, 1.1), ms, (1.0,) * 6, others)

    systems = [
        measured(DDP, (above, above, None, below, above, above)),  # 4 of the 5 rounds read: mostly busy
        measured(ours, (above, BUSY, below, above, above, below)),  # 3 of 6 (BUSY itself is not above it)
        measured(zero, (None,) * 6),  # /proc/stat unread
    ]
    return Results(Config(systems=(DDP, ours, zero), rounds=6), systems, others_cpu=None)


def test_a_round_is_busy_above_the_threshold():
    from zerofn.bench.report import busy

    ddp, ours, zero = _busy_results().systems
    assert (ddp.busy_rounds, ours.busy_rounds, zero.busy_rounds) == (4, 3, 0)
    assert busy(ddp) == "4 of 5 †"  # more than half of the rounds read were busy
    assert busy(ours) == "3 of 6"  # half is not more than half
    assert busy(zero) == "n/a"


def test_the_report_marks_systems_timed_mostly_on_a_busy_machine():
    from zerofn.bench.harness import BUSY
    from zerofn.bench.report import markdown

    results = _busy_results()
    ddp, ours, zero = (m.name for m in results.systems)
    text = markdown(results, "python -m zerofn.bench", None)
    [(header, body)] = _tables(text, shapes=1)
    cells = {name: row[header.index("busy rounds") - 1] for name, row in body.items()}
    assert cells == {ddp: "4 of 5 †", ours: "3 of 6", zero: "n/a"}
    ms, fastest, slowest = (_column(header, body, c) for c in ("step ms", "step ms min", "step ms max"))
    assert (ms[ours], fastest[ours], slowest[ours]) == (102.5, 90.0, 120.0)  # the median and the rounds' range
    assert f"more than {100 * BUSY:g} % of the machine's CPU time" in text  # the threshold used
    assert "over every round (6 here), busy ones included" in text
    note = next(line for line in text.splitlines() if "† More than half" in line)
    assert f"`{ddp}`" in note and ours not in note and zero not in note


def test_the_plots_are_pngs_linked_from_the_report(report):
    out, text, _ = report
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(links) == [f"{stem}_{k}.png" for stem in ("memory", "step_time", "traffic") for k in (1, 2)]
    for name in links:
        data = (out / name).read_bytes()
        assert data.startswith(PNG), name
        assert len(data) > 5000, (name, len(data))  # a drawn chart, not an empty canvas


def test_the_report_says_how_to_regenerate_it_and_where_it_ran(report):
    out, text, proc = report
    assert f"python -m zerofn.bench --all --quick --out {out}" in text
    assert re.search(r"Generated \d{4}-\d\d-\d\d \d\d:\d\d UTC", text)
    assert "2 gloo ranks" in text and "torch " in text and "parameters" in text
    sections = re.findall(
        r"^## \d\. GPT of [\d,]+ parameters.*vocabulary (\d+)([^,]*), sequences of (\d+).*$", text, re.M
    )
    assert sections == [("64", "", "16"), ("512", " (output head untied)", "16")], sections  # --quick's length
    assert "betas (0.9, 0.95), weight decay 0.01" in text
    assert "wrote " in proc.stdout  # the terminal summary


def test_without_matplotlib_the_report_says_there_are_no_plots(tmp_path, monkeypatch):
    from zerofn.bench import Config, Measured, Results, write

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    results = Results(Config(systems=(DDP,)), [Measured(DDP, 100.0, 1.0, 4, 8, 16, 6, 8, 3.5)])
    text = open(write(results, str(tmp_path), "python -m zerofn.bench --systems 'torch DDP'")).read()
    assert "No plots: matplotlib could not be imported" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]
