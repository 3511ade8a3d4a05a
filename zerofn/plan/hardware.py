"""What a machine offers a training step: :class:`Hardware` (a GPU's compute and memory, its links within a
node and across nodes), the presets (:data:`PRESETS`: ``h100``, ``h200``, ``a100``) and the JSON file that
describes one (:func:`load_hardware`, :func:`hardware_from_dict`, :meth:`Hardware.to_dict`).

A hardware file (``python -m zerofn plan --hardware FILE.json``; ``--calibrate FILE.json`` writes one for
the machine it runs on) holds these fields, per GPU:

==========================  ========  ==================================================================
field                       required  meaning
==========================  ========  ==================================================================
``tflops``                  yes       dense bf16 peak, TFLOP/s (what MFU divides by)
``hbm_bytes``               yes       memory, bytes (the default ``--gpu-memory``)
``hbm_gbps``                yes       memory bandwidth, GB/s (the optimizer's update is bound by it)
``intra_node_gbps``         yes       bus bandwidth within a node, GB/s per GPU (NVLink)
``inter_node_gbps``         yes       bandwidth across nodes, GB/s per GPU (its NIC: 400 Gb/s = 50 GB/s)
``gpus_per_node``           yes       GPUs sharing the intra-node links
``intra_node_latency_us``   no        a collective's fixed cost within a node, microseconds (default 10)
``inter_node_latency_us``   no        ... across nodes (default 20)
``collectives``             no        per collective kind (``all_gather``, ``reduce_scatter``,
                                      ``all_reduce``, ``all_to_all``), ``{"gbps": ..., "latency_us": ...}``
                                      within a node, where they differ from the link's (calibrate's fit)
``name``, ``notes``,        no        free text; ``calibration`` the samples a calibration measured
``calibration``
==========================  ========  ==================================================================

Bandwidths are *bus* bandwidths, as nccl-tests reports them: a ring all-gather or reduce-scatter of a full
tensor of B bytes over n ranks moves B (n - 1) / n bytes through each rank's link, an all-reduce twice that,
and takes that many bytes over the bandwidth (see :mod:`zerofn.plan.speed`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

__all__ = ["COLLECTIVES", "Hardware", "LinkCost", "PRESETS", "hardware_from_dict", "load_hardware"]

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")

_REQUIRED = ("tflops", "hbm_bytes", "hbm_gbps", "intra_node_gbps", "inter_node_gbps", "gpus_per_node")
_OPTIONAL = ("name", "notes", "intra_node_latency_us", "inter_node_latency_us", "collectives", "calibration")
DEFAULT_INTRA_LATENCY_US = 10.0
DEFAULT_INTER_LATENCY_US = 20.0


@dataclass(frozen=True)
class LinkCost:
    """One collective kind's cost on a link: ``latency_s + bytes / (gbps x 1e9)`` seconds for the bytes a
    rank moves."""

    gbps: float
    latency_s: float

    def seconds(self, nbytes: float, count: int = 1) -> float:
        """The time of ``count`` collectives that together move ``nbytes`` through a rank's link."""
        if nbytes <= 0:
            return 0.0
        return count * self.latency_s + nbytes / (self.gbps * 1e9)


@dataclass(frozen=True)
class Hardware:
    """A GPU and its links (see the module docs for each field). ``collectives`` maps a collective kind to
    its own intra-node :class:`LinkCost` where it differs from the link's (a calibration's fit)."""

    name: str
    tflops: float
    hbm_bytes: float
    hbm_gbps: float
    intra_node_gbps: float
    inter_node_gbps: float
    gpus_per_node: int
    intra_node_latency_us: float = DEFAULT_INTRA_LATENCY_US
    inter_node_latency_us: float = DEFAULT_INTER_LATENCY_US
    collectives: dict[str, LinkCost] = field(default_factory=dict)
    notes: str = ""

    def intra(self, kind: str) -> LinkCost:
        """The cost of collective ``kind`` within a node."""
        own = self.collectives.get(kind)
        return own if own is not None else LinkCost(self.intra_node_gbps, self.intra_node_latency_us * 1e-6)

    def inter(self, kind: str) -> LinkCost:
        """The cost of collective ``kind``'s traffic across nodes (one NIC per GPU)."""
        return LinkCost(self.inter_node_gbps, self.inter_node_latency_us * 1e-6)

    def to_dict(self) -> dict:
        """The hardware file's fields (what :func:`hardware_from_dict` reads back)."""
        out = {
            "name": self.name,
            "tflops": self.tflops,
            "hbm_bytes": self.hbm_bytes,
            "hbm_gbps": self.hbm_gbps,
            "intra_node_gbps": self.intra_node_gbps,
            "inter_node_gbps": self.inter_node_gbps,
            "gpus_per_node": self.gpus_per_node,
            "intra_node_latency_us": self.intra_node_latency_us,
            "inter_node_latency_us": self.inter_node_latency_us,
        }
        if self.collectives:
            out["collectives"] = {
                k: {"gbps": c.gbps, "latency_us": c.latency_s * 1e6} for k, c in self.collectives.items()
            }
        if self.notes:
            out["notes"] = self.notes
        return out


# Published figures (datasheets), per GPU; the latencies are assumptions, not published figures.
PRESETS: dict[str, Hardware] = {
    "h100": Hardware(
        name="H100 SXM (8 per node, NVLink 4, 400 Gb/s InfiniBand per GPU)",
        tflops=989.0,  # dense bf16 (1979 with sparsity)
        hbm_bytes=80e9,
        hbm_gbps=3350.0,
        intra_node_gbps=450.0,  # NVLink 4: 900 GB/s both directions, 450 per direction
        inter_node_gbps=50.0,  # ConnectX-7 NDR, 400 Gb/s
        gpus_per_node=8,
    ),
    "h200": Hardware(
        name="H200 SXM (8 per node, NVLink 4, 400 Gb/s InfiniBand per GPU)",
        tflops=989.0,
        hbm_bytes=141e9,
        hbm_gbps=4800.0,
        intra_node_gbps=450.0,
        inter_node_gbps=50.0,
        gpus_per_node=8,
    ),
    "a100": Hardware(
        name="A100 80GB SXM (8 per node, NVLink 3, 200 Gb/s InfiniBand per GPU)",
        tflops=312.0,
        hbm_bytes=80e9,
        hbm_gbps=2039.0,
        intra_node_gbps=300.0,  # NVLink 3: 600 GB/s both directions, 300 per direction
        inter_node_gbps=25.0,  # ConnectX-6 HDR, 200 Gb/s
        gpus_per_node=8,
    ),
}


def _expected() -> str:
    return (
        f"expected {', '.join(_REQUIRED)} (and optionally {', '.join(_OPTIONAL)}); see docs/planning.md, "
        "'The hardware file'"
    )


def _positive(d: dict, key: str, where: str) -> float:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: field {key!r} must be a positive number, got {value!r}; {_expected()}")
    return float(value)


def hardware_from_dict(d: dict, where: str = "hardware") -> Hardware:
    """A :class:`Hardware` from a hardware file's fields (see the module docs).

    Raises:
        ValueError: a missing or unknown field, or a value that is not a positive number; the message
            names the field and the expected ones. ``where`` names the source in it (a file's path).

    Example:
        >>> from zerofn.plan import hardware_from_dict
        >>> hw = hardware_from_dict({"tflops": 989, "hbm_bytes": 80e9, "hbm_gbps": 3350, "intra_node_gbps": 450,
        ...                          "inter_node_gbps": 50, "gpus_per_node": 8})
        >>> hw.intra("all_gather").seconds(450e9)                  # 450 GB at 450 GB/s, and 10 us of latency
        1.00001
        >>> round(hw.inter("all_gather").seconds(50e9), 6)         # 50 GB at 50 GB/s across nodes, 20 us
        1.00002
    """
    if not isinstance(d, dict):
        raise ValueError(f"{where}: a hardware file holds one JSON object, got {type(d).__name__}; {_expected()}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(map(repr, missing))}; {_expected()}")
    unknown = [k for k in d if k not in _REQUIRED and k not in _OPTIONAL]
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; {_expected()}")
    values = {k: _positive(d, k, where) for k in _REQUIRED}
    gpus = values["gpus_per_node"]
    if gpus != int(gpus):
        raise ValueError(
            f"{where}: field 'gpus_per_node' must be a whole number, got {d['gpus_per_node']!r}; {_expected()}"
        )
    lat = {}
    for k, default in (
        ("intra_node_latency_us", DEFAULT_INTRA_LATENCY_US),
        ("inter_node_latency_us", DEFAULT_INTER_LATENCY_US),
    ):
        v = d.get(k, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{where}: field {k!r} must be a number of microseconds >= 0, got {v!r}; {_expected()}")
        lat[k] = float(v)
    collectives = {}
    given = d.get("collectives", {})
    if not isinstance(given, dict):
        raise ValueError(
            f"{where}: field 'collectives' must map a collective kind ({', '.join(COLLECTIVES)}) to "
            f"{{'gbps': ..., 'latency_us': ...}}, got {given!r}"
        )
    for kind, cost in given.items():
        if kind not in COLLECTIVES:
            raise ValueError(
                f"{where}: field 'collectives' names {kind!r}, which is not a collective kind; expected "
                f"{', '.join(COLLECTIVES)}"
            )
        if not isinstance(cost, dict) or set(cost) != {"gbps", "latency_us"}:
            raise ValueError(
                f"{where}: field 'collectives.{kind}' must be {{'gbps': ..., 'latency_us': ...}}, got {cost!r}"
            )
        gbps = _positive(cost, "gbps", f"{where}: collectives.{kind}")
        latency = cost["latency_us"]
        if (
            isinstance(latency, bool)
            or not isinstance(latency, (int, float))
            or not math.isfinite(latency)
            or latency < 0
        ):
            raise ValueError(f"{where}: field 'collectives.{kind}.latency_us' must be >= 0, got {latency!r}")
        collectives[kind] = LinkCost(gbps, float(latency) * 1e-6)
    name = d.get("name", os.path.basename(where) if where != "hardware" else "custom")
    return Hardware(
        name=str(name),
        tflops=values["tflops"],
        hbm_bytes=values["hbm_bytes"],
        hbm_gbps=values["hbm_gbps"],
        intra_node_gbps=values["intra_node_gbps"],
        inter_node_gbps=values["inter_node_gbps"],
        gpus_per_node=int(gpus),
        intra_node_latency_us=lat["intra_node_latency_us"],
        inter_node_latency_us=lat["inter_node_latency_us"],
        collectives=collectives,
        notes=str(d.get("notes", "")),
    )


def load_hardware(spec: str) -> Hardware:
    """A preset by name (``h100``, ``h200``, ``a100``; any case) or a hardware JSON file.

    Raises:
        ValueError: neither a preset nor a readable JSON file, or a file whose fields are wrong (the message
            names the field and the expected ones).

    Example:
        >>> from zerofn.plan import load_hardware
        >>> h100 = load_hardware("h100")
        >>> h100.tflops, h100.intra_node_gbps, h100.inter_node_gbps, h100.gpus_per_node
        (989.0, 450.0, 50.0, 8)
    """
    preset = PRESETS.get(spec.strip().lower())
    if preset is not None:
        return preset
    if not os.path.isfile(spec):
        raise ValueError(
            f"hardware {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a file; pass a preset or a hardware "
            "JSON file (python -m zerofn plan --calibrate FILE.json writes one for this machine)"
        )
    try:
        with open(spec) as f:
            d = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{spec}: not a JSON file ({e}); {_expected()}") from None
    return hardware_from_dict(d, where=spec)
