"""benchmarks/summary/kernels.py and passes.py: BENCHMARKS.md's kernels and passes sections
render from the committed result files, with a row for every kernel and every method."""

from __future__ import annotations

import re
import sys

from helpers import BENCHMARKS_DIR

# The sections import their shared helpers as ``summary.common``, as benchmarks/report.py does.
if BENCHMARKS_DIR not in sys.path:
    sys.path.insert(0, BENCHMARKS_DIR)

from summary import common, kernels, passes  # noqa: E402


def _rows(text: str) -> list:
    """The table's rows below its header, each a list of its cells."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines[1:]]


def test_the_kernels_table_has_every_op_beside_its_baseline():
    text = kernels.section()
    assert "](docs/img/kernels.png)" in text
    rows = _rows(text)
    data = common.load(kernels.KERNELS)
    measured = [r for r in data["rows"] if r["baseline"]]
    assert len(rows) == len(kernels.rows(data)) > 0
    ops = {row[1] for row in rows}
    for op in ("`jaxcomp.topk`", "`jaxcomp.threshold_topk`", "`jaxcomp.zfp_encode`"):
        assert op in ops, ops
    for row, r in zip(rows, kernels.rows(data)):
        assert row[3] == f"{r['seconds'] * 1e3:.1f}"  # the file's time, in ms
        assert row[5] == "-" or row[5] == f"{r['speedup']:.1f}x"
    assert {r["baseline"] for r in measured} >= {"jax.lax.top_k", "zfpy.compress"}
    assert all("|" not in r["op"] for r in kernels.rows(data))  # a pipe would split a cell


def test_the_passes_table_has_every_method_and_model():
    text = passes.section()
    assert "](docs/img/passes.png)" in text
    rows = _rows(text)
    assert len(rows) <= 20
    methods = [row[0] for row in rows]
    # The newest job's methods first, then the older jobs' others.
    jobs = passes.newest_first()
    order = dict.fromkeys(r["method"] for job in jobs for r in common.load(job[0]))
    assert methods == [f"`{m}`" for m in order]
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    assert [c.strip() for c in header.strip("|").split("|")][1:-1] == list(passes.MODELS)
    for row in rows:
        for cell in row[1:4]:  # mlp4096, mlp2041 and resnet50: every method (a letter: older)
            assert re.fullmatch(r"\d+\.\d \(\d+ ms\)( \([a-z]\))?", cell), row


def test_a_cell_comes_from_the_newest_job_that_has_it():
    table = passes.cells()
    jobs = passes.newest_first()
    assert jobs[0] == passes.JOBS[0]
    for (method, model), (_, job) in table.items():
        for newer in jobs[: jobs.index(job)]:
            assert not any(
                r["method"] == method and r["model"] == model
                for path in newer
                for r in common.load(path)
            ), (method, model, job, newer)
    row, job = table[("sign", "gpt2")]
    rounds = [r for path in job for r in common.load(path) if r["method"] == "sign"]
    assert row["seconds"] == min(r["seconds"] for r in rounds if r["model"] == "gpt2")


def test_the_plots_write_pngs(tmp_path):
    for module in (kernels, passes):
        path = tmp_path / f"{module.__name__.split('.')[-1]}.png"
        module.plot(str(path))
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 10_000
