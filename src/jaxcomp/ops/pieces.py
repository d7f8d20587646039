"""A 1-D vector held as its consecutive parts, never joined.

A method whose total or contribution is made leaf by leaf (PowerSGD's ``P Q^T`` per matrix)
would otherwise join the parts into one vector (a pass that writes the whole gradient), and the
update would split that vector into its leaves again (another). Handed over as :class:`Pieces`
whose parts each hold whole leaves, each part goes where it belongs: the scaled updates of its
leaves, or their residuals (:mod:`jaxcomp.optim.packing`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import flat
from jaxcomp.ops.sign import ScaledSigns


@jax.tree_util.register_pytree_node_class
class Pieces:
    """The vector ``concatenate(parts)``, kept as its 1-D ``parts``.

    Args:
      parts: 1-D arrays of one dtype, in the vector's order.

    Example:
      >>> import jax.numpy as jnp
      >>> v = Pieces([jnp.array([1.0, 2.0]), jnp.array([3.0])])
      >>> v.size, v.joined().tolist(), v.map(lambda p: 2 * p).joined().tolist()
      (3, [1.0, 2.0, 3.0], [2.0, 4.0, 6.0])

    References:
      Vogels et al., "PowerSGD", NeurIPS 2019, Alg. 1 (a low-rank product per matrix).
    """

    def __init__(self, parts):
        self.parts = list(parts)

    def tree_flatten(self):
        return tuple(self.parts), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        # No checks: JAX may unflatten with placeholders in place of the arrays.
        pieces = object.__new__(cls)
        pieces.parts = list(children)
        return pieces

    @property
    def sizes(self) -> list[int]:
        """Values per part."""
        return [int(np.prod(p.shape)) for p in self.parts]

    @property
    def size(self) -> int:
        """Values in the vector."""
        return sum(self.sizes)

    @property
    def dtype(self):
        """The parts' dtype."""
        return self.parts[0].dtype

    def map(self, fn) -> Pieces:
        """``fn`` applied to each part (an elementwise ``fn`` acts on the whole vector)."""
        return Pieces([fn(p) for p in self.parts])

    def joined(self):
        """The vector itself (one pass that writes it: only where something needs it whole)."""
        return flat.concat(self.parts)

    @classmethod
    def split(cls, vector, sizes) -> Pieces:
        """``vector`` cut into consecutive parts of ``sizes`` values (which add up to its
        length)."""
        offsets = np.cumsum([0, *sizes])
        if offsets[-1] != vector.shape[0]:
            raise ValueError(f"sizes {list(sizes)} add up to {offsets[-1]}, not {vector.shape[0]}")
        return cls([vector[a:b] for a, b in zip(offsets[:-1], offsets[1:])])


def joined(vector):
    """``vector`` as one array: a :class:`Pieces` joined, the vector of
    :class:`~jaxcomp.ops.sign.ScaledSigns`, anything else as it is.

    Args:
      vector: a 1-D array, :class:`Pieces` or :class:`~jaxcomp.ops.sign.ScaledSigns`.

    Returns:
      A 1-D array.

    Example:
      >>> import jax.numpy as jnp
      >>> joined(Pieces([jnp.ones(1), jnp.zeros(1)])).tolist(), joined(jnp.ones(1)).tolist()
      ([1.0, 0.0], [1.0])

    References:
      Vogels et al., "PowerSGD", NeurIPS 2019, Alg. 1.
    """
    return vector.joined() if isinstance(vector, (Pieces, ScaledSigns)) else vector


def each(fn, vector):
    """``fn`` of a vector, or of each part of :class:`Pieces` (for an elementwise ``fn``).

    Args:
      fn: an elementwise function of an array.
      vector: a 1-D array or :class:`Pieces`.

    Returns:
      ``fn(vector)``, as :class:`Pieces` when ``vector`` is.

    Example:
      >>> import jax.numpy as jnp
      >>> each(jnp.abs, Pieces([-jnp.ones(1)])).joined().tolist()
      [1.0]

    References:
      Vogels et al., "PowerSGD", NeurIPS 2019, Alg. 1.
    """
    return vector.map(fn) if isinstance(vector, Pieces) else fn(vector)


def energies(vector, energy_scale=1.0):
    """:func:`jaxcomp.ops.flat.energies` of a vector or of :class:`Pieces` (summed over the
    parts, no join), or of :class:`~jaxcomp.ops.sign.ScaledSigns` (from its scales, no read of
    the vector).

    Args:
      vector: a 1-D array, :class:`Pieces` or :class:`~jaxcomp.ops.sign.ScaledSigns`.
      energy_scale: as for :func:`jaxcomp.ops.flat.energies`.

    Returns:
      ``flat.energies``'s three float32 scalars, as an array.

    Example:
      >>> import jax.numpy as jnp
      >>> energies(Pieces([jnp.ones(2), jnp.ones(1)])).tolist()[0]
      3.0

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019 (the energies).
    """
    if isinstance(vector, ScaledSigns):
        return vector.energies(energy_scale)
    if not isinstance(vector, Pieces):
        return jnp.asarray(flat.energies(vector, energy_scale))
    return sum(jnp.asarray(flat.energies(p, energy_scale)) for p in vector.parts)
