"""The benchmark examples run for a step or two at a tiny size, print their tables, and their numbers agree
with what they measure against (the same loss for every fp32 system; a checkpoint read back equal)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*argv: str, timeout: int = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_py_prints_every_system_with_the_same_fp32_loss():
    out = _run(
        "examples/bench.py",
        "--world",
        "2",
        "--dim",
        "32",
        "--layers",
        "1",
        "--seq-len",
        "16",
        "--batch",
        "2",
        "--steps",
        "1",
        "--rounds",
        "1",
        "--warmup",
        "1",
    )
    rows = {}
    for line in out.splitlines():
        m = re.match(r"^(torch DDP|torch ZeroRedundancyOptimizer|torch FSDP2|\S*train_step\S*)\s+(.*)$", line)
        if m:
            rows[m.group(1)] = [float(x) for x in m.group(2).split()]
    assert {
        "torch DDP",
        "train_step",
        "shard_optimizer(train_step)",
        "shard_grads(train_step)",
        "shard_params(train_step)",
    } <= set(rows), out
    # step ms, vs DDP (each system's loop over the reference DDP loop beside it), the fastest round's step ms, ...
    assert all(r[0] > 0 and r[1] > 0 and r[2] > 0 for r in rows.values()), rows
    losses = {name: r[-1] for name, r in rows.items()}
    assert max(losses.values()) - min(losses.values()) <= 1e-5, losses  # the same math: equal to rounding


def test_bench_checkpoint_py_saves_and_loads_against_torch(tmp_path):
    out = _run(
        "examples/bench_checkpoint.py",
        "--world",
        "2",
        "--models",
        "32x1",
        "--rounds",
        "1",
        "--warmup-rounds",
        "0",
        "--train-steps",
        "1",
        "--dir",
        str(tmp_path),
    )
    assert "zf shard_params (ZeRO-3)" in out and "torch DCP (FSDP2)" in out and "torch.save (DDP, rank 0)" in out, out
    assert os.listdir(tmp_path) == [], "the benchmark removes what it wrote"


def test_bench_offload_py_streams_from_files(tmp_path):
    out = _run(
        "examples/bench_offload.py", "--params", "200000", "--repeat", "1", "--steps", "2", "--path", str(tmp_path)
    )
    m = re.search(r"loss ([\d.]+) and ([\d.]+)", out)
    assert m, out
    assert float(m.group(1)) == float(m.group(2)), out  # offloading changes where the state lives, not the math
    four = re.search(r"4\. The host update alongside the forward.*", out)
    assert four, out
    assert len(re.findall(r"[\d.]+ ms \([\d.]+\)", four.group(0))) == 5, four.group(0)  # every system timed


def test_bench_infinity_py_trains_from_files_and_reports_the_disk_bound(tmp_path):
    """The ZeRO-Infinity benchmark at a tiny size, parameters in files and in RAM: it trains (the same losses
    both ways: where the shards rest changes no number), reports its figures, and removes its files."""
    outs = {}
    for where in ("nvme", "cpu"):
        out = _run(
            "examples/bench_infinity.py",
            *("--dim", "64", "--layers", "2", "--heads", "4", "--vocab", "64", "--seq-len", "16"),
            *("--steps", "1", "--probe-mb", "8", "--sub-group-mb", "0.25", "--params", where, "--path", str(tmp_path)),
        )
        assert re.search(r"step [\d.]+ s \(mean of 1 consecutive\): [\d.]+ x the disk bound", out), out
        assert re.search(r"moved per step: [\d.]+ GB read, [\d.]+ GB written", out), out
        assert re.search(r"peak RSS [\d.]+ GiB \([\d.-]+ GiB above the process before init, allocator: ", out), out
        outs[where] = re.search(r"loss ([\d.]+) -> ([\d.]+)", out).groups()
    assert outs["nvme"] == outs["cpu"], outs
    assert os.listdir(tmp_path) == [], "the benchmark removes what it wrote"


def test_bench_optim_groups_py_times_groups_muon_and_bf16_moments(tmp_path):
    out_json = tmp_path / "groups.json"
    _run(
        "examples/bench_optim_groups.py",
        *("--dim", "32", "--layers", "1", "--rounds", "1", "--steps", "1", "--warmup", "1", "--loss-steps", "3"),
        *("--json", str(out_json)),
    )
    res = json.loads(out_json.read_text())
    groups = res["groups"]
    for stage in ("train_step", "shard_optimizer", "shard_grads", "shard_params"):
        one, mask = groups[f"{stage}/adamw"], groups[f"{stage}/adamw(mask=decay_mask())"]
        multi = groups[f"{stage}/multi_transform(adamw, adamw)"]
        assert mask["buckets"] > one["buckets"] and multi["buckets"] == mask["buckets"]  # a label's own buckets
        assert mask["comm_bytes"] >= one["comm_bytes"] and mask["optimizer_bytes"] == one["optimizer_bytes"]
        muon = groups[f"{stage}/muon + adamw"]
        assert muon["optimizer_bytes"] < one["optimizer_bytes"]  # one momentum for the matrices, not two moments
    fp32, mu, both = (
        res["moments"][k]["optimizer_bytes"] for k in ("fp32 moments", "mu_dtype=bf16", "mu_dtype=nu_dtype=bf16")
    )
    assert fp32 - mu == mu - both > 0  # each bf16 moment saves 2 bytes per element


def test_bench_phases_py_breaks_the_step_into_phases():
    out = _run(
        "examples/bench_phases.py",
        *("--shape", "v512", "--dim", "32", "--layers", "1", "--seq-len", "16", "--batch", "2"),
        *("--rounds", "1", "--steps", "1", "--warmup", "1"),
        *("--systems", "ddp", "zf1", "zf0", "ddp-nosync", "zf2", "zf3", "fsdp2"),
    )
    names = "ddp|zf1|zf0|ddp-nosync|zf2|zf3|fsdp2"
    rows = dict(re.findall(rf"^({names})\s+([\d.]+)\s", out, re.M))
    assert set(rows) == {"ddp", "zf1", "zf0", "ddp-nosync", "zf2", "zf3", "fsdp2"}, out
    phases = {}  # (system, phase) -> rank 0's wall ms
    for m in re.finditer(rf"^  ({names}): (.+?)\s{{2,}}([\d.]+) \(", out, re.M):
        phases[m.group(1), m.group(2).strip()] = float(m.group(3))
    for system in ("zf1", "zf0", "zf2", "zf3"):
        step, fb = phases[system, "step"], phases[system, "forward + backward"]
        assert 0 < phases[system, "forward (inside forward + backward)"] < fb <= step, out
        assert phases[system, "update"] > 0, out
        # the statistics' all-reduce, launched (beside the gradients' under train_step) and waited for apart
        assert phases[system, "stats all-reduce (loss, gradient norm): launch"] > 0, out
        assert phases[system, "stats all-reduce: wait for it (blocking)"] > 0, out
    assert ("zf1", "in backward: launch reduce-scatter") in phases and (
        "zf0",
        "in backward: launch all-reduce",
    ) in phases
    assert ("zf0", "in backward: launch reduce-scatter") not in phases  # each system's phases are its own
    for system in ("ddp", "ddp-nosync"):
        assert phases[system, "backward (DDP's all-reduce inside)"] > 0, out
    assert phases["fsdp2", "backward (FSDP2's gathers and reduce-scatters inside)"] > 0, out
    # shard_params' own phases: its gathers and the units' agreement, in its rows only
    assert phases["zf3", "in forward and backward: launch a unit's all-gathers"] > 0, out
    assert ("zf3", "in forward and backward: the units' agreement (launch)") in phases, out
    assert ("zf2", "in forward and backward: launch a unit's all-gathers") not in phases, out


@pytest.mark.parametrize("where", ["spawned", "in-process"])
def test_bench_phases_py_without_phases_times_the_loops_alone(where):
    """``--no-phases`` at world size 1: every system's loop and its CPU over the model alone, and no phase timed
    inside a step (nothing wrapped); in a rank ``zf.spawn`` starts, or with ``--in-process`` in the script's
    own process."""
    out = _run(
        "examples/bench_phases.py",
        *("--world", "1", "--dim", "32", "--layers", "1", "--seq-len", "16", "--batch", "2"),
        *("--rounds", "1", "--steps", "1", "--warmup", "1", "--no-phases"),
        *("--systems", "torch", "zf0", "zf3"),
        *(["--in-process"] if where == "in-process" else []),
    )
    rows = dict(re.findall(r"^(torch|zf0|zf3)\s+([\d.]+)\s", out, re.M))
    assert set(rows) == {"torch", "zf0", "zf3"} and all(float(v) > 0 for v in rows.values()), out
    assert re.search(r"^  zf3\s+[\d.]+ \([+-][\d.]+\)", out, re.M), out  # its CPU over the model alone
    assert not re.search(r"^  (torch|zf0|zf3): ", out, re.M), out  # no phase


def test_bench_tp_py_trains_tp_2_x_dp_2_as_dp_4_and_counts_the_all_reduces(tmp_path):
    """The tensor-parallel benchmark at a tiny size under torchrun on 4 ranks: both systems train and are timed
    and reach the same loss; tp 2 x dp 2 holds per rank what dp 4 holds (a quarter of every split layer) plus
    its replicated norms sharded over 2 instead of 4, and moves Megatron's activation all-reduces on its
    tensor-parallel group beside fewer data-parallel bytes."""
    hidden, layers, seq, global_batch = 64, 2, 16, 8
    out_json = tmp_path / "tp.json"
    out = _run(
        *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", "examples/bench_tp.py"),
        *("--hidden", str(hidden), "--intermediate", "128", "--layers", str(layers), "--heads", "4", "--kv-heads", "2"),
        *("--vocab", "64", "--seq-len", str(seq), "--global-batch", str(global_batch), "--steps", "2", "--rounds", "1"),
        *("--quiet", "--json", str(out_json)),
    )
    assert re.search(r"Llama 0\.1 M parameters", out), out
    assert re.search(r"loss after 5 steps: .* the same within 0\.0001", out), out
    res = json.loads(out_json.read_text())
    assert len(res["ranks"]) == 4 and res["same_loss"]
    norms = (2 * layers + 1) * hidden  # replicated under tensor_parallel: each rank holds 1/2 of them, not 1/4
    activation = global_batch // 2 * seq * hidden * 4  # one all-reduce's bytes: a data-parallel rank's rows
    for rank in res["ranks"]:
        f = rank["figures"]
        dp, tp = f["dp"], f["tp"]
        for system in (dp, tp):
            assert system["step_s"] > 0 and system["comm_bytes"] > 0 and system["step_peak"] > 0, system
            assert math.isfinite(system["last_loss"]) and system["last_loss"] < system["first_loss"], system
        assert abs(tp["last_loss"] - dp["last_loss"]) <= 1e-4, (tp["last_loss"], dp["last_loss"])
        extra = norms * 4 // 2 - norms * 4 // 4  # fp32: the norms' half against their quarter, the rest the same
        assert tp["state"]["params"] - dp["state"]["params"] == extra, (tp["state"], dp["state"])
        assert tp["state"]["optimizer"] - dp["state"]["optimizer"] == 2 * extra, (tp["state"], dp["state"])  # 2 moments
        # two all-reduces per block in forward, two in backward, the embedding's and the head's input's, counted
        # 2 x their bytes, the batch check's 96 bytes and the gradient's sum of squares over the tp ranks' 16
        assert tp["tensor_comm_bytes"] == 2 * activation * (4 * layers + 2) + 96 + 16, tp["tensor_comm_bytes"]
        assert dp["tensor_comm_bytes"] == 0
        assert tp["comm_bytes"] - tp["tensor_comm_bytes"] < dp["comm_bytes"], (tp, dp)
    assert "tp 2 x dp 2 / dp 4, rank 3:" in out, out


def test_bench_quantize_py_holds_and_gathers_the_nf4_base_in_fewer_bytes(tmp_path):
    """The QLoRA benchmark at a tiny size under torchrun on 2 ranks: every system trains and is timed, and on
    each rank the NF4 base holds fewer bytes than the bf16 one (its projections at most 0.3 x: 4 bits and the
    scales against 16 bits) and moves fewer per step, with and without its shards offloaded."""
    out_json = tmp_path / "quantize.json"
    out = _run(
        *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "examples/bench_quantize.py"),
        *("--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2"),
        *("--vocab", "64", "--seq-len", "16", "--lora", "4", "--steps", "2", "--rounds", "1", "--quiet"),
        *("--json", str(out_json)),
    )
    assert re.search(r"Llama 0\.1 M parameters", out), out
    res = json.loads(out_json.read_text())
    assert len(res["ranks"]) == 2
    for rank in res["ranks"]:
        figures = rank["figures"]
        assert set(figures) == {"bf16 base", "nf4 base", "bf16 base, offloaded", "nf4 base, offloaded"}
        for f in figures.values():
            assert f["step_s"] > 0 and f["comm_bytes"] > 0 and f["step_peak"] > 0, f
            assert math.isfinite(f["first_loss"]) and math.isfinite(f["last_loss"]), f
        for where in ("", ", offloaded"):
            nf4, bf16 = figures[f"nf4 base{where}"], figures[f"bf16 base{where}"]
            assert 0 < nf4["projection_weights"] <= 0.3 * bf16["projection_weights"], (nf4, bf16)
            assert nf4["frozen_base"] < bf16["frozen_base"] and nf4["state"]["params"] < bf16["state"]["params"]
            assert nf4["comm_bytes"] < bf16["comm_bytes"], (nf4["comm_bytes"], bf16["comm_bytes"])
    assert "nf4 base / bf16 base, rank 1:" in out, out


def test_bench_generate_py_gathers_once_and_moves_activations_under_tensor_parallel(tmp_path):
    """The generation benchmark at a tiny size under torchrun on 2 ranks: every system generates and is timed;
    gathering once gives the per-call path's tokens for fewer bytes per token, and tensor_parallel(2), whose
    tokens move activations only, fewer still."""
    out_json = tmp_path / "generate.json"
    out = _run(
        *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "examples/bench_generate.py"),
        *("--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4", "--kv-heads", "2"),
        *("--vocab", "64", "--prompt", "8", "--tokens", "4", "--rounds", "1", "--json", str(out_json)),
    )
    assert re.search(r"Llama 0\.1 M parameters", out), out
    res = json.loads(out_json.read_text())
    assert len(res["ranks"]) == 2
    for rank in res["ranks"]:
        f = rank["figures"]
        assert set(f) == {"tensor_parallel(2)", "shard_params, per call", "shard_params, once"}
        for system in f.values():
            assert system["token_s"] > 0 and len(system["tokens"]) == 4, system
        once, per_call, tp = f["shard_params, once"], f["shard_params, per call"], f["tensor_parallel(2)"]
        assert once["tokens"] == per_call["tokens"]  # the same state, the same math
        assert (
            once["comm_calls"]["default group"]["all_gather"] * 4
            == per_call["comm_calls"]["default group"]["all_gather"]
        ), (once["comm_calls"], per_call["comm_calls"])  # one gather of each bucket against one per token
        assert tp["comm_bytes_per_token"] < once["comm_bytes_per_token"] < per_call["comm_bytes_per_token"]
    assert "shard_params, once" in out and "vs tensor_parallel(2)" in out, out


def test_bench_host_reads_times_both_paths_of_each_step():
    out = _run("examples/bench_host_reads.py", "--dim", "32", "--layers", "1", "--seq-len", "16", "--steps", "2")
    rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| adamw")]
    assert [r[0].strip() for r in rows] == ["adamw fp32", "adamw amp fp16"], out
    for r in rows:
        device, host, ratio = (float(x) for x in r[1:4])
        assert device > 0 and host > 0 and math.isclose(ratio, device / host, rel_tol=0.01, abs_tol=0.002), out


def test_bench_context_py_finds_the_longest_sequence_per_system(tmp_path):
    """The long-sequence benchmark at its tiny size on 1 and 2 ranks: every system has a longest sequence under
    the budget with its step time and peak, cp 2 trains at least cp 1's, plain torch is the reference, and the
    first losses (the same model and sequence, fp32) agree."""
    out_json = tmp_path / "context.json"
    out = _run("examples/bench_context.py", "--quick", "--cp", "1", "2", "--methods", "ulysses", "--out", str(out_json))
    res = json.loads(out_json.read_text())
    systems = res["systems"]
    assert set(systems) == {"plain torch", "cp 1", "cp 2"}, systems
    for name, s in systems.items():
        assert s["longest"] and s["step_s"] > 0 and s["tokens_s"] > 0, (name, s)
        assert 0 < s["peak"] <= res["args"]["budget"] and s["stopped_by"] in ("budget", "max-seq"), (name, s)
    assert systems["cp 2"]["longest"] >= systems["cp 1"]["longest"] >= systems["plain torch"]["longest"], systems
    assert systems["plain torch"]["vs_torch"] == 1.0
    losses = [r["first_loss"] for r in res["results"]]
    assert max(losses) - min(losses) <= 1e-5, losses
    assert "| plain torch | 1 |" in out and "| cp 2 | 2 |" in out, out
