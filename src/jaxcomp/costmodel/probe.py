"""Measure the network: time all-reduces of a few sizes on the live mesh and fit α and β.

The fit uses the same model :mod:`jaxcomp.costmodel.cost` predicts with (a ring all-reduce costs
``2(N-1) α + 2(N-1)/N · M β``), so the Network :func:`probe_network` returns plugs straight into
:func:`jaxcomp.costmodel.cost.predict` and :func:`jaxcomp.costmodel.cost.choose`. Paper 002 (App. C)
measures α the same way: time a ring all-reduce of a tiny vector and divide by the number of steps.

:func:`codec_seconds` times a method's codec; :func:`jaxcomp.optim.timing.overhead_seconds` times
its whole update (what it adds to a step besides the network), asking the method object how.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import methods
from jaxcomp.collectives import baseline
from jaxcomp.costmodel import cost
from jaxcomp.methods import Dense, Method

#: Bytes per device of each timed all-reduce, smallest first: a latency-bound size, then sizes
#: up to 8 MiB, large enough that a link's burst allowance (a token bucket lets the first few
#: hundred KiB through at full speed) does not pass for bandwidth. Sizes that would not fit in
#: the time budget are skipped (see :func:`probe_network`).
DEFAULT_SIZES = (2**10, 2**16, 2**20, 2**23)

#: Timed calls per size; the median is kept (the fastest call of a shaped link is the one that
#: found its bucket full, which made repeated probes disagree widely).
DEFAULT_REPEATS = 3

#: Seconds :func:`probe_network` may take by default, compilation included.
DEFAULT_BUDGET = 5.0

#: Times :func:`probe_network` measures (each with 8x larger sizes than the last) before giving up.
_ATTEMPTS = 3

_CACHE: dict = {}

#: Values a device codes at most while :func:`codec_seconds` times it (more: scaled from these).
MAX_TIMED_VALUES = 2**24


def fit_alpha_beta(sizes, seconds, n_workers: int, method: Method = Dense()) -> cost.Network:
    """Least-squares α and β from timings of one collective at several sizes.

    Solves ``seconds_i ≈ α · steps + β · volume_i`` with ``steps`` and ``volume_i`` from
    :func:`jaxcomp.costmodel.cost.message_steps` and :func:`jaxcomp.costmodel.cost.volume_bytes`,
    weighting each equation by ``1 / seconds_i`` so small (latency-bound) and large
    (bandwidth-bound) timings count alike. A negative α (noise on a latency-free link) is clamped to
    0 and β refitted.

    Args:
      sizes: bytes per device of each timed call (float32 gradients), at least two distinct.
      seconds: the measured time of each call, all positive.
      n_workers: the number of devices the collective ran over, >= 2.
      method: the method the timings are of, one that sends everything (default
        :class:`jaxcomp.Dense`, how :func:`probe_network` times ``psum``), or its name.

    Returns:
      The fitted :class:`jaxcomp.costmodel.cost.Network`.

    Example:
      >>> from jaxcomp.costmodel import cost
      >>> true = cost.Network(alpha=1e-4, bandwidth=1e9)
      >>> sizes = [2**10, 2**16, 2**22]
      >>> times = [cost.predict("dense", s, 8, true) for s in sizes]
      >>> fit = fit_alpha_beta(sizes, times, 8)
      >>> round(fit.alpha, 6), round(fit.bandwidth / 1e9, 3)
      (0.0001, 1.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I; Agarwal et al., MLSys 2022, App. C.
    """
    sizes = np.asarray(sizes, dtype=np.float64)
    seconds = np.asarray(seconds, dtype=np.float64)
    if sizes.ndim != 1 or seconds.shape != sizes.shape:
        raise ValueError(
            f"sizes and seconds must be 1-D of equal length, got shapes {sizes.shape} and "
            f"{seconds.shape}"
        )
    if len(np.unique(sizes)) < 2:
        raise ValueError(
            "sizes must hold at least two distinct sizes to separate α from β, got "
            f"{sizes.tolist()}"
        )
    if not np.all(np.isfinite(seconds)) or np.any(seconds <= 0):
        raise ValueError(f"seconds must be positive and finite, got {seconds.tolist()}")
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 2:
        raise ValueError(
            f"n_workers must be an integer >= 2 (one device sends nothing), got {n_workers!r}"
        )
    method = methods.parse(method)
    if not method.sends_everything:
        raise ValueError(
            "method must be one that sends everything (a dense all-reduce), got "
            f"{method.describe()}"
        )
    steps = float(cost.message_steps(method, n_workers))
    volumes = np.array([cost.volume_bytes(method, float(s), n_workers) for s in sizes])
    weights = 1.0 / seconds
    design = np.stack([np.full_like(volumes, steps), volumes], axis=1) * weights[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, seconds * weights, rcond=None)
    if alpha < 0:
        alpha = 0.0
        beta = float(
            np.sum(volumes * weights * seconds * weights) / np.sum((volumes * weights) ** 2)
        )
    if not beta > 0:
        raise ValueError(
            "seconds do not grow with size, so the bandwidth cannot be estimated; time larger "
            f"sizes (sizes={sizes.tolist()}, seconds={seconds.tolist()})"
        )
    return cost.Network(alpha=float(alpha), bandwidth=float(1.0 / beta))


def probe_network(
    mesh,
    axis_name: str,
    sizes=DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    cache: bool = True,
    budget: float | None = DEFAULT_BUDGET,
) -> cost.Network:
    """Measures α and β of ``axis_name`` on ``mesh`` by timing ``psum`` at several sizes.

    Sizes run smallest first. Each is compiled once, run once to warm up, then timed
    ``repeats`` times; the median counts. The timings are fitted by :func:`fit_alpha_beta` as
    ring all-reduces; with 3 or more sizes the bandwidth is then the slope of the two largest
    and α what the smallest leaves over (a shaped link's burst allowance would otherwise pass for
    bandwidth). In a multi-process run every process times the same collectives, the
    timings are gathered and the slowest process's time per size is fitted, so every process
    returns the same Network. Call it from every process, as any collective.

    The time is bounded: before each size after the first two, the time it would take (the last
    size's time scaled by the size ratio, times ``repeats + 1``) is compared with what is left of
    ``budget``, and the size and all larger ones are skipped when it does not fit. Every process
    decides from the same gathered timings, so all of them skip together.

    Args:
      mesh: a :class:`jax.sharding.Mesh`.
      axis_name: the mesh axis to measure; it must have at least 2 devices.
      sizes: bytes per device of each timed all-reduce (multiples of 4, at least two distinct).
      repeats: timed calls per size, >= 1.
      cache: reuse an earlier result for the same devices, axis, sizes and repeats.
      budget: seconds the probe may take (default :data:`DEFAULT_BUDGET`, 5), or None for no
        limit. The two smallest sizes always run.

    Returns:
      The measured :class:`jaxcomp.costmodel.cost.Network`.

    Example:
      >>> import jax
      >>> from jaxcomp import probe_network
      >>> mesh = jax.sharding.Mesh(jax.devices()[:2], ("data",))
      >>> net = probe_network(mesh, "data", sizes=(1024, 65536), repeats=2)
      >>> net.alpha >= 0 and net.bandwidth > 0
      True

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-measure α and β, re-decide);
      Agarwal et al., MLSys 2022, App. C (α from a timed all-reduce).
    """
    n_workers, sizes = _check_probe(mesh, axis_name, sizes, repeats, budget)
    key = (
        tuple(d.id for d in mesh.devices.flat),
        mesh.devices.shape,
        mesh.axis_names,
        axis_name,
        sizes,
        repeats,
        budget,
    )
    if cache and key in _CACHE:
        return _CACHE[key]
    for attempt in range(_ATTEMPTS):
        timed, seconds = _time_sizes(mesh, axis_name, sizes, repeats, budget)
        try:
            network = _bucket_free(
                fit_alpha_beta(timed, seconds, n_workers), timed, seconds, n_workers
            )
            break
        except ValueError:
            # Timings that do not grow with size are noise on a link too fast for these sizes:
            # measure again with larger messages (every process sees the same gathered timings,
            # so all of them retry together).
            if attempt == _ATTEMPTS - 1:
                raise
            sizes = tuple(8 * size for size in sizes)
    if cache:
        _CACHE[key] = network
    return network


def _check_probe(mesh, axis_name, sizes, repeats, budget):
    """``(n_workers, sorted sizes)`` of :func:`probe_network`'s arguments, or a ValueError naming
    one."""
    if not isinstance(mesh, jax.sharding.Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis_name not in mesh.axis_names:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    n_workers = mesh.shape[axis_name]
    if n_workers < 2:
        raise ValueError(f"axis {axis_name!r} has {n_workers} device; a probe needs at least 2")
    sizes = tuple(sizes)
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 4 or size % 4:
            raise ValueError(
                f"sizes must be positive multiples of 4 bytes (float32 values), got {size!r}"
            )
    if len(set(sizes)) < 2:
        raise ValueError(f"sizes must hold at least two distinct sizes, got {sizes}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if budget is not None and not (
        isinstance(budget, (int, float))
        and not isinstance(budget, bool)
        and math.isfinite(budget)
        and budget > 0
    ):
        raise ValueError(f"budget must be a positive number of seconds or None, got {budget!r}")
    return n_workers, tuple(sorted(sizes))


def _time_sizes(mesh, axis_name, sizes, repeats, budget):
    """``(timed sizes, seconds)``: the agreed (slowest process's) ``psum`` time of each size,
    smallest first, stopping before a size that would not fit in what is left of ``budget``."""
    start = time.perf_counter()
    timed, seconds = [], []
    for size in sizes:
        if len(timed) >= 2 and budget is not None:
            expected = seconds[-1] * size / timed[-1] * (repeats + 1)
            # The elapsed time is agreed too: every process must skip the same sizes.
            elapsed = float(agree_across_processes(np.array([time.perf_counter() - start]))[0])
            if elapsed + expected > budget:
                break
        timed.append(size)
        seconds.append(
            float(
                agree_across_processes(np.array([_time_psum(mesh, axis_name, size // 4, repeats)]))[
                    0
                ]
            )
        )
    return timed, seconds


def codec_seconds(
    method,
    n_values: int,
    *,
    n_workers: int | None = None,
    mesh=None,
    axis_name: str | None = None,
    repeats: int = 3,
    cache: bool = True,
    **options,
) -> float:
    """Measures a method's local work (:meth:`jaxcomp.methods.Method.local_work`) on this machine.

    Without a mesh the work runs once on the default device. With ``mesh`` and ``axis_name``
    every device of the axis works on its own ``n_values`` at once, inside ``shard_map``, as in
    training: devices that share compute (CPU devices on one host, say) then slow each other
    down as they would in a step.

    What is timed is the method's own answer (top-k's selection and error feedback, the ZFP
    ring's encodes and decodes, THC's transforms and packing); a method with none
    (:class:`jaxcomp.Dense`) costs 0. Paper 002 adds this ``T_encode-decode`` to the step time.

    Args:
      method: a :mod:`jaxcomp.methods` object, or a name with its options in ``options``.
      n_values: float32 values in the gradient, >= 1.
      n_workers: workers the method runs over (the ZFP ring's chunks, THC's field width);
        default: the mesh axis's size, else 2.
      mesh: optional :class:`jax.sharding.Mesh` to run the work on every device of.
      axis_name: the mesh axis the gradient is data-parallel over (required with ``mesh``).
      repeats: timed runs after one warm-up; the fastest counts.
      cache: reuse an earlier measurement of the same arguments.
      **options: with a name, the method's options (``ratio=``, ``rate=``, ``bits=``, ...).

    Returns:
      Seconds for the local work of one step on the whole gradient (on every device at once),
      scaled from :data:`MAX_TIMED_VALUES` values above that many.

    Example:
      >>> from jaxcomp.methods import Zfp
      >>> codec_seconds(Zfp(8), 4096, repeats=1) > 0
      True

    References:
      Agarwal et al., MLSys 2022, §3.1 and App. C (measuring T_encode-decode).
    """
    method = methods.parse(method, **options)
    _check_codec(n_values, repeats, n_workers, mesh, axis_name)
    workers = n_workers or (mesh.shape[axis_name] if mesh is not None else 2)
    timed = min(n_values, MAX_TIMED_VALUES)
    codec = method.local_work(timed, workers)
    if codec is None:
        return 0.0
    where = (
        (tuple(d.id for d in mesh.devices.flat), mesh.devices.shape, mesh.axis_names, axis_name)
        if mesh is not None
        else jax.default_backend()
    )
    key = ("codec", method, n_values, workers, repeats, where)
    if cache and key in _CACHE:
        return _CACHE[key]
    run, x = _codec_run(codec, timed, mesh, axis_name)
    best = best_seconds(lambda: run(x), repeats) * (n_values / timed)
    if cache:
        _CACHE[key] = best
    return best


def _check_codec(n_values, repeats, n_workers, mesh, axis_name):
    """A ValueError (or TypeError) naming the first bad argument of :func:`codec_seconds`."""
    if isinstance(n_values, bool) or not isinstance(n_values, int) or n_values < 1:
        raise ValueError(f"n_values must be an integer >= 1, got {n_values!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    if n_workers is not None and (
        isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1
    ):
        raise ValueError(f"n_workers must be an integer >= 1, got {n_workers!r}")
    if mesh is not None:
        if not isinstance(mesh, jax.sharding.Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}")
        if axis_name not in mesh.axis_names:
            raise ValueError(
                f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}"
            )


def _codec_run(codec, n_values, mesh, axis_name):
    """``(jitted codec, its input)``: one gradient on the default device, or one per device of
    the mesh axis inside ``shard_map``."""
    if mesh is None:
        x = jax.random.normal(jax.random.key(0), (n_values,), jnp.float32)
        return jax.jit(codec), x
    spec = P(axis_name)
    shape = (mesh.shape[axis_name] * n_values,)
    values = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    x = jax.make_array_from_callback(shape, NamedSharding(mesh, spec), lambda index: values[index])
    return jax.jit(jax.shard_map(codec, mesh=mesh, in_specs=spec, out_specs=spec)), x


def best_seconds(run, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``run``, after one warm-up call.

    Args:
      run: a callable returning JAX arrays (waited for with ``jax.block_until_ready``).
      repeats: timed calls.

    Returns:
      Seconds of the fastest call.

    Example:
      >>> import jax.numpy as jnp
      >>> best_seconds(lambda: jnp.ones(4) + 1, repeats=2) >= 0
      True

    References:
      Agarwal et al., MLSys 2022, App. C (the minimum of repeated timings).
    """
    jax.block_until_ready(run())
    return min(_seconds_of(run) for _ in range(repeats))


def _seconds_of(call) -> float:
    """Wall-clock seconds of one call of ``call``, its arrays waited for."""
    start = time.perf_counter()
    jax.block_until_ready(call())
    return time.perf_counter() - start


def excess_seconds(run, baseline, repeats: int, *, most: int | None = None) -> float:
    """How much longer ``run`` takes than ``baseline``: the fastest of each, timed in turns.

    After one warm-up call of each, every round times ``baseline`` and then ``run``, so a burst
    of load on a shared machine slows both rather than one (timing one and then the other
    reported a top-k update no slower than a dense one on a loaded CI machine). While ``run`` is
    not yet measurably slower, rounds go on, up to ``most`` in all.

    Args:
      run: a callable returning JAX arrays (waited for with ``jax.block_until_ready``).
      baseline: the same, for what is subtracted.
      repeats: rounds at least.
      most: rounds at most; None: ``4 * repeats``.

    Returns:
      Seconds of ``run``'s fastest call less ``baseline``'s fastest; at least 0.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones(1 << 16)
      >>> excess_seconds(lambda: jnp.sort(x), lambda: x + 1, repeats=2) > 0
      True

    References:
      Agarwal et al., MLSys 2022, App. C (the minimum of repeated timings).
    """
    most = 4 * repeats if most is None else most
    jax.block_until_ready(baseline())
    jax.block_until_ready(run())
    fastest = [math.inf, math.inf]
    rounds = 0
    while rounds < repeats or (fastest[1] <= fastest[0] and rounds < most):
        for i, call in enumerate((baseline, run)):
            fastest[i] = min(fastest[i], _seconds_of(call))
        rounds += 1
    return max(0.0, fastest[1] - fastest[0])


def _bucket_free(network, sizes, seconds, n_workers):
    """β from the slope of the two largest sizes, α from the smallest, when 3 or more ran.

    A shaped link (a token bucket, as ``tc tbf`` or a cloud's burst credit) lets the first few
    hundred KiB of a burst through at full speed, so mid sizes look faster than the link and the
    least-squares line overstates the bandwidth (by much, on an emulated link). Past the
    bucket, every extra byte travels at the link's rate: the slope between the two largest sizes
    is that rate.
    """
    if len(sizes) < 3:
        return network
    volumes = [cost.volume_bytes(Dense(), float(s), n_workers) for s in sizes]
    beta = (seconds[-1] - seconds[-2]) / (volumes[-1] - volumes[-2])
    if not beta > 0:
        return network
    steps = cost.message_steps(Dense(), n_workers)
    alpha = max(0.0, (seconds[0] - beta * volumes[0]) / steps)
    return cost.Network(alpha=float(alpha), bandwidth=float(1.0 / beta))


def clear_cache() -> None:
    """Forgets every cached :func:`probe_network` and :func:`codec_seconds` result, so both measure
    again.

    Returns:
      None.

    Example:
      >>> clear_cache()

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (α and β change during training).
    """
    _CACHE.clear()


def _time_psum(mesh, axis_name, values_per_device, repeats):
    spec = P(axis_name)
    sharding = NamedSharding(mesh, spec)
    shape = (mesh.shape[axis_name] * values_per_device,)
    x = jax.make_array_from_callback(
        shape, sharding, lambda index: np.ones(shape, np.float32)[index]
    )
    reduce = jax.jit(
        jax.shard_map(
            lambda v: baseline.psum(v, axis_name), mesh=mesh, in_specs=spec, out_specs=P()
        )
    )
    reduce(x).block_until_ready()  # compile and warm up outside the timing
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        reduce(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def agree_across_processes(seconds):
    """The largest of each value over the processes, identical on every process (the values
    themselves in a single-process job). Call it from every process at once.

    Args:
      seconds: a 1-D array of this process's values (timings).

    Returns:
      A float64 array of the per-entry maxima over the processes.

    Example:
      >>> agree_across_processes(np.array([0.5])).tolist()
      [0.5]

    References:
      Agarwal et al., MLSys 2022, App. C (the slowest worker bounds a synchronous step).
    """
    if jax.process_count() == 1:
        return seconds
    from jax.experimental import multihost_utils

    # float32 on the wire (x64 is usually off); every process then fits identical numbers.
    gathered = multihost_utils.process_allgather(jnp.asarray(seconds, jnp.float32))
    return np.max(np.asarray(gathered, np.float64).reshape(jax.process_count(), -1), axis=0)
