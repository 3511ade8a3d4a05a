"""The expert-parallel benchmark at its tiny size (``--quick``: 2 ranks, a 0.5 M-parameter Mixtral, 87 % of it
in the experts): both systems train on the same global batch to the same losses, expert_parallel moves fewer
bytes per step than shard_params and holds no more per rank, and the goals are reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*argv: str, timeout: int = 300) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv[0]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_bench_ep_py_moves_fewer_bytes_for_the_same_losses(tmp_path):
    out_json = tmp_path / "ep.json"
    out = _run("examples/bench_ep.py", "--quick", "--out", str(out_json))
    res = json.loads(out_json.read_text())
    systems = res["systems"]
    assert set(systems) == {"shard_params", "expert_parallel"}, systems
    a, b = systems["shard_params"], systems["expert_parallel"]
    for name, s in systems.items():
        assert s["ranks"] == 2 and s["data_ranks"] == 2, (name, s)
        assert s["comm_bytes_max"] > 0 and s["state_bytes"] > 0 and s["step_peak"] > 0 and s["step_s"] > 0, (name, s)
    assert b["name"].startswith("expert_parallel(") and a["name"].startswith("shard_params("), (a["name"], b["name"])
    # expert_parallel is exact: the same global batch, the same sums in another order
    assert len(a["losses"]) == len(b["losses"]) >= 3
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) <= 1e-4, (a["losses"], b["losses"])
    assert res["goals"]["losses"]["max_diff"] <= 1e-4
    # The experts are 87 % of the parameters: at ep = world they are never gathered, and the tokens' exchanges
    # (2 layers x 2 (T k + R) rows of 64 floats) weigh far less than ZeRO-3's gathers of them.
    assert b["comm_bytes_max"] < a["comm_bytes_max"], (b["comm_bytes_max"], a["comm_bytes_max"])
    # The same state per rank: the experts sharded over the ep ranks that own them, the rest over all of them.
    assert b["state_bytes"] <= a["state_bytes"], (b["state_bytes"], a["state_bytes"])
    for goal in ("bytes", "step_time"):
        g = res["goals"][goal]
        assert {"ratio", "goal", "met"} <= set(g) and g["ratio"] > 0, (goal, g)
    assert {"bytes", "state_bytes", "step_peak", "step_time"} <= set(res["ratios"]), res["ratios"]
    assert "| shard_params(train_step) | 2 |" in out and "| expert_parallel(shard_params(train_step)) | 2 |" in out, out
    assert "load average" in out and "wall time" in out, out
