"""The plain all-reduce a JAX program without jaxcomp runs: XLA's own, one per leaf.

Benchmarks compare jaxcomp against it (``jaxcomp netbench``'s plain rows, the probe of a dense
sum's wire time). It is here so that every byte crossing devices goes through
:mod:`jaxcomp.collectives`, the baseline's too; training uses :func:`jaxcomp.collectives.psum`.
"""

from __future__ import annotations

import jax


def pmean(tree, axis_name):
    """The mean over ``axis_name`` of every leaf of ``tree``: ``jax.lax.pmean``, as it is.

    Args:
      tree: a pytree of this device's arrays.
      axis_name: the mesh axis, or tuple of axes, to average over.

    Returns:
      A pytree like ``tree``: each leaf's mean, replicated.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.collectives import baseline
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(lambda x: baseline.pmean(x, "data"), mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> f(jnp.arange(4.0)).tolist()
      [1.0, 2.0]

    References:
      Li et al., "PyTorch Distributed", VLDB 2020 (the dense all-reduce DDP runs).
    """
    return jax.lax.pmean(tree, axis_name)


def psum(tree, axis_name):
    """The sum over ``axis_name`` of every leaf of ``tree``: ``jax.lax.psum``, as it is.

    Args:
      tree: a pytree of this device's arrays.
      axis_name: the mesh axis, or tuple of axes, to sum over.

    Returns:
      A pytree like ``tree``: each leaf's sum, replicated.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.collectives import baseline
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(lambda x: baseline.psum(x, "data"), mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> f(jnp.arange(4.0)).tolist()
      [2.0, 4.0]

    References:
      Li et al., "PyTorch Distributed", VLDB 2020 (the dense all-reduce DDP runs).
    """
    return jax.lax.psum(tree, axis_name)
