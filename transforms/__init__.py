"""Transforms that rewrite a Step into a collective-aware Step.

Each is a function ``Step -> Step`` in a module of its own that replaces a
part of the step (``reduction``, ``storage``, ``precision``) or extends its
chain of extensions; see docs/design.md. The shard transforms nest:
``shard_params`` implies ``shard_grads``, which implies ``shard_optimizer``.

Applying a transform to a step that already has its effect (itself, or a
transform that implies it) returns the step unchanged when the options
agree, and raises a ValueError naming both settings when they differ; the
same rule holds for every transform here.

``zf.from_deepspeed(config, loss_fn)`` (the front-end ``zerofn.deepspeed``)
composes them from a DeepSpeed ``ds_config.json``.
"""

from zerofn.transforms.amp import amp
from zerofn.transforms.context_parallel import context_parallel
from zerofn.transforms.expert_parallel import expert_parallel
from zerofn.transforms.offload import offload
from zerofn.transforms.pipeline_parallel import pipeline_parallel
from zerofn.transforms.quantize import quantize
from zerofn.transforms.remat import remat
from zerofn.transforms.shard_grads import shard_grads
from zerofn.transforms.shard_optimizer import shard_optimizer
from zerofn.transforms.shard_params import shard_params
from zerofn.transforms.tensor_parallel import tensor_parallel

__all__ = [
    "amp",
    "context_parallel",
    "expert_parallel",
    "offload",
    "pipeline_parallel",
    "quantize",
    "remat",
    "shard_grads",
    "shard_optimizer",
    "shard_params",
    "tensor_parallel",
]
