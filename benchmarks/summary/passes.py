"""The summary's passes section: each method's local work, its ``compress`` update alone on one
device over a plain copy of the gradient in the same job (``benchmarks/passes.py``).

A cell (method, model) comes from the newest job that measured it, by the commit that added the
job's files (``git log``): the two jobs of 2026-12-06 ran GPT-2's dense, sign, PowerSGD and
codecs (two rounds), and dense and the casts on five models (three rounds, after the casts
stopped building what they sent); the job of 2026-12-02 afternoon ran
every method on three models; the
two A/B jobs of that morning ran GPT-2 for some methods, and only the job of 2026-11-25 ran
many_small and GPT-2's codecs. A job of several rounds gives the fastest round's update, with
its passes over that round's own copy, as the A/B jobs' own tables did. Left out: the "before"
sides of the A/B jobs and their "first_job" (code since replaced), and the older jobs whose every
cell a newer job measured again (passes_before, passes_glibc, passes_tuned, one_device_2026-11-29,
allocator_threads_2026-12-01, passes_powersgd_pieces_2026-11-27).
"""

from __future__ import annotations

import functools
import os
import string
import subprocess

from summary import common

#: The jobs that give a cell, each the files of its rounds.
JOBS = (
    tuple(common.result(f"passes_gpt2_2026-12-06/passes_{r}.json") for r in (1, 2)),
    tuple(common.result(f"passes_casts_2026-12-06/passes_{r}.json") for r in (1, 2, 3)),
    (common.result("passes_2026-12-02/passes.json"),),
    tuple(common.result(f"sign_pack_passes_2026-12-02/passes_after_{r}.json") for r in (1, 2)),
    tuple(common.result(f"topk_candidates_2026-12-02/passes_after_{r}.json") for r in (1, 2)),
    (common.result("passes.json"),),
)
FILES = tuple(path for job in JOBS for path in job)
MODELS = ("mlp4096", "mlp2041", "resnet50", "gpt2", "many_small")

STILL_SHORT_WHY = (
    "what is left is mostly the flat vector, which the packing writes and the residual's cut "
    "copies out again (selecting straight from the leaves and keeping the residual in place are "
    "not started), sign's decoded `sent`, written by the unpack and read by the residual's cut "
    "and the update."
)


@functools.cache
def _committed(path: str) -> int:
    """The Unix time of the last commit that touched ``path`` (uncommitted: the newest)."""
    out = subprocess.run(
        ["git", "log", "-1", "--format=%ct", "--", path],
        cwd=common.ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return int(out) if out else 2**62


def newest_first(jobs=JOBS) -> list:
    """``jobs`` ordered by the commit that added them, the newest first."""
    return sorted(jobs, key=lambda job: max(map(_committed, job)), reverse=True)


def cells(jobs=JOBS) -> dict:
    """``{(method, model): (row, job)}``: each cell's row from the newest job that has it, the
    fastest round's where the job has several."""
    out = {}
    for job in newest_first(jobs):
        best = {}
        for path in job:
            for row in common.load(path):
                key = (row["method"], row["model"])
                if key not in best or row["seconds"] < best[key]["seconds"]:
                    best[key] = row
        for key, row in best.items():
            out.setdefault(key, (row, job))
    return out


def methods(table) -> list:
    """The methods in the order of the newest job's rows, then any others."""
    order = []
    for job in newest_first():
        for row in common.load(job[0]):
            if row["method"] not in order:
                order.append(row["method"])
    return [m for m in order if any((m, model) in table for model in MODELS)]


def _target(method, table) -> str:
    target = next(row["target"] for (m, _), (row, _) in table.items() if m == method)
    return f"{target} beside its matmuls" if method.startswith("powersgd") else str(target)


def _cell(entry, marks) -> str:
    if entry is None:
        return "-"
    row, job = entry
    mark = f" ({marks[job]})" if job in marks else ""
    return f"{row['passes']:.1f} ({row['seconds'] * 1e3:.0f} ms){mark}"


def _how(job) -> str:
    """``", the tuned allocator, the faster of 2 rounds"``: what a job's files say of it."""
    allocators = sorted({r.get("allocator", "glibc") for path in job for r in common.load(path)})
    named = ["the tuned allocator" if a == "tuned" else f"{a}'s allocator" for a in allocators]
    best = "faster" if len(job) == 2 else "fastest"
    rounds = [f"the {best} of {len(job)} rounds"] if len(job) > 1 else []
    return ", " + ", ".join(named + rounds)


def _marks() -> dict:
    """``{job: letter}`` of the jobs older than the newest, newest first."""
    return dict(zip(newest_first()[1:], string.ascii_lowercase))


def results_line() -> str:
    """Which job gives the unmarked cells and which each letter."""
    marks = _marks()
    described = [
        (f"({marks[job]}) " if job in marks else "") + common.sources(job) + _how(job)
        for job in newest_first()
    ]
    return (
        "Results, each cell from the newest job that has it (a letter: an older job's): "
        + "; ".join(described)
        + "."
    )


def table_lines() -> list:
    """The table's Markdown lines: a row per method, a column per model, and the targets."""
    table, marks = cells(), _marks()
    models = [m for m in MODELS if any(model == m for _, model in table)]
    lines = [
        "| method | " + " | ".join(models) + " | target |",
        "|---|" + "---:|" * len(models) + "---:|",
    ]
    for method in methods(table):
        shown = [_cell(table.get((method, model)), marks) for model in models]
        lines.append(f"| `{method}` | " + " | ".join(shown) + f" | {_target(method, table)} |")
    return lines


def over_target() -> list:
    """The methods with a cell over their target."""
    table = cells()
    return [
        m
        for m in methods(table)
        if any(row["passes"] > row["target"] for (name, _), (row, _) in table.items() if name == m)
    ]


def section() -> str:
    """The Markdown of the section."""
    over = ", ".join(f"`{m}`" for m in over_target())
    return "\n".join(
        [
            "## What local work each method adds",
            "",
            "Each method's `compress` update alone on one CPU device (its collectives move "
            "nothing there), at `benchmarks/passes.py`'s settings, on random gradients of a zoo "
            "model's shapes, over a plain copy of those gradients timed in the same job: its "
            "local work in *passes* over the gradient, the update's time in brackets. ZFP and "
            "THC (`quantized`) skip their codec on one device, so their rows understate what "
            "they cost on several.",
            "",
            "Command: `python benchmarks/passes.py --models MODELS --repeats R --allocator tuned "
            "--json FILE`, one job at a time (the oldest job predates `--allocator` and ran "
            "glibc's); one CPU device of the development machine, 2 cores. " + results_line(),
            "",
            *table_lines(),
            "",
            "![passes over the gradient, every method and model](docs/img/passes.png)",
            "",
            f"**Still short:** {over} take more passes than their targets somewhere; "
            + STILL_SHORT_WHY,
        ]
    )


def plot(path: str) -> None:
    """Grouped bars: a group per method, a bar per model (hatched where the cell comes from an
    older job than the newest), and each method's target as a dashed line over its group."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    table = cells()
    newest = newest_first()[0]
    names = methods(table)
    models = [m for m in MODELS if any(model == m for _, model in table)]
    width = 0.8 / len(models)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for j, model in enumerate(models):
        xs, ys, hatches = [], [], []
        for i, method in enumerate(names):
            entry = table.get((method, model))
            if entry is not None:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(entry[0]["passes"])
                hatches.append("" if entry[1] == newest else "///")
        bars = ax.bar(xs, ys, width, color=f"C{j}")
        for bar, hatch in zip(bars, hatches):
            bar.set_hatch(hatch)
    for i, method in enumerate(names):
        target = next(row["target"] for (m, _), (row, _) in table.items() if m == method)
        ax.hlines(target, i - 0.45, i + 0.45, colors="black", linestyles="dashed")
    handles = [Patch(color=f"C{j}", label=model) for j, model in enumerate(models)]
    handles += [
        Line2D([], [], color="black", linestyle="dashed", label="target"),
        Patch(facecolor="white", edgecolor="black", hatch="///", label="from an older job"),
    ]
    ax.legend(handles=handles, fontsize=8, ncol=2)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("passes (the update's time over a copy's)")
    ax.set_title("Each method's local work on one CPU device, in passes over the gradient")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)
