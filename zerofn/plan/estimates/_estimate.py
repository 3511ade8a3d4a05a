"""The estimate: bytes per GPU, CPU RAM and NVMe of one composition (:func:`estimate`). The arithmetic is
described in :mod:`zerofn.plan`."""

from __future__ import annotations

import dataclasses
import math

import torch

from zerofn import optim as O
from zerofn.plan.activations import activation_bytes
from zerofn.plan.context import context_parallel_plan
from zerofn.plan.estimates._checks import check
from zerofn.plan.estimates._defaults import (
    BUCKET_BYTES,
    NVME_LANDING_BUFFERS,
    NVME_SUB_GROUP_BYTES,
    NVME_UPDATE_BUFFERS,
    PREFETCH,
    nvme_read_buffers,
)
from zerofn.plan.estimates._optimizer import optimizer_bytes
from zerofn.plan.estimates._record import Estimate, label
from zerofn.plan.expert import expert_parallel_plan
from zerofn.plan.lora import lora_plan, projections
from zerofn.plan.pipeline import pipeline_parallel_plan
from zerofn.plan.shapes import ModelShape
from zerofn.plan.tensor import tensor_parallel_plan


def _ends(psi, layers, block, vocab, hidden, gated, tied, tensor) -> tuple[int, int]:
    """``(first, last)``: what one GPU holds outside the blocks on a pipeline's first stage (the input embedding,
    learned positions) and on its last (the final norm: RMSNorm's ``hidden`` when gated, LayerNorm's ``2 hidden``
    otherwise; an untied head, ``vocab x hidden``, over tp when it splits the vocabulary). A tied head is the
    embedding, held by the first stage. Without the vocabulary everything outside the blocks is the first's."""
    root = psi - (layers or 0) * (block or 0)
    if not (vocab and hidden):
        return root, 0
    table = int(vocab) * int(hidden) // (tensor.size if tensor is not None and tensor.vocab_split else 1)
    last = min(root, (int(hidden) if gated else 2 * int(hidden)) + (0 if tied else table))
    return root - last, last


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


def _one(
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
    cp: int | None = None,
    cp_method: str = "ulysses",
    chunked_loss: bool = False,
    remat_offload: bool = False,
    ep: int | None = None,
    pp: int | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    stage_index: int | None = None,
) -> Estimate:
    """:func:`estimate` of one composition; under ``pp``, of pipeline rank ``stage_index``."""
    shape = params if isinstance(params, ModelShape) else None
    if shape is not None:
        layers, hidden, heads, kv_heads, ffn, vocab, gated = shape.given(
            layers, hidden, heads, kv_heads, ffn, vocab, gated
        )
        psi = shape.params
    else:
        psi = int(round(float(params)))
    if psi <= 0:
        raise ValueError(f"estimate: the parameter count must be positive, got {params!r}")
    param_offload = check(
        stage=stage,
        optimizer_offload=optimizer_offload,
        param_offload=param_offload,
        remat=remat,
        inference=inference,
        lora_rank=lora_rank,
        quantize=quantize,
        shaped=bool(layers and hidden),
        experts=shape.experts if shape is not None else 1,
        tp=tp,
        cp=cp,
        remat_offload=remat_offload,
        ep=ep,
        pp=pp if stage_index is not None else None,
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
            seq=seq // cp if (seq and cp) else seq,  # each tp group all-reduces its cp share of the tokens
            micro_batch=micro_batch,
            activation_bytes=2 if mixed_precision else 4,
        )
        psi, layer_params, n = tensor.local, tensor.block, tensor.data
    context = None
    if cp is not None:
        # The sequence cut over cp GPUs; the state as without it (the ZeRO stages shard over dp x cp = N)
        context = context_parallel_plan(
            size=cp,
            method=cp_method,
            world=world,
            tp=tp,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=shape.head_dim if shape else None,
            hidden=hidden,
            seq=seq,
            micro_batch=micro_batch,
            activation_bytes=2 if mixed_precision else 4,
        )
    pipeline = None
    if stage_index is not None:
        # One stage's blocks, and the embeddings (first) or the final norm and head (last); from here on Psi counts
        # what one GPU of pipeline rank stage_index holds, layers its blocks, and N the GPUs of its dp x cp
        tied = shape.tied if shape else True
        first, last = _ends(psi, layers, layer_params, vocab, hidden, gated, tied, tensor)
        table = int(vocab or 0) * int(hidden or 0) // (tensor.size if tensor is not None and tensor.vocab_split else 1)
        pipeline = pipeline_parallel_plan(
            size=pp,
            microbatches=microbatches,
            world=world,
            layers=layers,
            block=layer_params or 0,
            first=first,
            last=last,
            schedule=schedule,
            virtual=virtual_stages,
            tp=tp,
            cp=cp or 1,
            micro_batch=micro_batch,
            seq=seq,
            hidden=hidden,
            activation_bytes=2 if mixed_precision else 4,
            stage=stage_index,
            tied=pb * table if tied else 0,
        )
        psi, layers, n = pipeline.stage_params[stage_index], pipeline.stage_blocks[stage_index], n // pipeline.size
        if tensor is not None:
            tensor = dataclasses.replace(tensor, data=tensor.data // pipeline.size, layers=layers)
        if context is not None:
            context = dataclasses.replace(
                context, data=context.data // pipeline.size, group=context.group // pipeline.size, layers=layers
            )
    expert = None
    groups = [(psi, n)]  # the parameters one GPU holds, by the group the ZeRO stages shard them over
    if ep is not None:
        # Each GPU's experts (experts / ep of each block's) and the rest whole; from here on Psi counts those,
        # a block its share, and the ZeRO stages shard the experts over the GPUs holding the same ones
        expert = expert_parallel_plan(
            size=ep,
            world=world,
            tp=tp,
            cp=cp or 1,
            experts=shape.experts if shape else 1,
            top_k=shape.top_k if shape else 1,
            moe_layers=shape.moe_layers if shape else 0,
            params=psi,
            expert_params=shape.expert_params if shape else 0,
            hidden=hidden,
            seq=seq,
            micro_batch=micro_batch,
            activation_bytes=2 if mixed_precision else 4,
            shaped=shape is not None,
        )
        if layer_params:
            layer_params -= (expert.expert_params - expert.local_expert_params) // layers
        psi = expert.local
        groups = [(psi - expert.local_expert_params, n), (expert.local_expert_params, expert.expert_group)]
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
        groups = [(psi, n)]
    # Buckets, each padded to a multiple of its group's N elements (at most N - 1 each): flat buckets of
    # bucket_bytes for stages 1-2, one bucket per unit (each block and the root) for ZeRO-3; under ep the
    # experts' buckets apart (one per mixture-of-experts block under ZeRO-3), padded to their group.
    units = [(layers or 0) + 1, expert.moe_layers if expert else 0]
    parts = []  # (padded elements, ranks) per group
    for (elements, ranks), unit in zip(groups, units):
        buckets = unit if stage == 3 else max(1, math.ceil(elements * pb / bucket_bytes))
        parts.append((elements + (buckets * (ranks - 1) if stage >= 1 and ranks > 1 else 0), ranks))
    if lora is not None and stage == 3:  # each block's adapters one bucket, padded to N; the root unit has none
        parts = [(layers * -(-lora.block_trainable // n) * n, n)]
    padded = sum(p for p, _ in parts)
    shard = sum(p // r for p, r in parts) if stage >= 1 else psi  # what the optimizer updates on this rank

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
            # the logits per GPU, on a pipeline's last stage
            vocab=0
            if pipeline is not None and stage_index != pipeline.size - 1
            else (vocab or 0) // (tp if tensor is not None and tensor.vocab_split else 1),
            gated=bool(gated),
            mixed_precision=mixed_precision or inference,
            remat=remat,
            inference=inference,
            flash=flash,
            device=device,
            lora_rank=lora.rank if lora else 0,
            tp=tp,
            cp=cp,
            cp_method=cp_method,
            chunked_loss=chunked_loss,
            remat_offload=remat_offload,
            in_flight=pipeline.in_flight[stage_index] if pipeline else 1,
            chunks=pipeline.virtual if pipeline else 1,
            waiting=pipeline.waiting[stage_index] if pipeline else 0,
        )
    # remat's kept inputs in host memory: one hidden state per block and token this GPU computes
    remat_host = 0
    if remat_offload and acts and device != "cpu":
        remat_host = layers * micro_batch * seq // (cp or 1) * hidden * (2 if mixed_precision else 4)
        if pipeline is not None:  # the kept inputs of each micro-batch in flight, a chunk's blocks each
            remat_host = remat_host * pipeline.in_flight[stage_index] // pipeline.virtual
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
        if expert is not None:  # a block's shards: of the rest over N, of its experts over their group
            xb = expert.local_expert_params // layers
            block_shard = pb * (math.ceil((layer_params - xb) / n) + math.ceil(xb / expert.expert_group))

    if pipeline is not None and stage_index == pipeline.size - 1:
        gathered += 2 * pipeline.tied  # a tied head lent by the first stage for the step, and its gradient
    common = dict(
        label=label(stage, optimizer_offload, param_offload, remat, inference, remat_offload),
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
        context_parallel=context,
        cp_traffic=context.traffic(remat=remat) if context else 0,
        remat_host=remat_host,
        expert_parallel=expert,
        ep_traffic=expert.traffic(remat=remat) if expert else 0,
        pipeline_parallel=pipeline,
        pp_traffic=pipeline.traffic() if pipeline else 0,
    )
    if inference:
        held = pb * (shard if stage == 3 else psi)
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

    param_bytes = pb * (shard if stage == 3 else (padded if stage >= 1 else psi))
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
            least = min(r for _, r in groups)  # the smallest group: the largest partition of a bucket
            cpu += NVME_LANDING_BUFFERS * 4 * math.ceil(min(bucket_bytes, pb * psi) / pb / (least if stage else 1))
        if param_offload == "nvme":
            # the shards read ahead of their gathers and still being gathered: a buffer per unit's shards, a
            # pool per size of unit (the root unit's one buffer; the blocks' nvme_read_buffers)
            cpu += root_shard + min(nvme_read_buffers(prefetch), blocks) * block_shard
        state_cpu += held.fixed  # the step counts stay in memory, on the host
        state_nvme += k * shard + gbuf  # the current generation of the state files, and the gradients' files
    cpu += remat_host  # host RAM, but no state: it lives inside a step
    # the ZeRO paper's elements moved per rank, each part over its group (none over a group of one)
    traffic = (3 if stage == 3 else 2) * sum(elements for elements, ranks in groups if ranks > 1)
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
    cp: int | None = None,
    cp_method: str = "ulysses",
    chunked_loss: bool = False,
    remat_offload: bool = False,
    ep: int | None = None,
    pp: int | None = None,
    microbatches: int | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    pp_stage: int | None = None,
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
            attention's heads whole), and the embedding and an untied head over the vocabulary when
            ``tp`` divides it (logits ``vocab / tp`` wide per GPU); everything else (norms, a row-wise
            layer's bias) whole on each; the step runs on the ``gpus x nodes / tp`` data-parallel ranks, over which ``stage`` shards
            what one GPU holds. Each GPU's parameters, gradients and optimizer state are those of its
            ``1 / tp`` of the split layers and of the whole rest; activations split attention's and the
            MLP's intermediates by ``tp`` (the residual stream and the norms' inputs stay whole: no
            sequence parallelism); ``Estimate.tp_traffic`` counts the activations' all-reduces. ``tp``
            must divide the GPUs per node (a group stays in a node), the attention heads, the
            key/value heads and the MLP's width; it needs the shapes. See :mod:`zerofn.plan.tensor`.
        cp: context parallelism, ``context_parallel(step, cp, method=cp_method)`` (None: not applied):
            each of the ``cp`` GPUs of a group computes ``seq / cp`` of every micro-batch's tokens, from the
            embedding to the loss (``seq`` is the whole sequence, ``micro_batch`` the sequences of a group);
            parameters are whole along ``cp`` and the ZeRO stages shard over ``dp x cp = world / tp`` ranks,
            so the state is what it is without it. ``cp`` must divide ``world / tp``, and ``seq`` be a
            multiple of the layout unit (``cp``, ring ``2 cp``). Activations: see :func:`activation_bytes`;
            ``Estimate.cp_traffic`` counts the attention's exchanges. See :mod:`zerofn.plan.context`.
        cp_method: ``"ulysses"`` (the query heads on a GPU a multiple of ``cp``) or ``"ring"``.
        chunked_loss: the loss by ``zf.losses.chunked_cross_entropy`` (``context_parallel``'s own for a
            Llama, Mistral or Qwen model given labels): one chunk's logits at a time, not tokens x vocabulary.
        remat_offload: with ``remat``, ``remat(..., offload="cpu")``: the blocks' kept inputs wait in host
            memory, ``layers x tokens x hidden x`` the activations' bytes per rank (``Estimate.remat_host``,
            in ``cpu``), not on the GPU (on ``device="cpu"`` they stay where they are).
        ep: expert parallelism, ``expert_parallel(step, ep)`` (None: not applied), for a mixture-of-experts
            :class:`ModelShape`: each of the ``ep`` GPUs of a group holds ``experts / ep`` of every
            mixture-of-experts block's routed experts whole and the rest of the model whole; every GPU feeds
            its own micro-batch (``micro_batch`` is per GPU, the micro-batches in flight ``world / (tp x
            cp)``). The ZeRO stages shard the experts one GPU holds over the ``world / (tp x ep)`` GPUs
            holding the same ones and the rest over ``world / tp``, each part's gradients reduced on its own
            group. ``ep`` must divide the experts of a block and ``world / (tp x cp)``.
            ``Estimate.ep_traffic`` counts the routed tokens' all-to-alls; activations are counted as
            without it (balanced routing: each GPU computes as many routed rows as it sends). See
            :mod:`zerofn.plan.expert`.
        pp: pipeline parallelism, ``pipeline_parallel(step, pp, microbatches=microbatches,
            schedule=schedule, virtual_stages=virtual_stages)`` (None or 1: not applied): the blocks cut into
            ``pp x virtual_stages`` chunks (the first chunks one block more where they do not divide), each GPU
            holding ``virtual_stages`` of them, the first stage the embeddings, the last the final norm and an
            untied head. The mesh is ``pp x dp x cp x tp``; each stage's state is sharded by ``stage`` over its
            ``world / (pp x tp)`` GPUs. ``micro_batch`` is the sequences of one pipeline micro-batch (a step
            takes ``micro_batch x microbatches`` a data-parallel rank), and each stage holds the activations of
            the micro-batches its schedule keeps in flight, of its own blocks only. The estimate is that of the
            stage whose ``total`` is the largest (``Estimate.pipeline_parallel.stage``); ``pp`` must divide
            ``world / (tp x cp)``, and ``pp x virtual_stages`` be at most the blocks. See
            :mod:`zerofn.plan.pipeline`.
        microbatches: the micro-batches a step pipelines (needed with ``pp``): at least ``pp`` under
            ``"1f1b"``; a multiple of torch's rounds (``max(1, microbatches // pp)``) under the interleaved
            schedules.
        schedule: ``"1f1b"`` (``virtual_stages`` 1), ``"interleaved"`` (``virtual_stages`` >= 2) or
            ``"zero_bubble"``.
        virtual_stages: model chunks per GPU.
        pp_stage: with ``pp``, the pipeline rank (0 to ``pp - 1``) to estimate instead of the largest.

    Returns:
        An :class:`Estimate`.

    Raises:
        ValueError: a stage outside 0-3, an unknown offload device, or a
            combination zerofn does not run (parameters off the GPU without
            stage 3 or with the optimizer state on the GPU; parameters on NVMe
            without the optimizer state there too); ``quantize`` without
            ``lora_rank``, or either with ``inference`` or without the shapes; a
            ``tp`` that does not divide the GPUs per node, the heads or the MLP's
            width, or with ``lora_rank`` or ``inference``; a ``cp`` that does not divide
            ``world / tp``, or with ``inference``; Ulysses' heads not a multiple of ``cp``;
            ``remat_offload`` without ``remat``; an ``ep`` without a mixture-of-experts shape, that does
            not divide its experts or ``world / (tp x cp)``, or with ``inference``; a ``pp`` that does not
            divide ``world / (tp x cp)``, without ``microbatches`` or the layer count, with more chunks than
            blocks, fewer micro-batches than 1F1B needs, or with ``inference``, ``lora_rank`` or ``ep``.

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
        >>> p = memory.estimate(llama2_7b, gpus=8, stage=1, pp=4, microbatches=8, seq=4096, micro_batch=1)
        >>> t = p.pipeline_parallel                                     # 4 stages of 8 blocks, 8 micro-batches
        >>> t.stage, t.stage_blocks, t.in_flight[t.stage], round(p.total / 1e9, 1)  # the first: 4 in flight
        (0, (8, 8, 8, 8), 4, 42.2)
    """
    kwargs = dict(locals())
    params = kwargs.pop("params")
    kwargs.pop("pp_stage")
    if pp is None or pp == 1:
        return _one(params, **kwargs, stage_index=None)
    # each stage holds its own blocks and keeps its own micro-batches in flight: the largest is what must fit
    rows = [_one(params, **kwargs, stage_index=0)]  # (pp, its schedule and its micro-batches checked)
    if pp_stage is not None:
        if not isinstance(pp_stage, int) or isinstance(pp_stage, bool) or not 0 <= pp_stage < pp:
            raise ValueError(
                f"estimate: pp_stage must be a rank of the pipeline, an int from 0 to {pp - 1} (pp={pp}), got "
                f"{pp_stage!r}; leave it out for the largest stage"
            )
        return rows[0] if pp_stage == 0 else _one(params, **kwargs, stage_index=pp_stage)
    rows += [_one(params, **kwargs, stage_index=i) for i in range(1, pp)]
    return max(rows, key=lambda e: (e.total, e.cpu))
