"""The network benchmark: data-parallel training steps on an emulated cluster, per method and link rate.

    jaxcomp netbench --hosts 2,4 --rates 10gbit,1gbit,100mbit,none --params 25e6 --plot netbench.png
    jaxcomp netbench --hosts 2 --rates 1gbit --model mlp4096,gpt2,resnet50,many_small

For every model, number of hosts and link rate it builds a :class:`jaxcomp.distributed.cluster.Cluster` (one
``jax.distributed`` process with one CPU device per host, gloo over ``tbf``-shaped veth links)
and runs, in one job, a flax model trained by :func:`jaxcomp.data_parallel` with each method: a
plain ``lax.pmean`` of the gradients (no jaxcomp, the baseline users compare with),
``compress("dense")`` at both granularities, every compressed method and ``"auto"``. The model is
a :mod:`jaxcomp.training.zoo` model named by ``--model`` (several: a cell each), or else an MLP of 6
square dense layers of ``--params`` float32 parameters. Per method it reports the median step
time after warm-up, the compute-only step (the same model's gradient and Adam update with no
communication, run by every host at once, since the emulated hosts share this machine's cores),
sync time = step - compute, the bytes the host's ``eth0`` really carried per step (the link's
counters) beside jaxcomp's ``bytes_sent``, the cost model's predicted sync time on the network
probed in the job, paper 002's prediction of the step (what ``jaxcomp advise`` says), the speedup
against the plain ``pmean`` step, and what ``"auto"`` picked.

The worker half runs inside each emulated host (``python -m jaxcomp.distributed.netbench --worker SPEC``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time

from jaxcomp.methods import Cast, Dense, PowerSGD, Quantized, RandomK, Sign, TopK, Zfp


def _runs():
    fixed = (
        Dense(),
        TopK(0.01),
        TopK(0.01, collective="ar"),
        Zfp(8),
        Quantized(4),
        RandomK(0.01),
        Cast("bfloat16"),
        Sign(),
        PowerSGD(4),
    )
    table = {
        "pmean": (None, {}, None),
        fixed[0].label: (fixed[0], {}, None),
        f"{fixed[0].label}_leaf": (fixed[0], {"granularity": "leaf"}, None),
    }
    table.update({m.label: (m, {}, None) for m in fixed[1:]})
    # float16 halves the wire over gloo as bfloat16 does (issue 22 compares both); not an auto candidate.
    table[Cast("float16").label] = (Cast("float16"), {}, None)
    table["auto"] = (fixed, {}, None)
    # Sharded training (data_parallel(shard=...)): the gradient reduce-scattered, the params all-gathered.
    for method in (fixed[0], Zfp(8), Quantized(4), Cast("bfloat16")):
        for shard in ("optimizer", "params"):
            table[f"{method.label}@{shard}"] = (method, {}, shard)
    return table


#: The runs of the benchmark, by label: (a jaxcomp.methods object, a tuple of them for
#: ``compress_auto``'s candidates, or None for the plain pmean; the transformation's keyword
#: arguments; data_parallel's ``shard=``). ``auto`` chooses among the fixed methods; a label
#: ``method@optimizer`` or ``method@params`` runs that method sharded.
METHODS = _runs()

DEFAULT_RATES = ("10gbit", "1gbit", "100mbit", "none")
DEFAULT_HOSTS = (2, 4)
DEFAULT_PARAMS = 25e6
DEFAULT_LAYERS = 6
DEFAULT_BATCH = 4  # rows per host: little compute, as in the issue's set-up


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one job measures (passed to the workers as JSON)."""

    params: float
    methods: tuple[str, ...]
    steps: int
    warmup: int
    batch: int
    layers: int
    out: str
    rate_bits: float | None  # the link rate (None: no limit), recorded with the results
    model: str | None = None  # a jaxcomp.training.zoo name; None: the MLP of `params` and `layers`


def width_for(params: float, layers: int) -> int:
    """The hidden width of an MLP of ``layers`` square dense layers holding about ``params`` parameters.

    Args:
      params: the parameter count wanted.
      layers: square dense layers.

    Returns:
      The width ``w`` with ``layers * w * w`` closest to ``params`` (at least 8).

    Example:
      >>> width_for(25e6, 6)
      2041

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (measure the step, not the bytes); issue 13's set-up.
    """
    return max(8, round(math.sqrt(params / layers)))


# ----------------------------------------------------------------------------------------------
# Worker: runs inside each emulated host.


def _worker(spec: Spec) -> None:
    from jaxcomp.distributed import launch

    launch.initialize()
    import gc

    import jax
    import numpy as np
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxcomp
    from jaxcomp.distributed.cluster import INTERFACE, read_interface_counters

    params, loss_fn, local_batches, about = _workload(
        spec, np.random.default_rng(1 + jax.process_index())
    )
    n_params = sum(x.size for x in jax.tree.leaves(params))

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices), ("data",))
    n_hosts = len(devices)
    sharding = NamedSharding(mesh, P("data"))

    def global_batch(i):
        return jax.tree.map(
            lambda x: jax.make_array_from_process_local_data(sharding, x), local_batches[i % 4]
        )

    def median_step(step, state, make_batch, extra_warmup=0):
        times = []
        warmup = spec.warmup + extra_warmup
        for i in range(warmup + spec.steps):
            batch = make_batch(i)
            start = time.perf_counter()
            state, loss = step(state, batch)
            jax.block_until_ready(loss)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return state, statistics.median(times), times

    # Compute only: the same gradient and Adam update on the local device, no communication, all
    # hosts at once (they share the machine's cores as in the real steps).
    adam = optax.adam(1e-4)
    local_params = jax.device_put(params, jax.local_devices()[0])

    @jax.jit
    def local_step(state, batch):
        p, opt = state
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, opt = adam.update(grads, opt, p)
        return (optax.apply_updates(p, updates), opt), loss

    compute_state = (local_params, adam.init(local_params))

    def local_batch(i):
        return jax.device_put(local_batches[i % 4], jax.local_devices()[0])

    def measure_compute(label):
        """Median local step, timed after every host compiled and warmed up (they share the cores)."""
        nonlocal compute_state
        for i in range(spec.warmup + 1):
            compute_state, loss = local_step(compute_state, local_batch(i))
            jax.block_until_ready(loss)
        multihost_utils.sync_global_devices(label)
        times = []
        for i in range(spec.steps):
            start = time.perf_counter()
            compute_state, loss = local_step(compute_state, local_batch(i))
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        multihost_utils.sync_global_devices(label + " done")
        return statistics.median(times)

    compute_first = measure_compute("compute")

    probe_start = time.perf_counter()
    network = jaxcomp.probe_network(mesh, "data") if n_hosts > 1 else None
    probe_seconds = time.perf_counter() - probe_start
    results = {
        "hosts": n_hosts,
        "params": n_params,
        **about,
        "compute": compute_first,
        "probe": None
        if network is None
        else {"alpha": network.alpha, "beta": network.beta, "seconds": probe_seconds},
        "methods": {},
    }

    for position, label in enumerate(spec.methods):
        method, options, shard = METHODS[label]
        gc.collect()
        _reset_peak_memory()
        if method is None:
            step = _plain_pmean_step(loss_fn, mesh)
            state = step.init(params)
        else:
            aggregate = (
                jaxcomp.compress_auto(method, **options)
                if isinstance(method, tuple)
                else jaxcomp.compress(method, **options)
            )
            tx = optax.chain(aggregate, optax.adam(1e-4))
            dp = jaxcomp.data_parallel(loss_fn, tx, mesh, shard=shard)
            init_start = time.perf_counter()
            state = dp.init(params)
            init_seconds = time.perf_counter() - init_start
            step = dp
            del dp, tx
        metrics_box = {}

        def run(state, batch, step=step):
            state, metrics = step.step(state, batch)
            metrics_box.update(metrics)
            return state, metrics["loss"]

        multihost_utils.sync_global_devices(label)
        # The first method also pays for gloo's connections and TCP's ramp-up: two more warm-up steps.
        extra = 2 if position == 0 else 0
        before = read_interface_counters(INTERFACE)
        state, median, times = median_step(run, state, global_batch, extra)
        after = read_interface_counters(INTERFACE)
        steps_counted = spec.warmup + extra + spec.steps
        entry = {
            "step": median,
            "times": times,
            "sync": median - compute_first,
            "wire_tx": (after[0] - before[0]) / steps_counted,
            "wire_rx": (after[1] - before[1]) / steps_counted,
            # This device's share of the training state (params + optimizer state, the
            # error-feedback residual included), from the arrays' shardings, and the process's
            # peak resident memory from this method's init to its last step.
            "state_bytes": _state_bytes(state),
            "peak_rss": _peak_resident_bytes(),
        }
        if method is not None:
            entry["init"] = init_seconds
            host = {
                k: float(np.asarray(v.addressable_data(0)))
                for k, v in metrics_box.items()
                if k in ("bytes_sent", "density", "gain", "method", "gather_bytes")
            }
            # Sharded: the gradient's reduce-scatter plus the params' all-gather.
            entry["bytes_sent"] = host.get("bytes_sent", 0.0) + host.get("gather_bytes", 0.0)
            ran = jaxcomp.find_compress_state(state.opt_state).methods[int(host.get("method", 0))]
            entry["ran"] = ran.label
        else:
            ran = Dense()
            entry["bytes_sent"] = ran.wire_bytes(n_params, n_hosts)
            entry["ran"] = label
        if network is not None:
            entry.update(_predictions(ran, params, n_hosts, network, compute_first, mesh, shard))
        results["methods"][label] = entry
        if jax.process_index() == 0:
            print(
                f"netbench: {n_hosts} hosts, {label}: step {median:.3f} s (compute {compute_first:.3f} s), "
                f"wire {entry['wire_tx'] / 1e6:.1f} MB/step",
                file=sys.stderr,
                flush=True,
            )
            with open(
                spec.out, "w"
            ) as f:  # after every method: a failed job keeps what it measured
                json.dump(results, f)
        # Free this method's state and executables before the next (25M params: ~1 GB each).
        del state, step, run
        metrics_box.clear()
        jax.clear_caches()
        gc.collect()
    # Compute again at the end; the smaller of the two counts (noise only ever adds time), and
    # every method's sync is its step minus that.
    compute_last = measure_compute("compute again")
    compute = min(compute_first, compute_last)
    results.update(compute=compute, compute_first=compute_first, compute_last=compute_last)
    for entry in results["methods"].values():
        entry["sync"] = entry["step"] - compute
        if "advise_step" in entry:  # paper 002's step (no overlap) is linear in the compute time
            entry["advise_step"] += compute - compute_first
    if jax.process_index() == 0:
        with open(spec.out, "w") as f:
            json.dump(results, f)


def _workload(spec: Spec, rng):
    """What the job trains: ``(params, loss_fn, local_batches, about)``.

    ``spec.model`` names a :mod:`jaxcomp.training.zoo` model; None is the MLP of ``spec.layers`` square dense
    layers of about ``spec.params`` parameters. ``local_batches`` are four of this host's batches of
    ``spec.batch`` rows drawn from ``rng``; ``about`` is what the results record of the model.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    if spec.model is not None:
        from jaxcomp.training import zoo

        model = zoo.build(spec.model)
        batches = [model.make_batch(rng, spec.batch) for _ in range(4)]
        return (
            model.params,
            model.loss_fn,
            batches,
            {"model": spec.model, "leaves": model.n_leaves, "width": None},
        )
    width = width_for(spec.params, spec.layers)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(spec.layers):
                x = nn.Dense(width)(x)
                if i < spec.layers - 1:
                    x = jnp.tanh(x)
            return x

    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, width)))

    def loss_fn(p, batch):
        return jnp.mean((model.apply(p, batch["x"]) - batch["y"]) ** 2)

    batches = [
        {
            "x": rng.normal(size=(spec.batch, width)).astype(np.float32),
            "y": rng.normal(size=(spec.batch, width)).astype(np.float32),
        }
        for _ in range(4)
    ]
    about = {
        "model": f"mlp_{spec.layers}x{width}",
        "leaves": len(jax.tree.leaves(params)),
        "width": width,
    }
    return params, loss_fn, batches, about


def _state_bytes(state) -> int:
    """Bytes of ``state``'s arrays on this process's first device (its shard of each)."""
    import jax

    return sum(
        leaf.addressable_shards[0].data.nbytes
        for leaf in jax.tree.leaves(state)
        if isinstance(leaf, jax.Array)
    )


def _reset_peak_memory() -> None:
    """Starts a new peak of this process's resident memory (Linux: ``5`` to
    ``/proc/self/clear_refs`` resets ``VmHWM``); does nothing where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_resident_bytes() -> int:
    """This process's peak resident memory since :func:`_reset_peak_memory` (``VmHWM``), 0 where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _predictions(ran, params, n_hosts, network, compute, mesh, shard=None):
    """The cost model's sync time and paper 002's step time (``jaxcomp advise``) for the method that ran.

    Both include the method's local work, measured as ``compress_auto`` measures it
    (:func:`jaxcomp.optim.timing.overhead_seconds`, every host at once). Sharded runs are costed as a
    reduce-scatter plus the params' all-gather (``shard=True``; dense: the same bytes as its all-reduce).
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
    """The baseline without jaxcomp: ``jax.grad`` on varying params, ``lax.pmean`` of the gradients, Adam."""

    def __init__(self, loss_fn, mesh):
        import jax
        import optax
        from jax.sharding import PartitionSpec as P

        self.tx = optax.adam(1e-4)

        def local(params, opt, batch):
            varying = jax.lax.pcast(params, "data", to="varying")
            loss, grads = jax.value_and_grad(loss_fn)(varying, batch)
            grads = jax.lax.pmean(grads, "data")
            updates, opt = self.tx.update(grads, opt, params)
            return optax.apply_updates(params, updates), opt, jax.lax.pmean(loss, "data")

        self._step = jax.jit(
            jax.shard_map(
                local, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=(P(), P(), P())
            )
        )

    def init(self, params):
        return params, self.tx.init(params)

    def step(self, state, batch):
        params, opt, loss = self._step(state[0], state[1], batch)
        return (params, opt), {"loss": loss}


# ----------------------------------------------------------------------------------------------
# Controller: builds the clusters, runs the jobs, prints the table.


def run_benchmark(
    hosts=DEFAULT_HOSTS,
    rates=DEFAULT_RATES,
    *,
    params=DEFAULT_PARAMS,
    methods=tuple(METHODS),
    steps=3,
    warmup=1,
    batch=DEFAULT_BATCH,
    layers=DEFAULT_LAYERS,
    timeout=1800,
    progress=True,
    log=None,
    on_cell=None,
    models=None,
) -> list[dict]:
    """Runs every (model, hosts, rate) cell on an emulated cluster; returns one row per cell and method.

    Args:
      hosts: numbers of emulated hosts.
      rates: link rates (``"1gbit"``, ``"none"`` for no limit).
      params: parameters (float32) of the MLP trained when ``models`` is None.
      methods: labels from :data:`METHODS`; ``"pmean"`` is the baseline speedups are measured
        against and always runs.
      steps: timed steps per method (the median counts), after ``warmup`` untimed ones.
      batch: rows (sequences, images) per host.
      layers: dense layers of the MLP trained when ``models`` is None.
      timeout: seconds per cell before its processes are killed.
      progress: show a progress bar (tqdm) over the cells.
      log: file the workers' output goes to (default: discarded unless a cell fails).
      on_cell: called with all rows so far after each cell (to save partial results).
      models: :data:`jaxcomp.training.zoo.NAMES` to train, one cell per model, host count and rate; None
        trains the MLP of ``params`` and ``layers``.

    Returns:
      A list of dicts, one per (model, hosts, rate, method); ``"model"`` names the model.

    Example:
      >>> rows = run_benchmark((2,), ("1gbit",), models=("resnet50",), methods=("ar_topk",))  # doctest: +SKIP

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (measure the step, not the bytes); issue 13's set-up.
    """
    from jaxcomp.distributed.cluster import check_support, format_rate, parse_rate
    from jaxcomp.training import zoo

    check_support()
    methods = tuple(dict.fromkeys(("pmean",) + tuple(methods)))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods must be among {tuple(METHODS)}, got {unknown}")
    if models is not None and (not tuple(models) or any(m not in zoo.NAMES for m in models)):
        raise ValueError(f"models must be None or names among {zoo.NAMES}, got {models}")
    models = (None,) if models is None else tuple(models)
    cells = [(m, h, r) for m in models for h in hosts for r in rates]
    bar = _progress(len(cells), progress)
    rows = []
    try:
        for model, n_hosts, rate in cells:
            rate_bits = parse_rate(rate)
            bar.set_description(f"{model or 'mlp'}, {n_hosts} hosts, {format_rate(rate_bits)}")
            with tempfile.TemporaryDirectory() as tmp:
                spec = Spec(
                    params=float(params),
                    methods=methods,
                    steps=steps,
                    warmup=warmup,
                    batch=batch,
                    layers=layers,
                    out=os.path.join(tmp, "result.json"),
                    rate_bits=rate_bits,
                    model=model,
                )
                result = _run_cell(
                    spec, n_hosts, timeout, log or os.path.join(tmp, "workers.log"), tmp
                )
            base = result["methods"]["pmean"]["step"]
            for label, entry in result["methods"].items():
                rows.append(
                    {
                        "model": result.get("model"),
                        "hosts": n_hosts,
                        "rate": format_rate(rate_bits),
                        "method": label,
                        "params": result["params"],
                        "leaves": result.get("leaves"),
                        "compute": result["compute"],
                        "probe": result["probe"],
                        "speedup": base / entry["step"],
                        **entry,
                    }
                )
            bar.update(1)
            if on_cell is not None:
                on_cell(rows)
    finally:
        bar.close()
    return rows


def _run_cell(spec: Spec, n_hosts: int, timeout: float, log_path: str, cwd: str) -> dict:
    """One job of ``spec`` on a fresh cluster of ``n_hosts``; the workers' results (host 0's JSON)."""
    from jaxcomp.distributed.cluster import Cluster, ClusterError, format_rate

    with open(log_path, "a") as out, Cluster(n_hosts, rate=spec.rate_bits) as cluster:
        # cwd: `-m` puts it first on sys.path, and a source checkout there would shadow the
        # installed package.
        codes = cluster.run(
            [
                "-m",
                "jaxcomp.distributed.netbench",
                "--worker",
                json.dumps(dataclasses.asdict(spec)),
            ],
            timeout=timeout,
            stdout=out,
            stderr=out,
            cwd=cwd,
        )
    if any(codes) or not os.path.exists(spec.out):
        with open(log_path) as f:
            tail = f.read()[-3000:]
        what = f"{spec.model} " if spec.model else ""
        raise ClusterError(
            f"the {n_hosts}-host {what}job at {format_rate(spec.rate_bits)} failed (exit codes "
            f"{codes}); the workers' output ends with:\n{tail}"
        )
    with open(spec.out) as f:
        return json.load(f)


def _progress(total, enabled):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the progress bar is optional
        tqdm = None
    if tqdm is None or not enabled:

        class _Quiet:
            def set_description(self, text):
                if enabled:
                    print(text, file=sys.stderr, flush=True)

            def update(self, n):
                pass

            def close(self):
                pass

        return _Quiet()
    return tqdm(total=total, unit="cell", file=sys.stderr)


def _mb(value):
    return "-" if value is None else f"{value / 1e6:.1f}"


def _s(value):
    return "-" if value is None else f"{value:.3f}"


def table(rows) -> str:
    """The markdown table of :func:`run_benchmark`'s rows.

    Args:
      rows: the rows :func:`run_benchmark` returns.

    Returns:
      A markdown table, one line per row; rows without a ``"model"`` (older results) show ``-``.

    Example:
      >>> table([]).splitlines()[0].split(" | ")[:4]
      ['| model', 'hosts', 'rate', 'method']

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (measure the step, not the bytes); issue 13's set-up.
    """
    lines = [
        "| model | hosts | rate | method | step s | compute s | sync s | predicted sync s | advise step s | "
        "wire MB/step/host | bytes_sent MB | sync: dense / this | speedup vs pmean | ran | state MB/host | "
        "peak RSS MB/host |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    dense_sync = {
        (r.get("model"), r["hosts"], r["rate"]): r["sync"]
        for r in rows
        if r["method"] == Dense().label
    }
    for r in rows:
        base = dense_sync.get((r.get("model"), r["hosts"], r["rate"]))
        ratio = f"{base / r['sync']:.1f}x" if base and base > 0 and r["sync"] > 0 else "-"
        lines.append(
            f"| {r.get('model') or '-'} | {r['hosts']} | {r['rate']} | {r['method']} | {_s(r['step'])} | "
            f"{_s(r['compute'])} | {_s(r['sync'])} | {_s(r.get('predicted_sync'))} | "
            f"{_s(r.get('advise_step'))} | "
            f"{_mb(r['wire_tx'])} | {_mb(r.get('bytes_sent'))} | {ratio} | {r['speedup']:.2f}x | "
            f"{r['ran']} | {_mb(r.get('state_bytes'))} | {_mb(r.get('peak_rss'))} |"
        )
    return "\n".join(lines)


def plot(rows, path) -> None:
    """Speedup against link rate per method (measured points) beside the cost model's curve.

    One panel per model (a row of panels each) and host count; a method's dashed line is the cost
    model's step time of the plain pmean over the method's (compute + predicted sync), at the rates
    measured.

    Args:
      rows: the rows :func:`run_benchmark` returns.
      path: the PNG to write.

    Returns:
      None.

    Example:
      >>> plot(rows, "netbench.png")  # doctest: +SKIP

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (measure the step, not the bytes); issue 13's set-up.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from jaxcomp.distributed.cluster import parse_rate

    models = list(dict.fromkeys(r.get("model") for r in rows))
    hosts = sorted({r["hosts"] for r in rows})
    fig, axes = plt.subplots(
        len(models), len(hosts), figsize=(6 * len(hosts), 4.5 * len(models)), squeeze=False
    )
    for row, model in zip(axes, models):
        for ax, n in zip(row, hosts):
            cell = [
                r
                for r in rows
                if r.get("model") == model and r["hosts"] == n and parse_rate(r["rate"]) is not None
            ]
            _plot_panel(ax, cell)
            ax.set_title(
                f"{model + ', ' if model else ''}{n} emulated hosts (points: measured, dashed: cost model)"
            )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _plot_panel(ax, cell):
    """One model's and host count's speedups against the rate: measured points, the cost model's dashes."""
    from jaxcomp.distributed.cluster import parse_rate

    for method in dict.fromkeys(r["method"] for r in cell):
        if method == "pmean":
            continue
        points = sorted(
            (parse_rate(r["rate"]), r["speedup"], r.get("predicted_sync"), r["compute"])
            for r in cell
            if r["method"] == method
        )
        (line,) = ax.plot(
            [p[0] / 1e9 for p in points], [p[1] for p in points], "o", label=f"{method} measured"
        )
        base = {parse_rate(r["rate"]): r for r in cell if r["method"] == "pmean"}
        model = [
            (p[0] / 1e9, (base[p[0]]["compute"] + base[p[0]]["predicted_sync"]) / (p[3] + p[2]))
            for p in points
            if p[2] is not None and base.get(p[0], {}).get("predicted_sync") is not None
        ]
        if model:
            ax.plot(
                [m[0] for m in model],
                [m[1] for m in model],
                "--",
                color=line.get_color(),
                alpha=0.6,
            )
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("link rate, Gbit/s")
    ax.set_ylabel("step speedup vs plain pmean")
    ax.legend(fontsize=7)


def _parser() -> argparse.ArgumentParser:
    from jaxcomp.training import zoo

    parser = argparse.ArgumentParser(prog="jaxcomp netbench", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--hosts",
        default=",".join(map(str, DEFAULT_HOSTS)),
        help="emulated host counts (default 2,4)",
    )
    parser.add_argument(
        "--rates",
        default=",".join(DEFAULT_RATES),
        help=f"link rates, 'none' for no limit (default {','.join(DEFAULT_RATES)})",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="NAME[,NAME...]",
        help=f"train these jaxcomp.training.zoo models, one cell each, from {','.join(zoo.NAMES)} "
        "(default: the MLP of --params)",
    )
    parser.add_argument(
        "--params",
        type=float,
        default=None,
        help="parameters of the MLP of 6 square layers trained without --model (default 25e6)",
    )
    parser.add_argument("--methods", default=",".join(METHODS), help=f"from {','.join(METHODS)}")
    parser.add_argument(
        "--steps", type=int, default=3, help="timed steps per method, the median counts (default 3)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument(
        "--batch",
        type=int,
        default=DEFAULT_BATCH,
        help="rows (sequences, images) per host (default 4)",
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds per cell (default 1800)"
    )
    parser.add_argument("--plot", default=None, help="write the speedup plot (PNG) here")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument("--log", default=None, help="append the workers' output here")
    return parser


def _names(text):
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _checked_args(parser, args):
    """The flags' values, checked before any cluster is built: (hosts, rates, methods, models)."""
    from jaxcomp.distributed.cluster import parse_rate
    from jaxcomp.training import zoo

    try:
        hosts = tuple(int(h) for h in args.hosts.split(","))
        if any(h < 1 for h in hosts):
            raise ValueError
    except ValueError:
        parser.error(f"--hosts must be positive integers separated by commas, got {args.hosts!r}")
    rates, methods = _names(args.rates), _names(args.methods)
    try:
        for rate in rates:
            parse_rate(rate)
    except ValueError as e:
        parser.error(f"--rates: {e}")
    if not rates:
        parser.error("--rates names no rate")
    if any(m not in METHODS for m in methods) or not methods:
        parser.error(f"--methods must be among {','.join(METHODS)}, got {args.methods!r}")
    models = None if args.model is None else _names(args.model)
    if models is not None and (not models or any(m not in zoo.NAMES for m in models)):
        parser.error(f"--model must be among {','.join(zoo.NAMES)}, got {args.model!r}")
    if models is not None and args.params is not None:
        parser.error(
            "--params sizes the MLP trained without --model: give one of --model and --params"
        )
    if args.params is not None and not (args.params >= 1000 and math.isfinite(args.params)):
        parser.error(f"--params must be a finite number >= 1000, got {args.params}")
    for name in ("steps", "batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    for path in (args.plot, args.json):
        if path and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            parser.error(f"the folder of {path!r} does not exist")
    return hosts, rates, methods, models


def main(argv=None) -> int:
    """``jaxcomp netbench [--hosts 2,4] [--rates ...] [--model resnet50,gpt2 | --params 25e6] [--plot out.png]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        _worker(Spec(**{**json.loads(argv[1]), "methods": tuple(json.loads(argv[1])["methods"])}))
        return 0
    parser = _parser()
    args = parser.parse_args(argv)
    hosts, rates, methods, models = _checked_args(parser, args)
    params = DEFAULT_PARAMS if args.params is None else args.params

    def save(rows):
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)

    from jaxcomp.distributed.cluster import ClusterError, sigterm_as_interrupt

    try:
        with sigterm_as_interrupt():  # `kill` tears the cluster down too
            rows = run_benchmark(
                hosts,
                rates,
                params=params,
                methods=methods,
                steps=args.steps,
                warmup=args.warmup,
                batch=args.batch,
                timeout=args.timeout,
                log=args.log,
                on_cell=save,
                models=models,
            )
    except ClusterError as e:
        print(f"jaxcomp netbench: {e}", file=sys.stderr)
        return 2
    print(table(rows))
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
