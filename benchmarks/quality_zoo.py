"""The quality zoo: every recommended pairing on several tasks, at dense Adam's tuned learning
rate and at twice it, at a constant rate and with warm-up plus cosine decay.

    python benchmarks/quality_zoo.py --out zoo                        # the whole grid
    python benchmarks/quality_zoo.py --tasks mlp-charlm --pairings dense,adam:sign --steps 500
    python benchmarks/quality_zoo.py --tune --out zoo-tune            # dense Adam's lr per task
    python benchmarks/quality_zoo.py --table zoo/zoo.json  # its tables again, and zoo/zoo.png

A recommendation must hold on every task, not on the one it was tuned on. The tasks are
``quality_tasks.TASKS`` (a transformer and an MLP char-LM on code, a CNN on digits, a regression,
a convolutional LM on prose). A pairing is ``dense`` (``optax.adam`` after
``compress("dense")``; ``dense:reseed`` the same from other initial params and batches, the
task's own noise), ``adam:METHOD`` (``jaxcomp.adam(lr, METHOD)``) or ``chain:METHOD``
(``optax.chain(compress(METHOD), optax.adam(lr))``). Each run trains on 8 virtual CPU devices
with ``jaxcomp.data_parallel``, from the same params on the same batches as dense in its cell,
and records the held-out loss every tenth of the run (and at step 500), the bytes a device
sends, rejected steps and guardrail triggers. Results are appended to ``--out``/zoo.json after
every run, and a run already there is not run again, so an interrupted grid resumes.

The verdict table gives each pairing's worst held-out loss ratio to dense's over the cells: a
pairing is recommended where it is within 3% of dense at dense's rate after 1500 steps on every
task, and never non-finite or over 1.5x dense at either rate.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

N_DEVICES = 8

#: The methods of the pairings, by name (``describe()``): built when jaxcomp is imported.
METHODS = (
    "sign",
    "zfp(8)",
    "quantized(4)",
    "ar_topk(0.01)",
    "allgather_topk(0.01)",
    "powersgd(4)",
    "randomk(0.01)",
    "cast(bfloat16)",
)

#: Every pairing: dense; dense from another seed (other initial params and batches: how far two
#: dense runs of a task fall apart, the task's noise); jaxcomp.adam sending every value (what its
#: own recipe costs); then each method through jaxcomp.adam and through the chain.
PAIRINGS = ("dense", "dense:reseed", "adam:dense") + tuple(
    f"{kind}:{m}" for m in METHODS for kind in ("adam", "chain")
)

SCHEDULES = ("constant", "cosine")

#: The learning rates ``--tune`` tries for dense Adam.
TUNE_RATES = (1e-3, 2e-3, 4e-3, 8e-3)


def method(name: str):
    """The method object of a :data:`METHODS` name."""
    from jaxcomp import methods as m

    table = {
        "sign": m.Sign(),
        "zfp(8)": m.Zfp(8),
        "quantized(4)": m.Quantized(4),
        "ar_topk(0.01)": m.TopK(0.01, collective="ar"),
        "allgather_topk(0.01)": m.TopK(0.01),
        "powersgd(4)": m.PowerSGD(4),
        "randomk(0.01)": m.RandomK(0.01),
        "cast(bfloat16)": m.Cast("bfloat16"),
        "dense": m.Dense(),
    }
    if name not in table:
        raise ValueError(f"unknown method {name!r}; choose from {', '.join(table)}")
    return table[name]


def learning_rate(peak: float, schedule: str, steps: int):
    """A constant ``peak``, or 0 to ``peak`` over ``steps // 20`` steps then cosine to a tenth."""
    import optax

    if schedule == "constant":
        return peak
    if schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, peak, max(1, steps // 20), steps, end_value=0.1 * peak
        )
    raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")


def transformation(pairing: str, lr):
    """The whole optimizer of a pairing (see the module docstring)."""
    import optax

    import jaxcomp

    if pairing in ("dense", "dense:reseed"):
        return optax.chain(jaxcomp.compress(method("dense")), optax.adam(lr))
    kind, _, name = pairing.partition(":")
    if kind == "adam":
        return jaxcomp.adam(lr, method(name))
    if kind == "chain":
        return optax.chain(jaxcomp.compress(method(name)), optax.adam(lr))
    raise ValueError(f"pairing must be dense, adam:METHOD or chain:METHOD, got {pairing!r}")


def key(run: dict) -> tuple:
    """What identifies a run in the results."""
    return (run["task"], run["pairing"], run["lr_scale"], run["schedule"], run["steps"])


def train(
    task, pairing: str, lr_scale: float, schedule: str, steps: int, devices, tx=None, **options
) -> dict:
    """One run; returns its record (held-out curve, final loss, bytes, rejected, triggers, the
    optimizer steps its state took). ``tx`` replaces the pairing's transformation (built with
    the pairing's learning rate: ``tx(lr)``); ``options`` go to ``jaxcomp.data_parallel``."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jaxcomp
    from jaxcomp.training.rollback import triggered

    lr = learning_rate(task.learning_rate * lr_scale, schedule, steps)
    # A step whose update is not finite is skipped and counted (the zoo reports rejected steps).
    options.setdefault("nonfinite_updates", "skip")
    dp = jaxcomp.data_parallel(
        task.loss_fn,
        transformation(pairing, lr) if tx is None else tx(lr),
        Mesh(np.array(devices), ("data",)),
        **options,
    )
    evaluate = jax.jit(task.loss_fn)
    marks = {steps * i // 10 for i in range(1, 11)} | ({500} if steps > 500 else set())
    state, curve, sent, rejected = dp.init(task.params), [], [], []
    started = time.perf_counter()
    for step in range(steps):
        state, metrics = dp.step(state, task.batch(step))
        sent.append(metrics["bytes_sent"])
        rejected.append(metrics["rejected"])
        if step + 1 in marks:
            curve.append((step + 1, float(evaluate(state.params, task.heldout))))
    return {
        "task": task.name,
        "pairing": pairing,
        "lr_scale": lr_scale,
        "schedule": schedule,
        "steps": steps,
        "learning_rate": task.learning_rate * lr_scale,
        "heldout_loss": curve[-1][1],
        "eval_curve": curve,
        "mean_bytes_per_step": float(np.mean([float(v) for v in sent])),
        "rejected": int(sum(float(v) for v in rejected)),
        "fallbacks": triggered(state.opt_state),
        "optimizer_steps": int(state.step),
        "rollbacks": getattr(dp.step, "rollbacks", 0),
        "seconds": time.perf_counter() - started,
    }


def _ratio(run, dense):
    loss = run["heldout_loss"]
    if not (math.isfinite(loss) and dense and math.isfinite(dense["heldout_loss"])):
        return math.nan
    return loss / dense["heldout_loss"]


def _fmt(ratio):
    if math.isnan(ratio):
        return "**NaN**"
    return f"**{ratio:.3f}**" if ratio > 1.03 else f"{ratio:.3f}"


def cell_tables(results) -> str:
    """One Markdown table per task: a row per pairing, a column per (lr, schedule, steps) cell,
    each entry the held-out loss over dense's in that cell (bold above 1.03); a constant-rate
    run's first 500 steps count as a 500-step cell (:func:`with_prefixes`)."""
    results, lines = with_prefixes(results), []
    for task in sorted({r["task"] for r in results}):
        runs = {key(r): r for r in results if r["task"] == task}
        cells = sorted({k[2:] for k in runs})
        lines += [
            f"#### {task}",
            "",
            "| pairing | " + " | ".join(f"{s}x {sched} {n}" for s, sched, n in cells) + " |",
            "|---|" + "---:|" * len(cells),
        ]
        dense = {c: runs.get((task, "dense", *c)) for c in cells}
        lines.append(
            "| dense (loss) | "
            + " | ".join(f"{d['heldout_loss']:.4f}" if d else "-" for d in dense.values())
            + " |"
        )
        for pairing in [p for p in PAIRINGS if p != "dense"]:
            row = [runs.get((task, pairing, *c)) for c in cells]
            if any(row):
                entries = [_fmt(_ratio(r, dense[c])) if r else "-" for r, c in zip(row, cells)]
                lines.append(f"| {pairing} | " + " | ".join(entries) + " |")
        lines.append("")
    return "\n".join(lines)


def with_prefixes(results, at: int = 500) -> list:
    """``results`` and, for each constant-rate run longer than ``at`` steps, the run it contains
    of ``at`` steps (its held-out loss at step ``at``), unless such a run was made itself."""
    have = {key(r) for r in results}
    out = list(results)
    for r in results:
        curve = dict((step, loss) for step, loss in r["eval_curve"])
        prefix = (r["task"], r["pairing"], r["lr_scale"], r["schedule"], at)
        if r["schedule"] == "constant" and r["steps"] > at and at in curve and prefix not in have:
            out.append(dict(r, steps=at, heldout_loss=curve[at], prefix_of=r["steps"]))
    return out


def _count(pairs, name: str) -> int:
    """The guardrail's triggers or the rejected steps of a pairing's runs (prefixes not counted
    again)."""
    return sum(r.get(name, 0) for r, _ in pairs if "prefix_of" not in r)


def _worst(ratios):
    return max(ratios, key=lambda x: math.inf if math.isnan(x) else x, default=math.nan)


def noise(results, steps: int) -> dict:
    """Each task's seed noise: the largest ``|dense:reseed / dense - 1|`` over its cells of
    ``steps`` steps (both rates, every schedule), or 0 where there is no reseeded run. A task
    whose dense runs fall this far apart from another seed cannot judge a pairing closer."""
    dense = {key(r)[:1] + key(r)[2:]: r for r in results if r["pairing"] == "dense"}
    spread = {}
    for r in results:
        cell = key(r)[:1] + key(r)[2:]
        if r["pairing"] == "dense:reseed" and r["steps"] == steps:
            ratio = _ratio(r, dense.get(cell))
            if not math.isnan(ratio):
                spread[r["task"]] = max(spread.get(r["task"], 0.0), abs(ratio - 1))
    return spread


def verdict(results) -> str:
    """Each pairing's worst ratio to dense over the tasks: at dense's rate after the longest run
    (the 3% target) and after 500 steps, on the quiet tasks (seed noise within 3%), and over
    every cell (the 1.5x bound); with its mean
    bytes against dense's. Recommended: on every task of the results, no run non-finite, within
    3% at dense's rate and within 1.5x anywhere, both widened by the task's seed noise
    (:func:`noise`) where it has any: within ``max(3%, noise)`` and ``1.5 (1 + noise)``. A
    last line gives each task's seed noise."""
    results = with_prefixes(results)
    dense = {key(r)[:1] + key(r)[2:]: r for r in results if r["pairing"] == "dense"}
    longest = max((r["steps"] for r in results), default=0)
    tasks, spread = {r["task"] for r in results}, noise(results, longest)
    lines = [
        f"| pairing | tasks | worst at 1x, {longest} steps, quiet tasks | tasks within 3% or "
        "noise | at 1x, 500 steps, quiet tasks | worst anywhere | non-finite cells "
        "| triggers / rejected "
        "| bytes vs dense | recommended |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for pairing in [p for p in PAIRINGS if p not in ("dense", "dense:reseed")]:
        pairs = [
            (r, dense[key(r)[:1] + key(r)[2:]])
            for r in results
            if r["pairing"] == pairing and key(r)[:1] + key(r)[2:] in dense
        ]
        if pairs:
            lines.append(_verdict_row(pairing, pairs, tasks, spread, longest))
    told = ", ".join(f"{t} {spread[t]:.1%}" for t in sorted(spread))
    return "\n".join(lines) + f"\n\nSeed noise after {longest} steps: {told or '-'}."


def _verdict_row(pairing, pairs, tasks, spread, longest) -> str:
    ratios = [_ratio(r, d) for r, d in pairs]
    at_rate = {
        n: [(r["task"], _ratio(r, d)) for r, d in pairs if r["lr_scale"] == 1 and r["steps"] == n]
        for n in (longest, 500)
    }
    quiet = {n: [x for t, x in v if spread.get(t, 0.0) <= 0.03] for n, v in at_rate.items()}
    shown = {n: _fmt(_worst(v)) if v else "-" for n, v in quiet.items()}
    within = {t for t, x in at_rate[longest] if x <= 1 + max(0.03, spread.get(t, 0.0))}
    within -= {t for t, x in at_rate[longest] if not x <= 1 + max(0.03, spread.get(t, 0.0))}
    bad = sum(1 for x in ratios if math.isnan(x))
    saved = [r["mean_bytes_per_step"] / d["mean_bytes_per_step"] for r, d in pairs]
    covered = {r["task"] for r, _ in pairs}
    bounded = all(_ratio(r, d) <= 1.5 * (1 + spread.get(r["task"], 0.0)) for r, d in pairs)
    holds = covered == tasks == within and bad == 0 and bounded
    return (
        f"| {pairing} | {len(covered)} / {len(tasks)} | {shown[longest]} "
        f"| {len(within)} / {len(tasks)} | {shown[500]} | {_fmt(_worst(ratios))} "
        f"| {bad} / {len(ratios)} | {_count(pairs, 'fallbacks')} / {_count(pairs, 'rejected')} "
        f"| {sum(saved) / len(saved):.3f} | {'yes' if holds else 'no'} |"
    )


def tune_table(results) -> str:
    """``--tune``'s table: dense Adam's final held-out loss per task and learning rate."""
    rates = sorted({r["learning_rate"] for r in results})
    lines = [
        "| task | " + " | ".join(f"{x:g}" for x in rates) + " |",
        "|---|" + "---:|" * len(rates),
    ]
    for task in sorted({r["task"] for r in results}):
        by_rate = {r["learning_rate"]: r["heldout_loss"] for r in results if r["task"] == task}
        best = min(by_rate, key=lambda x: by_rate[x] if math.isfinite(by_rate[x]) else math.inf)
        lines.append(
            f"| {task} | "
            + " | ".join(
                ("**{:.4f}**" if x == best else "{:.4f}").format(by_rate.get(x, math.nan))
                for x in rates
            )
            + " |"
        )
    return "\n".join(lines)


def _grid(args):
    """The runs to make: ``(task, pairing, lr_scale, schedule, steps)``."""
    if args.tune:
        # The rate enters as a scale of the task's own: each task's TUNE_RATES.
        return [("tune", rate, "constant", args.steps) for rate in TUNE_RATES]
    return [
        (pairing, scale, schedule, args.steps)
        for scale in args.lr_scales
        for schedule in args.schedules
        for pairing in args.pairings
    ]


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=None, help="comma-separated (default: every task)")
    parser.add_argument("--pairings", default=None, help="comma-separated (default: every one)")
    parser.add_argument("--lr-scales", default="1,2", help="times dense's tuned rate (1,2)")
    parser.add_argument("--schedules", default="constant,cosine")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--tune", action="store_true", help="dense Adam at 1e-3..8e-3 per task")
    parser.add_argument("--out", default="quality-zoo", help="folder for zoo.json")
    parser.add_argument("--table", metavar="JSON", help="print the tables of a zoo.json and exit")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    from quality_tasks import TASKS

    args.tasks = _names(parser, "--tasks", args.tasks, TASKS)
    args.pairings = _names(parser, "--pairings", args.pairings, PAIRINGS)
    args.schedules = _names(parser, "--schedules", args.schedules, SCHEDULES)
    try:
        args.lr_scales = [float(x) for x in args.lr_scales.split(",")]
    except ValueError:
        parser.error(f"--lr-scales must be comma-separated numbers, got {args.lr_scales!r}")
    if args.steps < 1 or any(not (x > 0) for x in args.lr_scales):
        parser.error("--steps and --lr-scales must be positive")
    return args


def _names(parser, flag, given, known):
    names = list(known) if given is None else [n.strip() for n in given.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"{flag}: unknown {unknown}; choose from {','.join(known)}")
    return names


def plot(results, path: str):
    """A heat map of every pairing's held-out loss over dense's, a column per task and cell:
    green within 3%, red at 1.5x and above, black where the run was not finite, grey where
    there is no run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    results = with_prefixes(results)
    dense = {key(r)[:1] + key(r)[2:]: r for r in results if r["pairing"] == "dense"}
    columns = sorted(dense)
    rows = [p for p in PAIRINGS if p != "dense" and any(r["pairing"] == p for r in results)]
    runs = {key(r): r for r in results}
    grid = np.full((len(rows), len(columns)), np.nan)
    for i, pairing in enumerate(rows):
        for j, (task, *cell) in enumerate(columns):
            run = runs.get((task, pairing, *cell))
            if run is not None:
                ratio = _ratio(run, dense[(task, *cell)])
                grid[i, j] = 9.0 if math.isnan(ratio) else min(ratio, 1.5)
    cmap = matplotlib.colormaps["RdYlGn_r"].with_extremes(over="black", bad="lightgrey")
    fig, ax = plt.subplots(figsize=(2 + 0.45 * len(columns), 1.5 + 0.35 * len(rows)))
    image = ax.imshow(grid, cmap=cmap, vmin=0.97, vmax=1.5, aspect="auto")
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    labels = [f"{task} {scale:g}x {sched} {n}" for task, scale, sched, n in columns]
    ax.set_xticks(range(len(columns)), labels, rotation=90, fontsize=7)
    fig.colorbar(
        image,
        ax=ax,
        extend="max",
        label="held-out loss / dense's\n(black: non-finite, grey: not run)",
    )
    ax.set_title("The quality zoo: every pairing against dense Adam in its cell")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _print_tables(results, tune: bool):
    if tune:
        print(tune_table(results))
        return
    print(cell_tables(results))
    print("\n### Verdict\n")
    print(verdict(results))


def main(argv=None):
    args = _parse(argv)
    if args.table:
        with open(args.table) as f:
            data = json.load(f)
        _print_tables(data["results"], data.get("tune", False))
        if not data.get("tune", False):
            plot(data["results"], os.path.splitext(args.table)[0] + ".png")
        return 0
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
    )
    import jax
    from quality_tasks import TASKS

    jax.config.update("jax_num_cpu_devices", N_DEVICES)
    devices = jax.devices("cpu")[:N_DEVICES]
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "zoo.json")
    results = json.load(open(path))["results"] if os.path.exists(path) else []
    done = {key(r) for r in results}
    todo = [(name, *cell) for name in args.tasks for cell in _grid(args)]
    progress = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=len(todo), desc="zoo runs", file=sys.stderr)
    tasks = {}
    for name, pairing, scale, schedule, steps in todo:
        seed = int(pairing == "dense:reseed")
        task = tasks.get((name, seed)) or tasks.setdefault((name, seed), TASKS[name](seed))
        if args.tune:
            pairing, scale = "dense", scale / task.learning_rate
        if (name, pairing, scale, schedule, steps) not in done:
            results.append(train(task, pairing, scale, schedule, steps, devices))
            with open(path, "w") as f:
                json.dump({"tune": args.tune, "results": results}, f)
        if progress is not None:
            progress.update()
    _print_tables([r for r in results if r["task"] in args.tasks], args.tune)
    if not args.tune:
        plot(results, os.path.join(args.out, "zoo.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
