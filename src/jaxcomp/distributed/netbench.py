"""The network benchmark: data-parallel training steps on an emulated cluster, per method and link
rate.

    jaxcomp netbench --hosts 2,4 --rates 10gbit,1gbit,100mbit,none --params 25e6 --plot netbench.png
    jaxcomp netbench --hosts 2 --rates 1gbit --model mlp4096,gpt2,resnet50,many_small

For every model, number of hosts and link rate it builds a
:class:`jaxcomp.distributed.cluster.Cluster` (one ``jax.distributed`` process with one CPU device
per host, gloo over ``tbf``-shaped veth links) and runs, in one job, a flax model trained by
:func:`jaxcomp.data_parallel` with each method: a plain ``lax.pmean`` of the gradients (no jaxcomp,
the baseline users compare with), the same of one vector of them (``pmean_flat``: XLA:CPU runs a
``pmean`` of many leaves as one collective per leaf), ``compress("dense")`` at both granularities,
every compressed method and ``"auto"``. The model is a :mod:`jaxcomp.training.zoo` model named by
``--model`` (several: a cell each), or else an MLP of 6 square dense layers of ``--params`` float32
parameters. Per method it reports the median step time after warm-up, the compute-only step (the
same model's gradient and Adam update with no communication, run by every host at once, since the
emulated hosts share this machine's cores), sync time = step - compute, the bytes the host's
``eth0`` really carried per step (the link's counters) beside jaxcomp's ``bytes_sent``, the cost
model's predicted sync time on the network probed in the job, paper 002's prediction of the step
(what ``jaxcomp advise`` says), the speedup against the plain ``pmean`` step and against the
faster of ``pmean`` and ``pmean_flat`` (the plain step a user would keep), and what ``"auto"``
picked.

This module runs the benchmark (:func:`run_benchmark`: the clusters, one job per cell); the half
that runs inside each emulated host is :mod:`jaxcomp.distributed.netbench_worker`, and the command
line (its flags, the table, the plot, the progress bar) is :mod:`jaxcomp.cli.netbench`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile

from jaxcomp.methods import QUALITY_SAFE, Cast, Dense, PowerSGD, Quantized, RandomK, Sign, TopK, Zfp
from jaxcomp.ops import allocator as allocator_module

_LOG = logging.getLogger("jaxcomp.distributed")


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
        # The same sum as one vector (jax.flatten_util.ravel_pytree): XLA:CPU runs pmean's merged
        # all-reduce as one collective per leaf, which a model of many leaves pays for.
        "pmean_flat": (None, {"flat": True}, None),
        fixed[0].label: (fixed[0], {}, None),
        f"{fixed[0].label}_leaf": (fixed[0], {"granularity": "leaf"}, None),
    }
    table.update({m.label: (m, {}, None) for m in fixed[1:]})
    # DDP-style buckets of 25 MiB, sent while the backward pass runs (compress(bucket_mb=)): the
    # default of dense and the casts (Method.buckets_by_default), whose "_nobucket" rows send one
    # message after the backward pass; a "_bucket" row for every other fixed method but PowerSGD
    # (which works matrix by matrix).
    fp16 = Cast("float16")
    for method in [m for m in fixed if not isinstance(m, PowerSGD)] + [fp16]:
        if method.buckets_by_default:
            table[f"{method.label}_nobucket"] = (method, {"bucket_mb": None}, None)
        else:
            table[f"{method.label}_bucket"] = (method, {"bucket_mb": 25}, None)
    # float16 halves the wire over gloo as bfloat16 does (docs/performance.md, "float16 by the
    # ring"); not an auto candidate. "fp16_unscaled": without its scales, as PyTorch's hook.
    table[fp16.label] = (fp16, {}, None)
    table["fp16_unscaled"] = (Cast("float16", scale=False), {}, None)
    # The casts with error feedback: their default is without (Method.feeds_back_by_default).
    for method in (Cast("bfloat16"), fp16):
        table[f"{method.label}_ef"] = (method, {"error_feedback": True}, None)
    # 1-bit Adam's compressed all-reduce: the ring whose messages are signs (2/N of the
    # all-gather's bytes, 2 (N-1) steps).
    table[Sign(aggregation="ring").label] = (Sign(aggregation="ring"), {}, None)
    # AR-Topk with the paper's leader (STAR: one device's k indices, round-robin; the default is
    # SPLIT, every device picking k/N of them). Not an auto candidate.
    star = TopK(0.01, collective="ar", leader="star")
    table[star.label] = (star, {}, None)
    # PowerSGD's factors as float16 (the quality pairing sends rank 12 so): rank 4 beside the
    # float32 row, what the 16-bit ring costs a step. Not an auto candidate.
    half = PowerSGD(4, dtype="float16")
    table[half.label] = (half, {}, None)
    table["auto"] = (fixed, {}, None)
    # compress("auto")'s default: the candidates that keep a plain optimizer's quality (dense,
    # the bfloat16 cast, ZFP 8), none of them sparse.
    table["auto_safe"] = (QUALITY_SAFE, {}, None)
    table["auto_safe_bucket"] = (QUALITY_SAFE, {"bucket_mb": 25}, None)
    # Sharded training (data_parallel(shard=...)): the gradient reduce-scattered, the params
    # all-gathered.
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
DEFAULT_BATCH = 4  # rows per host: little compute, so that the network is what is measured
#: The optimizers every step of a job can use after the gradients' mean (learning rate 1e-4):
#: ``"adam"`` (the default) or ``"sgd"`` (plain SGD, what ``benchmarks/peers.py``'s torch rows
#: run by default: the same per-step optimizer work on both sides).
OPTIMIZERS = ("adam", "sgd")


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
    optimizer: str = "adam"  # one of OPTIMIZERS, after the mean in every step
    donate: bool = False  # every step donates its input state (data_parallel(donate=True))


def width_for(params: float, layers: int) -> int:
    """The hidden width of an MLP of ``layers`` square dense layers holding about ``params``
    parameters.

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
      MLSys 2022 (measure the step, not the bytes); docs/network.md has the set-up.
    """
    return max(8, round(math.sqrt(params / layers)))


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
    progress=None,
    log=None,
    on_cell=None,
    models=None,
    allocator="glibc",
    optimizer="adam",
    donate=False,
) -> list[dict]:
    """Runs every (model, hosts, rate) cell on an emulated cluster: a row per cell and method.

    Args:
      hosts: numbers of emulated hosts.
      rates: link rates (``"1gbit"``, ``"none"`` for no limit).
      params: parameters (float32) of the MLP trained when ``models`` is None.
      methods: labels from :data:`METHODS`; ``"pmean"``, the speedups' baseline, always runs.
      steps: timed steps per method (the median counts), after ``warmup`` untimed ones.
      batch: rows (sequences, images) per host.
      layers: dense layers of the MLP trained when ``models`` is None.
      timeout: seconds per cell before its processes are killed.
      progress: a progress bar over the cells to drive (an object with ``set_description``,
        ``update`` and ``close``, as :func:`jaxcomp.cli._report.progress_bar` gives), or None.
      log: file the workers' output goes to (default: discarded unless a cell fails).
      on_cell: called with all rows so far after each cell (to save partial results).
      models: :data:`jaxcomp.training.zoo.NAMES` to train, a cell each; None: the MLP.
      allocator: ``"glibc"`` (default: glibc's malloc as it is) or ``"tuned"``: every host starts
        with :data:`jaxcomp.ops.allocator.ENVIRONMENT` (docs/performance.md).
      optimizer: what every step applies after the mean, one of :data:`OPTIMIZERS`.
      donate: every step (the compute-only one too) donates its input state
        (:func:`jaxcomp.data_parallel`'s ``donate``).

    Returns:
      A list of dicts, one per (model, hosts, rate, method), with the step's times, bytes and
      predictions, and the ``"model"``, ``"allocator"`` (what the hosts report they started
      with), ``"optimizer"`` and ``"donate"`` of its cell.

    Example:
      >>> rows = run_benchmark((2,), ("1gbit",), models=("resnet50",))  # doctest: +SKIP

    References:
      Agarwal et al., "On the Utility of Gradient Compression in Distributed Training Systems",
      MLSys 2022 (measure the step, not the bytes); docs/network.md has the set-up.
    """
    from jaxcomp.distributed.cluster import check_support

    check_support()
    env = allocator_module.environment(allocator)  # checks the name before any cluster is built
    _check_step(optimizer, donate)
    methods, models = _checked_runs(methods, models)
    bar = _checked_bar(progress)
    cells = [(m, h, r) for m in models for h in hosts for r in rates]
    options = dict(
        params=float(params),
        steps=steps,
        warmup=warmup,
        batch=batch,
        layers=layers,
        optimizer=optimizer,
        donate=donate,
    )
    rows = []
    try:
        for model, n_hosts, rate in cells:
            rows += _cell_rows(model, n_hosts, rate, methods, options, bar, timeout, log, env)
            bar.update(1)
            if on_cell is not None:
                on_cell(rows)
    finally:
        bar.close()
    return rows


def _check_step(optimizer, donate) -> None:
    """The steps' ``optimizer`` and ``donate``, checked."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if not isinstance(donate, bool):
        raise TypeError(f"donate must be True or False, got {donate!r}")


def _checked_runs(methods, models):
    """``(methods, models)`` checked, the ``pmean`` baseline first; ``(None,)`` for the MLP."""
    from jaxcomp.training import zoo

    methods = tuple(dict.fromkeys(("pmean",) + tuple(methods)))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"methods must be among {tuple(METHODS)}, got {unknown}")
    if models is not None and (not tuple(models) or any(m not in zoo.NAMES for m in models)):
        raise ValueError(f"models must be None or names among {zoo.NAMES}, got {models}")
    return methods, (None,) if models is None else tuple(models)


class _NoBar:
    def set_description(self, text):
        pass

    def update(self, n):
        pass

    def close(self):
        pass


def _checked_bar(progress):
    """The progress bar to drive: ``progress``, or one that shows nothing for None or False."""
    if progress is None or progress is False:
        return _NoBar()
    if not all(hasattr(progress, name) for name in ("set_description", "update", "close")):
        raise TypeError(
            "progress must be None or a progress bar with set_description, update and close "
            f"(jaxcomp.cli._report.progress_bar gives one), got {progress!r}"
        )
    return progress


def _cell_rows(model, n_hosts, rate, methods, options, bar, timeout, log, env) -> list[dict]:
    """One (model, hosts, rate) cell: its job on a fresh cluster, one row per method."""
    from jaxcomp.distributed.cluster import format_rate, parse_rate

    rate_bits = parse_rate(rate)
    bar.set_description(f"{model or 'mlp'}, {n_hosts} hosts, {format_rate(rate_bits)}")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Spec(
            methods=methods,
            out=os.path.join(tmp, "result.json"),
            rate_bits=rate_bits,
            model=model,
            **options,
        )
        log_path = log or os.path.join(tmp, "workers.log")
        result = _run_cell(spec, n_hosts, timeout, log_path, tmp, env)
    base = result["methods"]["pmean"]["step"]
    plain = _faster_plain(result["methods"])
    return [
        {
            "model": result.get("model"),
            "hosts": n_hosts,
            "rate": format_rate(rate_bits),
            "method": label,
            "params": result["params"],
            "leaves": result.get("leaves"),
            "compute": result["compute"],
            "probe": result["probe"],
            "allocator": result.get("allocator"),
            "optimizer": result.get("optimizer"),
            "donate": result.get("donate", False),
            "speedup": base / entry["step"],
            "speedup_plain": plain / entry["step"],
            **({"incomplete": result["incomplete"]} if "incomplete" in result else {}),
            **entry,
        }
        for label, entry in result["methods"].items()
    ]


def _faster_plain(measured: dict) -> float:
    """The faster plain baseline's step: ``pmean``'s, or ``pmean_flat``'s where it ran and won.

    Neither is fast on every model under XLA:CPU: ``pmean`` of many leaves runs one collective per
    leaf (seconds a step for 1,030 leaves on 4 hosts), and ``ravel_pytree``'s concatenation of a few
    large leaves falls into a slow loop fusion (slower than ``pmean`` on mlp4096;
    docs/performance.md, "One collective per leaf"). A user would write the faster one, so speedups
    are honest against it.
    """
    return min(measured[name]["step"] for name in ("pmean", "pmean_flat") if name in measured)


def _run_cell(spec: Spec, n_hosts: int, timeout: float, log_path: str, cwd: str, env) -> dict:
    """One job of ``spec`` on a fresh cluster of ``n_hosts``, its processes started with ``env``
    added to their environment; the workers' results (host 0's JSON)."""
    from jaxcomp.distributed.cluster import Cluster, ClusterError, format_rate

    with open(log_path, "a") as out, Cluster(n_hosts, rate=spec.rate_bits) as cluster:
        # cwd: `-m` puts it first on sys.path, and a source checkout there would shadow the
        # installed package.
        codes = cluster.run(
            [
                "-m",
                "jaxcomp.distributed.netbench_worker",
                json.dumps(dataclasses.asdict(spec)),
            ],
            timeout=timeout,
            env=env,
            stdout=out,
            stderr=out,
            cwd=cwd,
        )
    measured = _measured(spec.out)
    if any(codes) or measured is None:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        what = f"{spec.model} " if spec.model else ""
        failure = (
            f"the {n_hosts}-host {what}job at {format_rate(spec.rate_bits)} failed (exit codes "
            f"{codes}); the workers' output ends with:\n{tail}"
        )
        if measured is None or "pmean" not in measured["methods"]:
            raise ClusterError(failure)
        # Host 0 wrote the results after every method: keep the rows it measured.
        kept = ", ".join(measured["methods"])
        _LOG.warning("jaxcomp netbench: %s\nkept the rows measured before: %s", failure, kept)
        measured["incomplete"] = f"exit codes {codes}"
    return measured


def _measured(path):
    """The results host 0 wrote (after every method), or None when it wrote none."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
