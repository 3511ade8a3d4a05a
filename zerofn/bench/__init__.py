"""Benchmark: zerofn's compositions against torch DDP, ZeroRedundancyOptimizer and FSDP2.

    python -m zerofn.bench --all                          # writes docs/bench/report.md and its plots
    python -m zerofn.bench --all --quick --out /tmp/b     # a tiny model: checks the harness in seconds
    python -m zerofn.bench --systems "torch DDP" "shard_grads(train_step)" --steps 20
    python -m zerofn.bench --list                         # the names of the systems

Every system trains the GPT of :mod:`zerofn.bench.gpt` (dim 256, 4 layers,
8 sequences per rank by default) with AdamW and no gradient clipping on 2
local gloo ranks, from the same seed on the same data, in two shapes
(``--shapes``): ``v64``, vocabulary 64, sequences of 64, AdamW betas
(0.9, 0.999) and weight decay 0.1 (3.19 M parameters); ``v512``, vocabulary
512 with an output head of its own, sequences of 128, betas (0.9, 0.95) and
weight decay 0.01 (3.45 M).
``--all`` runs torch DDP,
torch ZeroRedundancyOptimizer, torch FSDP2 (``fully_shard`` on every block
and the root), DeepSpeed ZeRO-1/2/3 when ``import deepspeed`` works, and the
zerofn compositions: ``train_step``, ``shard_optimizer``, ``shard_grads`` and
``shard_params``, each also under ``amp(..., bf16)``, ``offload`` of
``shard_optimizer`` to CPU RAM, and ``remat`` of ``shard_params``.

Per system and shape the report gives the step time of a loop of
consecutive steps (synchronised only before and after it: what a training
loop waits for) and its ratio to DDP's, round by round (the systems take
turns within each round, so the ratios come from one run), each the median
over the rounds with the smallest and largest beside it, the rounds in
which other processes used more than a few percent of the machine's CPU,
the bytes each rank holds between steps (parameters, optimizer state, the
rest) and its peak during a step, the collective traffic of one step, and
the final loss. See :mod:`zerofn.bench.report` for how each figure is made;
the plots need matplotlib (``zerofn[plot]``).

The modules: :mod:`~zerofn.bench.gpt` (the model and corpus),
:mod:`~zerofn.bench.systems` (the systems and the traffic counting),
:mod:`~zerofn.bench.harness` (the ranks and the measurements),
:mod:`~zerofn.bench.report` (markdown and plots), ``__main__`` (the command
line). The harness uses the transforms as a user does, so unlike the rest of
``zerofn/`` it imports ``zerofn.transforms``.
"""

from zerofn.bench.harness import QUICK, SHAPES, Config, Measured, Results, run, run_all
from zerofn.bench.report import write
from zerofn.bench.systems import ALL, SYSTEMS

__all__ = ["ALL", "QUICK", "SHAPES", "SYSTEMS", "Config", "Measured", "Results", "run", "run_all", "write"]
