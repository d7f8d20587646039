"""Time a method's whole update: the local work it adds to a step besides the network.

:func:`update_seconds` runs ``jaxcomp.compress(method)``'s update on this process's devices with
every collective a no-op; :func:`overhead_seconds` adds the codec of the methods that skip it on one
device (:func:`jaxcomp.costmodel.probe.codec_seconds`). ``compress_auto`` and ``jaxcomp advise``
feed these to the cost model.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import methods
from jaxcomp.costmodel.probe import codec_seconds, excess_seconds
from jaxcomp.methods import Dense, Method
from jaxcomp.optim.compression import compress


def update_seconds(method, params, *, repeats: int = 3, **options) -> float:
    """Seconds ``jaxcomp.compress(method)``'s whole update spends on this process beyond a dense
    one.

    Every local device runs the update at once, inside ``shard_map`` over a mesh of this
    process's devices with extra axes of size 1 that ``compress`` reduces over (as many as the
    method needs): every collective is then a no-op, and what is timed is the method's own work on
    a gradient shaped like ``params`` (for top-k: the concatenation, the selection, the scatters
    and the error feedback), minus the same for :class:`jaxcomp.Dense`, with the devices sharing
    the cores as in a step. Call it from every process at once in a multi-process job, for the
    same reason. Methods that skip their codec on one device (ZFP, THC) get their codec's
    :func:`codec_seconds` added by :func:`overhead_seconds`.

    Args:
      method: a :mod:`jaxcomp.methods` object, or a name with its options in ``options``.
      params: the params pytree (arrays or ``jax.ShapeDtypeStruct``).
      repeats: timed rounds after one warm-up, each a dense update and then this one; the
        fastest of each counts (up to 4x as many rounds while the update is not measurably
        slower: :func:`jaxcomp.costmodel.probe.excess_seconds`).
      **options: with a name, the method's options (``ratio=``, ...).

    Returns:
      Seconds per update, at least 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.methods import TopK
      >>> update_seconds(TopK(0.01, collective="ar"), {"w": jnp.zeros((256, 256))}, repeats=1) >= 0
      True

    References:
      Agarwal et al., MLSys 2022, §3.1 (compression's compute counts in the step).
    """
    return _UpdateTimer(params, repeats).seconds(methods.parse(method, **options))


class _UpdateTimer:
    """Times methods' updates on one gradient shaped like ``params``: the gradient is drawn once
    per mesh, and the dense update that every timing subtracts is compiled once per mesh (the
    timing of nine ``compress_auto`` candidates drew nine 100 MB gradients and timed dense nine
    times). Each method's update is timed in turns with the dense one
    (:func:`jaxcomp.costmodel.probe.excess_seconds`)."""

    def __init__(self, params, repeats: int):
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
        self._params = params
        self._repeats = repeats
        self._grads = {}  # number of local axes -> (axes, mesh, its replicated sharding, gradient)
        self._dense = {}  # number of local axes -> Dense()'s update, compiled, ready to call

    def seconds(self, method: Method) -> float:
        """``method``'s update beyond a dense one, in seconds, at least 0."""
        n_axes = method.axes_needed or 1
        if n_axes not in self._dense:
            self._dense[n_axes] = self._update(Dense(), n_axes)
        return excess_seconds(self._update(method, n_axes), self._dense[n_axes], self._repeats)

    def _gradient(self, n_axes: int):
        if n_axes not in self._grads:
            axes = tuple(f"_local{i}" for i in range(n_axes))
            mesh = jax.sharding.Mesh(
                np.array(jax.local_devices()).reshape(-1, *(1,) * n_axes), ("_device",) + axes
            )
            rng = np.random.default_rng(0)
            replicated = NamedSharding(mesh, P())
            grads = jax.tree.map(
                lambda p: jax.device_put(
                    rng.standard_normal(np.shape(p)).astype(np.float32), replicated
                ),
                self._params,
            )
            self._grads[n_axes] = axes, mesh, replicated, grads
        return self._grads[n_axes]

    def _update(self, method: Method, n_axes: int):
        """A call of ``method``'s whole update on the gradient, every collective a no-op."""
        axes, mesh, replicated, grads = self._gradient(n_axes)
        tx = compress(method, axis_name=axes if len(axes) > 1 else axes[0])
        state = jax.device_put(tx.init(grads), replicated)

        def update(g, state):
            g = jax.lax.pcast(g, axes, to="varying")
            return tx.update(g, state)[0]

        run = jax.jit(
            jax.shard_map(update, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
        )
        return lambda: run(grads, state)


def overhead_seconds(
    method: Method, params, *, mesh=None, axis_name: str | None = None, repeats: int = 3
) -> float:
    """The seconds of local work ``method`` adds to a step, measured the way the method asks.

    0 for a method that sends everything; else :func:`update_seconds`, the method's whole
    ``compress`` update on one device beyond a dense one (packing, codec, selection, error
    feedback, unpacking), plus, for a method whose codec does not run on one device
    (:attr:`jaxcomp.methods.Method.codec_skipped_on_one_device`: ZFP, THC), :func:`codec_seconds`
    of its :meth:`jaxcomp.methods.Method.local_work` on every device of ``mesh``'s ``axis_name`` at
    once. :meth:`jaxcomp.DataParallel.reprobe` gives these to
    :func:`jaxcomp.compress_auto`.

    Args:
      method: a :mod:`jaxcomp.methods` object.
      params: the params pytree (arrays or ``jax.ShapeDtypeStruct``).
      mesh: the training mesh (for :func:`codec_seconds`), or None for the default device.
      axis_name: the data-parallel axis of ``mesh``.
      repeats: timed rounds after one warm-up, each a dense update and then this one; the
        fastest of each counts (up to 4x as many rounds while the update is not measurably
        slower: :func:`jaxcomp.costmodel.probe.excess_seconds`).

    Returns:
      Seconds, at least 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.methods import Dense
      >>> overhead_seconds(Dense(), {"w": jnp.zeros(8)})
      0.0

    References:
      Agarwal et al., MLSys 2022, §3.1 and App. C.
    """
    (seconds,) = overhead_seconds_each(
        [method], params, mesh=mesh, axis_name=axis_name, repeats=repeats
    )
    return seconds


def overhead_seconds_each(
    methods_, params, *, mesh=None, axis_name: str | None = None, repeats: int = 3
) -> list[float]:
    """:func:`overhead_seconds` of each of several methods, on one shared gradient.

    The gradient is drawn once and the dense update that each timing subtracts is timed once,
    where a loop over :func:`overhead_seconds` would do both once per method (nine times for
    ``compress_auto``'s nine candidates on a 25M-parameter model).

    Args:
      methods_: :mod:`jaxcomp.methods` objects (or names).
      params: the params pytree (arrays or ``jax.ShapeDtypeStruct``).
      mesh: the training mesh (for :func:`codec_seconds`), or None for the default device.
      axis_name: the data-parallel axis of ``mesh``.
      repeats: timed rounds after one warm-up, each a dense update and then this one; the
        fastest of each counts (up to 4x as many rounds while the update is not measurably
        slower: :func:`jaxcomp.costmodel.probe.excess_seconds`).

    Returns:
      A list of seconds, one per method, in order, each at least 0.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.methods import Dense, RandomK
      >>> dense, randomk = overhead_seconds_each([Dense(), RandomK(0.1)], {"w": jnp.zeros(64)})
      >>> dense, randomk >= 0
      (0.0, True)

    References:
      Agarwal et al., MLSys 2022, §3.1 and App. C.
    """
    timer = _UpdateTimer(params, repeats)
    n_values = sum(math.prod(np.shape(p)) for p in jax.tree.leaves(params))
    seconds = []
    for method in map(methods.parse, methods_):
        if method.sends_everything:
            seconds.append(0.0)
            continue
        # The real update, whatever the method: a slow packing or unpacking (the fused
        # concatenate of docs/performance.md, which cost seconds a step on one model) is local
        # work too, and only the update shows it.
        local = timer.seconds(method)
        if method.codec_skipped_on_one_device:
            local += codec_seconds(
                method, n_values, mesh=mesh, axis_name=axis_name, repeats=repeats
            )
        seconds.append(local)
    return seconds
