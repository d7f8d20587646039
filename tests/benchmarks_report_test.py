"""benchmarks/report.py: README's tables are what the committed result files say."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess

import pytest
from helpers import load_benchmark

report = load_benchmark("report")


def test_readme_is_what_report_writes():
    """Run ``python benchmarks/report.py`` after changing a result file or a row. In a shallow
    clone every file's last commit is the clone's one, so commits and dates are left out there."""
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"],
        cwd=report.ROOT,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    stamp = re.compile(r"(\b[0-9a-f]{7,12} )?\d{4}-\d{2}-\d{2}|uncommitted")
    for name, new in report.stale():
        with open(os.path.join(report.ROOT, name)) as f:
            old = f.read()
        if shallow == "true":
            old, new = stamp.sub("DATE", old), stamp.sub("DATE", new)
        assert old == new, f"{name} is stale: run python benchmarks/report.py"


def test_the_newest_file_with_a_cell_gives_it(tmp_path):
    """The speed section's cells, which README's table summarizes: per model, the first file's."""
    rows = lambda *cells: [  # noqa: E731
        dict(model=m, rate="1gbit", method=k, hosts=4, speedup=v) for m, k, v in cells
    ]
    new, old = str(tmp_path / "new.json"), str(tmp_path / "old.json")
    with open(new, "w") as f:
        json.dump({"rows": rows(("mlp4096", "sign", 2.0))}, f)
    with open(old, "w") as f:  # netbench's bare list
        json.dump(rows(("mlp4096", "sign", 9.0), ("resnet50", "sign", 1.5)), f)
    cells = report.speed.cells((new, old))
    assert {m: v for m, (v, *_) in cells[("1gbit", "sign")].items()} == {
        "mlp4096": 2.0,
        "resnet50": 1.5,
    }
    assert report._summary(cells[("1gbit", "sign")]) == "1.75x / 1.50x"


def test_time_to_loss_is_dense_seconds_over_the_rows(tmp_path):
    """dp reaches its own final loss (2.0) at 100 s; a row that reaches it at 20 s is 5x
    sooner; one that never does is None (the table prints "never")."""

    def curve(*points):
        return [dict(step=i, seconds=s, loss=x, bytes=s + 1.0) for i, (s, x) in enumerate(points)]

    curves = [
        dict(name="dp", curve=curve((0, 3.0), (50, 2.5), (100, 2.0))),
        dict(name="fast", curve=curve((0, 3.0), (20, 2.0), (40, 1.9))),
        dict(name="never", curve=curve((0, 3.0), (10, 2.1))),
    ]
    (tmp_path / "ttq.json").write_text(json.dumps({"panels": [["100mbit", curves]]}))
    cells = report.to_loss_cells({"ttq.json": {"fast": "a", "never": "b"}}, root=str(tmp_path))
    assert cells == {("100mbit", "a"): 5.0, ("100mbit", "b"): None}


def test_a_missing_block_is_named():
    with pytest.raises(ValueError, match="report: decision"):
        report.rendered("no markers here", {"decision": lambda: "x"})


def test_the_zoo_cells_are_ratios_over_dense_of_the_same_task():
    cells = report.zoo_cells()
    assert cells["dense"]["bytes"] == 1.0
    assert all(v == 1.0 for v in cells["dense"]["loss"].values())
    assert set(report.QUIET_TASKS) <= set(cells["adam:sign"]["loss"])
    assert all(math.isfinite(v) for v in cells["adam:sign"]["loss"].values())
    assert cells["adam:sign"]["bytes"] < 0.5


@pytest.mark.parametrize("name, most", [("README.md", 200), ("BENCHMARKS.md", 500)])
def test_the_front_pages_stay_short(name, most):
    with open(os.path.join(report.ROOT, name)) as f:
        assert len(f.read().splitlines()) <= most


def test_results_hold_what_the_tables_read_and_nothing_else():
    """A result file no table reads belongs in a dated note's commit, not in the tree."""
    read = report.read_files()
    missing = [f for f in read if not os.path.isfile(os.path.join(report.ROOT, f))]
    assert not missing, missing
    held = {
        os.path.relpath(os.path.join(folder, name), report.ROOT)
        for folder, _, names in os.walk(os.path.join(report.ROOT, report.RESULTS))
        for name in names
    }
    assert held == read, sorted(held - read)


@pytest.mark.parametrize("name", ["kernels", "passes", "speed", "quality", "to_loss", "gpu"])
def test_each_section_says_what_where_from_and_what_is_short(name):
    """A heading, the command, the files it read (each committed), at most one screenful or
    two, and one line on what is still short of its target."""
    module = importlib.import_module(f"summary.{name}")
    lines = module.section().splitlines()
    assert lines[0].startswith("## ")
    assert sum(line.startswith("**Still short:**") for line in lines) == 1
    assert any("Command:" in line for line in lines)
    assert module.FILES and all(os.path.isfile(os.path.join(report.ROOT, f)) for f in module.FILES)
    assert len(lines) <= 80, len(lines)
