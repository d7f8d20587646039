"""The verdict of ``jaxcomp demo``: one record per run against dense, the table in Markdown and
CSV, and the eval curves' figure.

A row is "yes" when its final eval accuracy is at most :data:`WITHIN_POINTS` below dense's,
"no" otherwise, and "diverged" when an eval loss was non-finite or above :data:`EXPLODED` times
the loss at step 0 (chance level, ln 10, for the demo's model). The test set has 359 images: 1
point is 3.6 images, about what another ``--seed`` moves.
"""

from __future__ import annotations

import math
import os

from jaxcomp.cli import _report
from jaxcomp.cli._demo_runs import DENSE, FAMILIES

#: A row is "within" when its final eval accuracy is at most this many points below dense's.
WITHIN_POINTS = 1.0
#: A row has diverged when an eval loss is above this multiple of the loss at step 0 (or is not
#: finite).
EXPLODED = 2.0


def diverged(result) -> bool:
    """Whether a run diverged: an eval loss not finite or above :data:`EXPLODED` times the loss of
    the initial params (step 0 of its eval curve)."""
    losses = [loss for _, loss in result["eval_curve"]] + [result["eval_loss"]]
    start = result["eval_curve"][0][1]
    return not all(math.isfinite(loss) for loss in losses) or max(losses) > EXPLODED * start


def verdicts(results) -> list[dict]:
    """One record per run, the numbers of the verdict table: ``run``, ``ran``, ``density``,
    ``accuracy`` and ``accuracy_vs_dense`` (points), ``eval_loss``, ``bytes``,
    ``bytes_vs_dense``, ``step_ms``, ``within`` ("yes", "no", "diverged", or "-" without a dense
    run) and ``note``."""
    dense = next((r for r in results if r["name"] == DENSE), None)
    records = []
    for r in results:
        gap = 100 * (r["eval_accuracy"] - dense["eval_accuracy"]) if dense else float("nan")
        if diverged(r):
            within = "diverged"
        elif dense is None:
            within = "-"
        else:  # accuracies are counts over the same test set: the tolerance absorbs rounding
            within = "yes" if gap >= -WITHIN_POINTS - 1e-6 else "no"
        records.append(
            {
                "run": r["name"],
                "ran": r["method"],
                "density": r["density"],
                "accuracy": 100 * r["eval_accuracy"],
                "accuracy_vs_dense": gap,
                "eval_loss": r["eval_loss"],
                "bytes": r["bytes_sent"],
                "bytes_vs_dense": r["bytes_sent"] / dense["bytes_sent"]
                if dense and dense["bytes_sent"]
                else float("nan"),
                "step_ms": 1e3 * r["step_time"],
                "within": within,
                "note": r.get("note", ""),
            }
        )
    return records


#: The verdict table's columns (Markdown), one per field of a :func:`verdicts` record.
TABLE_HEADER = (
    "run",
    "ran (density)",
    "eval accuracy",
    "vs dense (pt)",
    "eval loss",
    "bytes / step / device",
    "vs dense",
    "step time",
    "within 1 pt of dense?",
    "setting / trade-off",
)


def format_table(results) -> str:
    """The verdict table in Markdown: accuracy and its gap to dense, eval loss, bytes and their
    ratio to dense, step time, the verdict and the row's documented setting or trade-off."""
    rows = []
    for v in verdicts(results):
        rows.append(
            [
                v["run"],
                f"{v['ran']} ({v['density']:.3g})",
                f"{v['accuracy']:.2f}%",
                "-" if math.isnan(v["accuracy_vs_dense"]) else f"{v['accuracy_vs_dense']:+.2f}",
                f"{v['eval_loss']:.4g}",
                f"{v['bytes']:,.0f}",
                "-" if math.isnan(v["bytes_vs_dense"]) else f"{v['bytes_vs_dense']:.4f}",
                f"{v['step_ms']:.2f} ms",
                v["within"],
                v["note"],
            ]
        )
    return _report.format_table(TABLE_HEADER, rows, align="llrrrrrrll")


def save_tables(results, folder) -> list[str]:
    """Writes the verdict table to ``folder`` as ``verdict.md`` and ``verdict.csv`` (the CSV with
    the unformatted numbers of :func:`verdicts`); returns the two paths."""
    records = verdicts(results)
    md, csv = os.path.join(folder, "verdict.md"), os.path.join(folder, "verdict.csv")
    with open(md, "w") as f:
        f.write(format_table(results) + "\n")
    _report.write_csv(csv, list(records[0]), [list(v.values()) for v in records])
    return [md, csv]


def figure(results):
    """The eval curves as a matplotlib figure: one column per family (:data:`FAMILIES` present in
    ``results``), eval loss above eval accuracy, dense in every panel, each legend below its
    column; returns it."""
    from jaxcomp.cli import _demo_plot

    verdict = {v["run"]: v["within"] for v in verdicts(results)}
    return _demo_plot.figure(results, FAMILIES, DENSE, verdict, WITHIN_POINTS)


def plot(results, path):
    """Saves :func:`figure` of ``results`` to ``path`` (PNG)."""
    _report.save_figure(figure(results), path, dpi=110)
