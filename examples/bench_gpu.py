"""GPU throughput, fraction of bf16 peak and peak memory: torch AMP, FSDP2, DeepSpeed and zerofn.

The systems and their measurement live in :mod:`zerofn.bench.gpu_speed` (the speed half of
``python -m zerofn.bench gpu``); this script is that command line, for any subset of systems:

    python examples/bench_gpu.py --dim 2048 --layers 24 --seq-len 1024 --batch 16
    python examples/bench_gpu.py --systems torch-amp fsdp2 zf-z3-amp --steps 50 --warmup 10
    python examples/bench_gpu.py --device cpu --dim 64 --layers 2 --seq-len 32 --batch 2 --steps 2 --warmup 1 \\
        --systems torch-amp zf-amp zf-z3-amp fsdp2                                     # a smoke run on the CPU
"""

from zerofn.bench.gpu_speed import *  # noqa: F403 (the script is the module's command line)
from zerofn.bench.gpu_speed import main

if __name__ == "__main__":
    main()
