"""Forced failures: does the guard bring a run back to dense's loss, and leave a healthy run alone?

    python benchmarks/guardrail_forced.py --out forced              # every case on three tasks
    python benchmarks/guardrail_forced.py --tasks regression --steps 600 --at 300
    python benchmarks/guardrail_forced.py --table forced/forced.json  # the tables, forced.png

Each case forces one failure into a run of the quality zoo (``quality_tasks.TASKS``), at step
``--at`` of ``--steps``, on 8 virtual CPU devices with ``jaxcomp.data_parallel``:

* ``frozen-variance``: ``jaxcomp.adam(2 * lr, "sign")`` with its variance floor taken out (the
  failure of issue 66: the frozen variance of a coordinate quiet during the warm-up lets
  ``m / sqrt(v)`` explode when it wakes), from the start;
* ``nan-gradients``: ``jaxcomp.adam(lr, "sign")``, device 0's gradients NaN for 10 steps (its
  loss times NaN: a bad batch);
* ``gradient-spike``: ``optax.chain(compress("zfp", rate=8), optax.adam(lr))``, every
  device's gradients 1e4 times too large for 3 steps (a corrupt batch): Adam's variance takes
  the spike, and its steps shrink by hundreds of times for thousands of steps.

Each runs unguarded (``guardrail=False``; the step's own check of non-finite updates cannot
be switched off), with the default guardrail, and with the guardrail and
``data_parallel(rollback=50)``; and, without the failure, unguarded and with guardrail and
rollback (what the guard costs a healthy run), and unguarded from params one ulp away (what
float rounding alone moves: a guard's change below it cannot be told apart). Every run is
compared with dense Adam (``optax.adam`` after ``compress("dense")``) in the same cell, from the
same params on the same batches. Results go to ``--out``/forced.json after every run; an
interrupted job resumes.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import quality_zoo  # noqa: E402

#: case -> (pairing, lr scale, the fault's gradient scale: None for none, per device or all)
CASES = {
    "frozen-variance": ("adam:sign", 2.0, None),
    "nan-gradients": ("adam:sign", 1.0, ("device0", math.nan, 10)),
    "gradient-spike": ("chain:zfp(8)", 1.0, ("all", 1e4, 3)),
}

#: guard -> (compress's guardrail, data_parallel's rollback)
GUARDS = {"unguarded": (False, None), "guardrail": (True, None), "rollback": (True, 50)}

#: A run without the guard or a failure, its initial params moved by one float32 ulp: how far
#: float rounding alone moves the final loss, the floor under which no guard's change can show.
NUDGED = "unguarded, +1 ulp"

TASK_NAMES = ("mlp-charlm", "transformer", "regression")


def faulted(task, fault, at: int, n_devices: int):
    """``task`` whose loss is multiplied on the steps ``[at, at + length)`` by ``scale`` (on
    device 0's rows, or on every row); a batch carries its rows' factors beside it."""
    import jax.numpy as jnp
    import numpy as np

    where, scale, length = fault
    rows = len(jax_leaf(task.batch(0)))

    def batch(step):
        factor = np.ones(rows, np.float32)
        if at <= step < at + length:
            factor[: rows // n_devices if where == "device0" else rows] = scale
        return (task.batch(step), factor)

    def loss_fn(params, batch):
        inner, factor = batch
        return task.loss_fn(params, inner) * jnp.mean(factor)

    heldout = (task.heldout, np.ones(len(jax_leaf(task.heldout)), np.float32))
    return dataclasses.replace(task, loss_fn=loss_fn, batch=batch, heldout=heldout)


def jax_leaf(tree):
    """The first leaf of a batch (its leading axis is the batch)."""
    import jax

    return jax.tree.leaves(tree)[0]


@contextlib.contextmanager
def floor_removed():
    """``jaxcomp.adam`` without its variance floor, for the ``frozen-variance`` case."""
    from jaxcomp.optim import optimizers

    kept = optimizers._floored
    optimizers._floored = lambda mu, nu, count, warm, hyper: nu
    try:
        yield
    finally:
        optimizers._floored = kept


def nudged(params):
    """Every float parameter moved by one ulp towards +inf."""
    import jax
    import numpy as np

    def nudge(p):
        p = np.asarray(p)
        return np.nextafter(p, np.inf).astype(p.dtype) if p.dtype.kind == "f" else p

    return jax.tree.map(nudge, params)


def transformation(pairing: str, guardrail: bool):
    """``tx(lr)`` of a pairing with compress's guardrail on or off."""
    import optax

    import jaxcomp

    kind, _, name = pairing.partition(":")
    method = quality_zoo.method(name)
    if kind == "adam":
        return lambda lr: jaxcomp.adam(lr, method, guardrail=guardrail)
    return lambda lr: optax.chain(jaxcomp.compress(method, guardrail=guardrail), optax.adam(lr))


def run(task, case: str, guard: str, failed: bool, args, devices) -> dict:
    """One run of ``case`` with ``guard``, with its failure or without."""
    pairing, scale, fault = CASES[case]
    guardrail, rollback = GUARDS["unguarded" if guard == NUDGED else guard]
    if guard == NUDGED:
        task = dataclasses.replace(task, params=nudged(task.params))
    if failed and fault is not None:
        task = faulted(task, fault, args.at, quality_zoo.N_DEVICES)
    removed = floor_removed() if failed and fault is None else contextlib.nullcontext()
    with removed:
        record = quality_zoo.train(
            task,
            pairing,
            scale,
            "constant",
            args.steps,
            devices,
            tx=transformation(pairing, guardrail),
            rollback=rollback,
        )
    return dict(record, case=case, guard=guard, failed=failed)


def reference(task, scale: float, args, devices) -> dict:
    """Dense Adam in the cell of a case (its learning-rate scale)."""
    record = quality_zoo.train(task, "dense", scale, "constant", args.steps, devices)
    return dict(record, case="dense", guard="-", failed=False)


def table(results) -> str:
    """A Markdown table per task: a row per case, each run's held-out loss over dense's in its
    cell (bold above 1.03), with the guardrail's triggers, the rollbacks and the optimizer
    steps the run's state took (fewer than the loop's after a rollback)."""
    lines = []
    for task in sorted({r["task"] for r in results}):
        runs = {
            (r["case"], r["guard"], r["failed"], r["lr_scale"]): r
            for r in results
            if r["task"] == task
        }
        lines += [
            f"#### {task}",
            "",
            "| case | pairing | unguarded | guardrail | guardrail + rollback "
            "| no failure: unguarded | no failure: guarded + rollback "
            "| no failure: unguarded, params +1 ulp |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for case, (pairing, scale, _) in CASES.items():
            dense = runs.get(("dense", "-", False, scale))
            cells = [
                _cell(runs.get((case, guard, failed, scale)), dense)
                for guard, failed in (
                    ("unguarded", True),
                    ("guardrail", True),
                    ("rollback", True),
                    ("unguarded", False),
                    ("rollback", False),
                    (NUDGED, False),
                )
            ]
            lines.append(f"| {case} | {pairing} {scale:g}x | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _cell(run, dense) -> str:
    if run is None or dense is None:
        return "-"
    ratio = quality_zoo._ratio(run, dense)
    told = f"{run['fallbacks']} trig"
    if run.get("rollbacks"):
        told += f", {run['rollbacks']} back, {run['optimizer_steps']} steps"
    return f"{quality_zoo._fmt(ratio)} ({told})"


def plot(results, path: str):
    """A panel per task and case: the held-out loss along the run, dense's and each guard's
    with its failure (log scale; a run that went non-finite stops where it did)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in results})
    fig, axes = plt.subplots(
        len(tasks), len(CASES), figsize=(4 * len(CASES), 3 * len(tasks)), squeeze=False
    )
    for row, task in zip(axes, tasks):
        runs = [r for r in results if r["task"] == task]
        for ax, (case, (pairing, scale, _)) in zip(row, CASES.items()):
            lines = [(r, "dense") for r in runs if r["case"] == "dense" and r["lr_scale"] == scale]
            lines += [(r, r["guard"]) for r in runs if r["case"] == case and r["failed"]]
            for run, label in lines:
                finite = [(s, x) for s, x in run["eval_curve"] if math.isfinite(x)]
                ax.plot(*zip(*finite) if finite else ([], []), marker=".", label=label)
            ax.set_yscale("log")
            ax.set_title(f"{task}: {case}\n{pairing} {scale:g}x", fontsize=9)
            ax.set_xlabel("step")
        row[0].set_ylabel("held-out loss")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=",".join(TASK_NAMES), help="comma-separated")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--at", type=int, default=600, help="the step the failure starts")
    parser.add_argument("--out", default="guardrail-forced", help="folder for forced.json")
    parser.add_argument("--table", metavar="JSON", help="print the tables of a forced.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    from quality_tasks import TASKS

    args.tasks = quality_zoo._names(parser, "--tasks", args.tasks, TASKS)
    args.cases = quality_zoo._names(parser, "--cases", args.cases, CASES)
    if not 0 < args.at < args.steps:
        parser.error(f"--at must be in (0, --steps), got {args.at}")
    return args


def _todo(args):
    """``(task, case, guard, failed)`` of every run, dense's first."""
    scales = sorted({CASES[c][1] for c in args.cases})
    todo = []
    for name in args.tasks:
        todo += [(name, "dense", scale, False) for scale in scales]
        todo += [
            (name, case, guard, failed)
            for case in args.cases
            for guard, failed in [(g, True) for g in GUARDS]
            + [("unguarded", False), ("rollback", False), (NUDGED, False)]
        ]
    return todo


def main(argv=None):
    args = _parse(argv)
    if args.table:
        with open(args.table) as f:
            results = json.load(f)["results"]
        print(table(results))
        plot(results, os.path.splitext(args.table)[0] + ".png")
        return 0
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={quality_zoo.N_DEVICES}"
    )
    import jax
    from quality_tasks import TASKS

    jax.config.update("jax_num_cpu_devices", quality_zoo.N_DEVICES)
    devices = jax.devices("cpu")[: quality_zoo.N_DEVICES]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "forced.json")
    results = json.load(open(path))["results"] if os.path.exists(path) else []
    done = {
        (r["task"], r["case"], r["guard"] if r["case"] != "dense" else r["lr_scale"], r["failed"])
        for r in results
    }
    todo, tasks = _todo(args), {}
    progress = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(todo), desc="forced runs", file=sys.stderr)
    for name, case, guard, failed in todo:
        task = tasks.get(name) or tasks.setdefault(name, TASKS[name](0))
        if (name, case, guard, failed) not in done:
            if case == "dense":
                results.append(reference(task, guard, args, devices))
            else:
                results.append(run(task, case, guard, failed, args, devices))
            with open(path, "w") as f:
                json.dump({"steps": args.steps, "at": args.at, "results": results}, f)
        if progress is not None:
            progress.update()
    print(table([r for r in results if r["task"] in args.tasks]))
    plot(results, os.path.join(args.out, "forced.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
