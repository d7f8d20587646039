"""Measuring the network again during training and handing it to
``compress_auto``: :func:`remeasure`.

:meth:`jaxcomp.training.trainer.DataParallel.init` calls it when a :func:`jaxcomp.compress_auto`
has no ``network=``; a training loop calls :meth:`~jaxcomp.training.trainer.DataParallel.reprobe`
as often as the network may change. Every process measures, and every process gets the same
numbers (the slowest process's), so that all of them take the same branch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.costmodel.probe import agree_across_processes, probe_network
from jaxcomp.optim.auto_state import auto_branches, set_network
from jaxcomp.optim.timing import overhead_seconds_each


def probe_axis(layout):
    """The axis :func:`remeasure` measures: the first of ``axis_name`` with 2 or more devices.

    Args:
      layout: the run's :class:`jaxcomp.training.layout.Layout`.

    Returns:
      The axis name, or None when every data axis has one device (no network to probe).

    Example:
      >>> import jax, numpy as np, types
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("node", "device"))
      >>> probe_axis(types.SimpleNamespace(mesh=mesh, axes=("node", "device")))
      'device'

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-measure α and β, re-decide).
    """
    return next((a for a in layout.axes if layout.mesh.shape[a] > 1), None)


def remeasure(layout, state, *, codec: bool = True, **probe_options):
    """Measures the network (and each branch's local work) again and hands them to
    ``compress_auto``.

    Args:
      layout: the run's :class:`jaxcomp.training.layout.Layout`.
      state: the :class:`jaxcomp.training.state.TrainState`.
      codec: also time each branch's local work (see
        :meth:`jaxcomp.training.trainer.DataParallel.reprobe`).
      **probe_options: passed to :func:`jaxcomp.probe_network`; it always measures anew.

    Returns:
      The state with the new network in every ``compress_auto`` state, laid out as before.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> tx = optax.chain(
      ...     jaxcomp.compress_auto([jaxcomp.Dense(), jaxcomp.TopK(0.01)]), optax.sgd(0.1)
      ... )
      >>> dp = jaxcomp.data_parallel(lambda w, b: jnp.sum(w * b), tx, mesh)
      >>> state = remeasure(dp.layout, dp.init(jnp.zeros(4)), codec=False)
      >>> bool(jaxcomp.find_compress_state(state.opt_state).auto.network[1] > 0)
      True

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-E (re-measure α and β, re-decide); Agarwal et al.,
      MLSys 2022, §3.1 (encode/decode time in the step).
    """
    branches = auto_branches(state.opt_state)
    if not branches:
        raise ValueError(
            "tx holds no compress_auto (compress('auto')): there is nothing to reprobe for"
        )
    axis = probe_axis(layout)
    if axis is None:
        raise ValueError(
            f"every axis of {layout.axis_name!r} has 1 device: no network to probe (nothing "
            "crosses one; compress_auto runs its first candidate)"
        )
    network = probe_network(layout.mesh, axis, cache=False, **probe_options)
    overhead = _agreed_overheads(layout, state, branches, axis) if codec else None
    opt_state = set_network(state.opt_state, network, overhead)
    return jax.jit(
        lambda s: s,
        out_shardings=layout.state_sharding(layout.whole_avals(state.params), state.model_state),
    )(state._replace(opt_state=opt_state))


def _agreed_overheads(layout, state, branches, axis):
    """Each branch's method -> seconds of its local work, the slowest process's time."""
    shapes = [
        jax.ShapeDtypeStruct(a.shape, jnp.float32)
        for a in jax.tree.leaves(layout.whole_avals(state.params))
        if jnp.issubdtype(a.dtype, jnp.floating)
    ]
    unique = list(dict.fromkeys(m for group in branches for m in group))
    seconds = overhead_seconds_each(unique, shapes, mesh=layout.mesh, axis_name=axis)
    # Every process must take the same branch: all of them use the slowest one's times.
    agreed = dict(zip(unique, (float(s) for s in agree_across_processes(np.array(seconds)))))
    return agreed.__getitem__
