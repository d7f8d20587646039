"""Time to quality: data-parallel training against per-step compression and DiLoCo (dense and
compressed pseudo-gradients) on the character-level language model, in one process or on an
emulated cluster.

This is ``jaxcomp netbench --to-loss`` (:mod:`jaxcomp.cli.to_loss`; the rows and their training
loop are :mod:`jaxcomp.training.to_loss`, the model :mod:`jaxcomp.training.charlm`), kept here so
that the commands in BENCHMARKS.md run as they were written:

    python benchmarks/time_to_quality.py                    # one process, 8 devices, ~15 min
    python benchmarks/time_to_quality.py --steps 100 --rows dp,diloco-h10
    python benchmarks/time_to_quality.py --quick            # a tiny model, a few steps (smoke test)
    sudo python benchmarks/time_to_quality.py --hosts 4 --rates 1gbit,100mbit --model wide \\
        --steps 150 --out results/ttq                       # the emulated cluster (root)
    sudo python benchmarks/time_to_quality.py --fault-tolerant --hosts 4 --model small \\
        --steps 4500 --max-steps 6000 --eval-every 150 --out results/ft  # a worker killed, back

``python benchmarks/time_to_quality.py --help`` lists the flags.
"""

import sys

from jaxcomp.cli.to_loss import main

if __name__ == "__main__":
    sys.exit(main())
