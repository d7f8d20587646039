"""The figure of ``jaxcomp demo``: one column of panels per family of methods, eval loss above
eval accuracy, the dense reference in every panel, distinct colours and line styles within a
panel, and each legend below its column, where it covers no curve."""

from __future__ import annotations

import numpy as np

from jaxcomp.cli import _report


def figure(results, families, reference, verdict, within_points):
    """The eval curves of the demo's runs as a matplotlib figure.

    Args:
      results: the runs' results (``name``, ``family``, ``eval_curve``, ``accuracy_curve``,
        ``eval_accuracy``), as ``jaxcomp.cli.demo.train`` returns them.
      families: the families' order, one column each (those present in ``results``; others
        after them, sorted).
      reference: the name of the run drawn in every panel (dense), black.
      verdict: the verdict of each run by name; "diverged" is written in its legend entry.
      within_points: the width, in accuracy points below the reference, of the green band.

    Returns:
      The figure: two rows of axes (eval loss on a log scale, eval accuracy in %), one column
      per family.
    """
    present = [f for f in families if any(r["family"] == f for r in results)]
    present += sorted({r["family"] for r in results} - set(present) - {""})
    present = present or [""]  # the reference alone
    fig, axes = _report.pyplot().subplots(
        2,
        len(present),
        figsize=(4.4 * len(present), 8.2),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    dense = next((r for r in results if r["name"] == reference), None)
    for column, family in enumerate(present):
        members = [r for r in results if r["family"] == family and r is not dense]
        _draw_family(
            axes[0, column], axes[1, column], family, dense, members, verdict, within_points
        )
    fig.suptitle(
        "jaxcomp demo: digits MLP on 8 data-parallel CPU devices. Eval loss (top) and accuracy "
        f"(bottom) per family; {reference}, black, in every panel"
    )
    return fig


def _draw_family(ax_loss, ax_accuracy, family, dense, members, verdict, within_points):
    """One column of :func:`figure`: the family's runs, and dense, on both axes; a run that
    leaves the scale says so in the legend."""
    lines = ([dense] if dense else []) + members
    styles = _report.distinct_styles(len(members))
    if dense:
        styles.insert(0, {"color": "black", "linewidth": 2.6, "alpha": 0.55, "zorder": 3})
    bottom = _accuracy_floor(dense, lines)
    for r, style in zip(lines, styles):
        label = f"{r['name']}: {100 * r['eval_accuracy']:.2f}%"
        if verdict[r["name"]] == "diverged":
            label += " (diverged)"
        elif 100 * r["eval_accuracy"] < bottom:
            label += " (below the scale)"
        style = {"markersize": 4, "markevery": 2, "linewidth": 1.6, **style}
        steps, losses = zip(*r["eval_curve"])
        ax_loss.plot(steps, losses, label=label, **style)
        steps, accuracies = zip(*r["accuracy_curve"])
        ax_accuracy.plot(steps, 100 * np.asarray(accuracies), **style)
    start = max(r["eval_curve"][0][1] for r in lines)
    title = family or lines[0]["name"]  # the reference alone
    ax_loss.set(yscale="log", title=f"{title}\neval loss", ylabel="eval loss")
    ax_loss.set_ylim(top=1.3 * start)  # a run that blows up leaves through the top
    _report.log_ticks_1_2_5(ax_loss.yaxis)
    ax_accuracy.set_ylim(bottom, 100.5)
    if dense:
        best = 100 * dense["eval_accuracy"]
        ax_accuracy.axhspan(best - within_points, best, color="tab:green", alpha=0.15, lw=0)
    ax_accuracy.set(xlabel="step", ylabel="eval accuracy (%)", title="eval accuracy")
    for ax in (ax_loss, ax_accuracy):
        ax.grid(alpha=0.3)
    ax_accuracy.legend(
        *ax_loss.get_legend_handles_labels(),
        loc="upper center",
        bbox_to_anchor=(0.5, -0.16),
        fontsize=9,
        frameon=False,
        title="final eval accuracy"
        + (f"; green: within {within_points:g} pt of {dense['name']}" if dense else ""),
        title_fontsize=8,
    )


def _accuracy_floor(dense, lines) -> float:
    """The bottom of an accuracy panel (%): 2 points below its lowest final accuracy, but at most
    10 below dense's, so that the 1-point band stays readable."""
    lowest = min(100 * r["eval_accuracy"] for r in lines)
    if not dense:
        return max(0.0, lowest - 2)
    best = 100 * dense["eval_accuracy"]
    return max(0.0, best - 10, min(lowest - 2, best - 3))
