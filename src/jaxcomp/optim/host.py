"""Reading replicated values on the host: one process's copy of an array that may span the
devices of other processes (multi-process jobs, ``jax.distributed``)."""

from __future__ import annotations

import jax
import numpy as np


def local_copy(x):
    """This process's copy of a replicated global array (``x`` itself when it is all local).

    Args:
      x: anything; a ``jax.Array`` that spans devices of other processes is replaced.

    Returns:
      ``x.addressable_data(0)`` for such an array, else ``x``.

    Example:
      >>> import jax.numpy as jnp
      >>> local_copy(jnp.ones(2)).tolist()
      [1.0, 1.0]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (every worker holds the same replicated values).
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return x.addressable_data(0)
    return x


def value(x) -> np.ndarray:
    """A replicated array's value as a numpy array on this host (also when it spans processes).

    Args:
      x: a ``jax.Array``, a numpy array or a number.

    Returns:
      ``np.asarray`` of :func:`local_copy`.

    Example:
      >>> import jax.numpy as jnp
      >>> value(jnp.arange(3)).tolist()
      [0, 1, 2]

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (every worker holds the same replicated values).
    """
    return np.asarray(local_copy(x))


def scalar(x):
    """A replicated scalar's value on this host: the first element of this process's first shard
    (a state laid out a row per device holds one copy per row). Reads one shard, never gathers the
    rest: the guardrail's probe calls it every step.

    Args:
      x: a ``jax.Array`` (a scalar, or one copy of it per device), a numpy array or a number.

    Returns:
      A numpy scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> int(scalar(jnp.full(4, 7)))
      7

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (every worker holds the same replicated values).
    """
    return np.asarray(x.addressable_data(0) if isinstance(x, jax.Array) else x).reshape(-1)[0]
