"""quantize: a step makes no tensor from Python numbers on the device its layers compute on. On a GPU each such
tensor is a copy the host waits for; measured on an H200 before the NF4 code book was kept, every
dequantization made one (25 host waits per step of a 2-layer LoRA Llama). Counted here on the CPU by a
TorchFunctionMode over the factories that copy Python data (``torch.tensor``, ``torch.as_tensor``) with a
``device`` given (empty ones, as transformers' key/value cache starts from, copy nothing)."""

from __future__ import annotations

import pytest
import torch
from test_quantize import _batch, _lora_llama, _loss_fn
from torch.overrides import TorchFunctionMode
from zerofn.transforms import amp, quantize, shard_params

import zerofn as zf

pytest.importorskip("peft")


class _Copies(TorchFunctionMode):
    """Counts ``torch.tensor``/``torch.as_tensor`` of Python data (not of a tensor) onto a named device."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None and out.numel():
            if not isinstance(args[0] if args else None, torch.Tensor):  # (an empty one copies nothing)
                self.calls.append(f"{func.__name__}(..., device={kwargs['device']})")
        return out


@pytest.mark.parametrize("kind", ["nf4", "int8"])
@pytest.mark.parametrize("name", ["plain", "shard_params+amp"])
def test_steps_make_no_tensor_from_python_numbers_on_the_device(name, kind):
    apply = zf.functional(_lora_llama())
    step = zf.train_step(_loss_fn(apply), zf.optim.adamw(1e-2))
    step = quantize(amp(shard_params(step), torch.bfloat16) if name != "plain" else step, kind)
    state = step.init(apply.params)
    state, _ = step(state, _batch(0))  # the first step may build what later ones reuse
    with _Copies() as copies:
        for i in range(1, 3):
            state, _ = step(state, _batch(i))
        step.apply(state, input_ids=_batch(9)[:1, :4], use_cache=False)  # dequantizes without gradients too
    assert copies.calls == [], copies.calls[:5]
