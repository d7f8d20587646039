"""The quorum of fault-tolerant DiLoCo (``jaxcomp.distributed.quorum``): argument errors, one
worker in this process, and 4 worker processes (no XLA collective, no ``jax.distributed``) of
which one is SIGKILLed and restarted.

This file is also the workers' script: ``python quorum_test.py worker ADDRESS RANK INCARNATION``
prints one JSON line per event, with ``time.monotonic()`` (the machine's one clock).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import events, free_port, service_process, subprocess_env, wait_for

from jaxcomp.distributed import quorum
from jaxcomp.distributed.quorum import (
    Member,
    Quorum,
    QuorumError,
    QuorumMismatchError,
    QuorumTimeoutError,
    ServiceLostError,
)

FAILURE_TIMEOUT = 5  # seconds: the service's heartbeat timeout in the multi-process test
WORKERS = 4
GET_TIMEOUT = 2.0  # a survivor's wait for the dead worker's bytes


@pytest.mark.parametrize(
    "args, message",
    [
        (("nowhere", 0, 4), "address"),
        (("127.0.0.1:1", 4, 4), "rank"),
        (("127.0.0.1:1", -1, 4), "rank"),
        (("127.0.0.1:1", True, 4), "rank"),
        (("127.0.0.1:1", 0, 0), "num_workers"),
        (("127.0.0.1:1", 0, 4, 0.0), "failure_timeout"),
        (("127.0.0.1:1", 0, 4, float("nan")), "failure_timeout"),
    ],
)
def test_bad_arguments_are_errors_before_connecting(args, message):
    began = time.monotonic()
    with pytest.raises(ValueError, match=message):
        Quorum(*args)  # nothing listens on port 1: a connection attempt would wait
    with pytest.raises(ValueError, match="prefix"):
        Quorum("127.0.0.1:1", 0, 4, prefix="/abs")
    with pytest.raises(ValueError, match="num_workers"):
        quorum.host_service("127.0.0.1:1", 0)
    with pytest.raises(ValueError, match="failure_timeout"):
        quorum.host_service("127.0.0.1:1", 2, failure_timeout=-1)
    assert time.monotonic() - began < 1.0


def test_no_service_is_an_error_not_an_abort():
    # jaxlib's connect would end this process from C++ (SIGABRT) when nothing listens
    began = time.monotonic()
    with pytest.raises(QuorumError, match="no coordination service at 127.0.0.1:1 after 1 s"):
        Quorum("127.0.0.1:1", 0, 1, failure_timeout=1)
    assert time.monotonic() - began < 3.0


def test_missing_jaxlib_method_names_it_and_the_jax_version(monkeypatch):
    from importlib.metadata import version

    monkeypatch.setattr(quorum, "_CLIENT_METHODS", (*quorum._CLIENT_METHODS, "no_such_method"))
    with pytest.raises(QuorumError, match=f"no_such_method.*jax {version('jax')}"):
        Quorum("127.0.0.1:1", 0, 1, failure_timeout=1)


def test_quorum_id_names_sync_workers_and_incarnations():
    a = quorum.quorum_id(3, [Member(2, 12), Member(0, 11)])
    assert a == quorum.quorum_id(3, [Member(0, 11), Member(2, 12)]) and a.startswith("3-")
    assert a != quorum.quorum_id(4, [Member(0, 11), Member(2, 12)])
    assert a != quorum.quorum_id(3, [Member(0, 11), Member(2, 13)])


def test_one_worker_in_this_process():
    port = free_port()
    service = quorum.host_service(f"127.0.0.1:{port}", 1, failure_timeout=3)
    try:
        with Quorum(f"127.0.0.1:{port}", 0, 1, failure_timeout=3) as q:
            with pytest.raises(ValueError, match="members"):
                q.put("x", b"1")
            with pytest.raises(ValueError, match=r"members\(0\) first"):
                q.commit(0)
            with pytest.raises(
                QuorumMismatchError, match="worker 0 came to sync 0.s members barrier new"
            ) as error:
                q.members(0)  # a worker's first barrier: it is new to the quorum
            assert error.value.sync == 0
            members = q.members(0)
            assert [m.worker for m in members] == [0] and members == q.members(0)
            q.put("x", b"\x00payload")
            assert q.get("x") == b"\x00payload"
            with pytest.raises(QuorumError, match="'x'"):
                q.put("x", b"again")  # a key is put once per quorum
            with pytest.raises(TypeError, match="bytes"):
                q.put("y", "text")
            began = time.monotonic()
            with pytest.raises(QuorumTimeoutError, match=r"'nobody' within 0.5 s") as error:
                q.get("nobody", timeout=0.5)
            assert 0.4 < time.monotonic() - began < 2.0 and error.value.waiting_for == "nobody"
            assert q.commit(0) is True
            assert q.members(1) == members and q.commit(1) is True
            with pytest.raises(ValueError, match="timeout"):
                q.get("x", timeout=0)
        with pytest.raises(QuorumError, match="closed"):
            q.members(2)
    finally:
        service.shutdown()


def test_the_service_dies_the_worker_lives_and_reconnects():
    """SIGKILLed, the service takes jaxlib's client process with it, not the worker: each call
    is a ServiceLostError (jaxlib's last status in it) until reconnect() finds the service
    restarted, as a new incarnation."""
    port = free_port()
    service = service_process(port, 1, 3)
    try:
        q = Quorum(f"127.0.0.1:{port}", 0, 1, failure_timeout=3)
        with pytest.raises(QuorumMismatchError):
            q.members(0)
        (before,) = q.members(0)
        service.kill()
        service.wait()
        began = time.monotonic()
        while time.monotonic() - began < 10:  # its client notices within about a second
            try:
                q.members(1)
            except ServiceLostError as e:
                assert "is gone" in str(e) and "SIGABRT" in str(e), e
                break
            time.sleep(0.1)
        else:
            pytest.fail("no ServiceLostError 10 s after the service was killed")
        with pytest.raises(ServiceLostError):
            q.get("x")
        service = service_process(port, 1, 3)
        q.reconnect(timeout=10)
        with pytest.raises(QuorumMismatchError):
            q.members(1)  # new to the new service's quorum
        (after,) = q.members(1)
        assert after.worker == 0 and after.incarnation != before.incarnation
        assert q.commit(1) is True
        q.close()
    finally:
        service.kill()
        service.wait()


def emit(event, **fields):
    print(json.dumps({"t": time.monotonic(), "event": event, **fields}), flush=True)


def exchange(q, sync, members):
    """Every member puts its bytes and reads everyone's; returns the workers whose bytes did not
    come (or came wrong)."""
    q.put(f"delta/{q.rank}", bytes([q.rank, sync % 256]) * 1000)
    missing = []
    for m in members:
        try:
            if (
                q.get(f"delta/{m.worker}", timeout=GET_TIMEOUT)
                != bytes([m.worker, sync % 256]) * 1000
            ):
                missing.append(m.worker)
        except QuorumTimeoutError as e:
            emit("get-timeout", sync=sync, worker=m.worker, message=str(e))
            missing.append(m.worker)
    return missing


def worker(address, rank, incarnation):
    """Syncs until a quorum of every worker, with worker 3 restarted, commits (worker 3's first
    run SIGKILLs itself at sync 1, after the barrier and before the exchange)."""
    q = Quorum(address, rank, WORKERS, failure_timeout=FAILURE_TIMEOUT)
    sync, first, deadline = 0, None, time.monotonic() + 45
    while time.monotonic() < deadline:
        try:
            members = q.members(sync, timeout=30)
        except QuorumMismatchError as e:
            emit("mismatch", sync=sync, adopt=e.sync)
            sync = e.sync
            continue
        first = first or members
        emit("members", sync=sync, members=[list(m) for m in members])
        if rank == 3 and incarnation == 0 and sync == 1:
            emit("dying")
            os.kill(os.getpid(), signal.SIGKILL)
        missing = exchange(q, sync, members)
        committed = q.commit(sync)
        emit("commit", sync=sync, value=committed, missing=missing)
        if committed and len(members) == WORKERS and (incarnation == 1 or members != first):
            break  # a quorum of all, worker 3 restarted, committed
        sync += committed
        time.sleep(0.3)  # stands for the inner steps
    q.close()
    emit("closed", sync=sync)


def absent_worker(address, rank):
    """Worker 0 waits at sync 0's barrier for 1.5 s; worker 1 is connected but never comes."""
    q = Quorum(address, rank, 2, failure_timeout=FAILURE_TIMEOUT)
    if rank == 1:
        time.sleep(4)
        os._exit(0)
    began = time.monotonic()
    try:
        q.members(0, timeout=1.5)
    except QuorumTimeoutError as e:
        emit("timeout", seconds=time.monotonic() - began, message=str(e), waiting_for=e.waiting_for)
    try:
        q.members(0)
    except QuorumError as e:
        emit("after", message=str(e))
    os._exit(0)  # the barrier's thread is still inside jaxlib


def start_worker(address, rank, incarnation, out_dir, role="worker"):
    out = open(os.path.join(out_dir, f"{role}{rank}.{incarnation}.jsonl"), "w")
    env = subprocess_env(JAX_PLATFORMS="cpu")
    command = [sys.executable, os.path.abspath(__file__), role, address, str(rank)]
    return subprocess.Popen(
        [*command, str(incarnation)], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=out_dir
    )


def test_four_workers_agree_one_dies_and_one_rejoins(tmp_path):
    port = free_port()
    service = quorum.host_service(f"[::]:{port}", WORKERS, failure_timeout=FAILURE_TIMEOUT)
    address, log = f"127.0.0.1:{port}", lambda r, i: str(tmp_path / f"worker{r}.{i}.jsonl")
    processes = {(r, 0): start_worker(address, r, 0, tmp_path) for r in range(WORKERS)}
    try:
        wait_for(lambda: processes[3, 0].poll() is not None, 60, "worker 3 to die")
        survivors = [0, 1, 2]
        sync1_failed = lambda r: any(  # noqa: E731
            e["event"] == "commit" and e["sync"] == 1 for e in events(log(r, 0))
        )
        wait_for(lambda: all(sync1_failed(r) for r in survivors), 3 * FAILURE_TIMEOUT, "sync 1")
        processes[3, 1] = start_worker(address, 3, 1, tmp_path)
        for key, p in processes.items():
            assert p.wait(timeout=45) == (-signal.SIGKILL if key == (3, 0) else 0), open(
                log(*key)
            ).read()
    finally:
        for p in processes.values():
            p.kill() if p.poll() is None else None
        service.shutdown()
    runs = {key: events(log(*key)) for key in processes}
    check_runs(runs, survivors)


def check_runs(runs, survivors):
    def first(run, event, **match):
        return next(
            e for e in run if e["event"] == event and all(e[k] == v for k, v in match.items())
        )

    # syncs 0 and 1: all four agree on the four workers; sync 0 commits after a full exchange
    lists = {
        json.dumps(first(runs[r, 0], "members", sync=s)["members"])
        for r in range(WORKERS)
        for s in (0, 1)
    }
    assert len(lists) == 1 and [w for w, _ in json.loads(lists.pop())] == [0, 1, 2, 3]
    for r in range(WORKERS):
        assert first(runs[r, 0], "commit", sync=0) == {
            **first(runs[r, 0], "commit", sync=0),
            "value": True,
            "missing": [],
        }
    killed = first(runs[3, 0], "dying")["t"]
    for r in survivors:
        run = runs[r, 0]
        timeout = first(run, "get-timeout", sync=1, worker=3)
        assert (
            "'delta/3' within 2 s" in timeout["message"]
            and timeout["t"] - killed < GET_TIMEOUT + 1.5
        )
        failed = first(run, "commit", sync=1)
        assert failed["value"] is False and failed["missing"] == [3]
        assert failed["t"] - killed < FAILURE_TIMEOUT + 2.0, failed["t"] - killed

    # the survivors' retry of sync 1: the same three workers, same incarnations, on each
    before = {w: i for w, i in first(runs[0, 0], "members", sync=0)["members"]}
    retries = set()
    for r in survivors:
        failed_at = first(runs[r, 0], "commit", sync=1)["t"]
        retry = next(e for e in runs[r, 0] if e["event"] == "members" and e["t"] > failed_at)
        retries.add(json.dumps(retry["members"]))
    assert retries == {json.dumps([[w, before[w]] for w in survivors])}
    # the rejoin: worker 3's new run adopts the survivors' sync, then a quorum of all four
    # (worker 3 with a new incarnation) commits on every member
    assert first(runs[3, 1], "mismatch")["adopt"] >= 1
    finals = [runs[r, 0] for r in survivors] + [runs[3, 1]]
    last = [[e for e in run if e["event"] == "members"][-1] for run in finals]
    assert len({json.dumps([e["sync"], e["members"]]) for e in last}) == 1, last
    members = dict(last[0]["members"])
    assert sorted(members) == [0, 1, 2, 3] and members[3] != before[3]
    assert {m: i for m, i in members.items() if m != 3} == {w: before[w] for w in survivors}
    for run in finals:
        assert [e for e in run if e["event"] == "commit"][-1]["value"] is True
        assert run[-1]["event"] == "closed"


def test_a_live_worker_that_never_comes_is_a_timeout_naming_it(tmp_path):
    port = free_port()
    service = quorum.host_service(f"[::]:{port}", 2, failure_timeout=FAILURE_TIMEOUT)
    try:
        processes = [start_worker(f"127.0.0.1:{port}", r, 0, tmp_path, "absent") for r in (0, 1)]
        codes = [p.wait(timeout=30) for p in processes]
    finally:
        for p in processes:
            p.kill() if p.poll() is None else None
        service.shutdown()
    run = events(tmp_path / "absent0.0.jsonl")
    assert codes == [0, 0] and [e["event"] for e in run] == ["timeout", "after"], run
    assert 1.4 < run[0]["seconds"] < 3.0 and run[0]["waiting_for"] == [1]
    assert "worker 1 did not reach sync 0's members barrier within 1.5 s" in run[0]["message"]
    assert "unusable" in run[1]["message"]


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif __name__ == "__main__" and sys.argv[1:2] == ["absent"]:
    absent_worker(sys.argv[2], int(sys.argv[3]))
