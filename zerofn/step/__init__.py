"""``zf.train_step`` and the Step protocol that transforms rewrite.

A Step is a pure function from the outside, ``step(state, batch) -> (state,
metrics)``, with ``step.init(params) -> state``. It is made of three parts,
each owning one concern and its piece of the step's name, and one chain:

- ``reduction`` (:class:`zerofn.reduction.Reduction`): how gradients are
  reduced across ranks, and the ZeRO ``stage`` that transforms compare;
- ``storage`` (:class:`zerofn.storage.Storage`): how parameters are held,
  bound for a forward, updated and gathered;
- ``precision`` (:class:`zerofn.precision.Precision`): dtypes, autocast,
  the optimizer's master weights and the loss scale;
- ``extensions`` (:class:`zerofn.extension.Extension`): what further
  transforms add (optimizer wrappers, contexts around forward and backward,
  checks), in the order they were applied;
- ``mesh`` and ``claims``: the ranks as a named mesh
  (:class:`zerofn.mesh.Mesh`) once a parallelism lays them out, and the
  axis each such transform works on with the parameters it cuts there
  (:class:`zerofn.sharding.Claim`, recorded as placements in the state's
  spec).

A transform ``Step -> Step`` replaces a part or extends the chain; the core
names no transform. One call runs six phases (the sink; forward and
backward; carry; unscale; update; publish), described once in the design
page of the docs ("The phases of a step"); the comments in
``zerofn.step._call`` number them alike.

Example:
    >>> import torch, zerofn as zf
    >>> model = torch.nn.Linear(4, 1)
    >>> apply = zf.functional(model)
    >>> def loss_fn(params, batch):
    ...     return ((apply(params, batch["x"]) - batch["y"]) ** 2).mean()
    >>> step = zf.train_step(loss_fn, zf.optim.sgd(0.1))
    >>> state = step.init(apply.params)
    >>> batch = {"x": torch.ones(8, 4), "y": torch.zeros(8, 1)}
    >>> state, metrics = step(state, batch)
    >>> sorted(metrics)
    ['comm_bytes', 'comm_bytes_by_axis', 'grad_norm', 'loss', 'skipped']

The package, one job per module:

- ``_step``: the :class:`Step` value (its parts, its name, ``replace``,
  ``extend``, ``extension``), its views of a state (``full_params``,
  ``state_dict``, ``apply``), :func:`train_step`, :func:`transform` and
  :func:`reapply`;
- ``_init``: ``step.init``, the state a run starts from;
- ``_call``: one call, as its phases (accumulate, skip, update) with one
  exit that builds the next state;
- ``_stats``: the statistics every call sums over the ranks, one vector
  and the record that names its slots;
- ``_grads``: averaging the gradients and the model's buffers over the ranks;
- ``_checks``: the checks (the ranks' parameters and batches, what
  ``loss_fn`` returns, the update's verdict, :func:`report`) and their messages;
- ``_derived``: what a run derives once from its step and keeps in its
  states (the bound optimizer, the model);
- the optimizer's view of the buckets is :mod:`zerofn.optim.bucket_view`.
"""

from __future__ import annotations

from zerofn.optim.bucket_view import param_view
from zerofn.step._checks import report
from zerofn.step._step import DEFAULT_BUCKET_BYTES, Step, StepTransform, reapply, train_step, transform

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Step",
    "StepTransform",
    "param_view",
    "reapply",
    "report",
    "train_step",
    "transform",
]
