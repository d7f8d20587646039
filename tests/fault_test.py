"""Bounded failure: a dead, never-started or stalled peer is an error in the other processes.

Each multi-process test starts 2 processes of one ``jax.distributed`` job (1 CPU device each)
with ``failure_timeout`` of 10 s and reads the surviving process's exit code, output and run time.
JAX's defaults would wait 100 to 300 s here and then abort the process (issue 14). The
rendezvous (``jaxcomp.distributed.rendezvous``) is also tested on its own, with threads standing for
processes.
"""

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
from helpers import subprocess_env

from jaxcomp.distributed import _failure as failure
from jaxcomp.distributed import launch, rendezvous

FAILURE_TIMEOUT = 10
WORKER = os.path.join(os.path.dirname(__file__), "fault_worker.py")


def free_ports(count):
    """``count`` distinct free ports on 127.0.0.1."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_job(fault, faulty, at_step, start=(0, 1), wait=90, steps=200, wait_for=None):
    """Starts the processes in ``start`` of a 2-process job and waits for those in ``wait_for``
    (default: all but ``faulty``); returns {id: (code, output), "rendezvous_port": port},
    {id: seconds} (the others are killed then, their output kept with code None)."""
    port, rendezvous_port = free_ports(2)
    coordinator = f"127.0.0.1:{port}"
    processes = {}
    began = time.monotonic()
    for process_id in start:
        env = launch.process_env(
            coordinator,
            2,
            process_id,
            1,
            base=subprocess_env(),
            failure_timeout=FAILURE_TIMEOUT,
            rendezvous_port=rendezvous_port,
        )
        processes[process_id] = subprocess.Popen(
            [sys.executable, WORKER, fault, str(faulty), str(at_step), str(steps)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    results, elapsed = {"rendezvous_port": rendezvous_port}, {}
    wait_for = [i for i in start if i != faulty] if wait_for is None else wait_for
    try:
        for process_id, p in processes.items():
            if process_id not in wait_for:
                continue
            out, err = p.communicate(timeout=wait)
            results[process_id] = (p.returncode, out + err)
            elapsed[process_id] = time.monotonic() - began
    finally:
        for process_id, p in processes.items():
            if p.poll() is None:
                p.kill()
            out, err = p.communicate()
            results.setdefault(process_id, (None, out + err))
    return results, elapsed


def run_jobs(*jobs):
    """Runs several :func:`run_job` calls at once (each a dict of its arguments), in threads: the
    jobs mostly wait on timeouts, so a pair of them takes the time of the longer one. Returns
    their ``(results, elapsed)`` in order; each job's times count from its own start."""
    out = [None] * len(jobs)

    def run(i):
        out[i] = run_job(**jobs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(o is not None for o in out), "a job's thread raised (see its traceback above)"
    return out


def seconds_to_raise(results, faulty, survivor):
    """Seconds from the fault (the faulty process's ``stopping T``) to the survivor's ``raised``."""
    stopped = re.search(r"^stopping ([\d.]+)$", results[faulty][1], re.M)
    raised = re.search(r"^raised \w+ ([\d.]+)$", results[survivor][1], re.M)
    assert stopped and raised, results
    return float(raised.group(1)) - float(stopped.group(1))


def each_faulty(fault, at_step, faulties=(1, 0), survivor_only=False):
    """Runs the job with each process of ``faulties`` as the faulty one, at once (with
    ``survivor_only``, the faulty process is never started); yields ``faulty, survivor,
    (code, output), results, elapsed`` per job."""
    starts = [(1 - f,) if survivor_only else (0, 1) for f in faulties]
    jobs = run_jobs(
        *(dict(fault=fault, faulty=f, at_step=at_step, start=st) for f, st in zip(faulties, starts))
    )
    for faulty, (results, elapsed) in zip(faulties, jobs):
        survivor = 1 - faulty
        yield faulty, survivor, results[survivor], results, elapsed


@pytest.mark.multiprocess
def test_killed_peer_or_coordinator_is_an_error_in_the_other():
    # JAX's coordination service runs in process 0's rendezvous server, not in process 0: losing
    # process 0 no longer aborts process 1 ("Terminating process because the JAX distributed
    # service detected fatal errors", SIGABRT, before this change). Both jobs run at once.
    for faulty, survivor, (code, output), _, elapsed in each_faulty("kill", 3):
        assert "step 2" in output, output  # the job ran before the fault
        assert code == 1, output  # a Python exception, not an abort (-6) nor a hang
        assert "Traceback" in output
        assert f"process(es) {faulty} did not check in" in output, output
        assert "Terminating process" not in output, output
        assert elapsed[survivor] < (45 if faulty else 30), elapsed


@pytest.mark.multiprocess
def test_killed_peer_is_an_error_in_an_idle_process():
    # The survivor spends 30 s in Python code without a collective when its peer dies: the
    # rendezvous server reports the loss and PeerLostError is raised in its main thread.
    for faulty, survivor, (code, output), _, elapsed in each_faulty("kill-idle", 3):
        assert "idle" in output, output
        assert code == 1, output
        assert (
            f"PeerLostError: process {survivor} of 2: process(es) {faulty} left the job" in output
        ), output
        assert "Terminating process" not in output, output
        assert elapsed[survivor] < 25, elapsed  # well before the 30 s idle ends


@pytest.mark.multiprocess
def test_stalled_peer_is_an_error_in_the_other():
    # Mid-run a collective times out after failure_timeout; before the first step gloo's own
    # connection set-up waits its fixed 30 s first. Both jobs run at once.
    at_steps = (3, 0)
    jobs = run_jobs(*(dict(fault="stall", faulty=1, at_step=a) for a in at_steps))
    for at_step, (results, elapsed) in zip(at_steps, jobs):
        code, output = results[0]
        assert code == 1, output
        assert "process(es) 1 did not check in" in output, output
        assert elapsed[0] < (FAILURE_TIMEOUT + 30 if at_step else 60), elapsed


@pytest.mark.multiprocess
def test_sigstopped_peer_is_an_error_in_a_process_in_a_collective():
    # SIGSTOP stops every thread of the peer (JAX's heartbeats, jaxcomp's pings): the survivor's
    # collective times out (failure_timeout) and the exit names the peer. Before, JAX's
    # coordination service declared the peer dead after the heartbeat timeout and aborted the
    # survivor (SIGABRT, rc -6, "Terminating process because the JAX distributed service detected
    # fatal errors") while it was still exiting.
    for faulty, survivor, (code, output), results, elapsed in each_faulty("sigstop", 5):
        assert "step 4" in output, output
        assert code == 1, output  # a Python exception, not an abort (-6)
        assert "Traceback" in output and "Gloo all-reduce failed" in output, output
        assert f"process(es) {faulty} stopped responding (no sign of life for 1" in output, output
        assert "Terminating process" not in output, output
        assert seconds_to_raise(results, faulty, survivor) < FAILURE_TIMEOUT + 5, output
        assert elapsed[survivor] < 60, elapsed


@pytest.mark.multiprocess
def test_sigstopped_peer_is_a_python_exception_in_an_idle_process():
    # The survivor runs Python code without a collective: the rendezvous server declares the
    # silent peer stalled after failure_timeout, the on_failure hook runs, then PeerStalledError
    # rises in the main thread. Before: SIGABRT after the heartbeat timeout, no exception.
    for faulty, survivor, (code, output), results, elapsed in each_faulty("sigstop-idle", 5):
        assert "idle" in output, output
        assert code == 1, output
        assert (
            f"PeerStalledError: process {survivor} of 2: process(es) {faulty} stopped responding"
            in output
        ), output
        hook = output.find(f"on_failure PeerStalledError [{faulty}]")
        assert 0 <= hook < output.find("raised PeerStalledError"), output  # the hook ran first
        assert "Terminating process" not in output, output
        seconds = seconds_to_raise(results, faulty, survivor)
        assert FAILURE_TIMEOUT - 1 < seconds < FAILURE_TIMEOUT + 5, (seconds, output)
        assert elapsed[survivor] < 60, elapsed


@pytest.mark.multiprocess
def test_peer_killed_right_after_initialize_is_a_python_exception():
    # Killed before its first JAX op. Before: JAX's service declared the peer dead after the
    # heartbeat timeout and aborted the survivor (rc -6, 11 to 13 s).
    for faulty, survivor, (code, output), results, elapsed in each_faulty("kill-after-init", 0):
        assert code == 1, output
        assert "Traceback" in output, output
        assert f"on_failure PeerLostError [{faulty}]" in output, output
        # The survivor's first JAX op waits in the CPU backend's topology exchange (2 to 5 min):
        # once PeerLostError is pending, JAX's distributed client is shut down to end that wait.
        assert (
            f"PeerLostError: process {survivor} of 2: process(es) {faulty} left the job" in output
        ), output
        assert "Terminating process" not in output and "F1" not in output, output
        assert seconds_to_raise(results, faulty, survivor) < 15, output
        assert elapsed[survivor] < 60, elapsed


@pytest.mark.multiprocess
def test_peer_that_never_starts_is_a_python_exception():
    # Process 1 (the peer), then process 0 (the coordinator) never starts; both jobs at once.
    for missing, survivor, (code, output), _, elapsed in each_faulty("none", 0, survivor_only=True):
        assert code == 1, output
        # Raised in initialize, before JAX is, so the script could catch it (the worker does,
        # and re-raises).
        assert f"caught MissingProcessError, missing=[{missing}]" in output, output
        assert (
            "Traceback" in output and "jaxcomp.distributed.rendezvous.MissingProcessError" in output
        ), output
        if missing:
            assert "process(es) 1 did not check in at the rendezvous" in output, output
        else:
            assert "process 0 did not open the rendezvous" in output, output
        assert "Terminating process" not in output and "F1" not in output, output  # no C++ abort
        assert FAILURE_TIMEOUT - 1 < elapsed[survivor] < FAILURE_TIMEOUT + 15, elapsed


@pytest.mark.multiprocess
def test_a_job_that_ends_normally_leaves_nothing_behind():
    results, _ = run_job("none", -1, at_step=0, steps=3, wait_for=(0, 1))
    for process_id in (0, 1):
        code, output = results[process_id]
        assert code == 0, output
        assert "step 2" in output and "left without a goodbye" not in output, output
    # The rendezvous server (process 0's helper) exits once every process has: its port is free.
    deadline = time.monotonic() + 10
    while True:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", results["rendezvous_port"]))
                break
            except OSError:
                assert time.monotonic() < deadline, (
                    "the rendezvous server still runs after the job ended"
                )
        time.sleep(0.2)


def test_launcher_stops_at_the_first_failure_of_any_worker():
    # Worker 1 fails at once while worker 0 would sleep 20 s: launch returns 1's code, not
    # after 20 s.
    began = time.monotonic()
    code = launch.launch(
        [
            "-c",
            "import os, sys, time\n"
            "if os.environ['JAXCOMP_PROCESS_ID'] == '1': sys.exit(3)\n"
            "time.sleep(20)",
        ],
        num_processes=2,
    )
    assert code == 3
    assert time.monotonic() - began < 10


def test_processes_that_ignore_sigterm_share_one_grace_period(monkeypatch):
    # JAX catches SIGTERM: the stopped processes are killed once the grace is over, all of them
    # after one grace period, not one each.
    monkeypatch.setattr(launch, "STOP_GRACE_SECONDS", 1.0)
    stubborn = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('ready', flush=True); time.sleep(60)"
    )
    processes = [
        subprocess.Popen([sys.executable, "-c", stubborn], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    assert [p.stdout.readline() for p in processes] == ["ready\n"] * 3  # SIGTERM is ignored now
    processes.append(subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(3)"]))
    began = time.monotonic()
    codes, failed = launch.wait_all(processes)
    assert failed == 3 and codes == [-9, -9, -9, 3]
    assert time.monotonic() - began < 2.5  # one grace (1 s), not three
    for p in processes[:3]:
        p.stdout.close()


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "10", True])
def test_failure_timeout_must_be_positive_seconds(value):
    with pytest.raises(ValueError, match="failure_timeout"):
        launch.initialize(failure_timeout=value)
    with pytest.raises(ValueError, match="failure_timeout"):
        launch.launch(["x.py"], 2, failure_timeout=value)


class FakeMembership:
    hosts_jax_service = True

    def leaving(self):
        pass


def fake_job(monkeypatch, process_id, failure_timeout=12.5, **env_options):
    """initialize()'s calls to the rendezvous and to JAX, recorded without starting a job."""
    calls = {}
    import jax

    monkeypatch.setattr(jax.distributed, "initialize", lambda *a, **kw: calls.update(jax=kw))
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    monkeypatch.setattr(launch, "exit_promptly_on_failure", lambda *a: None)
    monkeypatch.setattr(launch.atexit, "register", lambda *a: None)
    monkeypatch.setattr(launch, "_memberships", [])

    def check_in(address, num_processes, pid, timeout, **kw):
        calls.update(
            check_in=dict(
                address=address, num_processes=num_processes, process_id=pid, timeout=timeout, **kw
            )
        )
        return FakeMembership()

    monkeypatch.setattr(launch.rendezvous, "check_in", check_in)
    env = launch.process_env(
        "127.0.0.1:7733",
        2,
        process_id,
        1,
        base={"XLA_FLAGS": "--xla_cpu_collective_timeout_seconds=5"},
        failure_timeout=failure_timeout,
        **env_options,
    )
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return calls


def test_initialize_sets_the_timeouts(monkeypatch):
    calls = fake_job(monkeypatch, 1)
    assert launch.initialize() == 1
    assert calls["check_in"]["address"] == "127.0.0.1:7734"  # the coordinator's port + 1
    assert calls["check_in"]["timeout"] == 12.5 and calls["check_in"]["jax_service"] is None
    assert calls["check_in"]["stall_timeout"] == 12.5  # a peer silent this long is stalled
    assert calls["jax"]["heartbeat_timeout_seconds"] == 13
    assert calls["jax"]["initialization_timeout"] > 13  # the watchdog (13 s) ends the process first
    assert calls["jax"]["coordinator_bind_address"] is None
    assert os.environ["XLA_FLAGS"].split().count("--xla_cpu_collective_timeout_seconds=13") == 1
    assert "=5" not in os.environ["XLA_FLAGS"]


def test_process_0_hands_the_coordination_service_to_the_rendezvous_server(monkeypatch):
    calls = fake_job(monkeypatch, 0, rendezvous_port=9000)
    assert launch.initialize() == 0
    assert calls["check_in"]["address"] == "127.0.0.1:9000"
    service = calls["check_in"]["jax_service"]
    assert service.bind_address == "[::]:7733" and service.num_processes == 2
    assert service.heartbeat_timeout == 13 and service.shutdown_timeout == 13
    assert service.recoverable  # a dead or stalled task does not make the service abort the others
    # process 0's own service (jax.distributed.initialize always starts one) goes to an unused port
    assert calls["jax"]["coordinator_bind_address"] == "127.0.0.1:0"


def test_initialize_leaves_a_job_the_script_joined_itself(monkeypatch):
    calls = fake_job(monkeypatch, 1)
    import jax

    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert launch.initialize() == 1
    assert calls == {}


@pytest.mark.parametrize("value", [0, 65536, -1, "7734", True, 1.5])
def test_rendezvous_port_must_be_a_port(value, monkeypatch):
    with pytest.raises(ValueError, match="rendezvous_port must be a port number"):
        launch.initialize(rendezvous_port=value)
    with pytest.raises(ValueError, match="rendezvous_port must be a port number"):
        launch.launch(["x.py"], 2, rendezvous_port=value)
    with pytest.raises(ValueError, match="rendezvous_port must be a port number"):
        launch.process_env("127.0.0.1:7733", 2, 0, 1, rendezvous_port=value)


def test_rendezvous_port_from_the_environment_is_checked(monkeypatch):
    fake_job(monkeypatch, 1)
    monkeypatch.setenv("JAXCOMP_RENDEZVOUS_PORT", "next")
    with pytest.raises(
        ValueError, match="JAXCOMP_RENDEZVOUS_PORT must be a port number, got 'next'"
    ):
        launch.initialize()


def test_rendezvous_port_cannot_be_the_coordinators():
    with pytest.raises(ValueError, match="rendezvous_port must differ from the coordinator's port"):
        launch.launch(["x.py"], 1, coordinator="10.0.0.1:7733", rendezvous_port=7733)
    with pytest.raises(ValueError, match="give the rendezvous port explicitly"):
        launch.launch(["x.py"], 1, coordinator="10.0.0.1:65535")


# -- the rendezvous itself, with threads standing for processes ------------------------------------


def check_in_all(
    ids, num_processes, timeout=5.0, address=None, on_loss=None, stall_timeout=None, on_stall=None
):
    """Runs rendezvous.check_in for every id in ``ids`` at once; returns ({id: membership or error},
    seconds)."""
    address = address or f"127.0.0.1:{free_ports(1)[0]}"
    results, began = {}, time.monotonic()

    def one(process_id):
        try:
            results[process_id] = rendezvous.check_in(
                address,
                num_processes,
                process_id,
                timeout,
                on_loss=on_loss and (lambda *a: on_loss(process_id, *a)),
                stall_timeout=stall_timeout,
                on_stall=on_stall and (lambda *a: on_stall(process_id, *a)),
            )
        except Exception as e:
            results[process_id] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results, time.monotonic() - began


def test_rendezvous_lets_the_job_start_when_all_check_in():
    results, seconds = check_in_all([0, 1, 2], 3)
    assert all(isinstance(m, rendezvous.Membership) for m in results.values()), results
    assert seconds < 5
    for m in results.values():
        m.close()


def test_rendezvous_names_the_process_that_never_checks_in():
    results, seconds = check_in_all([0, 2], 3, timeout=2.0)
    for process_id in (0, 2):
        error = results[process_id]
        assert isinstance(error, rendezvous.MissingProcessError) and isinstance(
            error, TimeoutError
        ), error
        assert error.missing == (1,)
        assert f"process {process_id} of 3: process(es) 1 did not check in" in str(error)
    assert 1.5 < seconds < 10


def test_rendezvous_names_process_0_when_it_never_starts():
    results, seconds = check_in_all([1], 2, timeout=1.0)
    assert isinstance(results[1], rendezvous.MissingProcessError) and results[1].missing == (0,)
    assert "process 0 did not open the rendezvous" in str(results[1])


def test_rendezvous_refuses_processes_that_disagree_on_the_job_size():
    address = f"127.0.0.1:{free_ports(1)[0]}"
    results = {}

    def one(process_id, num_processes):
        try:
            results[process_id] = rendezvous.check_in(address, num_processes, process_id, 2.0)
        except Exception as e:
            results[process_id] = e

    threads = [threading.Thread(target=one, args=(0, 2)), threading.Thread(target=one, args=(1, 3))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert isinstance(results[1], ValueError)
    assert "process 1 says the job has 3 processes, process 0 says 2" in str(results[1])
    assert isinstance(results[0], rendezvous.MissingProcessError) and results[0].missing == (1,)


def test_rendezvous_port_in_use_is_a_clear_error():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(
            OSError, match=f"cannot start the rendezvous server on {address}.*--rendezvous-port"
        ):
            rendezvous.check_in(address, 2, 0, 5.0)


def test_rendezvous_reports_a_process_that_leaves_without_a_goodbye():
    heard = []
    results, _ = check_in_all(
        [0, 1, 2], 3, on_loss=lambda me, lost, message: heard.append((me, lost, message))
    )
    results[1].leaving()  # a goodbye: not a loss
    results[1]._sock.shutdown(socket.SHUT_RDWR)
    results[2]._sock.shutdown(socket.SHUT_RDWR)  # no goodbye: as if killed
    deadline = time.monotonic() + 10
    while results[0].lost != (2,) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert results[0].lost == (2,)
    assert any(
        me == 0 and lost == (2,) and "process(es) 2 left the job" in message
        for me, lost, message in heard
    )
    with pytest.raises(
        rendezvous.PeerLostError, match="process 0 of 3: process.es. 2 left the job"
    ) as error:
        results[0].raise_if_lost()
    assert error.value.lost == (2,)
    results[0].close()


@pytest.mark.parametrize("address", ["localhost", "host:", ":80", "host:0", "host:99999", "a b:1"])
def test_rendezvous_address_must_be_host_port(address):
    with pytest.raises(ValueError, match="address"):
        rendezvous.check_in(address, 2, 0, 1.0)


@pytest.mark.parametrize(
    "name, args",
    [
        ("num_processes", (0, 0, 1.0)),
        ("process_id", (2, 2, 1.0)),
        ("timeout", (2, 0, 0.0)),
        ("timeout", (2, 0, float("inf"))),
    ],
)
def test_rendezvous_arguments_are_checked(name, args):
    with pytest.raises(ValueError, match=name):
        rendezvous.check_in("127.0.0.1:7734", *args)


def test_failure_timeout_from_the_environment_is_checked(monkeypatch):
    env = launch.process_env("127.0.0.1:1", 2, 1, 1, base={})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("JAXCOMP_FAILURE_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="JAXCOMP_FAILURE_TIMEOUT must be a number of seconds"):
        launch.initialize()


def test_rendezvous_reports_a_process_that_stops_pinging():
    heard = []
    results, _ = check_in_all(
        [0, 1, 2],
        3,
        stall_timeout=1.0,
        on_stall=lambda me, stalled, message: heard.append((me, stalled, message)),
    )
    time.sleep(2.0)
    assert results[0].stalled == () and results[1].stalled == ()  # pings keep them alive
    results[2]._send = lambda data: True  # as if stopped: its pings no longer leave
    began = time.monotonic()
    while results[0].stalled != (2,) and time.monotonic() < began + 10:
        time.sleep(0.05)
    assert results[0].stalled == (2,) and time.monotonic() - began < 4
    assert results[0].lost == ()  # still connected: stalled, not lost

    def told_1():
        return any(
            me == 1 and stalled == (2,) and "process(es) 2 stopped responding" in message
            for me, stalled, message in list(heard)
        )

    # Process 0 (the server) tells process 1 in a message of its own: under load that arrives
    # after 0 itself noticed (a CI run once checked in between).
    while not told_1() and time.monotonic() < began + 10:
        time.sleep(0.05)
    assert told_1()
    assert all(me != 2 for me, _, _ in heard)  # the stalled process is not told about itself
    with pytest.raises(
        rendezvous.PeerStalledError, match="process 0 of 3: process.es. 2 stopped responding"
    ) as error:
        results[0].raise_if_lost()
    assert error.value.lost == (2,) and isinstance(error.value, rendezvous.PeerLostError)
    for m in results.values():
        m.close()


@pytest.mark.parametrize("hook_fails", [False, True])
def test_peer_failure_runs_the_hook_then_raises_in_the_main_thread_once(hook_fails):
    calls = []

    def on_failure(error):
        calls.append((error, time.monotonic()))
        if hook_fails:
            raise OSError("disk full")

    on_loss, on_stall = failure.raise_peer_lost_later(threading.Event(), 0.3, on_failure)
    began = time.monotonic()
    with pytest.raises(rendezvous.PeerStalledError, match="process.es. 1 stopped") as error:
        on_stall((1,), "process 0 of 2: process(es) 1 stopped responding")
        while time.monotonic() < began + 5:
            time.sleep(0.01)
    raised = time.monotonic()
    assert error.value.lost == (1,) and 0.25 < raised - began < 3
    assert len(calls) == 1 and isinstance(calls[0][0], rendezvous.PeerStalledError)
    assert calls[0][1] < raised  # the hook ran before the exception
    on_loss((1,), "process 0 of 2: process(es) 1 left the job")  # later failures: nothing more
    time.sleep(0.6)
    assert len(calls) == 1


def test_peer_failure_on_the_way_out_raises_nothing():
    exiting, calls = threading.Event(), []
    on_loss, _ = failure.raise_peer_lost_later(exiting, 0.1, calls.append)
    exiting.set()  # the process already ends on an exception of its own
    on_loss((1,), "process 0 of 2: process(es) 1 left the job")
    time.sleep(0.4)
    assert calls == []


def test_rendezvous_stall_timeout_is_checked():
    with pytest.raises(ValueError, match="stall_timeout"):
        rendezvous.check_in("127.0.0.1:7734", 2, 0, 1.0, stall_timeout=0)
