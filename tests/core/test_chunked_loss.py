"""``zf.losses.chunked_cross_entropy``: the output head's cross entropy over chunks of tokens.

Its values and gradients (hidden, weight, bias) equal ``F.cross_entropy`` over the whole float32 logits, in
fp32 to rounding and from bf16 inputs to bf16's rounding, for every reduction, with ignored labels, chunks that
do not divide the tokens and 3-D hidden states; its peak memory holds one chunk's logits, not the whole
``[tokens, V]``; and inside a step, reading a Hugging Face model's ``lm_head.weight``, it trains as the loss over
the full logits does.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import max_abs_diff, tiny_llama

import zerofn as zf
from zerofn.losses import chunked_cross_entropy

IGNORE = -100


def _inputs(shape, hidden_size, vocab, dtype, *, bias=True, seed=0, ignored=0.25):
    """hidden ``[*shape, H]``, the head's weight ``[V, H]`` and bias ``[V]`` (leaves requiring grad), and
    labels of ``shape`` with about ``ignored`` of them ``IGNORE``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=g) / hidden_size**0.5).to(dtype).requires_grad_()
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype).requires_grad_() if bias else None
    labels = torch.randint(vocab, shape, generator=g)
    labels[torch.rand(shape, generator=g) < ignored] = IGNORE
    return hidden, weight, b, labels


def _reference(hidden, weight, bias, labels, reduction, upcast=False):
    """The loss over the whole logits as a model computes it, and its gradients; ``upcast``: from the inputs'
    values in float32 (the reference for bf16 inputs)."""
    leaves = [t.detach().float() if upcast else t.detach() for t in (hidden, weight, bias) if t is not None]
    leaves = [t.requires_grad_() for t in leaves]
    h, w, b = leaves if bias is not None else (*leaves, None)
    logits = h @ w.T + (b if b is not None else 0)
    loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE, reduction=reduction)
    loss = loss.reshape(labels.shape) if reduction == "none" else loss
    return loss, leaves


def _backward(loss, seed=1):
    """Backward through ``loss`` with a fixed random incoming gradient (so that "none" is checked per token)."""
    go = torch.randn(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=loss.dtype)
    (loss * go).sum().backward()


def _close(got, want, tol):
    """|got - want| within ``tol`` times the larger of 1 and want's magnitude."""
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), (err, want.abs().max().item())


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "shape, chunk",
    [((37,), 5), ((37,), None), ((3, 13), 7), ((2, 16), 32)],
    ids=["2d-chunk5", "2d-default", "3d-chunk7", "3d-one-chunk"],
)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_equals_cross_entropy_over_full_logits_fp32(reduction, shape, chunk, bias):
    hidden, weight, b, labels = _inputs(shape, 24, 53, torch.float32, bias=bias)
    loss = chunked_cross_entropy(hidden, weight, labels, bias=b, reduction=reduction, chunk_size=chunk)
    _backward(loss)
    want, leaves = _reference(hidden, weight, b, labels, reduction)
    _backward(want)
    assert loss.dtype == torch.float32 and loss.shape == want.shape
    _close(loss.detach(), want.detach(), 1e-6)
    for got, ref in zip([t for t in (hidden, weight, b) if t is not None], leaves):
        assert got.grad.dtype == got.dtype
        _close(got.grad, ref.grad, 1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_bf16_inputs_match_the_float32_reference_to_bf16_rounding(reduction):
    hidden, weight, b, labels = _inputs((4, 33), 32, 97, torch.bfloat16)
    loss = chunked_cross_entropy(hidden, weight, labels, bias=b, reduction=reduction, chunk_size=10)
    _backward(loss)
    want, leaves = _reference(hidden, weight, b, labels, reduction, upcast=True)
    _backward(want)
    assert loss.dtype == torch.float32  # the loss in float32, as over logits.float()
    _close(loss.detach(), want.detach(), 2e-2)
    for got, ref in zip((hidden, weight, b), leaves):
        assert got.grad.dtype == torch.bfloat16
        _close(got.grad, ref.grad, 2e-2)


def test_causal_lm_alignment_hidden_shifted_against_labels_shifted():
    """The causal LM's use: hidden[:, :-1] (a non-contiguous view) against labels[:, 1:]."""
    hidden, weight, _, labels = _inputs((3, 11), 16, 29, torch.float32, bias=False)
    loss = chunked_cross_entropy(hidden[:, :-1], weight, labels[:, 1:], chunk_size=4)
    loss.backward()
    want, (h, w) = _reference(hidden, weight, None, labels, "none")
    want = want[:, :-1]  # the full-sequence reference, compared where the shifted one predicts
    ref_logits = (h @ w.T)[:, :-1].flatten(0, 1)
    ref = F.cross_entropy(ref_logits, labels[:, 1:].flatten(), ignore_index=IGNORE)
    ref.backward()
    _close(loss.detach(), ref.detach(), 1e-6)
    _close(hidden.grad, h.grad, 1e-6)
    assert hidden.grad[:, -1].abs().max() == 0  # the last position predicts nothing
    _close(weight.grad, w.grad, 1e-6)


def test_mean_with_no_label_is_nan_with_zero_gradients_as_cross_entropy():
    hidden, weight, b, labels = _inputs((9,), 8, 13, torch.float32, ignored=1.1)
    loss = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_size=4)
    loss.backward()
    want, leaves = _reference(hidden, weight, b, labels, "mean")
    want.backward()
    assert torch.isnan(loss) and torch.isnan(want)
    for got, ref in zip((hidden, weight, b), leaves):
        assert torch.equal(got.grad, torch.zeros_like(got.grad)) and torch.equal(ref.grad, got.grad)
    total = chunked_cross_entropy(hidden, weight, labels, bias=b, reduction="sum")
    assert total.item() == 0.0


def test_only_what_requires_grad_gets_one_and_no_grad_runs_without_a_graph():
    hidden, weight, _, labels = _inputs((21,), 8, 13, torch.float32, bias=False)
    frozen = hidden.detach()
    loss = chunked_cross_entropy(frozen, weight, labels, chunk_size=4)
    loss.backward()
    want, (_, w) = _reference(frozen, weight, None, labels, "mean")
    want.backward()
    _close(weight.grad, w.grad, 1e-6)
    with torch.no_grad():
        out = chunked_cross_entropy(hidden, weight, labels, chunk_size=4)
    assert out.grad_fn is None and not out.requires_grad
    _close(out, want.detach(), 1e-6)


def test_under_autocast_the_matmul_runs_in_the_autocast_dtype():
    hidden, weight, b, labels = _inputs((2, 15), 16, 41, torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_size=8)
        logits = F.linear(hidden.detach(), weight.detach(), b.detach())
    assert logits.dtype == torch.bfloat16
    want = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
    loss.backward()
    assert loss.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.float32
    _close(loss.detach(), want, 1e-6)  # the same bf16 logits, the same float32 loss


def test_hidden_of_another_dtype_runs_in_the_weights_dtype():
    """A float32 hidden state (a model's output under amp's compute="param") against a bf16 head: the matmul
    in bf16, as the head's module would run it, and the hidden state's gradient in float32."""
    hidden, _, _, labels = _inputs((2, 15), 16, 41, torch.float32)
    _, weight, _, _ = _inputs((2, 15), 16, 41, torch.bfloat16)
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=8)
    loss.backward()
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    want = F.cross_entropy(F.linear(h.bfloat16(), w).flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)
    want.backward()
    _close(loss.detach(), want.detach(), 1e-6)
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
    _close(hidden.grad, h.grad, 1e-2)
    _close(weight.grad, w.grad, 1e-2)


def test_sum_under_zf_mean_is_the_mean():
    hidden, weight, b, labels = _inputs((2, 19), 12, 31, torch.float32)
    mean = zf.Mean(chunked_cross_entropy(hidden, weight, labels, bias=b, reduction="sum"), (labels != IGNORE).sum())
    ref = chunked_cross_entropy(hidden, weight, labels, bias=b)
    _close(mean.total.detach() / mean.counted(), ref.detach(), 1e-6)
    assert zf.losses.chunked_cross_entropy is chunked_cross_entropy


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(labels=torch.zeros(4, 6, dtype=torch.long)), r"labels of shape \[4, 6\] do not match hidden's"),
        (dict(weight=torch.randn(13, 7)), r"weight must be the output head's \[V, H\]"),
        (dict(weight=torch.randn(8, 13)), r"with H = hidden's last dim \(8\), got shape \[8, 13\]"),
        (dict(bias=torch.randn(12)), r"bias must be the head's \[V\] = \[13\] bias"),
        (dict(labels=torch.zeros(4, 5)), r"labels must be integer class indices \(torch.long\), got dtype"),
        (dict(labels=torch.zeros(4, 5, dtype=torch.bool)), r"labels must be integer class indices"),
        (dict(reduction="avg"), r"reduction must be one of \('mean', 'sum', 'none'\), got 'avg'"),
        (dict(chunk_size=0), r"chunk_size must be a positive int"),
    ],
)
def test_errors_say_what_was_wrong(change, match):
    args = dict(hidden=torch.randn(4, 5, 8), weight=torch.randn(13, 8), labels=torch.zeros(4, 5, dtype=torch.long))
    args.update(change)
    kwargs = {k: args.pop(k) for k in ("bias", "reduction", "chunk_size") if k in args}
    with pytest.raises(ValueError, match=match):
        chunked_cross_entropy(args["hidden"], args["weight"], args["labels"], **kwargs)


def test_peak_memory_is_one_chunk_of_logits_not_the_whole():
    """2048 tokens over a vocabulary of 4096: the whole float32 logits take 32 MiB, a chunk of 256 tokens 4 MiB.
    The peak of forward and backward (above what was live before) stays within one chunk's logits plus the
    inputs' and the gradients' sizes (the forward's gradient of hidden and float32 sums of the weight's and
    bias' are those gradients), while the loss over the whole logits peaks above them."""
    tokens, vocab, hidden_size, chunk = 2048, 4096, 64, 256
    hidden, weight, b, labels = _inputs((tokens,), hidden_size, vocab, torch.float32)
    nbytes = sum(t.untyped_storage().nbytes() for t in (hidden, weight, b))
    inputs = nbytes + labels.untyped_storage().nbytes()
    grads = nbytes
    chunk_logits = chunk * vocab * 4
    full_logits = tokens * vocab * 4
    with zf.memory.track() as t:
        chunked_cross_entropy(hidden, weight, labels, bias=b, chunk_size=chunk).backward()
    assert t.peak <= chunk_logits + inputs + grads, (t.peak, chunk_logits + inputs + grads)
    assert t.peak < full_logits / 3, (t.peak, full_logits)
    for p in (hidden, weight, b):
        p.grad = None
    with zf.memory.track() as full:
        _reference(hidden, weight, b, labels, "mean")[0].backward()
    assert full.peak >= full_logits  # what the chunks avoid


def test_inside_a_step_trains_as_the_loss_over_the_full_logits():
    """A Hugging Face Llama in float64, three AdamW updates: the loss reads the hidden states and
    ``params["lm_head.weight"]``; the parameters equal those trained on the full logits' cross entropy."""
    seq, batch = 12, 4

    def data(i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(64, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, :3] = IGNORE  # a prompt the loss does not learn
        return {"input_ids": ids, "labels": labels}

    def chunked(apply):
        def loss_fn(params, b):
            out = apply(params, input_ids=b["input_ids"], output_hidden_states=True, logits_to_keep=1)
            labels = b["labels"][:, 1:]
            total = chunked_cross_entropy(
                out.hidden_states[-1][:, :-1], params["lm_head.weight"], labels, reduction="sum", chunk_size=5
            )
            return zf.Mean(total, (labels != IGNORE).sum())

        return loss_fn

    def full(apply):
        def loss_fn(params, b):
            logits = apply(params, input_ids=b["input_ids"]).logits
            labels = b["labels"][:, 1:]
            # float64 logits as they are (.float() would round them to float32; the chunks keep float64)
            total = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum"
            )
            return zf.Mean(total, (labels != IGNORE).sum())

        return loss_fn

    trained = []
    for make in (chunked, full):
        apply = zf.functional(tiny_llama(seed=0).double())
        step = zf.train_step(make(apply), zf.optim.adamw(1e-2, weight_decay=0.1))
        state = step.init(apply.params)
        for i in range(3):
            state, metrics = step(state, data(i))
        trained.append(step.full_params(state))
    assert max_abs_diff(*trained) < 1e-10


def test_under_shard_params_a_head_read_outside_its_unit_trains_the_head():
    """shard_params hands loss_fn placeholders of its parameters; chunked_cross_entropy on the head's (read
    outside the model, so gathered for the read) must give it its gradient, as F.cross_entropy over its logits
    does: the same losses step after step (without its gradient the head never trained, and the losses drifted
    from the second step)."""
    from zerofn.transforms import shard_params

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def run(chunked: bool) -> list[float]:
        apply = zf.functional(tiny_llama())

        def loss_fn(params, batch):
            out = apply(params, input_ids=batch, output_hidden_states=True, logits_to_keep=1)
            h, y, w = out.hidden_states[-1][:, :-1], batch[:, 1:], params["lm_head.weight"]
            if chunked:
                return zf.losses.chunked_cross_entropy(h, w, y)
            return F.cross_entropy((h @ w.T).flatten(0, 1), y.flatten())

        step = shard_params(zf.train_step(loss_fn, zf.optim.sgd(0.1)))
        state, losses = step.init(apply.params), []
        for _ in range(3):
            state, m = step(state, ids)
            losses.append(float(m["loss"]))
        return losses

    want, got = run(False), run(True)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)
