"""PowerSGD's update with the matrices of one view worked on together, against one matrix at a
time: the first call (trace, compile, run) and the update's time, per zoo model.

    python benchmarks/powersgd_batches.py [--models mlp4096,mlp2041,gpt2,resnet50,many_small]

:func:`jaxcomp.methods.powersgd.batches` groups the compressed matrices by view. Each group's
``P`` s are orthogonalized in one batched pass, and a group's small matrices
(``STACK_MAX_VALUES``) are multiplied in batched products. "one at a time" puts each matrix in a
group of its own (``batches`` patched), which is the update before the grouping. Both run in one
process on one CPU device (``jax.shard_map``, the collectives move nothing), as
``compress_auto``'s ``init`` times a candidate and as a training step runs the update. The first
call is timed once per mode (which mode compiles first alternates between models); the update's
time is the best of ``--repeats`` interleaved rounds, and ``passes`` divides it by a plain copy
of the gradients timed in the same rounds (benchmarks/passes.py). Results: stdout (a table) and
``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import passes  # noqa: E402  (the zoo's gradients, the one-device update)

MODES = ("one at a time", "batched")


def parse_args(argv=None):
    from jaxcomp.training import zoo

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(zoo.NAMES), help="zoo models (default all)")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD's rank (default 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds (default 3)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    for name in args.models:
        if name not in zoo.NAMES:
            parser.error(f"--models: {name!r} is not a zoo model ({', '.join(zoo.NAMES)})")
    if args.repeats < 1 or args.rank < 1:
        parser.error("--repeats and --rank must be >= 1")
    return args


@contextlib.contextmanager
def mode(name: str):
    """Within: PowerSGD groups its matrices as ``name`` says."""
    from jaxcomp.methods import powersgd

    grouped = powersgd.batches
    if name == "one at a time":
        powersgd.batches = lambda views: [(i,) for i in range(len(views))]
    try:
        yield
    finally:
        powersgd.batches = grouped


def measure(model: str, rank: int, repeats: int, order=MODES) -> list[dict]:
    """One model's two rows: the first call's seconds (the modes compiled in ``order``), the
    update's best seconds, its passes."""
    import jaxcomp
    from jaxcomp.methods import PowerSGD

    grads = passes.gradients(model)
    copy = jax.jit(lambda g: jax.tree.map(lambda x: x * 2, g))
    runs, first = {"copy": lambda: copy(grads)}, {}
    for name in order:  # each mode traces and compiles its own update
        with mode(name):
            step, state = passes.transformation_update(jaxcomp.compress(PowerSGD(rank)), grads)
            start = time.perf_counter()
            jax.block_until_ready(step(grads, state))
            first[name] = time.perf_counter() - start
        runs[name] = lambda step=step, state=state: step(grads, state)
    best = passes.best_of_rounds(runs, repeats)
    leaves = jax.tree.leaves(grads)
    return [
        {
            "model": model,
            "params": sum(x.size for x in leaves),
            "leaves": len(leaves),
            "mode": name,
            "rank": rank,
            "first_call_seconds": first[name],
            "update_seconds": best[name],
            "copy_seconds": best["copy"],
            "passes": best[name] / best["copy"],
        }
        for name in MODES
    ]


def table(rows) -> str:
    """The rows as a markdown table."""
    lines = [
        "| model | leaves | matrices | first call s | update ms | passes |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['leaves']} | {r['mode']} | {r['first_call_seconds']:.1f} | "
            f"{r['update_seconds'] * 1e3:.1f} | {r['passes']:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = []
    for i, model in enumerate(args.models):  # which mode compiles first alternates
        rows += measure(model, args.rank, args.repeats, MODES if i % 2 == 0 else MODES[::-1])
        print("\n".join(table(rows[-2:]).splitlines()[2:]), flush=True)
    print(f"\n{platform.processor() or platform.machine()}, jax {jax.__version__}\n")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
