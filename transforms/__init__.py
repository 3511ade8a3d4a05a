"""Transforms that rewrite a Step into a collective-aware Step.

Each is a function ``Step -> Step`` in a module of its own.
"""

from zerofn.transforms.shard_optimizer import shard_optimizer

__all__ = ["shard_optimizer"]
