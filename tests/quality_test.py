"""benchmarks/quality.py: the training-quality benchmark runs end to end on a tiny model."""

import json
import math
import os
import subprocess
import sys

from helpers import subprocess_env

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "quality.py")


def run(tmp_path, *args):
    return subprocess.run([sys.executable, SCRIPT, *args], env=subprocess_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)


def test_quick_run_writes_finite_losses_bytes_and_a_plot(tmp_path):
    result = run(tmp_path, "--quick", "--methods", "dense,allgather_topk(0.01)", "--out", str(tmp_path),
                 "--no-progress")
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "quality.json") as f:
        data = json.load(f)
    dense, topk = data["results"]
    assert (dense["name"], topk["name"]) == ("dense", "allgather_topk(0.01)")
    for r in (dense, topk):
        assert len(r["train_loss"]) == data["config"]["steps"]
        assert all(math.isfinite(v) for v in r["train_loss"])
        # Six steps from random init: near the uniform guess over 128 characters, and finite.
        assert math.isfinite(r["heldout_loss"]) and 0 < r["heldout_loss"] < math.log(128) + 1
        assert r["eval_curve"][-1] == [data["config"]["steps"], r["heldout_loss"]]
    assert 0 < topk["bytes_per_step"] < dense["bytes_per_step"]
    assert data["corpus"] and all(f["bytes"] > 0 and os.path.isfile(f["path"]) for f in data["corpus"])
    assert (tmp_path / "quality.png").stat().st_size > 1000
    assert "| allgather_topk(0.01) |" in result.stdout


def test_unknown_method_is_refused_naming_the_option(tmp_path):
    result = run(tmp_path, "--quick", "--methods", "dense,nope", "--out", str(tmp_path))
    assert result.returncode == 2
    assert "--methods" in result.stderr and "nope" in result.stderr
