"""The keys of a DeepSpeed config that ``from_deepspeed`` knows, table by table, with what zerofn does instead.

``docs/migrating/deepspeed.md`` lists every key named here (``tests/test_docs_site.py`` checks it).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "ADAM_PARAMS",
    "AUTO",
    "AUTO_HINTS",
    "COMPRESSED_OPTIMIZERS",
    "EP_ERRORS",
    "EP_IGNORED",
    "EP_PRESETS",
    "EP_QUIET",
    "MOE_LAYER_ERRORS",
    "MOE_LAYER_IGNORED",
    "LAMB_PARAMS",
    "OPTIMIZERS",
    "PIPE_IGNORED",
    "PIPE_QUIET",
    "PRECISION_IGNORED",
    "SCHEDULERS",
    "SGD_PARAMS",
    "TOP_ERRORS",
    "TOP_IGNORED",
    "TOP_QUIET",
    "TP_ERRORS",
    "TP_IGNORED",
    "TP_PRESETS",
    "ZERO_ALIASES",
    "COMPRESSION_TECHNIQUES",
    "OFFLOAD_KNOWN",
    "ZERO_ANYWAY",
    "ZERO_BLOCK_ERRORS",
    "ZERO_IGNORED",
    "ZERO_READ",
    "Anyway",
]

AUTO = "auto"
OPTIMIZERS = ("Adam", "AdamW", "SGD", "Lamb")
ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad")
SGD_PARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
LAMB_PARAMS = (  # DeepSpeed's FusedLamb
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "bias_correction",
    "max_coeff",
    "min_coeff",
    "eps_inside_sqrt",
    "max_grad_norm",
    "amsgrad",
)
# DeepSpeed's communication-compressing optimizers (refused), as written in configs -> the optimizer
# they compress, which zerofn runs uncompressed.
COMPRESSED_OPTIMIZERS = {
    "OneBitAdam": "Adam",
    "OnebitAdam": "Adam",
    "ZeroOneAdam": "Adam",
    "OneBitLamb": "Lamb",
    "OnebitLamb": "Lamb",
}
_WARMUP = ("warmup_num_steps", "warmup_type", "last_batch_iteration")
SCHEDULERS = {  # each scheduler's parameters
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", *_WARMUP),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", *_WARMUP),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "cos_min_ratio", *_WARMUP),
}

# What to write instead of "auto", per key (_auto.FILLED_BY names the training_args field that fills it).
AUTO_HINTS = {
    "train_batch_size": "the global batch per update, over all ranks",
    "train_micro_batch_size_per_gpu": "the batch each rank feeds per call",
    "gradient_accumulation_steps": "the micro-batches per update",
    "gradient_clipping": "the largest gradient norm, e.g. 1.0, or 0 for none",
    "lr": "the learning rate, e.g. 3e-4",
    "betas": "[beta1, beta2], e.g. [0.9, 0.999]",
    "eps": "e.g. 1e-8",
    "weight_decay": "e.g. 0.01, or 0",
    "warmup_min_lr": "the learning rate at the start, e.g. 0",
    "warmup_max_lr": "the peak learning rate, e.g. 3e-4",
    "warmup_num_steps": "the updates of the warmup, e.g. 100",
    "total_num_steps": "the number of updates of the whole run",
    "enabled": "true or false",
    "stage": "0, 1, 2 or 3",
}

# Top-level keys with no equivalent whose absence changes no number: warned, with what zerofn does.
TOP_IGNORED = {
    "steps_per_print": "zerofn prints nothing itself: each step returns its metrics (loss, grad_norm, loss_scale, ...)",
    "wall_clock_breakdown": "no timers: time the steps yourself",
    "dump_state": "print(state) shows what the state holds, where, and its bytes",
    "memory_breakdown": "zf.memory.state_bytes(state) and zf.memory.track() measure memory",
    "zero_allow_untested_optimizer": "every zf.optim optimizer runs under every stage",
    "zero_force_ds_cpu_optimizer": "offload runs the zf.optim optimizer on the host",
    "flops_profiler": "no profiler: use torch.profiler",
    "tensorboard": "no monitors: log the metrics yourself",
    "wandb": "no monitors: log the metrics yourself",
    "csv_monitor": "no monitors: log the metrics yourself",
    "comet": "no monitors: log the metrics yourself",
    "comms_logger": "metrics['comm_bytes'] counts each step's collective traffic",
    "checkpoint": "zf.checkpoint.save and load take their options as arguments",
    "nebula": "zf.checkpoint.save(..., blocking=False) writes in the background",
    "aio": "NVMe offload streams with its own reader and writer threads",
    "autotuning": "no autotuner",
    "dataloader_drop_last": "zerofn builds no data loader: drop the last partial batch yourself",
    "sparse_gradients": "gradients are dense",
    "prescale_gradients": "gradients are averaged once, after the reduction (the same average up to rounding)",
    "gradient_predivide_factor": "gradients are averaged once, after the reduction (the same average up to rounding)",
    "disable_allgather": "stages 1-3 always all-gather the updated shards",
    "eigenvalue": "no eigenvalue computation",
    "sparse_attention": "no sparse-attention kernels: the model computes its own attention",
    "hybrid_engine": "no inference engine: step.apply(state, ...) runs the model",
    "timers": "no timers",
    "data_types": "gradients accumulate in the dtype they are reduced in (communication_data_type)",
    "seq_parallel_communication_data_type": "context_parallel's all-to-alls move activations in their own dtype",
    "weight_quantization": "no quantization",
    "communication_data_type": "gradients of fp32 parameters are reduced in fp32 (another dtype needs bf16 or fp16)",
    "use_data_before_expert_parallelism": "zerofn lays out its own mesh: each expert-parallel group is consecutive "
    "ranks (dp x cp x ep x tp); the layout changes which ranks exchange tokens, not the numbers",
}

TOP_QUIET = {"gradient_predivide_factor": 1.0}  # DeepSpeed's defaults that ask for nothing

# Top-level blocks that would change the numbers when enabled: errors, with what to write instead.
TOP_ERRORS = {
    "amp": 'apex AMP has no equivalent; zerofn\'s mixed precision is "bf16": {"enabled": true} or '
    '"fp16": {"enabled": true}: write one of those instead',
    "torch_autocast": 'write "bf16": {"enabled": true} (or "fp16") for zerofn\'s amp: autocast, fp32 master weights',
    "elasticity": "it changes the batch sizes with the world size; zerofn takes them as written (and its checkpoints "
    "load on any world size): remove it and write train_batch_size / train_micro_batch_size_per_gpu",
    "curriculum_learning": "it changes the data each step sees; zerofn has no data pipeline: remove it "
    '(or set "enabled": false) and feed the batches you want',
    "data_efficiency": "it changes the data each step sees; zerofn has no data pipeline: remove it "
    '(or set "enabled": false) and feed the batches you want',
    "progressive_layer_drop": "it skips layers while training; zerofn has no equivalent: remove it "
    '(or set "enabled": false)',
    "quantize_training": "it quantizes the weights while training; zerofn has no equivalent: remove it "
    '(or set "enabled": false)',
}


class Anyway(NamedTuple):
    """A ``zero_optimization`` key zerofn does anyway: the value that asks for nothing, and why."""

    value: bool
    why: str


# zero_optimization keys zerofn's shard transforms do anyway: silent with these values, warned otherwise.
ZERO_ANYWAY = {
    "overlap_comm": Anyway(True, "reductions always overlap backward"),
    "contiguous_gradients": Anyway(True, "gradients always go into contiguous buckets"),
    "reduce_scatter": Anyway(True, "stages 1-3 always reduce-scatter"),
    "allgather_partitions": Anyway(True, "stages 1-2 always all-gather the updated shards"),
    "ignore_unused_parameters": Anyway(True, "a parameter without a gradient gets zeros"),
    "load_from_fp32_weights": Anyway(True, "checkpoints restore the fp32 master weights"),
    "round_robin_gradients": Anyway(False, "no round-robin gradient copies"),
    "elastic_checkpoint": Anyway(True, "checkpoints load on any composition and world size"),
    "grad_hooks": Anyway(True, "gradients are reduced from hooks during backward"),
}

# zero_optimization keys with no equivalent (memory and traffic only): warned.
ZERO_IGNORED = {
    "allgather_bucket_size": "updated shards are all-gathered per bucket of reduce_bucket_size",
    "stage3_max_live_parameters": "ZeRO-3 gathers one unit (a block) at a time plus the prefetched ones",
    "stage3_max_reuse_distance": "ZeRO-3 releases a unit after its forward and gathers it again for backward",
    "stage3_param_persistence_threshold": "ZeRO-3 shards every parameter; small ones travel with their module's unit "
    "(to gather coarser units, build the step by hand with shard_params(units=MinUnitBytes(n)))",
    "stage3_model_persistence_threshold": "ZeRO-3 shards every parameter",
    "stage3_gather_16bit_weights_on_model_save": "step.state_dict(state) and python -m zerofn consolidate gather "
    "on demand",
    "stage3_module_granularity_threshold": "ZeRO-3 units are the model's blocks (shard_params(units=...) by hand)",
    "stage3_use_all_reduce_for_fetch_params": "ZeRO-3 fetches with all-gathers",
    "memory_efficient_linear": "linear layers are the model's own",
    "mics_hierarchical_params_gather": "no MiCS sub-groups",
    "use_multi_rank_bucket_allreduce": "one collective per bucket",
    "legacy_stage1": "one stage-1 implementation",
    "pipeline_loading_checkpoint": "it makes the ranks of a node load a ZeRO-3 checkpoint one after another; "
    "zf.checkpoint.load reads each rank's part of the state on every rank at once (the same state)",
    "override_module_apply": "no module patching",
    "log_trace_cache_warnings": "no trace cache",
    "zeropp_loco_param": "no quantized communication",
}
ZERO_ALIASES = {  # DeepSpeed's names without the stage3_ prefix
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "model_persistence_threshold": "stage3_model_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
}
# zero_optimization keys the reader reads itself (the stage, sizes, offload and their older spellings).
ZERO_READ = {
    "stage",
    "zero_hpz_partition_size",
    "mics_shard_size",
    "zero_quantized_weights",
    "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients",
    "reduce_bucket_size",
    "stage3_prefetch_bucket_size",
    "sub_group_size",
    "offload_optimizer",
    "offload_param",
    "cpu_offload",
    "cpu_offload_param",
    "cpu_offload_use_pin_memory",
}

# zero_optimization blocks that change the numbers when set: errors, with what to write instead.
ZERO_BLOCK_ERRORS = {
    "zenflow": "ZenFlow updates the most important gradient columns each step and the rest stale, every "
    "update_interval steps, which changes the numbers; zerofn updates every parameter from its gradient on every "
    "update (offload to the CPU overlaps the host update with the next step instead): remove it",
}

# The keys of offload_optimizer / offload_param that tune DeepSpeed's own buffers: warned (device, nvme_path,
# pin_memory and ratio are read).
OFFLOAD_KNOWN = {
    "nvme_path",
    "buffer_count",
    "buffer_size",
    "max_in_cpu",
    "fast_init",
    "pipeline",
    "pipeline_read",
    "pipeline_write",
    "super_offload",
    "cpuadam_cores_perc",
}

# compression_training's techniques (DeepSpeed's compression library): any enabled one is an error.
COMPRESSION_TECHNIQUES = {
    "weight_quantization": "quantizes the weights while training",
    "activation_quantization": "quantizes the activations while training",
    "sparse_pruning": "prunes weights while training",
    "row_pruning": "prunes rows of the weights while training",
    "head_pruning": "prunes attention heads while training",
    "channel_pruning": "prunes convolution channels while training",
    "layer_reduction": "drops layers of the model (distillation into fewer layers)",
}

# Keys of the fp16 / bf16 blocks with no equivalent whose absence changes no number: warned (any other key
# the reader does not read there is an error).
PRECISION_IGNORED = {
    "immediate_grad_update": "gradients accumulate into their bucket as backward produces them",
    "check_grad_overflow": "a step whose loss or gradient is not finite is always skipped",
}

# The pipeline block (DeepSpeed's PipelineEngine; the stages are PipelineModule's num_stages, from_deepspeed's
# pipeline_stages=): stages and activation_checkpoint_interval are read (_pipeline.py). The values of the other keys
# that ask for nothing: DeepSpeed's no-op defaults (its "partition" default, "best", is never read), and zerofn's
# behaviour (whole activations sent, non-reentrant checkpointing, blocks split evenly).
PIPE_QUIET = {
    "pipe_partitioned": (False,),
    "grad_partitioned": (False,),
    "use_reentrant": (False,),
    "seed_layers": (False,),
    "partition": ("best", "uniform"),
}
# Keys that only tune DeepSpeed's engine or where the layers sit: warned with any other value.
PIPE_IGNORED = {
    "pipe_partitioned": "zerofn's stages send each activation whole to the next stage's ranks (DeepSpeed splits it "
    "over the tensor-parallel ranks, and only beside tensor parallelism)",
    "grad_partitioned": "zerofn's stages send each activation's gradient whole to the previous stage's ranks "
    "(DeepSpeed splits it over the tensor-parallel ranks, and only beside tensor parallelism)",
    "use_reentrant": "remat checkpoints with torch's non-reentrant checkpoint (the same numbers)",
    "seed_layers": "zerofn does not build the model: it trains the parameters step.init is given (seed their "
    "initialisation yourself)",
    "partition": "pipeline_parallel divides the decoder's blocks evenly over the stages (the first stages one more), "
    "the embedding on the first stage and the final norm, head and loss on the last; to place the blocks yourself "
    "build the step by hand with pipeline_parallel(step, N, microbatches=m, split=[...])",
}

# The tensor_parallel block (AutoTP training): autotp_size N is tensor_parallel(step, N); tp.tp_size, mpu,
# tp_group and preset_model are read beside it (_tensor.py). Keys that change no number: warned.
TP_IGNORED = {
    "tp_overlap_comm": "the tensor-parallel all-reduces run as the layers reach them, not overlapped (true only "
    "changes when they run)",
    "dtype": "the parameters' dtype is the precision block's: fp32, or bf16 / fp16 under amp",
    "keep_module_on_host": "tensor_parallel slices each weight where it is (a model built on the meta device under "
    "ZeRO-3 is split as each layer is initialised)",
    "tp_grain_size": "heads and features split evenly over the ranks (DeepSpeed does not use it in training either)",
    "replace_with_kernel_inject": "no inference kernels: the model's own layers compute",
    "kernel_inject": "no inference kernels: the model's own layers compute",
}
# Keys that would change which layers are split or how: errors, with what to write instead.
TP_ERRORS = {
    "partition_config": "a custom split of the layers; zerofn derives Megatron's for Hugging Face Llama, Qwen2/3 and "
    "Mistral. Remove it for those, or build the step by hand: tensor_parallel(step, N, plan={module path: "
    "'colwise' | 'rowwise'})",
    "injection_policy_tuple": "an injection policy names the row-wise layers of another model; zerofn derives "
    "Megatron's split for Hugging Face Llama, Qwen2/3 and Mistral. Remove it for those, or build the step by hand: "
    "tensor_parallel(step, N, plan={module path: 'colwise' | 'rowwise'})",
}
TP_PRESETS = ("llama", "qwen2")  # DeepSpeed's presets whose split zerofn derives itself

# The expert_parallel block (AutoEP): "enabled": true with autoep_size N is expert_parallel(step, N); enabled,
# autoep_size, expert_tensor_parallel_size and preset_model are read beside it (_expert.py). The values of the
# other keys that ask for nothing (DeepSpeed's defaults: the model's own routing):
EP_QUIET = {
    "use_grouped_mm": (True,),
    "disable_triton_grouped_mm": (False,),
    "combine_impl": ("auto",),
    "validate_folding_routing": (False,),
    "score_func": ("auto",),
    "score_apply": ("auto",),
    "route_norm": (None,),
    "route_scale": (1, 1.0),
    "top_k": ("auto",),
    "routed_scaling_factor": ("auto",),
    "num_expert_groups": (None,),
    "num_limited_groups": (None,),
    "load_balance_coeff": (None,),
}
# Keys that change no number: warned.
EP_IGNORED = {
    "use_grouped_mm": "the model's own experts implementation computes each rank's experts",
    "disable_triton_grouped_mm": "the model's own experts implementation computes each rank's experts",
    "combine_impl": "the routed outputs are combined as the model's own code weighs them",
    "validate_folding_routing": "a check of DeepSpeed's AutoEP with AutoTP; zerofn's tensor_parallel sits inside "
    "expert_parallel on the mesh",
}
_DETECTION = (
    "a layout of the mixture-of-experts layers for DeepSpeed's detection; zerofn's expert_parallel finds the "
    "experts of Hugging Face Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and GPT-OSS models itself (their stacked "
    "expert weights): remove it for those"
)
_ROUTING = (
    "it overrides the model's routing; zerofn routes every token as the model's own router does, with the model "
    "config's values (num_experts_per_tok, norm_topk_prob, routed_scaling_factor, n_group, topk_group, "
    "scoring_func): remove it, or set the model config's field"
)
# Keys that would change which parameters are experts or how tokens are routed: errors.
EP_ERRORS = {
    **dict.fromkeys(
        (
            "moe_layer_pattern",
            "router_pattern",
            "expert_pattern",
            "expert_w1",
            "expert_w2",
            "expert_w3",
            "num_experts_attr",
            "top_k_attr",
            "has_shared_experts",
            "shared_experts_pattern",
            "shared_experts_gate_pattern",
        ),
        _DETECTION,
    ),
    **dict.fromkeys(
        (
            "score_func",
            "score_apply",
            "route_norm",
            "route_scale",
            "top_k",
            "routed_scaling_factor",
            "num_expert_groups",
            "num_limited_groups",
        ),
        _ROUTING,
    ),
    "load_balance_coeff": "auxiliary-loss-free load balancing (an expert bias updated from the routing) changes "
    "the routing; zerofn routes as the model's own router does: remove it (DeepSpeed refuses it too)",
}
EP_PRESETS = ("mixtral", "qwen3_moe", "deepseek_v3")  # DeepSpeed's presets whose models zerofn finds itself

# The arguments of DeepSpeed's own MoE layer (deepspeed.moe.layer.MoE, in model code), found in a config (at the
# top level, in a "moe" block or in expert_parallel): errors, each with what zerofn does instead. drop_tokens
# false and the keys that then ask for nothing pass silently.
_DROPLESS = (
    "zerofn's expert_parallel is dropless: every token reaches its top-k experts (the row counts are exchanged "
    "first, so an expert takes as many as are routed to it), with no capacity factor"
)
MOE_LAYER_ERRORS = {
    "ep_size": "the expert-parallel size of DeepSpeed's MoE layer, an argument in model code; a config asks for "
    'expert parallelism as "expert_parallel": {"enabled": true, "autoep_size": N}: write that instead',
    "expert_parallel_size": 'not a DeepSpeed config key; write "expert_parallel": {"enabled": true, '
    '"autoep_size": N} for expert parallelism over N ranks',
    "capacity_factor": f"a capacity per expert past which tokens are dropped; {_DROPLESS}: remove it (or write "
    '"drop_tokens": false, under which it asks for nothing)',
    "eval_capacity_factor": f"a capacity per expert past which tokens are dropped; {_DROPLESS}: remove it (or "
    'write "drop_tokens": false, under which it asks for nothing)',
    "min_capacity": f"a capacity per expert past which tokens are dropped; {_DROPLESS}: remove it (or write "
    '"drop_tokens": false, under which it asks for nothing)',
    "drop_tokens": f"tokens past an expert's capacity are dropped; {_DROPLESS}: write false or remove it",
    "noisy_gate_policy": "noise in the gate changes the routing; zerofn routes as the model's own router does: "
    "remove it (or write null)",
    "top2_2nd_expert_sampling": "sampling the second expert changes the routing; zerofn routes every token to the "
    "top-k experts of the model's own router: write false or remove it",
    "use_residual": "Residual MoE (a dense MLP beside the experts, mixed by a learned coefficient) is another "
    "model; zerofn trains the Hugging Face model as it is: write false or remove it",
    "enable_expert_tensor_parallelism": "zerofn holds each expert whole on the ranks of its expert-parallel group "
    "(no expert tensor parallelism): write false or remove it",
    "num_experts": "the model's config says how many experts a block has (num_local_experts, num_experts or "
    "n_routed_experts), and zerofn reads it from the model: remove it",
    "k": "the model's config says how many experts each token goes to (num_experts_per_tok), and zerofn reads it "
    "from the model: remove it",
}
# Keys of DeepSpeed's MoE layer that change no number here: warned when true.
MOE_LAYER_IGNORED = {
    "use_rts": "Random Token Selection picks which tokens a full expert drops; zerofn drops none",
    "use_tutel": "no Tutel kernels: the model's own experts implementation computes",
}
