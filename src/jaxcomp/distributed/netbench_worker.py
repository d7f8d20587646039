"""The half of ``jaxcomp netbench`` that runs inside each emulated host.

    python -m jaxcomp.distributed.netbench_worker SPEC

:func:`jaxcomp.distributed.netbench.run_benchmark` starts this once per host of a
:class:`jaxcomp.distributed.cluster.Cluster`, with ``SPEC`` the JSON of a
:class:`jaxcomp.distributed.netbench.Spec`. The job times the compute-only step, probes the network,
then trains the model with each method in turn and times its steps; process 0 writes the results to
``spec.out`` after every method (a failed job keeps what it measured).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import statistics
import sys
import time

from jaxcomp.distributed._memory import peak_resident_bytes, reset_peak_memory, state_bytes
from jaxcomp.distributed.netbench import METHODS, Spec
from jaxcomp.distributed.netbench_workload import optimizer, workload
from jaxcomp.methods import Dense
from jaxcomp.ops import allocator
from jaxcomp.optim import host as host_values

_LOG = logging.getLogger("jaxcomp.distributed")


@dataclasses.dataclass
class _Job:
    """What every method of one job shares: the model, this host's batches and the mesh."""

    spec: Spec
    params: object
    loss_fn: object
    local_batches: list
    about: dict
    mesh: object
    n_hosts: int
    n_params: int

    def global_batch(self, i):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        sharding = NamedSharding(self.mesh, P("data"))
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, x),
            self.local_batches[i % 4],
        )


def _start_job(spec: Spec) -> _Job:
    """Joins the job and builds its workload and mesh (one CPU device per host)."""
    from jaxcomp.distributed import launch

    launch.initialize()
    import jax
    import numpy as np
    from jax.sharding import Mesh

    params, loss_fn, local_batches, about = workload(
        spec, np.random.default_rng(1 + jax.process_index())
    )
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return _Job(
        spec,
        params,
        loss_fn,
        local_batches,
        about,
        Mesh(np.array(devices), ("data",)),
        len(devices),
        sum(x.size for x in jax.tree.leaves(params)),
    )


class _ComputeTimer:
    """The compute-only step: the same gradient and optimizer update on the local device, no
    communication, all hosts at once (they share the machine's cores as in the real steps)."""

    def __init__(self, job: _Job):
        import jax
        import optax

        tx = optimizer(job.spec.optimizer)
        self._device = jax.local_devices()[0]
        self._batches = job.local_batches
        self._spec = job.spec
        self._params = job.params
        self._tx = tx

        def local_step(state, batch):
            p, opt = state
            loss, grads = jax.value_and_grad(job.loss_fn)(p, batch)
            updates, opt = tx.update(grads, opt, p)
            return (optax.apply_updates(p, updates), opt), loss

        self._step = jax.jit(local_step, donate_argnums=(0,) if job.spec.donate else ())
        self._state = None  # made by each measure() and dropped after it

    def _run(self, i):
        import jax

        batch = jax.device_put(self._batches[i % 4], self._device)
        self._state, loss = self._step(self._state, batch)
        jax.block_until_ready(loss)

    def measure(self, label):
        """Median local step, timed after every host compiled and warmed up (they share the
        cores). Its params and Adam state live only while it runs, so that the methods' peak
        memory does not count them (GPT-2: 1.5 GB a host)."""
        import jax
        import jax.numpy as jnp

        local_params = jax.device_put(self._params, self._device)
        if self._spec.donate:
            # device_put of arrays already on the device gives them back, and the donating step
            # would delete the job's own params.
            local_params = jax.tree.map(jnp.copy, local_params)
        self._state = (local_params, self._tx.init(local_params))
        try:
            return self._timed(label)
        finally:
            self._state = None

    def _timed(self, label):
        from jax.experimental import multihost_utils

        for i in range(self._spec.warmup + 1):
            self._run(i)
        multihost_utils.sync_global_devices(label)
        times = []
        for i in range(self._spec.steps):
            start = time.perf_counter()
            self._run(i)
            times.append(time.perf_counter() - start)
        multihost_utils.sync_global_devices(label + " done")
        return statistics.median(times)


def _probe(job: _Job, compute_first):
    """Probes the network (several hosts only); returns ``(network, results)`` before any method."""
    import jaxcomp

    probe_start = time.perf_counter()
    network = jaxcomp.probe_network(job.mesh, "data") if job.n_hosts > 1 else None
    probe_seconds = time.perf_counter() - probe_start
    results = {
        "hosts": job.n_hosts,
        "params": job.n_params,
        **job.about,
        "compute": compute_first,
        "allocator": allocator.started_with(),
        "optimizer": job.spec.optimizer,
        "donate": job.spec.donate,
        "probe": None
        if network is None
        else {"alpha": network.alpha, "beta": network.beta, "seconds": probe_seconds},
        "methods": {},
    }
    return network, results


def _build_step(job: _Job, method, options, shard):
    """The training step of one run and its initial state; ``init_seconds`` None for the pmean."""
    import optax

    import jaxcomp

    if method is None:
        tx = optimizer(job.spec.optimizer)
        step = _plain_pmean_step(job.loss_fn, job.mesh, tx, donate=job.spec.donate, **options)
        return step, step.init(job.params), None
    aggregate = (
        jaxcomp.compress_auto(method, **options)
        if isinstance(method, tuple)
        else jaxcomp.compress(method, **options)
    )
    tx = optax.chain(aggregate, optimizer(job.spec.optimizer))
    dp = jaxcomp.data_parallel(job.loss_fn, tx, job.mesh, shard=shard, donate=job.spec.donate)
    init_start = time.perf_counter()
    state = dp.init(job.params)
    return dp, state, time.perf_counter() - init_start


#: Seconds a host waits at most for its link's counters to stop moving around a method's steps.
_SETTLE = 2.0


def _median_step(job: _Job, run, state, extra_warmup, busy, mark):
    """Runs warm-up then timed steps: ``(state, median seconds, every timed step's seconds, the
    median CPU seconds of this process per timed step, the link's counters before the first
    timed step)``. A call while ``busy()`` (``compress_auto``'s trial of its candidates) is
    untimed too; ``mark()`` reads the counters as the timed steps start."""
    import jax

    times, cpu, before = [], [], None
    warmup = job.spec.warmup + extra_warmup
    calls = 0
    while len(times) < job.spec.steps:
        timed = calls >= warmup and not busy()
        if timed and before is None:
            before = mark()
        batch = job.global_batch(calls)
        start, start_cpu = time.perf_counter(), time.process_time()
        state, loss = run(state, batch)
        jax.block_until_ready(loss)
        calls += 1
        if timed:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return state, statistics.median(times), times, statistics.median(cpu), before


def _timed_run(job: _Job, label, position, step, state, compute_first):
    """One method's steps, timed, with the link's counters around them:
    ``(state, metrics, entry)``."""
    from jax.experimental import multihost_utils

    from jaxcomp.distributed.cluster import INTERFACE, read_interface_counters
    from jaxcomp.training.branches import REPORT_DELAY, pinnable

    metrics_box = {}

    def run(state, batch):
        state, metrics = step.step(state, batch)
        metrics_box.update(metrics)
        return state, metrics["loss"]

    multihost_utils.sync_global_devices(label)
    # The first method also pays for gloo's connections and TCP's ramp-up: two more warm-up steps.
    extra = 2 if position == 0 else 0
    # A choice of several branches reaches the host REPORT_DELAY calls after the device made it
    # (jaxcomp.training.branches), and the chosen branch's step compiles then: untimed too.
    opt_state = getattr(state, "opt_state", None)
    extra += REPORT_DELAY if opt_state is not None and pinnable(opt_state) else 0

    def mark():
        # Settled: the warm-up's last sends have left the tbf queue. Then every host starts its
        # timed steps together (a settle takes each host its own time).
        counters = read_interface_counters(INTERFACE, settle=_SETTLE)
        multihost_utils.sync_global_devices(f"{label}/timed")
        return counters

    # compress_auto's trial of its leading candidates (jaxcomp.training.trial) is untimed too,
    # and its steps (other methods, dense at first) are not counted in the wire's bytes.
    state, median, times, cpu, before = _median_step(
        job, run, state, extra, lambda: getattr(step.step, "in_trial", False), mark
    )
    after = read_interface_counters(INTERFACE, settle=_SETTLE)
    entry = {
        "step": median,
        "times": times,
        # Host 0's CPU seconds a step (every thread of its process): the hosts share this
        # machine's cores, so a method's CPU work shows here where the wall clock hides it.
        "cpu": cpu,
        "sync": median - compute_first,
        "wire_tx": (after[0] - before[0]) / len(times),
        "wire_rx": (after[1] - before[1]) / len(times),
        # This device's share of the training state (params + optimizer state, the
        # error-feedback residual included), from the arrays' shardings, and the process's
        # peak resident memory from this method's init to its last step.
        "state_bytes": state_bytes(state),
        "peak_rss": peak_resident_bytes(),
    }
    return state, metrics_box, entry


def _what_ran(job: _Job, label, method, state, metrics, init_seconds):
    """The method that ran (``auto``'s choice), and the entry's init time and bytes sent."""
    import numpy as np

    import jaxcomp

    if method is None:
        ran = Dense()
        return ran, {"bytes_sent": ran.wire_bytes(job.n_params, job.n_hosts), "ran": label}
    host = {
        k: float(host_values.scalar(v))
        for k, v in metrics.items()
        if k in ("bytes_sent", "density", "gain", "method", "gather_bytes")
    }
    compress = jaxcomp.find_compress_state(state.opt_state)
    ran = compress.methods[int(host.get("method", 0))]
    about = {
        "init": init_seconds,
        # Sharded: the gradient's reduce-scatter plus the params' all-gather.
        "bytes_sent": host.get("bytes_sent", 0.0) + host.get("gather_bytes", 0.0),
        "ran": ran.label,
    }
    if compress.auto is not None:  # the whole steps auto's trial measured, per candidate
        measured = host_values.value(compress.auto.measured).astype(np.float64)
        about["trial"] = {
            m.describe(): float(s) for m, s in zip(compress.methods, measured) if s > 0
        }
    return ran, about


def _run_method(job: _Job, label, position, network, compute_first) -> dict:
    """One method's entry of the results: its step time, wire bytes, memory and predictions."""
    method, options, shard = METHODS[label]
    gc.collect()
    reset_peak_memory()
    step, state, init_seconds = _build_step(job, method, options, shard)
    state, metrics, entry = _timed_run(job, label, position, step, state, compute_first)
    ran, about = _what_ran(job, label, method, state, metrics, init_seconds)
    entry.update(about)
    if network is not None:
        entry.update(
            _predictions(ran, job.params, job.n_hosts, network, compute_first, job.mesh, shard)
        )
    return entry


def _report(job: _Job, results, label, entry, compute_first) -> None:
    """Process 0: a line in the log, and the results so far to ``spec.out``."""
    import jax

    if jax.process_index() != 0:
        return
    _LOG.info(
        "netbench: %s hosts, %s: step %.3f s (compute %.3f s), wire %.1f MB/step",
        job.n_hosts,
        label,
        entry["step"],
        compute_first,
        entry["wire_tx"] / 1e6,
    )
    with open(job.spec.out, "w") as f:  # after every method: a failed job keeps what it measured
        json.dump(results, f)


def _finish(results, compute_first, compute_last) -> None:
    """The smaller of the two compute times counts (noise only ever adds time); every method's
    sync is its step minus that."""
    compute = min(compute_first, compute_last)
    results.update(compute=compute, compute_first=compute_first, compute_last=compute_last)
    for entry in results["methods"].values():
        entry["sync"] = entry["step"] - compute
        if "advise_step" in entry:  # paper 002's step (no overlap) is linear in the compute time
            entry["advise_step"] += compute - compute_first


def run_job(spec: Spec) -> None:
    """Runs one job of the benchmark in this emulated host (every host of the cluster runs it).

    Args:
      spec: what to measure (the models, methods, steps and where process 0 writes the results).

    Returns:
      None; process 0 writes the results as JSON to ``spec.out``.

    Example:
      >>> run_job(Spec(2e5, ("pmean",), 2, 1, 4, 6, "out.json", None))  # doctest: +SKIP

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (measure the step, not the bytes); docs/network.md has the set-up.
    """
    import jax

    job = _start_job(spec)
    timer = _ComputeTimer(job)
    compute_first = timer.measure("compute")
    network, results = _probe(job, compute_first)
    for position, label in enumerate(spec.methods):
        entry = _run_method(job, label, position, network, compute_first)
        results["methods"][label] = entry
        _report(job, results, label, entry, compute_first)
        # Free this method's state and executables before the next (25M params: ~1 GB each), and
        # give the freed heap back: glibc (and the tuned allocator above all) keeps it, and a
        # host running method after method grew until the kernel killed it for memory.
        jax.clear_caches()
        gc.collect()
        allocator.release_host_memory()
    _finish(results, compute_first, timer.measure("compute again"))
    if jax.process_index() == 0:
        with open(spec.out, "w") as f:
            json.dump(results, f)


def _predictions(ran, params, n_hosts, network, compute, mesh, shard=None):
    """The cost model's sync time and paper 002's step time (``jaxcomp advise``) for the method that
    ran.

    Both include the method's local work, measured as ``compress_auto`` measures it
    (:func:`jaxcomp.optim.timing.overhead_seconds`, every host at once). Sharded runs are costed as
    a reduce-scatter plus the params' all-gather (``shard=True``; dense: the same bytes as its
    all-reduce).
    """
    import jax

    from jaxcomp.costmodel import advise, cost
    from jaxcomp.optim.timing import overhead_seconds

    n_params = sum(int(x.size) for x in jax.tree.leaves(params))
    nbytes = 4.0 * n_params
    local = overhead_seconds(ran, params, mesh=mesh, axis_name="data")
    if ran.sends_everything:
        step = advise.sync_sgd_time(nbytes, n_hosts, network, compute, overlap=False, method=ran)
    else:
        step = advise.compressed_time(
            ran,
            nbytes,
            n_hosts,
            network,
            compute,
            encode_decode_seconds=local,
            shard=shard is not None,
        )
    return {
        "predicted_sync": cost.predict(
            ran, nbytes, n_hosts, network, overhead=local, shard=shard is not None
        ),
        "advise_step": step,
        "local_work": local,
    }


class _plain_pmean_step:
    """The baseline without jaxcomp: ``jax.grad`` on varying params, ``lax.pmean`` of the gradients
    (with ``flat``, of one vector of them: ``ravel_pytree``), then ``tx`` (the job's optimizer;
    default Adam); with ``donate``, the step writes the new params and optimizer state over the
    old ones."""

    def __init__(self, loss_fn, mesh, tx=None, flat=False, donate=False):
        import jax
        import optax
        from jax.flatten_util import ravel_pytree
        from jax.sharding import PartitionSpec as P

        from jaxcomp.collectives import baseline

        self.tx = optimizer("adam") if tx is None else tx

        def mean(grads):
            if not flat:
                return baseline.pmean(grads, "data")
            vector, unravel = ravel_pytree(grads)
            return unravel(baseline.pmean(vector, "data"))

        def local(params, opt, batch):
            varying = jax.lax.pcast(params, "data", to="varying")
            loss, grads = jax.value_and_grad(loss_fn)(varying, batch)
            grads = mean(grads)
            updates, opt = self.tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, baseline.pmean(loss, "data")

        self._step = jax.jit(
            jax.shard_map(
                local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())
            ),
            donate_argnums=(0, 1) if donate else (),
        )
        self._donate = donate

    def init(self, params):
        import jax
        import jax.numpy as jnp

        if self._donate:  # the step would delete the caller's params
            params = jax.tree.map(jnp.copy, params)
        return params, self.tx.init(params)

    def step(self, state, batch):
        params, opt, loss = self._step(state[0], state[1], batch)
        return (params, opt), {"loss": loss}


def main(argv=None) -> int:
    """``python -m jaxcomp.distributed.netbench_worker SPEC``: one job, ``SPEC`` a :class:`Spec`
    as JSON."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # the form the launcher used before the worker had its own module
        argv = argv[1:]
    if len(argv) != 1:
        _LOG.error("usage: %s", main.__doc__)
        return 2
    fields = json.loads(argv[0])
    run_job(Spec(**{**fields, "methods": tuple(fields["methods"])}))
    return 0


if __name__ == "__main__":
    # This process's stderr is the workers' log (the cell's log file): its progress lines go there.
    logging.basicConfig(format="%(message)s")
    logging.getLogger("jaxcomp").setLevel(logging.INFO)
    sys.exit(main())
