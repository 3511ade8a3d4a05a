"""Text output of ``python -m zerofn plan``: the table and its verdicts (:func:`plan_text`), and the
planner's units (:func:`fmt_bytes`, :func:`format_count`)."""

from __future__ import annotations

from zerofn.placement import format_bytes
from zerofn.plan.estimates import Estimate

__all__ = ["fmt_bytes", "format_count", "plan_text"]


def fmt_bytes(n: float) -> str:
    """Bytes in decimal units, as GPU makers count them: ``1.12 TB``, ``140.0 GB``, ``512.0 MB``
    (:func:`zerofn.placement.format_bytes`)."""
    return format_bytes(n)


def format_count(n: float) -> str:
    """A parameter count for a reader: ``70B``, ``124M``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


_PROJECTIONS = {7: "q, k, v, o, gate, up and down", 6: "q, k, v, o, up and down"}


def _lora_lines(e: Estimate) -> list[str]:
    """What LoRA trains and what its frozen base holds, for :func:`plan_text`."""
    lora = e.lora
    k = e.optimizer_per_param
    pb = lora.dtype.itemsize
    where = f"the {_PROJECTIONS.get(len(lora.linears), 'linear')} projections of {lora.layers} blocks"
    lines = [
        f"trainable: {format_count(lora.trainable)} LoRA parameters (rank {lora.rank} on {where}) at {pb} + {pb} + "
        f"{k} bytes per parameter (parameters + gradients + optimizer state) = "
        f"{fmt_bytes((2 * pb + k) * lora.trainable)} in all"
    ]
    dtype = str(lora.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
    base = fmt_bytes(lora.base_bytes())
    if lora.quantize:
        lines.append(
            f"frozen base: {format_count(lora.frozen)} parameters, no gradients or optimizer state; the projections' "
            f"{format_count(lora.quantized)} in {lora.quantize.upper()} at {lora.bytes_per_quantized():.4f} bytes per "
            f"parameter (codes and scales), the rest (embeddings, head, norms) in {dtype}: {base}, on every GPU "
            "under DDP, its shard under ZeRO-3, which gathers it per unit at that size; each projection's weight is "
            f"dequantized to {dtype} for its call, forward and again in backward: {fmt_bytes(e.dequant)} for the "
            "largest (the 'dequant' column)"
        )
    else:
        lines.append(
            f"frozen base: {format_count(lora.frozen)} parameters in {dtype}, no gradients or optimizer state: {base}, "
            "on every GPU under DDP, its shard under ZeRO-3"
        )
    return lines


def _tensor_lines(e: Estimate) -> list[str]:
    """What one GPU holds of a split model and what its tensor-parallel group sends, for :func:`plan_text`."""
    t = e.tensor_parallel
    act = 2 if e.mixed_precision else 4
    staged = e.pipeline_parallel is not None
    held = (
        f"{format_count(t.local)} parameters per GPU of the whole pipeline, cut into its stages below"
        if staged
        else f"{format_count(t.local)} parameters per GPU, which the ZeRO stages below shard over the {t.data} "
        "data-parallel rank(s)"
    )
    lines = [
        f"tensor parallelism over {t.size} GPUs x {t.data} data-parallel ranks: each GPU holds 1/{t.size} of every "
        f"block's projections{' and of the embedding and head, over the vocabulary' if t.vocab_split else ''} "
        f"({format_count(t.split)} parameters in all) and the rest whole "
        f"({'norms' if t.vocab_split else 'embeddings, head, norms'}: {format_count(t.replicated)}): {held}"
    ]
    if t.allreduce:
        lines.append(
            f"tensor-parallel traffic per micro-batch: 4 all-reduces a block (2 in forward, 2 in backward; 6 under "
            f"remat, which recomputes the forward){' and 2 for the vocabulary' if t.vocab_split else ''} of "
            f"micro-batch x seq x hidden x {act} bytes = {fmt_bytes(t.allreduce)} each: "
            f"{fmt_bytes(t.traffic(remat=False))} over {t.layers} blocks{f' of stage {e.pipeline_parallel.stage}' if staged else ''} ({fmt_bytes(t.traffic(remat=True))} under "
            f"remat), on each node's links (a ring all-reduce sends 2 x {t.size - 1}/{t.size} of it from each GPU)"
        )
    else:
        lines.append("tensor-parallel traffic not counted: pass --seq and --micro-batch")
    return lines


def _context_lines(rows: list[Estimate]) -> list[str]:
    """What each GPU computes of a sequence cut over a context-parallel group, the long-context recipe's terms
    and what the group sends, for :func:`plan_text`."""
    e = rows[0]
    c = e.context_parallel
    tokens = f" ({c.tokens:,} tokens of each micro-batch)" if c.tokens else ""
    lines = [
        f"context parallelism over {c.size} GPUs ({c.method}) x {c.data} data-parallel rank(s): each GPU computes "
        f"1/{c.size} of every micro-batch's sequence{tokens}, from the embedding to the loss; the parameters are "
        f"whole on each, and the ZeRO stages below shard over the {c.group} GPUs of dp x cp"
        + (" x tp" if e.tensor_parallel else "")
        + " (the state is as without --cp)"
    ]
    offloaded = next((r for r in rows if r.remat_host), None)
    if offloaded is not None:
        lines.append(
            f"remat with its inputs on the CPU (remat(..., offload='cpu')): each block's kept input waits in CPU "
            f"RAM, {fmt_bytes(offloaded.remat_host)} per GPU ({fmt_bytes(offloaded.remat_host * e.gpus_per_node)} "
            "per node, in the CPU/node column of the remat rows), the GPU holding the one being recomputed"
        )
    if not c.exchange:
        lines.append("context-parallel traffic not counted: pass --seq and the shapes (--model)")
    elif c.method == "ulysses":
        lines.append(
            f"context-parallel traffic per micro-batch: Ulysses' 4 all-to-alls a layer per direction (q, k, v and the "
            f"output, this GPU's tokens of each) of {fmt_bytes(c.exchange)}: {fmt_bytes(c.traffic(remat=False))} over "
            f"{c.layers} layers, forward and backward ({fmt_bytes(c.traffic(remat=True))} under remat, which "
            "recomputes the forward)"
        )
    else:
        lines.append(
            f"context-parallel traffic per micro-batch: ring attention's {c.size - 1} key/value blocks a layer per "
            f"direction ({fmt_bytes(c.exchange)}) and in backward {c.size} trips of the fp32 dk/dv accumulator "
            f"({fmt_bytes(c.accumulator)}): {fmt_bytes(c.traffic(remat=False))} over {c.layers} layers "
            f"({fmt_bytes(c.traffic(remat=True))} under remat, which recomputes the forward)"
        )
    return lines


def _expert_lines(e: Estimate) -> list[str]:
    """What one GPU holds of a model whose experts are cut over an expert-parallel group, over which groups the
    ZeRO stages shard it, and what the group sends, for :func:`plan_text`."""
    x = e.expert_parallel
    act = 2 if e.mixed_precision else 4
    lines = [
        f"expert parallelism over {x.size} GPUs: each holds {x.local_experts} of the {x.experts} routed experts of "
        f"each of the {x.moe_layers} mixture-of-experts blocks ({format_count(x.expert_params)} expert parameters "
        f"in all, {format_count(x.local_expert_params)} per GPU) and the rest whole (attention, routers, shared "
        f"experts, embeddings, norms: {format_count(x.replicated)}): {format_count(x.local)} parameters per GPU; "
        f"every GPU feeds its own micro-batch ({x.data} in flight); the ZeRO stages below shard the experts over "
        f"the {x.expert_group} GPU(s) holding the same ones and the rest over the {x.group} GPU(s), each part's "
        "gradients reduced on its own group"
    ]
    if x.exchange:
        lines.append(
            f"expert-parallel traffic per micro-batch: 4 all-to-alls a mixture-of-experts block (dispatch and "
            f"combine, in forward and in backward; 6 under remat, which recomputes the forward) of this GPU's routed "
            f"rows, {x.tokens:,} tokens x top-{x.top_k} x hidden x {act} bytes = {fmt_bytes(x.exchange)} each (its "
            f"own rows included; no capacity factor, no token dropped): {fmt_bytes(x.traffic(remat=False))} over "
            f"{x.moe_layers} blocks ({fmt_bytes(x.traffic(remat=True))} under remat); the row counts exchanged "
            "before each are not counted"
        )
    else:
        lines.append("expert-parallel traffic not counted: pass --seq and --micro-batch")
    return lines


def _by_stage(values: tuple, fmt=str) -> str:
    """``stage 0: a, stages 1-2: b, stage 3: c``: per-stage values, runs of equal ones together."""
    runs: list[list] = []
    for i, x in enumerate(values):
        if runs and runs[-1][2] == x:
            runs[-1][1] = i
        else:
            runs.append([i, i, x])
    return ", ".join(f"stage {a}: {fmt(x)}" if a == b else f"stages {a}-{b}: {fmt(x)}" for a, b, x in runs)


def _pipeline_lines(rows: list[Estimate]) -> list[str]:
    """How the stages cut the model, what each holds and keeps in flight, the bubble and what the stages send each
    other, for :func:`plan_text`."""
    e = rows[0]
    pl = e.pipeline_parallel
    p, v, m = pl.size, pl.virtual, pl.microbatches
    sizes = sorted(set(pl.chunks), reverse=True)
    cut = (
        f"{sizes[0]} blocks each"
        if len(sizes) == 1
        else f"{sizes[0]} or {sizes[1]} blocks (the first {pl.chunks.count(sizes[0])} one more)"
    )
    chunks = f", {v} model chunks a GPU (chunk c on stage c mod {p})" if v > 1 else ""
    lines = [
        f"pipeline parallelism over {p} stages ({pl.name}, {m} micro-batches a step{chunks}) x {pl.data} "
        f"data-parallel rank(s): the {pl.layers} blocks cut into {p * v} chunks of {cut}; stage 0 holds the input "
        f"embedding (and a head tied to it), stage {p - 1} the final norm and an untied head: parameters per GPU "
        f"{_by_stage(pl.stage_params, format_count)}; the ZeRO stages below shard each stage's over its {pl.group} "
        f"GPU(s){' (dp x cp)' if e.context_parallel is not None else ''}, and each row is the stage whose bytes per "
        "GPU are the largest (the 'stage' column): what must fit"
    ]
    rows_mb = f" of {pl.micro_batch} sequence(s) (a step takes {pl.micro_batch * m} a data-parallel rank)"
    rows_mb = rows_mb if pl.micro_batch else ""
    held = _by_stage(pl.in_flight)
    if pl.schedule == "1f1b":
        lines.append(
            f"activations: 1F1B keeps min(p - i, m) micro-batches{rows_mb} in flight on stage i, of its own blocks "
            f"only (p - i forwards before its first backward, then one backward a forward): {held}"
        )
    else:
        factor = "2 (p - 1 - i)" if pl.schedule == "interleaved" else "(p - 1 - i)"
        line = (
            f"activations: {pl.name} keeps min((v - 1) r + {factor} + 1, v m) micro-batches{rows_mb} of one chunk "
            f"(L / (p v) blocks) in flight on stage i, r = {pl.per_round} micro-batches a round (torch's): {held}"
        )
        if pl.schedule == "interleaved":
            line += (
                f"; on stage 0 {pl.in_flight[0]} = (1 + (p - 1) / (p v)) x p micro-batches of a stage's blocks when r "
                "= p (Narayanan et al. 2021, Megatron-LM's interleaved schedule)"
            )
        else:
            line += (
                "; with one chunk a GPU as many as 1F1B keeps. Each stage's weight gradients (W) run i micro-batches "
                "after their input gradients (B), so stage i also keeps W's inputs (each Linear's input and its "
                f"output's gradient) of up to i micro-batches: {_by_stage(pl.waiting)}"
            )
        lines.append(line)
    scale = {"1f1b": "", "interleaved": f"{v} x ", "zero_bubble": f"3 x {v} x "}[pl.schedule]
    den = {"1f1b": 1, "interleaved": v, "zero_bubble": 3 * v}[pl.schedule] * m + p - 1
    note = {
        "1f1b": "",
        "interleaved": "; the chunks shrink 1F1B's bubble by v",
        "zero_bubble": " (an approximation of ZB-H1's, about a third of 1F1B's: Qi et al. 2023)",
    }[pl.schedule]
    lines.append(
        f"bubble: {pl.bubble_formula} = {p - 1} / ({scale}{m} + {p - 1}) = {p - 1} / {den} = {pl.bubble:.1%} of a "
        f"step idle{note}"
    )
    if pl.send:
        act = 2 if e.mixed_precision else 4
        most = max(range(p), key=lambda i: pl.sends[i])
        lines.append(
            f"pipeline traffic: each micro-batch's output, micro-batch x seq{' / cp' if e.context_parallel else ''} x "
            f"hidden x {act} bytes = {fmt_bytes(pl.send)}, goes to the next chunk's stage and its gradient comes back, "
            f"across each of the {pl.hops} chunk boundaries: a GPU of stage {most} sends {pl.sends[most]} a "
            f"micro-batch, {fmt_bytes(pl.traffic(most))} a step, and receives as many"
        )
    else:
        lines.append("pipeline traffic not counted: pass --seq and --micro-batch")
    return lines


def _recommend(rows: list[Estimate], gpu: float, cpu: float | None, nvme: float | None) -> Estimate | None:
    return next((e for e in rows if e.fits(gpu, cpu, nvme)), None)


def plan_text(rows: list[Estimate], *, gpu: float, cpu: float | None, nvme: float | None, psi: int, title: str) -> str:
    """The table and verdicts :func:`main` prints."""
    lines = [title]
    e0 = rows[0]
    lora = e0.lora
    if e0.inference:
        lines.append(f"weights: 2 bytes x {format_count(psi)} = {fmt_bytes(2 * psi)}")
    elif lora is not None:
        lines += _lora_lines(e0)
        psi = lora.trainable  # the lines below are about what trains
    elif e0.tensor_parallel is not None or e0.expert_parallel is not None or e0.pipeline_parallel is not None:
        if e0.tensor_parallel is not None:
            lines += _tensor_lines(e0)
            psi = e0.tensor_parallel.local  # the lines below are about what one GPU holds
        if e0.expert_parallel is not None:
            lines += _expert_lines(e0)
            psi = e0.expert_parallel.local
        if e0.pipeline_parallel is not None:
            lines += _pipeline_lines(rows)
            psi = max(e0.pipeline_parallel.stage_params)  # what one GPU of the stage holding the most holds
        k = e0.optimizer_per_param
        pb = 2 if e0.mixed_precision else 4
        lines.append(
            f"model state: {pb} + {pb} + {k} bytes per parameter (parameters + gradients + optimizer state) "
            f"= {fmt_bytes((2 * pb + k) * psi)} per GPU{' of the stage holding the most' if e0.pipeline_parallel else ''}"
            " under DDP"
        )
    else:
        k = e0.optimizer_per_param
        pb = 2 if e0.mixed_precision else 4
        lines.append(
            f"model state: {pb} + {pb} + {k} bytes per parameter (parameters + gradients + optimizer state) "
            f"= {fmt_bytes((2 * pb + k) * psi)} in all, on every GPU under DDP"
        )
    if e0.context_parallel is not None:
        lines += _context_lines(rows)
    show_acts = any(e.activations for e in rows)
    show_dequant = any(e.dequant for e in rows)
    staged = e0.pipeline_parallel is not None
    head = ["composition"] + (["stage"] if staged else []) + ["params"] + (["frozen"] if lora else [])
    head += ["grads", "optimizer"]
    head += ["activations"] if show_acts else []
    head += ["gathered"] + (["dequant"] if show_dequant else [])
    head += ["update", "model state", "per GPU", "CPU/node", "NVMe/node", "fits"]
    table = []
    for e in rows:
        short = e.short(gpu, cpu, nvme)
        verdict = "yes" if not short else "no: " + ", ".join(short)
        unchecked = [w for w, lim, need in (("CPU", cpu, e.cpu), ("NVMe", nvme, e.nvme)) if lim is None and need]
        if not short and unchecked:
            verdict += f" ({', '.join(unchecked)} not checked)"
        b = lambda n: fmt_bytes(n) if n else "-"  # noqa: E731
        cells = [e.label] + ([str(e.pipeline_parallel.stage)] if staged else []) + [b(e.params)]
        cells += ([b(e.frozen)] if lora else []) + [b(e.grads), b(e.optimizer)]
        cells += [b(e.activations)] if show_acts else []
        cells += [b(e.gathered)] + ([b(e.dequant)] if show_dequant else [])
        cells += [b(e.update), b(e.model_state), b(e.total), b(e.cpu_per_node), b(e.nvme_per_node)]
        cells.append(verdict)
        table.append(cells)
    widths = [max(len(r[i]) for r in [head] + table) for i in range(len(head))]

    def fmt_row(r: list[str]) -> str:  # names and verdicts left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    lines += ["", fmt_row(head)] + [fmt_row(r) for r in table] + [""]
    best = _recommend(rows, gpu, cpu, nvme)
    if best is None:
        lines.append(
            f"recommendation: nothing fits in {fmt_bytes(gpu)} per GPU on {e0.world_size} GPU(s): add GPUs, "
            "shorten sequences or micro-batches, or use bigger GPUs"
        )
    else:
        where = f"{fmt_bytes(best.total)} per GPU"
        if best.cpu:
            where += f", {fmt_bytes(best.cpu_per_node)} CPU RAM per node"
        if best.nvme:
            where += f", {fmt_bytes(best.nvme_per_node)} NVMe per node"
        lines.append(f"recommendation: {best.label} ({where})")
    # The model-state verdict: the ZeRO table alone, whatever write-ups say about it.
    state_fit = next((e for e in rows if e.model_state <= gpu and not e.short(None, cpu, nvme)), None)
    if not e0.inference:
        ddp = next(e for e in rows if e.stage == 0 and not e.optimizer_offload)
        z3 = next(e for e in rows if e.stage == 3 and not e.optimizer_offload)
        lines.append(
            f"model state per GPU (the ZeRO table: parameters + gradients + optimizer state"
            f"{', and the frozen base' if lora else ''}, no activations or transients): "
            f"DDP {fmt_bytes(ddp.model_state)}, ZeRO-3 {fmt_bytes(z3.model_state)}, which "
            f"{'fits' if z3.model_state <= gpu else 'does not fit'} in {fmt_bytes(gpu)}; "
            + (
                f"first to fit: {state_fit.label} ({fmt_bytes(state_fit.model_state)})"
                if state_fit
                else "no composition's model state fits"
            )
        )
        host = next(e for e in rows if e.optimizer_offload == "cpu" and e.stage == 3 and not e.param_offload)
        k = e0.optimizer_per_param
        pb = 2 if e0.mixed_precision else 4
        split = e0.tensor_parallel or e0.expert_parallel or e0.pipeline_parallel
        whose = "the adapters" if lora else "every GPU's share" if split else "the whole model"
        lines.append(
            f"optimizer state in CPU RAM: zerofn holds {pb + 4 + k} bytes per {'trainable ' if lora else ''}parameter "
            f"on the host ({k} optimizer state + 4 fp32 gradient buffer + {pb} parameter copy), "
            f"{fmt_bytes(host.cpu_per_node * host.world_size / host.gpus_per_node)} for "
            f"{whose} over all nodes; ZeRO-Offload write-ups count {k} ({fmt_bytes(k * psi)}{' per GPU' if split else ''})"
        )
        if e0.mixed_precision:
            lines.append(
                "the update casts each rank's gradient partition to fp32 on the GPU (4 bytes per parameter / N beside "
                "the 2-byte partition): the 'update' column, which offloading the optimizer state does not remove"
            )
    if not show_acts:
        lines.append(
            "activations not counted: pass --layers, --hidden, --seq and --micro-batch (or --model with --seq "
            "and --micro-batch)"
        )
    if any(e.stage == 3 for e in rows) and not any(e.gathered for e in rows):
        on_nvme = any(e.param_offload == "nvme" for e in rows)
        lines.append(
            "ZeRO-3's gathered blocks not counted: pass --layers (or --model)"
            + ("; with the parameters on NVMe, RAM counts every shard as read ahead at once" if on_nvme else "")
        )
    if lora is not None and any(e.param_offload for e in rows):
        lines.append(
            "with ZeRO-3's parameters in CPU RAM or on NVMe, the frozen base's shards rest there too and are copied "
            "in per unit before its gather (the CPU/node and NVMe/node columns count them)"
        )
    lines.append("leave headroom for the CUDA context, the allocator's fragmentation and communication buffers")
    return "\n".join(lines)
