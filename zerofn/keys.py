"""The keys zerofn builds and reads back, in one place: a bucket's key in the optimizer's view, and the
keys of a checkpoint's records. Each key is built by one function here and parsed by its inverse.

Example:
    >>> from zerofn import keys
    >>> keys.bucket(3), keys.bucket_index("b3"), keys.bucket_index("mu")
    ('b3', 3, None)
    >>> keys.opt(("inner", "b3", "mu")), keys.opt_bucket(("inner", "b3", "mu"))
    ('opt:inner/*/mu', 3)
    >>> keys.opt((keys.scope("decay"), 0, "count")), keys.unscoped("opt:[decay]/0/count")
    ('opt:[decay]/0/count', 'opt:0/count')
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXTRA",
    "LOSS_SCALE",
    "OPT",
    "bucket",
    "bucket_index",
    "extra",
    "loss_scale",
    "opt",
    "opt_bucket",
    "rng",
    "scope",
    "unscoped",
]

OPT, EXTRA, LOSS_SCALE = "opt:", "extra:", "loss_scale:"
_BUCKET = "b"


def bucket(i: int) -> str:
    """Bucket ``i``'s key in the optimizer's view of the parameters (``{"b0": ..., "b1": ...}``)."""
    return f"{_BUCKET}{i}"


def bucket_index(key: Any) -> int | None:
    """The bucket a key names (the inverse of :func:`bucket`), or None for any other key."""
    if isinstance(key, str) and key.startswith(_BUCKET) and key[1:].isdigit() and key[1:] == str(int(key[1:])):
        return int(key[1:])
    return None


def opt(path: tuple) -> str:
    """A checkpoint key of an optimizer-state leaf: its path, with each bucket key as ``*``."""
    return OPT + "/".join("*" if bucket_index(c) is not None else str(c) for c in path)


def scope(label: Any) -> str:
    """The path component that puts what follows under ``label``: one of several inner states side by side
    (a group's, :class:`zerofn.roles.Inner` with a scope), written ``[label]``."""
    text = str(label)
    for ch in _ESCAPED:
        text = text.replace(ch, f"%{ord(ch):02X}")
    return f"[{text}]"


def unscoped(key: str) -> str:
    """``key`` with the :func:`scope` components of its path left out: what an optimizer-state leaf is
    called without groups, and the key two groupings of the same parameters agree on."""
    if not key.startswith(OPT):
        return key
    parts = key[len(OPT) :].split("/")
    return OPT + "/".join(c for c in parts if not _is_scope(c))


def _is_scope(component: str) -> bool:
    return len(component) >= 2 and component[0] == "[" and component[-1] == "]"


_ESCAPED = "%/[]"  # escaped in a scope's label (as %XX), so that a scope is one component, told apart by its brackets


def opt_bucket(path: tuple) -> int | None:
    """The bucket an optimizer-state path runs through (None: a leaf of no bucket, such as a count)."""
    return next((i for c in path if (i := bucket_index(c)) is not None), None)


def extra(entry: str, path: str) -> str:
    """A checkpoint key of a leaf of ``state.extra[entry]`` at ``path`` (a key string)."""
    return f"{EXTRA}{entry}:{path}"


def loss_scale(path: str) -> str:
    """A checkpoint key of a leaf of the loss scale at ``path`` (a key string)."""
    return LOSS_SCALE + path


def rng(kind: str, rank: int) -> str:
    """A checkpoint key of rank ``rank``'s RNG state of ``kind`` (``"torch"``, ``"cuda"``)."""
    return f"rng:{kind}:{rank}"
