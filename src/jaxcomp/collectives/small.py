"""The exchanges that are not a gradient: metrics and flags, a model's statistics, and the gather
of sharded params.

These move a few scalars a step (a loss, a count of non-finite entries, a "was every sum finite"
flag), a model's running statistics (``data_parallel(has_state=True)``: BatchNorm's averages) or,
in sharded training (``data_parallel(shard=...)``), every device's shard of the params.
They are here so that every byte crossing devices goes through :mod:`jaxcomp.collectives`:
the bytes of the gathers are counted by the step's ``gather_bytes`` metric, those of the scalars
are too few to count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives._common import all_gather_or_retype, axis_size, psum_or_retype
from jaxcomp.ops import flat
from jaxcomp.ops._ffi import varying_axes

#: Arrays of at most this many values that cross devices together are joined into one vector
#: first (:func:`joined_groups`). XLA merges the collectives of many arrays into one instruction,
#: but XLA:CPU runs it as one collective per array: over gloo a round trip each, so an
#: all-reduce of 1,030 small leaves took far longer than one vector of the same values
#: (docs/performance.md, "One collective per leaf"). A larger array crosses alone, with no copy.
JOINED_VALUES = 1 << 16


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


def joined_groups(arrays) -> list:
    """Which of ``arrays`` cross devices as one vector: each of more than :data:`JOINED_VALUES`
    values alone, the smaller ones of each dtype together.

    Args:
      arrays: arrays or abstract values (their sizes and dtypes).

    Returns:
      A list of groups, each a sorted list of positions in ``arrays``, ordered by their first.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.collectives import small
      >>> small.joined_groups([jnp.zeros(3), jnp.zeros(70000), jnp.zeros(2, jnp.bfloat16),
      ...                      jnp.zeros(2)])
      [[0, 3], [1], [2]]

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB
      2020, §3.2.3 (a bucket is one flat buffer, one all-reduce).
    """
    alone, together = [], {}
    for i, a in enumerate(arrays):
        if a.size > JOINED_VALUES:
            alone.append([i])
        else:
            together.setdefault(jnp.dtype(a.dtype), []).append(i)
    return sorted(alone + list(together.values()))


def joined_mean(arrays, axis_name) -> list:
    """The mean over ``axis_name`` of each of ``arrays``, the small ones of each dtype in one
    all-reduce (:func:`joined_groups`): one collective for a model's statistics, not one per leaf.

    Args:
      arrays: a list of this device's float arrays, any shapes; each is typed varying over the
        axes first where it is not.
      axis_name: the mesh axis, or tuple of axes, to average over.

    Returns:
      The list of means, replicated (typed invariant), in the arrays' shapes and dtypes.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.collectives import small
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda a, b: small.joined_mean([a, b], "data"), mesh=mesh,
      ...                           in_specs=(P("data"), P("data")), out_specs=P()))
      >>> [x.tolist() for x in f(jnp.arange(4.0), jnp.arange(2.0))]
      [[1.0, 2.0], [0.5]]

    References:
      Ioffe & Szegedy, "Batch Normalization", ICML 2015 (running averages of the batch
      statistics); Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3 (one flat buffer).
    """
    n = axis_size(axis_name)
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    arrays = list(arrays)
    for i, a in enumerate(arrays):
        if not jnp.issubdtype(a.dtype, jnp.inexact):
            raise TypeError(f"joined_mean averages float arrays; arrays[{i}] has dtype {a.dtype}")
        missing = tuple(x for x in axes if x not in varying_axes(a))
        arrays[i] = jax.lax.pcast(a, missing, to="varying") if missing else a
    out = [None] * len(arrays)
    for group in joined_groups(arrays):
        vector = flat.concat([arrays[i] for i in group])
        mean = psum_or_retype(vector, axes) / jnp.asarray(n, vector.dtype)
        ends = np.cumsum([arrays[i].size for i in group])
        for i, end in zip(group, ends):
            out[i] = mean[end - arrays[i].size : end].reshape(arrays[i].shape)
    return out


def gather_leaf_shards(shards, axis_name):
    """:func:`gather_shards` of each leaf of ``shards``, the small ones of each dtype in one
    all-gather (:func:`joined_groups`): one collective, not one per leaf.

    Args:
      shards: a pytree of this device's shard of each leaf, any shapes.
      axis_name: the mesh axis the shards are spread over.

    Returns:
      The pytree of ``[N, *shard.shape]`` per leaf, replicated (typed invariant).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp.collectives import small
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda a, b: small.gather_leaf_shards([a, b], "data"),
      ...                           mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P()))
      >>> [x.tolist() for x in f(jnp.arange(4.0), jnp.arange(2.0))]
      [[[0.0, 1.0], [2.0, 3.0]], [[0.0], [1.0]]]

    References:
      Rajbhandari et al., "ZeRO", SC 2020 (params gathered from their shards for the forward pass).
    """
    shards, treedef = jax.tree.flatten(shards)
    out = [None] * len(shards)
    for group in joined_groups(shards):
        if len(group) == 1:
            out[group[0]] = gather_shards(shards[group[0]], axis_name)
            continue
        gathered = gather_shards(flat.concat([shards[i] for i in group]), axis_name)
        ends = np.cumsum([shards[i].size for i in group])
        for i, end in zip(group, ends):
            piece = gathered[:, end - shards[i].size : end]
            out[i] = piece.reshape((gathered.shape[0],) + shards[i].shape)
    return treedef.unflatten(out)


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
    return all_gather_or_retype(shard, axis_name)
