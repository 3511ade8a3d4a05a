"""The activation model: bytes alive at a training step's peak on one GPU (:func:`activation_bytes`)."""

from __future__ import annotations

__all__ = ["activation_bytes"]


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
    sb = s * b
    t = int(tp)
    # whole: the first norm's output, the residual after attention, the second norm's output, the block's
    # output; split over tensor-parallel GPUs: q, k, v, the attention output and the MLP's activations
    elems = 4 * h + (2 * h + 2 * h_kv + (4 if gated else 2) * f) / t + (7 if gated else 6) * int(lora_rank)
    stats = 16 + 4 * a_heads / t
    per_layer = sb * (act * elems + 2 * norm32 * h + stats + (0 if flash else act * a_heads * s / t))
    x = sb * act * h  # one residual-stream tensor
    if inference:
        return int(x + per_layer + sb * act * int(vocab))
    head = x + sb * (norm32 * h + 8 + 12 * int(vocab))
    if not remat:
        return int(x + L * per_layer + head)
    start = (L + 1) * x + head
    first_block = L * x + per_layer + sb * act * f / t
    return int(max(start, first_block))
