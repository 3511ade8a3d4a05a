"""Transforms that rewrite a Step into a collective-aware Step.

Each is a function ``Step -> Step`` in a module of its own. The shard
transforms nest: ``shard_grads`` implies ``shard_optimizer``; applying an
implied transform again returns the step unchanged.
"""

from zerofn.transforms.shard_grads import shard_grads
from zerofn.transforms.shard_optimizer import shard_optimizer

__all__ = ["shard_grads", "shard_optimizer"]
