"""The summary's kernels section: how fast jaxcomp's CPU kernels are, read from the newest
committed jobs that timed them, each beside the code it replaced or a plain copy, in one process.

No committed result file holds ``benchmarks/kernels.py``'s own output (its tables, beside
``jax.lax.top_k`` and zfpy, were pasted into the measurement log by hand), so the rows come from
the three later jobs that did commit what they printed, one kernel family each; no two of them
timed the same kernel, so there is no older cell to drop:

* top-k, threshold top-k and SPLIT's merge (``topk_candidates_2026-12-02/kernels.out``): this
  tree's kernels and those of the commit the file names, alternating, two rounds; a row is the
  best of each side's rounds, as the log compared them;
* ``sign_pack`` (``sign_pack_bench.out`` there, a C++ harness built against the old and the new
  ``kernels/sign.h``, alternating, two rounds): the best of each side's rounds;
* ZFP's encode and decode (``zfp_ring_cpu_2026-12-02``: ``kern.py`` printed them, its README
  holds the figures), beside a plain copy of the same chunk.
"""

from __future__ import annotations

import json
import os
import re
from typing import NamedTuple

from summary import common

TOPK = common.result("topk_candidates_2026-12-02/kernels.out")
SIGN = common.result("topk_candidates_2026-12-02/sign_pack_bench.out")
#: The harness's source: the vector's length is a constant there.
SIGN_SOURCE = common.result("topk_candidates_2026-12-02/sign_pack_bench.cc")
#: The commit whose ``kernels/sign.h`` the harness's "old" lines ran (the log's "sign_pack in
#: the update" names it; the output file does not).
SIGN_BEFORE = "07df35f"
ZFP = common.result("zfp_ring_cpu_2026-12-02/README.md")
#: The script that printed ZFP's figures: the chunk's length and the rate are constants there.
ZFP_SOURCE = common.result("zfp_ring_cpu_2026-12-02/kern.py")
FILES = (TOPK, SIGN, SIGN_SOURCE, ZFP, ZFP_SOURCE)

STILL_SHORT = (
    "**Still short:** no committed result file holds `benchmarks/kernels.py`'s comparison with "
    "`jax.lax.top_k` and zfpy (the log in docs/notes has its last tables, older than these "
    "kernels), and none times the Hadamard transform; the GPU's speed targets (docs/gpu.md) "
    "have never been measured on a GPU; ZFP's chunk codings are all of its step's CPU over "
    "dense's, and most of `sign_pack`'s time is now its chunks' halving-tree scales."
)


class Row(NamedTuple):
    """A kernel at one size: its best time, the code it replaced and that code's best time (in
    the same job), and a plain copy of the same vector's time in the same job (None: not timed)."""

    kernel: str
    n: int
    ms: float
    replaced: str | None
    replaced_ms: float | None
    copy_ms: float | None


def _text(path: str) -> str:
    with open(os.path.join(common.ROOT, path)) as f:
        return f.read()


def _percent(part: int, whole: int) -> str:
    return f"{round(100 * part / whole, 4):g}%"


def topk_rows(text: str) -> list:
    """The rows of ``kernels.out``: ``== before (COMMIT), round R`` and ``== after, round R``
    headers, each followed by one JSON line per kernel (``op``, ``n``, ``k``, ``ms``)."""
    best, side, commit = {}, None, "?"
    for line in text.splitlines():
        header = re.match(r"== (before|after)(?: \((\w+)\))?", line)
        if header:
            side = header.group(1)
            commit = header.group(2) or commit
        elif line.startswith("{"):
            row = json.loads(line)
            key = (side, row["op"], row["n"], row["k"])
            best[key] = min(best.get(key, float("inf")), row["ms"])
    copies = {n: ms for (side, op, n, _), ms in best.items() if side == "after" and op == "copy"}
    rows = []
    for (side, op, n, k), ms in best.items():
        if side != "after" or op == "copy":
            continue
        runs = re.match(r"merge of (\d+) runs", op)
        if runs:
            count = int(runs.group(1))
            kernel = f"SPLIT's merge of {count} runs, k = {_percent(count * k, n)}"
            replaced = f"XLA's sort ({commit})"
        else:
            kernel, replaced = f"`{op}`, k = {_percent(k, n)}", f"the kernel of {commit}"
        rows.append(Row(kernel, n, ms, replaced, best.get(("before", op, n, k)), copies.get(n)))
    return rows


def sign_rows(text: str, source: str) -> list:
    """The rows of ``sign_pack_bench.out``: ``old|new: one thread X ms, two Y ms`` lines."""
    n = int(re.search(r"const int64_t n = (\d+)", source).group(1))
    best = {}
    for side, one, two in re.findall(r"(old|new): one thread ([\d.]+) ms, two ([\d.]+) ms", text):
        for threads, ms in (("one thread", one), ("two threads", two)):
            best[(side, threads)] = min(best.get((side, threads), float("inf")), float(ms))
    return [
        Row(
            f"`sign_pack`, {threads}",
            n,
            best[("new", threads)],
            f"the kernel of {SIGN_BEFORE}",
            best[("old", threads)],
            None,
        )
        for threads in ("one thread", "two threads")
    ]


def zfp_rows(readme: str, source: str) -> list:
    """The rows of the ZFP job: ``kern.py: encode W ms wall / C ms CPU; decode W / C; ...; a
    plain copy of the chunk W / C`` in its README (wall times), the length and rate from
    ``kern.py``."""
    n = int(re.search(r"^N = ([\d_]+)$", source, flags=re.M).group(1))
    rate = int(re.search(r"zfp_encode\(v, (\d+)\)", source).group(1))
    text = " ".join(readme.split())
    found = re.search(
        r"kern\.py: encode ([\d.]+) ms wall / [\d.]+ ms CPU; decode ([\d.]+) / [\d.]+;"
        r".*?a plain copy of the chunk ([\d.]+) /",
        text,
    )
    encode, decode, copy = (float(v) for v in found.groups())
    return [
        Row(f"`zfp_encode`, rate {rate}", n, encode, None, None, copy),
        Row(f"`zfp_decode`, rate {rate}", n, decode, None, None, copy),
    ]


def rows() -> list:
    """Every row of the table, top-k's first."""
    return (
        topk_rows(_text(TOPK))
        + sign_rows(_text(SIGN), _text(SIGN_SOURCE))
        + zfp_rows(_text(ZFP), _text(ZFP_SOURCE))
    )


def _line(row: Row) -> str:
    replaced = row.replaced_ms is not None
    cells = [
        row.kernel,
        f"{row.n / 1e6:.1f}M",
        f"{row.ms:.1f}",
        row.replaced if replaced else "-",
        f"{row.replaced_ms:.1f}" if replaced else "-",
        f"{row.replaced_ms / row.ms:.2f}x" if replaced else "-",
        f"{row.ms / row.copy_ms:.1f}" if row.copy_ms else "-",
    ]
    return "| " + " | ".join(cells) + " |"


def section() -> str:
    """The Markdown of the section."""
    return "\n".join(
        [
            "## How fast the kernels are",
            "",
            "Each CPU kernel timed alone on float32 values, the best of several calls, beside the "
            "code it replaced in the same job (alternating, two rounds, the best of each side: "
            "*speed-up* is the old time over the new). *Copies*: the kernel's time over a plain "
            "copy (`x * 2`) of the same vector in the same job. ZFP's vector is one device's "
            "ring chunk of mlp4096.",
            "",
            "Command: `bash benchmarks/results/topk_candidates_2026-12-02/kernels.sh OLD_TREE "
            "OLD_PYTHON` (it runs `kernels_bench.py` there), `sign_pack_bench.cc` in the same "
            "folder (`g++ -O3 -pthread`), and "
            "`python benchmarks/results/zfp_ring_cpu_2026-12-02/kern.py`; "
            "the development machine, 2 cores, the tuned allocator. Results: "
            f"{common.sources(FILES)}.",
            "",
            "| kernel | n | ms | the code it replaced | its ms | speed-up | copies |",
            "|---|---:|---:|---|---:|---:|---:|",
            *(_line(row) for row in rows()),
            "",
            "![each kernel's time beside the code it replaced and a copy](docs/img/kernels.png)",
            "",
            STILL_SHORT,
        ]
    )


def plot(path: str) -> None:
    """One line a kernel, log scale: a grey dot at the code it replaced, an arrow to a blue dot at
    its time now, and a black tick at a plain copy of the same vector where the job timed one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    table = rows()
    ys = list(range(len(table)))
    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.36 * len(table)))
    for y, r in zip(ys, table):
        if r.replaced_ms is not None:
            ax.annotate(
                "",
                xy=(r.ms, y),
                xytext=(r.replaced_ms, y),
                arrowprops={"arrowstyle": "->", "color": "grey", "shrinkB": 5},
            )
    old = [(y, r.replaced_ms) for y, r in zip(ys, table) if r.replaced_ms is not None]
    copies = [(y, r.copy_ms) for y, r in zip(ys, table) if r.copy_ms]
    ax.scatter(
        [ms for _, ms in old], [y for y, _ in old], color="darkgrey", label="the code it replaced"
    )
    ax.scatter([r.ms for r in table], ys, color="tab:blue", label="now", zorder=3)
    ax.scatter(
        [ms for _, ms in copies],
        [y for y, _ in copies],
        marker="|",
        s=200,
        color="black",
        label="a plain copy of the same vector",
    )
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    labels = [f"{r.kernel.replace('`', '')}, n = {r.n / 1e6:.1f}M" for r in table]
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set_ylim(len(table) - 0.5, -0.5)
    ax.set_xlabel("ms, the best of several calls (log scale)")
    ax.set_title("jaxcomp's CPU kernels, each beside the code it replaced")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, frameon=False)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
