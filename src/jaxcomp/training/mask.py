"""Which leaves of a run's optimizer state differ per device: :func:`per_device_mask`.

The error-feedback residual differs per device (each keeps what it did not send); with
``shard=``, so do the optimizer's shards; the rest of the state is the same everywhere. Rather than
trusting each transformation to say which is which, ``tx.update`` is traced (no compilation)
inside ``shard_map`` with gradients typed *varying*: the state leaves that come out varying are
per device. Those leaves then go in varying too, and the trace repeats until nothing changes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxcomp.ops._ffi import varying_axes
from jaxcomp.optim.state import compress_states


def per_device_mask(layout, avals):
    """Which leaves of the optimizer state differ per device after ``tx.update``.

    Traces ``tx.update`` (no compilation) with varying gradients, marks the state leaves that
    come out varying, and repeats with those leaves varying on the way in until nothing changes.
    On the way it refuses a ``tx`` that does not aggregate first (or, sharded, that returns
    updates of other shapes than the shards).

    Args:
      layout: the run's :class:`jaxcomp.training.layout.Layout`.
      avals: the whole params, as ``jax.ShapeDtypeStruct`` s.

    Returns:
      ``(state_def, mask)``: the optimizer state's treedef and a tuple of bools, one per leaf.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jaxcomp.training.layout import Layout
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> tx = optax.chain(jaxcomp.compress("ar_topk", ratio=0.5), optax.sgd(0.1))
      >>> _, mask = per_device_mask(
      ...     Layout(tx, mesh, "data"), jax.ShapeDtypeStruct((3,), jnp.float32)
      ... )
      >>> sum(mask)  # the residual
      1

    References:
      Tyagi & Swany, "Flexible Communication for Optimal Distributed Learning over Unpredictable
      Networks" (arXiv 2312.02493), Alg. 1 (per-worker residuals, replicated model).
    """
    shard_avals = layout.shard_avals(avals) if layout.shard else None
    state_avals = jax.eval_shape(layout.tx_init, avals, shard_avals)
    state_leaves, state_def = jax.tree.flatten(state_avals)
    if layout.shard and not compress_states(state_avals):
        raise _needs_compress(layout, "tx holds none")
    mask = (False,) * len(state_leaves)
    while True:
        found = _trace_update(layout, avals, state_def, state_leaves, mask)
        _check_updates(layout, found, shard_avals)
        new_mask = tuple(a or b for a, b in zip(mask, found["mask"]))
        if new_mask == mask:
            return state_def, mask
        mask = new_mask


def _trace_update(layout, avals, state_def, state_leaves, mask):
    """Traces one ``tx.update`` with the ``mask`` leaves per device; what came out varying."""
    found = {}

    def trace_update(params, state_leaves):
        opt_state = state_def.unflatten(
            [leaf[0] if per_device else leaf for leaf, per_device in zip(state_leaves, mask)]
        )
        grads = jax.lax.pcast(params, layout.axis_name, to="varying")
        tx_params = layout.my_shards(params) if layout.shard else params
        updates, new_state = layout.tx_update(grads, opt_state, tx_params)
        new_leaves, new_def = jax.tree.flatten(new_state)
        if new_def != state_def:
            raise ValueError(
                f"tx.update changed the optimizer state's structure: {state_def} -> {new_def}"
            )
        axes = set(layout.axes)
        found["mask"] = tuple(bool(axes & varying_axes(x)) for x in new_leaves)
        found["updates"] = any(axes & varying_axes(u) for u in jax.tree.leaves(updates))
        found["shapes"] = [u.shape for u in jax.tree.leaves(updates)]
        return jnp.zeros(())

    specs = [P(layout.axis_name) if per_device else P() for per_device in mask]
    stacked = [
        jax.ShapeDtypeStruct((layout.n_devices,) + leaf.shape, leaf.dtype) if per_device else leaf
        for leaf, per_device in zip(state_leaves, mask)
    ]
    jax.eval_shape(
        jax.shard_map(trace_update, mesh=layout.mesh, in_specs=(P(), specs), out_specs=P()),
        avals,
        stacked,
    )
    return found


def _check_updates(layout, found, shard_avals):
    """Refuses updates that differ per device, or (sharded) that are not this device's shards."""
    if layout.shard:
        want = [a.shape for a in jax.tree.leaves(shard_avals)]
        if found["shapes"] != want:
            raise _needs_compress(
                layout, f"tx returned updates of shapes {found['shapes']}, not the shards {want}"
            )
    elif found["updates"]:
        raise ValueError(
            "tx returns updates that differ per device: its first transformation must aggregate "
            "the gradients across the data axis, e.g. optax.chain(jaxcomp.compress('dense', "
            f"axis_name={layout.axis_name!r}), optax.adam(1e-3)). (compress('zfp', "
            "algorithm='recursive_doubling') returns a total typed varying although it is the same "
            "everywhere; use the default algorithm='ring' with data_parallel.)"
        )


def _needs_compress(layout, found) -> ValueError:
    """The error for a sharded run whose ``tx`` does not begin with a compress on the data axes."""
    return ValueError(
        f"with shard={layout.shard!r}, tx must begin with jaxcomp.compress (or compress_auto) on "
        "the data axes, e.g. optax.chain(jaxcomp.compress('dense', "
        f"axis_name={layout.axis_name!r}), optax.adam(1e-3)): it hands the rest of the chain each "
        f"device's shard of the aggregated gradient; {found}"
    )
