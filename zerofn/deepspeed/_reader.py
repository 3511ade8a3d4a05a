"""Reading a DeepSpeed config: the file (or dict), its blocks key by key, and each value as the kind it must be.

A :class:`Block` remembers the keys it was asked for, so that what no reader asked for is left over
for the construction warning (or an error, where ignoring it would change the numbers).
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import os
from typing import Any

from zerofn.deepspeed._auto import FILLED_BY
from zerofn.deepspeed._keys import AUTO, AUTO_HINTS

__all__ = ["Block", "asks_nothing", "auto_error", "load_config", "value_as"]


class Block:
    """One dict of the config, read key by key; what is never read is left over for the warning."""

    def __init__(self, path: str, data: Any):
        if not isinstance(data, dict):
            raise ValueError(f"from_deepspeed: {path} must be a JSON object (a dict), got {data!r}")
        self.path, self.data, self.used = path, data, set()

    def key(self, k: str) -> str:
        return f"{self.path}.{k}" if self.path else k

    def __contains__(self, k: str) -> bool:
        return k in self.data

    def raw(self, k: str, default: Any = None) -> Any:
        self.used.add(k)
        return self.data.get(k, default)

    def get(self, k: str, default: Any, kind: str, *, auto: Any = None, low: float | None = None) -> Any:
        """The value of ``k`` (``default`` when absent) as ``kind``; "auto" raises unless ``auto`` resolves it."""
        self.used.add(k)
        if k not in self.data:
            return default
        v = self.data[k]
        if v == AUTO:
            if auto is not None:
                return auto
            raise auto_error(self.key(k))
        return value_as(self.key(k), v, kind, low)

    def block(self, k: str) -> Block | None:
        self.used.add(k)
        v = self.data.get(k)
        return None if v is None else Block(self.key(k), v)

    def leftover(self) -> list[str]:
        return [k for k in self.data if k not in self.used]


def auto_error(key: str) -> ValueError:
    """The error for an "auto" left in the config: what to write, and the training_args field that fills it.

    (Under ``training_args=`` every "auto" a field fills is filled before the reader runs, so what is
    left is an "auto" no Trainer argument fills.)
    """
    hint = AUTO_HINTS.get(key.rsplit(".", 1)[-1], "the value itself")
    field = FILLED_BY.get(key)
    if field is None:
        return ValueError(
            f'from_deepspeed: {key} is "auto", which no Hugging Face Trainer argument fills (the Trainer leaves it '
            f"to DeepSpeed as it is): write {hint}"
        )
    return ValueError(
        f'from_deepspeed: {key} is "auto", which the Hugging Face Trainer fills in from its own arguments: pass '
        f"training_args= ({field}), or write {hint}"
    )


def value_as(key: str, v: Any, kind: str, low: float | None = None) -> Any:
    """``v`` as ``kind`` ("bool", "int" (an element count: 5e8 is fine), "float", "str", "pair")."""
    if kind == "bool":
        if isinstance(v, bool):
            return v
        raise ValueError(f"from_deepspeed: {key} must be true or false, got {v!r}")
    if kind == "str":
        if isinstance(v, str):
            return v
        raise ValueError(f"from_deepspeed: {key} must be a string, got {v!r}")
    if kind == "pair":
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(_real(x) for x in v):
            return (float(v[0]), float(v[1]))
        raise ValueError(f"from_deepspeed: {key} must be a list of two numbers such as [0.9, 0.999], got {v!r}")
    if not _real(v) or not math.isfinite(v):
        raise ValueError(f"from_deepspeed: {key} must be a number, got {v!r}")
    if kind == "int":
        if float(v) != int(v):
            raise ValueError(f"from_deepspeed: {key} must be a whole number, got {v!r}")
        v = int(v)
    else:
        v = float(v)
    if low is not None and v < low:
        raise ValueError(f"from_deepspeed: {key} must be >= {low:g}, got {v!r}")
    return v


def _real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def load_config(config: Any) -> dict:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"from_deepspeed: no config file {path!r}; pass a DeepSpeed JSON file or a dict")

        def no_duplicates(pairs):
            seen = {}
            for k, v in pairs:
                if k in seen:
                    raise ValueError(f"from_deepspeed: {path}: key {k!r} appears twice (DeepSpeed refuses it too)")
                seen[k] = v
            return seen

        with open(path) as f:
            try:
                return json.load(f, object_pairs_hook=no_duplicates)
            except json.JSONDecodeError as e:
                raise ValueError(f"from_deepspeed: {path} is not valid JSON: {e}") from None
    raise TypeError(
        f"from_deepspeed: config must be a dict or the path of a DeepSpeed JSON file, got {type(config).__name__}"
    )


def asks_nothing(v: Any) -> bool:
    """A key set to false (or null), or a block with "enabled": false."""
    return v is False or v is None or (isinstance(v, dict) and v.get("enabled") is False)
