"""Planning: what fits where. Bytes per GPU, CPU RAM and NVMe for each ZeRO stage, offload and remat.

:func:`estimate` (also ``zf.memory.estimate``) is the ZeRO paper's memory
table as zerofn holds it, plus activations and the transients of a step;
:func:`model_shape` reads a Hugging Face ``config.json``; :func:`main` is
``python -m zerofn plan``. Nothing here touches torch: it is arithmetic on
shapes, checked against real runs in ``tests/test_plan.py``.

Notation: Psi trainable parameters, N = GPUs per node x nodes ranks,
S = Psi / N (padded: each bucket to a multiple of N elements). Mixed
precision (``amp``, bf16/fp16): 2 bytes of parameter, 2 of gradient, and
K = 12 of optimizer state (4 fp32 master + 4 + 4 Adam moments); full
precision: 4 + 4 + K = 8. Either way 16 bytes per parameter under DDP.

Per rank, per composition (docs/design.md's table, as the state holds it):

========================  ==================  ===================  ==================
stage                     parameters          gradients (in step)  optimizer state
========================  ==================  ===================  ==================
DDP (0)                   2 Psi               2 Psi                K Psi
ZeRO-1                    2 Psi               2 Psi                K S
ZeRO-2                    2 Psi               2 S + 2 buckets      K S
ZeRO-3                    2 S                 2 S                  K S
========================  ==================  ===================  ==================

(4 instead of 2 in full precision), plus the optimizer's 8-byte step count.
Between steps a :class:`~zerofn.TrainState` holds parameters and optimizer
state only (``Estimate.state``, what ``zf.memory.state_bytes`` reports);
gradients exist inside a step. Also inside a step:

- activations (when the shapes are given): see :func:`activation_bytes`;
- ZeRO-3's gathered units: the root unit's full parameters and gradients
  (embeddings, head, final norm) and ``prefetch + 2`` blocks' full
  parameters and gradients;
- the update's transient: under mixed precision the reduced gradient
  partition is cast to fp32 for the master weights on the GPU (4 S bytes
  beside the 2 S partition); in full precision one bucket's temporary.
  With the optimizer state in CPU RAM there is none: each bucket's
  gradient is cast and copied to the host as backward lands it, so the
  GPU holds three buckets of gradient (or two and one's fp32 copy), not
  all of it.

``Estimate.total`` (per GPU) = parameters + optimizer state on the GPU +
gradients + max(activations + gathered units, update transient).

Optimizer state in CPU RAM (``"cpu"``): the GPU keeps only parameters and
the gradients of the buckets backward is landing; the host holds, per
rank, the optimizer state (K S), an fp32 gradient buffer kept from step
to step (4 S) and a host copy of the parameters it updates (2 S, or the
parameters themselves when they rest on the host too:
``param_offload="cpu"``, ZeRO-3 only): 18 bytes per
parameter in mixed precision, where write-ups of ZeRO-Offload count 12.
On NVMe (``"nvme"``): the files hold two generations of the K S state plus
a staging copy of the parameters, (2 K + 2) S bytes; RAM holds a few
streamed sub-groups.

Example:
    >>> from zerofn import memory
    >>> ddp = memory.estimate(70e9, gpus=8)                       # bf16 + Adam, DDP
    >>> round(ddp.model_state / 1e12, 2)                            # 16 bytes x 70e9 on every GPU
    1.12
    >>> z3 = memory.estimate(70e9, gpus=8, stage=3)
    >>> round(z3.model_state / 1e9, 1), z3.fits(80e9)               # 1120 GB / 8 > 80 GB
    (140.0, False)
    >>> cpu = memory.estimate(70e9, gpus=8, stage=3, optimizer_offload="cpu")
    >>> round(cpu.model_state / 1e9, 1), round(cpu.cpu_per_node / 1e12, 2)  # GPU: 2 / 8 + buckets; host: 18 bytes
    (17.6, 1.26)
    >>> round(memory.estimate(70e9, inference=True).total / 1e9, 1)  # fp16 weights only
    140.0
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["Estimate", "ModelShape", "activation_bytes", "compositions", "estimate", "main", "model_shape"]

# zerofn's defaults, repeated here so that planning imports no torch (tests check they agree):
BUCKET_BYTES = 25 * 2**20  # zerofn.step.DEFAULT_BUCKET_BYTES
NVME_SUB_GROUP_BYTES = 64 * 2**20  # the NVMe update's sub-group (transforms/offload.py)
NVME_SUB_GROUPS_IN_RAM = 5  # the one read ahead, the one updated, two being written, and the copies in
PREFETCH = 1  # ZeRO-3's default prefetch
ADAM_COUNT_BYTES = 8  # the optimizer's int64 step count

_DEVICES = (None, "cpu", "nvme")


# --------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A transformer's size and shapes, as :func:`estimate` takes them.

    ``params`` counts each tensor once (a tied head adds nothing). Block
    shapes follow GPT: ``layers`` blocks of attention (``heads`` query
    heads, ``kv_heads`` key/value heads) and an MLP of width ``ffn``
    (``gated``: SwiGLU's three matrices, Llama-style).
    """

    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    positions: int | None = None
    gated: bool = False
    tied: bool = True
    layer_params: int | None = None  # one block's parameters (a ZeRO-3 unit)
    name: str = ""

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks (embeddings, head, final norm): ZeRO-3's root unit."""
        return self.params - self.layers * (self.layer_params or 0)


_GATED_TYPES = frozenset(
    "llama mistral mixtral qwen2 qwen2_moe qwen3 qwen3_moe gemma gemma2 gemma3_text phi3 olmo olmo2 cohere "
    "internlm2 granite deepseek_v2 deepseek_v3 starcoder2_gated smollm3 exaone".split()
)
_ABSOLUTE_POSITIONS = frozenset("gpt2 gpt_bigcode opt gpt_neo bloom_absolute".split())


def _first(cfg: dict, *names: str, default: Any = None) -> Any:
    for n in names:
        if cfg.get(n) is not None:
            return cfg[n]
    return default


def model_shape(config: dict | str | os.PathLike) -> ModelShape:
    """A model's parameter count and shapes from a Hugging Face config.

    Reads ``vocab_size``, ``hidden_size``, ``num_hidden_layers``,
    ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``, ``tie_word_embeddings``, ``attention_bias``/``mlp_bias``
    and ``num_local_experts`` (Llama, Mistral, Qwen, Gemma-style: gated MLP,
    RMSNorm, rotary positions), or GPT-2's ``n_embd``, ``n_layer``,
    ``n_head``, ``n_inner``, ``n_positions`` (biases, LayerNorm, learned
    positions).

    Args:
        config: a dict, a ``config.json`` path, or a directory holding one.

    Returns:
        A :class:`ModelShape`.

    Raises:
        ValueError: a config without a hidden size, layer count, head count
            or vocabulary size.

    Example:
        >>> from zerofn.plan import model_shape
        >>> gpt2 = {"model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
        ...         "n_positions": 1024}
        >>> model_shape(gpt2).params                                   # GPT-2 small: 124 M
        124439808
        >>> llama2_70b = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "num_hidden_layers": 80,
        ...               "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
        ...               "tie_word_embeddings": False}
        >>> model_shape(llama2_70b).params
        68976648192
    """
    name = ""
    if not isinstance(config, dict):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            config = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    cfg = dict(config)
    if "text_config" in cfg and _first(cfg, "hidden_size", "n_embd", "d_model") is None:
        cfg = {**cfg, **cfg["text_config"]}  # a multimodal config: plan for its language model
    kind = str(cfg.get("model_type", ""))
    gpt2_names = "n_embd" in cfg
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head")
    vocab = _first(cfg, "vocab_size")
    named = (("hidden size", hidden), ("layers", layers), ("heads", heads), ("vocab_size", vocab))
    missing = [n for n, v in named if v is None]
    if missing:
        raise ValueError(
            f"model_shape: the config lacks {', '.join(missing)}; expected Hugging Face names (hidden_size, "
            "num_hidden_layers, num_attention_heads, vocab_size) or GPT-2's (n_embd, n_layer, n_head)"
        )
    hidden, layers, heads, vocab = int(hidden), int(layers), int(heads), int(vocab)
    kv_heads = int(_first(cfg, "num_key_value_heads", default=1 if cfg.get("multi_query") else heads))
    head_dim = int(_first(cfg, "head_dim", default=hidden // heads))
    ffn = int(_first(cfg, "intermediate_size", "n_inner", "ffn_dim", default=4 * hidden))
    act = str(_first(cfg, "hidden_act", "activation_function", default=""))
    gated = (kind in _GATED_TYPES or act in ("silu", "swiglu")) and not gpt2_names
    positions = _first(cfg, "max_position_embeddings", "n_positions", "n_ctx")
    learned_positions = gpt2_names or kind in _ABSOLUTE_POSITIONS
    tied = bool(cfg.get("tie_word_embeddings", True))
    layer_norm = not gated  # GPT-2 style LayerNorm (weight + bias) or RMSNorm (weight)
    norm = 2 * hidden if layer_norm else hidden
    q, kv = heads * head_dim, kv_heads * head_dim
    if gated:  # Llama-style: no biases unless the config says (Qwen2 has q, k, v biases)
        qkv_bias = bool(cfg.get("attention_bias", False)) or kind.startswith("qwen2")
        out_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
    else:  # GPT-2 style: biases everywhere
        qkv_bias = out_bias = mlp_bias = True
    attn = hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if qkv_bias else 0) + (hidden if out_bias else 0)
    if gated:
        mlp = 3 * hidden * ffn + (2 * ffn + hidden if mlp_bias else 0)
    else:
        mlp = 2 * hidden * ffn + (ffn + hidden if mlp_bias else 0)
    experts = int(_first(cfg, "num_local_experts", "num_experts", default=1) or 1)
    if experts > 1:
        mlp = experts * mlp + hidden * experts  # the experts and the router
    layer = attn + mlp + 2 * norm
    params = vocab * hidden * (1 if tied else 2) + layers * layer + norm
    if learned_positions and positions:
        params += int(positions) * hidden
    return ModelShape(
        params=params, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
        positions=int(positions) if positions else None, gated=gated, tied=tied, layer_params=layer,
        name=name or kind,
    )  # fmt: skip


# --------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------


def activation_bytes(
    *,
    layers: int,
    hidden: int,
    seq: int,
    micro_batch: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int = 0,
    gated: bool = False,
    mixed_precision: bool = True,
    remat: bool = False,
    inference: bool = False,
    flash: bool = True,
    device: str = "cuda",
) -> int:
    """Activation bytes alive at a training step's peak on one GPU, for a GPT-like model.

    Per token (s b of them, seq x micro-batch), with a = 2 bytes under mixed
    precision (4 in fp32), h = hidden, h_kv = kv_heads x head size, f = ffn:

    - each block saves a x (6 h + 2 h_kv + 2 f) (gated MLP: 4 f): the first
      norm's output, q, k, v, the attention output, the residual after
      attention, the second norm's output, the MLP's two activations and the
      block's output, which is the next block's input: 16 h for GPT (f = 4 h),
      Korthikanti et al.'s 34 s b h bytes in 16-bit without the dropout masks
      (2 s b h) and, with flash/SDPA attention, without the 5 a s^2 b attention
      matrices; plus 16 + 4 x heads bytes of fp32 statistics (norms' mean and
      rstd, attention's log-sum-exp). ``flash=False`` adds the softmax output,
      a x heads x s. On CUDA, autocast runs layer norms in fp32: each of the
      two norms saves an fp32 copy of its input (4 h more); on the CPU they
      run in bf16 (what the tests measure).
    - the embedding's output (a h), the final norm's output (a h), and at the
      start of backward the fp32 log-probabilities, their gradient and the
      logits' gradient: 12 x vocab.
    - ``remat``: every block keeps only its input (a h per block); the peak is
      the larger of the start of backward (the inputs, the head's terms) and
      the first block's backward: the inputs of the blocks not yet done, one
      block's recomputed activations and the gradients of its output and MLP
      activation (a (h + f)).
    - ``inference``: nothing is saved; one block's intermediates and the
      logits at a time.

    Returns:
        Bytes (an int).

    Example:
        >>> from zerofn.plan import activation_bytes
        >>> gpt = dict(layers=4, hidden=256, seq=128, micro_batch=8, heads=4, vocab=512, mixed_precision=False)
        >>> round(activation_bytes(**gpt) / 2**20, 1), round(activation_bytes(**gpt, remat=True) / 2**20, 1)
        (72.1, 24.0)
    """
    h, s, b, L = int(hidden), int(seq), int(micro_batch), int(layers)
    a_heads = int(heads or max(1, h // 64))
    h_kv = h * int(kv_heads or a_heads) // a_heads
    f = int(ffn or 4 * h)
    act = 2 if mixed_precision else 4
    norm32 = 4 if (mixed_precision and device != "cpu") else 0  # CUDA autocast: layer norms in fp32
    sb = s * b
    elems = 6 * h + 2 * h_kv + (4 if gated else 2) * f
    stats = 16 + 4 * a_heads
    per_layer = sb * (act * elems + 2 * norm32 * h + stats + (0 if flash else act * a_heads * s))
    x = sb * act * h  # one residual-stream tensor
    if inference:
        return x + per_layer + sb * act * int(vocab)
    head = x + sb * (norm32 * h + 8 + 12 * int(vocab))
    if not remat:
        return x + L * per_layer + head
    start = (L + 1) * x + head
    first_block = L * x + per_layer + sb * act * f
    return max(start, first_block)


# --------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Bytes for one composition: per GPU (a rank's accelerator), per rank and per node on the host.

    Attributes:
        label: the composition, e.g. ``"ZeRO-3 + optimizer on CPU + remat"``.
        stage: ZeRO stage 0-3 (0: DDP; inference: 0 replicated, 3 sharded).
        optimizer_offload: where the optimizer state lives: None (the GPU), "cpu" or "nvme".
        param_offload: "cpu" when ZeRO-3's parameter shards rest in CPU RAM.
        remat: activations recomputed per block.
        mixed_precision: bf16/fp16 with fp32 master weights (else fp32).
        inference: weights only.
        world_size: GPUs in all; gpus_per_node: GPUs per node.
        params: parameter bytes on the GPU between steps.
        grads: gradient bytes on the GPU inside a step (the ZeRO table's share).
        optimizer: optimizer-state bytes on the GPU (0 when held elsewhere).
        activations: activation bytes at the step's peak (0 without shapes).
        gathered: ZeRO-3's gathered units inside a step (0 without layer count).
        update: the update's transient beyond the gradients (fp32 gradient copy under mixed precision).
        cpu: host RAM per rank for state (0 without offload).
        nvme: NVMe bytes per rank.
        state: bytes a TrainState holds per rank between steps, every placement
            (what ``zf.memory.state_bytes(state)["total"]`` reports).
        traffic: elements moved per rank per step (the ZeRO paper's count: 2 Psi, 3 Psi for ZeRO-3).
    """

    label: str
    stage: int
    optimizer_offload: str | None
    param_offload: str | None
    remat: bool
    mixed_precision: bool
    inference: bool
    world_size: int
    gpus_per_node: int
    params: int
    grads: int
    optimizer: int
    activations: int
    gathered: int
    update: int
    cpu: int
    nvme: int
    state: int
    traffic: int

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state on the GPU: the ZeRO paper's table, per GPU (with the
        optimizer state in CPU RAM, the gradients are the few buckets backward is landing)."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """Peak bytes per GPU in a step: model state + max(activations + gathered units, update transient)."""
        return self.model_state + max(self.activations + self.gathered, self.update)

    @property
    def cpu_per_node(self) -> int:
        return self.cpu * self.gpus_per_node

    @property
    def nvme_per_node(self) -> int:
        return self.nvme * self.gpus_per_node

    def fits(self, gpu_memory: float, cpu_memory: float | None = None, nvme: float | None = None) -> bool:
        """Whether ``total`` fits a GPU and the host needs fit per node (None: not checked)."""
        return not self.short(gpu_memory, cpu_memory, nvme)

    def short(self, gpu_memory: float | None, cpu_memory: float | None = None, nvme: float | None = None) -> list[str]:
        """What does not fit: any of ``"GPU"``, ``"CPU"``, ``"NVMe"`` (empty when it fits; None: not checked)."""
        out = []
        if gpu_memory is not None and self.total > gpu_memory:
            out.append("GPU")
        if cpu_memory is not None and self.cpu_per_node > cpu_memory:
            out.append("CPU")
        if nvme is not None and self.nvme_per_node > nvme:
            out.append("NVMe")
        return out

    def order(self) -> tuple:
        """Preference: least traffic, then no offload before CPU before NVMe, then no remat, then lower stage."""
        level = {None: 0, "cpu": 1, "nvme": 3}[self.optimizer_offload] + (1 if self.param_offload else 0)
        return (self.traffic, level, self.remat, self.stage)


def _label(stage: int, optimizer_offload: str | None, param_offload: str | None, remat: bool, inference: bool) -> str:
    if inference:
        text = "replicated" if stage == 0 else f"ZeRO-{stage}"
    else:
        text = "DDP" if stage == 0 else f"ZeRO-{stage}"
    where = {"cpu": "CPU", "nvme": "NVMe"}
    if optimizer_offload and param_offload:
        text += f" + optimizer and params on {where[optimizer_offload]}"
    elif optimizer_offload:
        text += f" + optimizer on {where[optimizer_offload]}"
    elif param_offload:
        text += " + params on CPU"
    return text + (" + remat" if remat else "")


def estimate(
    params: float | ModelShape,
    *,
    gpus: int = 1,
    nodes: int = 1,
    stage: int = 0,
    mixed_precision: bool = True,
    optimizer_offload: str | None = None,
    param_offload: str | None = None,
    remat: bool = False,
    inference: bool = False,
    layers: int | None = None,
    hidden: int | None = None,
    seq: int | None = None,
    micro_batch: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int | None = None,
    gated: bool | None = None,
    flash: bool = True,
    device: str = "cuda",
    bucket_bytes: int = BUCKET_BYTES,
    prefetch: int = PREFETCH,
) -> Estimate:
    """Bytes per GPU, per rank on the host and per node for one zerofn composition (see the module docs).

    Args:
        params: the trainable parameter count Psi, or a :class:`ModelShape`
            (from :func:`model_shape`), whose shapes fill the arguments below
            that are not given.
        gpus: GPUs per node; nodes: nodes. The world size is their product.
        stage: ZeRO stage, 0 (DDP) to 3.
        mixed_precision: bf16/fp16 parameters and gradients with fp32 master
            weights (``amp``); False: fp32 throughout.
        optimizer_offload: None, ``"cpu"`` or ``"nvme"`` (``offload``).
        param_offload: ``"cpu"`` to rest ZeRO-3's parameter shards in CPU RAM
            (``offload(..., params=True)``: needs stage 3 and ``"cpu"``).
        remat: activations recomputed per block.
        inference: 2-byte weights only (no gradients or optimizer state);
            stage 0 replicates them, stage 3 shards them.
        layers, hidden, seq, micro_batch: the shapes for activations (per GPU
            micro-batch); without all four activations count 0. heads,
            kv_heads, ffn (default 4 x hidden), vocab (default 0: no logits),
            gated (SwiGLU MLP) refine them; see :func:`activation_bytes`.
        flash: flash/SDPA attention (no s^2 attention matrix saved).
        device: ``"cuda"`` (layer norms in fp32 under autocast) or ``"cpu"``.
        bucket_bytes: zerofn's gradient bucket size (padding, ZeRO-2's buckets).
        prefetch: ZeRO-3's prefetch.

    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: a stage outside 0-3, an unknown offload device, or a
            combination zerofn does not run (parameters on the host without
            stage 3 or without the optimizer on the CPU).

    Example:
        >>> from zerofn import memory
        >>> e = memory.estimate(7e9, gpus=8, stage=2)                  # bf16 + Adam over 8 GPUs
        >>> [round(x / 1e9, 2) for x in (e.params, e.grads, e.optimizer)]  # 2 Psi, 2 Psi / 8 + 2 buckets, 12 Psi / 8
        [14.0, 1.8, 10.5]
        >>> round(e.state / 1e9, 2)                                     # what the TrainState holds between steps
        24.5
    """
    shape = params if isinstance(params, ModelShape) else None
    if shape is not None:
        layers = shape.layers if layers is None else layers
        hidden = shape.hidden if hidden is None else hidden
        heads = shape.heads if heads is None else heads
        kv_heads = shape.kv_heads if kv_heads is None else kv_heads
        ffn = shape.ffn if ffn is None else ffn
        vocab = shape.vocab if vocab is None else vocab
        gated = shape.gated if gated is None else gated
        psi = shape.params
    else:
        psi = int(round(float(params)))
    if psi <= 0:
        raise ValueError(f"estimate: the parameter count must be positive, got {params!r}")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"estimate: stage must be 0 (DDP), 1, 2 or 3, got {stage!r}")
    if optimizer_offload not in _DEVICES:
        raise ValueError(f'estimate: optimizer_offload must be None, "cpu" or "nvme", got {optimizer_offload!r}')
    if param_offload not in (None, "cpu"):
        raise ValueError(f'estimate: param_offload must be None or "cpu", got {param_offload!r}')
    if inference and (optimizer_offload or remat):
        raise ValueError("estimate: inference holds no optimizer state and saves no activations")
    if param_offload and stage != 3:
        raise ValueError("estimate: parameters rest on the host only under ZeRO-3 (stage=3)")
    if param_offload and not inference and optimizer_offload != "cpu":
        raise ValueError(
            'estimate: parameters on the host come with the optimizer state in CPU RAM (optimizer_offload="cpu")'
        )
    gpus, nodes = int(gpus), int(nodes)
    if gpus < 1 or nodes < 1:
        raise ValueError(f"estimate: gpus and nodes must be at least 1, got {gpus} and {nodes}")
    n = gpus * nodes

    pb = 2 if (mixed_precision or inference) else 4  # parameter (and gradient) bytes
    k = 12 if mixed_precision else 8  # optimizer bytes per parameter: fp32 master + Adam moments, or the moments
    layer_params = None
    if layers:
        if shape is not None and shape.layer_params:
            layer_params = shape.layer_params
        elif hidden:
            f = ffn or 4 * hidden
            layer_params = 4 * hidden * hidden + (3 if gated else 2) * hidden * f
        else:
            layer_params = psi // layers
        layer_params = min(layer_params, psi // layers)
    # Buckets, each padded to a multiple of N elements (at most N - 1 each): flat buckets of
    # bucket_bytes for stages 1-2, one bucket per unit (each block and the root) for ZeRO-3.
    if stage == 3:
        buckets = (layers or 0) + 1
    else:
        buckets = max(1, math.ceil(psi * pb / bucket_bytes))
    padded = psi + (buckets * (n - 1) if stage >= 1 and n > 1 else 0)
    shard = padded // n if stage >= 1 else psi  # what the optimizer updates on this rank

    acts = 0
    if layers and hidden and seq and micro_batch:
        acts = activation_bytes(
            layers=layers, hidden=hidden, seq=seq, micro_batch=micro_batch, heads=heads, kv_heads=kv_heads,
            ffn=ffn, vocab=vocab or 0, gated=bool(gated), mixed_precision=mixed_precision or inference,
            remat=remat, inference=inference, flash=flash, device=device,
        )  # fmt: skip
    gathered = 0
    if stage == 3 and layer_params:
        root = psi - layers * layer_params
        per_param = pb if inference else 2 * pb  # full parameters (and, training, their gradients)
        gathered = root * per_param + min(prefetch + 2, layers) * layer_params * per_param

    label = _label(stage, optimizer_offload, param_offload, remat, inference)
    common = dict(
        label=label, stage=stage, optimizer_offload=optimizer_offload, param_offload=param_offload, remat=remat,
        mixed_precision=mixed_precision and not inference, inference=inference, world_size=n, gpus_per_node=gpus,
        activations=acts, gathered=gathered,
    )  # fmt: skip
    if inference:
        held = pb * (padded // n if stage == 3 else psi)
        return Estimate(
            **common, params=0 if param_offload else held, grads=0, optimizer=0, update=0,
            cpu=held if param_offload else 0, nvme=0, state=held, traffic=psi if (stage == 3 and n > 1) else 0,
        )  # fmt: skip

    param_bytes = pb * (padded // n if stage == 3 else (padded if stage >= 1 else psi))
    if stage <= 1:
        grads = pb * psi  # the whole gradient (stage 1 keeps whole local sums when accumulating)
    elif stage == 2:
        grads = min(pb * psi, pb * shard + 2 * bucket_bytes)  # the partition, one bucket filling, one in flight
    else:
        grads = pb * shard
    opt_state = k * shard + ADAM_COUNT_BYTES
    # The update: mixed precision casts the reduced partition to fp32 on the GPU for the master weights;
    # full precision makes one bucket-sized temporary.
    update = 4 * shard if mixed_precision else min(bucket_bytes, 4 * shard)
    cpu = nvme = 0
    state = param_bytes + opt_state
    if optimizer_offload == "cpu":
        # Each bucket's reduced gradient leaves for the host as backward lands it (cast to fp32 first
        # under mixed precision), so there is no update transient and the GPU holds a few buckets of
        # gradient: when a bucket completes, its gradients and its buffer and the bucket before it in
        # flight; when that one lands, the two buffers and the landing one's fp32 copy.
        whole = pb * (psi if stage < 3 else shard)
        bucket = min(bucket_bytes, whole)
        copy = min(4 * shard, 2 * bucket) if mixed_precision else 0
        grads = max(3 * bucket, 2 * bucket + copy) if whole > 2 * bucket_bytes else max(2 * whole, whole + copy)
        update = 0
        host_params = pb * shard  # a host copy of what the optimizer updates, or the parameters themselves
        cpu = opt_state + 4 * shard + (0 if param_offload else host_params)  # + the fp32 gradient buffer
        state += 4 * shard + (0 if param_offload else host_params)
        if param_offload:
            cpu += param_bytes
    elif optimizer_offload == "nvme":
        nvme = (2 * k + pb) * shard  # two generations of the state files and the parameters' staging copy
        cpu = NVME_SUB_GROUPS_IN_RAM * min(NVME_SUB_GROUP_BYTES, k * shard)
    return Estimate(
        **common, params=0 if param_offload else param_bytes, grads=grads,
        optimizer=0 if optimizer_offload else opt_state, update=update, cpu=cpu, nvme=nvme, state=state,
        traffic=0 if n == 1 else (3 if stage == 3 else 2) * psi,
    )  # fmt: skip


def compositions(
    params: float | ModelShape, *, inference: bool = False, remat: bool | None = None, **kwargs: Any
) -> list[Estimate]:
    """Every composition :func:`main` tabulates, in preference order (see ``Estimate.order``).

    Training: DDP and ZeRO-1, 2, 3, each with the optimizer state on the
    GPU, in CPU RAM or on NVMe, and ZeRO-3 with its parameters in CPU RAM
    too; each with and without remat when ``remat`` is None and the shapes
    for activations are given. Inference: replicated, ZeRO-3, ZeRO-3 with
    parameters in CPU RAM.

    Example:
        >>> from zerofn.plan import compositions
        >>> [e.label for e in compositions(1e9, gpus=2)][:4]
        ['DDP', 'ZeRO-1', 'ZeRO-2', 'DDP + optimizer on CPU']
    """
    if inference:
        rows = [estimate(params, inference=True, stage=s, param_offload=p, **kwargs)
                for s, p in ((0, None), (3, None), (3, "cpu"))]  # fmt: skip
        return sorted(rows, key=Estimate.order)
    shaped = isinstance(params, ModelShape) or all(kwargs.get(x) for x in ("layers", "hidden"))
    has_acts = shaped and bool(kwargs.get("seq")) and bool(kwargs.get("micro_batch"))
    remats = (False, True) if (remat is None and has_acts) else (bool(remat),)
    rows = []
    for r in remats:
        for stage in (0, 1, 2, 3):
            for dev in _DEVICES:
                rows.append(estimate(params, stage=stage, optimizer_offload=dev, remat=r, **kwargs))
        rows.append(estimate(params, stage=3, optimizer_offload="cpu", param_offload="cpu", remat=r, **kwargs))
    return sorted(rows, key=Estimate.order)


# --------------------------------------------------------------------------
# python -m zerofn plan
# --------------------------------------------------------------------------

_SIZE_UNITS = {
    "": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
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


def _size(text: str) -> float:
    return _parse(text, _SIZE_UNITS, "a size such as 80GB, 1TB or 512GiB")


def _count(text: str) -> float:
    return _parse(text, _COUNT_UNITS, "a parameter count such as 70e9, 70B or 124M")


def fmt_bytes(n: float) -> str:
    """Bytes in decimal units, as GPU makers count them: ``1.12 TB``, ``140.0 GB``, ``512.0 MB``."""
    n = float(n)
    for unit, scale, digits in (("TB", 1e12, 2), ("GB", 1e9, 1), ("MB", 1e6, 1), ("KB", 1e3, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def _fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m zerofn plan",
        description="Bytes per GPU, CPU RAM and NVMe per node for DDP and ZeRO-1, 2, 3 with the optimizer state "
        "(and ZeRO-3's parameters) on the GPU, in CPU RAM or on NVMe, with and without remat; what fits, and "
        "the composition to use.",
    )
    p.add_argument("--params", type=_count, help="trainable parameters (70e9, 70B, 124M)")
    p.add_argument("--model", metavar="CONFIG", help="a Hugging Face config.json or its directory: size and shapes")
    p.add_argument("--gpus", type=int, default=1, help="GPUs per node (default 1)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpu-memory", type=_size, required=True, help="memory of one GPU (80GB, 24GB)")
    p.add_argument("--cpu-memory", type=_size, default=None, help="CPU RAM per node (not checked if absent)")
    p.add_argument("--nvme", type=_size, default=None, help="NVMe space per node (not checked if absent)")
    p.add_argument("--layers", type=int, help="transformer blocks")
    p.add_argument("--hidden", type=int, help="hidden size")
    p.add_argument("--heads", type=int, help="attention heads (default hidden / 64)")
    p.add_argument("--ffn", type=int, help="MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, help="vocabulary (the logits' activations)")
    p.add_argument("--seq", type=int, help="sequence length")
    p.add_argument("--micro-batch", type=int, help="sequences per GPU per micro-step")
    p.add_argument("--inference", action="store_true", help="weights only, 2 bytes per parameter (fp16/bf16)")
    p.add_argument("--fp32", action="store_true", help="full precision training (4 + 4 + 8 bytes per parameter)")
    p.add_argument("--plot", metavar="FILE.png", help="draw bytes per GPU by composition against the GPU memory")
    return p


def _recommend(rows: list[Estimate], gpu: float, cpu: float | None, nvme: float | None) -> Estimate | None:
    return next((e for e in rows if e.fits(gpu, cpu, nvme)), None)


def plan_text(rows: list[Estimate], *, gpu: float, cpu: float | None, nvme: float | None, psi: int, title: str) -> str:
    """The table and verdicts :func:`main` prints."""
    lines = [title]
    e0 = rows[0]
    if e0.inference:
        lines.append(f"weights: 2 bytes x {_fmt_count(psi)} = {fmt_bytes(2 * psi)}")
    else:
        k = 12 if e0.mixed_precision else 8
        pb = 2 if e0.mixed_precision else 4
        lines.append(
            f"model state: {pb} + {pb} + {k} bytes per parameter (parameters + gradients + optimizer state) "
            f"= {fmt_bytes(16 * psi)} in all, on every GPU under DDP"
        )
    show_acts = any(e.activations for e in rows)
    head = ["composition", "params", "grads", "optimizer"] + (["activations"] if show_acts else [])
    head += ["gathered", "update", "model state", "per GPU", "CPU/node", "NVMe/node", "fits"]
    table = []
    for e in rows:
        short = e.short(gpu, cpu, nvme)
        verdict = "yes" if not short else "no: " + ", ".join(short)
        unchecked = [w for w, lim, need in (("CPU", cpu, e.cpu), ("NVMe", nvme, e.nvme)) if lim is None and need]
        if not short and unchecked:
            verdict += f" ({', '.join(unchecked)} not checked)"
        b = lambda n: fmt_bytes(n) if n else "-"  # noqa: E731
        cells = [e.label, b(e.params), b(e.grads), b(e.optimizer)] + ([b(e.activations)] if show_acts else [])
        cells += [b(e.gathered), b(e.update), b(e.model_state), b(e.total), b(e.cpu_per_node), b(e.nvme_per_node)]
        cells.append(verdict)
        table.append(cells)
    widths = [max(len(r[i]) for r in [head] + table) for i in range(len(head))]
    def fmt_row(r: list[str]) -> str:  # names and verdicts left-aligned, numbers right-aligned
        return "  ".join(c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    lines += ["", fmt_row(head)] + [fmt_row(r) for r in table] + [""]
    best = _recommend(rows, gpu, cpu, nvme)
    if best is None:
        lines.append(f"recommendation: nothing fits in {fmt_bytes(gpu)} per GPU on {e0.world_size} GPU(s): add GPUs, "
                     "shorten sequences or micro-batches, or use bigger GPUs")  # fmt: skip
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
            f"model state per GPU (the ZeRO table: parameters + gradients + optimizer state, no activations or "
            f"transients): DDP {fmt_bytes(ddp.model_state)}, ZeRO-3 {fmt_bytes(z3.model_state)}, which "
            f"{'fits' if z3.model_state <= gpu else 'does not fit'} in {fmt_bytes(gpu)}; "
            + (f"first to fit: {state_fit.label} ({fmt_bytes(state_fit.model_state)})" if state_fit
               else "no composition's model state fits")
        )  # fmt: skip
        host = next(e for e in rows if e.optimizer_offload == "cpu" and e.stage == 3 and not e.param_offload)
        k = 12 if e0.mixed_precision else 8
        pb = 2 if e0.mixed_precision else 4
        lines.append(
            f"optimizer state in CPU RAM: zerofn holds {pb + 4 + k} bytes per parameter on the host ({k} optimizer "
            f"state + 4 fp32 gradient buffer + {pb} parameter copy), "
            f"{fmt_bytes(host.cpu_per_node * host.world_size / host.gpus_per_node)} for the whole model over all "
            f"nodes; ZeRO-Offload write-ups count {k} ({fmt_bytes(k * psi)})"
        )  # fmt: skip
        if e0.mixed_precision:
            lines.append(
                "the update casts each rank's gradient partition to fp32 on the GPU (4 bytes per parameter / N beside "
                "the 2-byte partition): the 'update' column, which offloading the optimizer state does not remove"
            )
    if not show_acts:
        lines.append("activations not counted: pass --layers, --hidden, --seq and --micro-batch (or --model with --seq "
                     "and --micro-batch)")  # fmt: skip
    if any(e.stage == 3 for e in rows) and not any(e.gathered for e in rows):
        lines.append("ZeRO-3's gathered blocks not counted: pass --layers (or --model)")
    lines.append("leave headroom for the CUDA context, the allocator's fragmentation and communication buffers")
    return "\n".join(lines)


def plot(rows: list[Estimate], gpu: float, path: str, title: str = "") -> None:
    """Stacked bars of bytes per GPU by composition, with the GPU memory as a line (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "python -m zerofn plan --plot needs matplotlib, which is not installed: pip install zerofn[plot] "
            "(or pip install matplotlib)"
        ) from None
    labels = [e.label.replace(" + ", "\n+ ") for e in rows]
    parts = [
        ("parameters", [e.params for e in rows]),
        ("gradients", [e.grads for e in rows]),
        ("optimizer state", [e.optimizer for e in rows]),
        ("activations, gathered units, update", [max(e.activations + e.gathered, e.update) for e in rows]),
    ]
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * len(rows)), 5.5))
    bottom = [0.0] * len(rows)
    for name, vals in parts:
        gb = [v / 1e9 for v in vals]
        ax.bar(range(len(rows)), gb, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, gb)]
    ax.axhline(gpu / 1e9, color="black", linestyle="--", label=f"GPU memory ({fmt_bytes(gpu)})")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=90, fontsize=7)
    ax.set_ylabel("GB per GPU")
    top = max(bottom)
    if top > 20 * gpu / 1e9:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m zerofn plan ...``: print the table and the recommendation; returns the exit status."""
    p = _parser()
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    if (args.params is None) == (args.model is None):
        p.error("give either --params or --model")
    if args.gpus < 1 or args.nodes < 1:
        p.error("--gpus and --nodes must be at least 1")
    if args.fp32 and args.inference:
        p.error("--inference counts 2-byte weights; --fp32 is for training")
    if args.plot:
        try:
            importlib.import_module("matplotlib")
        except ImportError:
            print(
                "error: --plot needs matplotlib, which is not installed: pip install zerofn[plot] (or pip install "
                "matplotlib)", file=sys.stderr,
            )  # fmt: skip
            return 2
    try:
        source: float | ModelShape = model_shape(args.model) if args.model else args.params
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shape_kw = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "vocab", "seq", "micro_batch")}
    shape_kw = {k: v for k, v in shape_kw.items() if v is not None}
    kw = dict(gpus=args.gpus, nodes=args.nodes, **shape_kw)
    if not args.inference:
        kw["mixed_precision"] = not args.fp32
    rows = compositions(source, inference=args.inference, **kw)
    psi = source.params if isinstance(source, ModelShape) else int(round(source))
    n = args.gpus * args.nodes
    what = "fp32, Adam" if args.fp32 else "bf16 mixed precision, Adam"
    what = "inference, fp16/bf16 weights" if args.inference else what
    name = f" ({source.name})" if isinstance(source, ModelShape) and source.name else ""
    title = (
        f"{_fmt_count(psi)} parameters{name} on {n} GPU(s) ({args.nodes} node(s) x {args.gpus}), "
        f"{fmt_bytes(args.gpu_memory)} each; {what}"
    )
    print(plan_text(rows, gpu=args.gpu_memory, cpu=args.cpu_memory, nvme=args.nvme, psi=psi, title=title))
    if args.plot:
        try:
            plot(rows, args.gpu_memory, args.plot, title)
        except ImportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

