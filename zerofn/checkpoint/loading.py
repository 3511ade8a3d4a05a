"""Loading and resharding: build the state for any step on any world size, and fill each range this
rank holds from the saved pieces that cover it.

Which saved quantity fills a range is decided by roles (:class:`zerofn.checkpoint._format.Role`),
never by a quantity's name: see :meth:`_Sources.of`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, NamedTuple

import torch

from zerofn import collectives as C
from zerofn import keys
from zerofn._io import FileTensor, remove
from zerofn.checkpoint._format import CheckpointError, layout_json, signature
from zerofn.checkpoint.manifest import Saved, Source
from zerofn.checkpoint.partitioned import into_part, of_spec, partitions, view
from zerofn.checkpoint.parts import BUFFERS, FROZEN, PARAM_STEPS, PARAMS, Part, frozen_crc, layouts, state_parts
from zerofn.functional import owner_of
from zerofn.state import TrainState

__all__ = ["CHUNK_BYTES", "load", "verify"]

CHUNK_BYTES = 64 * 2**20  # bytes read, cast and copied at a time on load
_FULL = (torch.float32, torch.float64)  # full-precision parameters


class _Sources:
    """Which saved quantity fills each range of the state being loaded, from the saved quantities' roles
    and the loading state's own.

    Args:
        saved: the checkpoint.
        parts: the loading state's parts.
    """

    def __init__(self, saved: Saved, parts: list[Part]):
        self.saved = saved
        declares_newer = any(p.role is not None and p.role.newer for p in parts)
        # A delayed update saves its newest parameters as a quantity of their own; a step that declares
        # no such quantity takes those as its parameters.
        self.params_from_newer = saved.newer is not None and not declares_newer

    def of(self, part: Part, name: str, dtype: torch.dtype) -> tuple[str, str]:
        """The saved (quantity, kind) that fills parameter ``name`` of ``part`` (whose dtype is ``dtype``)."""
        saved = self.saved
        skind = saved.index[name].kind
        if part.kind == BUFFERS:
            return BUFFERS, BUFFERS
        role = part.role
        key = PARAMS if role is not None and role.mirror else part.key  # a mirror is filled as the parameters
        if key == PARAMS and skind == PARAMS and self.params_from_newer:
            return saved.newer, PARAMS
        if key in (PARAMS, FROZEN):
            if skind == PARAMS and dtype in _FULL and saved.precise is not None and saved.index[name].dtype != dtype:
                return saved.precise, PARAMS  # the full-precision copy saved beside low-precision parameters
            return skind, skind
        if skind != PARAMS:
            raise CheckpointError(f"{saved.what}: parameter {name} was frozen when saved; it has no {key}")
        if role is not None and role.precise:
            return saved.precise or PARAMS, PARAMS  # saved without one: the parameters, at their precision
        if role is not None and role.newer:
            return saved.newer or PARAMS, PARAMS  # saved without one: nothing pending beyond the parameters
        return key, PARAMS


class _Segment(NamedTuple):
    """Elements ``[lo, hi)`` of a part (relative to its start), read from ``source`` at ``src_lo``."""

    lo: int
    hi: int
    source: Source
    src_lo: int


def _check_model(saved: Saved, lays: dict, state: TrainState) -> None:
    """The same model: parameter names, shapes and (up to a float cast) dtypes, and buffer names."""
    mine = {s.name: (tuple(s.shape), b.dtype) for k in (PARAMS, FROZEN) for b in lays[k] for s in b.slots}
    theirs = {n: (tuple(e.shape), e.dtype) for n, e in saved.index.items() if e.kind != BUFFERS}
    problems = []
    missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
    if missing:
        problems.append(f"parameters this model has and the checkpoint lacks: {missing[:5]}")
    if extra:
        problems.append(f"parameters the checkpoint has and this model lacks: {extra[:5]}")
    for n in sorted(set(mine) & set(theirs)):
        (sa, da), (sb, db) = mine[n], theirs[n]
        if sa != sb:
            problems.append(f"{n}: shape {list(sb)} saved, {list(sa)} here")
        elif da != db and not (da.is_floating_point and db.is_floating_point):
            problems.append(f"{n}: dtype {db} saved, {da} here")
    if state.buffers:
        saved_buffers = {s.name: (tuple(s.shape), b.dtype) for b in saved.layouts[BUFFERS] for s in b.slots}
        for n, t in state.buffers.items():
            if n not in saved_buffers:
                problems.append(f"buffer {n} is not in the checkpoint")
            elif saved_buffers[n][0] != tuple(t.shape):
                problems.append(f"buffer {n}: shape {list(saved_buffers[n][0])} saved, {list(t.shape)} here")
    if problems:
        raise CheckpointError(
            f"{saved.what} is of another model (saved by {saved.m['chain']} on {saved.m['world_size']} "
            "rank(s)):\n  " + "\n  ".join(problems[:10]) + "\nLoad a checkpoint of this model, or build the model "
            "with the configuration the checkpoint was saved with."
        )


def _segments(sources: _Sources, part: Part, lays: dict, dtype: torch.dtype) -> list[_Segment]:
    """The saved ranges that fill ``part``, parameter by parameter, adjacent ones merged."""
    saved = sources.saved
    segs: list[_Segment] = []
    for s in lays[part.kind][part.bucket].slots:
        a0, a1 = max(part.lo, s.offset), min(part.hi, s.offset + s.numel)
        if a0 >= a1:
            continue
        skey, skind = sources.of(part, s.name, dtype)
        entry = saved.index[s.name]
        source = Source(skey, skind, entry.bucket)
        if source not in saved.pieces and skind == PARAMS:
            raise CheckpointError(
                f"{saved.what}: it holds no {skey} for parameter {s.name}: the optimizer that updated this "
                "parameter when it was saved kept other state for it (another transformation for its group). "
                "Load with an optimizer that gives each parameter the transformation it was saved with."
            )
        src_lo = entry.offset + (a0 - s.offset)
        last = segs[-1] if segs else None
        if last and last.hi == a0 - part.lo and last.source == source and last.src_lo + (last.hi - last.lo) == src_lo:
            segs[-1] = last._replace(hi=a1 - part.lo)
        else:
            segs.append(_Segment(a0 - part.lo, a1 - part.lo, source, src_lo))
    return segs


def _gaps(segs: list[_Segment], n: int) -> list[tuple[int, int]]:
    """The element ranges of ``[0, n)`` no segment covers: the bucket's padding."""
    out, at = [], 0
    for seg in sorted(segs, key=lambda s: s.lo):
        if seg.lo > at:
            out.append((at, seg.lo))
        at = max(at, seg.hi)
    if at < n:
        out.append((at, n))
    return out


def _fill(sources: _Sources, part: Part, lays: dict) -> None:
    """Write every element of ``part``: the saved values over each parameter's range, zeros over the
    padding. A fresh state relies on it: ``step.init(structure_only=True)`` writes none of them."""
    saved = sources.saved
    value = part.value
    flat = None
    if isinstance(value, torch.Tensor):
        flat = value.detach().view(-1) if value.is_contiguous() else None
    staged = None
    if flat is None and not isinstance(value, FileTensor):
        staged = torch.empty(part.hi - part.lo, dtype=value.dtype)
    segs = _segments(sources, part, lays, value.dtype)
    if isinstance(value, FileTensor) and len(segs) == 1 and _link_whole(saved, value, segs[0], part):
        return
    chunk = max(1, CHUNK_BYTES // 4)
    target = flat if flat is not None else staged  # the host tensor a range may be read straight into
    for a, b in _gaps(segs, part.hi - part.lo):
        if target is not None:
            target[a:b].zero_()
        else:
            for c in range(a, b, chunk):
                value.write(c, torch.zeros(min(b, c + chunk) - c, dtype=value.dtype))
    for seg in segs:
        if target is not None and target.device.type == "cpu" and target.dtype == saved.dtype(seg.source):
            # The saved bytes are the held ones: read them in place, with no buffer and no copy.
            saved.read(seg.source, seg.src_lo, seg.src_lo + (seg.hi - seg.lo), out=target[seg.lo : seg.hi])
            continue
        for a in range(seg.lo, seg.hi, chunk):
            b = min(seg.hi, a + chunk)
            data = saved.read(seg.source, seg.src_lo + (a - seg.lo), seg.src_lo + (b - seg.lo))
            if isinstance(value, FileTensor):
                value.write(a, data)
            elif flat is not None:
                flat[a:b].copy_(data)
            else:
                staged[a:b].copy_(data)
    if staged is not None:
        with torch.no_grad():
            value.copy_(staged.view(value.shape))


def _link_whole(saved: Saved, value: FileTensor, seg: _Segment, part: Part) -> bool:
    """A file-held range that equals one saved file: hard-link (or copy) that file, checked, in its place."""
    if (seg.lo, seg.hi) != (0, part.hi - part.lo):
        return False
    for p in saved.pieces.get(seg.source, []):
        if p.lo == seg.src_lo and p.hi == seg.src_lo + seg.hi and p.offset == 0 and p.dtype == value.dtype:
            if saved.m["files"][p.file]["size"] != seg.hi * value.itemsize:
                return False
            src = os.path.join(saved.path, p.file)
            saved.reader(p.file).verify()
            remove(value.path)
            try:
                os.link(src, value.path)
            except OSError:
                shutil.copyfile(src, value.path)
            return True
    return False


def load(
    path: str | os.PathLike,
    step: Any,
    *,
    state: TrainState | None = None,
    params: Any = None,
    rng: bool = True,
) -> TrainState:
    """The state for ``step`` from the checkpoint at ``path``, on any world size and composition.

    Args:
        path: a checkpoint directory (``latest(directory)`` finds the newest).
        step: the Step to load for: any composition of transforms, on any
            world size; its optimizer must be the one saved (its state has
            the same entries), or the same transformations grouped otherwise
            (``adamw`` and ``adamw(mask=...)``, or a ``multi_transform`` of
            AdamWs): each parameter's moments go where the parameter goes,
            and a group's step count comes from the saved group (or the
            saved optimizer) it matches once the groups' labels are left out.
        state: a state of ``step`` to fill in place (for example one you
            just built); by default ``step.init(params)``.
        params: the params tree for ``step.init`` (default: the parameters
            of the model ``loss_fn`` calls, ``apply.params``); their values
            are overwritten, so a freshly built model, or one on the meta
            device under ``shard_params``, will do; but for a checkpoint
            saved with ``save(..., frozen=False)``, whose frozen parameters
            ``step.init`` builds from them (the source model's weights, or
            its files through ``init_fn=zf.checkpoint.pretrained_init(...)``)
            and checks against the CRC-32 saved.
        rng: restore this rank's RNG states (when the world size is the one saved).

    Returns:
        The TrainState, equal to the saved one where the composition is the
        same (bit for bit), and the same model and optimizer state otherwise.

    Raises:
        IntegrityError: a missing, truncated or corrupted file.
        CheckpointError: a checkpoint of another model, or one whose
            optimizer state this step's optimizer does not have.

    Collective (through ``step.init``): every rank of the step's group calls
    it (``step.group``; None: the current group, see
    ``zf.collectives.group_scope``), and it runs in that group.
    """
    with C.group_scope(getattr(step, "group", None)):
        return _load(path, step, state, params, rng)


def _load(path: str | os.PathLike, step: Any, state: TrainState | None, params: Any, rng: bool) -> TrainState:
    split = partitions(path)  # a split model's checkpoint: one per part (zerofn.checkpoint.partitioned)
    saved = Saved(path) if split is None else Saved(os.path.join(path, "part0"))
    frozen_saved = saved.m.get("frozen", True)
    try:
        if state is None:
            if params is None:
                params = step.model().params
            owner = owner_of(params)
            if owner is not None and owner.adopted:
                raise CheckpointError(
                    "checkpoint.load: the model's parameters are held by a state already (step.init took them "
                    "over), so they cannot seed another. Pass that state to fill in place: "
                    "load(path, step, state=state), or build a fresh model for the step."
                )
            # the values are overwritten below; but for frozen ones saved without (frozen=False): built from params
            state = step.init(params, structure_only=frozen_saved)
        else:
            step.check_state(state)
        mine = of_spec(state.spec)
        if split is not None:  # the saved parts, reassembled and cut as this state's part is (if it differs)
            saved = view(path, split, saved, mine)
        elif mine is not None:  # an ordinary checkpoint into a split state: each parameter cut from the whole
            saved = into_part(path, saved, mine[1])
        lays = layouts(state)
        _check_model(saved, lays, state)
        held = state_parts(state, C.rank(), lays)
        wanted = {p.key for p in held.parts if p.key.startswith(keys.OPT)}
        wanted |= {k for k in held.small if k.startswith(keys.OPT)}
        # Compared modulo scopes: a group's counts are saved under its label, so that a checkpoint of one
        # grouping of the same parameters loads under another (see Saved.small_for).
        saved_opt = {k for k in saved.keys if k.startswith(keys.OPT)}
        saved_plain, wanted_plain = {keys.unscoped(k) for k in saved_opt}, {keys.unscoped(k) for k in wanted}
        lacking = sorted(k for k in wanted if k not in saved_opt and keys.unscoped(k) not in saved_plain)
        surplus = sorted(k for k in saved_opt if k not in wanted and keys.unscoped(k) not in wanted_plain)
        if lacking or surplus:
            raise CheckpointError(
                f"{saved.what}: its optimizer state does not map onto {step.name}'s: entries this optimizer has "
                f"and the checkpoint lacks: {lacking[:5]}; entries saved that this optimizer lacks: {surplus[:5]}. "
                "Load with the optimizer the checkpoint was saved with."
            )
        sources = _Sources(saved, held.parts)
        with torch.no_grad():
            for part in held.parts:
                if part.key != FROZEN or frozen_saved:
                    _fill(sources, part, lays)
            if not frozen_saved:
                _check_frozen(saved, held.parts, lays)
            same_layout = saved.m["signature"] == signature(layout_json(lays))
            for key, t in held.small.items():
                found = saved.small_for(key)
                if found is None or (key.startswith(keys.EXTRA) and not same_layout):
                    continue  # entries tied to a layout (shard_params' unit order) start afresh on another
                src = saved.read_small(found)
                if src.shape == t.shape:
                    t.copy_(src)
            if PARAM_STEPS not in saved.small or tuple(saved.small[PARAM_STEPS].shape) != tuple(
                state.param_steps.shape
            ):
                # saved before parameters kept their own counts (or with other parameters trainable): every
                # parameter updated as often as the step
                state.param_steps.fill_(int(state.count))
        if rng and saved.m["world_size"] == C.world_size():
            r = C.rank()
            if keys.rng("torch", r) in saved.small:
                torch.set_rng_state(saved.read_small(keys.rng("torch", r)))
            if keys.rng("cuda", r) in saved.small and torch.cuda.is_available():
                torch.cuda.set_rng_state(saved.read_small(keys.rng("cuda", r)))
        return state
    finally:
        saved.close()


def _check_frozen(saved: Saved, parts: list[Part], lays: dict) -> None:
    """Frozen values rebuilt by ``step.init`` (a checkpoint saved with ``frozen=False``) against the CRC-32
    each rank recorded, where this state's ranks hold what the saved ones did (same world size and layout)."""
    crcs, world = saved.m.get("frozen_crc") or [], C.world_size()
    if saved.m["world_size"] != world or saved.m["signature"] != signature(layout_json(lays)) or len(crcs) != world:
        return  # another layout: each rank's ranges differ, nothing to compare with
    want = crcs[C.rank()]
    differs = torch.tensor([want is not None and frozen_crc(parts) != want], dtype=torch.uint8)
    if world > 1:  # every rank raises together, whichever ranks hold the differing bytes
        differs = C.any_of(differs)
    if bool(differs.any()):
        raise CheckpointError(
            f"{saved.what} was saved without its frozen parameters (save(..., frozen=False)), and those this "
            "step built from the params it was given differ from the ones it was trained with. Build them from "
            "the same source as when it was saved: the same model weights, or init_fn="
            "zf.checkpoint.pretrained_init(directory) of the same directory, with the same transforms holding them."
        )


def verify(path: str | os.PathLike) -> dict:
    """Check every file of a checkpoint against its manifest (sizes and every block's checksum).

    Returns the manifest; raises :class:`IntegrityError` naming the first bad file. A split model's
    checkpoint (one part per group of ranks: tensor-parallel slices, a pipeline's stages) has every part
    checked, and gives part 0's manifest with every part's files (``part{i}/<name>``) and the ranks of
    every part (``world_size``).
    """
    split = partitions(path)
    if split is not None:
        parts = [verify(os.path.join(os.fspath(path), f"part{i}")) for i in range(len(split))]
        files = {f"part{i}/{name}": rec for i, m in enumerate(parts) for name, rec in m["files"].items()}
        return dict(parts[0], files=files, world_size=sum(m["world_size"] for m in parts))
    saved = Saved(path)
    try:
        for fname in saved.m["files"]:
            saved.reader(fname).verify()
        return saved.m
    finally:
        saved.close()
