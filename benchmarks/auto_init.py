"""What ``compress_auto``'s init spends timing its candidates' local work, one candidate at a time
(``overhead_seconds`` per method: a gradient drawn and a dense update timed for each) against
all at once (``overhead_seconds_each``: one gradient, one dense timing).

    python benchmarks/auto_init.py --model mlp4096 --rounds 2

The candidates are netbench's nine (``jaxcomp.distributed.netbench``'s ``auto`` row). Each round
times both ways, in alternating order, in one process, on this process's devices (1 by default,
as one emulated host has). Prints the wall seconds of each way and the local work each found.
Results go to BENCHMARKS.md.
"""

import argparse
import os
import platform
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp4096", help="a jaxcomp.training.zoo model")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of both ways")
    parser.add_argument("--devices", type=int, default=1, help="virtual CPU devices")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per update")
    return parser.parse_args()


args = parse_args()
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxcomp.distributed.netbench import _runs  # noqa: E402
from jaxcomp.optim import timing  # noqa: E402
from jaxcomp.training import zoo  # noqa: E402


def one_at_a_time(candidates, shapes):
    return [timing.overhead_seconds(m, shapes, repeats=args.repeats) for m in candidates]


def all_at_once(candidates, shapes):
    return timing.overhead_seconds_each(candidates, shapes, repeats=args.repeats)


def main():
    candidates = _runs()["auto"][0]
    model = zoo.build(args.model, abstract=True)
    shapes = [jax.ShapeDtypeStruct(p.shape, np.float32) for p in jax.tree.leaves(model.params)]
    n = sum(int(np.prod(s.shape)) for s in shapes)
    print(f"# {args.model}: {n:,} params in {len(shapes)} leaves, {len(candidates)} candidates,")
    machine = platform.processor() or platform.machine()
    print(f"# {args.devices} device(s), {machine}, jax {jax.__version__}")
    ways = [("one at a time", one_at_a_time), ("all at once", all_at_once)]
    for round_ in range(args.rounds):
        for name, way in ways if round_ % 2 == 0 else ways[::-1]:
            start = time.perf_counter()
            seconds = way(candidates, shapes)
            wall = time.perf_counter() - start
            found = ", ".join(f"{m.label} {s * 1e3:.0f}" for m, s in zip(candidates, seconds))
            print(
                f"round {round_ + 1}, {name}: {wall:.1f} s wall; local work ms: {found}", flush=True
            )


if __name__ == "__main__":
    main()
