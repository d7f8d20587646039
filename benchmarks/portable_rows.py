"""The portable (XLA) top-k family on many short rows and on long ones: the first call (trace,
compile, run) and the best of three later calls, for each shape.

    PYTHONPATH=src python benchmarks/portable_rows.py LABEL

LABEL names the version of jaxcomp on the path in each output line, so that two versions (a
worktree of an older commit, with the native module copied in) can be run one after the other
and their lines compared. Each op runs under an outer jax.jit, at XLA's default optimization.
Results go to BENCHMARKS.md.
"""

import sys
import time

import jax
import numpy as np

import jaxcomp

CASES = [
    ("topk", (5000, 7), 3),
    ("find_threshold", (5000, 7), 3),
    ("topk", (3, 8193), 2731),
    ("topk", (1, 65537), 3300),
    ("topk", (1, 1 << 20), 10000),
]


def op_of(name, k):
    if name == "topk":
        return jax.jit(lambda v: jaxcomp.topk(v, k, implementation="xla"))
    return jax.jit(lambda v: jaxcomp.find_threshold(v, k, 16, implementation="xla"))


def seconds(run):
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def main(label):
    for name, shape, k in CASES:
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        op = op_of(name, k)
        first = seconds(lambda: op(x))
        best = min(seconds(lambda: op(x)) for _ in range(3))
        rows = f"{shape[0]} x {shape[1]}, k={k}"
        print(f"{label} | {name} {rows} | {first:.2f} s | {best * 1e3:.1f} ms", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this")
