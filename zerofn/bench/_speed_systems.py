"""The systems ``python -m zerofn.bench.gpu_speed`` compares, each built for one rank of one process.

``torch-amp`` (the plain module, DDP over more than one rank, under
autocast) and ``fsdp2`` (``fully_shard`` per block and on the root), the
DeepSpeed engines (ZeRO stage 2 / 3, and stage 2 offloading its optimizer
to the CPU), and zerofn's compositions of transforms (:func:`zf_composition`);
:func:`build` makes a system's step, ``batch -> loss``, over the GPT of
:mod:`zerofn.bench.gpt` drawn from seed 0 (:func:`gpt_model`), with AdamW of the
same hyper-parameters in every system.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "BETAS",
    "DEEPSPEED_SYSTEMS",
    "EPS",
    "LR",
    "SYSTEMS",
    "TORCH_SYSTEMS",
    "WD",
    "ZF_SYSTEMS",
    "build",
    "gpt_model",
    "gpt_params",
    "zf_composition",
]

LR, BETAS, EPS, WD = 3e-4, (0.9, 0.95), 1e-8, 0.1
TORCH_SYSTEMS = ("torch-amp", "fsdp2")
DEEPSPEED_SYSTEMS = ("deepspeed-z2", "deepspeed-z3", "deepspeed-z2-offload")
ZF_SYSTEMS = (
    "zf-amp",
    "zf-z1-amp",
    "zf-z2-amp",
    "zf-z3-amp",
    "zf-z2-amp-offload",
    "zf-z2-amp-offload-sync",
    "zf-z2-amp-offload-early",
    "zf-z2-amp-offload-delay",
    "zf-z3-amp-remat",
)
SYSTEMS = TORCH_SYSTEMS + DEEPSPEED_SYSTEMS + ZF_SYSTEMS


def zf_composition(name: str):
    """``step -> step`` for a zerofn system name (``zf-...``)."""
    from zerofn.transforms import amp, offload, remat, shard_grads, shard_optimizer, shard_params

    shard = {
        "zf-amp": lambda s: s,
        "zf-z1-amp": shard_optimizer,
        "zf-z2-amp": shard_grads,
        "zf-z3-amp": shard_params,
        "zf-z3-amp-remat": shard_params,
    }.get(name, shard_grads)

    def compose(step):
        step = amp(shard(step), torch.bfloat16)
        if "-offload" in name:  # overlapped (the default), updated first, started during backward, one step late
            step = offload(
                step,
                "cpu",
                overlap=not name.endswith("-sync"),
                delay=int(name.endswith("-delay")),
                early=name.endswith("-early"),
            )
        if name.endswith("-remat"):
            step = remat(step)
        return step

    return compose


def gpt_params(cfg) -> int:
    """Parameters of the GPT of ``cfg`` (a ``GPTConfig``), counted on the meta device: the tied head once."""
    from zerofn.bench.gpt import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def build(system: str, cfg, device: torch.device, world: int, batch_per_rank: int):
    """``system``'s step on this rank: ``batch -> loss`` (a zerofn step also answers ``state_bytes()``)."""
    if system in ZF_SYSTEMS:
        return _build_zf(system, cfg, device)
    if system in DEEPSPEED_SYSTEMS:
        return _build_deepspeed(system, cfg, device, batch_per_rank)
    return _build_torch(system, cfg, device, world)


def _build_torch(system, cfg, device, world):
    import torch.nn.functional as F

    model = gpt_model(cfg, device)
    if system == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        net = fully_shard(model, mesh=mesh, mp_policy=mp)
        autocast = False  # the policy casts the parameters per module
    elif world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        autocast = True
    else:
        net, autocast = model, True
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)

    def step(batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = net(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _build_deepspeed(system, cfg, device, batch_per_rank):
    if device.type == "cuda" and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        # DeepSpeed compiles its CPU Adam at first use; for this GPU only, not for every architecture
        # torch lists (a newer CUDA compiler refuses the oldest of them)
        os.environ["TORCH_CUDA_ARCH_LIST"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
    import deepspeed
    import torch.nn.functional as F

    model = gpt_model(cfg, device)
    config = {
        "train_micro_batch_size_per_gpu": batch_per_rank,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; no other system clips
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": int(system[len("deepspeed-z")])},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    adamw = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
    if system.endswith("-offload"):  # ZeRO-Offload: its CPU Adam on pinned host state
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = {"type": "AdamW", "params": {**adamw, "betas": list(BETAS)}}
        optimizer = None
    else:
        # torch's fused AdamW over DeepSpeed's fp32 partitions: the kernel every other GPU row runs, so
        # that the rows compare ZeRO and not two Adam kernels (and no compiler is needed at first use)
        config["zero_allow_untested_optimizer"] = True
        optimizer = torch.optim.AdamW(model.parameters(), **adamw, fused=device.type == "cuda")
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), optimizer=optimizer, config=config
    )

    def step(batch):
        logits = engine(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return step


def _build_zf(system, cfg, device):
    import zerofn as zf
    from zerofn.bench.gpt import loss_fn_for

    apply = zf.functional(gpt_model(cfg, device))
    step = zf.train_step(loss_fn_for(apply), zf.optim.adamw(LR, betas=BETAS, eps=EPS, weight_decay=WD))
    step = zf_composition(system)(step)
    box = [step.init(apply.params)]

    def run(batch):
        box[0], metrics = step(box[0], batch)
        return metrics["loss"]

    run.state_bytes = lambda: zf.memory.state_bytes(box[0])["by_placement"]
    return run


def gpt_model(cfg, device: torch.device):
    """The GPT from seed 0, its weights drawn on ``device`` (a 1.4 B model's CPU initialisation would take
    longer than its benchmark); every system of one run draws the same ones."""
    from zerofn.bench.gpt import GPT

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(cfg)
