"""The user-facing walk-throughs run: notebooks/quickstart.ipynb (executed) and `jaxcomp demo`."""

import os

import nbclient
import nbformat
import pytest
from helpers import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow  # a training run of its own
def test_quickstart_notebook_executes(tmp_path):
    notebook = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    saved = {
        name: os.environ.get(name)
        for name in ("PYTHONPATH", "JAXCOMP_NOTEBOOK_STEPS", "MPLBACKEND")
    }
    # The kernel inherits this environment: the jaxcomp this process imported, few steps, and the
    # notebook's own inline plots (a non-interactive MPLBACKEND would swallow them).
    os.environ.pop("MPLBACKEND", None)
    os.environ.update({"PYTHONPATH": subprocess_env()["PYTHONPATH"], "JAXCOMP_NOTEBOOK_STEPS": "6"})
    try:
        nbclient.NotebookClient(
            notebook,
            timeout=240,
            kernel_name="python3",
            resources={"metadata": {"path": str(tmp_path)}},
        ).execute()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    outputs = [
        output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
    ]
    text = "".join(output.get("text", "") for output in outputs)
    assert "non-zero entries of the update: 16" in text  # SPLIT: 8 devices x 2 indices
    assert "after 6 steps" in text
    assert "| allgather_topk_noef |" in text
    assert any("image/png" in output.get("data", {}) for output in outputs), (
        "the comparison plot is missing"
    )


def test_demo_command_prints_table_and_saves_plot(tmp_path, capsys):
    from jaxcomp.cli import demo

    code = demo.main(
        [
            "--steps",
            "3",
            "--methods",
            "dense,ar_topk,auto_adaptive_100mbit",
            "--out",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert code == 0
    table = capsys.readouterr().out
    # SPLIT's density counts its N ceil(k/N) slots: 0.0101 where k/n is 0.00999.
    assert "| dense | dense (1) |" in table and "| ar_topk | ar_topk (0.0101) |" in table
    # ar_topk at 1% sends a small fraction of dense's bytes; the table shows the ratio.
    ar_line = next(line for line in table.splitlines() if line.startswith("| ar_topk |"))
    assert float(ar_line.split("|")[7]) < 0.1
    # On the simulated slow link auto compresses, exploring from the highest candidate density.
    assert (
        "| auto_adaptive_100mbit | allgather_topk (0.1) |" in table
        or "| auto_adaptive_100mbit | ar_topk (0.1) |" in table
    )
    with open(tmp_path / "loss_curves.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # The verdict table is printed last and saved next to the plot.
    with open(tmp_path / "verdict.md") as f:
        assert f.read().strip() in table
    with open(tmp_path / "verdict.csv") as f:
        assert f.readline().startswith("run,ran,density,accuracy,accuracy_vs_dense,")


def test_demo_rejects_unknown_methods():
    from jaxcomp.cli import demo

    with pytest.raises(SystemExit):
        demo.main(["--methods", "dense,fastest"])
