"""The summary's quality section: what each method costs in held-out loss on the quality zoo,
what holds over 5000 steps, and whether the guard brings a forced failure back."""

from __future__ import annotations

import math

import guardrail_forced
import quality_zoo

from summary import common

ZOO = common.result("quality_zoo_2026-12-05/zoo.json")
LONG = common.result("quality_zoo_2026-12-05/long/zoo.json")
FORCED = common.result("guardrail_forced_2026-12-05/forced.json")
TUNE = common.result("quality_zoo_2026-12-05/tune.json")
FILES = (ZOO, LONG, FORCED, TUNE)

STILL_SHORT = (
    "**Still short:** the digits CNN's seeds disagree by more than any pairing does, so it only "
    "catches divergence; the 5000-step runs are at twice the tuned rate and a constant rate only; "
    "random-k, all-gather top-k and PowerSGD through the chain have not run on the zoo; with no "
    "failure the guard leaves the chain's runs as they were, but moves `jaxcomp.adam`'s by as "
    "much as a one-ulp nudge of the initial params does, not within 0.1%: the two programs "
    "round differently from the first step, and the signs turn that into another run."
)


def section() -> str:
    """The Markdown of the section."""
    zoo = common.load(ZOO)["results"]
    return "\n".join(
        [
            "## What each method costs in quality",
            "",
            "Every pairing trains five tasks (`benchmarks/quality_tasks.py`: a transformer and an "
            "MLP char-LM on code, a CNN on scikit-learn's digits, a regression, a convolutional "
            "char-LM on prose) at dense Adam's tuned learning rate (1x) and twice it (2x), a "
            "constant rate and warm-up plus cosine, beside dense from the same params and batches "
            "and dense from another seed (the task's noise). Each figure is the held-out loss over "
            "dense's in the same cell; bold is over 1.03. Recommended: on every task, never "
            "non-finite, within 3% (or the task's noise) at 1x and within 1.5x anywhere.",
            "",
            "Command: `python benchmarks/quality_zoo.py --out DIR`, then `--table DIR/zoo.json`; "
            "8 virtual CPU devices on the development machine (2 cores). Results: "
            f"{common.sources([ZOO, LONG])}.",
            "",
            tuning(common.load(TUNE)["results"]),
            "",
            quality_zoo.verdict(zoo),
            "",
            "![the quality zoo: every pairing, task and learning rate](docs/img/quality_zoo.png)",
            "",
            long_runs(common.load(LONG)["results"]),
            "",
            forced(common.load(FORCED)),
            "",
            STILL_SHORT,
        ]
    )


def tuning(results) -> str:
    """Dense Adam's held-out loss per task at each constant rate it was tried at; the tuned
    rate (the best, bold) is the zoo's 1x."""
    rates = sorted({r["learning_rate"] for r in results})
    lines = [
        f"Dense Adam's tuned rate per task (`--tune`, {common.stamp(TUNE)}): held-out loss "
        "after 1500 steps at a constant rate, the best in bold.",
        "",
        "| task | " + " | ".join(f"{lr:g}" for lr in rates) + " |",
        "|---|" + "---:|" * len(rates),
    ]
    for task in sorted({r["task"] for r in results}):
        loss = {r["learning_rate"]: r["heldout_loss"] for r in results if r["task"] == task}
        best = min(loss, key=loss.get)
        cells = [
            "-" if lr not in loss else f"**{loss[lr]:.4f}**" if lr == best else f"{loss[lr]:.4f}"
            for lr in rates
        ]
        lines.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def long_runs(results) -> str:
    """5000 steps at 2x, constant: a row per pairing, a column per task."""
    dense = {r["task"]: r for r in results if r["pairing"] == "dense"}
    tasks = sorted(dense)
    pairings = sorted({r["pairing"] for r in results} - {"dense"})
    cells = {(r["pairing"], r["task"]): r for r in results}
    lines = [
        "**5000 steps** at 2x, constant (the pairings that freeze a variance; "
        "non-finite would read NaN):",
        "",
        "| pairing | " + " | ".join(tasks) + " |",
        "|---|" + "---:|" * len(tasks),
    ]
    for pairing in pairings:
        row = [cells.get((pairing, t)) for t in tasks]
        shown = [
            quality_zoo._fmt(quality_zoo._ratio(r, dense[t])) if r else "-"
            for r, t in zip(row, tasks)
        ]
        lines.append(f"| {pairing} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


def forced(data) -> str:
    """The forced failures: a row per task and case, the guards' held-out loss over dense's."""
    results = data["results"]
    lines = [
        f"**Forced failures** (`python benchmarks/guardrail_forced.py`, {common.stamp(FORCED)}): "
        f"each forced at step {data['at']} of {data['steps']}; the guardrail alone, and with "
        "`data_parallel(rollback=50)`; without a failure, the guard's change beside what moving "
        "the initial params by one ulp does (float rounding alone). "
        "![forced failures](docs/img/guardrail_forced.png)",
        "",
        "| task | case | unguarded | guardrail | + rollback | no failure, guarded | "
        "no failure, unguarded | params +1 ulp |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    columns = [
        ("unguarded", True),
        ("guardrail", True),
        ("rollback", True),
        ("rollback", False),
        ("unguarded", False),
        (guardrail_forced.NUDGED, False),
    ]
    for task in sorted({r["task"] for r in results}):
        runs = {(r["case"], r["guard"], r["failed"]): r for r in results if r["task"] == task}
        for case, (_, scale, _) in guardrail_forced.CASES.items():
            dense = next(
                (
                    r
                    for r in results
                    if r["task"] == task and r["case"] == "dense" and r["lr_scale"] == scale
                ),
                None,
            )
            cells = [_cell(runs.get((case, g, f)), dense) for g, f in columns]
            lines.append(f"| {task} | {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(run, dense) -> str:
    if run is None or dense is None:
        return "-"
    ratio = quality_zoo._ratio(run, dense)
    return "NaN" if math.isnan(ratio) else f"{ratio:.3f}"


def plot(path: str) -> None:
    """The zoo's heat map (``quality_zoo --table`` draws it)."""
    quality_zoo.plot(common.load(ZOO)["results"], path)
