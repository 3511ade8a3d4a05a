"""What a transform adds to a step beyond its three parts: an :class:`Extension` in the step's chain.

A Step has three parts that a transform may replace (``reduction``,
``storage``, ``precision``) and one ordered chain that a transform extends:
``step.extensions``. An extension is one transform's additions, each
optional:

- ``wrap_optimizer``: optimizer -> optimizer. Applied after the precision
  part's wrapper (amp's fp32 master weights are optimizer state, so a
  wrapper that places optimizer state moves them too), then in the order
  the extensions were added.
- ``around``: ``around(model, state)`` -> a context manager entered around
  forward and backward, outermost first; ``model()`` returns the
  ``zf.functional`` apply the loss calls (found on first use).
- ``feed``: ``feed(batch)`` -> what ``loss_fn`` is given in place of the
  rank's micro-batch, called inside the ``around`` contexts
  (``context_parallel`` gives each rank its slice of the sequence).
- ``check``: ``check(step)`` runs when ``step.init`` is called, before
  anything is built, for settings that depend on transforms applied later.
- ``prepare``: ``prepare(split, functional, where) -> split`` rewrites the
  parameters ``init`` holds (a :class:`~zerofn.storage.ParamSplit`, in the
  dtypes the precision part holds them) before anything is built from
  them, and the module to match (``quantize`` holds a frozen weight as its
  quantized parts); ``functional`` is the ``zf.functional`` the params came
  from (None for a plain tree), ``where`` names the caller in errors.
- ``prepare_first``: its ``prepare`` runs before the other extensions'
  (in the order of application otherwise): it changes what the model's
  layers are (``tensor_parallel`` splits them), which the others' read.
- ``reports``: its forward reports checks made on the device
  (:func:`zerofn.step.report`): every update's statistics then carry
  whether one failed, so that every rank skips alike.
- ``runs``: ``runs(step, state, sink, scale) -> runner``, which takes the
  forward and backward over: ``runner.sink`` is where the parameters'
  gradients go in its place (the step's sink behind it), and
  ``runner(params, batch)`` runs forward and backward and returns what
  ``loss_fn`` would (its loss detached), each ``feed`` applied to every
  micro-batch it cuts. ``pipeline_parallel`` runs a
  schedule of micro-batches over the stages this way. At most one
  extension runs.
- ``updates_late``: ``updates_late(device_type) -> bool``, whether its
  optimizer wrapper may leave the update running after the step returns
  when the parameters compute on ``device_type`` (the tensors it writes
  marked with :func:`zerofn.state.arriving`); the module a state adopts
  then waits for them before its parameters are read.

What a parallelism does on an axis of the step's mesh (the parameters it
cuts, the groups it uses) is no extension: it is a
:class:`zerofn.sharding.Claim` on the step (:meth:`zerofn.step.Step.claim`).

Its ``name`` is its piece of the step's name, and ``options`` what it was
asked for: a transform applied to a step that already has its extension
returns the step unchanged when the options agree and raises when they
differ (:func:`zerofn.step.reapply`).

Example (a transform written outside zerofn, counting forward passes):
    >>> import contextlib, torch, zerofn as zf
    >>> from zerofn.extension import Extension
    >>> calls = []
    >>> @contextlib.contextmanager
    ... def count(model, state):
    ...     calls.append(int(state.count))
    ...     yield
    >>> def counted(step):
    ...     return step.extend(Extension("counted", around=count))
    >>> apply = zf.functional(torch.nn.Linear(2, 1))
    >>> step = counted(zf.train_step(lambda p, b: apply(p, b).sum(), zf.optim.sgd(0.1)))
    >>> state, _ = step(step.init(apply.params), torch.ones(1, 2))
    >>> step.name, calls
    ('counted(train_step)', [0])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Extension"]


@dataclass(frozen=True)
class Extension:
    """One transform's additions to a step (see the module docs).

    Attributes:
        name: the transform's name, its piece of the step's name.
        options: the transform's settings (compared when it is applied again).
        wrap_optimizer: optimizer -> optimizer, or None.
        around: ``(model, state) -> context manager`` around forward and backward, or None.
        feed: ``batch -> batch``: what ``loss_fn`` is given in place of the rank's micro-batch, or None.
        check: ``step -> None``, raises when the finished step cannot honour the extension.
        prepare: ``(split, functional, where) -> split``: the parameters ``init`` holds, rewritten.
        updates_late: ``device_type -> bool``: the optimizer wrapper may still be writing after the
            step returns, for parameters on that device type (None: never).
        runs: ``(step, state, sink, scale) -> runner`` that runs forward and backward in the step's place
            (None: the step calls ``loss_fn`` and runs backward itself).
        prepare_first: its ``prepare`` runs before the other extensions'.
        reports: its forward reports checks made on the device (:func:`zerofn.step.report`): every
            update's statistics then carry whether one failed, so that every rank skips alike.
    """

    name: str
    options: Any = None
    wrap_optimizer: Callable | None = None
    around: Callable | None = None
    feed: Callable | None = None
    check: Callable | None = None
    prepare: Callable | None = None
    updates_late: Callable[[str], bool] | None = None
    prepare_first: bool = False
    reports: bool = False
    runs: Callable | None = None
