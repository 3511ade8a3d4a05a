"""The correctness and host-sync half of ``python -m zerofn.bench gpu``: one process, one rank.

Each case trains a composition for ``STEPS`` steps and the same model with
plain torch (``torch.optim.AdamW(fused=True)``, autocast for ``amp``) on the
same device and batches, and compares the parameters: bit for bit where the
arithmetic is the same, within a stated tolerance where it is not (the host
Adam kernel of ``offload``, bf16, ``torch.compile``'s fused kernels). The
reference also runs twice, so a difference is read against torch's own
run-to-run difference on the device.

On CUDA the steps from the third on run twice more, each time in a fresh
state: once under ``torch.cuda.set_sync_debug_mode("warn")`` with the torch
profiler on, which counts every synchronising call (CUDA's own check, and
``cudaStreamSynchronize`` / ``cudaDeviceSynchronize`` / ``cudaEventSynchronize``
seen by the profiler) and where zerofn made it; then, when that counted none,
under ``"error"``, which raises on the first one. No metric is read inside
either window.

Run by the parent (``zerofn.bench.gpu``) under ``torch.distributed.run
--nproc_per_node 1`` (NCCL on CUDA, gloo on the CPU), each case's result one
JSON line appended to ``--out`` as soon as it is known, so a crash loses
only the case in flight::

    python -m torch.distributed.run --standalone --nproc_per_node 1 -m zerofn.bench.gpu_checks \\
        --device cuda --out checks.jsonl [--cases train_step amp_fp16_overflow ...] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import zerofn as zf
from zerofn.bench.gpt import GPT, GPTConfig, MarkovCorpus, loss_fn_for

STEPS = 10
WINDOW = range(2, STEPS)  # steps 3 to 10, counted from 1
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(zf.__file__)))  # frames below it are zerofn's
_HERE = os.path.relpath(os.path.abspath(__file__), _ROOT)  # how _where names this file


@dataclass(frozen=True)
class Ctx:
    device: torch.device
    tiny: bool  # the CPU smoke form: tiny shapes

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def gpt_config(self) -> GPTConfig:
        if self.tiny:
            return GPTConfig(vocab=64, seq_len=16, dim=32, heads=2, layers=2)
        return GPTConfig(vocab=512, seq_len=128, dim=256, heads=4, layers=4)

    def batches(self, vocab: int, seq: int) -> list[torch.Tensor]:
        corpus = MarkovCorpus(vocab)
        n = 2 if self.tiny else 8
        return [corpus.sample(n, seq + 1, seed=i).to(self.device) for i in range(STEPS)]


# ---------------------------------------------------------------- models and references


def _gpt(ctx: Ctx) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(ctx.gpt_config()).to(ctx.device)


def _llama(ctx: Ctx, *, lora: bool = False, nf4_of: torch.dtype | None = None) -> torch.nn.Module:
    """A small Llama (grouped-query attention); ``lora``: peft adapters on every projection, B drawn
    non-zero; ``nf4_of``: its frozen Linear weights replaced by their NF4 round trip from that dtype."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    width = 64 if ctx.tiny else 256
    cfg = LlamaConfig(
        vocab_size=128 if ctx.tiny else 512,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float()
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    if nf4_of is not None:
        from zerofn.transforms.quantize import codec

        fmt = codec("nf4", 64)
        with torch.no_grad():
            for path, m in model.named_modules():
                if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad and not path.endswith("lm_head"):
                    w = m.weight.to(nf4_of)
                    m.weight.copy_(fmt.decode(fmt.encode(w), w.shape, w.dtype))
    return model.to(ctx.device)


def _gpt_loss(model: torch.nn.Module) -> Callable:
    def loss(batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    return loss


def _llama_loss_fn(apply) -> Callable:
    def loss_fn(params, batch):
        logits = apply(params, input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))

    return loss_fn


def _torch_train(model: torch.nn.Module, loss: Callable, batches, *, autocast: torch.dtype | None = None):
    """Plain torch: fused AdamW over the trainable parameters; the parameters after every batch, and the losses."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    losses = []
    for batch in batches:
        with torch.autocast(batch.device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            out = loss(batch)
        out.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.detach())
    return {n: p.detach().clone() for n, p in model.named_parameters()}, torch.stack(losses).float().cpu()


def _adamw():
    return zf.optim.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD)


# ---------------------------------------------------------------- syncs


@contextlib.contextmanager
def _watch(ctx: Ctx, mode: str, record: dict):
    """Count synchronising calls in the block: CUDA's sync check (``mode`` "warn" counts each, with the
    innermost zerofn frame that made it; "error" raises on the first) and, under "warn", the profiler's
    runtime calls."""
    if not ctx.cuda:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    seen: list[str] = []
    harness: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            where = _where(traceback.extract_stack()[:-1])
            # a sync made by this harness (its own frame innermost: the profiler's start or flush) is no step's
            (harness if where.startswith(_HERE) else seen).append(where)

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if mode == "warn" else None
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        if prof is not None:
            prof.__enter__()
        torch.cuda.set_sync_debug_mode(mode)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
            if prof is not None:
                prof.__exit__(None, None, None)
    record["sync_warnings"] = len(seen)
    record["sync_where"] = sorted(set(seen))[:8]
    record["harness_syncs"] = len(harness)
    if prof is not None:
        counts = {name: 0 for name in SYNC_CALLS}
        for e in prof.events():
            if e.name in counts:
                counts[e.name] += 1
        record["profiler_syncs"] = counts


def _where(frames) -> str:
    """The innermost frame of zerofn in a stack (the call that synchronised), else the innermost outside
    torch, marked as such."""
    mine = [f for f in frames if _ours(f.filename)]
    if mine:
        return _named(mine[-1])
    outside = [f for f in frames if os.sep + "torch" + os.sep not in f.filename] or frames
    return f"(not zerofn) {os.path.basename(outside[-1].filename)}:{outside[-1].lineno} {outside[-1].name}"


def _zerofn_frames(exc: BaseException) -> list[str]:
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [_named(f) for f in frames if _ours(f.filename)]
    return mine[-4:] or [f"{os.path.basename(f.filename)}:{f.lineno}" for f in frames[-3:]]


def _named(f: traceback.FrameSummary) -> str:
    return f"{os.path.relpath(f.filename, _ROOT)}:{f.lineno} {f.name}"


def _ours(filename: str) -> bool:
    return filename.startswith(_ROOT) and os.sep + "torch" + os.sep not in filename[len(_ROOT) :]


# ---------------------------------------------------------------- zerofn runs


def _zf_train(build: Callable, batches, *, watch: str | None, ctx: Ctx, record: dict, before: Callable | None = None):
    """Build (apply, step) fresh, init, run every batch (the ``WINDOW`` steps under ``_watch(watch)``);
    return the full parameters, the losses and the metrics of each step."""
    apply, step = build()
    state = step.init(apply.params)
    metrics_all, snaps = [], []
    stack = contextlib.ExitStack()
    for i, batch in enumerate(batches):
        if watch is not None and i == WINDOW.start:
            stack.enter_context(_watch(ctx, watch, record))
        if before is not None:
            snaps.append(before(state, i))
        state, m = step(state, batch)
        metrics_all.append(m)
        if watch is not None and i == WINDOW.stop - 1:
            stack.close()
    stack.close()
    full = step.full_params(state)
    return apply, step, state, full, metrics_all, snaps


def _diff(got: dict, want: dict) -> tuple[float, bool, list[str]]:
    names = [n for n in want if n in got]
    if not names:
        raise AssertionError(f"no parameter names in common: {sorted(got)[:4]} vs {sorted(want)[:4]}")
    worst, equal = 0.0, True
    for n in names:
        a, b = got[n].detach().float().to(want[n].device), want[n].float()
        if a.shape != b.shape:
            raise AssertionError(f"{n}: shape {tuple(a.shape)}, torch's {tuple(b.shape)}")
        worst = max(worst, float((a - b).abs().max()) if a.numel() else 0.0)
        equal = equal and torch.equal(a, b)
    return worst, equal, names


def _compare(record: dict, got: dict, want: dict, again: dict, *, tol: float, bitwise: bool, why: str = ""):
    worst, equal, names = _diff(got, want)
    floor, _, _ = _diff(again, want)
    record.update(max_abs_diff=worst, bitwise=equal, torch_rerun_diff=floor, tolerance=tol, params=len(names))
    record["expect"] = "bit for bit" if bitwise else f"within {tol:g}" + (f" ({why})" if why else "")
    ok = equal if bitwise and floor == 0.0 else worst <= max(tol, 2 * floor)
    record["correct"] = bool(ok)
    if bitwise and not equal and floor == 0.0:
        record["note"] = f"not bit for bit: max |diff| {worst:.3g} where torch reruns exactly"


def _sync_runs(ctx: Ctx, build: Callable, batches, record: dict):
    """The two sync windows, each in a fresh state: count ("warn" + profiler), then "error" if none."""
    if not ctx.cuda:
        record["syncs"] = "n/a (CPU)"
        return
    counted: dict = {}
    _zf_train(build, batches, watch="warn", ctx=ctx, record=counted)
    empty: dict = {}  # the profiler's own calls (its start and its flush), counted on an empty window
    with _watch(ctx, "warn", empty):
        pass
    n_steps = len(WINDOW)
    own = empty.get("profiler_syncs", {})
    prof = {k: v - own.get(k, 0) for k, v in counted.get("profiler_syncs", {}).items()}
    record["sync_warnings_per_step"] = counted["sync_warnings"] / n_steps
    record["profiler_syncs_per_step"] = sum(prof.values()) / n_steps
    record["profiler_syncs"] = prof
    record["sync_where"] = counted["sync_where"]
    if counted["sync_warnings"]:
        record["sync_error_mode"] = "skipped: the counting window saw synchronising calls"
        return
    try:
        _zf_train(build, batches, watch="error", ctx=ctx, record={})
        record["sync_error_mode"] = "clean"
    except RuntimeError as e:
        record["sync_error_mode"] = f"raised: {str(e).splitlines()[0][:160]} at {_zerofn_frames(e)}"


# ---------------------------------------------------------------- the cases


def _gpt_case(compose: Callable, *, tol: float = 0.0, why: str = "", autocast: torch.dtype | None = None):
    """A case on the GPT: the composition against torch (bit for bit unless ``tol``)."""

    def case(ctx: Ctx, record: dict):
        cfg = ctx.gpt_config()
        batches = ctx.batches(cfg.vocab, cfg.seq_len)
        want, want_loss = _torch_train(m := _gpt(ctx), _gpt_loss(m), batches, autocast=autocast)
        again, _ = _torch_train(m := _gpt(ctx), _gpt_loss(m), batches, autocast=autocast)

        def build():
            apply = zf.functional(_gpt(ctx))
            step = compose(zf.train_step(loss_fn_for(apply), _adamw()), ctx)
            return apply, step

        _, _, state, got, metrics, _ = _zf_train(build, batches, watch=None, ctx=ctx, record=record)
        _compare(record, got, want, again, tol=tol, bitwise=tol == 0.0, why=why)
        losses = torch.stack([m["loss"].detach().float().cpu() for m in metrics])
        record["loss_diff"] = float((losses - want_loss).abs().max())
        record["state_bytes"] = zf.memory.state_bytes(state)["by_placement"]
        _sync_runs(ctx, build, batches, record)

    return case


def _fp16_overflow(ctx: Ctx, record: dict):
    """amp fp16 with a dynamic scale (hysteresis 1): step 5's loss made infinite on the device, so the
    update is skipped, the scale halved and the parameters kept, with no host read (step 5 is inside the
    sync windows)."""
    from zerofn.transforms import amp

    cfg = ctx.gpt_config()
    batches = ctx.batches(cfg.vocab, cfg.seq_len)
    bad = 4  # the fifth step

    def build():
        apply = zf.functional(_gpt(ctx))
        base = loss_fn_for(apply)
        calls = []

        def loss_fn(p, b):
            calls.append(1)
            out = base(p, b)
            return out * float("inf") if len(calls) == bad + 1 else out

        step = amp(zf.train_step(loss_fn, _adamw()), torch.float16, hysteresis=1)
        return apply, step

    def snapshot(state, i):
        return [t.detach().clone() for t in state.params] if i in (bad, bad + 1) else None

    _, _, _, _, metrics, snaps = _zf_train(build, batches, watch=None, ctx=ctx, record=record, before=snapshot)
    skipped = [bool(m["skipped"]) for m in metrics]
    scales = [float(m["loss_scale"]) for m in metrics]
    kept = all(torch.equal(a, b) for a, b in zip(snaps[bad], snaps[bad + 1]))
    record.update(skipped_steps=[i + 1 for i, s in enumerate(skipped) if s], scales=scales[bad - 1 : bad + 2])
    record["expect"] = "step 5 skipped, its scale half of step 4's, the parameters unchanged by it"
    record["correct"] = skipped == [i == bad for i in range(STEPS)] and scales[bad] == scales[bad - 1] / 2 and kept
    record["params_kept"] = kept
    _sync_runs(ctx, build, batches, record)


def _llama_reference(ctx: Ctx, seed: int, **model: Any) -> tuple[list[torch.Tensor], dict, dict]:
    """Random token batches from ``seed``, and the parameters torch trains from them on ``_llama(ctx, **model)``,
    twice (its own run-to-run difference)."""
    vocab, seq = (128, 16) if ctx.tiny else (512, 128)
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randint(vocab, (2 if ctx.tiny else 8, seq + 1), generator=g).to(ctx.device) for _ in range(STEPS)]

    def loss(m):
        return lambda b: F.cross_entropy(m(input_ids=b[:, :-1]).logits.flatten(0, 1).float(), b[:, 1:].flatten())

    runs = [_torch_train(m := _llama(ctx, **model), loss(m), batches)[0] for _ in range(2)]
    return batches, runs[0], runs[1]


def _quantize_lora(ctx: Ctx, record: dict):
    """quantize("nf4") of a peft LoRA Llama against the same model whose frozen weights are their NF4 round
    trip, trained by torch."""
    from zerofn.transforms import quantize

    batches, want, again = _llama_reference(ctx, 3, lora=True, nf4_of=torch.float32)

    def build():
        apply = zf.functional(_llama(ctx, lora=True))
        return apply, quantize(zf.train_step(_llama_loss_fn(apply), _adamw()), "nf4")

    _, step, state, got, _, _ = _zf_train(build, batches, watch=None, ctx=ctx, record=record)
    lora = {n: t for n, t in want.items() if "lora_" in n}
    _compare(record, got, lora, {n: again[n] for n in lora}, tol=1e-5, bitwise=False, why="the adapters")
    record["state_bytes"] = zf.memory.state_bytes(state)["by_placement"]
    _sync_runs(ctx, build, batches, record)


def _tensor_parallel_1(ctx: Ctx, record: dict):
    from zerofn.transforms import tensor_parallel

    batches, want, again = _llama_reference(ctx, 4)

    def build():
        apply = zf.functional(_llama(ctx))
        return apply, tensor_parallel(zf.train_step(_llama_loss_fn(apply), _adamw()), 1)

    _, _, _, got, _, _ = _zf_train(build, batches, watch=None, ctx=ctx, record=record)
    _compare(record, got, want, again, tol=0.0, bitwise=True)
    _sync_runs(ctx, build, batches, record)


def _context_parallel_1(ctx: Ctx, record: dict):
    """The long-context recipe at cp 1: context_parallel (the model's loss by chunks, the MLPs by tiles) with
    remat's checkpoints in pinned host memory, copied on a side stream; against torch on the whole logits."""
    from zerofn.transforms import context_parallel, remat

    batches, want, again = _llama_reference(ctx, 5)
    fed = [{"input_ids": b[:, :-1], "shift_labels": b[:, 1:]} for b in batches]

    def build():
        apply = zf.functional(_llama(ctx))
        step = zf.train_step(lambda params, batch: apply(params, **batch).loss, _adamw())
        return apply, context_parallel(remat(step, offload="cpu"), 1, mlp_tiles=2)

    _, _, _, got, _, _ = _zf_train(build, fed, watch=None, ctx=ctx, record=record)
    # The loss summed by chunks rounds a gradient unlike torch's whole-logits loss. AdamW's first update of an
    # element is lr * g / (|g| + eps): a rounding of d in a gradient near eps moves it by up to lr * d / eps. On
    # an AVX-512 CPU 2 of 90 K elements of the tiny Llama move by 1.13e-5 in the first step (1.1 % of lr), and
    # by no more in ten.
    why = "the loss summed by chunks of tokens, the MLPs by tiles; 2 % of lr"
    _compare(record, got, want, again, tol=2e-5, bitwise=False, why=why)
    _sync_runs(ctx, build, fed, record)


def _generate(ctx: Ctx, record: dict):
    """zf.generate under shard_params: the tokens of the model's own greedy generate."""
    from zerofn.transforms import shard_params

    model = _llama(ctx)
    model.eval()
    prompt = torch.randint(model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5)).to(ctx.device)
    want = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    apply = zf.functional(_llama(ctx).eval())
    step = shard_params(zf.train_step(_llama_loss_fn(apply), _adamw()))
    state = step.init(apply.params)
    got = zf.generate(step, state, prompt, max_new_tokens=12)
    record["expect"] = "the tokens of model.generate(do_sample=False)"
    record["tokens_equal"] = bool(torch.equal(got.cpu(), want.cpu()))
    record["correct"] = record["tokens_equal"]


def _compiled(ctx: Ctx, record: dict):
    """Each block compiled (inductor on CUDA, aot_eager on the CPU) under amp(shard_params): no graph
    break, within tolerance of the same composition in eager mode."""
    from torch._dynamo.utils import counters

    from zerofn.transforms import amp, shard_params

    cfg = ctx.gpt_config()
    batches = ctx.batches(cfg.vocab, cfg.seq_len)
    backend = "inductor" if ctx.cuda else "aot_eager"

    def build(compiled: bool):
        def make():
            model = _gpt(ctx)
            if compiled:
                for block in model.blocks:
                    block.compile(backend=backend)
            apply = zf.functional(model)
            return apply, amp(shard_params(zf.train_step(loss_fn_for(apply), _adamw())), torch.bfloat16)

        return make

    _, _, _, want, _, _ = _zf_train(build(False), batches, watch=None, ctx=ctx, record={})
    counters.clear()
    t0 = time.perf_counter()
    _, _, _, got, _, _ = _zf_train(build(True), batches, watch=None, ctx=ctx, record=record)
    record["compile_and_train_s"] = round(time.perf_counter() - t0, 1)
    breaks = sum(counters["graph_break"].values())
    worst, _, _ = _diff(got, want)
    record.update(backend=backend, graph_breaks=breaks, max_abs_diff=worst, tolerance=2e-2)
    record["expect"] = "no graph break; within 2e-2 of eager (bf16, fused kernels)"
    record["correct"] = breaks == 0 and worst <= 2e-2
    _sync_runs(ctx, build(True), batches, record)


def _compositions():
    from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

    def nvme(step, ctx):
        path = tempfile.mkdtemp(prefix="zf-gpu-nvme-")
        return offload(shard_params(step), "nvme", path=path, params="nvme")

    host = "the host Adam kernel rounds differently"
    return {
        "train_step": _gpt_case(lambda s, c: s),
        "shard_optimizer": _gpt_case(lambda s, c: shard_optimizer(s)),
        "shard_grads": _gpt_case(lambda s, c: shard_grads(s)),
        "shard_params": _gpt_case(lambda s, c: shard_params(s)),
        "remat": _gpt_case(lambda s, c: remat(shard_params(s))),
        "amp_bf16": _gpt_case(
            lambda s, c: amp(s, torch.bfloat16), tol=5e-2, why="bf16 weights against autocast", autocast=torch.bfloat16
        ),
        "amp_fp16_overflow": _fp16_overflow,
        "offload_cpu": _gpt_case(lambda s, c: offload(shard_grads(s), "cpu"), tol=2e-5, why=host),
        "offload_nvme_params": _gpt_case(nvme, tol=2e-5, why=host),
        "quantize_nf4_lora": _quantize_lora,
        "tensor_parallel_1": _tensor_parallel_1,
        "context_parallel_1": _context_parallel_1,
        "generate": _generate,
        "compile": _compiled,
    }


CASES = (
    "train_step",
    "shard_optimizer",
    "shard_grads",
    "shard_params",
    "remat",
    "amp_bf16",
    "amp_fp16_overflow",
    "offload_cpu",
    "offload_nvme_params",
    "quantize_nf4_lora",
    "tensor_parallel_1",
    "context_parallel_1",
    "generate",
    "compile",
)


def run_case(name: str, ctx: Ctx) -> dict:
    record: dict = {"case": name}
    t0 = time.perf_counter()
    try:
        _compositions()[name](ctx, record)
    except Exception as e:  # a failing case is a finding, reported, not the end of the run
        record["correct"] = False
        record["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        record["where"] = _zerofn_frames(e)
    record["seconds"] = round(time.perf_counter() - t0, 2)
    return record


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m zerofn.bench.gpu_checks")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", required=True, help="a JSON-lines file, one line appended per case")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    p.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU smoke form)")
    args = p.parse_args(argv)
    import torch.distributed as dist

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if "RANK" in os.environ and not dist.is_initialized():  # under torchrun: NCCL on CUDA, gloo on the CPU
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None
        )
    ctx = Ctx(device, args.tiny)
    for name in args.cases:
        record = run_case(name, ctx)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"check {name}: {'ok' if record.get('correct') else 'FAILED'} ({record['seconds']} s)", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
