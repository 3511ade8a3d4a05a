"""What a run derives once from its step and keeps in its states' :class:`~zerofn.state.RunCache`.

A :class:`~zerofn.step.Step` is a value: it holds no cache. What is costly to derive, or must stay the same
object from update to update, is derived by ``init`` (or on a run's first need) and carried by the run:

- the optimizer bound to the buckets this rank updates (:func:`run_optimizer`): the user's optimizer in
  the precision's and the extensions' wrappers, which may learn from update to update (and hold pools
  of buffers); one per optimizer, precision and chain of extensions the run is stepped with;
- the model ``loss_fn`` calls (:func:`run_model`), found in its closure once per ``loss_fn``.
"""

from __future__ import annotations

from typing import Any

from zerofn import optim as O
from zerofn.closure import find_functional
from zerofn.functional import Functional
from zerofn.state import Layout, RunCache

__all__ = ["run_model", "run_optimizer"]


class _Same:
    """A key that equals another exactly when it holds the same objects (identity, as a cache on each
    step compared them): it holds them, so their ids stay theirs."""

    __slots__ = ("objects",)

    def __init__(self, *objects: Any) -> None:
        self.objects = objects

    def __hash__(self) -> int:
        return hash(tuple(map(id, self.objects)))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Same)
            and len(other.objects) == len(self.objects)
            and all(a is b for a, b in zip(self.objects, other.objects))
        )


def run_optimizer(step: Any, run: RunCache, layout: Layout, rank: int, treedef: Any) -> O.GradientTransformation:
    """``step.bound_optimizer(layout, rank, treedef)``, built once per run for the step's optimizer,
    precision and extensions (a copy of the step with other settings shares it)."""
    key = _Same("optimizer", step.optimizer, step.precision, *step.extensions)
    return run.get(key, lambda: step.bound_optimizer(layout, rank, treedef))


def run_model(step: Any, run: RunCache) -> Functional:
    """The ``zf.functional`` apply ``step.loss_fn`` calls, found once per run."""
    return run.get(_Same("model", step.loss_fn), lambda: find_functional(step.loss_fn))
