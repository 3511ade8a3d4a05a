"""The gradient sink fills a bucket that was never zeroed: each slot holds exactly the gradient autograd
computed, and what no gradient wrote (the padding, a parameter without a gradient) is zero, whatever the
allocator left there; sums carried to the next micro-step are added to, not overwritten."""

from __future__ import annotations

import torch

from zerofn.reduction import GradSink, Reduction
from zerofn.state import Layout

SHAPES = {"w": (3, 5), "b": (7,), "unused": (4,)}  # 26 elements, padded to 28 for 4 shards


def _loss(t: dict, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ t["w"].T + t["w"].sum() * 0.5).sum() + (t["b"] * t["b"]).sum()  # w used twice


def _poison_empty(monkeypatch) -> None:
    """Every torch.empty comes back full of NaN, as reused memory may."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned)


def _micro_step(layout: Layout, values: dict, x: torch.Tensor, carried=None) -> tuple:
    sink = GradSink(layout, Reduction(), lambda d: d, rank=0, reduce=False, carried=carried)
    leaves, hooks = {}, []
    for name, v in values.items():
        leaves[name], h = sink.leaf(name, v.clone())
        hooks += h
    _loss(leaves, x).backward()
    for h in hooks:
        h.remove()
    return sink.full_buffers()


def test_a_bucket_holds_autograds_gradients_and_zeros_elsewhere(monkeypatch):
    torch.manual_seed(0)
    values = {k: torch.randn(s) for k, s in SHAPES.items()}
    x = torch.randn(2, 5)
    ref = {k: v.clone().requires_grad_(True) for k, v in values.items()}
    grads = dict(zip(("w", "b"), torch.autograd.grad(_loss(ref, x), [ref["w"], ref["b"]])))
    layout = Layout.build(values, shards=4, bucket_bytes=1 << 20)
    (bucket,) = layout.buckets
    assert bucket.padded > bucket.numel  # there is padding to zero

    _poison_empty(monkeypatch)
    (buf,) = _micro_step(layout, values, x)
    views = layout.bucket_views(0, buf)
    assert torch.equal(views["w"], grads["w"]) and torch.equal(views["b"], grads["b"])
    assert torch.equal(views["unused"], torch.zeros(4))
    assert torch.equal(buf[bucket.numel :], torch.zeros(bucket.padded - bucket.numel))

    # the next micro-step adds its gradients to the carried sums
    (total,) = _micro_step(layout, values, x, carried=(buf,))
    views = layout.bucket_views(0, total)
    assert torch.equal(views["w"], grads["w"] + grads["w"]) and torch.equal(views["b"], grads["b"] + grads["b"])
    assert not torch.isnan(total).any() and torch.equal(views["unused"], torch.zeros(4))
