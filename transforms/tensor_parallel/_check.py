"""The batch check, and what a step enters around forward and backward (:class:`Around`).

The ranks of a tensor-parallel group feed the same micro-batch. Before the model's call they compare
what they feed (structure and shapes, a weighted sum and a sum of squares of the values: three float64
in one small all-reduce on the group), on the device; nothing reads the answer on the host: a
difference skips the update (``zerofn.step.report``) and the next wait raises. Around the same call:
torch's ``loss_parallel`` with a vocabulary-parallel head, sequence parallelism's hooks, and the step's
shared input copies (``_autograd.COPIES``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from zerofn.transforms.tensor_parallel._autograd import COPIES
from zerofn.transforms.tensor_parallel._layers import VocabHead

from zerofn import collectives as C
from zerofn import tree as T
from zerofn.mesh import Mesh
from zerofn.step import report


class Around:
    """Around forward and backward: before the model's call, the ranks of a tensor-parallel group compare
    what they feed it (structure, shapes and a checksum of the values; one small all-reduce); with a head
    split over the vocabulary, torch's ``loss_parallel`` (its cross-entropy on the split logits); with
    sequence parallelism, its hooks (the first block's slice, the regions' gathers). All only while the
    step runs."""

    def __init__(self, m: Mesh, model: Callable):
        self.m, self.model, self.hooks, self.loss = m, model, [], None

    def __enter__(self):
        self.copies = COPIES.set({})
        if self.m.size("tp") > 1:
            module = self.model().module
            self.hooks.append(module.register_forward_pre_hook(self._check, with_kwargs=True))
            for sub, fn in module.__dict__.get("_zf_sequence_hooks", ()):  # sequence parallelism's, for the step
                if getattr(fn, "zf_after", False):
                    self.hooks.append(sub.register_forward_hook(fn))
                else:
                    self.hooks.append(sub.register_forward_pre_hook(fn, with_kwargs=True))
            if any(isinstance(x, VocabHead) for x in module.modules()):
                from torch.distributed.tensor.parallel import loss_parallel

                self.loss = loss_parallel()
                self.loss.__enter__()
        return self

    def __exit__(self, *exc):
        if self.loss is not None:
            self.loss.__exit__(*exc)
        for h in self.hooks:
            h.remove()
        self.hooks = []
        COPIES.reset(self.copies)
        return False

    def _check(self, module, args, kwargs):
        if not torch.is_grad_enabled() and not module.training:
            return None
        tree = (args, kwargs)
        leaves = [t.detach().double() for t in T.tree_leaves(tree) if isinstance(t, torch.Tensor)]
        dev = leaves[0].device if leaves else torch.device("cpu")
        digest = torch.full((), float(T.treespec_digest(tree) & ((1 << 52) - 1)), dtype=torch.float64, device=dev)
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        # Three numbers whatever the batch (so that the all-reduce's size never differs between the ranks):
        # the structure and shapes, and a weighted sum and sum of squares of the values; made and compared
        # on the device, read by no one (the step skips the update and raises at the next wait).
        total = sum((t.sum() * (i + 1) for i, t in enumerate(leaves)), zero)
        squares = sum((t.square().sum() for t in leaves), zero)
        key = torch.stack([digest, total, squares])
        both = torch.cat([key, -key])
        C.all_reduce(both, "max", group=self.m.group("tp"))
        differ = (both[:3] != -both[3:]).any()  # the max is the min everywhere when they agree
        report(
            differ,
            "tensor_parallel: the ranks of a tensor-parallel group fed different batches (their structure, shapes "
            "or values differ); that update was skipped and the state kept as it was. Every rank of a group feeds "
            "the micro-batch of its data-parallel rank: batch[zf.collectives.data_rank(step)] (the global rank // "
            "size).",
        )
        return None
