"""The estimate: bytes per GPU, CPU RAM and NVMe of one composition (:func:`estimate`), and of all
that ``python -m zerofn plan`` tabulates (:func:`compositions`). The arithmetic is described in
:mod:`zerofn.plan`.

The package, one job a module: ``_defaults`` (zerofn's defaults the estimate counts with: the bucket size,
offload's pools, ZeRO-3's prefetch; :func:`nvme_read_buffers`), ``_optimizer`` (what an optimizer's state
holds: :class:`OptimizerBytes`, :func:`optimizer_bytes`), ``_record`` (:class:`Estimate` and a
composition's label), ``_checks`` (the refusals), ``_estimate`` (:func:`estimate`), ``_compositions``
(:func:`compositions`) and ``_longest`` (:func:`longest_sequence`).
"""

from zerofn.plan.estimates._checks import QUANTIZE_NEEDS_LORA as QUANTIZE_NEEDS_LORA  # re-exported
from zerofn.plan.estimates._compositions import compositions
from zerofn.plan.estimates._defaults import (
    BUCKET_BYTES,
    NVME_LANDING_BUFFERS,
    NVME_SUB_GROUP_BYTES,
    NVME_UPDATE_BUFFERS,
    PREFETCH,
    nvme_read_buffers,
)
from zerofn.plan.estimates._estimate import estimate
from zerofn.plan.estimates._longest import longest_sequence
from zerofn.plan.estimates._optimizer import ADAM as ADAM  # re-exported: Adam's bytes
from zerofn.plan.estimates._optimizer import ADAM_COUNT_BYTES, OptimizerBytes, optimizer_bytes
from zerofn.plan.estimates._record import Estimate

__all__ = [
    "ADAM_COUNT_BYTES",
    "BUCKET_BYTES",
    "NVME_LANDING_BUFFERS",
    "NVME_SUB_GROUP_BYTES",
    "NVME_UPDATE_BUFFERS",
    "PREFETCH",
    "Estimate",
    "OptimizerBytes",
    "compositions",
    "estimate",
    "longest_sequence",
    "nvme_read_buffers",
    "optimizer_bytes",
]
