"""The state of a :func:`jaxcomp.data_parallel` run (:class:`TrainState`) and the params it trains.

:func:`check_params` refuses params that cannot be differentiated; :func:`avals_of` and
:func:`tree_key` describe params by their shapes and dtypes, which is all the layout of a run
depends on (:mod:`jaxcomp.training.layout`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class TrainState(NamedTuple):
    """State of a :func:`data_parallel` run."""

    # the model's params, replicated over the mesh; with shard="params", each leaf's shards,
    # [n_devices, m] sharded over the data axes
    params: Any
    # tx's state: per-device leaves (residuals; with shard=, the optimizer's shards) are
    # [n_devices, *shape] sharded over the data axis, the rest replicated
    opt_state: Any
    step: jax.Array  # i32[]: steps taken
    # with has_state=True, the model's own state (BatchNorm's running averages), replicated: each
    # step's new one averaged over the devices; None otherwise, which adds no leaf, so a state
    # without one keeps the tree (and the checkpoints) it had before the field existed
    model_state: Any = None


def avals_of(params):
    """The shape and dtype of every leaf of ``params``.

    Args:
      params: a pytree of arrays, numpy arrays or ``jax.ShapeDtypeStruct``.

    Returns:
      The same pytree of ``jax.ShapeDtypeStruct`` (no sharding).

    Example:
      >>> import jax.numpy as jnp
      >>> avals_of({"w": jnp.zeros((2, 3))})["w"]
      ShapeDtypeStruct(shape=(2, 3), dtype=float32)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (the replicated model each worker holds).
    """
    return jax.tree.map(lambda p: jax.ShapeDtypeStruct(np.shape(p), jnp.result_type(p)), params)


def tree_key(avals):
    """A hashable key of a pytree of avals: its structure, shapes and dtypes.

    Args:
      avals: a pytree of ``jax.ShapeDtypeStruct`` (see :func:`avals_of`).

    Returns:
      A tuple, equal for two pytrees of the same structure, shapes and dtypes.

    Example:
      >>> import jax.numpy as jnp
      >>> tree_key(avals_of(jnp.zeros(3))) == tree_key(avals_of(jnp.ones(3)))
      True

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (the replicated model each worker holds).
    """
    return jax.tree.structure(avals), tuple((a.shape, a.dtype) for a in jax.tree.leaves(avals))


def check_params(params):
    """Refuses params data_parallel cannot differentiate: non-float leaves, or no values at all.

    Args:
      params: the whole params (arrays or avals).

    Returns:
      None; raises ``ValueError`` (nothing to train) or ``TypeError`` (a leaf that is not
      floating point, named by its path).

    Example:
      >>> import jax.numpy as jnp
      >>> check_params({"w": jnp.zeros(3)})
      >>> check_params({"n": jnp.zeros(3, jnp.int32)})
      Traceback (most recent call last):
      TypeError: params['n'] has dtype int32: ...

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (every worker differentiates the whole model).
    """
    leaves = jax.tree.leaves_with_path(params)
    if not leaves:
        raise ValueError("params holds no arrays: nothing to train")
    for path, leaf in leaves:
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"params{jax.tree_util.keystr(path)} has dtype {dtype}: data_parallel "
                "differentiates every leaf of params, so each must be floating point. Keep integer "
                "or boolean state (counters, masks, tables) out of params: close over it in "
                "loss_fn or pass it in the batch"
            )
    if sum(math.prod(np.shape(leaf)) for _, leaf in leaves) == 0:
        raise ValueError(
            f"params holds no values (every leaf is empty: shapes "
            f"{[tuple(np.shape(leaf)) for _, leaf in leaves]}): nothing to train"
        )
