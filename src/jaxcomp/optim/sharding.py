"""Sharded updates (ZeRO-style): the layout of a leaf's shards and the switch :func:`compress`
reads.

With ``jaxcomp.data_parallel(..., shard="optimizer" | "params")`` every device owns one ``1/N``
shard of each parameter leaf: the leaf is flattened, zero-padded to ``N * m`` values with
``m = ceil(size / N)`` (:func:`shard_length`), and device ``d`` (its position along the data
axes) owns values ``[d m, (d + 1) m)``. :func:`jaxcomp.compress` then ends its aggregation with a
reduce-scatter instead of an all-reduce: each device receives the aggregated gradient of its own
shards only (one 1-D vector of ``m`` values per leaf), and the rest of the optax chain updates
those shards with optimizer state of the same size.

Several leaves aggregated as one vector (``granularity="model"``) are laid out *shard-major*
(:func:`shard_major`): row ``d`` of an ``[N, M]`` matrix is the concatenation of device ``d``'s
shard of every leaf (padded to the ``M`` the method needs), so a reduce-scatter of the flattened
matrix hands device ``d`` exactly its shards, in one collective.

Error feedback is unchanged: each device keeps the residual of its whole local gradient.

References:
  Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  SC 2020 (P_os, P_os+g, P_os+g+p); Wang et al., "ZeRO++", ICLR 2024 (quantized weights, qwZ).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxcomp.collectives import sizes, small

#: The ``shard=`` modes of :func:`jaxcomp.data_parallel`.
SHARD_MODES = (None, "optimizer", "params")


@dataclasses.dataclass(frozen=True)
class ShardedUpdates:
    """What :func:`compress` needs to know to reduce-scatter: the devices sharing the shards."""

    n_devices: int


_ACTIVE: contextvars.ContextVar[ShardedUpdates | None] = contextvars.ContextVar(
    "jaxcomp_sharded", default=None
)


@contextlib.contextmanager
def sharded_updates(n_devices: int):
    """Within this context, :func:`jaxcomp.compress` (and ``compress_auto``) return each device's
    shard of the aggregated gradients instead of all of it (their ``init`` refuses a method with
    no reduce-scatter form here, naming the methods that have one).

    :func:`jaxcomp.data_parallel` enters it while it traces a sharded step; use it yourself only
    in a ``shard_map`` loop of your own that updates shards (see :func:`shard_of`).

    Args:
      n_devices: the devices over the data axes (the shards of each leaf).

    Returns:
      A context manager.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxcomp
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> tx = jaxcomp.compress("dense")
      >>> state = tx.init(jnp.zeros(3))
      >>> def f(g):
      ...     with sharded_updates(2):
      ...         return tx.update(g, state)[0]
      >>> g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      >>> g(jnp.arange(6.0)).tolist()
      [1.5, 2.5, 3.5, 0.0]

    References:
      Rajbhandari et al., ZeRO, SC 2020 (gradient partitioning, P_os+g).
    """
    token = _ACTIVE.set(ShardedUpdates(int(n_devices)))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> ShardedUpdates | None:
    """The :class:`ShardedUpdates` in force.

    Returns:
      The innermost :func:`sharded_updates`'s, or None (replicated updates).

    Example:
      >>> with sharded_updates(4):
      ...     active().n_devices
      4
      >>> active() is None
      True

    References:
      Rajbhandari et al., ZeRO, SC 2020.
    """
    return _ACTIVE.get()


def shard_length(size: int, n_devices: int) -> int:
    """Values in one device's shard of a leaf of ``size`` values: ``ceil(size / N)`` (at least 1).

    Args:
      size: values in the leaf.
      n_devices: the shards.

    Returns:
      The shard's length.

    Example:
      >>> shard_length(10, 4), shard_length(0, 4)
      (3, 1)

    References:
      Rajbhandari et al., ZeRO, SC 2020 (even partitions of every tensor).
    """
    return max(1, sizes.ceil_div(size, n_devices))


def shard_of(leaf, n_devices: int, index):
    """Device ``index``'s shard of ``leaf``: ``shard_length`` values of its flattened, zero-padded
    form.

    Args:
      leaf: an array (the whole leaf).
      n_devices: the shards.
      index: the device's position (a Python int or an int32 scalar, e.g. ``jax.lax.axis_index``).

    Returns:
      A 1-D array of :func:`shard_length` values.

    Example:
      >>> shard_of(jnp.arange(5.0), 2, 1).tolist()
      [3.0, 4.0, 0.0]

    References:
      Rajbhandari et al., ZeRO, SC 2020.
    """
    return jax.lax.dynamic_index_in_dim(all_shards(leaf, n_devices), index, keepdims=False)


def all_shards(leaf, n_devices: int):
    """Every device's shard of ``leaf`` at once: its flattened, zero-padded form as ``[n_devices,
    shard_length]``, row ``i`` device ``i``'s (:func:`shard_of`).

    Args:
      leaf: an array (the whole leaf).
      n_devices: the shards.

    Returns:
      A ``[n_devices, shard_length(leaf.size, n_devices)]`` array.

    Example:
      >>> all_shards(jnp.arange(5.0), 2).tolist()
      [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]

    References:
      Rajbhandari et al., ZeRO, SC 2020.
    """
    m = shard_length(leaf.size, n_devices)
    return jnp.pad(leaf.ravel(), (0, n_devices * m - leaf.size)).reshape(n_devices, m)


def unshard(shards, shape):
    """The leaf of ``shape`` from all its shards, ``shards`` of shape ``[N, m]`` (an all-gather's
    result) or ``[N * m]``.

    Args:
      shards: every shard of the leaf, in device order.
      shape: the leaf's shape.

    Returns:
      The leaf (padding dropped).

    Example:
      >>> unshard(jnp.array([[0.0, 1, 2], [3, 4, 0]]), (5,)).tolist()
      [0.0, 1.0, 2.0, 3.0, 4.0]

    References:
      Rajbhandari et al., ZeRO, SC 2020 (the parameter all-gather).
    """
    return shards.reshape(-1)[: math.prod(shape)].reshape(shape)


def gather_whole(shards, like, axis_name):
    """The whole leaves from every device's shards: an all-gather over ``axis_name`` (the small
    leaves joined into one, :func:`jaxcomp.collectives.small.gather_leaf_shards`), then
    :func:`unshard`.

    Args:
      shards: a pytree of this device's 1-D shard of each leaf.
      like: the whole leaves' pytree (arrays or avals: their shapes).
      axis_name: the mesh axis the shards are spread over.

    Returns:
      The pytree of whole leaves, replicated, in the shards' dtypes.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda s: gather_whole(s, {"w": jnp.zeros(3)}, "data"),
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> f({"w": jnp.array([1.0, 2.0, 3.0, 0.0])})["w"].tolist()
      [1.0, 2.0, 3.0]

    References:
      Rajbhandari et al., ZeRO, SC 2020 (the parameter all-gather).
    """
    gathered = small.gather_leaf_shards(shards, axis_name)
    return jax.tree.map(lambda g, a: unshard(g, a.shape), gathered, like)


def shard_major(parts, n_devices: int, row: int):
    """One vector of ``n_devices * row`` values from whole leaves ``parts``: row ``d`` holds device
    ``d``'s shard of each part in order, zero-padded to ``row`` values.

    Args:
      parts: arrays (whole leaves).
      n_devices: the shards.
      row: values per row, at least the sum of the parts' :func:`shard_length`.

    Returns:
      The flattened ``[n_devices, row]`` matrix.

    Example:
      >>> shard_major([jnp.arange(4.0), jnp.arange(10.0, 12.0)], 2, 4).tolist()
      [0.0, 1.0, 10.0, 0.0, 2.0, 3.0, 11.0, 0.0]

    References:
      Rajbhandari et al., ZeRO, SC 2020 (bucketed reduce-scatter of many tensors).
    """
    columns = []
    for part in parts:
        m = shard_length(part.size, n_devices)
        columns.append(jnp.pad(part.ravel(), (0, n_devices * m - part.size)).reshape(n_devices, m))
    used = sum(c.shape[1] for c in columns)
    if used > row:
        raise ValueError(f"row={row} is shorter than the {used} values of one device's shards")
    if used < row:
        columns.append(jnp.zeros((n_devices, row - used), columns[0].dtype))
    matrix = jnp.concatenate(columns, axis=1) if len(columns) > 1 else columns[0]
    return matrix.reshape(-1)


def from_shard_major(vector, sizes, n_devices: int):
    """The parts (flattened, ``sizes`` values each) of a :func:`shard_major` vector: its inverse.

    Args:
      vector: a :func:`shard_major` vector of ``n_devices`` rows.
      sizes: the values of each part, in order.
      n_devices: the shards.

    Returns:
      A list of 1-D arrays, one per part.

    Example:
      >>> v = shard_major([jnp.arange(4.0), jnp.arange(10.0, 12.0)], 2, 4)
      >>> [p.tolist() for p in from_shard_major(v, [4, 2], 2)]
      [[0.0, 1.0, 2.0, 3.0], [10.0, 11.0]]

    References:
      Rajbhandari et al., ZeRO, SC 2020.
    """
    matrix = vector.reshape(n_devices, -1)
    parts, offset = [], 0
    for size in sizes:
        m = shard_length(size, n_devices)
        parts.append(matrix[:, offset : offset + m].reshape(-1)[:size])
        offset += m
    return parts
