"""The Hugging Face fine-tuning example: LoRA under ZeRO-3 + bf16 on 2 ranks exports a model that
from_pretrained loads and generates with; QLoRA (an NF4 base) under ZeRO-3 on 2 ranks, built on the meta
device, exports adapters that peft loads and a merged bf16 model whose logits match step.apply's; full
fine-tuning with the model's own gradient checkpointing saves checkpoints and resumes from them. All learn
the responses only (a prompt-masked zf.Mean loss), counted over every rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from test_examples import ROOT

pytest.importorskip("transformers")
pytest.importorskip("peft")

SCRIPT = os.path.join(ROOT, "examples", "finetune_hf.py")
# ZEROFN_TIMEOUT_S: a rank that hangs instead of failing fails the test in a minute.
ENV = dict(os.environ, OMP_NUM_THREADS="1", ZEROFN_TIMEOUT_S="60", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
ENV.pop("TORCHELASTIC_RESTART_COUNT", None)
LAUNCH = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _run(argv: list[str], cwd) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=cwd, env=ENV)
    assert proc.returncode == 0, f"{argv}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _loss(label: str, out: str) -> float:
    return float(re.search(rf"^{label} loss ([0-9.]+)$", out, re.M).group(1))


def _learned(out: str, steps: range) -> None:
    """The example's loss counted the response tokens of the whole global batch, every rank's, on each of
    ``steps`` (metrics["count"] summed), and only those: not the prompts, not the padding."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from finetune_hf import sft_batch
    from gpt import MarkovCorpus

    corpus = MarkovCorpus(vocab=128, seed=0)  # the example's defaults: a 128-token vocabulary, seed 0
    batches = [sft_batch(corpus, 8, 32, seed=i) for i in steps]  # --batch 8, --seq-len 32
    expected = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    learned = re.search(r"^learned (\d+) response tokens of (\d+) positions", out, re.M)
    assert learned, out
    assert int(learned.group(1)) == expected, (learned.group(0), expected)
    assert 0 < expected < int(learned.group(2)) == len(steps) * 8 * 32


def test_lora_zero3_bf16_on_two_ranks_exports_a_model_that_loads_and_generates(tmp_path):
    export = tmp_path / "export"
    args = ["--zero", "3", "--amp", "bf16", "--lora", "4", "--steps", "4", "--export", str(export), "--quiet"]
    out = _run([*LAUNCH, SCRIPT, *args], tmp_path).stdout
    assert "amp(shard_params(train_step)) on 2 rank(s)" in out, out
    first, last = _loss("first", out), _loss("last", out)
    print(f"loss {first:.4f} -> {last:.4f}")
    assert last < first, out
    _learned(out, range(4))
    # the example reloaded the export, generated, and matched step.apply's logits (or it would exit non-zero)
    generated = re.search(r"^generated: prompt \[[0-9, ]+\] -> \[([0-9, ]+)\]$", out, re.M)
    assert generated and len(generated.group(1).split(",")) == 8, out
    assert "logits max |reloaded - step.apply|" in out, out

    # and the exported directory stands alone: a plain Llama (LoRA merged), loadable and generating here
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not any("lora" in name for name in model.state_dict())
    prompt = torch.tensor([[1, 2, 3, 4]])
    tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert tokens.shape == (1, 9) and torch.equal(tokens[:, :4], prompt)


def test_qlora_zero3_on_two_ranks_exports_adapters_peft_loads_and_a_merged_bf16_model(tmp_path):
    export = tmp_path / "export"
    args = ["--lora", "8", "--quantize", "nf4", "--zero", "3", "--steps", "3", "--export", str(export), "--merged"]
    out = _run([*LAUNCH, SCRIPT, *args, "--quiet"], tmp_path).stdout
    assert "quantize(shard_params(train_step)) on 2 rank(s)" in out, out
    _learned(out, range(3))
    # a few tokens zf.generate chose from the quantized state (collective: both ranks generated)
    generated = re.search(r"^generated: prompt \[[0-9, ]+\] -> \[([0-9, ]+)\]$", out, re.M)
    assert generated and len(generated.group(1).split(",")) == 8, out
    # the example's own checks passed (or it would exit non-zero): the adapters read back on the dequantized
    # base give step.apply's logits (fp32: exactly), and the merged bf16 model's are within bf16 rounding
    adapters = re.search(r"^logits max \|adapters on the dequantized base - step.apply\| (\S+) ", out, re.M)
    merged = re.search(r"^logits max \|merged bf16 - step.apply\| (\S+) \(tolerance (\S+),", out, re.M)
    assert adapters and merged, out
    print(f"adapters: {adapters.group(1)}; merged bf16: {merged.group(1)} (tolerance {merged.group(2)})")
    assert float(adapters.group(1)) == 0.0 and 0 < float(merged.group(1)) <= float(merged.group(2)), out

    import torch
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    # the adapters in peft's format: they load onto the base model, trained (lora_B starts at zero)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(export))
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(export / "merged"))
    lora = {n: p for n, p in PeftModel.from_pretrained(base, export).named_parameters() if "lora_" in n}
    assert len(lora) == 2 * 2 * 2  # A and B on q_proj and v_proj of 2 blocks
    assert all(p.abs().max() > 0 for n, p in lora.items() if "lora_B" in n)
    # the merged model stands alone: a plain Llama in bf16, loadable and generating here
    model = AutoModelForCausalLM.from_pretrained(export / "merged")
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.bfloat16
    assert not any("lora" in name or "weight_" in name for name in model.state_dict())
    prompt = torch.tensor([[1, 2, 3, 4]])
    tokens = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert tokens.shape == (1, 9) and torch.equal(tokens[:, :4], prompt)


def test_full_finetune_with_hf_checkpointing_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = ["--hf-checkpointing", "--zero", "0", "--ckpt-dir", str(ckpt), "--save-every", "2", "--quiet"]
    out = _run([sys.executable, SCRIPT, *args, "--steps", "3"], tmp_path).stdout
    assert "resumed from" not in out, out
    assert sorted(os.listdir(ckpt)) == ["step_000002", "step_000003"]
    out = _run([sys.executable, SCRIPT, *args, "--steps", "5"], tmp_path).stdout
    assert re.search(r"resumed from \S*step_000003 at step 3\n", out), out
    assert re.search(r"over 2 steps", out), out  # steps 3 and 4 only
    _learned(out, range(3, 5))
    assert sorted(os.listdir(ckpt)) == ["step_000004", "step_000005"]  # --keep 2
