"""The planner's context parallelism (``estimate(..., cp=)``, ``python -m zerofn plan --cp N --seq-len max``)
against real ``context_parallel`` steps.

- Peaks: the long-context recipe, ``remat(context_parallel(shard_params(step), cp), offload="cpu")`` with the
  model's loss (chunked by ``context_parallel``), on a tiny Hugging Face Llama (grouped-query attention) at
  512 tokens on 2 gloo ranks: cp 1 (dp 2) and cp 2 with Ulysses, cp 2 with ring, fp32 and bf16. The planner's
  in-step terms (gradients, activations, gathered units) against ``zf.memory.track()``'s peak, within
  ``PEAK_TOL``; the state against ``zf.memory.state_bytes`` (sharded over dp x cp = 2 either way); and cp 2's
  peak over cp 1's as measured.
- ``longest_sequence`` / ``--seq-len max``: a Llama-2-7B-shaped model on 8 x 80 GB; the sequence grows with
  cp as the tokens per GPU stay (8 x at cp 8), on multiples of the layout unit, the next not fitting.
- Traffic: Ulysses' and ring's bytes per layer as the transform's own tests count them.
- Refusals: a cp that does not divide world / tp, Ulysses' heads, a sequence off the layout unit, inference,
  remat_offload without remat; the command line's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import TINY_DECODER, rank_slice, tiny_llama

import zerofn as zf
from zerofn import plan
from zerofn.plan import compositions, context_parallel_plan, estimate, layout_unit, longest_sequence, model_shape

pytest.importorskip("transformers")

SEQ, MICRO = 512, 2  # 512 tokens so that the activations, not the 0.1 M parameters, dominate the peak
CONFIG = dict(model_type="llama", **TINY_DECODER, max_position_embeddings=SEQ, tie_word_embeddings=False)
# (cp, method, mixed precision), each on 2 ranks: cp 1 is dp 2, cp 2 is one group of 2
CASES = [(1, "ulysses", False), (2, "ulysses", False), (1, "ulysses", True), (2, "ulysses", True)]
CASES += [(2, "ring", False), (2, "ring", True)]
# The activation model is GPT's with context parallelism's terms; on this Llama computing on the CPU it is
# 16 % under to 11 % over the tracked peak. Under: in bf16, Hugging Face's RMSNorm keeps fp32 copies of its
# input that the model counts on CUDA only (autocast's), not on the CPU (and ring's fp32 temporaries beyond
# those counted). Over: ZeRO-3's gathered units are counted as prefetch + 2 blocks of full parameters and
# gradients, more than a 2-block model holds at once, which at 0.1 M parameters is a tenth of the peak.
# 25 %, tests/plan/test_plan.py's bound, leaves room for neither to be tuned to this model.
PEAK_TOL = 0.25
RATIO_TOL = 0.10  # cp 2's peak over cp 1's: the activations halve, the gathered units and gradients stay

LLAMA2_7B = dict(
    model_type="llama",
    vocab_size=32000,
    hidden_size=4096,
    num_hidden_layers=32,
    intermediate_size=11008,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
RECIPE = dict(chunked_loss=True, remat_offload=True)


def _measure(cases: list) -> list[dict]:
    """Each case's state bytes and in-step peak under the long-context recipe, on this rank."""
    return [_measure_one(*case) for case in cases]


def _measure_one(cp: int, method: str, mp: bool) -> dict:
    from zerofn.transforms import amp, context_parallel, remat, shard_params

    apply = zf.functional(tiny_llama(max_position_embeddings=SEQ))

    def loss_fn(params, batch):  # the model's loss from its labels: chunked by context_parallel
        return apply(params, **batch).loss

    step = shard_params(zf.train_step(loss_fn, zf.optim.adamw(1e-3)))
    if mp:
        step = amp(step, torch.bfloat16)
    step = remat(context_parallel(step, cp, method=method), offload="cpu")
    state = step.init(apply.params)
    held = zf.memory.state_bytes(state)
    here, data = zf.collectives.data_rank(step), step.mesh.data_size
    ids = torch.randint(0, TINY_DECODER["vocab_size"], (MICRO * data, SEQ), generator=torch.Generator().manual_seed(0))
    with zf.memory.track() as t:
        state, _ = step(state, rank_slice({"input_ids": ids, "labels": ids}, here, data))
    return dict(case=(cp, method, mp), state=held["total"] - held["buffers"], peak=t.peak)


def _estimate(cp: int, method: str, mp: bool) -> zf.plan.Estimate:
    return estimate(
        model_shape(CONFIG),
        gpus=2,
        stage=3,
        mixed_precision=mp,
        seq=SEQ,
        micro_batch=MICRO,
        device="cpu",
        remat=True,
        cp=cp,
        cp_method=method,
        **RECIPE,
    )


def test_the_recipe_s_peak_is_planned(ranks):
    """The planner's in-step bytes against the larger of the two ranks' peaks (ring's ranks may differ: the
    blocks each computes depend on its chunks), and the state against each's."""
    results = ranks(2).run(_measure, CASES)
    worst = 0.0
    peaks = {}
    for i, case in enumerate(CASES):
        e = _estimate(*case)
        what = f"cp {case[0]} {case[1]} {'bf16' if case[2] else 'fp32'}"
        for rows in results:  # the state: ZeRO-3 over dp x cp = 2 ranks either way, within its padding
            assert 0 <= e.state - rows[i]["state"] <= 0.01 * rows[i]["state"], (what, e.state, rows[i]["state"])
        peak = max(rows[i]["peak"] for rows in results)  # the GPU that has to hold it
        in_step = e.grads + max(e.activations + e.gathered, e.update)
        err = in_step / peak - 1
        assert abs(err) <= PEAK_TOL, (what, in_step, peak)
        worst = max(worst, abs(err))
        peaks[case] = (peak, in_step)
    for mp in (False, True):
        (m1, p1), (m2, p2) = peaks[(1, "ulysses", mp)], peaks[(2, "ulysses", mp)]
        assert m2 < 0.6 * m1, (m1, m2)  # the sequence cut in two: activations halve
        assert abs((p2 / p1) / (m2 / m1) - 1) <= RATIO_TOL, (m2 / m1, p2 / p1)
    print(f"\ncontext parallelism on 2 ranks: in-step peak within {100 * worst:.1f} %")


def test_the_model_s_loss_is_chunked_and_the_inputs_leave_the_gpu():
    """At 32k tokens of a 7B-shaped model: the whole logits' 12 bytes per vocabulary entry and token against one
    chunk's (and the gradients the chunked loss keeps); remat's kept inputs in host RAM (in ``cpu``) on a GPU,
    where on the CPU they stay."""
    shape = model_shape(LLAMA2_7B)
    v, h, tokens = 32000, 4096, 32768
    kw = dict(gpus=8, stage=3, seq=tokens, micro_batch=1)
    whole, chunked = estimate(shape, **kw), estimate(shape, **kw, chunked_loss=True)
    grad_hidden, chunk = tokens * h * 2, 64 * 2**20 // (4 * v)  # bf16; tokens a chunk of 64 MiB of fp32 logits
    loss = grad_hidden + 4 * v * h + max(chunk * v * (4 + 2), grad_hidden + 4 * v * h)
    assert whole.activations - chunked.activations == 12 * v * tokens - loss
    kw["remat"] = True
    chunked = estimate(shape, **kw, chunked_loss=True)
    offloaded = estimate(shape, **kw, **RECIPE)
    inputs = 32 * 32768 * 4096 * 2  # a bf16 hidden state per block and token
    assert offloaded.remat_host == inputs and offloaded.cpu - chunked.cpu == inputs
    assert chunked.activations - offloaded.activations == pytest.approx(31 * 32768 * 4096 * 2, rel=0.01)
    on_cpu = estimate(shape, **kw, **RECIPE, device="cpu")
    assert on_cpu.remat_host == 0 and on_cpu.activations > offloaded.activations
    assert "remat (inputs on CPU)" in offloaded.label


def test_longest_sequence_grows_with_cp():
    shape = model_shape(LLAMA2_7B)
    found = {}
    for cp, method in ((1, "ulysses"), (8, "ulysses"), (8, "ring")):
        kw = dict(gpus=8, cp=cp, cp_method=method, **RECIPE)
        seq, best = longest_sequence(shape, gpu_memory=80e9, **kw)
        unit = layout_unit(cp, method)
        assert seq % unit == 0, (cp, method, seq)
        assert best.fits(80e9) and best.total <= 80e9
        rows = compositions(shape, seq=seq + unit, micro_batch=1, **kw)
        assert not any(e.fits(80e9) for e in rows), (cp, method, seq)  # one unit more fits nowhere
        found[cp, method] = seq
    # the tokens per GPU stay: at cp 8 the sequence is 8 x cp 1's, to the layout unit
    assert abs(found[8, "ulysses"] - 8 * found[1, "ulysses"]) <= 8, found
    assert found[1, "ulysses"] > 100_000
    # ring computes its scores in tiles of at most 32 MiB: its fp32 blocks (dq, the accumulators) cost more per
    # token than Ulysses' working set, but no quadratic term: the same order of length
    assert found[8, "ulysses"] / 4 < found[8, "ring"] < found[8, "ulysses"] * 2, found
    # with the host's RAM checked, remat's inputs (8 GPUs x layers x tokens x hidden x 2 bytes) bound it
    seq, best = longest_sequence(shape, gpu_memory=80e9, cpu_memory=512e9, gpus=8, cp=8, **RECIPE)
    assert seq < found[8, "ulysses"] and best.cpu_per_node <= 512e9 and best.remat_host


def test_traffic_is_the_transform_s():
    """Ulysses: per layer and direction bytes(q) + bytes(k) + bytes(v) + bytes(out) of this rank's tokens (the tiny
    Llama's 2 key/value heads at cp 4 repeated to 4), tests/transforms/context_parallel's formula; ring: (cp - 1)
    k and v blocks a direction and cp trips of the fp32 accumulator in backward (the ring module's)."""
    rows, seq, heads, kv, d, e = 4, 16, 4, 2, 16, 4
    for cp in (2, 4):
        tokens = rows * seq // cp
        c = context_parallel_plan(
            size=cp,
            method="ulysses",
            world=cp,
            tp=1,
            layers=2,
            heads=heads,
            kv_heads=kv,
            head_dim=d,
            seq=seq,
            micro_batch=rows,
            activation_bytes=e,
        )
        q, k = tokens * heads * d * e, tokens * max(kv, cp) * d * e
        assert c.exchange == 2 * q + 2 * k and c.traffic(remat=False) == 2 * 2 * (2 * q + 2 * k)
        assert c.traffic(remat=True) == 3 * 2 * (2 * q + 2 * k)
        r = context_parallel_plan(
            size=cp,
            method="ring",
            world=cp,
            tp=1,
            layers=2,
            heads=heads,
            kv_heads=kv,
            head_dim=d,
            seq=seq,
            micro_batch=rows,
            activation_bytes=e,
        )
        n = rows * kv * (seq // cp) * d
        per_layer = (cp - 1) * 2 * n * e + (cp - 1) * 2 * n * e + cp * 2 * n * 4
        assert r.traffic(remat=False) == 2 * per_layer and r.unit == 2 * cp


def test_the_planner_s_constants_are_the_transform_s():
    from zerofn.transforms.context_parallel import METHODS, _feed

    from zerofn import losses
    from zerofn.plan import activations, context

    assert activations.LOSS_CHUNK_BYTES == losses.CHUNK_BYTES
    from zerofn.transforms.context_parallel import _ring

    assert activations.RING_TILE_BYTES == _ring._TILE_BYTES
    assert context.METHODS == METHODS
    for cp in (1, 2, 3, 8):
        for method in METHODS:
            assert layout_unit(cp, method) == _feed.chunks(1024, cp, method)


def test_refusals_name_the_numbers():
    shape = model_shape(LLAMA2_7B)
    llama = model_shape(CONFIG)  # 4 attention, 2 key/value heads
    cases = [
        (shape, dict(gpus=8, cp=3), "cp=3 does not divide world / tp = 8"),
        (shape, dict(gpus=8, tp=2, cp=8), "cp=8 does not divide world / tp = 4"),
        (llama, dict(gpus=8, cp=8), "a GPU holds 4 query and 2 key/value heads"),
        (llama, dict(gpus=8, cp=8), "Use cp_method='ring'"),
        (llama, dict(gpus=8, tp=2, cp=4), "holds 2 query and 1 key/value heads (the model's 4 and 2 over tp 2)"),
        (shape, dict(gpus=8, cp=8, cp_method="ring", seq=4100, micro_batch=1), "plan a multiple of 16, such as 4112"),
        (shape, dict(gpus=8, cp=8, inference=True), "cp=8 with inference=True is not modelled"),
        (shape, dict(gpus=8, cp=8, remat_offload=True), "pass remat=True too"),
        (shape, dict(gpus=8, cp=0), "cp must be an int >= 1"),
        (shape, dict(gpus=8, cp=2, cp_method="stripes"), "cp_method must be one of ['ulysses', 'ring']"),
    ]
    for source, kw, message in cases:
        with pytest.raises(ValueError) as e:
            estimate(source, **kw)
        assert message in str(e.value), (kw, str(e.value))
    assert estimate(llama, gpus=8, cp=8, cp_method="ring").context_parallel.unit == 16  # ring keeps every head
    with pytest.raises(ValueError, match="needs the shapes|need the shapes|which need the shapes"):
        longest_sequence(7e9, gpu_memory=80e9, gpus=8, cp=8)


def test_cli_refusals(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    base = ["--model", str(tmp_path), "--gpus", "8", "--gpu-memory", "80GB"]
    for args, message in (
        (["--cp-method", "ring"], "--cp-method ring says how --cp N splits attention; pass --cp N too"),
        (["--cp", "0"], "--cp 0: the GPUs per context-parallel group must be at least 1"),
        (["--seq-len", "lots"], "expected a sequence length in tokens (4096, 32k) or max"),
    ):
        with pytest.raises(SystemExit):
            plan.main(base + args)
        assert message in capsys.readouterr().err, args
    assert plan.main(base + ["--cp", "3", "--seq-len", "max"]) == 2
    assert "error: estimate: cp=3 does not divide world / tp = 8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan.main(["--params", "7e9", "--gpus", "8", "--gpu-memory", "80GB", "--cp", "8", "--seq-len", "max"])
    assert "--seq-len max finds the longest sequence" in capsys.readouterr().err


def test_cli_example_runs(tmp_path):
    """The docs' example: ``python -m zerofn plan --model config.json --gpus 8 --gpu-memory 80GB --cp 8 --seq-len
    max``, as a user runs it; the sequence it names and the table at it; --seq and --seq-len are one option."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    args = ["--model", str(tmp_path / "config.json"), "--gpus", "8", "--gpu-memory", "80GB", "--cp", "8"]
    run = subprocess.run(
        [sys.executable, "-m", "zerofn", "plan", *args, "--seq-len", "max"], capture_output=True, text=True, check=True
    )
    out = run.stdout
    seq, best = longest_sequence(model_shape(LLAMA2_7B), gpu_memory=80e9, gpus=8, cp=8, **RECIPE)
    assert f"longest sequence: {seq:,} tokens x micro-batch 1 (a multiple of 8, the layout unit of cp 8" in out
    assert f"with {best.label} at" in out and f"recommendation: {best.label}" in out
    assert "past the config's max_position_embeddings (4,096)" in out
    assert "context parallel 8 (ulysses) x data parallel 1" in out
    assert f"each GPU computes 1/8 of every micro-batch's sequence ({seq // 8:,} tokens" in out
    assert "remat with its inputs on the CPU" in out and "Ulysses' 4 all-to-alls a layer per direction" in out
    assert plan.main(args + ["--seq", "32k", "--micro-batch", "1"]) == 0
    assert plan.main(args + ["--seq-len", "32768", "--micro-batch", "1", "--cp-method", "ring"]) == 0
