"""Transforms that rewrite a Step into a collective-aware Step.

Each is a function ``Step -> Step`` in a module of its own. The shard
transforms nest: ``shard_params`` implies ``shard_grads``, which implies
``shard_optimizer``; applying an
implied transform again returns the step unchanged.
"""

from zerofn.transforms.amp import amp
from zerofn.transforms.offload import offload
from zerofn.transforms.shard_grads import shard_grads
from zerofn.transforms.shard_optimizer import shard_optimizer
from zerofn.transforms.shard_params import shard_params

__all__ = ["amp", "offload", "shard_grads", "shard_optimizer", "shard_params"]
