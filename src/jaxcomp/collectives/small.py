"""The exchanges that are not a gradient: metrics and flags, and the gather of sharded params.

These move a few scalars a step (a loss, a count of non-finite entries, a "was every sum finite"
flag) or, in sharded training (``data_parallel(shard=...)``), every device's shard of the params.
They are here so that every byte crossing devices goes through :mod:`jaxcomp.collectives`:
the bytes of the gathers are counted by the step's ``gather_bytes`` metric, those of the scalars
are too few to count.
"""

from __future__ import annotations

import jax

from jaxcomp.collectives._common import axis_size


def metric_sum(x, axis_name):
    """The sum over ``axis_name`` of a metric of any shape (a count, a few energies).

    Args:
      x: this device's value, any shape and dtype.
      axis_name: the mesh axis, or tuple of axes, to sum over.

    Returns:
      The sum, replicated (typed invariant).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.collectives import small
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(lambda x: small.metric_sum(x.sum(), "data"), mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> float(f(jnp.arange(4.0)))
      6.0

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C3 (the compression gain, from summed energies).
    """
    axis_size(axis_name)
    return jax.lax.psum(x, axis_name)


def metric_mean(x, axis_name):
    """The mean over ``axis_name`` of a metric of any shape (the loss, user metrics).

    Args:
      x: this device's value, any shape and float dtype.
      axis_name: the mesh axis, or tuple of axes, to average over.

    Returns:
      The mean, replicated (typed invariant).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.collectives import small
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(lambda x: small.metric_mean(x.sum(), "data"), mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> float(f(jnp.arange(4.0)))
      3.0

    References:
      Goyal et al., "Accurate, Large Minibatch SGD", 2017 (the data-parallel mean).
    """
    axis_size(axis_name)
    return jax.lax.pmean(x, axis_name)


def all_true(flag, axis_name):
    """Whether ``flag`` holds on every device of ``axis_name`` (one integer min).

    Args:
      flag: this device's boolean scalar.
      axis_name: the mesh axis, or tuple of axes.

    Returns:
      A replicated boolean scalar.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.collectives import small
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(lambda x: small.all_true(x[0] > 0, "data"), mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> bool(f(jnp.array([1.0, -1.0]))), bool(f(jnp.array([1.0, 2.0])))
      (False, True)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2 (skip a step every
      device agrees to skip).
    """
    axis_size(axis_name)
    return jax.lax.pmin(flag.astype("int32"), axis_name) > 0


def gather_shards(shard, axis_name):
    """Every device's shard along ``axis_name``, stacked in device order (sharded training).

    Args:
      shard: this device's shard of a leaf, any shape.
      axis_name: the mesh axis the shards are spread over.

    Returns:
      ``[N, *shard.shape]``, replicated (typed invariant).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.collectives import small
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(lambda x: small.gather_shards(x, "data"), mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> f(jnp.arange(4.0)).tolist()
      [[0.0, 1.0], [2.0, 3.0]]

    References:
      Rajbhandari et al., "ZeRO", SC 2020 (params gathered from their shards for the forward pass).
    """
    axis_size(axis_name)
    return jax.lax.all_gather(shard, axis_name, to="invarying")
