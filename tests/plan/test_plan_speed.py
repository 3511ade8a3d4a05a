"""The planner's speed model (``zerofn.plan.speeds``, ``python -m zerofn plan --hardware``), against the
formulas worked by hand (docs/planning.md, "Speed"); no timing is asserted.

- The ring formulas, and the hierarchical split of a group spanning nodes.
- The bytes each composition moves on each link: ZeRO-3's ``3 Psi`` (the paper's; zerofn's own schedule
  less the root unit and one block), HSDP's ``3 Psi (s - 1) / s`` within the node and ``2 (Psi / s)
  (R - 1) / R`` across, hpZ's, ZeRO-1/2's and DDP's ``2 Psi``, qwZ and qgZ's int8 bytes.
- Overlap: ZeRO-3's first gather and last reduce-scatter show, the rest hides behind its pass.
- Ranking: HSDP before ZeRO-3 when the inter-node bandwidth is low, not when it is NVLink's. qwZ and qgZ send
  about half of bf16's bytes and a quarter of fp32's; across nodes qgZ's flat all-to-all sends ``(n - s) / n``
  of the gradient over the NICs.
- One published configuration (torchtitan's Llama-3.1-8B FSDP on 8 H100) against the formulas by hand.
- Hardware files: presets, a file read back, bad files refused with the field named; the command line's
  table; ``--calibrate`` on 2 ranks with tiny sizes writes a hardware file that ``--hardware`` takes.
"""

from __future__ import annotations

import json
import math

import pytest

from zerofn import plan
from zerofn.plan import (
    PRESETS,
    Composition,
    flops_per_token,
    hardware_from_dict,
    link_bytes,
    load_hardware,
    model_shape,
    ring_bytes,
    speeds,
    step_speed,
)
from zerofn.plan.speed import INT8_BYTES

H100 = PRESETS["h100"]
LLAMA3_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}
GOOD = {
    "tflops": 989,
    "hbm_bytes": 80e9,
    "hbm_gbps": 3350,
    "intra_node_gbps": 450,
    "inter_node_gbps": 50,
    "gpus_per_node": 8,
}
PSI = 8e9  # a bare parameter count for the byte formulas


def _speed(comp: Composition, *, nodes: int, gpus: int = 8, root: float = 0, block: float = 0, hw=H100, **kw):
    return step_speed(
        comp,
        hardware=hw,
        params=PSI,
        root=root,
        block=block,
        layers=32,
        nodes=nodes,
        gpus_per_node=gpus,
        model_flops=1e15,
        tokens=8192.0 * nodes * gpus,
        **kw,
    )


def _bytes(speed, kinds=None) -> tuple[float, float]:
    cs = [c for c in speed.comms if kinds is None or c.kind in kinds]
    return sum(c.intra_bytes for c in cs), sum(c.inter_bytes for c in cs)


# ---------------------------------------------------------------- the ring formulas


def test_ring_formulas_by_hand():
    assert ring_bytes("all_gather", 8e9, 8) == 8e9 * 7 / 8
    assert ring_bytes("reduce_scatter", 8e9, 8) == 8e9 * 7 / 8
    assert ring_bytes("all_to_all", 8e9, 8) == 8e9 * 7 / 8
    assert ring_bytes("all_reduce", 8e9, 8) == 2 * 8e9 * 7 / 8
    assert ring_bytes("all_gather", 8e9, 1) == 0
    # a group over 16 nodes of 8: NVLink carries the node's ring over the whole tensor, each GPU's NIC the
    # ring across nodes over its 1/8; together the ring over all 128
    intra, inter = link_bytes("all_gather", 8e9, 128, 8)
    assert intra == 8e9 * 7 / 8
    assert inter == 8e9 / 8 * 15 / 16
    assert intra + inter == pytest.approx(8e9 * 127 / 128, rel=1e-12)
    intra, inter = link_bytes("all_reduce", 8e9, 128, 8)
    assert (intra, inter) == (2 * 8e9 * 7 / 8, 2 * 8e9 / 8 * 15 / 16)
    assert link_bytes("reduce_scatter", 8e9, 8, 8) == (8e9 * 7 / 8, 0.0)  # within one node: no NIC
    # an all-to-all is flat: 1/128 of it to each other rank, 7 of them on the node and 120 across
    assert link_bytes("all_to_all", 8e9, 128, 8) == (8e9 * 7 / 128, 8e9 * 120 / 128)
    assert link_bytes("all_to_all", 8e9, 8, 8) == (8e9 * 7 / 8, 0.0)
    assert link_bytes("all_reduce", 8e9, 16, 1) == (0.0, 2 * 8e9 * 15 / 16)  # one GPU a node: all across


def test_a_collective_costs_latency_plus_bytes_over_bandwidth():
    hw = hardware_from_dict(dict(GOOD, intra_node_latency_us=10, inter_node_latency_us=20))
    s = _speed(Composition("ZeRO-3", 3), nodes=2, hw=hw)
    for c in s.comms:
        if c.intra_bytes:
            assert c.intra_s == pytest.approx(c.count * 10e-6 + c.intra_bytes / 450e9, rel=1e-12)
        if c.inter_bytes:
            assert c.inter_s == pytest.approx(c.count * 20e-6 + c.inter_bytes / 50e9, rel=1e-12)


def test_flops_per_token_is_palms():
    assert flops_per_token(params=7.5e9, layers=32, width=4096, seq=8192) == 6 * 7.5e9 + 12 * 32 * 4096 * 8192


# ---------------------------------------------------------------- the bytes on each link


@pytest.mark.parametrize("nodes", [1, 16])
def test_zero3_moves_3_psi_times_n_minus_1_over_n(nodes):
    n, s, r, p = 8 * nodes, 8, nodes, 2  # bf16 parameters and gradients
    z3 = _speed(Composition("ZeRO-3", 3), nodes=nodes)  # no root unit or block given: the paper's 3 Psi
    intra, inter = _bytes(z3)
    assert intra + inter == pytest.approx(3 * PSI * p * (n - 1) / n, rel=1e-12)
    assert intra == pytest.approx(3 * PSI * p * (s - 1) / s, rel=1e-12)
    assert inter == pytest.approx(3 * PSI * p / s * (r - 1) / r, rel=1e-12)
    # zerofn's schedule: the root unit stays gathered into backward and backward starts with forward's last block
    root, block = 1e9, 2e8
    own = _speed(Composition("ZeRO-3", 3), nodes=nodes, root=root, block=block)
    gathers, _ = _bytes(own, {"all_gather"})
    reduces, _ = _bytes(own, {"reduce_scatter"})
    assert gathers == pytest.approx((2 * PSI - root - block) * p * (s - 1) / s, rel=1e-12)
    assert reduces == pytest.approx(PSI * p * (s - 1) / s, rel=1e-12)
    fp32 = _speed(Composition("ZeRO-3", 3), nodes=nodes, mixed_precision=False)
    assert sum(_bytes(fp32)) == pytest.approx(3 * PSI * 4 * (n - 1) / n, rel=1e-12)


def test_hsdp_shards_within_the_node_and_all_reduces_the_shards_across():
    nodes, s, p = 16, 8, 2
    hsdp = _speed(Composition("HSDP", 3, replicate=True), nodes=nodes)
    intra, inter = _bytes(hsdp)
    assert intra == pytest.approx(3 * PSI * p * (s - 1) / s, rel=1e-12)
    assert inter == pytest.approx(2 * (PSI * p / s) * (nodes - 1) / nodes, rel=1e-12)
    assert {c.kind for c in hsdp.comms if c.inter_bytes} == {"all_reduce"}
    assert hsdp.code == "shard_params(step, replicate=16)"


def test_hpz_gathers_backward_within_the_node():
    nodes, s, p = 16, 8, 2
    hpz = _speed(Composition("hpZ", 3, hpz=True), nodes=nodes)
    intra, inter = _bytes(hpz)
    assert intra == pytest.approx(3 * PSI * p * (s - 1) / s, rel=1e-12)  # NVLink as ZeRO-3's
    assert inter == pytest.approx(2 * PSI * p / s * (nodes - 1) / nodes, rel=1e-12)  # forward gather + reduce
    backward = [c for c in hpz.comms if c.window == "backward" and c.kind == "all_gather"]
    assert backward and all(c.ranks == s and c.inter_bytes == 0 for c in backward)
    assert hpz.code == "shard_params(step, hpz=8)"


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_ddp_and_zero12_move_2_psi(stage):
    nodes, s, p = 4, 8, 2
    n = nodes * s
    row = _speed(Composition(f"stage {stage}", stage), nodes=nodes)
    intra, inter = _bytes(row)
    assert intra + inter == pytest.approx(2 * PSI * p * (n - 1) / n, rel=1e-12)
    assert inter == pytest.approx(2 * PSI * p / s * (nodes - 1) / nodes, rel=1e-12)
    buckets = [c for c in row.comms if c.kind != "all_gather"]
    assert sum(c.count for c in buckets) == 1 + math.ceil((PSI * p - 2**20) / (25 * 2**20))  # 1 MiB, then 25 MiB


def test_qwz_and_qgz_send_int8():
    # one node: the int8 gathers and all-to-all move INT8_BYTES a parameter where bf16 moves 2 and fp32 4
    bf16 = _speed(Composition("ZeRO-3", 3), nodes=1)
    fp32 = _speed(Composition("ZeRO-3", 3), nodes=1, mixed_precision=False)
    both = _speed(Composition("ZeRO-3 + qwZ + qgZ", 3, int8_gather=True, int8_reduce=True), nodes=1)
    assert _bytes(both)[0] / _bytes(bf16)[0] == pytest.approx(INT8_BYTES / 2, rel=1e-12)  # ~0.5
    assert _bytes(both)[0] / _bytes(fp32)[0] == pytest.approx(INT8_BYTES / 4, rel=1e-12)  # ~0.25
    assert 0.25 < INT8_BYTES / 4 < 0.2505 and INT8_BYTES == 1 + 4 / 2048
    # their codec: a pass over every gathered (qwZ) and every reduced (qgZ) element, p + 1 bytes each
    assert both.codec_s == pytest.approx((2 * PSI + PSI) * 3 / 3350e9, rel=1e-12)


def test_across_nodes_qwz_halves_the_gathers_and_qgz_is_a_flat_all_to_all():
    nodes, s, q = 16, 8, INT8_BYTES
    n = nodes * s
    bf16 = _speed(Composition("ZeRO-3", 3), nodes=nodes)
    qw = _speed(Composition("ZeRO-3 + qwZ", 3, int8_gather=True), nodes=nodes)
    assert _bytes(qw, {"all_gather"})[1] / _bytes(bf16, {"all_gather"})[1] == pytest.approx(q / 2, rel=1e-12)
    qg = _speed(Composition("ZeRO-3 + qgZ", 3, int8_reduce=True), nodes=nodes)
    assert {c.kind for c in qg.comms} == {"all_gather", "all_to_all"}
    # each rank sends each other rank its int8 chunk directly: (n - s) / n of the gradient crosses nodes, where
    # a ring's reduce-scatter sends (1 / s) (R - 1) / R of it
    intra, inter = _bytes(qg, {"all_to_all"})
    assert (intra, inter) == (pytest.approx(PSI * q * (s - 1) / n), pytest.approx(PSI * q * (n - s) / n))
    both = _speed(Composition("ZeRO-3 + qwZ + qgZ", 3, int8_gather=True, int8_reduce=True), nodes=nodes)
    by_hand = 2 * PSI * q / s * (nodes - 1) / nodes + PSI * q * (n - s) / n
    assert _bytes(both)[1] == pytest.approx(by_hand, rel=1e-12)
    assert _bytes(bf16)[1] == pytest.approx(3 * PSI * 2 / s * (nodes - 1) / nodes, rel=1e-12)
    # on 2 nodes of 2 (the emulated two nodes of examples/bench_multinode.py) the int8 pair sends 2/3 of bf16's
    small = [_speed(c, nodes=2, gpus=2) for c in (Composition("ZeRO-3", 3), both.composition)]
    assert _bytes(small[1])[1] / _bytes(small[0])[1] == pytest.approx((0.5 * q + 0.5 * q) / 1.5, rel=1e-12)


# ---------------------------------------------------------------- overlap and the step


def test_zero3_hides_all_but_the_first_gather_and_the_last_reduce_scatter():
    root, block = 1e9, 2e8
    z3 = _speed(Composition("ZeRO-3", 3), nodes=1, root=root, block=block)
    first = [c for c in z3.comms if c.window == "none"]
    assert [c.kind for c in first] == ["all_gather", "reduce_scatter"]
    assert all(c.full_bytes == root * 2 for c in first)
    assert z3.exposed_s == pytest.approx(sum(c.seconds for c in first), rel=1e-12)  # the rest is hidden
    assert z3.step_s == pytest.approx(z3.compute_s + z3.exposed_s + z3.update_s, rel=1e-12)
    assert z3.update_s == pytest.approx(PSI / 8 * 36 / 3350e9, rel=1e-12)
    # with far less compute the passes cannot hide their collectives: what exceeds each pass shows
    quick = step_speed(
        Composition("ZeRO-3", 3), hardware=H100, params=PSI, root=root, block=block, layers=32, nodes=1,
        gpus_per_node=8, model_flops=1e12, tokens=8192.0,
    )  # fmt: skip
    fwd = sum(c.seconds for c in quick.comms if c.window == "forward")
    bwd = sum(c.seconds for c in quick.comms if c.window == "backward")
    none = sum(c.seconds for c in quick.comms if c.window == "none")
    assert quick.exposed_s == pytest.approx(none + fwd - quick.forward_s + bwd - quick.backward_s, rel=1e-12)


def test_zero1_publish_and_last_bucket_do_not_overlap():
    z1 = _speed(Composition("ZeRO-1", 1), nodes=1)
    shown = {c.what for c in z1.comms if c.window == "none"}
    assert any("publish" in w for w in shown) and any("last bucket" in w for w in shown)
    assert z1.exposed_s == pytest.approx(sum(c.seconds for c in z1.comms if c.window == "none"), rel=1e-12)


def test_remat_adds_a_forward_that_mfu_does_not_count():
    plain = _speed(Composition("ZeRO-3", 3), nodes=1)
    remat = _speed(Composition("ZeRO-3", 3), nodes=1, remat=True)
    assert remat.compute_s == pytest.approx(plain.compute_s * 4 / 3, rel=1e-12)
    assert remat.model_flops == plain.model_flops
    assert plain.compute_s == pytest.approx(1e15 / (989e12 * 0.6), rel=1e-12)


# ---------------------------------------------------------------- ranking


def _ranked(hw, nodes=8):
    shape = model_shape(dict(LLAMA3_8B, num_hidden_layers=16))  # a 4.6 B model: fits without remat everywhere
    return [s.label for s in speeds(shape, hardware=hw, nodes=nodes, seq=2048, micro_batch=1) if s.fits]


def test_hsdp_beats_zero3_when_the_inter_node_bandwidth_is_low():
    slow = hardware_from_dict(dict(GOOD, inter_node_gbps=2))
    order = _ranked(slow)
    assert order.index("HSDP") < order.index("ZeRO-3"), order
    assert order.index("hpZ") < order.index("ZeRO-3") and order.index("ZeRO-3 + qwZ") < order.index("ZeRO-3"), order
    fast = hardware_from_dict(dict(GOOD, inter_node_gbps=450))  # across nodes as fast as NVLink
    order = _ranked(fast)
    assert order.index("ZeRO-3") < order.index("HSDP"), order


def test_tensor_and_context_parallel_traffic_is_on_the_critical_path():
    llama70 = model_shape(
        dict(LLAMA3_8B, hidden_size=8192, num_hidden_layers=80, intermediate_size=28672, num_attention_heads=64)
    )
    rows = speeds(llama70, hardware=H100, nodes=4, tp=8, seq=4096, micro_batch=1)
    z3 = next(r for r in rows if r.label == "ZeRO-3")
    tp = next(c for c in z3.comms if c.what.startswith("tensor-parallel"))
    assert tp.window == "none" and tp.inter_bytes == 0
    assert tp.intra_bytes == pytest.approx(2 * tp.full_bytes * 7 / 8, rel=1e-12)
    gather = next(c for c in z3.comms if c.what.startswith("parameter all-gather, blocks in forward"))
    assert (gather.ranks, gather.per_node, gather.intra_bytes) == (4, 1, 0)  # dp 4, one a node: all across
    assert z3.tokens == 4 * 4096  # 4 data-parallel ranks, a sequence each
    cp = speeds(model_shape(LLAMA3_8B), hardware=H100, nodes=2, cp=16, seq=131072, micro_batch=1)
    assert "HSDP" not in [r.label for r in cp]  # one node cannot hold the cp group of 16
    ex = next(c for c in cp[0].comms if c.what.startswith("context-parallel"))
    assert ex.window == "none" and ex.intra_bytes == ex.inter_bytes == ex.full_bytes / 2


# ---------------------------------------------------------------- a published configuration, by hand


def test_torchtitan_llama3_8b_on_8_h100_by_hand():
    """torchtitan's Llama-3.1-8B FSDP on 8 H100 (local batch 2, sequences of 8192): the ZeRO-3 row from the
    formulas. It needs remat to fit 80 GB, so the compute is 4/3 of the model FLOPs'."""
    shape = model_shape(LLAMA3_8B)
    psi = 8_030_261_248
    assert shape.params == psi
    embedding = 128256 * 4096
    block = 4 * 4096 * 4096 - 2 * 4096 * 3072 + 3 * 4096 * 14336 + 2 * 4096  # q, o whole; k, v 8 of 32 heads
    root = psi - 32 * block
    n, p, eff, peak = 8, 2, 0.6, 989e12
    flops = 2 * 8192 * (6 * (psi - embedding) + 12 * 32 * 4096 * 8192)  # a GPU's step: 2 sequences of 8192
    compute = flops * 4 / 3 / (peak * eff)
    gather = lambda b, k: k * 10e-6 + b * p * (n - 1) / n / 450e9  # noqa: E731
    exposed = 2 * gather(root, 1)  # the root unit's gather and its reduce-scatter; the rest hides
    update = psi / n * 36 / 3350e9
    step = compute + exposed + update
    rows = speeds(shape, hardware=H100, nodes=1, seq=8192, micro_batch=2)
    z3 = next(r for r in rows if r.label == "ZeRO-3")
    assert z3.remat and z3.fits
    assert z3.model_flops == pytest.approx(flops, rel=1e-12)
    assert z3.compute_s == pytest.approx(compute, rel=1e-12)
    assert z3.intra_bytes == pytest.approx((3 * psi - root - block) * p * (n - 1) / n, rel=1e-12)
    assert z3.inter_bytes == 0
    assert z3.exposed_s == pytest.approx(exposed, rel=1e-12)
    assert z3.step_s == pytest.approx(step, rel=1e-12)
    assert z3.mfu == pytest.approx(flops / (step * peak), rel=1e-12)
    assert z3.tokens_per_s == pytest.approx(8 * 2 * 8192 / step, rel=1e-12)
    assert round(z3.mfu, 3) == 0.446 and round(z3.tokens_per_s / 8) == 7617  # docs/planning.md's figures
    assert rows[0].label == "ZeRO-3"


# ---------------------------------------------------------------- hardware files


def test_presets_carry_the_published_figures():
    assert (H100.tflops, H100.intra_node_gbps, H100.inter_node_gbps, H100.gpus_per_node) == (989, 450, 50, 8)
    assert (PRESETS["h200"].tflops, PRESETS["h200"].hbm_bytes) == (989, 141e9)
    a100 = PRESETS["a100"]
    assert (a100.tflops, a100.intra_node_gbps, a100.inter_node_gbps, a100.hbm_bytes) == (312, 300, 25, 80e9)
    assert load_hardware("H100") is H100


def test_a_hardware_file_reads_back(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(dict(GOOD, collectives={"all_gather": {"gbps": 100, "latency_us": 5}})))
    hw = load_hardware(str(path))
    assert hw.intra("all_gather").gbps == 100 and hw.intra("all_gather").latency_s == pytest.approx(5e-6)
    assert hw.intra("reduce_scatter").gbps == 450  # the link's, where the file names no kind's own
    assert hardware_from_dict(hw.to_dict()) == hw


@pytest.mark.parametrize(
    "change, names",
    [
        ({"tflops": None}, "'tflops'"),  # missing
        ({"inter_node_gbps": None}, "'inter_node_gbps'"),
        ({"nvlink": 900}, "'nvlink'"),  # unknown
        ({"hbm_gbps": -1}, "'hbm_gbps'"),
        ({"intra_node_gbps": "450"}, "'intra_node_gbps'"),
        ({"gpus_per_node": 7.5}, "'gpus_per_node'"),
        ({"collectives": {"broadcast": {"gbps": 1, "latency_us": 1}}}, "'broadcast'"),
        ({"collectives": {"all_gather": {"gbps": 0, "latency_us": 1}}}, "'gbps'"),
    ],
)
def test_a_bad_hardware_file_is_refused_naming_the_field(tmp_path, change, names):
    d = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        load_hardware(str(path))
    assert names in str(e.value) and str(path) in str(e.value)
    if "collectives" not in change:
        assert "expected tflops, hbm_bytes, hbm_gbps, intra_node_gbps, inter_node_gbps, gpus_per_node" in str(e.value)


def test_not_a_hardware_file(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON file"):
        load_hardware(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="one JSON object"):
        load_hardware(str(path))
    with pytest.raises(ValueError, match="neither a preset"):
        load_hardware(str(tmp_path / "missing.json"))


# ---------------------------------------------------------------- the command line


def test_the_command_line_prints_the_speed_table(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA3_8B))
    argv = ["--model", str(config), "--nodes", "128", "--gpus-per-node", "8", "--hardware", "h100"]
    assert plan.main([*argv, "--seq", "8192", "--micro-batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "1024 GPU(s) (128 node(s) x 8), 80.0 GB each" in out  # --gpus-per-node and the preset's memory
    header = next(line for line in out.splitlines() if line.startswith("composition") and "MFU" in line)
    for column in ("remat", "compute", "intra-node", "inter-node", "overlapped", "exposed", "update", "step",
                   "tokens/s", "MFU"):  # fmt: skip
        assert column in header
    for label in ("ZeRO-1", "ZeRO-2", "ZeRO-3", "HSDP", "hpZ", "ZeRO-3 + qwZ", "ZeRO-3 + qgZ", "ZeRO++"):
        assert f"\n{label}" in out
    assert "fastest: " in out and "shard_params(step, replicate=128)" in out and "hpz=8" in out
    assert "parameter all-gather, root unit (before forward computes)" in out


def test_the_command_line_refuses_what_speed_does_not_model(capsys, tmp_path):
    def usage(argv):
        with pytest.raises(SystemExit) as e:
            plan.main(argv)
        assert e.value.code == 2
        return " ".join(capsys.readouterr().err.split())

    base = ["--params", "8B", "--layers", "32", "--hidden", "4096", "--vocab", "128256"]
    assert "--hardware nope.json: neither a preset (h100, h200, a100) nor a file" in usage(
        [*base, "--hardware", "nope.json", "--seq", "8192", "--micro-batch", "1"]
    )
    assert "need the shapes" in usage(["--params", "8B", "--hardware", "h100", "--seq", "8192", "--micro-batch", "1"])
    assert "pass --seq and --micro-batch" in usage([*base, "--hardware", "h100"])
    assert "pass --hardware too" in usage([*base, "--gpu-memory", "80GB", "--efficiency", "0.5"])
    assert "required: --gpu-memory" in usage(base)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({k: v for k, v in GOOD.items() if k != "tflops"}))
    assert plan.main([*base, "--hardware", str(bad), "--seq", "8192", "--micro-batch", "1"]) == 2
    assert "missing field(s) 'tflops'" in capsys.readouterr().err
    assert "is a directory" in usage(["--calibrate", str(tmp_path)])


def test_calibrate_writes_a_hardware_file_that_plans(tmp_path, capsys):
    """The entry point on 2 ranks and tiny sizes (a few seconds): the file is valid, whatever the timings."""
    out = tmp_path / "this-machine.json"
    argv = ["--calibrate", str(out), "--calibrate-ranks", "2", "--calibrate-sizes", "4KiB,64KiB"]
    assert plan.main([*argv, "--calibrate-repeats", "1"]) == 0
    assert "written to" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert set(d["collectives"]) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}
    assert d["gpus_per_node"] == 2 and d["calibration"]["ranks"] == 2
    hw = load_hardware(str(out))
    assert all(c.gbps > 0 and c.latency_s >= 0 for c in hw.collectives.values())
    argv = ["--params", "1M", "--layers", "2", "--hidden", "64", "--vocab", "128", "--hardware", str(out)]
    assert plan.main([*argv, "--seq", "128", "--micro-batch", "2", "--fp32"]) == 0
    assert "fastest: " in capsys.readouterr().out
