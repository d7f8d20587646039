"""The tables of README.md, written from the committed result files, never by hand.

    python benchmarks/report.py           # rewrites the generated blocks of README.md
    python benchmarks/report.py --check   # exits 1, saying which block differs, if one is stale

A generated block sits between ``<!-- report: NAME -->`` and ``<!-- /report: NAME -->``; the
text around it is the author's. Each table says where its numbers come from: the command, the
result files, their commits and dates (``git log``), and the machine. As a table names the
commit of each file it reads, commit new result files first, then run this script and commit
what it writes.

The decision table has one row per method at its recommended pairing (and the ones that are not
recommended, so that their cost shows):

* bytes a step against dense, and the held-out loss against dense, from the quality zoo
  (``benchmarks/quality_zoo.py``: five tasks, dense Adam's tuned learning rate, a constant
  rate, 1500 steps);
* the step against a plain ``pmean`` on 4 emulated hosts at 1 Gbit and 100 Mbit
  (``benchmarks/peers.py`` and ``jaxcomp netbench``), the median and the worst over the model
  zoo's models measured: the speed section's cells (``summary.speed.cells``: each (model, rate,
  method) from the newest file that has it, as that job's own ``pmean``'s step over the
  method's, a ratio within one job);
* the time to dense's final held-out loss against data-parallel dense, where a run measured it
  (``benchmarks/time_to_quality.py``).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.join(ROOT, "benchmarks") not in sys.path:  # the summary package, the scripts
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import quality_zoo  # noqa: E402
from summary import common, speed, to_loss  # noqa: E402

RESULTS = os.path.join("benchmarks", "results")

#: The quality zoo's results (every pairing, task, learning rate and schedule).
ZOO_FILE = os.path.join(RESULTS, "quality_zoo_2026-12-05", "zoo.json")
#: The zoo's tasks whose dense runs agree across seeds within 3% (the others move more).
QUIET_TASKS = ("transformer", "mlp-charlm", "prose-conv")

#: Step times on 4 emulated hosts: the speed section's cells (``summary.speed.cells``: per
#: model, rate and method the newest file's), summarized over its models.
RATES = ("1gbit", "100mbit")

#: Time to data-parallel's final loss on 4 emulated hosts: file -> {row name: table row}.
TO_LOSS_FILES = {
    "time_to_quality_cluster_onebit_100mbit.json": {"adam-sign": "adam:sign"},
    "time_to_quality_cluster.json": {"ar_topk": "chain:ar_topk(0.01)"},
    "time_to_quality_cluster_small_4500_1gbit.json": {"diloco-h50-avg-int8": "diloco"},
    "time_to_quality_cluster_small_4500_100mbit.json": {"diloco-h50-avg-int8": "diloco"},
}
#: What differs in a time-to-loss run from today's defaults.
TO_LOSS_NOTES = {
    "time_to_quality_cluster_onebit_100mbit.json": "warm-up 25, a refresh every 100, no floor",
    "time_to_quality_cluster.json": "AR-Topk's STAR leader",
}
#: DiLoCo's bytes and loss against data-parallel's: its own 4500-step run (the zoo has none).
DILOCO_FILE = "time_to_quality_cluster_small_4500_100mbit.json"


class Row:
    """A row of the decision table: what users write, where its numbers are, when to use it."""

    def __init__(self, label, pairing, method, recommended, use_when):
        self.label, self.pairing, self.method = label, pairing, method
        self.recommended, self.use_when = recommended, use_when


ROWS = (
    Row("`jaxcomp.adam(lr, \"sign\")`", "adam:sign", "sign", True,
        "Adam on any link: the fewest bytes that hold"),
    Row("`jaxcomp.adam(lr, jaxcomp.Zfp(8))`", "adam:zfp(8)", "zfp", True,
        "Adam on a slow link, if signs cost your model quality"),
    Row("`jaxcomp.adam(lr, jaxcomp.Quantized(4))`", "adam:quantized(4)", "quantized", True,
        "as ZFP 8"),
    Row("`chain(compress(jaxcomp.Zfp(8)), tx)`", "chain:zfp(8)", "zfp", True,
        "an optimizer other than Adam, on a slow link"),
    Row("`chain(compress(\"bf16\"), tx)`", "chain:cast(bfloat16)", "bf16", True,
        "any optimizer, any link: half the bytes"),
    Row("`chain(compress(\"ar_topk\", ratio=0.01), adam)`", "chain:ar_topk(0.01)", "ar_topk",
        False, "not recommended: it loses quality"),
    Row("`jaxcomp.adam(lr, \"powersgd\", rank=4)`", "adam:powersgd(4)", "powersgd", False,
        "not recommended: it loses quality"),
    Row("`jaxcomp.diloco(...)`, H = 50, int8", None, None, True,
        "slow links, if you can sync every 50 steps"),
    Row("`compress(\"dense\")`, `optax.adam`", "dense", "dense", True,
        "the baseline"),
)  # fmt: skip


def zoo_cells(path=ZOO_FILE):
    """``{pairing: {"loss": {task: ratio}, "bytes": ratio}}`` at dense's tuned rate, constant,
    1500 steps; each ratio over dense's run of the same task (bytes: the median over tasks)."""
    runs = [
        r
        for r in common.load(path)["results"]
        if r["lr_scale"] == 1.0 and r["schedule"] == "constant" and r["steps"] == 1500
    ]
    dense = {r["task"]: r for r in runs if r["pairing"] == "dense"}
    cells = {}
    for r in runs:
        base = dense.get(r["task"])
        if base is None:
            continue
        cell = cells.setdefault(r["pairing"], {"loss": {}, "bytes": []})
        cell["loss"][r["task"]] = _over(r["heldout_loss"], base["heldout_loss"])
        cell["bytes"].append(r["mean_bytes_per_step"] / base["mean_bytes_per_step"])
    for cell in cells.values():
        cell["bytes"] = statistics.median(cell["bytes"])
    return cells


def _over(value, base):
    finite = math.isfinite(value) and math.isfinite(base) and base > 0
    return value / base if finite else math.nan


def speed_cells():
    """``{(rate, method): {model: (ratio, file, against)}}``: the speed section's cells."""
    return speed.cells()


def to_loss_cells(files=TO_LOSS_FILES, root=RESULTS):
    """``{(rate, table row): ratio}``: data-parallel dense's seconds to its own final held-out
    loss over the row's (None where the row never reached it), as the time-to-loss section
    reads them (``summary.to_loss.rows``)."""
    cells = {}
    for name, rows in files.items():
        for rate, row, sooner, _, _ in to_loss.rows(common.load(os.path.join(root, name))):
            if row in rows:
                cells[(rate, rows[row])] = sooner
    return cells


def diloco_cell(name=DILOCO_FILE, root=RESULTS):
    """DiLoCo's zoo-like cell from its own run: ``{"loss": {task: final loss over dp's},
    "bytes": bytes a step over dp's}``."""
    _, curves = common.load(os.path.join(root, name))["panels"][0]
    dp = next(c["curve"] for c in curves if c["name"] == "dp")
    row = next(c["curve"] for c in curves if c["name"] == "diloco-h50-avg-int8")
    per_step = [c[-1]["bytes"] / c[-1]["step"] for c in (row, dp)]
    return {
        "loss": {"small char-LM": row[-1]["loss"] / dp[-1]["loss"]},
        "bytes": per_step[0] / per_step[1],
    }


def _summary(cell):
    """``"median / worst"`` of a speed cell over its models (with how many were measured)."""
    if not cell:
        return "-"
    values = [v for v, *_ in cell.values()]
    worst = min(values)
    text = f"{statistics.median(values):.2f}x / {worst:.2f}x"
    return text if len(values) > 1 else f"{values[0]:.2f}x (1 model)"


def _loss(cell):
    quiet = [cell["loss"][t] for t in QUIET_TASKS + ("small char-LM",) if t in cell["loss"]]
    every = list(cell["loss"].values())
    if not quiet or any(math.isnan(v) for v in every):
        return "NaN" if any(math.isnan(v) for v in every) else "-"
    return f"{max(quiet):.3f} ({max(every):.2f})"


def decision_rows(zoo, steps, sooner):
    """The decision table's Markdown rows (without the header)."""
    lines = []
    for row in ROWS:
        cell = zoo.get(row.pairing) if row.pairing else diloco_cell()
        loss = _loss(cell) if cell else "-"
        sent = f"{cell['bytes']:.3f}" if cell else "-"
        step = [_summary(steps.get((rate, row.method))) for rate in RATES]
        key = row.pairing or "diloco"
        soon = [sooner.get((rate, key), "-") for rate in RATES]
        soon = ["never" if v is None else v if isinstance(v, str) else f"{v:.1f}x" for v in soon]
        name = row.label if row.recommended else f"({row.label})"
        lines.append(
            f"| {name} | {sent} | {loss} | {step[0]} | {step[1]} | {soon[0]} | {soon[1]} "
            f"| {row.use_when} |"
        )
    return lines


def decision_table():
    """The README's decision table with the sources of its numbers."""
    zoo, steps, sooner = zoo_cells(), speed_cells(), to_loss_cells()
    spread = quality_zoo.noise(common.load(ZOO_FILE)["results"], 1500)
    noisy = ", ".join(f"{v:.0%} on {t}" for t, v in sorted(spread.items()) if v > 0.03)
    header = [
        "| pairing | bytes vs dense | held-out loss vs dense | step vs `pmean`, 1 Gbit "
        "(median / worst model) | 100 Mbit | sooner to dense's loss, 1 Gbit | 100 Mbit "
        "| use it when |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    used = {
        f for r in ROWS for rate in RATES for _, f, _ in steps.get((rate, r.method), {}).values()
    }
    dates = sorted(common.stamp(f).split()[-1] for f in used)
    notes = [
        "",
        "- **bytes, loss**: the quality zoo (`benchmarks/quality_zoo.py`; "
        f"`{ZOO_FILE}`, {common.stamp(ZOO_FILE)}): 8 CPU devices, dense Adam's tuned rate, "
        "constant, 1500 steps. Loss: the worst of the three tasks whose dense runs agree across "
        "seeds within 3% (two char-LMs, prose), and in brackets the worst of all five (two "
        f"dense seeds differ by {noisy} after 1500 steps). Bytes: the median over the tasks, "
        "warm-up and refresh steps included.",
        "- **step**: 4 emulated hosts (network namespaces, `tbf` at the rate, sharing 2 cores) on "
        f"the development machine; the median / the worst over {', '.join(speed.MODELS)} where "
        f"measured, each the same job's `pmean` step over the method's, from {len(used)} result "
        f"files of `benchmarks/peers.py` and `jaxcomp netbench` dated {dates[0]} to {dates[-1]} "
        "(BENCHMARKS.md's speed section lists them). The `jaxcomp.adam` rows show the method's "
        "step through the chain: no cluster run has timed `jaxcomp.adam` itself.",
        "- **DiLoCo**: 4 workers, 8-bit pseudo-gradients every 50 steps, its own 4500-step run "
        f"of a small char-LM (`{DILOCO_FILE}`): bytes and final loss against data-parallel's.",
        "- **sooner**: the time to data-parallel dense's final held-out loss, over dense's "
        "(`benchmarks/time_to_quality.py`, 4 emulated hosts; "
        + ", ".join(
            f"`{f}` {common.stamp(os.path.join(RESULTS, f))}"
            + (f" ({TO_LOSS_NOTES[f]})" if f in TO_LOSS_NOTES else "")
            for f in TO_LOSS_FILES
        )
        + "); `-`: not measured.",
    ]
    return "\n".join(header + decision_rows(zoo, steps, sooner) + notes)


def _sections():
    """BENCHMARKS.md's sections, in order: block name -> the module's ``section``."""
    from summary import gpu, kernels, passes, quality, speed, to_loss

    return {
        "kernels": kernels.section,
        "passes": passes.section,
        "speed": speed.section,
        "quality": quality.section,
        "to_loss": to_loss.section,
        "gpu": gpu.section,
    }


#: Generated blocks: file -> {block name: function returning its Markdown}.
BLOCKS = {"README.md": {"decision": decision_table}, "BENCHMARKS.md": _sections()}


def read_files() -> set:
    """Every result file a table reads (paths relative to the root): what
    ``benchmarks/results/`` keeps."""
    from summary import gpu, kernels, passes, quality, speed, to_loss

    used = {ZOO_FILE}
    used |= {os.path.join(RESULTS, f) for f in (*TO_LOSS_FILES, DILOCO_FILE)}
    for module in (gpu, kernels, passes, quality, speed, to_loss):
        used |= set(module.FILES)
    return used


def rendered(text, blocks):
    """``text`` with each of ``blocks``' markers' contents replaced; raises naming a missing one."""
    for name, make in blocks.items():
        pattern = re.compile(
            rf"(<!-- report: {name} -->\n).*?(<!-- /report: {name} -->)", flags=re.S
        )
        if not pattern.search(text):
            raise ValueError(f"no <!-- report: {name} --> ... <!-- /report: {name} --> block")
        text = pattern.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def stale():
    """``[(file, new text)]`` of the files whose generated blocks differ from what they hold."""
    out = []
    for name, blocks in BLOCKS.items():
        with open(os.path.join(ROOT, name)) as f:
            text = f.read()
        new = rendered(text, blocks)
        if new != text:
            out.append((name, new))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a block is stale")
    args = parser.parse_args(argv)
    changed = stale()
    if args.check:
        for name, _ in changed:
            print(f"{name}: stale; run python benchmarks/report.py", file=sys.stderr)
        return 1 if changed else 0
    for name, text in changed:
        with open(os.path.join(ROOT, name), "w") as f:
            f.write(text)
        print(f"wrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
