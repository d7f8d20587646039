"""benchmarks/guardrail_forced.py: the failures are forced where asked, a short job runs every
guard with and without its failure, writes its table and plot, and resumes."""

import math
import os
import sys

import numpy as np
import pytest
from helpers import load_benchmark, run_resumable

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
sys.path.insert(0, BENCHMARKS)
forced = load_benchmark("guardrail_forced")
tasks = load_benchmark("quality_tasks")


def test_a_fault_scales_the_loss_on_its_steps_and_rows_only():
    task = tasks.TASKS["regression"]()
    nan = forced.faulted(task, ("device0", math.nan, 2), at=5, n_devices=8)
    spike = forced.faulted(task, ("all", 1e4, 1), at=5, n_devices=8)
    clean = float(task.loss_fn(task.params, task.batch(5)))
    assert float(nan.loss_fn(task.params, nan.batch(4))) == float(
        task.loss_fn(task.params, task.batch(4))
    )
    factor = nan.batch(6)[1]
    assert np.isnan(factor[: len(factor) // 8]).all() and (factor[len(factor) // 8 :] == 1).all()
    assert not np.isnan(nan.batch(7)[1]).any()
    np.testing.assert_allclose(float(spike.loss_fn(task.params, spike.batch(5))), 1e4 * clean, 1e-5)
    assert float(spike.loss_fn(task.params, spike.heldout)) == float(
        task.loss_fn(task.params, task.heldout)
    )


@pytest.mark.slow  # a training run of its own
def test_a_short_job_runs_every_guard_and_resumes(tmp_path):
    args = [
        sys.executable,
        os.path.join(BENCHMARKS, "guardrail_forced.py"),
        "--tasks",
        "regression",
        "--cases",
        "gradient-spike",
        "--steps",
        "30",
        "--at",
        "20",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    first, results = run_resumable(args, tmp_path, "forced.json")
    guards = sorted((r["case"], r["guard"], r["failed"]) for r in results)
    assert guards == sorted(
        [("dense", "-", False)]
        + [("gradient-spike", g, True) for g in ("unguarded", "guardrail", "rollback")]
        + [("gradient-spike", g, False) for g in ("unguarded", "rollback", forced.NUDGED)]
    )
    nudged = next(r for r in results if r["guard"] == forced.NUDGED)
    unguarded = next(r for r in results if r["guard"] == "unguarded" and not r["failed"])
    assert nudged["heldout_loss"] != unguarded["heldout_loss"]  # one ulp is felt at all
    assert "| gradient-spike | chain:zfp(8) 1x |" in first.stdout
    assert (tmp_path / "forced.png").stat().st_size > 0


def test_nudged_params_are_one_ulp_away():
    params = {"w": np.array([1.0, -2.0, 0.0], np.float32), "n": np.array([3], np.int32)}
    moved = forced.nudged(params)
    np.testing.assert_array_equal(moved["w"], np.nextafter(params["w"], np.float32(np.inf)))
    assert moved["w"].dtype == np.float32 and np.all(moved["w"] > params["w"])
    np.testing.assert_array_equal(moved["n"], params["n"])
