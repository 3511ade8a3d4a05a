"""The estimate's record: :class:`Estimate`, the bytes of one composition and what fits, and its
label (:func:`label`)."""

from __future__ import annotations

from dataclasses import dataclass

from zerofn.plan.context import ContextParallelPlan
from zerofn.plan.expert import ExpertParallelPlan
from zerofn.plan.lora import LoraPlan
from zerofn.plan.pipeline import PipelineParallelPlan
from zerofn.plan.tensor import TensorParallelPlan


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
        context_parallel: the cut of ``estimate(..., cp=)`` (:class:`~zerofn.plan.ContextParallelPlan`), or
            None. ``activations`` are then those of the ``seq / cp`` tokens one GPU computes; the state is
            sharded over ``world / tp`` ranks as without it.
        cp_traffic: bytes one rank sends on its context-parallel group per micro-batch (Ulysses' all-to-alls,
            ring's key/value blocks and accumulators; 0 without ``cp`` or the shapes).
        remat_host: the blocks' kept inputs ``remat(..., offload="cpu")`` holds in host memory, per rank,
            within a step (included in ``cpu``; 0 without ``remat_offload``).
        expert_parallel: the cut of ``estimate(..., ep=)`` (:class:`~zerofn.plan.ExpertParallelPlan`), or
            None. The columns above are then one GPU's, of the parameters it holds (its ``experts / ep`` of
            each block's experts, the rest whole), the experts sharded over the GPUs holding the same ones
            (``world / (tp x ep)``) and the rest over ``world / tp``; ``traffic`` counts each part over its
            group.
        ep_traffic: bytes one GPU sends on its expert-parallel group per micro-batch (the all-to-alls of the
            routed tokens: 4 a mixture-of-experts block, 6 under remat; 0 without ``ep`` or without ``seq``
            and ``micro_batch``).
        pipeline_parallel: the cut of ``estimate(..., pp=)`` (:class:`~zerofn.plan.PipelineParallelPlan`), or
            None (pp 1). The columns above are then those of one GPU of its largest stage
            (``pipeline_parallel.stage``: what must fit): its blocks and embeddings or head, sharded over its
            ``world / (pp x tp)`` GPUs, and the activations of the micro-batches it holds in flight; on the
            last stage ``gathered`` counts a tied head lent by the first stage for the step, and its gradient.
        pp_traffic: bytes one GPU of that stage sends to its neighbour stages in a step (each micro-batch's
            activations forward, their gradients back; 0 without ``pp`` or without ``seq`` and ``micro_batch``).
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
    context_parallel: ContextParallelPlan | None = None
    cp_traffic: int = 0
    remat_host: int = 0
    expert_parallel: ExpertParallelPlan | None = None
    ep_traffic: int = 0
    pipeline_parallel: PipelineParallelPlan | None = None
    pp_traffic: int = 0

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


def label(
    stage: int,
    optimizer_offload: str | None,
    param_offload: str | None,
    remat: bool,
    inference: bool,
    remat_offload: bool = False,
) -> str:
    """A composition's name as the table prints it, e.g. ``"ZeRO-3 + optimizer on CPU + remat"``, and
    ``"... + remat (inputs on CPU)"`` for remat's kept inputs in host memory."""
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
    return text + (" + remat" if remat else "") + (" (inputs on CPU)" if remat and remat_offload else "")
