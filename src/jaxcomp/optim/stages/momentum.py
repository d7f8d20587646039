"""Stage 4, DGC's momentum correction: each device accumulates a velocity, cleared where sent.

With ``momentum_correction=m`` a device compresses its velocity ``u = m u + g`` (plus the
residual) instead of ``g``, and the entries that were sent leave the velocity too (momentum
factor masking); the optimizer after ``compress`` then runs without momentum.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomp.methods import Method
from jaxcomp.ops import pieces


def check(method: Method, momentum: float | None) -> None:
    """Refuses momentum correction for a method that does not sparsify.

    Args:
      method: the :mod:`jaxcomp.methods` object.
      momentum: the ``momentum_correction=`` argument (validated), or None.

    Returns:
      None; raises a ValueError naming ``momentum_correction``.

    Example:
      >>> from jaxcomp.methods import Dense
      >>> check(Dense(), 0.9)
      Traceback (most recent call last):
      ValueError: momentum_correction applies to the sparsifying methods ...

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.2.
    """
    if momentum is not None and not method.sparse:
        raise ValueError(
            "momentum_correction applies to the sparsifying methods (jaxcomp.TopK, "
            "jaxcomp.RandomK), whose sent entries it clears from the momentum; got "
            f"{method.describe()}"
        )


def accumulate(momentum: float, velocity, g):
    """The new velocity ``u = m u + g`` (this device's, before compression).

    Args:
      momentum: ``m`` in [0, 1).
      velocity: the state's velocity of the leaf (float32).
      g: the leaf's finite gradient (float32).

    Returns:
      ``momentum * velocity + g``.

    Example:
      >>> import jax.numpy as jnp
      >>> accumulate(0.5, jnp.array([2.0]), jnp.array([1.0])).tolist()
      [2.0]

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.2, Eqn 4.
    """
    return momentum * velocity + g


def clear_sent(u, sent, sparse: bool):
    """The velocity vector with the entries that were sent set to 0 (momentum factor masking).

    Args:
      u: a group's velocity vector.
      sent: this device's contribution: dense (nonzero where sent), or ``(indices, values)``.
      sparse: ``sent`` is ``(indices, values)``.

    Returns:
      ``u`` with the sent entries cleared.

    Example:
      >>> import jax.numpy as jnp
      >>> clear_sent(jnp.array([1.0, 2.0, 3.0]), jnp.array([0.0, 5.0, 0.0]), False).tolist()
      [1.0, 0.0, 3.0]

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.2 (momentum factor masking).
    """
    if sparse:
        indices, _ = sent
        return u.at[indices].set(0.0, mode="drop", unique_indices=True)
    return jnp.where(pieces.joined(sent) != 0, 0.0, u)
