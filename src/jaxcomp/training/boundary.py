"""Many small leaves cross a ``shard_map``'s boundary as a few packed arrays.

XLA's partitioner (the ``shardy-xla`` and ``spmd-partitioning`` passes) takes time quadratic in
the operands of a ``shard_map``: a ``shard_map`` of thousands of leaves in and out compiles for
tens of seconds (docs/performance.md, "The first step of a model of 1,000 small leaves"). A
training step carries every leaf of the params, of the optimizer state and of each ``compress``
residual, so a model of 1,000 small leaves under Adam and ``compress`` brings 4,000 leaves in and
out, and its first step spent most of its time in those passes alone.

:class:`Packing` concatenates the small leaves that share a ``PartitionSpec`` and a dtype into
one array before the boundary and slices them back after it: the ``shard_map`` sees a handful of
operands whatever the model. Leaves over :data:`SMALL_LEAF_VALUES` values travel as they are
(packing them would copy real data), and a state of fewer than :data:`MANY_SMALL_LEAVES` small
leaves is not packed at all, so the step of an ordinary model is unchanged. Once the partitioner
has inlined the ``shard_map``, XLA folds each slice of a packed array back into the leaf it came
from: the compiled step of a model of 1,030 small leaves has the same concatenates and copies
packed as not, and runs as fast. :func:`jaxcomp.data_parallel`'s and :func:`jaxcomp.diloco`'s
steps, a sharded run's initial state and ``params()`` of ``shard="params"`` cross their
``shard_map`` with :func:`packed_shard_map`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

#: A leaf of at most this many values may travel packed.
SMALL_LEAF_VALUES = 1 << 16

#: Packing starts when a state holds at least this many small leaves.
MANY_SMALL_LEAVES = 256


@dataclasses.dataclass(frozen=True)
class _Group:
    """Leaves packed into one array: their positions in the flat list and their shapes."""

    spec: P
    dtype: np.dtype
    positions: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def per_device(self) -> bool:
        """The leaves carry a leading per-device axis (a spec that splits axis 0)."""
        return self.spec != P()

    def pieces(self, lead: int) -> list[tuple[int, tuple[int, ...]]]:
        """``(values, shape)`` of each leaf in the packed array (per row of a per-device group),
        ``lead`` the array's leading size."""
        out = []
        for shape in self.shapes:
            body = shape[1:] if self.per_device else shape
            size = int(np.prod(body, dtype=np.int64))
            out.append((size, ((lead,) + body) if self.per_device else body))
        return out


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a list of leaves crosses a ``shard_map`` boundary: which travel packed, in which array.

    Build one with :meth:`plan` from the leaves outside the ``shard_map`` (whole shapes, per-device
    leaves with their leading device axis) and their specs; :meth:`pack` and :meth:`unpack` work on
    both sides of the boundary, since a per-device leaf keeps its leading axis whatever its length.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> leaves = [jnp.full((2, 3), i, jnp.float32) for i in range(4)]
      >>> packing = Packing.plan(leaves, [P()] * 4, min_leaves=2)
      >>> packed = packing.pack(leaves)
      >>> [a.shape for a in packed], len(packing.specs)
      ([(24,)], 1)
      >>> all(bool((a == b).all()) for a, b in zip(packing.unpack(packed), leaves))
      True
    """

    n_leaves: int
    groups: tuple[_Group, ...]
    loose: tuple[int, ...]
    loose_specs: tuple[P, ...]

    @classmethod
    def plan(cls, leaves, specs, *, min_leaves=None, max_values=None):
        """The packing of ``leaves`` (arrays or avals) with their ``specs``.

        Args:
          leaves: the flat list of leaves, as the caller has them outside ``shard_map``.
          specs: one ``PartitionSpec`` per leaf: ``P()`` (replicated) or one that splits axis 0
            only (a per-device leaf); a leaf with another spec travels as it is.
          min_leaves: pack only when at least this many leaves are small (default
            :data:`MANY_SMALL_LEAVES`).
          max_values: the largest leaf (values) that may travel packed (default
            :data:`SMALL_LEAF_VALUES`).

        Returns:
          A :class:`Packing`; with too few small leaves, one that packs nothing.
        """
        if len(specs) != len(leaves):
            raise ValueError(f"specs has {len(specs)} entries for {len(leaves)} leaves")
        min_leaves = MANY_SMALL_LEAVES if min_leaves is None else min_leaves
        max_values = SMALL_LEAF_VALUES if max_values is None else max_values
        keys = [_group_key(leaf, spec, max_values) for leaf, spec in zip(leaves, specs)]
        if sum(k is not None for k in keys) < min_leaves:
            keys = [None] * len(leaves)
        by_key: dict = {}
        for i, key in enumerate(keys):
            if key is not None:
                by_key.setdefault(key, []).append(i)
        groups = tuple(
            _Group(spec, dtype, tuple(pos), tuple(tuple(leaves[i].shape) for i in pos))
            for (spec, dtype), pos in by_key.items()
        )
        loose = tuple(i for i, key in enumerate(keys) if key is None)
        return cls(len(leaves), groups, loose, tuple(specs[i] for i in loose))

    @property
    def specs(self) -> list[P]:
        """The specs of :meth:`pack`'s arrays: the groups' then the loose leaves'."""
        return [g.spec for g in self.groups] + list(self.loose_specs)

    def pack(self, leaves) -> list:
        """The arrays that cross the boundary: one per group, then each loose leaf."""
        packed = []
        for group in self.groups:
            parts = [jnp.asarray(leaves[i]) for i in group.positions]
            if group.per_device:
                lead = parts[0].shape[0]
                flat = [jax.lax.reshape(p, (lead, p.size // lead)) for p in parts]
            else:
                flat = [jax.lax.reshape(p, (p.size,)) for p in parts]
            packed.append(jax.lax.concatenate(flat, 1 if group.per_device else 0))
        return packed + [leaves[i] for i in self.loose]

    def unpack(self, packed) -> list:
        """The leaves, in their order, from :meth:`pack`'s arrays."""
        leaves = [None] * self.n_leaves
        for group, array in zip(self.groups, packed):
            pieces = group.pieces(array.shape[0])
            sizes = [size for size, _ in pieces]
            parts = jax.lax.split(array, sizes, axis=1 if group.per_device else 0)
            for i, part, (_, shape) in zip(group.positions, parts, pieces):
                leaves[i] = jax.lax.reshape(part, shape)
        for i, leaf in zip(self.loose, packed[len(self.groups) :]):
            leaves[i] = leaf
        return leaves


def _group_key(leaf, spec, max_values):
    """``(spec, dtype)`` of a leaf that may travel packed, or None."""
    size = int(np.prod(leaf.shape, dtype=np.int64))
    if size == 0 or size > max_values or jnp.issubdtype(leaf.dtype, jax.dtypes.extended):
        return None  # typed PRNG keys and the like travel as they are
    # Replicated, or split along axis 0 only (a per-device leaf, which has that axis).
    if spec == P() or (len(spec) == 1 and spec[0] is not None):
        return (spec, np.dtype(leaf.dtype))
    return None


def packed_shard_map(fn, *, mesh, in_specs, out_specs, in_avals, out_avals=None):
    """``jax.shard_map(fn, ...)`` whose first argument and first result, two pytrees, cross the
    boundary packed (:class:`Packing`).

    ``fn(tree, *rest) -> (tree', *outs)``; ``rest`` and ``outs`` cross as they are. A training
    step takes a state and returns the next one of the same shapes (``out_avals`` defaults to
    ``in_avals``); an initial state or a gather returns another tree.

    Args:
      fn: the per-device function.
      mesh: the mesh.
      in_specs: ``(tree_specs, *rest_specs)``.
      out_specs: ``(tree_specs', *outs_specs)``.
      in_avals: the first argument's leaves (arrays or avals) as the caller passes them.
      out_avals: the first result's leaves as the caller gets them (default ``in_avals``).

    Returns:
      A function of ``(tree, *rest)`` with ``fn``'s results.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
      >>> tree = [jnp.ones(3) for _ in range(300)]
      >>> f = packed_shard_map(lambda t, x: ([a * x for a in t], x), mesh=mesh,
      ...                      in_specs=([P()] * 300, P()), out_specs=([P()] * 300, P()),
      ...                      in_avals=tree)
      >>> out, x = jax.jit(f)(tree, jnp.float32(2))
      >>> float(out[299][0])
      2.0

    References:
      docs/performance.md, "The first step of a model of 1,000 small leaves" (the partitioner's
      time, measured).
    """
    tree_in, *rest_specs = in_specs
    tree_out, *outs_specs = out_specs
    packing_in, def_in = _plan(tree_in, in_avals)
    packing_out, def_out = _plan(tree_out, in_avals if out_avals is None else out_avals)

    def local(packed, *rest):
        new_tree, *outs = fn(jax.tree.unflatten(def_in, packing_in.unpack(packed)), *rest)
        return (packing_out.pack(def_out.flatten_up_to(new_tree)), *outs)

    mapped = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(packing_in.specs, *rest_specs),
        out_specs=(packing_out.specs, *outs_specs),
    )

    def run(tree, *rest):
        packed, *outs = mapped(packing_in.pack(def_in.flatten_up_to(tree)), *rest)
        return (jax.tree.unflatten(def_out, packing_out.unpack(packed)), *outs)

    return run


def _plan(tree_specs, avals):
    """``(packing, treedef)`` of a pytree of ``PartitionSpec`` s and its leaves' avals."""
    leaf_specs, treedef = jax.tree.flatten(tree_specs, is_leaf=lambda s: isinstance(s, P))
    return Packing.plan(jax.tree.leaves(avals), leaf_specs), treedef
