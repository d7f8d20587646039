"""A :func:`jaxcomp.diloco` worker's inner step, where its inner optimizer state lives, and how
the devices of a two-level mesh's row share the outer exchange.

Without an inner axis a worker is one device: ``inner_tx`` updates its whole params. On a
two-level mesh a worker is a row of devices along ``inner_axis`` that split its batch block:

* ``shard=None``: every device of the row holds the whole inner optimizer state; the gradients
  are averaged over the row by a dense all-reduce (:func:`inner_mean`, the head of the inner
  chain), and every device applies the same update.
* ``shard="optimizer"`` (ZeRO stage 1 over the row): device ``i`` of the row owns the ``i``-th
  ``1/n`` shard of every leaf (:mod:`jaxcomp.optim.sharding`'s layout: flattened, zero-padded,
  split evenly). The gradients are reduce-scattered over the row, ``inner_tx`` updates the
  device's shards with optimizer state of the shards' size, and the updated shards are
  all-gathered back into the worker's whole params. The row moves the same bytes as the
  all-reduce (a reduce-scatter and an all-gather), and each device keeps ``1/n`` of the inner
  optimizer state (AdamW: a worker's two params-sized moments spread over its row, not on
  every device).

The row also splits the outer exchange (``exchange="split"``, the default with an inner axis):
device ``i`` of every worker sends only the ``i``-th block of each leaf of the pseudo-gradient
(along the leaf's longest axis) through the outer ``compress``, with its own residual, and the row
all-gathers the averaged blocks: a hierarchical all-reduce, each value over the slow axis once
per worker instead of once per device.

The stored inner state has one leading row per holder: ``[n_workers, ...]`` sharded over the outer
axis, or with ``shard="optimizer"`` ``[n_workers * n_inner, ...]`` sharded over both axes
(worker-major), so that each device's row is its own shards' state.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jaxcomp.collectives import dense, small
from jaxcomp.optim import sharding
from jaxcomp.optim.nonfinite import finite_updated, keep_finite
from jaxcomp.optim.vma import cond_typed_alike, varying_axes

#: The ``shard=`` modes of :func:`jaxcomp.diloco`.
DILOCO_SHARD_MODES = (None, "optimizer")
#: The ``exchange=`` modes of :func:`jaxcomp.diloco`: each device of a worker's row sends its
#: ``1/n`` block of the pseudo-gradient over the outer axis (``"split"``), or all of it.
EXCHANGE_MODES = ("split", "whole")


class Inner:
    """The inner steps of one :func:`jaxcomp.diloco` run: ``inner_tx``, the axes and ``shard``.

    Attributes:
      user_tx: ``inner_tx`` as the user gave it.
      tx: what runs: ``user_tx``, or with an inner axis and no ``shard`` the chain
        ``(inner_mean, user_tx)``.
      outer_axis, inner_axis, shard: as :func:`jaxcomp.diloco` was given them.
      splits: whether the outer exchange is split over the row (``exchange="split"``).
      n_workers, n_inner: the sizes of the two axes (``n_inner = 1`` without an inner axis).
    """

    def __init__(self, tx, mesh, outer_axis, inner_axis, shard, exchange="whole"):
        self.user_tx = tx
        self.outer_axis, self.inner_axis, self.shard = outer_axis, inner_axis, shard
        self.splits = exchange == "split"
        self.n_workers = mesh.shape[outer_axis]
        self.n_inner = mesh.shape[inner_axis] if inner_axis is not None else 1
        if inner_axis is not None and shard is None:
            # The inner gradients are averaged over the fast axis first, densely.
            tx = optax.chain(inner_mean(inner_axis, self.n_inner), tx)
        self.tx = tx

    @property
    def spec(self) -> P:
        """The ``PartitionSpec`` of every stored inner-state leaf (its leading rows)."""
        return P((self.outer_axis, self.inner_axis)) if self.shard else P(self.outer_axis)

    def state_avals(self, avals):
        """The avals of one holder's inner state (of the whole params, or of one shard each)."""
        return jax.eval_shape(self.tx.init, self._shard_avals(avals) if self.shard else avals)

    def initial_state(self, params):
        """Every holder's initial inner state, stacked along a leading axis (traced, e.g. under
        ``jax.jit``): ``[n_workers, ...]``, or ``[n_workers * n_inner, ...]`` sharded."""
        if not self.shard:
            state = self.tx.init(params)
            return jax.tree.map(
                lambda x: jnp.broadcast_to(x, (self.n_workers, *jnp.shape(x))), state
            )
        shards = jax.tree.map(lambda p: sharding.all_shards(p, self.n_inner), params)
        rows = [self.tx.init(jax.tree.map(lambda s: s[i], shards)) for i in range(self.n_inner)]
        # Worker-major: row w * n_inner + i is device i of worker w.
        return jax.tree.map(lambda *xs: jnp.concatenate([jnp.stack(xs)] * self.n_workers), *rows)

    def step(self, local, grads, state):
        """``(local, state)`` after one inner step, inside ``shard_map``: ``local`` the worker's
        whole params (this device's copy), ``grads`` this device's gradient of its batch shard
        (typed varying over the inner axis), ``state`` this device's row of the inner state.
        An entry the inner optimizer makes not finite keeps its old value (as
        ``data_parallel(nonfinite_updates="drop")``)."""
        if not self.shard:
            updates, new_state = self.tx.update(grads, state, local)
            return finite_updated(local, updates), keep_finite(state, new_state)
        me = jax.lax.axis_index(self.inner_axis)
        mine = jax.tree.map(lambda p: sharding.shard_of(p, self.n_inner, me), local)
        updates, new_state = self.tx.update(self._mean_shards(grads), state, mine)
        new = finite_updated(mine, updates)
        return sharding.gather_whole(new, local, self.inner_axis), keep_finite(state, new_state)

    def fresh_state(self, local):
        """This device's row of the inner state as ``tx.init`` makes it, inside ``shard_map``
        (of the worker's whole params, or of this device's shard of them)."""
        if not self.shard:
            return self.tx.init(local)
        me = jax.lax.axis_index(self.inner_axis)
        return self.tx.init(jax.tree.map(lambda p: sharding.shard_of(p, self.n_inner, me), local))

    # -- the outer exchange, split over the row (exchange="split") -----------------------------

    def block_avals(self, avals: list) -> list:
        """The avals of one device's blocks of a fragment's leaves (the leaves themselves when
        the exchange is not split): what the outer compress sees."""
        if not self.splits:
            return list(avals)
        return [jax.ShapeDtypeStruct(_block_shape(a.shape, self.n_inner), a.dtype) for a in avals]

    def block(self, leaf):
        """This device's block of a whole leaf (inside ``shard_map``): along the leaf's longest
        axis, zero-padded to ``n * ceil(size / n)``, the ``i``-th of ``n`` for device ``i`` of
        the row; that axis moved first, so a matrix stays a matrix (PowerSGD, ZFP, per-leaf
        top-k see its shape)."""
        if not self.splits:
            return leaf
        x = leaf.reshape(1) if leaf.ndim == 0 else leaf
        axis = _longest_axis(x.shape)
        x = jnp.moveaxis(x, axis, 0)
        m = sharding.shard_length(x.shape[0], self.n_inner)
        x = jnp.pad(x, [(0, self.n_inner * m - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(self.inner_axis) * m, m)

    def wholes(self, blocks: list, shapes: list) -> list:
        """The whole leaves of ``shapes`` from every device's ``blocks`` (an all-gather over the
        row, the small blocks in one: :func:`jaxcomp.collectives.small.gather_leaf_shards`;
        typed invariant over it)."""
        if not self.splits:
            return list(blocks)
        return [
            _from_blocks(gathered, shape)  # gathered: [n, m, *others]
            for gathered, shape in zip(small.gather_leaf_shards(blocks, self.inner_axis), shapes)
        ]

    def exchange_spec(self, per_worker: bool) -> P:
        """The ``PartitionSpec`` of an outer compress-state leaf: per worker (a residual) or
        replicated over the workers; with a split exchange, also a row per device of the row
        (each device compresses its own blocks)."""
        if not self.splits:
            return P(self.outer_axis) if per_worker else P()
        return P((self.outer_axis, self.inner_axis)) if per_worker else P(self.inner_axis)

    def exchange_rows(self, leaf, per_worker: bool):
        """An initial outer compress-state leaf (``[n_workers, ...]`` if ``per_worker``) laid out
        for :meth:`exchange_spec`: a split exchange repeats it for the devices of the row."""
        if not self.splits:
            return leaf
        if per_worker:
            return jnp.repeat(leaf, self.n_inner, axis=0)
        return jnp.broadcast_to(leaf, (self.n_inner, *jnp.shape(leaf)))

    def row_bytes(self, bytes_sent):
        """The bytes one device sent in a split exchange, the same on every device of the row."""
        if self.splits and self.inner_axis in varying_axes(bytes_sent):
            return small.metric_mean(bytes_sent, self.inner_axis)
        return bytes_sent

    def cond(self, pred, run, wait, operands):
        """``lax.cond`` of an exchange; with a split exchange its branches' outputs typed alike
        (the blocks' compress state varies over the row, the passed-through one is read so)."""
        if self.splits:
            return cond_typed_alike(pred, run, wait, operands)
        return jax.lax.cond(pred, run, wait, operands)

    def _shard_avals(self, avals):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(
                (sharding.shard_length(math.prod(a.shape), self.n_inner),), a.dtype
            ),
            avals,
        )

    def _mean_shards(self, grads):
        """This device's shard of the row's mean of each gradient leaf: a reduce-scatter over the
        row, one for the small leaves of each dtype (XLA:CPU would run merged ones one per leaf:
        :func:`jaxcomp.collectives.small.joined_groups`), one per large leaf."""
        leaves, treedef = jax.tree.flatten(grads)
        out = [None] * len(leaves)
        for group in small.joined_groups(leaves):
            parts = [leaves[i] for i in group]
            lengths = [sharding.shard_length(p.size, self.n_inner) for p in parts]
            vector = sharding.shard_major(parts, self.n_inner, sum(lengths))
            row = dense.psum_scatter(vector, self.inner_axis)[0] / self.n_inner
            for i, piece in zip(group, jnp.split(row, np.cumsum(lengths)[:-1].tolist())):
                out[i] = piece
        return treedef.unflatten(out)


def _longest_axis(shape) -> int:
    """The axis a leaf's exchange blocks split (its longest; the first of equals)."""
    return max(range(len(shape)), key=lambda i: (shape[i], -i))


def _block_shape(shape, n: int) -> tuple:
    """The shape of one of ``n`` blocks of a leaf of ``shape`` (see :meth:`Inner.block`)."""
    x_shape = tuple(shape) or (1,)
    axis = _longest_axis(x_shape)
    others = x_shape[:axis] + x_shape[axis + 1 :]
    return (sharding.shard_length(x_shape[axis], n), *others)


def inner_mean(axis_name, size: int) -> optax.GradientTransformation:
    """The gradients averaged over a worker's fast axis (a dense all-reduce), as a stateless
    optax transformation: the head of a two-level run's inner chain.

    Args:
      axis_name: the inner mesh axis.
      size: its number of devices.

    Returns:
      An ``optax.GradientTransformation``; its ``update`` runs inside ``shard_map``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> tx = inner_mean("data", 2)
      >>> f = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> f(jnp.arange(4.0)).tolist()
      [1.0, 2.0]

    References:
      Douillard et al., "DiLoCo" (arXiv 2311.08105), §2 (each worker is itself data-parallel).
    """

    def update(grads, state, params=None):
        del params
        mean = jax.tree.map(
            lambda g: (dense.psum(g.reshape(-1), axis_name)[0] / size).reshape(g.shape), grads
        )
        return mean, state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _from_blocks(gathered, shape):
    """The leaf of ``shape`` from its ``n`` blocks ``[n, m, *others]`` (:meth:`Inner.block`'s
    inverse: the padding dropped, the longest axis moved back)."""
    x_shape = tuple(shape) or (1,)
    axis = _longest_axis(x_shape)
    x = gathered.reshape((-1,) + gathered.shape[2:])[: x_shape[axis]]
    return jnp.moveaxis(x, 0, axis).reshape(shape)
