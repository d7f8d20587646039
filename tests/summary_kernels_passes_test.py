"""benchmarks/summary/kernels.py and passes.py: BENCHMARKS.md's kernels and passes sections
render from the committed result files, with a row for every kernel and every method."""

from __future__ import annotations

import json
import os
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


def _check_shape(text: str, image: str):
    lines = text.splitlines()
    assert lines[0].startswith("## ")
    assert sum(line.startswith("**Still short:**") for line in lines) == 1
    assert sum(line.startswith("Command:") for line in lines) == 1
    assert f"](docs/img/{image})" in text
    assert len(lines) <= 45, len(lines)


def test_every_file_a_section_reads_exists():
    for module in (kernels, passes):
        assert module.FILES
        for path in module.FILES:
            assert os.path.isfile(os.path.join(common.ROOT, path)), path


def test_the_kernels_table_has_every_kernel_at_every_size():
    text = kernels.section()
    _check_shape(text, "kernels.png")
    rows = _rows(text)
    assert len(rows) <= 25
    names = [(row[0], row[1]) for row in rows]
    for size in ("25.2M", "124.4M"):
        for kernel in ("`topk`, k = 1%", "`topk`, k = 0.25%", "`threshold_topk`, k = 1%"):
            assert (kernel, size) in names
        for runs in (4, 8):
            assert (f"SPLIT's merge of {runs} runs, k = 1%", size) in names
    assert ("`sign_pack`, two threads", "25.2M") in names
    assert ("`zfp_encode`, rate 8", "6.3M") in names
    assert ("`zfp_decode`, rate 8", "6.3M") in names
    for row in rows:
        assert re.fullmatch(r"\d+\.\d", row[2]), row  # every kernel has a time
        assert row[5] == "-" or re.fullmatch(r"\d+\.\d\dx", row[5]), row


def test_a_kernel_row_is_the_best_of_each_sides_rounds():
    topk = next(r for r in kernels.rows() if r.kernel == "`topk`, k = 1%" and r.n == 25_200_000)
    times = {"before": [], "after": []}
    side = None
    with open(os.path.join(common.ROOT, kernels.TOPK)) as f:
        for line in f:
            if line.startswith("== "):
                side = line.split()[1].rstrip(",")
            elif line.startswith("{"):
                row = json.loads(line)
                if (row["op"], row["n"], row["k"]) == ("topk", 25_200_000, 252_000):
                    times[side].append(row["ms"])
    assert len(times["before"]) == len(times["after"]) == 2
    assert (topk.ms, topk.replaced_ms) == (min(times["after"]), min(times["before"]))
    assert topk.copy_ms is not None


def test_the_passes_table_has_every_method_and_model():
    text = passes.section()
    _check_shape(text, "passes.png")
    rows = _rows(text)
    assert len(rows) <= 20
    methods = [row[0] for row in rows]
    newest = common.load(passes.JOBS[0][0])
    assert methods == [f"`{m}`" for m in dict.fromkeys(r["method"] for r in newest)]
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    assert [c.strip() for c in header.strip("|").split("|")][1:-1] == list(passes.MODELS)
    for row in rows:
        for cell in row[1:4]:  # mlp4096, mlp2041 and resnet50: every method, the newest job
            assert re.fullmatch(r"\d+\.\d \(\d+ ms\)", cell), row


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
