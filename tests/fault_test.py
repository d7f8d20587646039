"""Bounded failure: a dead, never-started or stalled peer is an error in the other processes.

Each test starts 2 processes of one ``jax.distributed`` job (1 CPU device each) with
``failure_timeout`` of 10 s and reads the surviving process's exit code, stderr and run time.
JAX's defaults would wait 100 to 300 s here and then abort the process (issue 14).
"""

import os
import subprocess
import sys
import time

import pytest

from helpers import subprocess_env
from jaxcomp import launch

FAILURE_TIMEOUT = 10
WORKER = os.path.join(os.path.dirname(__file__), "fault_worker.py")


def run_job(fault, faulty, at_step, start=(0, 1), wait=90):
    """Starts the processes in ``start`` of a 2-process job; returns {id: (code, stderr)}, seconds."""
    coordinator = f"127.0.0.1:{launch._free_port()}"
    processes = {}
    began = time.monotonic()
    for process_id in start:
        env = launch.process_env(coordinator, 2, process_id, 1, base=subprocess_env(),
                                 failure_timeout=FAILURE_TIMEOUT)
        processes[process_id] = subprocess.Popen(
            [sys.executable, WORKER, fault, str(faulty), str(at_step)], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results, elapsed = {}, {}
    try:
        for process_id, p in processes.items():
            if process_id == faulty:
                continue
            out, err = p.communicate(timeout=wait)
            results[process_id] = (p.returncode, out + err)
            elapsed[process_id] = time.monotonic() - began
    finally:
        for p in processes.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return results, elapsed


@pytest.mark.multiprocess
def test_killed_peer_is_an_error_in_the_other():
    results, elapsed = run_job("kill", 1, at_step=3)
    code, output = results[0]
    assert "step 2" in output, output  # the job ran before the fault
    assert code == 1, output  # a Python exception, not an abort (-6) nor a hang
    assert "Traceback" in output
    assert "process(es) 1 did not check in" in output, output
    assert elapsed[0] < 45, elapsed


@pytest.mark.multiprocess
def test_killed_coordinator_ends_the_other_promptly():
    results, elapsed = run_job("kill", 0, at_step=3)
    code, output = results[1]
    assert "step 2" in output, output
    # Losing process 0 (the coordination service) races two ends in process 1: its collective
    # raises (the Python exception, then jaxcomp's exit 1 naming process 0), and JAX's error
    # poller aborts the process ("Terminating process because the JAX distributed service detected
    # fatal errors"). JAX offers no way to turn the second into an exception; both are prompt.
    if code == 1:
        assert "process(es) 0 did not check in" in output, output
    else:
        assert code == -6 and "JAX distributed service detected fatal errors" in output, output
    assert elapsed[1] < 30, elapsed


@pytest.mark.multiprocess
@pytest.mark.parametrize("at_step", [3, 0], ids=["mid-run", "before-first-step"])
def test_stalled_peer_is_an_error_in_the_other(at_step):
    results, elapsed = run_job("stall", 1, at_step=at_step)
    code, output = results[0]
    assert code == 1, output
    assert "process(es) 1 did not check in" in output, output
    # Mid-run a collective times out after failure_timeout; before the first step gloo's own
    # connection set-up waits its fixed 30 s first.
    assert elapsed[0] < (FAILURE_TIMEOUT + 30 if at_step else 60), elapsed


@pytest.mark.multiprocess
def test_peer_that_never_starts_is_an_error():
    results, elapsed = run_job("none", 1, at_step=0, start=(0,))
    code, output = results[0]
    assert code == 1, output
    assert "not every process of the job connected to the coordinator" in output, output
    assert elapsed[0] < FAILURE_TIMEOUT + 15, elapsed


def test_launcher_stops_at_the_first_failure_of_any_worker():
    # Worker 1 fails at once while worker 0 would sleep 20 s: launch returns 1's code, not after 20 s.
    began = time.monotonic()
    code = launch.launch(["-c", "import os, sys, time\n"
                          "if os.environ['JAXCOMP_PROCESS_ID'] == '1': sys.exit(3)\n"
                          "time.sleep(20)"], num_processes=2)
    assert code == 3
    assert time.monotonic() - began < 10


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "10", True])
def test_failure_timeout_must_be_positive_seconds(value):
    with pytest.raises(ValueError, match="failure_timeout"):
        launch.initialize(failure_timeout=value)
    with pytest.raises(ValueError, match="failure_timeout"):
        launch.launch(["x.py"], 2, failure_timeout=value)


def test_initialize_sets_the_timeouts(monkeypatch):
    # What initialize passes to JAX, without starting a job.
    calls = {}
    import jax
    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.update(kw))
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setattr(launch, "_exit_promptly_on_failure", lambda *a: None)
    env = launch.process_env("127.0.0.1:1", 2, 1, 1, base={"XLA_FLAGS": "--xla_cpu_collective_timeout_seconds=5"},
                             failure_timeout=12.5)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert launch.initialize() == 1
    assert calls["heartbeat_timeout_seconds"] == 13
    assert calls["initialization_timeout"] > 13  # the watchdog (13 s) ends the process first
    assert os.environ["XLA_FLAGS"].split().count("--xla_cpu_collective_timeout_seconds=13") == 1
    assert "=5" not in os.environ["XLA_FLAGS"]


def test_failure_timeout_from_the_environment_is_checked(monkeypatch):
    env = launch.process_env("127.0.0.1:1", 2, 1, 1, base={})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("JAXCOMP_FAILURE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="JAXCOMP_FAILURE_TIMEOUT must be a number of seconds"):
        launch.initialize()
