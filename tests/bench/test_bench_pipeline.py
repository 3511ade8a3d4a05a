"""The pipeline benchmark at its tiny size (``--quick``): ZeRO-3 and every schedule of ``pipeline_parallel`` (1F1B,
interleaved, zero bubble; 4 and 8 micro-batches) train a Llama on 4 ranks to the same loss, each pipeline rank
sends the bytes the formula says, and the report carries every figure."""

from __future__ import annotations

import importlib.util
import json
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench():
    path = os.path.join(ROOT, "examples", "bench_pipeline.py")
    spec = importlib.util.spec_from_file_location("_bench_pipeline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not in sys.modules: cloudpickle sends its functions to the ranks by value
    return module


def test_bench_pipeline_py_sends_the_formulas_bytes_for_the_same_loss(ranks, tmp_path, capsys):
    bench = _bench()
    out_json = tmp_path / "pp.json"
    bench.main(["--quick", "--json", str(out_json)], pool=ranks(4))
    printed = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    args, rows = res["args"], res["rows"]
    p, batch, seq, hidden = res["world"], args["batch"], args["seq"], args["hidden"]
    assert p == 4 and args["microbatches"] == [4, 8]
    schedules = {"1f1b": 1, "interleaved": 2, "zero_bubble": 2}
    want = {"zero3"} | {f"{s} m={m}" for s in schedules for m in (4, 8)}
    assert set(rows) == want and res["skipped"] == {}, (set(rows), res["skipped"])
    for name in want:
        assert name in printed, printed
    zero3 = rows["zero3"]
    assert zero3["vs_zero3"] == 1.0 and len(zero3["sent_bytes"]) == p
    # one step's activations (or their gradients) across one stage boundary: every micro-batch's hidden states,
    # batch / m rows of seq x hidden fp32 each
    hop = batch * seq * hidden * 4
    # beside them: the loss vector (loss, count, check) and the gradient's sum of squares, float64, all-reduced
    # over the pipeline (an all-reduce counts twice)
    small = 2 * 8 * 3 + 2 * 8
    for name, row in rows.items():
        assert row["step_ms"] > 0 and row["fastest_ms"] <= row["step_ms"] <= row["slowest_ms"], (name, row)
        assert row["vs_zero3"] > 0 and row["params"] == zero3["params"], (name, row)
        # the same global batch, the same sums in another order: the same loss on every step
        assert len(row["losses"]) == len(zero3["losses"]) == args["warmup"] + args["rounds"] * args["steps"]
        assert max(abs(a - b) for a, b in zip(row["losses"], zero3["losses"])) <= 1e-4, (name, row["losses"])
        assert row["loss_diff"] <= 1e-4 and math.isfinite(row["loss"]), (name, row)
        if name == "zero3":
            continue
        schedule, m = name.split(" m=")
        v = schedules[schedule]
        assert (row["schedule"], row["virtual_stages"], row["microbatches"]) == (schedule, v, int(m))
        # 1F1B: the first stage sends its output, the last its input's gradient, a middle one both; with v
        # stages a rank (r, r + p, ...) each but the model's first and last sends both
        sends = [2 * v - (r == 0) - (r == p - 1) for r in range(p)]
        assert row["sent_bytes"] == [k * hop + small for k in sends], (name, row["sent_bytes"], hop)
        assert row["sent_formula"] == row["sent_bytes"]
        if v == 1:
            assert row["sent_bytes"][1] - small == 2 * (row["sent_bytes"][0] - small)
        # ZeRO-3 moves the parameters (3 Psi), a pipeline only activations: far fewer bytes here
        assert max(row["sent_bytes"]) < min(zero3["sent_bytes"]), (name, row["sent_bytes"], zero3["sent_bytes"])
        assert len(row["bubble"]) == p and all(0.0 <= b <= 1.0 for b in row["bubble"]), (name, row["bubble"])
        formula = {
            "1f1b": (p - 1) / (int(m) + p - 1),
            "interleaved": (p - 1) / (v * int(m) + p - 1),
            "zero_bubble": (p - 1) / (3 * v * int(m) + p - 1),
        }[schedule]
        assert math.isclose(row["bubble_formula"], formula), (name, row["bubble_formula"], formula)
    assert "vs zero3" in printed and "bubble" in printed and "on every pipeline rank" in printed, printed
