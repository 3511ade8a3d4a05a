"""``from_deepspeed``: the Step a DeepSpeed config (``ds_config.json``) asks for, built from zerofn's transforms.

A front-end over the transforms: ``from_deepspeed(config, loss_fn)`` reads a
DeepSpeed config (a dict, or the path of a JSON file) and composes what its
keys ask for, the same Step one would write by hand::

    train_step(loss_fn, chain(clip_by_global_norm(c), adamw(schedule, ...)), accumulate_steps, bucket_bytes=...)
      -> shard_optimizer / shard_grads / shard_params(prefetch=...)   zero_optimization.stage 1 / 2 / 3
      -> amp(torch.float16 | torch.bfloat16, loss scale ...)          fp16 / bf16
      -> offload("cpu" | "nvme", params=..., sub_group_bytes=...)     offload_optimizer / offload_param
      -> remat(offload="cpu" with cpu_checkpointing)                  activation_checkpointing,
                                                                      pipeline.activation_checkpoint_interval
      -> tensor_parallel(N)                                           tensor_parallel.autotp_size
      -> expert_parallel(N)                                           expert_parallel.autoep_size (AutoEP)
      -> context_parallel(N)                                          sequence_parallel_size (Ulysses, ALST)
      -> pipeline_parallel(N, microbatches=accumulation, "1f1b")      pipeline_stages=N (PipelineModule's num_stages)

It returns ``DeepSpeedRun(step, batch)``: the step, whose name and state are
those of the composition written by hand (a state of either steps the other),
and beside it the batch settings the config resolved (:class:`DeepSpeedConfig`).
A rank feeds ``batch.micro_batch_size`` samples per call, and every
``step.accumulate_steps``-th call updates: ``train_batch_size`` samples over
all ranks, as under DeepSpeed. The batch sizes count the data-parallel ranks,
``world // (autotp_size x sequence_parallel_size)``: the ranks of a tensor- or
sequence-parallel group feed one micro-batch, while every rank of an
expert-parallel group feeds its own (``autoep_size`` divides them, and is not
divided out). Under a pipeline (``from_deepspeed(..., pipeline_stages=N)``:
DeepSpeed's ``PipelineModule(num_stages=N)`` is code, not config) the
``gradient_accumulation_steps`` micro-batches are the pipeline's: every call
updates (``step.accumulate_steps`` is 1), a rank feeds
``batch.samples_per_call`` (micro x accumulation) samples, which the step cuts
into them, and ``N`` divides the data-parallel ranks out too.

The rules (the key-by-key table is in docs/migrating/deepspeed.md):

- Numbers keep DeepSpeed's meaning and defaults (its code's, where its
  docs differ: ``initial_scale_power`` 16, ``gradient_clipping`` 0), and
  sizes DeepSpeed counts in elements are converted to the bytes zerofn
  counts (``reduce_bucket_size`` x the bytes of a held parameter element;
  ``sub_group_size`` x the optimizer-state bytes per element).
- A key zerofn has no equivalent for, and whose absence changes no number
  (logging, profiling, tuning of DeepSpeed's own buffers), is listed in one
  ``UserWarning`` with what zerofn does instead; a key set to ``false``, or
  a block with ``"enabled": false``, asks for nothing and passes silently.
- A key that would change the numbers if ignored (``amsgrad``, apex
  ``amp``, ``consecutive_hysteresis``, curriculum learning, a MoE layer's
  ``capacity_factor`` or ``drop_tokens``, ...) raises a
  ValueError naming it and what to write instead, before anything is built.
- ``"auto"`` is filled in as the Hugging Face Trainer fills it when its
  arguments are passed: ``from_deepspeed(config, loss_fn,
  training_args=args)``, ``args`` a ``transformers.TrainingArguments`` or a
  dict of its fields, takes each value from the field the Trainer reads
  (``learning_rate``, ``per_device_train_batch_size``, ``max_steps``, ...),
  and the bucket sizes from the hidden size of the model ``loss_fn`` calls
  (or ``hidden_size=``); a number written in the config that disagrees with
  its field raises, as in the Trainer, with no ``"scheduler"`` the
  Trainer's ``lr_scheduler_type`` scales the learning rate, and with no
  ``"optimizer"`` (nor ``optimizer=``) the Trainer's own AdamW is built
  (no decay on biases and norm weights; the warning says so). Without
  ``training_args``, an ``"auto"`` raises, naming the key, what to write
  and the field that fills it, except where zerofn can resolve it: one
  batch key when the other two are numbers, and the sizes that only tune
  performance (buckets, prefetch), which take zerofn's defaults.

The modules: ``_reader`` (the file and its blocks, key by key), ``_auto``
(``"auto"`` as the Trainer fills it), ``_keys`` (the tables of known keys), ``_batch`` (the batch sizes), ``_optimizer``
(optimizer, scheduler, clipping), ``_precision`` (fp16 / bf16), ``_zero``
(ZeRO, offload, activation checkpointing), ``_tensor`` (AutoTP's ``tensor_parallel`` block), ``_expert``
(AutoEP's ``expert_parallel`` block, and the arguments of DeepSpeed's MoE layer a config may carry),
``_pipeline`` (``pipeline_stages`` and the ``pipeline`` block) and ``_build`` (the step).

Example:
    >>> import torch, zerofn as zf
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step, batch = zf.from_deepspeed({
    ...     "train_batch_size": 8, "gradient_accumulation_steps": 2,
    ...     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
    ...     "zero_optimization": {"stage": 2}, "bf16": {"enabled": True},
    ... }, loss_fn)
    >>> step.name, step.accumulate_steps, batch.micro_batch_size
    ('amp(shard_grads(train_step))', 2, 4)
"""

from zerofn.deepspeed._batch import BatchSizes, DeepSpeedConfig, batch_sizes
from zerofn.deepspeed._build import DeepSpeedRun, from_deepspeed

__all__ = ["BatchSizes", "DeepSpeedConfig", "DeepSpeedRun", "batch_sizes", "from_deepspeed"]
