"""``offload``: optimizer state and fp32 master weights in CPU RAM or in files on NVMe.

Composes with the shard transforms and ``amp`` in any order: it wraps the
optimizer after ``amp`` has (the fp32 master weights are optimizer state, so
they move with it), whatever order the transforms were applied in.

``device="cpu"``: the optimizer state (and amp's fp32 master) lives in host
memory, pinned when CUDA is present. Backward copies this rank's gradient
partition to the host bucket by bucket as each lands (non-blocking into
pinned buffers on CUDA) and frees it on the device; the update runs the
optimizer there (its fused kernel: torch's fused AdamW runs on the CPU) and
copies the updated parameters back; ``overlap`` lets it run on alongside the
next forward, ``early`` starts it during backward. On a CPU-only machine the
same code runs: the host copy is a separate placement with its own buffers,
not a shortcut.

``params="cpu"`` (with ``shard_params``; ``True`` says the same beside
``device="cpu"``): the parameter shards themselves live on the host, with
the optimizer state in RAM or on NVMe; each unit's shard is copied in just
before its all-gather, so the ``prefetch`` of ``shard_params`` brings it in
ahead of use.

``params="nvme"`` (with ``shard_params`` and ``device="nvme"``; ``True``
says the same beside ``device="nvme"``): the parameter shards rest in files
under ``path`` too, one per unit's bucket per rank, and RAM holds none of
them between uses. ``shard_params`` reads each unit's shard on an I/O thread
ahead of its gather (the units it expects next, ``prefetch + 1`` of them),
holds it while the gather runs, and reads it again for backward; the update
reads each sub-group's parameters beside its optimizer state and writes the
new values to the parameter's other generation, switched to only when every
write has succeeded. ``init`` writes each shard as soon as a model built on
the meta device has filled it, so no rank holds the model either.

``device="nvme"``: every optimizer-state tensor that is shaped like the
parameters (Adam's moments, amp's master weights) lives in files under
``path`` (one file per tensor per rank, in two generations); counters stay
in the state pytree. Backward writes each bucket's gradient to a file as it
lands (the device and RAM never hold the whole gradient partition), and the
update reads each sub-group's gradient beside its state. The update streams
the files in sub-groups of ``sub_group_bytes``: a background thread reads
the next sub-group and another writes the previous one while the current
one is updated, so RAM held for optimizer state is a few sub-groups
whatever the model size. New state goes
to the other generation and the new parameters to a staging file; only when
every write has succeeded are the parameters copied in and the manifest
switched, so a failed update (a full disk) leaves the state from before the
step intact and usable. Masks and groups (``zf.optim.masked``, ``mask=``,
``multi_transform``) work on either device: the host engine binds the
optimizer to what its buckets hold, the NVMe engine each sub-group to the
parameters it holds (so a group's optimizer, and torch's rule for parameters
without a gradient, apply per sub-group exactly as over the whole bucket).

Offloaded state shows its placement: the optimizer state is a
:class:`HostState` or :class:`NvmeState`, and ``zf.memory.state_bytes``
reports bytes per placement (``by_placement``: "cpu", "cuda", "nvme").

Collectives: none of its own.

The package: this module holds the transform and its checks; ``_host`` the
host-RAM engine (:class:`HostState`, ``HostEngine``), ``_pending`` the
updates that run on after a call returns and their worker thread, ``_nvme``
the NVMe engine, with ``_nvme_files`` its files (:class:`NvmeState`,
:class:`NvmeFiles`), ``_nvme_sub_groups`` a bucket's sub-groups and
``_nvme_update`` the update streamed through the files.

Example:
    >>> import torch, zerofn as zf
    >>> from zerofn.transforms import offload, shard_optimizer
    >>> apply = zf.functional(torch.nn.Linear(4, 1))
    >>> loss_fn = lambda p, b: apply(p, b).square().mean()
    >>> step = offload(shard_optimizer(zf.train_step(loss_fn, zf.optim.adamw(1e-3))), "cpu")
    >>> state, metrics = step(step.init(apply.params), torch.ones(2, 4))
    >>> type(state.opt_state).__name__
    'HostState'
"""

from __future__ import annotations

import functools
import os
import tempfile
from typing import Any

import torch
from zerofn.transforms.offload._host import DelayedHostState, HostOptions, HostState, host_optimizer, runs_late
from zerofn.transforms.offload._nvme import NvmeFiles, NvmeOptions, NvmeState, nvme_optimizer

from zerofn.extension import Extension
from zerofn.step import Step, reapply, transform

__all__ = ["DelayedHostState", "HostState", "NvmeFiles", "NvmeState", "offload"]

DEFAULT_SUB_GROUP_BYTES = 64 * 2**20


@transform
def offload(
    step: Step,
    /,
    device: str = "cpu",
    *,
    path: str | os.PathLike | None = None,
    params: bool | str = False,
    sub_group_bytes: int = DEFAULT_SUB_GROUP_BYTES,
    pin_memory: bool = True,
    overlap: bool | None = None,
    delay: int = 0,
    early: bool = False,
) -> Step:
    """Keep optimizer state (and fp32 master weights) in CPU RAM or NVMe files.

    Args:
        step: a Step. Called without it, returns a decorator.
        device: ``"cpu"`` or ``"nvme"``.
        path: a writable directory for ``"nvme"``'s files (one sub-directory per rank).
        params: where the parameter shards rest between uses (needs ``shard_params``): ``False`` (on
            the device the step computes on), ``"cpu"`` (host RAM, pinned when CUDA is present; each
            unit's shard is copied in just before its all-gather) with the optimizer state in RAM or on
            NVMe, ``"nvme"`` (files under ``path``, read ahead of each gather; needs ``device="nvme"``),
            or ``True``: the optimizer state's own placement.
        sub_group_bytes: ``"nvme"``: bytes of optimizer state streamed per sub-group.
        pin_memory: pin host buffers when CUDA is present.
        overlap: ``"cpu"``: run the host update on a worker thread, bucket by
            bucket in the order the forward reads them, and return before it
            ends; the next forward waits for each bucket as it first reads it,
            and reading the state waits for all of it. The same numbers as
            ``overlap=False``, which updates before the step returns. None
            (the default): on when the parameters live on an accelerator, off
            when the step computes on the CPU, whose cores the update and
            the forward would share.
        delay: ``"cpu"``: ``1`` delays each update by one step, as
            ZeRO-Offload's delayed parameter update: the host update of step
            t runs through the forward and backward of step t + 1, which use
            the parameters from before it, so each gradient is taken one
            update behind. It changes the numbers (off by default; see the
            offload page of the docs). ``0``: no delay.
        early: ``"cpu"``: start each bucket's host update during backward,
            as soon as its gradient is on the host, before the global norm
            and the skip decision are known: speculatively, the bucket's
            state saved first into a second copy of the host optimizer
            state (host RAM for it twice), restored on a skipped step and
            updated again when the norm clips. The same numbers as
            ``early=False``; see the offload page of the docs for when it
            pays.

    Returns:
        The rewritten Step. Applied to a step that already offloads with the
        same settings it returns that step unchanged.

    Raises:
        TypeError: ``step`` is not a Step.
        ValueError: an unknown device, a missing or unwritable ``path``, bad
            sizes, or a step that already offloads with other settings.
    """
    if device not in ("cpu", "nvme"):
        raise ValueError(f'offload: device must be "cpu" or "nvme", got {device!r}')
    if not isinstance(sub_group_bytes, int) or sub_group_bytes < 4096:
        raise ValueError(f"offload: sub_group_bytes must be an int >= 4096, got {sub_group_bytes!r}")
    params = _param_placement(params, device)
    if delay not in (0, 1) or isinstance(delay, bool):
        raise ValueError(
            f"offload: delay must be 0 (update before the next forward) or 1 (one step late), got {delay!r}"
        )
    if delay and device != "cpu":
        raise ValueError('offload: delay=1 runs the host update alongside the next step in CPU RAM; use device="cpu"')
    if early and (device != "cpu" or params or delay):
        raise ValueError(
            "offload: early=True updates host optimizer state in CPU RAM during backward, while the forward's "
            'parameters stay as they are; it takes device="cpu", params=False and delay=0 (got '
            f"device={device!r}, params={bool(params)}, delay={delay!r})"
        )
    if delay and params:
        raise ValueError(
            "offload: delay=1 keeps a second host copy of the parameters for the next forward to run on while "
            "the update writes the first, which params=True (the parameter shards themselves on the host) has "
            "no room for; use params=False with delay=1, or delay=0"
        )
    pin = bool(pin_memory) and torch.cuda.is_available()
    if device == "nvme":
        options: HostOptions | NvmeOptions = NvmeOptions(_check_path(path), sub_group_bytes, pin)
        wrap = functools.partial(nvme_optimizer, options=options)
        late = None
    else:
        if path is not None:
            raise ValueError('offload: path is for device="nvme"; device="cpu" keeps state in RAM')
        overlap = None if overlap is None else bool(overlap)
        options = HostOptions(params=bool(params), pin=pin, overlap=overlap, delay=delay, early=bool(early))
        wrap = functools.partial(host_optimizer, options=options)
        late = functools.partial(runs_late, delay=delay, overlap=overlap)
    have = step.extension("offload")
    if reapply(step, "offload", have and have.options, options, "offloads (device and settings)"):
        return step
    step = step.extend(
        Extension("offload", options, wrap_optimizer=wrap, check=_needs_units if params else None, updates_late=late)
    )
    if not params:
        return step
    where = options.root if params == "nvme" else None
    return step.replace(storage=step.storage.replace(param_placement=params, param_path=where))


def _param_placement(params: Any, device: str) -> str | None:
    """``offload``'s ``params`` as a placement ("cpu"), or None: the parameters stay on the device."""
    if params is False or params is None:
        return None
    if params is True:
        return device  # where the optimizer state is
    if params == "cpu":
        return "cpu"
    if params == "nvme":
        if device != "nvme":
            raise ValueError(
                'offload: params="nvme" streams the parameter shards from files beside an optimizer state that is '
                "on NVMe too (it is six times their size under Adam, so when it fits in RAM the parameters do): "
                'offload(step, "nvme", path=..., params="nvme"), or keep both in RAM: '
                'offload(step, "cpu", params="cpu")'
            )
        return "nvme"
    raise ValueError(f'offload: params must be False, True, "cpu" or "nvme", got {params!r}')


def _needs_units(step: Step) -> None:
    if not step.storage.gathers_units:
        raise ValueError(
            f"{step.name}.init: offload(params={step.storage.param_placement!r}) keeps parameter shards off the "
            "device (in host RAM or in files) and brings them in per unit, which needs shard_params: "
            f"offload(shard_params(step), ..., params={step.storage.param_placement!r})"
        )


def _check_path(path: Any) -> str:
    if path is None:
        raise ValueError('offload(device="nvme") needs path=, a directory on the NVMe disk for the optimizer state')
    root = os.fspath(path)
    if os.path.exists(root) and not os.path.isdir(root):
        raise ValueError(f"offload: path {root!r} is a file; pass a directory (on the NVMe disk) for the state files")
    if not os.path.isdir(root):
        raise ValueError(
            f"offload: path {root!r} does not exist or is not a directory; create it first "
            f"(os.makedirs({root!r})) or pass another path"
        )
    try:
        with tempfile.NamedTemporaryFile(dir=root):
            pass
    except OSError as e:
        raise ValueError(
            f"offload: path {root!r} is not writable ({e.strerror}); pass a directory you can write to"
        ) from None
    return root
