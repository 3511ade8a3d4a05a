"""The activation model: bytes alive at a training step's peak on one GPU (:func:`activation_bytes`)."""

from __future__ import annotations

__all__ = ["LOSS_CHUNK_BYTES", "activation_bytes", "weight_grad_bytes"]

# The logits one chunk of zf.losses.chunked_cross_entropy holds in float32 (zerofn.losses.CHUNK_BYTES)
LOSS_CHUNK_BYTES = 64 * 2**20


def activation_bytes(
    *,
    layers: int,
    hidden: int,
    seq: int,
    micro_batch: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    vocab: int = 0,
    gated: bool = False,
    mixed_precision: bool = True,
    remat: bool = False,
    inference: bool = False,
    flash: bool = True,
    device: str = "cuda",
    lora_rank: int = 0,
    tp: int = 1,
    cp: int | None = None,
    cp_method: str = "ulysses",
    chunked_loss: bool = False,
    remat_offload: bool = False,
    in_flight: int = 1,
    chunks: int = 1,
    waiting: int = 0,
) -> int:
    """Activation bytes alive at a training step's peak on one GPU, for a GPT-like model.

    Per token (s b of them, seq x micro-batch), with a = 2 bytes under mixed
    precision (4 in fp32), h = hidden, h_kv = kv_heads x head size, f = ffn:

    - each block saves a x (6 h + 2 h_kv + 2 f) (gated MLP: 4 f): the first
      norm's output, q, k, v, the attention output, the residual after
      attention, the second norm's output, the MLP's two activations and the
      block's output, which is the next block's input: 16 h for GPT (f = 4 h),
      Korthikanti et al.'s 34 s b h bytes in 16-bit without the dropout masks
      (2 s b h) and, with flash/SDPA attention, without the 5 a s^2 b attention
      matrices; plus 16 + 4 x heads bytes of fp32 statistics (norms' mean and
      rstd, attention's log-sum-exp). ``flash=False`` adds the softmax output,
      a x heads x s. On CUDA, autocast runs layer norms in fp32: each of the
      two norms saves an fp32 copy of its input (4 h more); on the CPU they
      run in bf16 (what the tests measure).
    - the embedding's output (a h), the final norm's output (a h), and at the
      start of backward the fp32 log-probabilities, their gradient and the
      logits' gradient: 12 x vocab.
    - ``remat``: every block keeps only its input (a h per block); the peak is
      the larger of the start of backward (the inputs, the head's terms) and
      the first block's backward: the inputs of the blocks not yet done, one
      block's recomputed activations and the gradients of its output and MLP
      activation (a (h + f)).
    - ``inference``: nothing is saved; one block's intermediates and the
      logits at a time.
    - ``lora_rank`` r: LoRA adapters on each projection of a block (7 in a
      gated block, 6 otherwise) save their r-wide middle (A's output, B's
      input): a x r more per projection. Their input is the projection's,
      saved already; a frozen projection saves nothing for a weight gradient.
    - ``tp``: tensor parallelism over ``tp`` GPUs (Megatron's accounting
      without sequence parallelism, Korthikanti et al.'s
      ``s b h (10 + 24 / t)``): what attention and the MLP compute between
      the column-wise and the row-wise layers is split, ``a (2 h + 2 h_kv +
      4 f) / tp`` (q, k, v, the attention output, the MLP's activations) and
      attention's statistics and softmax by heads / tp; the residual stream,
      the norms' inputs and outputs (4 a h), the embedding's output and the
      block inputs remat keeps are whole on every GPU (a head split over the
      vocabulary: pass ``vocab / tp``, the logits one GPU holds).
    - ``cp``: ``context_parallel(step, cp, method=cp_method)`` (None: not
      applied; 1: applied to groups of one). ``seq`` is the whole sequence;
      each GPU computes ``T = s b / cp`` of its tokens, and every per-token
      term above counts T tokens. The attention output is saved twice, by
      the attention function (for its backward) and as the o projection's
      input (a contiguous copy of it): ``a h / tp`` more a block. Ulysses
      repeats grouped key/value heads to the query heads before its
      attention, which saves them at that width: k and v count ``2 h``, not
      ``2 h_kv``; its attention holds the whole sequence for ``heads / cp``
      heads, the same bytes as all heads for the local tokens (no s^2
      matrix with flash/SDPA). Ring saves k and v as they are, and
      recomputes its scores in backward (never saved). A block's backward
      then has a working set beside what is saved (:data:`WORKING`), which
      enters the peak at the block being differentiated.
    - ``chunked_loss``: the loss by ``zf.losses.chunked_cross_entropy``
      (``context_parallel``'s own for Llama, Mistral and Qwen models): in
      place of the ``12 V`` per token of whole logits, one chunk's logits
      (``c = min(T, 64 MiB / (4 V))`` tokens: ``c V (4 + a)`` bytes in
      mixed precision, the bf16 logits beside their fp32 copy; ``4 c V``
      in fp32), the gradient of the hidden states it computes in forward
      (``a h`` per token, and its scaled copy in backward), and the float32
      sum of the head's weight gradient (``4 V h``; in mixed precision its
      float32 scaled copy in backward too, the head's bf16 gradient being
      counted with the gradients). Then a block's backward working set is
      compared with the head's terms: the peak is the larger.
    - ``remat_offload``: ``remat(..., offload="cpu")``: the L kept block
      inputs wait in host memory (the estimate counts them there), the
      device holding only the one input being recomputed. On the CPU
      (``device="cpu"``) host memory is the device's: nothing moves.
    - ``in_flight``, ``chunks``, ``waiting``: a pipeline stage
      (:mod:`zerofn.plan.pipeline`) holding ``layers`` blocks in
      ``chunks`` model chunks keeps the saved activations (remat: the kept
      inputs) of ``in_flight`` micro-batches of one chunk each, every one
      with its input (``x``, the hidden states it received), and the
      weight-gradient inputs (:func:`weight_grad_bytes`) of ``waiting``
      more (zero bubble); the head's terms (a last stage's logits, pass
      ``vocab``) and a block's backward are one micro-batch's. The
      defaults (1, 1, 0) are one micro-batch of every block.

    Returns:
        Bytes (an int).

    Example:
        >>> from zerofn.plan import activation_bytes
        >>> gpt = dict(layers=4, hidden=256, seq=128, micro_batch=8, heads=4, vocab=512, mixed_precision=False)
        >>> round(activation_bytes(**gpt) / 2**20, 1), round(activation_bytes(**gpt, remat=True) / 2**20, 1)
        (72.1, 24.0)
    """
    h, s, b, L = int(hidden), int(seq), int(micro_batch), int(layers)
    a_heads = int(heads or max(1, h // 64))
    h_kv = h * int(kv_heads or a_heads) // a_heads
    f = int(ffn or 4 * h)
    act = 2 if mixed_precision else 4
    norm32 = 4 if (mixed_precision and device != "cpu") else 0  # CUDA autocast: layer norms in fp32
    t = int(tp)
    sb = s * b if cp is None else s * b // int(cp)  # the tokens this GPU computes
    ulysses, ring = cp is not None and cp_method == "ulysses", cp is not None and cp_method == "ring"
    # saved k and v: Ulysses repeats grouped key/value heads to the query heads before its attention
    kv_saved = h if ulysses else h_kv
    out_twice = h if cp is not None else 0  # the attention function's output, and the o projection's input
    # whole: the first norm's output, the residual after attention, the second norm's output, the block's
    # output; split over tensor-parallel GPUs: q, k, v, the attention output and the MLP's activations
    elems = (
        4 * h + (2 * h + out_twice + 2 * kv_saved + (4 if gated else 2) * f) / t + (7 if gated else 6) * int(lora_rank)
    )
    stats = 16 + 4 * a_heads / t
    softmax = 0 if (flash or ring) else act * a_heads * s / t  # ring recomputes its scores in backward
    per_layer = sb * (act * elems + 2 * norm32 * h + stats + softmax)
    x = sb * act * h  # one residual-stream tensor
    v = int(vocab)
    if inference:
        return int(x + per_layer + sb * act * v)
    work = sb * act * f / t  # a block's backward: the gradients of its output and of its MLP activation
    if cp is not None:
        work = max(work, _attention_work(cp_method, sb, b, s // int(cp), h, h_kv, a_heads, t, act, device))
    if chunked_loss:
        c = min(sb, max(1, LOSS_CHUNK_BYTES // (4 * max(v, 1))))
        grad_hidden = sb * act * h
        logits = c * v * (4 + (act if act < 4 else 0))
        backward = grad_hidden + (4 * v * h if act < 4 else 0)  # the scaled copies of the gradients it kept
        loss = grad_hidden + 4 * v * h + max(logits, backward)
        head = x + sb * (norm32 * h + 8) + loss
    else:
        head = x + sb * (norm32 * h + 8 + 12 * v)
    if chunked_loss or cp is not None:
        head = max(head, work)  # the head's terms are gone by the time a block's backward runs
    # a pipeline stage: in_flight micro-batches of one of its chunks (layers / chunks blocks each) held at once
    held = L * int(in_flight) if chunks == 1 else L * int(in_flight) / int(chunks)
    waits = 0.0
    if waiting:  # zero bubble: micro-batches whose weight gradients wait, holding the W pass's inputs
        w = weight_grad_bytes(
            hidden=h,
            seq=s,
            micro_batch=b,
            heads=a_heads,
            kv_heads=kv_heads,
            ffn=f,
            gated=gated,
            mixed_precision=mixed_precision,
            tp=t,
            cp=cp,
        )
        waits = int(waiting) * L / int(chunks) * w
    if not remat:
        total = x * int(in_flight) + held * per_layer + head
        return int(total + waits if waiting else total)
    kept = 1 if (remat_offload and device != "cpu") else held  # the inputs on the device
    start = (kept + 1) * x + head
    first_block = kept * x + per_layer + work
    return int(max(start, first_block) + waits if waiting else max(start, first_block))


def weight_grad_bytes(
    *,
    hidden: int,
    seq: int,
    micro_batch: int,
    heads: int | None = None,
    kv_heads: int | None = None,
    ffn: int | None = None,
    gated: bool = False,
    mixed_precision: bool = True,
    tp: int = 1,
    cp: int | None = None,
) -> int:
    """Bytes one block keeps for one micro-batch whose input gradient has run and whose weight gradient (zero
    bubble's W pass) waits: each Linear's input and the gradient of its output, which ``dW = dY^T X`` reads.

    Per token, ``a`` bytes each: the inputs, the two norms' outputs (``2 h``, whole under tensor parallelism),
    the attention output and the MLP's activation (``(h + f) / tp``); the output gradients of q, k and v, gate
    and up (``(h + 2 h_kv + 2 f) / tp``, ``f`` for GPT's up alone) and of o and down (``2 h``, whole):
    ``a (4 h + (2 h + 2 h_kv + f + f_up) / tp)``, about one block's saved activations. ``seq / cp`` tokens a
    sequence under context parallelism.

    Example:
        >>> from zerofn.plan.activations import weight_grad_bytes
        >>> weight_grad_bytes(hidden=4096, seq=4096, micro_batch=1, ffn=11008, gated=True) / 2**20  # MiB
        514.0
    """
    h, b = int(hidden), int(micro_batch)
    a_heads = int(heads or max(1, h // 64))
    h_kv = h * int(kv_heads or a_heads) // a_heads
    f = int(ffn or 4 * h)
    t = int(tp)
    tokens = int(seq) * b // (int(cp) if cp else 1)
    act = 2 if mixed_precision else 4
    return int(tokens * act * (4 * h + (2 * h + 2 * h_kv + f + (2 * f if gated else f)) / t))


# What a block's backward holds beside the saved tensors, per token, in units of ``a h / tp`` (Ulysses: the
# gradient of the attention output, dq, dk and dv at the query heads' width, and one all-to-all's send copy
# and receive buffer); ring's is counted by :func:`_attention_work`.
WORKING = 6


# The most bytes of one float32 score (or probability) tile of context_parallel's ring attention: it computes
# each pair of key/value and query runs in tiles of at most this, two alive in backward (P and dP)
RING_TILE_BYTES = 32 * 2**20


def _attention_work(
    method: str, tokens: int, b: int, local: int, h: int, h_kv: int, heads: int, t: int, act: int, device: str
) -> float:
    """Bytes attention's backward holds beside the saved tensors on one GPU, for ``tokens`` local tokens
    (``local`` a sequence's, ``b`` sequences).

    Ulysses: :data:`WORKING` activation-sized tensors of the layer (``a h / tp`` per token). Ring: its float32
    blocks (the queries and the gradient of the output laid out as rows, the output's rows, dq: ``4 x 4 h``;
    the dk/dv part, the accumulator and the one in flight: ``3 x 8 h_kv``; k and v stacked and the pair in
    flight in their dtype, and as float32: ``(4 a + 8) h_kv``), and two score tiles of at most
    :data:`RING_TILE_BYTES` each (``P`` and ``dP``): bounded whatever the sequence, no ``local x local``
    matrix. On the CPU (``device="cpu"``) ring runs torch's fused kernel, which returns each block's output
    and gradients: the float32 output and dq accumulators (``8 h``), the dk/dv accumulator and the one in
    flight (``16 h_kv``), k and v with the pair in flight and a block's dk/dv (``(8 + 4 a) h_kv``), and no
    score tile."""
    if method == "ring":
        if device == "cpu":
            return tokens * (8 * h + 16 * h_kv + (8 + 4 * act) * h_kv) / t
        blocks = tokens * (16 * h + 24 * h_kv + (4 * act + 8) * h_kv) / t
        scores = 2 * min(RING_TILE_BYTES, 4 * (heads / t) * b * local * local)
        return blocks + scores
    return tokens * WORKING * act * h / t
