"""Fine-tune a Hugging Face causal LM with zerofn's transforms, on one process or a few ranks.

Nothing is downloaded: by default the model is a tiny Llama built from a config in code, and the data a
synthetic Markov corpus (examples/gpt.py's), so the loss has something to learn. Give a local model with
--model: a directory with config.json and weights (from_pretrained), a directory with only config.json,
or a config JSON file (from_config: fresh weights).

    python examples/finetune_hf.py --steps 20
    torchrun --nproc_per_node=2 examples/finetune_hf.py --zero 3 --amp bf16 --lora 8 --export out
    torchrun --nproc_per_node=2 examples/finetune_hf.py --zero 3 --lora 8 --quantize nf4 --export out --merged
    torchrun --nproc_per_node=2 examples/finetune_hf.py --zero 2 --offload cpu --remat
    python examples/finetune_hf.py --hf-checkpointing --ckpt-dir c --save-every 10 --steps 20   # run again
                                                                                       # with --steps 40

The task is supervised fine-tuning: each row is a prompt, a response and right padding, and the loss is the
cross-entropy over the response tokens only (labels -100 on the prompt and the padding), returned as
zf.Mean(sum, count) so that N ranks, whose rows hold different numbers of response tokens, train what one
process over the whole batch trains. Every rank feeds its own slice of the global batch. --lora R trains rank-R LoRA adapters on q_proj and
v_proj (peft), the base weights frozen (zerofn holds them without gradients or optimizer state); without it
every weight is trained. --remat is zerofn's per-block recomputation; --hf-checkpointing is the model's own
(gradient_checkpointing_enable, non-reentrant). With --ckpt-dir it saves every --save-every steps in the
background and resumes from the newest checkpoint. With --export DIR it writes the fine-tuned model
(LoRA merged into the base weights) with save_pretrained, reloads it with from_pretrained, generates a few
tokens, and checks that the reloaded model's logits equal step.apply's.

--quantize nf4|int8 (with --lora: QLoRA) holds the frozen base weights quantized (zerofn.transforms.quantize,
applied last), dequantized per call. With --zero 3 the model is then built on the meta device and each rank
initialises only its shards, layer by layer, quantizing each weight as it is read: from --model's safetensors
files (zf.checkpoint.pretrained_init) or, without weight files, from the model's own initialisation; no rank
ever builds the whole model. With --export DIR a quantized run writes the adapters in peft's format
(adapter_config.json and adapter_model.safetensors, for PeftModel.from_pretrained on the base model) and
prints a few tokens zf.generate chooses from the quantized state; --merged also writes DIR/merged, the base
dequantized (zerofn.transforms.quantize.dequantized) with the adapters merged in, in bf16, built whole on
rank 0 (the one place it is), and checks the reloaded adapters' logits and the merged model's against
step.apply's.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_paths import existing_file, output_dir, output_file  # noqa: E402


def parse_args(argv=None):
    """The command line, its paths checked (standard library only: run before torch is imported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=None,
        metavar="DIR_OR_CONFIG_JSON",
        help="a local model directory (config.json, with or without weights) or a config JSON file; "
        "default: a tiny Llama config built in code",
    )
    p.add_argument("--lora", type=int, default=0, metavar="R", help="LoRA rank on q_proj, v_proj (0: full fine-tuning)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="ZeRO stage (0 = plain data parallel)")
    p.add_argument("--amp", choices=["bf16", "fp16"], default=None, help="mixed precision (fp32 master weights)")
    p.add_argument("--offload", choices=["cpu"], default=None, help="optimizer state (and amp's masters) in CPU RAM")
    ckpt = p.add_mutually_exclusive_group()
    ckpt.add_argument("--remat", action="store_true", help="zerofn's remat: recompute each block in backward")
    ckpt.add_argument("--hf-checkpointing", action="store_true", help="the model's gradient_checkpointing_enable")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=None, help="default: 3e-3 full fine-tuning, 1e-2 LoRA")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over ranks")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default=None, metavar="DIR", help="save checkpoints here and resume from the newest")
    p.add_argument("--save-every", type=int, default=None, metavar="K", help="steps between checkpoints (default 20)")
    p.add_argument("--keep", type=int, default=2, metavar="N", help="checkpoints to keep (the newest N)")
    p.add_argument(
        "--quantize",
        choices=["nf4", "int8"],
        default=None,
        help="hold the frozen base weights quantized (QLoRA; needs --lora)",
    )
    p.add_argument("--export", default=None, metavar="DIR", help="save_pretrained the fine-tuned model here")
    p.add_argument(
        "--merged",
        action="store_true",
        help="with --quantize --export DIR: also the merged model, dequantized, in bf16, to DIR/merged",
    )
    p.add_argument("--prompt-len", type=int, default=6, help="tokens of the generation prompt (with --export)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens to generate (with --export)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (the summary lines are still printed)")
    p.add_argument("--jsonl", default=None, metavar="FILE", help="append rank 0's metrics here, one JSON line per step")
    p.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write rank 0's metrics to TensorBoard here (needs pip install tensorboard)",
    )
    args = p.parse_args(argv)
    if args.save_every is not None and args.ckpt_dir is None:
        p.error("--save-every needs --ckpt-dir")
    args.save_every = 20 if args.save_every is None else args.save_every
    if args.save_every < 1 or args.keep < 1:
        p.error("--save-every and --keep must be at least 1")
    if args.lr is None:
        args.lr = 1e-2 if args.lora else 3e-3
    if args.quantize and not args.lora:
        p.error(
            "--quantize needs --lora R: it holds the frozen base weights quantized, and without LoRA adapters "
            "every weight is trained (none is frozen)"
        )
    if args.merged and not (args.quantize and args.export):
        p.error(
            "--merged needs --quantize and --export DIR (without --quantize, --export writes the merged model already)"
        )
    if args.model is not None and os.path.isdir(args.model):
        existing_file(
            p,
            "--model",
            os.path.join(args.model, "config.json"),
            "a model directory holds a config.json (save_pretrained writes one); pass one that does, or a config "
            "JSON file, or leave --model out for the built-in tiny Llama",
        )
    elif args.model is not None and not os.path.isfile(args.model):
        p.error(
            f"--model {args.model}: no such file or directory; pass a local model directory (with a config.json) "
            "or a config JSON file, or leave --model out for the built-in tiny Llama"
        )
    output_dir(p, "--ckpt-dir", args.ckpt_dir)
    output_dir(p, "--export", args.export)
    output_file(p, "--jsonl", args.jsonl)
    output_dir(p, "--tensorboard", args.tensorboard)
    return args


if __name__ == "__main__":
    parse_args()  # a wrong command line or path fails here, before torch and transformers are imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpt import MarkovCorpus  # noqa: E402
from zerofn.transforms import amp, offload, quantize, remat, shard_grads, shard_optimizer, shard_params  # noqa: E402

import zerofn as zf  # noqa: E402

PAD = 0  # the padding token (masked out of attention and of the loss)
STAGES = {0: lambda s: s, 1: shard_optimizer, 2: shard_grads, 3: shard_params}
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_config(spec: str | None):
    """(config, weights directory or None)."""
    from transformers import AutoConfig, LlamaConfig

    if spec is None:
        cfg = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=True,
        )
        return cfg, None
    cfg = AutoConfig.from_pretrained(spec)
    weights = os.path.isdir(spec) and any(os.path.exists(os.path.join(spec, f)) for f in WEIGHT_FILES)
    return cfg, (spec if weights else None)


def build_model(cfg, weights: str | None, seed: int, meta: bool = False):
    """The same model on every rank: loaded weights, or fresh ones from the seed; ``meta``: its structure
    only, on the meta device (shard_params initialises each rank's shards)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.float32)
    if weights is not None:
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=torch.float32)
    return model


def lora_config(r: int):
    from peft import LoraConfig

    return LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )


def sft_batch(corpus, n: int, seq_len: int, seed: int) -> dict:
    """A supervised fine-tuning batch of ``n`` rows: a prompt, a response, right padding.

    Each row's prompt (a quarter to a half of the row) and response lengths are drawn from ``seed``, so every
    micro-batch holds its own number of response tokens. ``labels`` is -100 on the prompt and the padding: the
    loss learns the responses only. The batch of step i depends on i and the seed only (a resumed run goes on
    alike) and is the same on every rank, which takes its own rows.
    """
    g = torch.Generator().manual_seed(seed)
    ids = corpus.sample(n, seq_len, seed=seed)
    prompt = torch.randint(seq_len // 4, seq_len // 2 + 1, (n, 1), generator=g)
    end = torch.minimum(prompt + torch.randint(1, seq_len, (n, 1), generator=g), torch.tensor(seq_len))
    pos = torch.arange(seq_len)
    attention_mask = (pos < end).long()
    ids = ids.masked_fill(attention_mask == 0, PAD)
    labels = ids.masked_fill((pos < prompt) | (attention_mask == 0), -100)
    return {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}


def build_step(args, apply, init_fn=None):
    def loss_fn(params, batch):
        # Each rank's micro-batch holds its own number of response tokens: zf.Mean(sum, count) makes the loss the
        # mean over every rank's tokens (one process over the whole batch), not the mean of the ranks' means.
        mask = batch["attention_mask"]
        logits = apply(params, input_ids=batch["input_ids"], attention_mask=mask, use_cache=False).logits
        labels = batch["labels"][:, 1:]  # the logits at t predict the token at t + 1
        logits = logits[:, :-1].flatten(0, 1).float()
        total = F.cross_entropy(logits, labels.flatten(), ignore_index=-100, reduction="sum")
        return zf.Mean(total, (labels != -100).sum())

    warmup = max(args.steps // 10, 1)
    total = max(args.steps, warmup + 1)
    schedule = zf.optim.warmup_cosine_decay_schedule(0.0, args.lr, warmup, total, args.lr / 10)
    optimizer = zf.optim.chain(zf.optim.clip_by_global_norm(1.0), zf.optim.adamw(schedule, weight_decay=0.0))
    step = zf.train_step(loss_fn, optimizer)
    # ZeRO-3 from the meta device: init_fn reads each parameter (None: the model's own initialisation)
    step = shard_params(step, init_fn=init_fn) if args.zero == 3 else STAGES[args.zero](step)
    if args.amp:
        step = amp(step, {"bf16": torch.bfloat16, "fp16": torch.float16}[args.amp])
    if args.offload:
        step = offload(step, args.offload)
    if args.remat:
        step = remat(step)
    if args.quantize:  # last: it rewrites what init holds (the frozen weights become their quantized parts)
        step = quantize(step, args.quantize)
    return step


def export(args, step, state, cfg, weights, rank: int, vocab: int) -> None:
    """save_pretrained the fine-tuned model (rank 0), reload it, generate, and compare with step.apply."""
    from transformers import AutoModelForCausalLM

    master = {"master": True} if args.amp else {}
    full = step.state_dict(state, **master)  # collective: every rank gathers
    prompt = MarkovCorpus(vocab=vocab, seed=args.seed).sample(2, args.prompt_len, seed=123)
    logits = step.apply(state, input_ids=prompt, use_cache=False).logits  # collective under ZeRO-3
    if rank != 0:
        return
    fresh = build_model(cfg, weights, args.seed)
    if args.lora:
        from peft import get_peft_model

        fresh = get_peft_model(fresh, lora_config(args.lora))
    fresh.load_state_dict(full, strict=True)
    if args.lora:
        fresh = fresh.merge_and_unload()
    fresh.save_pretrained(args.export)
    reloaded = AutoModelForCausalLM.from_pretrained(args.export).eval()
    with torch.no_grad():
        out = reloaded.generate(prompt[:1], max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
        if args.amp:  # the same autocast step.apply runs under
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
            with torch.autocast("cpu", dtype=dtype):
                again = reloaded(input_ids=prompt, use_cache=False).logits
        else:
            again = reloaded(input_ids=prompt, use_cache=False).logits
    diff = float((again.float() - logits.float()).abs().max())
    scale = float(logits.float().abs().max())
    # fp32 full fine-tuning: the same weights, the same computation, bit for bit. LoRA merged into the base
    # weights sums in another order; under amp both sides run in bf16 (the masters round to the step's weights).
    tol = 0.0 if not (args.lora or args.amp) else (1e-4 if not args.amp else 5e-2) * max(1.0, scale)
    print(f"exported to {args.export}")
    print(f"generated: prompt {prompt[0].tolist()} -> {out[0, args.prompt_len :].tolist()}")
    print(f"logits max |reloaded - step.apply| {diff:.3g} (tolerance {tol:.3g}, logits up to {scale:.3g})")
    if not diff <= tol:
        raise SystemExit(f"the exported model's logits differ from step.apply's by {diff} > {tol}")


def export_quantized(args, step, state, cfg, rank: int, vocab: int, model) -> None:
    """--quantize: the adapters in peft's format (rank 0) and a few tokens zf.generate chooses from the quantized
    state; --merged: the base dequantized with the adapters merged in, in bf16, each checked against step.apply."""
    from peft import PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM
    from zerofn.transforms.quantize import dequantized

    model.eval()  # dropout off (and the model's own gradient checkpointing, which would refuse the cache)
    master = {"master": True} if args.amp else {}  # the fp32 adapters (the base: dequantized read its parts exactly)
    full = step.state_dict(state, **master)  # collective: every rank gathers (the parts: the quantized bytes)
    prompt = MarkovCorpus(vocab=vocab, seed=args.seed).sample(2, args.prompt_len, seed=123)
    logits = step.apply(state, input_ids=prompt, use_cache=False).logits  # collective under ZeRO-3
    tokens = zf.generate(step, state, prompt[:1], max_new_tokens=args.new_tokens)  # collective under ZeRO-3
    if rank != 0:
        return
    adapters = {k: v for k, v in full.items() if "lora_" in k}
    shell = get_peft_model(build_model(cfg, None, args.seed, meta=True), lora_config(args.lora))
    shell.load_state_dict(adapters, strict=False, assign=True)  # only the adapters are real: all it saves
    shell.save_pretrained(args.export)
    print(f"exported the {args.quantize} run's adapters to {args.export}")
    print(f"generated: prompt {prompt[0].tolist()} -> {tokens[0, args.prompt_len :].tolist()}")
    if not args.merged:
        return

    # The adapters as written, on the base as the step computes with it (dequantized): step.apply's numbers.
    peft_model = PeftModel.from_pretrained(build_model(cfg, None, args.seed), args.export).eval()
    read = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    if read.keys() != adapters.keys() or not all(torch.equal(read[k], adapters[k].float()) for k in read):
        raise SystemExit(f"the adapters read back from {args.export} differ from the state's")
    peft_model.load_state_dict(dequantized(full, model), strict=True)
    scale = float(logits.float().abs().max())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)

    def forward(m):
        with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            return m(input_ids=prompt, use_cache=False).logits.float()  # under amp: the autocast step.apply runs in

    # fp32: the same weights and the same computation; under amp both sides run in bf16 (as --export's check)
    tol = (1e-5 if not args.amp else 5e-2) * max(1.0, scale)
    diff = float((forward(peft_model) - logits.float()).abs().max())
    print(f"logits max |adapters on the dequantized base - step.apply| {diff:.3g} (tolerance {tol:.3g})")
    if not diff <= tol:
        raise SystemExit(f"the exported adapters on the dequantized base differ from step.apply by {diff} > {tol}")

    merged_dir = os.path.join(args.export, "merged")
    merged = peft_model.merge_and_unload().to(torch.bfloat16)
    merged.save_pretrained(merged_dir)
    reloaded = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()  # bf16 values, exact
    diff = float((forward(reloaded) - logits.float()).abs().max())
    # Each merged weight is rounded to bf16 (8 significant bits: a relative error of at most 2**-9), and the
    # logits pass through every one of the model's matrices: to first order they move by at most 2**-9 of
    # their scale per matrix on the way, so the tolerance is 2**-9 x those matrices x the logits' scale.
    matrices = sum(p.dim() == 2 for p in reloaded.parameters())
    tol = max(tol, 2**-9 * matrices * max(1.0, scale))
    print(f"exported the merged model (bf16) to {merged_dir}")
    print(f"logits max |merged bf16 - step.apply| {diff:.3g} (tolerance {tol:.3g}, logits up to {scale:.3g})")
    if not diff <= tol:
        raise SystemExit(f"the merged model's logits differ from step.apply's by {diff} > {tol}")


def main(argv=None) -> None:
    args = parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    # transformers 5 renamed gradient_checkpointing_* (the old names still work, with a FutureWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    if args.quiet:
        transformers.utils.logging.disable_progress_bar()
    world, rank = zf.collectives.world_size(), zf.collectives.rank()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must split evenly over {world} ranks")
    cfg, weights = load_config(args.model)
    # QLoRA under ZeRO-3: no rank builds the whole model; each initialises its shards, quantized layer by layer
    meta = args.zero == 3 and args.quantize is not None
    model = build_model(cfg, weights, args.seed, meta=meta)
    init_fn = zf.checkpoint.pretrained_init(weights) if meta and weights is not None else None
    if args.hf_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        from peft import get_peft_model

        model = get_peft_model(model, lora_config(args.lora))  # base weights: requires_grad=False
    model.train()  # dropout (if any) and the model's own gradient checkpointing are on in training mode
    apply = zf.functional(model)
    trainable = sum(p.numel() for p in apply.params.values() if p.requires_grad)
    total = sum(p.numel() for p in apply.params.values())  # before quantize holds the base as its parts
    step = build_step(args, apply, init_fn)

    latest = zf.checkpoint.latest(args.ckpt_dir) if args.ckpt_dir and os.path.isdir(args.ckpt_dir) else None
    state = zf.checkpoint.load(latest, step) if latest is not None else step.init(apply.params)
    del model  # the state holds the parameters now
    first = int(state.count)  # the batch of step i depends on i and the seed only: a resumed run goes on alike
    if first > args.steps:
        raise SystemExit(f"{latest} holds step {first}, past --steps {args.steps}")

    vocab = min(cfg.vocab_size, 128)
    corpus = MarkovCorpus(vocab=vocab, seed=args.seed)
    local = args.batch // world
    loud = rank == 0 and not args.quiet
    if rank == 0:
        print(
            f"{step.name} on {world} rank(s): {cfg.model_type}, {trainable:,} of {total:,} parameters trained"
            f"{f' (LoRA r={args.lora})' if args.lora else ''}, global batch {args.batch} x {args.seq_len} tokens"
        )
        if latest is not None:
            print(f"resumed from {latest} at step {first}")
        if loud:
            print(state)
    log = zf.metrics.Logger(
        args.steps,
        start=first,
        tokens_per_step=args.batch * args.seq_len,
        every=1,
        jsonl=args.jsonl,
        tensorboard=args.tensorboard,
        desc="train",
        bar=loud,
    )
    tokens, learned, losses, saving = 0, 0, [], None
    start = time.perf_counter()
    for i in range(first, args.steps):
        batch = sft_batch(corpus, args.batch, args.seq_len, seed=args.seed * 1_000_003 + i)
        state, metrics = step(state, {k: v[rank * local : (rank + 1) * local] for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
        tokens += args.batch * args.seq_len
        learned += int(metrics["count"])  # the response tokens of every rank: the loss's count
        log.log(i, metrics)
        done = i + 1
        if args.ckpt_dir and (done % args.save_every == 0 or done == args.steps):
            if saving is not None:
                saving.wait()  # one write at a time
            saving = zf.checkpoint.save(state, os.path.join(args.ckpt_dir, f"step_{done:06d}"), blocking=False,
                                        keep=args.keep)  # fmt: skip  # collective
    log.close()
    if saving is not None:
        saving.wait()
    elapsed = time.perf_counter() - start
    if rank == 0 and losses:
        print(f"first loss {losses[0]:.4f}")
        print(f"last loss {losses[-1]:.4f}")
        print(f"throughput {tokens / elapsed:,.0f} tokens/s over {len(losses)} steps ({elapsed:.1f} s)")
        print(f"learned {learned} response tokens of {tokens} positions (prompt and padding masked)")
    if args.export and args.quantize:
        export_quantized(args, step, state, cfg, rank, vocab, apply.module)
    elif args.export:
        export(args, step, state, cfg, weights, rank, vocab)


if __name__ == "__main__":
    main()
