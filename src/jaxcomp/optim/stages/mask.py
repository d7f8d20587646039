"""The mask: which float leaves are compressed, and the exact sum of the others.

``mask=`` (a pytree of bools or a callable ``params -> pytree``) and ``min_size=`` choose the
leaves a method compresses; the float leaves they leave out ("plain") are summed as they are, in
one fused all-reduce (a reduce-scatter when sharded). :class:`Layout` records the choice for
one update; ``granularity`` groups the compressed leaves into one vector or one per leaf.

``optax.masked`` and ``optax.partition`` do not serve here: the leaves left out are not passed
through but summed exactly, and the count of their entries that overflowed rides in the step's
one psum of scalars, which a partition would give a transformation, and a psum, of its own.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import collectives, methods
from jaxcomp.optim import packing

#: The plain all-reduce of the leaves ``mask``/``min_size`` leave out, for its byte count.
_DENSE = methods.Dense()


def compressed_leaves(mask, min_size: int, tree) -> list[bool]:
    """Per leaf of ``tree`` (params or gradients): whether ``mask`` and ``min_size`` let it be
    compressed; the other float leaves are summed as they are, in one fused all-reduce.

    Args:
      mask: None (every leaf), a pytree of bools like ``tree``, or a callable returning one.
      min_size: leaves with fewer values are not compressed.
      tree: the params or gradients.

    Returns:
      One bool per leaf of ``tree``. Raises a ValueError naming ``mask`` when it does not fit.

    Example:
      >>> import jax.numpy as jnp
      >>> tree = {"b": jnp.zeros(2), "w": jnp.zeros((4, 4))}
      >>> compressed_leaves({"b": True, "w": True}, 3, tree)
      [False, True]

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018 (small layers are not compressed).
    """
    leaves, treedef = jax.tree.flatten(tree)
    if mask is None:
        chosen = [True] * len(leaves)
    else:
        mask = mask(tree) if callable(mask) else mask
        try:
            chosen = treedef.flatten_up_to(mask)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"mask must have the structure of the params (a pytree of bools, or a callable "
                f"returning one): {e}"
            ) from None
        bad = [m for m in chosen if not isinstance(m, (bool, np.bool_))]
        if bad:
            raise ValueError(
                f"mask must hold Python bools (True: compress the leaf), got {bad[0]!r}"
            )
    return [bool(m) and leaf.size >= min_size for m, leaf in zip(chosen, leaves)]


class Layout(NamedTuple):
    """Which leaves an update aggregates how (positions in the flattened tree)."""

    floats: list  # every float leaf
    groups: list  # [(positions, name)]: the compressed leaves, grouped by `granularity`
    plain: list  # float leaves mask= and min_size= leave out: one fused all-reduce
    buckets: list | None = None  # per group, its bucket (bucket_mb=); bucket 0: the last leaves

    @property
    def compressed(self) -> set:
        """The positions of the compressed leaves."""
        return {i for positions, _ in self.groups for i in positions}


def is_float(leaf) -> bool:
    """Whether a leaf is floating point (the others pass through an update untouched).

    Args:
      leaf: an array or abstract value.

    Returns:
      True for a floating dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> is_float(jnp.zeros(2)), is_float(jnp.zeros(2, jnp.int32))
      (True, False)

    References:
      optax (integer leaves carry no gradient).
    """
    return jnp.issubdtype(leaf.dtype, jnp.floating)


def layout(config, tree, sends_everything: bool) -> Layout:
    """The :class:`Layout` of ``tree`` (the params at init, the gradients in update).

    Args:
      config: the :class:`jaxcomp.optim.config.FeedbackConfig` (``granularity``, ``mask``).
      tree: the params or gradients.
      sends_everything: every method loses nothing: every float leaf is summed, the small ones
        together and the large ones each alone (:func:`summed_together`).

    Returns:
      A :class:`Layout`.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.optim.config import FeedbackConfig
      >>> config = FeedbackConfig.check("data", True, "model", True, 0, "zero", min_size=3)
      >>> layout(config, [jnp.zeros(2), jnp.zeros(8), jnp.zeros(9)], False)
      Layout(floats=[0, 1, 2], groups=[([1, 2], 'the model')], plain=[0], buckets=None)

      With ``bucket_mb``, the last leaves first, in buckets of at most that many MiB:

      >>> config = FeedbackConfig.check("data", True, "model", True, 0, "zero", bucket_mb=1e-4)
      >>> layout(config, [jnp.zeros(8), jnp.zeros(8), jnp.zeros(32)], False).groups
      [([2], 'bucket 0 (leaf 2)'), ([0, 1], 'bucket 1 (leaves 0-1)')]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-C3 (fused compression of the whole model).
    """
    leaves = jax.tree.leaves(tree)
    floats = [i for i, leaf in enumerate(leaves) if is_float(leaf)]
    # A method that sends everything is elementwise: a mask changes nothing.
    chosen = [True] * len(leaves) if sends_everything else config.compressed(tree)
    compressed = [i for i in floats if chosen[i]]
    plain = [i for i in floats if not chosen[i]]
    whole = config.granularity != "leaf" and not sends_everything
    if config.bucket_mb is None:
        groups = [(g, None) for g in _split(config, leaves, compressed, sends_everything)]
    else:
        buckets = bucketed(leaves, compressed, config.bucket_mb * 2**20)
        groups = [
            (g, b)
            for b, bucket in enumerate(buckets)
            for g in _split(config, leaves, bucket, sends_everything)
        ]
    return Layout(
        floats,
        [(g, _group_name(g, b, whole)) for g, b in groups],
        plain,
        None if config.bucket_mb is None else [b for _, b in groups],
    )


def _split(config, leaves, positions: list, sends_everything: bool) -> list:
    """The groups of ``positions`` (the compressed leaves of one bucket or of the model): one per
    leaf (``granularity="leaf"``), small leaves together for a method that sends everything
    (:func:`summed_together`), else one."""
    if config.granularity == "leaf":
        return [[i] for i in positions]
    if sends_everything:
        return summed_together(leaves, positions)
    return [positions] if positions else []


def _group_name(group: list, bucket: int | None, whole: bool) -> str:
    """A group's name in messages: ``the model``, ``bucket 1 (leaves 0-4)``, ``leaf 3``."""
    if whole and bucket is None:
        return "the model"
    if whole or (len(group) > 1 and bucket is not None):
        return f"bucket {bucket} ({_leaf_names(group)})"
    return _leaf_names(group)


def summed_together(leaves, positions: list) -> list:
    """The groups of a method that sends everything: the leaves at ``positions`` of at most
    :data:`jaxcomp.collectives.small.JOINED_VALUES` values of each dtype joined into one vector
    (one collective, not one per leaf: XLA:CPU runs a merged all-reduce as one per leaf), each
    larger leaf alone (summed where it lies, no copy).

    Args:
      leaves: the tree's leaves (their sizes and dtypes).
      positions: the leaves to group, in order.

    Returns:
      A list of groups, each a sorted list of positions, ordered by their first position.

    Example:
      >>> import jax.numpy as jnp
      >>> summed_together([jnp.zeros(3), jnp.zeros(70000), jnp.zeros(2)], [0, 1, 2])
      [[0, 2], [1]]

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB
      2020, §3.2.3 (a bucket is one flat buffer, one all-reduce).
    """
    groups = collectives.small.joined_groups([leaves[i] for i in positions])
    return [[positions[j] for j in group] for group in groups]


def bucketed(leaves, positions: list, bucket_bytes: float) -> list:
    """``positions`` cut into buckets of at most ``bucket_bytes`` (a larger leaf is a bucket of
    its own), the last leaves first: the order in which a backward pass of a model whose tree
    follows its layers finishes them (:mod:`jaxcomp.optim.readiness` orders the sending).

    Args:
      leaves: the tree's leaves (their sizes and dtypes).
      positions: the leaves to cut, in tree order.
      bucket_bytes: the most bytes of gradient a bucket holds.

    Returns:
      A list of buckets, each a sorted list of positions, in the order they are sent.

    Example:
      >>> import jax.numpy as jnp
      >>> bucketed([jnp.zeros(4), jnp.zeros(4), jnp.zeros(16)], [0, 1, 2], 32)
      [[2], [0, 1]]

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB
      2020, §3.2.3 (gradient buckets in reverse order, ``bucket_cap_mb``).
    """
    buckets, size = [], 0
    for i in reversed(positions):
        nbytes = leaves[i].size * jnp.dtype(leaves[i].dtype).itemsize
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += nbytes
        else:
            buckets.append([i])
            size = nbytes
    return [sorted(bucket) for bucket in buckets]


def _leaf_names(positions) -> str:
    if len(positions) == 1:
        return f"leaf {positions[0]}"
    contiguous = positions == list(range(positions[0], positions[-1] + 1))
    return f"leaves {positions[0]}-{positions[-1]}" if contiguous else f"leaves {positions}"


def check_same_choice(lay: Layout, kept_per_leaf) -> None:
    """Refuses updates whose mask chooses other leaves than the params ``init`` saw.

    Args:
      lay: the update's :class:`Layout`.
      kept_per_leaf: the state's per-leaf residual or velocity (``optax.MaskedNode()`` where a
        leaf is not compressed), or None when the state keeps neither.

    Returns:
      None; raises a ValueError naming ``mask`` and ``min_size``.

    Example:
      >>> import optax
      >>> lay = Layout([0], [([0], "leaf 0")], [])
      >>> check_same_choice(lay, [optax.MaskedNode()])
      Traceback (most recent call last):
      ValueError: mask and min_size choose other leaves ...

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018 (the residual of each compressed leaf).
    """
    compressed = lay.compressed
    if kept_per_leaf is not None and any(
        isinstance(kept_per_leaf[i], optax.MaskedNode) == (i in compressed) for i in lay.floats
    ):
        raise ValueError(
            "mask and min_size choose other leaves to compress for these updates than for the "
            "params init saw: give a mask that depends on the params' structure and shapes only"
        )


def sum_plain(parts, axis_name, n_devices: int, dtype_bytes: int, comm_dtype, shards):
    """The exact sum of the plain leaves' (finite) values: one all-reduce, or one reduce-scatter
    with ``shards``.

    Args:
      parts: the plain leaves, non-finite entries already 0.
      axis_name: the axis or axes to sum over.
      n_devices: devices over those axes.
      dtype_bytes: bytes per value on the wire.
      comm_dtype: the dtype the collective carries.
      shards: the devices sharing the shards, or None.

    Returns:
      ``(total, bytes one device sends, values summed)``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = lambda x: sum_plain([x], "data", 2, 4, jnp.float32, None)[0]
      >>> jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(jnp.arange(4.0)).tolist()
      [2.0, 4.0]

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018 (small layers sent dense).
    """
    plain = packing.pack(parts, shards, packing.row((), parts, shards)).astype(comm_dtype)
    kept = sum(p.size for p in parts)
    if shards is None:
        total, _ = collectives.psum(plain, axis_name)
        sent = _DENSE.wire_bytes(kept, n_devices, dtype_bytes=dtype_bytes)
    else:
        total, _ = collectives.psum_scatter(plain, axis_name)
        sent = _DENSE.reduce_scatter_bytes(kept, n_devices, dtype_bytes=dtype_bytes)
    return total, sent, kept
