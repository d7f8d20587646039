"""The summary's kernel section: each CPU kernel beside the reference users would reach for
(``jax.lax.top_k``, ``numpy.argpartition``, zfpy), timed side by side in one process."""

from __future__ import annotations

import math

from summary import common

KERNELS = common.result("kernels_2026-12-05/kernels.json")
FILES = (KERNELS,)

STILL_SHORT = (
    "**Still short:** the GPU's speed targets (docs/gpu.md) have never been measured on a GPU, "
    "and the Hadamard transform has no timing of its own."
)


def rows(data) -> list:
    """jaxcomp's ops measured beside a baseline, in the file's order (the file also times the
    baselines against each other)."""
    return [r for r in data["rows"] if r["baseline"] and r["op"].startswith("jaxcomp.")]


def section() -> str:
    """The Markdown of the section."""
    data = common.load(KERNELS)
    machine = data["machine"]
    lines = [
        "## How fast the kernels are",
        "",
        "Each op on a realistic gradient (a heavy-tailed float32 vector), the best of several "
        "calls after a warm-up, beside its baseline in the same process; *speed-up* is the "
        "baseline's time over the op's. ZFP's error is its RMS error beside zfpy's at the same "
        "rate.",
        "",
        f"Command: `{data['command']}`; {machine['cores']} cores ({machine['processor']}), "
        f"{machine['device']}, jax {machine['jax']}. Results: {common.sources(FILES)}.",
        "",
        "| n | op | setting | ms | baseline | speed-up | note |",
        "|---:|---|---|---:|---|---:|---|",
    ]
    for r in rows(data):
        speedup = "-" if math.isnan(r["speedup"]) else f"{r['speedup']:.1f}x"
        lines.append(
            f"| {r['n']:,} | `{r['op']}` | {r['param']} | {r['seconds'] * 1e3:.1f} "
            f"| `{r['baseline']}` | {speedup} | {r['error'].replace('|', '/')} |"
        )
    lines += ["", "![each op's time beside its baseline](docs/img/kernels.png)", "", STILL_SHORT]
    return "\n".join(lines)


def plot(path: str) -> None:
    """A bar per op and setting: its speed-up over the baseline (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows(common.load(KERNELS)) if not math.isnan(r["speedup"])]
    labels = [
        f"{r['op']} {r['param']}\nvs {r['baseline']} (n = {r['n'] / 1e6:g}M)" for r in measured
    ]
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(measured) + 1))
    ax.barh(range(len(measured)), [r["speedup"] for r in measured], color="tab:blue")
    ax.set_yticks(range(len(measured)), labels, fontsize=7)
    ax.axvline(1, color="grey", linestyle=":")
    ax.set_xscale("log")
    ax.set_xlabel("speed-up over the baseline")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
