"""The vectors an update aggregates: leaves joined into one vector per group, and split back.

Without sharding a group's vector is its leaves raveled and concatenated; with
:func:`jaxcomp.optim.sharding.sharded_updates` in force it is shard-major
(:func:`jaxcomp.optim.sharding.shard_major`), padded to a row length every method accepts.
Every stage of :mod:`jaxcomp.optim.stages` reads and writes vectors through this module.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import flat, scatter
from jaxcomp.ops.pieces import Pieces
from jaxcomp.optim import sharding


def row(branches, parts, shards) -> int | None:
    """Values per device row of the shard-major vector of ``parts`` (None when not sharded): the
    shards of the parts, padded until every branch accepts the row (:meth:`Method.shard_row`).

    Args:
      branches: the methods that will aggregate the vector.
      parts: the arrays joined into it.
      shards: the devices sharing the shards, or None.

    Returns:
      The row length, or None without ``shards``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.methods import Dense
      >>> row((Dense(),), [jnp.zeros(5), jnp.zeros(3)], 2), row((), [jnp.zeros(5)], None)
      (5, None)

    References:
      Rajbhandari et al., "ZeRO", SC 2020 (each device's shard of every leaf).
    """
    if shards is None:
        return None
    length = sum(sharding.shard_length(p.size, shards) for p in parts)
    for _ in range(8):
        padded = functools.reduce(lambda r, m: max(r, m.shard_row(r, shards)), branches, length)
        if padded == length:
            return length
        length = padded
    raise ValueError(
        f"the methods {[m.describe() for m in branches]} agree on no row length for {length} values"
    )


def pack(parts, shards, row_length):
    """One vector of the parts: concatenated, or shard-major with ``shards``.

    Args:
      parts: arrays, any shapes.
      shards: the devices sharing the shards, or None.
      row_length: :func:`row`'s length (with ``shards``).

    Returns:
      A 1-D array.

    Example:
      >>> import jax.numpy as jnp
      >>> pack([jnp.ones((2, 2)), jnp.zeros(1)], None, None).tolist()
      [1.0, 1.0, 1.0, 1.0, 0.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-C3 (fused compression of the whole model).
    """
    return flat.concat(parts) if shards is None else sharding.shard_major(parts, shards, row_length)


def pieces(leaves, positions, vector, shards, silenced=None, drop=False):
    """``(i, flat piece)`` of ``vector`` for each leaf ``i`` at ``positions``: the inverse
    of :func:`pack`.

    Args:
      leaves: the update's leaves.
      positions: the group's leaf positions.
      vector: the group's per-device vector, or :class:`jaxcomp.ops.pieces.Pieces` of it
        (each part whole leaves; not sharded).
      shards: the devices sharing the shards, or None.
      silenced: None, or a bool scalar: True makes every piece 0.
      drop: non-finite values become 0. Both are applied as the pieces are cut (on the CPU, in
        the native pass that cuts a float32 vector into many small leaves, where a select of its
        own would write the whole vector once more).

    Returns:
      An iterable of ``(position, 1-D piece)``.

    Example:
      >>> import jax.numpy as jnp
      >>> [(i, p.tolist())
      ...  for i, p in pieces([jnp.zeros(1), jnp.zeros(2)], [0, 1], jnp.arange(3.0), None)]
      [(0, [0.0]), (1, [1.0, 2.0])]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (each leaf's residual).
    """
    sizes = [leaves[i].size for i in positions]
    if isinstance(vector, Pieces):  # each part whole leaves: cut each on its own
        return [
            piece
            for part, at in _parts(vector, leaves, positions)
            for piece in pieces(leaves, at, part, None, silenced, drop)
        ]
    if vector.dtype == jnp.float32 and shards is None:
        # One native pass on the CPU for runs of small leaves: no compiled loop per leaf.
        return zip(
            positions, scatter.split_scaled(vector, [(n,) for n in sizes], 1.0, silenced, drop)
        )
    if shards is not None:
        cut = sharding.from_shard_major(vector, sizes, shards)
    else:
        offsets = np.cumsum([0] + sizes)
        cut = [vector[offsets[j] : offsets[j + 1]] for j in range(len(positions))]
    return zip(positions, [_finished(piece, silenced, drop) for piece in cut])


def _finished(piece, silenced, drop):
    """``piece`` with :func:`pieces`'s ``drop`` and ``silenced`` applied (XLA fuses both into the
    cut)."""
    piece = flat.dropped(piece) if drop else piece
    return piece if silenced is None else flat.cleared(silenced, piece)


def write(out, leaves, positions, total, scale, skipped, shards=None):
    """Splits a group's ``total`` into its leaves' updates in ``out`` (zeros on a skipped step);
    with ``shards``, ``total`` is this device's row and each update is its 1-D shard of the leaf.

    Args:
      out: the update's leaves, written in place at ``positions``.
      leaves: the gradients' leaves (shapes and dtypes).
      positions: the group's leaf positions.
      total: the group's aggregate: a dense vector, a :class:`jaxcomp.ops.scatter.SparseTotal`
        (written into the leaves by :func:`jaxcomp.ops.scatter.scatter_leaves`, without
        sharding), or :class:`jaxcomp.ops.pieces.Pieces` (each part split on its own).
      scale: ``1 / devices`` for the mean, else 1.
      skipped: the step's skip flag, or None.
      shards: the devices sharing the shards, or None.

    Returns:
      None; ``out`` holds the updates.

    Example:
      >>> import jax.numpy as jnp
      >>> out = [None]
      >>> write(out, [jnp.zeros(2)], [0], jnp.array([2.0, 4.0]), 0.5, None)
      >>> out[0].tolist()
      [1.0, 2.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (the averaged aggregate).
    """
    if isinstance(total, scatter.SparseTotal):  # top-k, random-k: the pairs, into the leaves
        if shards is not None:
            raise ValueError("a sparse total is replicated; sharded updates take dense rows")
        updates = scatter.scatter_leaves(
            total, [leaves[i].shape for i in positions], scale, skipped
        )
    elif isinstance(total, Pieces):  # PowerSGD: each part into its own leaves
        for part, at in _parts(total, leaves, positions):
            write(out, leaves, at, part, scale, skipped)
        return
    else:
        shapes = [
            leaves[i].shape if shards is None else (sharding.shard_length(leaves[i].size, shards),)
            for i in positions
        ]
        updates = scatter.split_scaled(total, shapes, scale, skipped)
    for i, update in zip(positions, updates):
        out[i] = update.astype(leaves[i].dtype)


def keep(new, old, leaves, positions, vector, skipped, shards=None, cleared=None, drop=False):
    """Splits a group's per-device ``vector`` (residual, momentum) into its leaves in ``new``,
    keeping the ``old`` values on a skipped step; ``cleared`` (a bool scalar) makes them 0
    instead, and with ``drop`` a non-finite value is kept as 0.

    Args:
      new: the state's leaves, written in place at ``positions``.
      old: the state's leaves before the step.
      leaves: the gradients' leaves (shapes).
      positions: the group's leaf positions.
      vector: the group's per-device vector.
      skipped: the step's skip flag, or None.
      shards: the devices sharing the shards, or None.
      cleared: None, or a bool scalar: the step triggered the guardrail (zeros are kept).
      drop: non-finite entries of ``vector`` are kept as 0.

    Returns:
      None; ``new`` holds the kept values.

    Example:
      >>> import jax.numpy as jnp
      >>> new = [None]
      >>> keep(new, [jnp.zeros(2)], [jnp.zeros(2)], [0], jnp.array([1.0, 2.0]), None)
      >>> new[0].tolist()
      [1.0, 2.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (the residual each worker keeps).
    """
    for i, piece in pieces(leaves, positions, vector, shards, cleared, drop):
        piece = piece.reshape(leaves[i].shape)
        new[i] = piece if skipped is None else jnp.where(skipped, old[i], piece)


def _parts(vector: Pieces, leaves, positions):
    """``(part, its leaf positions)`` of :class:`~jaxcomp.ops.pieces.Pieces` whose parts each
    hold whole leaves of ``positions``, in order."""
    out, at = [], 0
    for part in vector.parts:
        n, first = 0, at
        # (a leaf without values goes with the part before it, or with the first)
        while at < len(positions) and (n < part.size or leaves[positions[at]].size == 0):
            n += leaves[positions[at]].size
            at += 1
        if n != part.size:
            raise ValueError(
                f"a part of {part.size} values does not hold whole leaves (sizes "
                f"{[leaves[i].size for i in positions]})"
            )
        out.append((part, positions[first:at]))
    if at != len(positions):
        raise ValueError(f"the parts hold {at} of the group's {len(positions)} leaves")
    return out
