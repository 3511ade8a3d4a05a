"""Planning: what fits where. Bytes per GPU, CPU RAM and NVMe for each ZeRO stage, offload and remat.

:func:`estimate` (also ``zf.memory.estimate``) is the ZeRO paper's memory
table as zerofn holds it, plus activations and the transients of a step;
:func:`model_shape` reads a Hugging Face ``config.json`` (:func:`shape_from_dims`
counts the same from the dimensions); :func:`main` is ``python -m zerofn plan``.
Nothing here computes with torch: it is arithmetic
on shapes, checked against real runs in ``tests/plan/test_plan.py`` (an optimizer
passed as ``estimate(..., optimizer=)`` is initialised once on a two-element
tensor, to count what its state holds: :func:`optimizer_bytes`).

The package, by concern: ``shapes`` (Hugging Face configs: :class:`ModelShape`,
:func:`model_shape`), ``activations`` (:func:`activation_bytes`), ``lora`` (LoRA adapters
on a frozen base, quantized or not: :class:`LoraPlan`, :func:`lora_plan`,
:func:`dequant_bytes`), ``local`` (what one GPU holds of parameters a parallelism cuts, from their
placements: :func:`local_params`, :func:`local_shape`), ``tensor`` (tensor parallelism's split, its
placements stated by the transform's rules: :class:`TensorParallelPlan`, :func:`tensor_parallel_plan`,
:func:`split_shapes`), ``context`` (context parallelism's cut of the sequence and its traffic:
:class:`ContextParallelPlan`, :func:`context_parallel_plan`, :func:`layout_unit`), ``expert`` (expert
parallelism's cut of a mixture-of-experts model's experts and its all-to-alls: :class:`ExpertParallelPlan`,
:func:`expert_parallel_plan`), ``pipeline`` (pipeline parallelism's stages, the micro-batches each keeps in
flight, the bubble and the sends between stages: :class:`PipelineParallelPlan`, :func:`pipeline_parallel_plan`,
:func:`bubble_fraction`), ``estimates/``
(:class:`Estimate`, :func:`estimate`, :func:`compositions`, :func:`optimizer_bytes`,
:func:`longest_sequence`; a module a job: the defaults, the optimizer's bytes, the record, the refusals, the
estimate, the compositions, the longest sequence), ``cli``
(:func:`main`, :func:`parse_size`, :func:`parse_count`), ``text``
(:func:`plan_text`, :func:`fmt_bytes`), ``plotting`` (:func:`plot`), and how fast:
``hardware`` (a GPU and its links, the presets and the hardware file: :class:`Hardware`,
:func:`load_hardware`, :func:`hardware_from_dict`), ``speed`` (a step's time per composition from its FLOPs
and its collectives on each link: :func:`speeds`, :func:`step_speed`, :class:`Speed`, :func:`ring_bytes`,
:func:`link_bytes`, :func:`flops_per_token`), ``speed_text`` (:func:`speed_text`) and ``calibrate``
(this machine's collectives measured on gloo ranks: :func:`calibrate`, :func:`fit`); every
name is importable from ``zerofn.plan``.

Notation: Psi trainable parameters, N = GPUs per node x nodes ranks,
S = Psi / N (padded: each bucket to a multiple of N elements). Mixed
precision (``amp``, bf16/fp16): 2 bytes of parameter, 2 of gradient, and
K = 12 of optimizer state (4 fp32 master + 4 + 4 Adam moments); full
precision: 4 + 4 + K = 8. Either way 16 bytes per parameter under DDP. Another
optimizer's state (``estimate(..., optimizer=)``) changes K: Adam with bf16
moments (``mu_dtype`` and ``nu_dtype``) holds 4 bytes where fp32 moments hold
8, so K = 8 in mixed precision and 4 in full precision. Without master weights
(``estimate(..., master_weights=False)``: ``amp(..., master_dtype=torch.bfloat16)``,
DeepSpeed's ``bf16_master_weights_and_grads``) there is no 4-byte master: K = 8
with fp32 moments, 4 with bf16 ones (``bf16_optimizer_states``), and no fp32
gradient copy in the update.

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

LoRA (``estimate(..., lora_rank=r)``) and QLoRA (``quantize="nf4"`` or
``"int8"`` too): Psi counts the adapters, r x (in + out) per projection of
every block, and the table above applies to them; the model's parameters are
a frozen base beside them (``Estimate.frozen``: no gradient, no optimizer
state), whole on every rank under DDP and ZeRO-1, 2, sharded per unit under
ZeRO-3, on the host with the parameters' placement. Quantized, its
projections' weights take the codec's exact bytes (NF4: 0.516 per
parameter with the scales), ZeRO-3 gathers them at that size, and one
projection's weight dequantized for its call adds ``Estimate.dequant`` in
the step: total = ... + max(activations + gathered units + dequant, update).
See :mod:`zerofn.plan.lora`.

Tensor parallelism (``estimate(..., tp=t)``, ``tensor_parallel(step, t)``): each GPU holds ``1 / t`` of
every block's projections (and of the embedding and head, over the vocabulary, when t divides it) and the
rest (the norms) whole, and the step runs on the ``N / t`` data-parallel ranks: the table above applies to
the parameters one GPU holds with N the data-parallel ranks. What one GPU holds is counted from each split
parameter's placement on the ``tp`` axis (:func:`split_shapes`, by the transform's own rules), as
:func:`local_params` counts any parallelism's placements. Activations split attention's and the MLP's intermediates by t; the
activations' all-reduces, four a block per micro-batch, are ``Estimate.tp_traffic``. See
:mod:`zerofn.plan.tensor`.

Context parallelism (``estimate(..., cp=c)``, ``context_parallel(step, c)``): each of the ``c`` GPUs of a
group computes ``seq / c`` of every micro-batch's tokens, from the embedding to the loss; the parameters are
whole on each and the step runs on the ``N`` GPUs of ``dp x cp`` (``N / tp`` with tensor parallelism), so the
table above applies as it is: ``cp`` divides the activations, not the state. Its long-context recipe,
``remat(context_parallel(shard_params(step), c), offload="cpu")`` with the chunked loss
(``chunked_loss=True``, ``remat_offload=True``), leaves the GPU one block's activations of the local tokens
and one chunk of logits; the blocks' kept inputs go to host RAM (``Estimate.remat_host``, in ``cpu``).
Attention's exchanges are ``Estimate.cp_traffic``; :func:`longest_sequence` finds the longest sequence a
composition fits. See :mod:`zerofn.plan.context`.

Expert parallelism (``estimate(..., ep=e)``, ``expert_parallel(step, e)``), for a mixture-of-experts
:class:`ModelShape`: each of the ``e`` GPUs of a group holds ``experts / e`` of every mixture-of-experts
block's routed experts whole, and the rest of the model whole; every GPU feeds its own micro-batch. The table
above applies to each part with its own N: the rest over ``N / tp`` as without it, the experts one GPU holds
over the ``N / (tp x e)`` GPUs holding the same ones. The routed tokens' all-to-alls, four a block per
micro-batch, are ``Estimate.ep_traffic``. See :mod:`zerofn.plan.expert`.

Pipeline parallelism (``estimate(..., pp=p, microbatches=m)``, ``pipeline_parallel(step, p, microbatches=m)``): the
blocks cut into ``p`` stages (``p v`` chunks under the interleaved schedules), the outermost axis of the mesh
(``pp x dp x cp x tp``); each GPU holds its stage's blocks (the first stage the embeddings, the last the final
norm and an untied head), and the table above applies to them with N the stage's ``world / (p x tp)`` GPUs. Its
activations are those of the micro-batches its schedule keeps in flight (1F1B: ``min(p - i, m)`` on stage
``i``), of its own blocks; the estimate is the largest stage's. The bubble, ``(p - 1) / (m + p - 1)`` for 1F1B,
and the stages' sends, ``Estimate.pp_traffic``, are in :mod:`zerofn.plan.pipeline`.

Optimizer state in CPU RAM (``"cpu"``): the GPU keeps only parameters and
the gradients of the buckets backward is landing; the host holds, per
rank, the optimizer state (K S), an fp32 gradient buffer kept from step
to step (4 S) and a host copy of the parameters it updates (2 S, or the
parameters themselves when they rest on the host too:
``param_offload="cpu"``, ZeRO-3 only): 18 bytes per
parameter in mixed precision, where write-ups of ZeRO-Offload count 12.
On NVMe (``"nvme"``): the files hold two generations of the K S state plus
a staging copy of the parameters, (2 K + 2) S bytes; RAM holds offload's
pools, whose sizes come from the options, not the model: the update's
``NVME_UPDATE_BUFFERS`` sub-groups (each 64 MiB of state with the fp32
gradient and the parameters over its elements) and, on a GPU,
``NVME_LANDING_BUFFERS`` fp32 copies of a bucket's gradient partition.
ZeRO-3's parameter shards on NVMe beside it (``param_offload="nvme"``,
ZeRO-Infinity): two generations of them instead of the staging copy,
(2 K + 4) S bytes of state and parameter files, and RAM holds the pool the
shards are read into too: a buffer of the root unit's shards and
:func:`~zerofn.plan.estimates.nvme_read_buffers` (``2 prefetch + 3``) of a
block's, divided by N. Files count in ``state`` in their
current generation (as ``zf.memory.state_bytes`` does), in ``nvme`` with
both.

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

from zerofn.plan.activations import activation_bytes
from zerofn.plan.calibrate import calibrate, fit, write_hardware
from zerofn.plan.cli import main, parse_count, parse_size
from zerofn.plan.context import ContextParallelPlan, context_parallel_plan, layout_unit
from zerofn.plan.estimates import (
    ADAM_COUNT_BYTES,
    BUCKET_BYTES,
    NVME_LANDING_BUFFERS,
    NVME_SUB_GROUP_BYTES,
    NVME_UPDATE_BUFFERS,
    PREFETCH,
    Estimate,
    OptimizerBytes,
    compositions,
    estimate,
    longest_sequence,
    optimizer_bytes,
)
from zerofn.plan.expert import ExpertParallelPlan, expert_parallel_plan
from zerofn.plan.hardware import PRESETS, Hardware, LinkCost, hardware_from_dict, load_hardware
from zerofn.plan.local import local_params, local_shape
from zerofn.plan.lora import LoraPlan, dequant_bytes, lora_plan
from zerofn.plan.pipeline import PipelineParallelPlan, bubble_fraction, pipeline_parallel_plan
from zerofn.plan.plotting import plot
from zerofn.plan.shapes import ModelShape, model_shape, shape_from_dims
from zerofn.plan.speed import (
    EFFICIENCY,
    Comm,
    Composition,
    Speed,
    flops_per_token,
    link_bytes,
    ring_bytes,
    speed_compositions,
    speeds,
    step_speed,
)
from zerofn.plan.speed_text import speed_text
from zerofn.plan.tensor import TensorParallelPlan, split_shapes, tensor_parallel_plan
from zerofn.plan.text import fmt_bytes, format_count, plan_text

__all__ = [
    "ADAM_COUNT_BYTES",
    "BUCKET_BYTES",
    "EFFICIENCY",
    "PRESETS",
    "NVME_LANDING_BUFFERS",
    "NVME_SUB_GROUP_BYTES",
    "NVME_UPDATE_BUFFERS",
    "PREFETCH",
    "Comm",
    "Composition",
    "ContextParallelPlan",
    "Estimate",
    "ExpertParallelPlan",
    "Hardware",
    "LinkCost",
    "LoraPlan",
    "ModelShape",
    "OptimizerBytes",
    "PipelineParallelPlan",
    "Speed",
    "TensorParallelPlan",
    "activation_bytes",
    "bubble_fraction",
    "calibrate",
    "compositions",
    "context_parallel_plan",
    "dequant_bytes",
    "estimate",
    "expert_parallel_plan",
    "fit",
    "flops_per_token",
    "fmt_bytes",
    "format_count",
    "hardware_from_dict",
    "layout_unit",
    "link_bytes",
    "load_hardware",
    "local_params",
    "local_shape",
    "longest_sequence",
    "lora_plan",
    "main",
    "model_shape",
    "optimizer_bytes",
    "parse_count",
    "parse_size",
    "pipeline_parallel_plan",
    "plan_text",
    "plot",
    "ring_bytes",
    "shape_from_dims",
    "speed_compositions",
    "speed_text",
    "speeds",
    "split_shapes",
    "step_speed",
    "tensor_parallel_plan",
    "write_hardware",
]
