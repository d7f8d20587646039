"""notebooks/quickstart.ipynb runs from top to bottom (a few steps per run) and draws its plot."""

import os

import nbclient
import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_executes(tmp_path):
    notebook = nbformat.read(os.path.join(ROOT, "notebooks", "quickstart.ipynb"), as_version=4)
    env_path = os.environ.get("PYTHONPATH", "")
    saved = {name: os.environ.get(name) for name in ("PYTHONPATH", "JAXCOMP_NOTEBOOK_STEPS", "MPLBACKEND")}
    # The kernel inherits this environment: jaxcomp from this checkout, few steps, and the
    # notebook's own inline plots (a non-interactive MPLBACKEND would swallow them).
    os.environ.pop("MPLBACKEND", None)
    os.environ.update({"PYTHONPATH": ROOT + (os.pathsep + env_path if env_path else ""),
                       "JAXCOMP_NOTEBOOK_STEPS": "6"})
    try:
        nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}).execute()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs]
    text = "".join(output.get("text", "") for output in outputs)
    assert "non-zero entries of the update: 10" in text
    assert "after 6 steps" in text
    assert "| allgather_topk_noef |" in text
    assert any("image/png" in output.get("data", {}) for output in outputs), "the comparison plot is missing"
