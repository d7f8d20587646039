"""The checks of a compress update that must come before any of its work: where it runs (inside
``shard_map``, over the axes it was given, sharded or not) and what it gets (gradients shaped
like the params ``init`` saw, still per device). Each names what is wrong and how to fix it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import methods
from jaxcomp.ops import _ffi
from jaxcomp.optim import sharding
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import mask
from jaxcomp.optim.state import CompressState


def checked_update(update_fn):
    """``update_fn`` behind the argument checks that must come before any of its work."""

    def update(updates, state, params=None, **extra_args):
        check_updates_fit_state(updates, state)
        return update_fn(updates, state, params, **extra_args)

    return update


def check_updates_fit_state(updates, state):
    """Gradients shaped like the params ``init`` saw, and at least one value to aggregate."""
    if not isinstance(state, CompressState):
        raise TypeError(
            "state must be the CompressState that compress's init returns, got "
            f"{type(state).__name__}"
        )
    leaves, treedef = jax.tree.flatten_with_path(updates)
    try:
        residuals = treedef.flatten_up_to(state.residual)
    except (ValueError, TypeError):
        return  # update reports the structure mismatch itself
    floats = [
        (path, leaf, residual)
        for (path, leaf), residual in zip(leaves, residuals)
        if mask.is_float(leaf)
    ]
    for path, leaf, residual in floats:
        if (
            isinstance(residual, jax.Array | jax.ShapeDtypeStruct | np.ndarray)
            and leaf.shape != residual.shape
        ):
            raise ValueError(
                f"updates{jax.tree_util.keystr(path)} has shape {leaf.shape}, but compress was "
                f"initialized with a param of shape {residual.shape} there: pass the gradients of "
                "the params given to init"
            )
    if floats and sum(leaf.size for _, leaf, _ in floats) == 0:
        raise ValueError(
            f"updates hold no values (every float leaf is empty: shapes "
            f"{[leaf.shape for _, leaf, _ in floats]}): there is nothing to aggregate"
        )


def bound_axis_size(axis_name) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"compress(axis_name={axis_name!r}): update must run inside jax.shard_map over a mesh "
            f"with axis {axis_name!r} (or use jaxcomp.data_parallel); no such axis is bound here"
        ) from None


def check_local_gradients(c: FeedbackConfig, leaves):
    """Refuses gradients that were already all-reduced densely (the replicated-params trap)."""
    # With check_vma=False nothing is typed varying, so there is nothing to check.
    probe = jax.lax.pcast(jnp.zeros((), jnp.float32), c.axis_name, to="varying")
    if not set(c.axes) <= _ffi.varying_axes(probe):
        return
    for leaf in leaves:
        if not set(c.axes) <= _ffi.varying_axes(leaf):
            raise ValueError(
                f"compress got gradients that are replicated over {c.axis_name!r}: jax.grad of "
                "replicated params inside shard_map already all-reduced them densely, before "
                "compression. Cast the params first: params = jax.lax.pcast(params, "
                f"{c.axis_name!r}, to='varying') (or use jaxcomp.data_parallel, which does this)."
            )


def shards(c: FeedbackConfig, branches, n_devices: int) -> int | None:
    """With :func:`jaxcomp.optim.sharding.sharded_updates` in force, the shards per leaf (after
    checking that they are the devices ``c.axes`` reduce over and that every method can
    reduce-scatter); else None."""
    active = sharding.active()
    if active is None:
        return None
    if active.n_devices != n_devices:
        raise ValueError(
            f"the updates are sharded over {active.n_devices} devices, but compress(axis_name="
            f"{c.axis_name!r}) reduces over {n_devices}: give compress the data axes data_parallel "
            "splits the batch over"
        )
    check_scatters(branches)
    return n_devices


def check_scatters(branches):
    """Raises a ValueError naming the first method without a reduce-scatter form."""
    for method in branches:
        if not method.scatters:
            raise ValueError(
                f"method {method.describe()} has no reduce-scatter form, so it cannot aggregate "
                f"sharded gradients (data_parallel(shard=...)); methods that can: "
                f"{', '.join(methods.scattering())}; or train with shard=None"
            )
