"""SparseLoCo's pseudo-gradients against data-parallel: final held-out loss and bytes, 4 workers.

    python sparseloco_quality.py --tasks charlm --rows dp,diloco-h50-avg-topk2r02 --lr-scales 1
    python sparseloco_quality.py --table          # the figures of results.json

Every run trains from the same params on the same batches for ``--steps`` steps (the same
samples: DiLoCo's 4 workers each take a quarter of dp's global batch). ``charlm`` is
time to quality's small char-LM (:mod:`jaxcomp.training.charlm`, 0.44M params, warm-up and
cosine), trained through ``jaxcomp.training.to_loss.train`` on 4 devices, so a row is a
``to_loss`` row name (``@lr=`` is set from ``--lr-scales``). Any other task is one of the quality
zoo's (``benchmarks/quality_tasks.py``) at its tuned Adam rate times the scale, on the zoo's
warm-up plus cosine schedule; ``dp`` is the zoo's dense pairing on 4 devices and a DiLoCo row is
``jaxcomp.diloco`` with the same Adam inside and the row's H, outer optimizer and codec. On these
tasks (and on ``charlm``, through the same loop) a row may end in ``+leaf`` (the top-k of each
leaf, ``granularity="leaf"``), ``+float`` (the selected values in float32, no 2-bit codes) and
``+decay95`` (SparseLoCo's error feedback: the residual decayed by 0.95 each sync).
Results go to ``results.json`` beside this script, one record a run; a run there already is not
run again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "benchmarks"))
RESULTS = os.path.join(HERE, "results.json")
WORKERS = 4


def _charlm(row: str, scale: float, steps: int, eval_every: int) -> dict:
    """A to_loss row on the small char-LM: its final held-out loss and bytes a device sent."""
    import dataclasses

    from jaxcomp.training import charlm, to_loss

    config = dataclasses.replace(charlm.MODELS["small"], steps=steps)
    name = f"{row}@lr={config.learning_rate * scale:g}"
    result = to_loss.train(
        name, config, charlm.load_corpus(), steps=steps, eval_every=eval_every, devices=WORKERS
    )
    curve = [(p["step"], p["loss"]) for p in result["curve"]]
    return dict(heldout_loss=curve[-1][1], bytes=result["curve"][-1]["bytes"], curve=curve)


def _zoo_run(task, row: str, lr, devices):
    """The zoo task's run of ``row``: ``data_parallel`` for dp, else ``jaxcomp.diloco``."""
    import dataclasses

    import numpy as np
    import optax
    import quality_zoo
    from jax.sharding import Mesh

    import jaxcomp
    from jaxcomp.training import to_loss

    if row == "dp":
        tx = quality_zoo.transformation("dense", lr)
        return jaxcomp.data_parallel(task.loss_fn, tx, Mesh(np.array(devices), ("data",)))
    # to_loss's own reading of a row name (its H, outer optimizer and codec), then the
    # variants after "+": "+leaf" (top-k of each leaf), "+float" (the values in float32).
    name, *variants = row.split("+")
    options = to_loss._row_options(name)
    method = to_loss.codec(options.get("compress") or "none")
    if "float" in variants:
        method = dataclasses.replace(method, value_bits=None)
    granularity = "leaf" if "leaf" in variants else "model"
    # "+decayNN": SparseLoCo's error feedback, the residual decayed by 0.NN each sync.
    decays = [float("0." + v[len("decay") :]) for v in variants if v.startswith("decay")]
    feedback = decays[0] if decays else "auto"
    return jaxcomp.diloco(
        task.loss_fn,
        optax.adam(lr),
        to_loss._outer(options["outer"]),
        mesh=Mesh(np.array(devices), ("workers",)),
        sync_every=options["sync_every"],
        compress=method
        and jaxcomp.compress(
            method, axis_name="workers", granularity=granularity, error_feedback=feedback
        ),
    )


def _task(name: str, scale: float, steps: int):
    """``(task, lr)``: a zoo task and its schedule, or (``charlm``) the small char-LM as
    ``to_loss.train`` builds it, from the same params on the same batches."""
    import dataclasses

    import quality_zoo
    from quality_tasks import TASKS, Task

    from jaxcomp.training import charlm

    if name != "charlm":
        task = TASKS[name](0)
        return task, quality_zoo.learning_rate(task.learning_rate * scale, "cosine", steps)
    config = dataclasses.replace(charlm.MODELS["small"], steps=steps)
    config = dataclasses.replace(config, learning_rate=config.learning_rate * scale)
    corpus = charlm.load_corpus()
    loss_fn, params, heldout = charlm.task(config, corpus, 0)
    windows = charlm.batches(corpus[0], config, steps, 0)
    batch = lambda step: {"tokens": corpus[0][windows[step]]}  # noqa: E731
    task = Task(name, loss_fn, params, batch, heldout, config.learning_rate)
    return task, charlm.schedule(config)


def _zoo(name: str, row: str, scale: float, steps: int, eval_every: int) -> dict:
    """A quality zoo task: its final held-out loss and bytes a device sent."""
    import jax

    from jaxcomp.optim import host

    task, lr = _task(name, scale, steps)
    run = _zoo_run(task, row, lr, jax.devices("cpu")[:WORKERS])
    params = (lambda s: s.params) if row == "dp" else run.params
    evaluate = jax.jit(task.loss_fn)
    state, sent, curve = run.init(task.params), [], []
    for step in range(steps):
        state, metrics = run.step(state, task.batch(step))
        sent.append(metrics["bytes_sent"])
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            curve.append((step + 1, float(evaluate(params(state), task.heldout))))
    total = float(sum(float(host.scalar(b)) for b in sent))
    return dict(heldout_loss=curve[-1][1], bytes=total, curve=curve)


def measure(task: str, row: str, scale: float, steps: int, eval_every: int) -> dict:
    """One run's record: the task, row, lr scale, steps, final held-out loss, bytes, seconds."""
    started = time.perf_counter()
    if task == "charlm" and "+" not in row:
        run = _charlm
    else:
        run = lambda *a: _zoo(task, *a)  # noqa: E731
    record = run(row, scale, steps, eval_every)
    record.update(task=task, row=row, lr_scale=scale, steps=steps)
    record["seconds"] = time.perf_counter() - started
    return record


def table(results) -> str:
    """A Markdown table: each run's final held-out loss and bytes over dp's in its cell."""
    dp = {(r["task"], r["lr_scale"], r["steps"]): r for r in results if r["row"] == "dp"}
    lines = [
        "| task | lr | steps | row | held-out loss | over dp's | dp's bytes over the row's |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in sorted(results, key=lambda r: (r["task"], r["lr_scale"], r["steps"])):
        base = dp.get((r["task"], r["lr_scale"], r["steps"]))
        ratio = f"{r['heldout_loss'] / base['heldout_loss']:.3f}" if base else "-"
        fewer = f"{base['bytes'] / r['bytes']:,.0f}x" if base and r["bytes"] else "-"
        lines.append(
            f"| {r['task']} | {r['lr_scale']:g}x | {r['steps']} | {r['row']} "
            f"| {r['heldout_loss']:.4f} | {ratio} | {fewer} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="charlm", help="charlm or quality zoo task names")
    parser.add_argument("--rows", default="dp,diloco-h50-avg,diloco-h50-avg-topk2r02")
    parser.add_argument("--lr-scales", default="1")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--eval-every", type=int, default=150)
    parser.add_argument("--out", default=RESULTS, help="the results file (results.json here)")
    parser.add_argument("--table", action="store_true", help="print the results' table")
    args = parser.parse_args(argv)
    results = json.load(open(args.out)) if os.path.exists(args.out) else []
    if args.table:
        print(table(results))
        return 0
    grid(args, results, measure, args.out)
    return 0


def grid(args, results, measure, out) -> None:
    """Runs every task, lr scale and row of ``args`` not in ``results`` yet with ``measure``,
    writing ``results`` to ``out`` after each, then prints the table."""
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    done = {(r["task"], r["row"], r["lr_scale"], r["steps"]) for r in results}
    for task in args.tasks.split(","):
        for scale in [float(x) for x in args.lr_scales.split(",")]:
            for row in args.rows.split(","):
                if (task, row, scale, args.steps) in done:
                    continue
                results.append(measure(task, row, scale, args.steps, args.eval_every))
                print(json.dumps({k: v for k, v in results[-1].items() if k != "curve"}))
                with open(out, "w") as f:
                    json.dump(results, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    sys.exit(main())
