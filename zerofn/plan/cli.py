"""``python -m zerofn plan``: the command line (:func:`main`) and its parsers of sizes and counts."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

from zerofn import optim as O
from zerofn.plan.calibrate import DEFAULT_RANKS, DEFAULT_REPEATS, DEFAULT_SIZES, calibrate, write_hardware
from zerofn.plan.context import METHODS, layout_unit
from zerofn.plan.estimates import compositions, longest_sequence
from zerofn.plan.hardware import PRESETS, load_hardware
from zerofn.plan.pipeline import SCHEDULES, bubble_formula
from zerofn.plan.plotting import plot
from zerofn.plan.shapes import ModelShape, model_shape, shape_from_dims
from zerofn.plan.speed import EFFICIENCY, speeds
from zerofn.plan.speed_text import calibration_text, speed_text
from zerofn.plan.text import fmt_bytes, format_count, plan_text

__all__ = ["fmt_size", "main", "parse_count", "parse_seq", "parse_size"]

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "PB": 10**15,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_COUNT_UNITS = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def _parse(text: str, units: dict, what: str) -> float:
    t = text.strip().upper().replace("_", "")
    i = len(t)
    while i > 0 and t[i - 1].isalpha():
        i -= 1
    num, unit = t[:i], t[i:]
    try:
        value = float(num) * units[unit]
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {what}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive {what}")
    return value


def parse_size(text: str) -> float:
    """Bytes from ``80GB``, ``1.5TB``, ``512GiB`` or ``5e9`` (decimal and binary units); raises
    ``argparse.ArgumentTypeError`` for anything else, or a size that is not positive.

    Example:
        >>> from zerofn.plan import parse_size
        >>> parse_size("80GB"), parse_size("512MiB")
        (80000000000.0, 536870912.0)
    """
    return _parse(text, _SIZE_UNITS, "a size such as 80GB, 1TB or 512GiB")


def parse_count(text: str) -> float:
    """A parameter count from ``70e9``, ``70B`` or ``124M``; raises ``argparse.ArgumentTypeError`` for
    anything else, or a count that is not positive."""
    return _parse(text, _COUNT_UNITS, "a parameter count such as 70e9, 70B or 124M")


def parse_seq(text: str) -> int | str:
    """A sequence length (``4096``, ``32k``, ``1M``: tokens) or ``max`` (the longest that fits); raises
    ``argparse.ArgumentTypeError`` for anything else."""
    if text.strip().lower() == "max":
        return "max"
    try:
        value = _parse(text, _COUNT_UNITS, "a sequence length such as 4096, 32k or max")
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a sequence length in tokens (4096, 32k) or max") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of tokens")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zerofn plan",
        description="Bytes per GPU, CPU RAM and NVMe per node for DDP and ZeRO-1, 2, 3 with the optimizer state "
        "(and ZeRO-3's parameters) on the GPU, in CPU RAM or on NVMe, with and without remat; what fits, and "
        "the composition to use.",
    )
    p.add_argument(
        "--params",
        type=parse_count,
        help="trainable parameters (70e9, 70B, 124M); absent, counted from the shapes (--layers, --hidden, --vocab)",
    )
    p.add_argument("--model", metavar="CONFIG", help="a Hugging Face config.json or its directory: size and shapes")
    p.add_argument(
        "--gpus",
        "--gpus-per-node",
        dest="gpus",
        type=int,
        default=None,
        help="GPUs per node (default 1, or the --hardware's GPUs per node)",
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument(
        "--gpu-memory",
        type=parse_size,
        default=None,
        help="memory of one GPU (80GB, 24GB); required unless --hardware gives it",
    )
    p.add_argument("--cpu-memory", type=parse_size, default=None, help="CPU RAM per node (not checked if absent)")
    p.add_argument("--nvme", type=parse_size, default=None, help="NVMe space per node (not checked if absent)")
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--hidden", type=int, help="hidden size")
    p.add_argument("--heads", type=int, help="attention heads (default hidden / 64)")
    p.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention; default --heads)")
    p.add_argument("--ffn", type=int, help="MLP width (default 4 x hidden)")
    p.add_argument(
        "--gated",
        action="store_true",
        help="a gated MLP (SwiGLU: gate, up and down projections, Llama-style, RMSNorm and no biases); default "
        "GPT's two matrices",
    )
    p.add_argument("--vocab", type=int, help="vocabulary (the embeddings and head; the logits' activations)")
    p.add_argument(
        "--seq",
        "--seq-len",
        dest="seq",
        type=parse_seq,
        metavar="S",
        help="sequence length in tokens (4096, 32k), or max: the longest that fits, searched over multiples of "
        "the context-parallel layout unit (cp for Ulysses, 2 cp for ring); --micro-batch then defaults to 1",
    )
    p.add_argument(
        "--micro-batch",
        type=int,
        help="sequences per GPU per micro-step (with --tp or --cp: per data-parallel rank, the GPUs of a group "
        "feeding the same; with --pp: of one pipeline micro-batch, a step taking --micro-batch x --microbatches)",
    )
    p.add_argument("--inference", action="store_true", help="weights only, 2 bytes per parameter (fp16/bf16)")
    p.add_argument("--fp32", action="store_true", help="full precision training (4 + 4 + 8 bytes per parameter)")
    p.add_argument(
        "--bf16-moments",
        action="store_true",
        help="Adam's moments in bf16 (zf.optim.adamw(..., mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)): "
        "4 bytes of optimizer state per parameter instead of 8",
    )
    p.add_argument(
        "--bf16-masters",
        action="store_true",
        help="no fp32 master weights: the optimizer updates the bf16 parameters (amp(..., "
        "master_dtype=torch.bfloat16), DeepSpeed's bf16_master_weights_and_grads): 4 bytes of optimizer state "
        "per parameter less, and no fp32 gradient copy in the update",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        metavar="R",
        help="LoRA adapters of rank R on every linear projection of every block (q, k, v, o, gate, up, down for "
        "Llama-shaped models), r x (in + out) trainable parameters each; the base frozen (no gradients, no "
        "optimizer state). Needs the shapes: --model, or --layers and --hidden",
    )
    p.add_argument(
        "--quantize",
        choices=("nf4", "int8"),
        help="hold the frozen base's projection weights quantized, as zerofn.transforms.quantize(step, KIND) does "
        "(QLoRA: nf4, 0.516 bytes per parameter with its scales; int8: 1.0625); needs --lora-rank",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor parallelism over N consecutive GPUs (zerofn.transforms.tensor_parallel(step, N)): each holds "
        "1/N of every block's q, k, v, o, gate, up and down, the rest whole; the ZeRO stages shard over the "
        "GPUs / N data-parallel ranks. N divides --gpus and the heads; needs the shapes (--model, or --layers and "
        "--hidden); --micro-batch is then per data-parallel rank",
    )
    p.add_argument(
        "--cp",
        type=int,
        metavar="N",
        help="context parallelism over N GPUs (zerofn.transforms.context_parallel(step, N)): each computes 1/N of "
        "every micro-batch's sequence, from the embedding to the loss; parameters whole, the ZeRO stages shard "
        "over the GPUs / tp ranks as without it. N divides GPUs x nodes / tp. Implies the long-context recipe: "
        "--chunked-loss and --remat-offload",
    )
    p.add_argument(
        "--cp-method",
        choices=METHODS,
        default=None,
        help="how attention meets the whole sequence under --cp: ulysses (default; all-to-alls to head slices, the "
        "query heads a multiple of N) or ring (key/value blocks around the ring, any heads)",
    )
    p.add_argument(
        "--ep",
        type=int,
        metavar="N",
        help="expert parallelism over N GPUs (zerofn.transforms.expert_parallel(step, N)), for a mixture-of-experts "
        "--model (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, GPT-OSS): each holds 1/N of every mixture-of-experts "
        "block's routed experts whole and the rest whole, and feeds its own micro-batch; the ZeRO stages shard the "
        "experts over the GPUs holding the same ones (GPUs / (tp x N)) and the rest over GPUs / tp. N divides the "
        "experts of a block and GPUs x nodes / (tp x cp); the routed tokens' all-to-alls are counted with --seq "
        "and --micro-batch",
    )
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        metavar="N",
        help="pipeline parallelism over N stages (zerofn.transforms.pipeline_parallel(step, N, microbatches=M)), the "
        "outermost axis of the mesh (pp x dp x cp x tp): each stage holds 1/N of the blocks (the first the "
        "embeddings, the last the final norm and head), the ZeRO stages shard it over its GPUs x nodes / (N x tp) "
        "GPUs, and it holds the activations of the micro-batches its schedule keeps in flight; the table is the "
        "largest stage's. N divides GPUs x nodes / (tp x cp); needs --microbatches and the layer count (--model "
        "or --layers); --micro-batch is then the sequences of one pipeline micro-batch",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        metavar="M",
        help="the micro-batches a step pipelines under --pp (a step takes --micro-batch x M sequences a data-parallel "
        "rank): at least N for 1f1b; the bubble, (p - 1) / (m + p - 1) for 1F1B, shrinks as M grows",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="the pipeline schedule under --pp: 1f1b (default; torch's Schedule1F1B), interleaved "
        "(ScheduleInterleaved1F1B, --virtual-stages V >= 2 chunks a GPU) or zero_bubble "
        "(ScheduleInterleavedZeroBubble, ZB-H1)",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="model chunks per GPU under --pp (interleaved: 2 or more; the bubble shrinks by V, the activations in "
        "flight grow by (1 + (N - 1) / (N V)) over 1F1B's)",
    )
    p.add_argument(
        "--chunked-loss",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the loss by zf.losses.chunked_cross_entropy (context_parallel's own for Llama, Mistral, Qwen): one "
        "chunk of about 64 MiB of fp32 logits at a time, not tokens x vocabulary (default: on with --cp)",
    )
    p.add_argument(
        "--remat-offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the remat rows hold each block's kept input in CPU RAM (remat(step, offload='cpu')), counted in "
        "CPU/node and against --cpu-memory, the GPU holding one block's (default: on with --cp)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="draw bytes per GPU by composition against the GPU memory")
    speed = p.add_argument_group(
        "speed",
        "how fast each composition that fits runs (docs/planning.md, Speed): needs --hardware, the "
        "shapes (--model, or --layers and --hidden), --seq and --micro-batch",
    )
    speed.add_argument(
        "--hardware",
        metavar="NAME|FILE.json",
        help=f"predict the step time, tokens/s and MFU on this hardware: a preset ({', '.join(PRESETS)}) or a "
        "hardware JSON file (tflops, hbm_bytes, hbm_gbps, intra_node_gbps, inter_node_gbps, gpus_per_node); its "
        "memory and GPUs per node are the defaults of --gpu-memory and --gpus",
    )
    speed.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help=f"the fraction of the dense bf16 peak the step's compute achieves (default {EFFICIENCY})",
    )
    speed.add_argument(
        "--calibrate",
        metavar="FILE.json",
        help="measure this machine's collectives on local gloo ranks (all-gather, reduce-scatter, all-reduce, "
        "all-to-all of a few sizes), fit a bandwidth and a latency to each and write them as a hardware file for "
        "--hardware; nothing else is planned",
    )
    speed.add_argument(
        "--calibrate-ranks", type=int, default=DEFAULT_RANKS, help=f"ranks --calibrate runs (default {DEFAULT_RANKS})"
    )
    speed.add_argument(
        "--calibrate-sizes",
        default=",".join(fmt_size(s) for s in DEFAULT_SIZES),
        metavar="SIZES",
        help="the full tensors' sizes --calibrate times, comma-separated (default "
        f"{','.join(fmt_size(s) for s in DEFAULT_SIZES)})",
    )
    speed.add_argument(
        "--calibrate-repeats",
        type=int,
        default=DEFAULT_REPEATS,
        help=f"timed runs per kind and size (their median counts; default {DEFAULT_REPEATS})",
    )
    return p


def fmt_size(n: int) -> str:
    """``65536`` as ``64KiB``, ``16777216`` as ``16MiB``: a size :func:`parse_size` reads back exactly."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def _calibrate(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--calibrate FILE.json``: measure, fit, write and say so."""
    out = args.calibrate
    where = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        p.error(f"--calibrate {out} is a directory; pass the name of the hardware JSON file to write")
    if not os.path.isdir(where):
        p.error(f"--calibrate {out}: the directory it goes in, {where}, does not exist; create it (mkdir -p {where})")
    if args.calibrate_ranks < 2:
        p.error(f"--calibrate-ranks {args.calibrate_ranks}: a collective needs at least 2 ranks")
    if args.calibrate_repeats < 1:
        p.error(f"--calibrate-repeats {args.calibrate_repeats}: time each collective at least once")
    try:
        sizes = [int(parse_size(x)) for x in args.calibrate_sizes.split(",") if x.strip()]
    except argparse.ArgumentTypeError as e:
        p.error(f"--calibrate-sizes: {e}")
    if not sizes:
        p.error("--calibrate-sizes: give at least one size, such as 1MiB,4MiB,16MiB")
    too_small = [x for x in sizes if x < 4 * args.calibrate_ranks]
    if too_small:
        p.error(
            f"--calibrate-sizes: {too_small[0]} bytes is less than one fp32 element a rank over "
            f"{args.calibrate_ranks} ranks ({4 * args.calibrate_ranks} bytes)"
        )
    print(
        f"calibrating: {args.calibrate_ranks} gloo ranks on this machine's CPU, all-gather, reduce-scatter, "
        f"all-reduce and all-to-all of {', '.join(fmt_bytes(x) for x in sizes)}, {args.calibrate_repeats} runs each",
        flush=True,
    )
    hw, record = calibrate(ranks=args.calibrate_ranks, sizes=sizes, repeats=args.calibrate_repeats)
    write_hardware(hw, out, record)
    print(calibration_text(hw, record))
    print(f"written to {out}; plan with it: python -m zerofn plan ... --hardware {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m zerofn plan ...``: print the table and the recommendation; returns the exit status."""
    p = _parser()
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.calibrate is not None:
        return _calibrate(p, args)
    shaped = bool(args.layers and args.hidden)
    hardware = None
    if args.hardware is not None:
        if args.hardware.strip().lower() not in PRESETS and not os.path.isfile(args.hardware):
            p.error(
                f"--hardware {args.hardware}: neither a preset ({', '.join(PRESETS)}) nor a file; pass a preset or a "
                "hardware JSON file (python -m zerofn plan --calibrate FILE.json writes one for this machine)"
            )
        try:
            hardware = load_hardware(args.hardware)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        _check_speed(p, args, shaped)
    elif args.efficiency is not None:
        p.error(f"--efficiency {args.efficiency} scales the compute of a predicted step; pass --hardware too")
    if args.gpus is None:
        args.gpus = hardware.gpus_per_node if hardware is not None else 1
    if args.gpu_memory is None:
        if hardware is None:
            p.error("the following arguments are required: --gpu-memory (or --hardware, whose memory it takes)")
        args.gpu_memory = hardware.hbm_bytes
    if args.params is not None and args.model is not None:
        p.error("give either --params or --model, not both")
    if args.params is None and args.model is None:
        if not shaped:
            p.error(
                "give either --params or --model, or the shapes to count the parameters from (--layers, --hidden, --vocab)"
            )
        if args.vocab is None:
            p.error(
                "--layers and --hidden without --params: the parameters are counted from the shapes, which needs "
                "--vocab (the embeddings and head); pass --vocab, or --params"
            )
    if args.gpus < 1 or args.nodes < 1:
        p.error("--gpus and --nodes must be at least 1")
    if args.fp32 and args.inference:
        p.error("--inference counts 2-byte weights; --fp32 is for training")
    if args.bf16_moments and args.inference:
        p.error("--inference holds no optimizer state; --bf16-moments is for training")
    if args.bf16_masters and (args.fp32 or args.inference):
        p.error(
            f"--bf16-masters drops the fp32 master copy of mixed-precision training; --{'fp32' if args.fp32 else 'inference'} "
            "has none: leave one of the two out"
        )
    if args.quantize and args.lora_rank is None:
        p.error(
            f"--quantize {args.quantize} holds the model's frozen Linear weights quantized, and without LoRA adapters "
            "every Linear is trainable: nothing would be frozen to quantize. Pass --lora-rank R (QLoRA: "
            f"--lora-rank 16 --quantize {args.quantize}), or leave --quantize out to plan full training"
        )
    if args.lora_rank is not None and args.lora_rank < 1:
        p.error(f"--lora-rank {args.lora_rank}: the adapters' rank must be at least 1 (16 and 64 are common)")
    if args.lora_rank is not None and args.inference:
        p.error(
            "--lora-rank plans training (adapters with gradients and optimizer state); --inference counts weights only"
        )
    if args.lora_rank is not None and args.model is None and not (args.layers and args.hidden):
        p.error(
            "--lora-rank puts adapters on every block's projections, whose shapes it needs: pass --model "
            "config.json, or --layers and --hidden (with --heads and --ffn where they differ from GPT's)"
        )
    if args.cp is not None and args.cp < 1:
        p.error(
            f"--cp {args.cp}: the GPUs per context-parallel group must be at least 1 (1: no split, the recipe alone)"
        )
    if args.ep is not None and args.ep < 1:
        p.error(
            f"--ep {args.ep}: the GPUs per expert-parallel group must be at least 1 (1: every GPU holds every expert)"
        )
    if args.pp < 1:
        p.error(f"--pp {args.pp}: the pipeline stages must be at least 1 (1: no pipeline, every GPU holds every block)")
    if args.pp == 1:
        given = [
            f"--{flag} {value}"
            for flag, value in (
                ("microbatches", args.microbatches),
                ("schedule", args.schedule),
                ("virtual-stages", args.virtual_stages),
            )
            if value is not None
        ]
        if given:
            p.error(
                f"{', '.join(given)}: how --pp N pipelines a step, and without --pp (or with --pp 1) there is no "
                f"pipeline; pass --pp N with N >= 2 stages too, or leave {'them' if len(given) > 1 else 'it'} out"
            )
    elif args.microbatches is None:
        p.error(
            f"--pp {args.pp} pipelines each step in micro-batches: pass --microbatches M (at least {args.pp} for "
            f"1f1b; the bubble {bubble_formula(args.schedule or '1f1b')} shrinks as M grows, e.g. --microbatches "
            f"{4 * args.pp})"
        )
    if args.cp_method is not None and args.cp is None:
        p.error(f"--cp-method {args.cp_method} says how --cp N splits attention; pass --cp N too")
    if args.seq == "max" and args.model is None and not shaped:
        p.error(
            "--seq-len max finds the longest sequence whose activations fit, which needs the shapes: pass --model "
            "config.json, or --layers and --hidden (with --vocab, --heads, --kv-heads, --ffn, --gated)"
        )
    if args.seq == "max" and args.inference:
        p.error("--seq-len max plans training activations; --inference counts weights only, whatever the sequence")
    if args.model is not None and not os.path.exists(args.model):
        p.error(
            f"--model {args.model}: no such file or directory; pass a Hugging Face config.json or the model "
            "directory that holds one"
        )
    if (
        args.model is not None
        and os.path.isdir(args.model)
        and not os.path.isfile(os.path.join(args.model, "config.json"))
    ):
        p.error(
            f"--model {args.model}: the directory holds no config.json; pass a Hugging Face model directory or its config.json"
        )
    if args.plot is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        where = os.path.dirname(os.path.abspath(args.plot))
        p.error(
            f"--plot {args.plot}: the directory it goes in, {where}, does not exist; create it (mkdir -p {where}) "
            "or pass a file in an existing directory"
        )
    if args.plot:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            print(
                "error: --plot needs matplotlib, which is not installed: pip install zerofn[plot] (or pip install "
                "matplotlib)",
                file=sys.stderr,
            )
            return 2
    try:
        source: float | ModelShape = model_shape(args.model) if args.model else args.params
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    note = None
    if args.model is None and shaped and args.vocab is not None:
        source, note = _count_from_shapes(args)
    dims = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq", "micro_batch")
    shape_kw = {k: getattr(args, k) for k in dims}
    shape_kw = {k: v for k, v in shape_kw.items() if v is not None}
    if args.gated:
        shape_kw["gated"] = True
    kw = dict(gpus=args.gpus, nodes=args.nodes, **shape_kw)
    if not args.inference:
        kw["mixed_precision"] = not args.fp32
    if args.bf16_moments:
        kw["optimizer"] = O.adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)
    if args.bf16_masters:
        kw["master_weights"] = False
    if args.lora_rank is not None:
        kw["lora_rank"] = args.lora_rank
        kw["quantize"] = args.quantize
    if args.tp != 1:
        kw["tp"] = args.tp
    if args.ep is not None:
        kw["ep"] = args.ep
    if args.pp != 1:
        kw["pp"], kw["microbatches"] = args.pp, args.microbatches
        kw["schedule"], kw["virtual_stages"] = args.schedule or "1f1b", args.virtual_stages or 1
    recipe = args.cp is not None  # --cp implies the long-context recipe unless told otherwise
    if args.cp is not None:
        kw["cp"], kw["cp_method"] = args.cp, args.cp_method or "ulysses"
    if recipe if args.chunked_loss is None else args.chunked_loss:
        kw["chunked_loss"] = True
    if recipe if args.remat_offload is None else args.remat_offload:
        kw["remat_offload"] = True
    longest = None
    try:
        if args.seq == "max":
            kw.pop("seq")
            kw.setdefault("micro_batch", 1)
            longest = longest_sequence(
                source, gpu_memory=args.gpu_memory, cpu_memory=args.cpu_memory, nvme=args.nvme, **kw
            )
            unit = layout_unit(args.cp, kw["cp_method"]) if args.cp is not None else 1
            kw["seq"] = longest[0] if longest else unit
        rows = compositions(source, inference=args.inference, **kw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    psi = source.params if isinstance(source, ModelShape) else int(round(source))
    n = args.gpus * args.nodes
    what = "fp32, Adam" if args.fp32 else "bf16 mixed precision, Adam"
    if args.bf16_masters:
        what = "bf16 parameters updated in place (no fp32 masters), Adam"
    what += " with bf16 moments" if args.bf16_moments else ""
    what = "inference, fp16/bf16 weights" if args.inference else what
    lora = rows[0].lora
    if lora is not None:
        what += f"; LoRA rank {lora.rank} ({format_count(lora.trainable)} trainable), the base frozen"
        what += f" in {lora.quantize.upper()}" if lora.quantize else ""
    tensor, context, expert = rows[0].tensor_parallel, rows[0].context_parallel, rows[0].expert_parallel
    pipeline = rows[0].pipeline_parallel
    mesh = []  # the mesh, innermost first: tp, ep, cp, then dp, then pp
    if tensor is not None:
        mesh.append(f"tensor parallel {tensor.size}")
    if expert is not None:
        mesh.append(f"expert parallel {expert.size}")
    if context is not None:
        mesh.append(f"context parallel {context.size} ({context.method})")
    if mesh or pipeline is not None:
        data = next(x.data for x in (context, tensor, expert, pipeline) if x is not None)
        mesh.append(f"data parallel {data // (expert.size if expert is not None else 1)}")
        if pipeline is not None:
            mesh.append(f"pipeline parallel {pipeline.size}")
        what += f"; {' x '.join(mesh)}"
    name = f" ({source.name})" if isinstance(source, ModelShape) and source.name else ""
    title = (
        f"{format_count(psi)} parameters{name} on {n} GPU(s) ({args.nodes} node(s) x {args.gpus}), "
        f"{fmt_bytes(args.gpu_memory)} each; {what}"
    )
    if note is not None:
        print(note)
    if args.seq == "max":
        print(_longest_line(longest, kw, args, source))
    print(plan_text(rows, gpu=args.gpu_memory, cpu=args.cpu_memory, nvme=args.nvme, psi=psi, title=title))
    if hardware is not None:
        efficiency = EFFICIENCY if args.efficiency is None else args.efficiency
        skw = {k: v for k, v in kw.items() if k not in ("gpus", "nodes")}
        try:
            fast = speeds(
                source,
                hardware=hardware,
                nodes=args.nodes,
                gpus_per_node=args.gpus,
                efficiency=efficiency,
                gpu_memory=args.gpu_memory,
                **skw,
            )
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print()
        print(
            speed_text(
                fast,
                hardware=hardware,
                nodes=args.nodes,
                gpus_per_node=args.gpus,
                efficiency=efficiency,
                gpu_memory=args.gpu_memory,
                mixed_precision=not args.fp32,
                pipeline=pipeline,
            )
        )
    if args.plot:
        try:
            plot(rows, args.gpu_memory, args.plot, title)
        except ImportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 0


def _check_speed(p: argparse.ArgumentParser, args: argparse.Namespace, shaped: bool) -> None:
    """What ``--hardware`` needs and what it does not model: usage errors."""
    if args.inference:
        p.error("--hardware predicts a training step's time; --inference is not modelled: leave one of the two out")
    if args.lora_rank is not None:
        p.error(
            "--hardware with --lora-rank is not modelled (the adapters' traffic beside a frozen base's gathers): "
            "plan LoRA's memory without --hardware"
        )
    if args.ep is not None:
        p.error("--hardware with --ep is not modelled (the experts' all-to-alls): plan its memory without --hardware")
    if args.model is None and not shaped:
        p.error(
            "--hardware predicts the step from the model's FLOPs and ZeRO-3's units, which need the shapes: pass "
            "--model config.json, or --layers and --hidden (with --vocab, --heads, --kv-heads, --ffn, --gated)"
        )
    if args.seq is None or (args.micro_batch is None and args.seq != "max"):
        p.error("--hardware predicts the step from its tokens: pass --seq and --micro-batch (sequences per GPU)")
    if args.efficiency is not None and not 0 < args.efficiency <= 1:
        p.error(
            f"--efficiency {args.efficiency}: the fraction of the peak the compute achieves, in (0, 1]; 0.6 is typical"
        )


def _longest_line(longest, kw: dict, args: argparse.Namespace, source) -> str:
    """What ``--seq-len max`` found, said above the table (which is planned at that length)."""
    cp, method = kw.get("cp"), kw.get("cp_method", "ulysses")
    unit = layout_unit(cp, method) if cp is not None else 1
    why = (
        f"a multiple of {unit}, the layout unit of cp {cp} with {method}: {'2 x cp chunks, two a GPU' if method == 'ring' else 'cp slices'}"
        if unit > 1
        else "any length"
    )
    b = kw.get("micro_batch", 1)
    if longest is None:
        return (
            f"longest sequence: none; no composition fits in {fmt_bytes(args.gpu_memory)} per GPU even at {unit} "
            f"token(s) x micro-batch {b} ({why}); the table below is at {unit}"
        )
    seq, best = longest
    line = (
        f"longest sequence: {seq:,} tokens x micro-batch {b} ({why}), with {best.label} at {fmt_bytes(best.total)} "
        f"per GPU; {seq + unit:,} does not fit. The table below is at {seq:,}"
    )
    positions = source.positions if isinstance(source, ModelShape) else None
    if positions and seq > positions:
        line += (
            f"\nnote: {seq:,} tokens is past the config's max_position_embeddings ({positions:,}): the model needs "
            "its positions extended (rotary scaling) or long-context training to use them"
        )
    return line


# How far --params may be from the shapes' count before the shapes' count is used (norms, biases, a tied or untied
# head and positions move it by a percent or two).
PARAMS_TOLERANCE = 0.05


def _count_from_shapes(args: argparse.Namespace) -> tuple[float | ModelShape, str | None]:
    """The parameter count to plan for, given the shapes (``--layers``, ``--hidden``, ``--vocab``, ...): the shapes'
    own count (a :class:`ModelShape`) when ``--params`` is absent or off it by more than ``PARAMS_TOLERANCE`` (with
    the line that says so), else ``--params`` as given. The blocks and the rest (embeddings, head, norms) are then
    what the shapes make them, where a larger ``--params`` would put its excess in the rest."""
    shape = shape_from_dims(
        layers=args.layers,
        hidden=args.hidden,
        vocab=args.vocab,
        heads=args.heads,
        kv_heads=args.kv_heads,
        ffn=args.ffn,
        gated=args.gated,
    )
    if args.params is None:
        return shape, None
    if abs(args.params - shape.params) <= PARAMS_TOLERANCE * shape.params:
        return args.params, None
    missing = [f for f, given in (("--gated", args.gated), ("--kv-heads", args.kv_heads)) if not given]
    hint = f"; for a Llama-style model pass {' and '.join(missing)}" if missing else ""
    note = (
        f"note: --params {format_count(args.params)} is {abs(args.params / shape.params - 1):.0%} off the "
        f"{format_count(shape.params)} the shapes hold ({args.layers} blocks of {format_count(shape.layer_params)}, "
        f"{format_count(shape.root_params)} in embeddings, head and norms): planning for the shapes' count{hint}"
    )
    return shape, note
