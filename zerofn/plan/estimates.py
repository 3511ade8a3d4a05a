"""The estimate: bytes per GPU, CPU RAM and NVMe of one composition (:func:`estimate`), and of all
that ``python -m zerofn plan`` tabulates (:func:`compositions`). The arithmetic is described in
:mod:`zerofn.plan`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from zerofn import optim as O
from zerofn.plan.activations import activation_bytes
from zerofn.plan.lora import LoraPlan, lora_plan, projections
from zerofn.plan.shapes import ModelShape
from zerofn.plan.tensor import TensorParallelPlan, tensor_parallel_plan

__all__ = [
    "ADAM_COUNT_BYTES",
    "BUCKET_BYTES",
    "NVME_LANDING_BUFFERS",
    "NVME_SUB_GROUP_BYTES",
    "NVME_UPDATE_BUFFERS",
    "PREFETCH",
    "Estimate",
    "OptimizerBytes",
    "compositions",
    "estimate",
    "nvme_read_buffers",
    "optimizer_bytes",
]

# zerofn's defaults, repeated here so that planning depends on no step or transform (tests check they agree):
BUCKET_BYTES = 25 * 2**20  # zerofn.step.DEFAULT_BUCKET_BYTES
NVME_SUB_GROUP_BYTES = 64 * 2**20  # the NVMe update's sub-group (transforms/offload.py)
# offload("nvme")'s host pools (docs/transforms/offload.md), as many buffers as the transform makes:
NVME_UPDATE_BUFFERS = 4  # the update's sub-groups: the one read ahead, the one updated, two being written
NVME_LANDING_BUFFERS = 3  # gradients copied off the GPU on their way to their files: two being written, one landing
PREFETCH = 1  # ZeRO-3's default prefetch
ADAM_COUNT_BYTES = 8  # the optimizer's int64 step count

_DEVICES = (None, "cpu", "nvme")


def nvme_read_buffers(prefetch: int = PREFETCH) -> int:
    """The buffers ZeRO-3's parameter shards are read into from their files (``offload(..., params="nvme")``):
    one per unit read ahead (``prefetch + 2``) or still being gathered (``prefetch + 1``)."""
    return (prefetch + 2) + (prefetch + 1)


QUANTIZE_NEEDS_LORA = (
    "estimate: quantize={quantize!r} without lora_rank: quantize holds the model's frozen Linear weights "
    "quantized (NF4 or int8, dequantized per call), and without LoRA adapters every Linear is trainable, so "
    "nothing would be frozen to quantize. Pass lora_rank= (python -m zerofn plan: --lora-rank R) for QLoRA, or "
    "leave quantize out to plan full training."
)


@dataclass(frozen=True)
class OptimizerBytes:
    """What an optimizer's state holds, as the planner counts it (:func:`optimizer_bytes`).

    Attributes:
        per_element: bytes per parameter element of its parameter-shaped state (Adam in fp32: 8, with
            bf16 moments 4), amp's master weights not included.
        fixed: bytes of its other tensors (step counts), whatever the model's size.
    """

    per_element: int
    fixed: int


ADAM = OptimizerBytes(8, ADAM_COUNT_BYTES)  # Adam's two fp32 moments and its step count


def optimizer_bytes(optimizer: O.GradientTransformation | None, dtype: torch.dtype = torch.float32) -> OptimizerBytes:
    """What ``optimizer``'s state holds per parameter element and besides, found by initialising it on one
    two-element parameter of ``dtype`` (:func:`zerofn.optim.probe_state`; fp32: amp's master weights, or the
    parameters in full precision, are what it updates; bf16 under ``amp(..., master_dtype=torch.bfloat16)``,
    where its moments default to bf16). None: Adam with fp32 moments.

    Under ``multi_transform`` the probe's parameter gets one group's transformation (the one its label
    function gives a 1-D tensor); for groups whose states differ in size, pass the largest group's
    optimizer to over-count rather than under-count.

    Example:
        >>> import torch
        >>> from zerofn import optim
        >>> from zerofn.plan import optimizer_bytes
        >>> optimizer_bytes(optim.adamw(1e-3, mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16))
        OptimizerBytes(per_element=4, fixed=8)
    """
    if optimizer is None:
        return ADAM
    if not isinstance(optimizer, O.GradientTransformation):
        raise TypeError(
            f"estimate: optimizer must be a zf.optim optimizer such as zf.optim.adamw(3e-4), got "
            f"{type(optimizer).__name__}"
        )
    probe = O.probe_state(optimizer, dtype)
    fixed = sum(t.numel() * t.dtype.itemsize for t in probe.small if isinstance(t, torch.Tensor))
    return OptimizerBytes(probe.bytes_per_element, fixed)


@dataclass(frozen=True)
class Estimate:
    """Bytes for one composition: per GPU (a rank's accelerator), per rank and per node on the host.

    Attributes:
        label: the composition, e.g. ``"ZeRO-3 + optimizer on CPU + remat"``.
        stage: ZeRO stage 0-3 (0: DDP; inference: 0 replicated, 3 sharded).
        optimizer_offload: where the optimizer state lives: None (the GPU), "cpu" or "nvme".
        param_offload: where ZeRO-3's parameter shards rest between uses: None (the GPU), "cpu" (CPU RAM)
            or "nvme" (files, beside an optimizer state on NVMe: ZeRO-Infinity).
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
        cpu: host RAM per rank for state and offload's pools of host buffers (0 without offload).
        nvme: NVMe bytes per rank: every file, both generations of those the update rewrites.
        state: bytes a TrainState holds per rank between steps, every placement
            (what ``zf.memory.state_bytes(state)["total"]`` reports: of files, the current generation).
        traffic: elements moved per rank per step (the ZeRO paper's count: 2 Psi, 3 Psi for ZeRO-3).
        optimizer_per_param: K, optimizer-state bytes per parameter (fp32 master and Adam's moments: 12;
            the moments alone in full precision: 8; 0 for inference).
        state_cpu, state_nvme: the parts of ``state`` in CPU RAM and in files on NVMe (the current
            generation of each file, as ``state_bytes`` counts them); the rest is on the GPU. See
            :meth:`by_placement`.
        frozen: bytes of the frozen base on the GPU between steps (``lora_rank=``: every parameter but the
            adapters, its projections quantized under ``quantize=``; this rank's shard under ZeRO-3; 0 when
            the shards rest on the host). ``params`` then counts the adapters only.
        dequant: the in-step transient of a quantized base: one projection's weight dequantized for its
            call (the largest's, forward and again in backward; 0 unquantized).
        lora: the adapters and the frozen base (:class:`~zerofn.plan.LoraPlan`), or None: every parameter
            trainable.
        tensor_parallel: the split of ``estimate(..., tp=)`` (:class:`~zerofn.plan.TensorParallelPlan`), or
            None (tp 1). The columns above are then one GPU's, of the parameters it holds, sharded over
            the data-parallel ranks (``world_size / tp``), and ``traffic`` counts those over those ranks.
        tp_traffic: bytes all-reduced on the tensor-parallel group per micro-batch (4 all-reduces of the
            activations a block, 6 under remat; 0 without ``tp`` or without ``seq`` and ``micro_batch``).
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
    optimizer_per_param: int = 0
    state_cpu: int = 0
    state_nvme: int = 0
    frozen: int = 0
    dequant: int = 0
    lora: LoraPlan | None = None
    tensor_parallel: TensorParallelPlan | None = None
    tp_traffic: int = 0

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state on the GPU: the ZeRO paper's table, per GPU (with the
        optimizer state in CPU RAM, the gradients are the few buckets backward is landing), and a frozen
        base on the GPU beside the adapters."""
        return self.params + self.frozen + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """Peak bytes per GPU in a step: model state + max(activations + gathered units + a quantized
        projection's dequantized weight, update transient)."""
        return self.model_state + max(self.activations + self.gathered + self.dequant, self.update)

    @property
    def cpu_per_node(self) -> int:
        return self.cpu * self.gpus_per_node

    @property
    def nvme_per_node(self) -> int:
        return self.nvme * self.gpus_per_node

    def by_placement(self, device: str = "cuda") -> dict[str, int]:
        """``state`` per placement, as ``zf.memory.state_bytes(state)["by_placement"]`` reports it for a step
        that computes on ``device`` (``"cpu"``: the GPU's part and the host's are one); placements holding
        nothing are left out."""
        out = {device: self.state - self.state_cpu - self.state_nvme}
        out["cpu"] = out.get("cpu", 0) + self.state_cpu
        out["nvme"] = self.state_nvme
        return {k: v for k, v in out.items() if v}

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
        """Preference: least traffic, then no offload before CPU before NVMe (the optimizer state on the GPU,
        in CPU RAM, in CPU RAM with the parameters, on NVMe, on NVMe with the parameters in CPU RAM, on NVMe
        with the parameters there too), then no remat, then lower stage."""
        level = {None: 0, "cpu": 1, "nvme": 3}[self.optimizer_offload] + {None: 0, "cpu": 1, "nvme": 2}[
            self.param_offload
        ]
        return (self.traffic, level, self.remat, self.stage)


_WHERE = {"cpu": "in CPU RAM", "nvme": "on NVMe"}


def _param_placement(param_offload: Any, optimizer_offload: str | None) -> str | None:
    """``estimate``'s ``param_offload`` as a placement, as ``offload``'s ``params`` is read: None or False (the
    GPU), "cpu", "nvme", or True (the optimizer state's placement, CPU RAM when it has none)."""
    if param_offload is None or param_offload is False:
        return None
    if param_offload is True:
        return optimizer_offload or "cpu"
    if param_offload in ("cpu", "nvme"):
        return param_offload
    raise ValueError(f'estimate: param_offload must be None, "cpu" or "nvme" (or True, False), got {param_offload!r}')


def _label(stage: int, optimizer_offload: str | None, param_offload: str | None, remat: bool, inference: bool) -> str:
    if inference:
        text = "replicated" if stage == 0 else f"ZeRO-{stage}"
    else:
        text = "DDP" if stage == 0 else f"ZeRO-{stage}"
    where = {"cpu": "CPU", "nvme": "NVMe"}
    if optimizer_offload and param_offload:
        text += f" + params on {where[param_offload]}, optimizer on {where[optimizer_offload]}"
    elif optimizer_offload:
        text += f" + optimizer on {where[optimizer_offload]}"
    elif param_offload:
        text += " + params on CPU"
    return text + (" + remat" if remat else "")


def _block_shape(layers, hidden, heads, kv_heads, shape, ffn, gated, layer_params) -> dict:
    """The blocks' shapes as tensor_parallel_plan and lora_plan take them."""
    return dict(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=shape and shape.head_dim,
        ffn=ffn,
        gated=bool(gated),
        layer_params=layer_params,
    )


def estimate(
    params: float | ModelShape,
    *,
    gpus: int = 1,
    nodes: int = 1,
    stage: int = 0,
    mixed_precision: bool = True,
    master_weights: bool = True,
    optimizer_offload: str | None = None,
    param_offload: str | bool | None = None,
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
    optimizer: O.GradientTransformation | None = None,
    lora_rank: int | None = None,
    quantize: str | None = None,
    tp: int = 1,
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
        master_weights: with ``mixed_precision``, amp's fp32 master copy (4 bytes per
            parameter in the optimizer state). False: none, as ``amp(..., master_dtype=torch.bfloat16)``
            (DeepSpeed's ``bf16_master_weights_and_grads``): the optimizer updates the bf16 parameters
            with bf16 gradients, its state probed on a bf16 parameter (bf16 moments unless its
            ``mu_dtype``/``nu_dtype`` say otherwise; ``optimizer=None`` still counts fp32 moments).
        optimizer_offload: None, ``"cpu"`` or ``"nvme"`` (``offload``).
        param_offload: where ZeRO-3's parameter shards rest between uses, as
            ``offload(..., params=)`` takes it: None or False (the GPU), ``"cpu"``
            (CPU RAM; needs stage 3 and the optimizer state off the GPU, ``"cpu"``
            or ``"nvme"``), ``"nvme"`` (files, read ahead of each unit's gather;
            needs stage 3 and ``optimizer_offload="nvme"``: ZeRO-Infinity), or
            True: the optimizer state's own placement.
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
        prefetch: ZeRO-3's prefetch (with ``param_offload="nvme"`` it sizes the pool the shards are read
            into: :func:`nvme_read_buffers`).
        optimizer: the ``zf.optim`` optimizer, whose state is counted as it holds it (see
            :func:`optimizer_bytes`: ``adamw(..., mu_dtype=torch.bfloat16, nu_dtype=torch.bfloat16)``
            holds 4 bytes per parameter where fp32 moments hold 8); None: Adam with fp32 moments.
        lora_rank: LoRA adapters of this rank on every linear projection of every
            block (q, k, v, o, gate, up, down for a gated, Llama-shaped block; q, k, v,
            o, up, down otherwise), r x (in + out) parameters each, as peft adds them:
            they are the trainable parameters (Psi of the table, with gradients and
            optimizer state); the model's own parameters (``params``) are the frozen
            base, held in the parameters' dtype (2 bytes under mixed precision, 4 in
            fp32), sharded under ZeRO-3 and gathered per unit with the adapters,
            resting on the host with ``param_offload``. Needs the shapes: a
            :class:`ModelShape`, or ``layers`` and ``hidden``. None: every parameter
            trainable. See :mod:`zerofn.plan.lora`.
        quantize: ``"nf4"`` or ``"int8"``: the base's projection weights held as
            ``zerofn.transforms.quantize(step, quantize)`` holds them (block size 64),
            at the codec's exact bytes (NF4: 0.516 bytes per parameter with its
            scales; int8: 1.0625); the embeddings, head, norms and biases stay in the
            parameters' dtype. ZeRO-3 gathers the quantized bytes, and each
            projection's weight is dequantized just for its call (``Estimate.dequant``).
            Needs ``lora_rank``: quantize holds frozen weights only.
        tp: tensor parallelism, ``tensor_parallel(step, tp)``: every block's q, k, v, o and MLP
            projections split over ``tp`` consecutive GPUs (Megatron's column- and row-wise layers,
            attention's heads whole), and, from a :class:`ModelShape`, an untied embedding and head
            over the vocabulary when ``tp`` divides it (logits ``vocab / tp`` wide per GPU); everything
            else (norms, a tied embedding) whole on each; the step runs on the ``gpus x nodes / tp`` data-parallel ranks, over which ``stage`` shards
            what one GPU holds. Each GPU's parameters, gradients and optimizer state are those of its
            ``1 / tp`` of the split layers and of the whole rest; activations split attention's and the
            MLP's intermediates by ``tp`` (the residual stream and the norms' inputs stay whole: no
            sequence parallelism); ``Estimate.tp_traffic`` counts the activations' all-reduces. ``tp``
            must divide the GPUs per node (a group stays in a node), the attention heads, the
            key/value heads and the MLP's width; it needs the shapes. See :mod:`zerofn.plan.tensor`.

    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: a stage outside 0-3, an unknown offload device, or a
            combination zerofn does not run (parameters off the GPU without
            stage 3 or with the optimizer state on the GPU; parameters on NVMe
            without the optimizer state there too); ``quantize`` without
            ``lora_rank``, or either with ``inference`` or without the shapes; a
            ``tp`` that does not divide the GPUs per node, the heads or the MLP's
            width, or with ``lora_rank`` or ``inference``.

    Example:
        >>> from zerofn import memory
        >>> e = memory.estimate(7e9, gpus=8, stage=2)                  # bf16 + Adam over 8 GPUs
        >>> [round(x / 1e9, 2) for x in (e.params, e.grads, e.optimizer)]  # 2 Psi, 2 Psi / 8 + 2 buckets, 12 Psi / 8
        [14.0, 1.8, 10.5]
        >>> round(e.state / 1e9, 2)                                     # what the TrainState holds between steps
        24.5
        >>> from zerofn.plan import model_shape                         # QLoRA: Llama-2-7B, rank 16, NF4 base
        >>> llama2_7b = model_shape({"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096,
        ...     "num_hidden_layers": 32, "intermediate_size": 11008, "num_attention_heads": 32})
        >>> q = memory.estimate(llama2_7b, stage=3, lora_rank=16, quantize="nf4")
        >>> round(q.lora.trainable / 1e6, 1), round(q.frozen / 1e9, 2), round(q.state / 1e9, 2)
        (40.0, 3.6, 4.16)
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
    param_offload = _param_placement(param_offload, optimizer_offload)
    if inference and (optimizer_offload or remat):
        raise ValueError("estimate: inference holds no optimizer state and saves no activations")
    if inference and param_offload == "nvme":
        raise ValueError(
            'estimate: param_offload="nvme" streams the parameter shards from files beside an optimizer state on '
            'NVMe, which inference does not hold; keep the weights in CPU RAM: stage=3, param_offload="cpu"'
        )
    if param_offload and stage != 3:
        beside = "nvme" if param_offload == "nvme" else optimizer_offload or "cpu"  # what offload takes with it
        raise ValueError(
            f"estimate: parameters rest {_WHERE[param_offload]} only under ZeRO-3, which gathers them unit by unit "
            f'(stage=3): estimate(..., stage=3, optimizer_offload="{beside}", param_offload="{param_offload}")'
        )
    if param_offload == "nvme" and optimizer_offload != "nvme":
        raise ValueError(
            'estimate: param_offload="nvme" streams the parameter shards from files beside an optimizer state that '
            "is on NVMe too (it is six times their size under Adam, so when it fits in RAM the parameters do): "
            'optimizer_offload="nvme", param_offload="nvme" (offload(step, "nvme", path=..., params="nvme")), or '
            'keep both in RAM: optimizer_offload="cpu", param_offload="cpu" (offload(step, "cpu", params="cpu"))'
        )
    if param_offload and not inference and optimizer_offload is None:
        raise ValueError(
            "estimate: parameters on the host come with the optimizer state off the GPU, in CPU RAM or on NVMe "
            '(optimizer_offload="cpu" or "nvme")'
        )
    if quantize is not None and lora_rank is None:
        raise ValueError(QUANTIZE_NEEDS_LORA.format(quantize=quantize))
    if lora_rank is not None and inference:
        raise ValueError(
            f"estimate: lora_rank={lora_rank!r}{f', quantize={quantize!r}' if quantize else ''} plans training "
            "(adapters with gradients and optimizer state); inference=True counts 2-byte weights only. Leave one "
            "of the two out."
        )
    if lora_rank is not None and not (layers and hidden):
        raise ValueError(
            "estimate: lora_rank puts adapters on every block's projections, whose shapes it needs: pass a "
            "ModelShape (zerofn.plan.model_shape(config)) or layers= and hidden= (with heads=, kv_heads=, ffn=, "
            "gated= where they differ from GPT's defaults)"
        )
    if lora_rank is not None and shape is not None and shape.experts > 1:
        raise ValueError(
            f"estimate: lora_rank on a mixture-of-experts model ({shape.experts} experts per block) is not "
            "modelled: its experts are not one Linear per projection. Plan its dense counterpart, or without "
            "lora_rank."
        )
    if tp != 1 and (lora_rank is not None or inference):
        what = f"lora_rank={lora_rank!r}" if lora_rank is not None else "inference=True"
        raise ValueError(
            f"estimate: tp={tp!r} with {what} is not modelled: tensor_parallel splits the trainable Linear "
            "layers of a training step (not LoRA's adapters on a frozen base, not weights alone). Leave one of "
            "the two out."
        )
    gpus, nodes = int(gpus), int(nodes)
    if gpus < 1 or nodes < 1:
        raise ValueError(f"estimate: gpus and nodes must be at least 1, got {gpus} and {nodes}")
    n = world = gpus * nodes

    pb = 2 if (mixed_precision or inference) else 4  # parameter (and gradient) bytes
    masters = mixed_precision and master_weights and not inference  # amp's fp32 copy in the optimizer state
    low = mixed_precision and not master_weights and not inference  # the optimizer updates the bf16 params
    held = optimizer_bytes(optimizer, torch.bfloat16 if low and optimizer is not None else torch.float32)
    # optimizer bytes per parameter: fp32 master + the optimizer's state (Adam's moments: 12), or its state (8)
    k = (4 if masters else 0) + held.per_element
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
    tensor = None
    if tp != 1:
        # One GPU's parameters: its slices of the split layers and the whole rest; from here on Psi counts
        # those, a block (a ZeRO-3 unit) its share, and N the data-parallel ranks the step runs on.
        tensor = tensor_parallel_plan(
            size=tp,
            gpus=gpus,
            nodes=nodes,
            params=psi,
            **_block_shape(layers, hidden, heads, kv_heads, shape, ffn, gated, layer_params),
            biases=(shape.qkv_bias, shape.out_bias, shape.mlp_bias) if shape else (False, False, False),
            experts=shape.experts if shape else 1,
            vocab=vocab,
            tied=shape.tied if shape else True,
            seq=seq,
            micro_batch=micro_batch,
            activation_bytes=2 if mixed_precision else 4,
        )
        psi, layer_params, n = tensor.local, tensor.block, tensor.data
    lora = None
    if lora_rank is not None:
        if shape is None:  # the block as its projections (norms are a rounding error)
            linears = projections(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=None, ffn=ffn, gated=gated)
            layer_params = min(sum(i * o for i, o in linears), psi // layers)
        lora = lora_plan(
            **_block_shape(layers, hidden, heads, kv_heads, shape, ffn, gated, layer_params),
            psi=psi,
            rank=lora_rank,
            quantize=quantize,
            dtype=torch.bfloat16 if pb == 2 else torch.float32,
        )
        psi = lora.trainable  # from here on Psi counts the trainable parameters: the adapters
    # Buckets, each padded to a multiple of N elements (at most N - 1 each): flat buckets of
    # bucket_bytes for stages 1-2, one bucket per unit (each block and the root) for ZeRO-3.
    if stage == 3:
        buckets = (layers or 0) + 1
    else:
        buckets = max(1, math.ceil(psi * pb / bucket_bytes))
    padded = psi + (buckets * (n - 1) if stage >= 1 and n > 1 else 0)
    if lora is not None and stage == 3:  # each block's adapters one bucket, padded to N; the root unit has none
        padded = layers * -(-lora.block_trainable // n) * n
    shard = padded // n if stage >= 1 else psi  # what the optimizer updates on this rank

    acts = 0
    if layers and hidden and seq and micro_batch:
        acts = activation_bytes(
            layers=layers,
            hidden=hidden,
            seq=seq,
            micro_batch=micro_batch,
            heads=heads,
            kv_heads=kv_heads,
            ffn=ffn,
            vocab=(vocab or 0) // (tp if tensor is not None and tensor.vocab_split else 1),  # the logits per GPU
            gated=bool(gated),
            mixed_precision=mixed_precision or inference,
            remat=remat,
            inference=inference,
            flash=flash,
            device=device,
            lora_rank=lora.rank if lora else 0,
            tp=tp,
        )
    gathered = 0
    # ZeRO-3's units in flight at once: the root unit (embeddings, head, final norm) and prefetch + 2 blocks.
    # Without the layer count the model is one unit: all of it.
    # this rank's shards of the root unit and of a block, and the blocks (the read pool's buffers: see below)
    root_shard, block_shard, blocks = pb * math.ceil(psi / n), 0, 0
    if stage == 3 and lora is not None:
        # The frozen base at the bytes it is held in (quantized parts), the adapters and their gradients.
        in_flight = min(prefetch + 2, layers)
        gathered = lora.root_bytes() + in_flight * (lora.block_bytes() + 2 * pb * lora.block_trainable)
        root_shard = math.ceil(lora.root_bytes() / n)
        block_shard, blocks = math.ceil((lora.block_bytes() + pb * lora.block_trainable) / n), layers
    elif stage == 3 and layer_params:
        root = psi - layers * layer_params
        per_param = pb if inference else 2 * pb  # full parameters (and, training, their gradients)
        gathered = root * per_param + min(prefetch + 2, layers) * layer_params * per_param
        root_shard, block_shard, blocks = pb * math.ceil(root / n), pb * math.ceil(layer_params / n), layers

    label = _label(stage, optimizer_offload, param_offload, remat, inference)
    common = dict(
        label=label,
        stage=stage,
        optimizer_offload=optimizer_offload,
        param_offload=param_offload,
        remat=remat,
        mixed_precision=mixed_precision and not inference,
        inference=inference,
        world_size=world,
        gpus_per_node=gpus,
        activations=acts,
        gathered=gathered,
        optimizer_per_param=0 if inference else k,
        dequant=lora.dequant if lora else 0,
        lora=lora,
        tensor_parallel=tensor,
        tp_traffic=tensor.traffic(remat=remat) if tensor else 0,
    )
    if inference:
        held = pb * (padded // n if stage == 3 else psi)
        return Estimate(
            **common,
            params=0 if param_offload else held,
            grads=0,
            optimizer=0,
            update=0,
            cpu=held if param_offload else 0,
            nvme=0,
            state=held,
            traffic=psi if (stage == 3 and n > 1) else 0,
            state_cpu=held if param_offload else 0,
        )

    param_bytes = pb * (padded // n if stage == 3 else (padded if stage >= 1 else psi))
    if stage <= 1:
        grads = pb * psi  # the whole gradient (stage 1 keeps whole local sums when accumulating)
    elif stage == 2:
        grads = min(pb * psi, pb * shard + 2 * bucket_bytes)  # the partition, one bucket filling, one in flight
    else:
        grads = pb * shard
    opt_state = k * shard + held.fixed
    # The update: mixed precision casts the reduced partition to fp32 on the GPU for the master weights;
    # full precision makes one bucket-sized temporary.
    update = 4 * shard if masters else min(bucket_bytes, (2 if low else 4) * shard)
    cpu = nvme = 0
    # The frozen base (LoRA): whole on every rank, or its shard under ZeRO-3; where the parameters rest.
    base = lora.base_bytes(n if stage == 3 else 1) if lora else 0
    state = param_bytes + base + opt_state
    state_cpu = param_bytes + base if param_offload == "cpu" else 0
    state_nvme = param_bytes + base if param_offload == "nvme" else 0  # the current generation of the files
    if optimizer_offload:
        # Each bucket's reduced gradient leaves for the host as backward lands it (cast to fp32 first
        # under mixed precision), so there is no update transient and the GPU holds a few buckets of
        # gradient: when a bucket completes, its gradients and its buffer and the bucket before it in
        # flight; when that one lands, the two buffers and the landing one's fp32 copy.
        whole = pb * (psi if stage < 3 else shard)
        bucket = min(bucket_bytes, whole)
        copy = min(4 * shard, 2 * bucket) if masters else 0
        grads = max(3 * bucket, 2 * bucket + copy) if whole > 2 * bucket_bytes else max(2 * whole, whole + copy)
        update = 0
        # where the gradients land: a host buffer ("cpu"), or a file per bucket ("nvme"); bf16 without masters
        gbuf = (2 if low else 4) * shard
        state += gbuf
        cpu = param_bytes + base if param_offload == "cpu" else 0
    if optimizer_offload == "cpu":
        host_params = pb * shard  # a host copy of what the optimizer updates, or the parameters themselves
        cpu += opt_state + gbuf + (0 if param_offload else host_params)
        state += 0 if param_offload else host_params
        state_cpu += opt_state + gbuf + (0 if param_offload else host_params)
    elif optimizer_offload == "nvme":
        # Two generations of the state files (the update writes the other one), and the gradients' files.
        # The parameters: a staging copy the update writes the new ones to, or, resting in files
        # (param_offload="nvme"), their two generations (the update writes the new shard to the other one).
        # (Frozen parameters, which this estimate does not count, would rest in one generation.)
        # A frozen base's files are written once, at init: one generation.
        nvme = 2 * k * shard + (2 * param_bytes + base if param_offload == "nvme" else pb * shard) + gbuf
        # RAM: offload's pools, fixed by the options whatever the model. The update's: a buffer per sub-group
        # in flight, each the optimizer state of a sub-group and the fp32 gradient and parameters over the same
        # elements (a whole shard when it is smaller).
        cpu += NVME_UPDATE_BUFFERS * min(NVME_SUB_GROUP_BYTES // (k or 4), shard) * (k + 4 + pb)
        if device != "cpu":  # each bucket's gradient copied off the GPU (in fp32) on its way to its file
            cpu += NVME_LANDING_BUFFERS * 4 * math.ceil(min(bucket_bytes, pb * psi) / pb / (n if stage else 1))
        if param_offload == "nvme":
            # the shards read ahead of their gathers and still being gathered: a buffer per unit's shards, a
            # pool per size of unit (the root unit's one buffer; the blocks' nvme_read_buffers)
            cpu += root_shard + min(nvme_read_buffers(prefetch), blocks) * block_shard
        state_cpu += held.fixed  # the step counts stay in memory, on the host
        state_nvme += k * shard + gbuf  # the current generation of the state files, and the gradients' files
    traffic = 0 if n == 1 else (3 if stage == 3 else 2) * psi
    if lora is not None and stage == 3 and n > 1:  # the frozen base gathered twice, its bytes as parameters
        traffic += 2 * lora.base_bytes() // pb
    return Estimate(
        **common,
        params=0 if param_offload else param_bytes,
        grads=grads,
        optimizer=0 if optimizer_offload else opt_state,
        update=update,
        cpu=cpu,
        nvme=nvme,
        state=state,
        traffic=traffic,
        state_cpu=state_cpu,
        state_nvme=state_nvme,
        frozen=0 if param_offload else base,
    )


def compositions(
    params: float | ModelShape, *, inference: bool = False, remat: bool | None = None, **kwargs: Any
) -> list[Estimate]:
    """Every composition :func:`main` tabulates, in preference order (see ``Estimate.order``).

    Training: DDP and ZeRO-1, 2, 3, each with the optimizer state on the
    GPU, in CPU RAM or on NVMe, ZeRO-3 with its parameters in CPU RAM too
    (beside an optimizer state in RAM or on NVMe), and ZeRO-3 with its
    parameters and optimizer state on NVMe; each with and without remat
    when ``remat`` is None and the shapes for activations are given. Inference: replicated, ZeRO-3, ZeRO-3 with
    parameters in CPU RAM.

    Every other keyword goes to :func:`estimate` for each row: ``lora_rank=`` (LoRA adapters of that rank
    on every block's projections, the rest frozen) and ``quantize=`` (``"nf4"`` or ``"int8"``: the frozen
    projections held quantized, QLoRA) among them, with :func:`estimate`'s meaning; there the parameters'
    placement moves the frozen base too (ZeRO-3 with its parameters in CPU RAM or on NVMe); and ``tp=``
    (tensor parallelism: every row one GPU's share of the split model, sharded over the data-parallel
    ranks).

    Example:
        >>> from zerofn.plan import compositions
        >>> [e.label for e in compositions(1e9, gpus=2)][:4]
        ['DDP', 'ZeRO-1', 'ZeRO-2', 'DDP + optimizer on CPU']
    """
    if inference:
        rows = [
            estimate(params, inference=True, stage=s, param_offload=p, **kwargs)
            for s, p in ((0, None), (3, None), (3, "cpu"))
        ]
        return sorted(rows, key=Estimate.order)
    shaped = isinstance(params, ModelShape) or all(kwargs.get(x) for x in ("layers", "hidden"))
    has_acts = shaped and bool(kwargs.get("seq")) and bool(kwargs.get("micro_batch"))
    remats = (False, True) if (remat is None and has_acts) else (bool(remat),)
    rows = []
    for r in remats:
        for stage in (0, 1, 2, 3):
            for dev in _DEVICES:
                rows.append(estimate(params, stage=stage, optimizer_offload=dev, remat=r, **kwargs))
        # ZeRO-3's parameter shards in CPU RAM beside the optimizer state in RAM or on NVMe, or on NVMe beside it
        for dev, p in (("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme")):
            rows.append(estimate(params, stage=3, optimizer_offload=dev, param_offload=p, remat=r, **kwargs))
    return sorted(rows, key=Estimate.order)
