"""benchmarks/summary/speed.py and gpu.py: BENCHMARKS.md's speed and GPU sections render from
the committed result files, every row and rate where it belongs."""

from __future__ import annotations

import os
import re
import sys

from helpers import BENCHMARKS_DIR

# The sections import their shared helpers as ``summary.common``, as benchmarks/report.py does.
if BENCHMARKS_DIR not in sys.path:
    sys.path.insert(0, BENCHMARKS_DIR)

import pytest  # noqa: E402
from summary import common, gpu, speed  # noqa: E402


@pytest.fixture(scope="module")
def speed_text():
    """The speed section, rendered once (each render asks git for every file's last commit)."""
    return speed.section()


def _tables(text: str) -> dict:
    """``{"1 Gbit": [row label, ...], ...}``: the rows under each bold rate heading."""
    tables, rate = {}, None
    for line in text.splitlines():
        heading = re.fullmatch(r"\*\*(.+)\*\*", line)
        if heading:
            rate = heading.group(1)
            tables[rate] = []
        elif rate and line.startswith("| ") and not line.startswith("| method"):
            tables[rate].append(line.split(" | ")[0][2:])
    return tables


def test_the_speed_section_has_a_table_a_rate_with_every_method(speed_text):
    text = speed_text
    assert "](docs/img/speed.png)" in text
    tables = _tables(text)
    assert list(tables) == list(speed.RATES.values())
    for rate, rows in tables.items():
        assert [f"`{m}`" for m in speed.METHODS] == rows[: len(speed.METHODS)], rate
        torch = rows[len(speed.METHODS) :]
        assert len(torch) == len(speed.TORCH), (rate, torch)
        assert all(row.startswith("torch `ddp") for row in torch)
        assert len(rows) <= 16


def test_cells_are_one_jobs_ratios_and_older_jobs_are_marked(speed_text):
    cells = speed.cells()
    ratio, path, against = cells[("1gbit", "torch ddp")]["mlp4096"]
    rows = common.load(path)["rows"]
    step = {(r.get("framework"), r["method"]): r["step"] for r in rows if r["model"] == "mlp4096"}
    assert against == "pmean"
    assert ratio == step[("jaxcomp", "pmean")] / step[("torch", "ddp")]
    older = speed._older(cells)
    newest = max(speed._date(p) for p in speed.FILES)
    assert older and all(speed._date(p) < newest for p in older)
    marked = f"({older[cells[('100mbit', 'bf16')]['mlp2041'][1]]})"
    assert re.search(r"\| `bf16` \|.*" + re.escape(marked), speed_text)


def test_the_gpu_section_reads_the_logs():
    text = gpu.section()
    log = open(os.path.join(common.ROOT, gpu.RUN, "tests.log")).read()
    failed = int(re.search(r"(\d+) failed", gpu.tested(log)).group(1))
    assert sum(count for _, _, count, _ in gpu.failures(log)) == failed
    assert "| kernels |" in text and "not run: no log" in text
    assert "(docs/gpu.md#" in text


def test_the_plot_writes_a_png(tmp_path):
    path = tmp_path / "speed.png"
    speed.plot(str(path), dpi=40)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000
