"""Benchmark: zerofn's compositions against torch DDP, ZeroRedundancyOptimizer and FSDP2.

    python -m zerofn.bench --all                          # writes docs/bench/report.md and its plots
    python -m zerofn.bench --all --quick --out /tmp/b     # a tiny model: checks the harness in seconds
    python -m zerofn.bench --systems "torch DDP" "shard_grads(train_step)" --steps 20
    python -m zerofn.bench --list                         # the names of the systems

Every system trains the GPT of :mod:`zerofn.bench.gpt` (dim 256, 4 layers,
sequences of 64 and 8 sequences per rank by default) with AdamW on 2 local
gloo ranks, from the same seed on the same data. ``--all`` runs torch DDP,
torch ZeroRedundancyOptimizer, torch FSDP2 (``fully_shard`` on every block
and the root), DeepSpeed ZeRO-1/2/3 when ``import deepspeed`` works, and the
zerofn compositions: ``train_step``, ``shard_optimizer``, ``shard_grads`` and
``shard_params``, each also under ``amp(..., bf16)``, ``offload`` of
``shard_optimizer`` to CPU RAM, and ``remat`` of ``shard_params``.

Per system the report gives the median step time and its ratio to DDP's
(the systems take turns within each round of timed steps, so the ratios
come from one run), the bytes each rank holds between steps (parameters,
optimizer state, the rest) and its peak during a step, the collective
traffic of one step, and the final loss. See :mod:`zerofn.bench.report` for
how each figure is made; the plots need matplotlib (``zerofn[plot]``).

The modules: :mod:`~zerofn.bench.gpt` (the model and corpus),
:mod:`~zerofn.bench.systems` (the systems and the traffic counting),
:mod:`~zerofn.bench.harness` (the ranks and the measurements),
:mod:`~zerofn.bench.report` (markdown and plots), ``__main__`` (the command
line). The harness uses the transforms as a user does, so unlike the rest of
``zerofn/`` it imports ``zerofn.transforms``.
"""

from zerofn.bench.harness import QUICK, Config, Measured, Results, run
from zerofn.bench.report import write
from zerofn.bench.systems import ALL, SYSTEMS

__all__ = ["ALL", "QUICK", "SYSTEMS", "Config", "Measured", "Results", "run", "write"]
