"""One worker of a fault-tolerant DiLoCo time-to-quality run (``jaxcomp netbench --to-loss
--fault-tolerant``, :mod:`jaxcomp.cli.to_loss_ft`), and the coordination service's process.

The worker is a JAX program of its own (no ``jax.distributed``): it trains the char-LM of time
to quality (:mod:`jaxcomp.training.charlm`) with :func:`jaxcomp.distributed.diloco_ft.diloco_ft`,
Adam on :func:`charlm.schedule` inside and plain averaging (``optax.sgd(1.0)``) outside, on its
rows of every batch, and prints one JSON line per event on stdout: ``ready``, ``sync`` (after
every committed sync), ``eval`` (the held-out loss of the global params, every ``eval_every``
steps) and ``done``. Every worker evaluates the same global params (the same bits after a sync)
at the same steps, so every worker stops at the same sync: at the target, or at ``max_steps``.
The clock leaves out the compilation and the evaluations, as :mod:`jaxcomp.training.to_loss_loop`
does; a worker connects to the quorum after its compilation.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

from jaxcomp.distributed.quorum import Quorum


def emit(event: str, **fields) -> None:
    """One JSON line on stdout, with ``time.monotonic()`` (the machine's one clock)."""
    print(json.dumps({"event": event, "t": time.monotonic(), **fields}), flush=True)


class _LateQuorum:
    """The worker's :class:`Quorum`, connected by :meth:`connect` once the worker has compiled:
    until then the others' barriers do not wait for it."""

    def __init__(self, address, rank, num_workers, failure_timeout):
        self.rank, self.num_workers, self._quorum = rank, num_workers, None
        self._args = (address, rank, num_workers, failure_timeout)

    def connect(self):
        self._quorum = Quorum(*self._args)

    def close(self):
        self._quorum.close()

    def members(self, sync, timeout=None):
        return self._quorum.members(sync, timeout)

    def commit(self, sync, timeout=None):
        return self._quorum.commit(sync, timeout)

    def put(self, key, value):
        return self._quorum.put(key, value)

    def get(self, key, timeout=None):
        return self._quorum.get(key, timeout)

    def reconnect(self, timeout=None):
        return self._quorum.reconnect(timeout)


class _Clock:
    """Wall-clock and CPU seconds of the training, with evaluations left out."""

    def __init__(self):
        self.seconds = self.cpu = 0.0
        self.start()

    def start(self):
        self._wall, self._cpu = time.perf_counter(), time.process_time()

    def stop(self):
        self.seconds += time.perf_counter() - self._wall
        self.cpu += time.process_time() - self._cpu


def _digest(params) -> str:
    import jax
    import numpy as np

    leaves = jax.tree.leaves(params)
    return hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in leaves)).hexdigest()[:16]


def _wire():
    """Bytes this emulated host's ``eth0`` has sent, or None off the cluster."""
    from jaxcomp.distributed.cluster import ClusterError, read_interface_counters

    try:
        return read_interface_counters()[0]
    except ClusterError:
        return None


def _setup(options: dict):
    """The worker's run (compiled), state, batch function and evaluation."""
    import dataclasses

    import jax
    import optax

    from jaxcomp.distributed.diloco_ft import diloco_ft
    from jaxcomp.distributed.ft_codecs import Int8
    from jaxcomp.training import charlm

    base = charlm.QUICK if options["model"] == "quick" else charlm.MODELS[options["model"]]
    config = dataclasses.replace(base, steps=options["steps"])
    corpus = charlm.load_corpus()
    loss_fn, params, heldout = charlm.task(config, corpus, options["seed"])
    windows = charlm.batches(corpus[0], config, options["max_steps"], options["seed"])
    rank, workers = options["rank"], options["workers"]
    per = config.batch // workers
    mine = slice(rank * per, (rank + 1) * per)
    quorum = _LateQuorum(options["address"], rank, workers, options["failure_timeout"])
    run = diloco_ft(
        loss_fn,
        optax.adam(charlm.schedule(config)),
        optax.sgd(1.0),  # plain averaging, the diloco-h50-avg row's outer step
        quorum=quorum,
        sync_every=options["sync_every"],
        sync_timeout=options["sync_timeout"],
        codec=Int8() if options.get("compress") == "int8" else None,
        eager=bool(options.get("eager")),
    )
    state = run.init(params)
    batch = lambda step: {"tokens": corpus[0][windows[step][mine]]}  # noqa: E731
    jax.block_until_ready(run.step(state, batch(0)))  # compiled before the clock; dropped
    evaluate = jax.jit(loss_fn)
    return run, state, batch, lambda p: float(evaluate(p, heldout)), quorum


def train(options: dict) -> None:
    """Trains this worker until an evaluation reaches ``options["target"]`` or
    ``options["max_steps"]``, printing its events (see the module's docstring)."""
    run, state, batch, evaluate, quorum = _setup(options)
    quorum.connect()
    every, target, wire0 = options["eval_every"], options.get("target"), _wire()
    emit("ready", step=state.step, cpu_total=time.process_time())
    if options["incarnation"] == 0:  # the curve's step 0 (a restarted worker's is not the run's)
        emit("eval", step=0, seconds=0.0, cpu=0.0, loss=evaluate(state.global_params), bytes=0)
    clock, sent, reason = _Clock(), 0, "max_steps"
    while state.step < options["max_steps"]:
        state, metrics = run.step(state, batch(state.step))
        sent += metrics["bytes_sent"]
        if options["pace"]:  # seconds a step that stand for a slower model (the tests)
            time.sleep(options["pace"])
        if not metrics["synced"]:
            continue
        keys = ("members", "trained", "joined", "attempts", "reconnects")
        keys += ("exchange_seconds", "waited")
        emit("sync", step=state.step, sync=state.sync - 1, cpu_total=time.process_time(),
             **{k: metrics[k] for k in keys})  # fmt: skip
        if state.step % every and state.step < options["max_steps"]:
            continue
        current = run.params(state)  # eager: waits for the exchange in flight, on the clock
        clock.stop()
        loss = evaluate(current)
        wired = None if wire0 is None else _wire() - wire0
        emit("eval", step=state.step, seconds=clock.seconds, cpu=clock.cpu, loss=loss,
             bytes=sent, wire=wired)  # fmt: skip
        clock.start()
        if target is not None and loss <= target:
            reason = "target"
            break
    final = run.params(state)  # eager: the exchange in flight ends before the quorum closes
    quorum.close()
    emit("done", step=state.step, sync=state.sync, reason=reason, cpu_total=time.process_time(),
         params=_digest(final))  # fmt: skip


def serve(bind_address: str, workers: int, failure_timeout: float) -> None:
    """Hosts the coordination service until stdin closes (the launcher's end)."""
    from jaxcomp.distributed.quorum import host_service

    service = host_service(bind_address, workers, failure_timeout=failure_timeout)
    print("READY", flush=True)
    sys.stdin.read()
    service.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    else:
        train(json.loads(sys.argv[2]))
