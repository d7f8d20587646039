"""Fault-tolerant DiLoCo (``jaxcomp.distributed.diloco_ft``): argument errors, two workers in this
process against ``jaxcomp.diloco``, and 4 worker processes of which one SIGKILLs itself mid-round
and comes back, or whose coordination service is SIGKILLed and restarted, against a replay of the
run that averages over the workers that trained.

This file is also the workers' script: ``python diloco_ft_test.py worker ADDRESS RANK
INCARNATION WHERE`` prints one JSON line per event, with ``time.monotonic()`` (the machine's one
clock).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import events, free_port, need_devices, service_process, subprocess_env, wait_for

import jaxcomp
from jaxcomp.distributed import quorum
from jaxcomp.distributed.diloco_ft import diloco_ft
from jaxcomp.distributed.ft_codecs import Int8
from jaxcomp.distributed.quorum import Quorum

FAILURE_TIMEOUT = 5  # seconds: the service's heartbeat timeout
WORKERS = 4
H = 3  # inner steps per sync
KILL_STEP = 2 * H + 1  # worker 2's first run dies before this inner step: inside sync 2's round
SYNCS = 6  # the syncs a run whose service dies trains for
PACE = 0.05  # seconds per inner step in the worker processes: stands for the computation
INNER = optax.adam(0.05)
OUTER = optax.sgd(0.7, momentum=0.9, nesterov=True)


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def initial_params():
    return {"w": jnp.zeros(5, jnp.float32), "b": jnp.zeros((), jnp.float32)}


def batch(rank, step):
    """Worker ``rank``'s batch at inner step ``step``: each worker its own target."""
    rng = np.random.default_rng(1000 * rank + step)
    x = rng.normal(size=(8, 5)).astype(np.float32)
    y = x @ np.arange(1.0, 6.0, dtype=np.float32) + rank + 0.1 * rng.normal(size=8)
    return x, y.astype(np.float32)


class NoQuorum:
    rank = 0

    def members(self, sync, timeout=None):
        raise AssertionError("nothing may be sent")

    commit = put = get = reconnect = members


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(sync_every=0), ValueError, "sync_every"),
        (dict(sync_every=True), ValueError, "sync_every"),
        (dict(sync_every=2, sync_timeout=0), ValueError, "sync_timeout"),
        (dict(sync_every=2, quorum=object()), TypeError, "quorum"),
        (dict(sync_every=2, inner_tx=optax.sgd), TypeError, "inner_tx"),
        (dict(sync_every=2, outer_tx="sgd"), TypeError, "outer_tx"),
        (dict(sync_every=2, loss_fn=3), TypeError, "loss_fn"),
        (dict(sync_every=2, codec="int8"), TypeError, "codec"),
        (dict(sync_every=2, eager="yes"), TypeError, "eager"),
    ],
)
def test_bad_arguments_are_errors_before_anything_is_sent(kwargs, error, message):
    kwargs = {"loss_fn": loss_fn, "quorum": NoQuorum(), **kwargs}
    with pytest.raises(error, match=message):
        diloco_ft(kwargs.pop("loss_fn"), **kwargs)
    run = diloco_ft(loss_fn, quorum=NoQuorum(), sync_every=2)
    with pytest.raises(ValueError, match="float"):
        run.init({"n": jnp.zeros(3, jnp.int32)})
    state, metrics = run.step(run.init(initial_params()), batch(0, 0))  # no sync: nothing sent
    assert state.step == 1 and not metrics["synced"] and metrics["bytes_sent"] == 0


def two_workers(steps, start=None, codec=None, eager=False, quorum_class=Quorum, pace=0.0):
    """Two workers in threads of this process, on a service of their own, for ``steps`` inner
    steps from ``start(run, rank)`` (default ``run.init``), each step ``pace`` seconds at least:
    ``{rank: (params, synced, state, metrics)}`` (``metrics`` of every step)."""
    port = free_port()
    service = quorum.host_service(f"127.0.0.1:{port}", 2, failure_timeout=FAILURE_TIMEOUT)
    results, errors = {}, []

    def work(rank):
        try:
            address = f"127.0.0.1:{port}"
            with quorum_class(address, rank, 2, failure_timeout=FAILURE_TIMEOUT) as q:
                run = diloco_ft(
                    loss_fn, INNER, OUTER, quorum=q, sync_every=H, sync_timeout=20, codec=codec,
                    eager=eager,
                )  # fmt: skip
                state = run.init(initial_params()) if start is None else start(run, rank)
                synced, every = [], []
                for _ in range(steps):
                    time.sleep(pace)
                    state, metrics = run.step(state, batch(rank, state.step))
                    synced.append((metrics["synced"], metrics["members"], metrics["trained"]))
                    every.append(metrics)
                results[rank] = (run.params(state), synced, state, every)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        service.shutdown()
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return results


def test_two_workers_in_this_process_match_diloco():
    need_devices(2)
    steps = 4 * H
    results = two_workers(steps)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("workers",))
    reference = jaxcomp.diloco(loss_fn, INNER, OUTER, mesh=mesh, sync_every=H)
    state = reference.init(initial_params())
    for step in range(steps):
        both = [batch(r, step) for r in (0, 1)]
        state, _ = reference.step(state, jax.tree.map(lambda *x: np.concatenate(x), *both))
    expected = reference.params(state)
    for rank in (0, 1):
        params, synced, final, _ = results[rank]
        assert synced == [
            (True, 2, (0, 1)) if (s + 1) % H == 0 else (False, 0, ()) for s in range(steps)
        ]
        assert final.step == steps and final.sync == steps // H
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), params, expected
        )
    same = jax.tree.map(lambda a, b: np.array_equal(a, b), results[0][0], results[1][0])
    assert all(jax.tree.leaves(same))


def int8_reference(x, chunk):
    """What the 8-bit codec sends of ``x``, in numpy: per chunk, the largest magnitude is 127."""
    n = x.size
    rows = np.pad(np.asarray(x, np.float32), (0, -n % chunk)).reshape(-1, chunk)
    scales = np.max(np.abs(rows), axis=1) / np.float32(127)
    codes = np.clip(np.round(rows / np.where(scales > 0, scales, 1)[:, None]), -127, 127)
    return (codes * scales[:, None]).ravel()[:n].astype(np.float32)


@pytest.mark.parametrize("n", [1, 5, 1023, 1024, 5000])
def test_the_int8_codec_matches_its_numpy_reference(n):
    codec = Int8(chunk=1024)
    rng = np.random.default_rng(n)  # magnitudes from 1e-3 to 1e2: each chunk its own scale
    x = (rng.normal(size=n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    codes, scales = jax.jit(codec.encode)(jnp.asarray(x))
    body = codec.to_bytes(codes, scales)
    assert len(body) == -(-n // 1024) * (1024 + 4)  # a quarter of float32's, and the scales
    np.testing.assert_allclose(codec.decode(body, n), int8_reference(x, 1024), rtol=1e-6)
    np.testing.assert_array_equal(codec.decode(body, n), codec.decoded(codes, scales, n))
    zeros = codec.encode(jnp.zeros(n))
    assert not codec.decode(codec.to_bytes(*zeros), n).any()
    with pytest.raises(ValueError, match="bytes"):
        codec.decode(body[:-1], n)
    with pytest.raises(ValueError, match="chunk"):
        Int8(chunk=0)


def test_two_workers_with_int8_pseudo_gradients_match_a_reference():
    """diloco_ft(codec=Int8(...)): each worker sends its pseudo-gradient plus its residual in 8
    bits and keeps the rest; the average is of what was sent (a replay in numpy)."""
    need_devices(2)
    chunk, syncs = 4, 3
    results = two_workers(syncs * H, codec=Int8(chunk=chunk))
    inner = jax.jit(_inner_step)
    global_params = initial_params()
    outer_state, leaves = OUTER.init(global_params), jax.tree.leaves(global_params)
    inner_states = {r: INNER.init(global_params) for r in (0, 1)}
    residual = {r: np.zeros(sum(x.size for x in leaves), np.float32) for r in (0, 1)}
    for k in range(syncs):
        sent = []
        for r in (0, 1):
            local = global_params
            for i in range(H):
                local, inner_states[r] = inner(local, inner_states[r], batch(r, k * H + i))
            x = np.asarray(flat(global_params), np.float32) - np.asarray(flat(local), np.float32)
            x = x + residual[r]
            sent.append(int8_reference(x, chunk))
            residual[r] = x - sent[-1]
        average = (sent[0] + sent[1]) / np.float32(2)
        treedef = jax.tree.structure(global_params)
        ends = np.cumsum([x.size for x in jax.tree.leaves(global_params)])
        shaped = treedef.unflatten(
            [average[e - x.size : e].reshape(x.shape) for x, e in zip(leaves, ends)]
        )
        updates, outer_state = OUTER.update(shaped, outer_state, global_params)
        global_params = optax.apply_updates(global_params, updates)
    for rank in (0, 1):
        params, synced, state, _ = results[rank]
        assert synced[-1] == (True, 2, (0, 1)) and state.residual.shape == residual[rank].shape
        np.testing.assert_allclose(flat(params), flat(global_params), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.residual, residual[rank], rtol=1e-4, atol=1e-6)
    assert flat(results[0][0]) == flat(results[1][0])


def test_a_run_whose_workers_all_stopped_resumes_from_their_checkpoints(tmp_path):
    """Both workers save after 2 syncs and stop, the service too; restored on a new service,
    they go on to the bits of a run that never stopped (inner and outer state, counters)."""
    import orbax.checkpoint as ocp

    need_devices(2)
    whole, first = two_workers(4 * H), two_workers(2 * H)
    checkpointer = ocp.StandardCheckpointer()
    for rank, (_, _, state, _) in first.items():
        checkpointer.save(tmp_path / f"worker{rank}", state)
    checkpointer.wait_until_finished()

    def restored(run, rank):
        state = run.restore(tmp_path / f"worker{rank}", initial_params())
        assert (state.step, state.sync) == (2 * H, 2) and isinstance(state.step, int)
        return state

    resumed = two_workers(2 * H, start=restored)
    for rank in (0, 1):
        assert resumed[rank][2].sync == 4 and resumed[rank][1][-1] == (True, 2, (0, 1))
        same = jax.tree.map(np.array_equal, resumed[rank][2], whole[rank][2])
        assert all(jax.tree.leaves(same)), rank


# -- 4 worker processes, one killed and restarted -------------------------------------------------


def emit(event, **fields):
    print(json.dumps({"t": time.monotonic(), "event": event, **fields}), flush=True)


def flat(params):
    return [float(x) for x in np.concatenate([np.ravel(x) for x in jax.tree.leaves(params)])]


class DyingQuorum(Quorum):
    """Worker 2's first run with ``where="exchange"``: SIGKILLs itself in sync 2, after the
    quorum's barrier and before it puts its pseudo-gradient."""

    def members(self, sync, timeout=None):
        self.sync = sync
        return super().members(sync, timeout)

    def put(self, key, value):
        if self.sync == 2:
            emit("dying", key=key)
            os.kill(os.getpid(), signal.SIGKILL)
        super().put(key, value)


def worker(address, rank, incarnation, where):
    """Trains until a sync that every worker trained for commits after one that some did not
    (the same decision on every member: it reads the sync's shared metrics only). Worker 2's
    first run SIGKILLs itself in sync 2's round: between two inner steps (``where="round"``) or
    inside the sync's exchange (``where="exchange"``)."""
    dies = rank == 2 and incarnation == 0 and where != "service"
    kind = DyingQuorum if dies and where == "exchange" else Quorum
    q = kind(address, rank, WORKERS, failure_timeout=FAILURE_TIMEOUT)
    run = diloco_ft(
        loss_fn, INNER, OUTER, quorum=q, sync_every=H, sync_timeout=30, service_timeout=30
    )
    state, saw_fewer, deadline = run.init(initial_params()), False, time.monotonic() + 60
    while time.monotonic() < deadline:
        if dies and where == "round" and state.step == KILL_STEP:
            emit("dying", step=state.step)
            os.kill(os.getpid(), signal.SIGKILL)
        state, metrics = run.step(state, batch(rank, state.step))
        time.sleep(PACE)
        if metrics["synced"]:
            keys = ("members", "trained", "joined", "attempts", "reconnects", "bytes_sent")
            emit(
                "sync",
                sync=state.sync - 1,
                step=state.step,
                params=flat(state.global_params),
                **{k: metrics[k] for k in keys},
            )
            saw_fewer |= len(metrics["trained"]) < WORKERS
            if where == "service" and state.sync == SYNCS:
                break
            if where != "service" and saw_fewer and len(metrics["trained"]) == WORKERS:
                break
    q.close()
    emit("closed", sync=state.sync, params=flat(state.global_params))
    sys.exit(0 if time.monotonic() < deadline else 3)


def start_worker(address, rank, incarnation, out_dir, where):
    out = open(os.path.join(out_dir, f"worker{rank}.{incarnation}.jsonl"), "w")
    command = [sys.executable, os.path.abspath(__file__), "worker", address, str(rank)]
    return subprocess.Popen(
        [*command, str(incarnation), where],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=subprocess_env(JAX_PLATFORMS="cpu"),
        cwd=out_dir,
    )


def replay(syncs):
    """The run in one process: per sync, the ranks that trained (in rank order) and the ranks
    that joined (their inner state restarts after it)."""
    inner = jax.jit(lambda p, s, b: _inner_step(p, s, b))
    global_params = initial_params()
    outer_state = OUTER.init(global_params)
    inner_states = {r: INNER.init(global_params) for r in range(WORKERS)}
    for k, (trained, joined) in enumerate(syncs):
        deltas = []
        for r in trained:
            local = global_params
            for i in range(H):
                local, inner_states[r] = inner(local, inner_states[r], batch(r, k * H + i))
            deltas.append(
                np.concatenate(
                    [
                        np.ravel(g - lo)
                        for g, lo in zip(jax.tree.leaves(global_params), jax.tree.leaves(local))
                    ]
                ).astype(np.float32)
            )
        average = deltas[0].copy()
        for d in deltas[1:]:
            average += d
        average = average / np.float32(len(deltas))
        leaves, treedef = jax.tree.flatten(global_params)
        ends = np.cumsum([x.size for x in leaves])
        shaped = treedef.unflatten(
            [average[e - x.size : e].reshape(x.shape) for x, e in zip(leaves, ends)]
        )
        updates, outer_state = OUTER.update(shaped, outer_state, global_params)
        global_params = optax.apply_updates(global_params, updates)
        for r in joined:
            inner_states[r] = INNER.init(global_params)
    return global_params


def _inner_step(params, inner_state, b):
    grads = jax.grad(loss_fn)(params, b)
    updates, inner_state = INNER.update(grads, inner_state, params)
    return optax.apply_updates(params, updates), inner_state


@pytest.mark.parametrize("where", ["round", "exchange"])
def test_four_workers_one_dies_the_others_go_on_and_it_rejoins(tmp_path, where):
    port = free_port()
    service = quorum.host_service(f"[::]:{port}", WORKERS, failure_timeout=FAILURE_TIMEOUT)
    address, log = f"127.0.0.1:{port}", lambda r, i: str(tmp_path / f"worker{r}.{i}.jsonl")
    processes = {(r, 0): start_worker(address, r, 0, tmp_path, where) for r in range(WORKERS)}
    survivors = (0, 1, 3)

    def committed(r, sync):
        return any(e["event"] == "sync" and e["sync"] == sync for e in events(log(r, 0)))

    try:
        wait_for(lambda: processes[2, 0].poll() is not None, 40, "worker 2 to die")
        wait_for(lambda: all(committed(r, 2) for r in survivors), 3 * FAILURE_TIMEOUT, "sync 2")
        processes[2, 1] = start_worker(address, 2, 1, tmp_path, where)
        for key, p in processes.items():
            assert p.wait(timeout=45) == (-signal.SIGKILL if key == (2, 0) else 0), open(
                log(*key)
            ).read()
    finally:
        for p in processes.values():
            p.kill() if p.poll() is None else None
        service.shutdown()
    check_runs({key: events(log(*key)) for key in processes}, survivors, where)


def check_runs(runs, survivors, where):
    syncs = {key: [e for e in run if e["event"] == "sync"] for key, run in runs.items()}
    # before the kill: syncs 0 and 1 with all four; sync 2 among the survivors, within the
    # heartbeat timeout of the kill (and the rest of the round); killed inside the exchange, the
    # survivors' get of its pseudo-gradient times out (failure_timeout too), their commit is
    # False and they redo sync 2 without it
    killed = next(e for e in runs[2, 0] if e["event"] == "dying")["t"]
    for r in survivors:
        first = syncs[r, 0][:3]
        assert [(e["sync"], e["members"], e["trained"]) for e in first] == [
            (0, 4, [0, 1, 2, 3]),
            (1, 4, [0, 1, 2, 3]),
            (2, 3, [0, 1, 3]),
        ], first
        assert first[2]["attempts"] == {"round": 1, "exchange": 2}[where], first[2]
        assert first[2]["t"] - killed < FAILURE_TIMEOUT + 3, first[2]["t"] - killed
    assert [e["sync"] for e in syncs[2, 0]] == [0, 1]
    # the restarted worker joins with its peers' state (excluded from that sync's average),
    # then trains: the last sync has all four on every worker
    joined = syncs[2, 1][0]
    assert joined["joined"] and joined["members"] == 4 and 2 not in joined["trained"]
    assert [e["joined"] for e in syncs[2, 1][1:]] == [False] * (len(syncs[2, 1]) - 1)
    closed = [runs[key][-1] for key in [(r, 0) for r in survivors] + [(2, 1)]]
    assert len({json.dumps([e["event"], e["sync"], e["params"]]) for e in closed}) == 1, closed
    assert all(syncs[key][-1]["trained"] == [0, 1, 2, 3] for key in syncs if key != (2, 0))
    # every worker's global params (and step count) after each sync it committed: the same bits
    # on every worker, the restarted one included
    by_sync = {}
    for run in syncs.values():
        for e in run:
            by_sync.setdefault(e["sync"], set()).add(
                json.dumps([e["params"], e["trained"], e["step"]])
            )
    assert all(len(v) == 1 for v in by_sync.values()), by_sync
    # and those of a replay that averages over the workers that trained in each sync
    order = sorted(by_sync)
    assert order == list(range(len(order)))
    plan = [json.loads(next(iter(by_sync[k])))[1] for k in order]
    joins = [[2] if k == joined["sync"] else [] for k in order]
    expected = flat(replay(list(zip(plan, joins))))
    np.testing.assert_allclose(
        json.loads(next(iter(by_sync[order[-1]])))[0], expected, rtol=1e-5, atol=1e-6
    )


def test_the_service_dies_and_comes_back_and_the_workers_go_on(tmp_path):
    """SIGKILLed between syncs, the service takes every worker's client process with it: the
    workers themselves see ServiceLostError, wait for it, reconnect to the restarted service and
    go on from their state; every sync has the same bits on every worker, those of a replay."""
    port, restart_after = free_port(), 2.0
    address, log = f"127.0.0.1:{port}", lambda r: str(tmp_path / f"worker{r}.0.jsonl")
    service = service_process(port, WORKERS, FAILURE_TIMEOUT)
    workers = [start_worker(address, r, 0, tmp_path, "service") for r in range(WORKERS)]

    def committed(r, sync):
        return any(e["event"] == "sync" and e["sync"] == sync for e in events(log(r)))

    try:
        wait_for(lambda: all(committed(r, 1) for r in range(WORKERS)), 40, "sync 1")
        service.kill()
        service.wait()
        killed = time.monotonic()
        time.sleep(restart_after)
        service = service_process(port, WORKERS, FAILURE_TIMEOUT)
        for r, p in enumerate(workers):
            assert p.wait(timeout=60) == 0, open(log(r)).read()
    finally:
        for p in [*workers, service]:
            p.kill() if p.poll() is None else None
    runs = {r: events(log(r)) for r in range(WORKERS)}
    syncs = {r: [e for e in run if e["event"] == "sync"] for r, run in runs.items()}
    # every worker lived through it: one sync after the restart reconnected, at most a few
    # seconds after it (the wait is bounded by service_timeout)
    for r in range(WORKERS):
        after = [e for e in syncs[r] if e["t"] > killed]
        assert after and after[0]["reconnects"] >= 1, syncs[r]
        assert after[0]["t"] - killed < restart_after + 2 * FAILURE_TIMEOUT, after[0]
        assert sum(e["reconnects"] for e in syncs[r]) == after[0]["reconnects"]
        assert syncs[r][-1]["sync"] == SYNCS - 1 and syncs[r][-1]["trained"] == [0, 1, 2, 3]
    # the same bits on every worker after each sync, and a replay's (a worker whose commit the
    # service's death cut off takes its peers' state: it joined that sync)
    by_sync = {}
    for run in syncs.values():
        for e in run:
            by_sync.setdefault(e["sync"], set()).add(json.dumps([e["params"], e["trained"]]))
    assert sorted(by_sync) == list(range(SYNCS)) and all(len(v) == 1 for v in by_sync.values())
    plan = [json.loads(next(iter(by_sync[k])))[1] for k in range(SYNCS)]
    joins = [[r for r in syncs if any(e["sync"] == k and e["joined"] for e in syncs[r])]
             for k in range(SYNCS)]  # fmt: skip
    expected = flat(replay(list(zip(plan, joins))))
    np.testing.assert_allclose(
        json.loads(next(iter(by_sync[SYNCS - 1])))[0], expected, rtol=1e-5, atol=1e-6
    )


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
