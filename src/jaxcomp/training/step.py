"""One step of :func:`jaxcomp.data_parallel` on every device: :func:`train_step`, a pipeline of
stages.

The step is one ``jax.shard_map`` over the data axes (``jax.jit`` around it is the caller's).
Inside it, the replicated params are cast to *varying* before ``jax.grad``, so each device
differentiates its own batch shard and nothing is all-reduced until :func:`jaxcomp.compress` runs
its collective. (Without the cast, the transpose of the implicit replicated-to-varying broadcast
is a dense ``psum`` of the gradient, inserted before compression: the silent trap.)

The stages, in the order they run on each device: this device's optimizer state (its row of each
per-device leaf), the params for the forward pass (gathered with ``shard="params"``), the local
loss and gradient, ``tx``'s update (kept out entirely when a ``compress`` skips a non-finite
step; an entry ``tx`` makes not finite is dropped, or its step skipped), the new params
(gathered back with ``shard="optimizer"``), the stored optimizer state, the model's own state
(``has_state=True``: averaged over the devices, :mod:`jaxcomp.training.model_state`), and the
metrics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from jaxcomp.collectives import small
from jaxcomp.optim import readiness, sharding, vma
from jaxcomp.optim.nonfinite import (
    finite_updated,
    keep_finite,
    keep_if_skipped,
    non_compress_leaves,
    skipped_or_none,
)
from jaxcomp.optim.stages import guard
from jaxcomp.optim.state import compress_states, find_compress_state
from jaxcomp.training import boundary, gradients
from jaxcomp.training import model_state as model_states
from jaxcomp.training.state import TrainState

_WARNED: list = []  # whether this process has warned once of a rejected update


def train_step(
    layout, loss_fn, has_aux, state, batch, on_nonfinite_policy=None, nonfinite_updates="drop"
):
    """One data-parallel step: each device's gradient, ``tx``'s aggregation and update.

    Args:
      layout: the run's :class:`jaxcomp.training.layout.Layout`.
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``), on one
        device's shard of the batch; with ``layout.has_state``, ``loss_fn(params, model_state,
        batch) -> (loss, new_model_state)``.
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      state: the :class:`jaxcomp.training.state.TrainState`.
      batch: a pytree whose leading axis is the global batch, divisible by the devices.
      on_nonfinite_policy: called while tracing with True when ``tx`` holds a
        ``compress(nonfinite="raise")`` (the caller then checks the metrics), else False.
      nonfinite_updates: what becomes of an update or optimizer-state entry that ``tx`` made
        not finite: ``"drop"`` (that entry keeps its old value) or ``"skip"`` (the whole step
        is skipped and ``metrics["rejected"]`` says so; see :func:`jaxcomp.data_parallel`).

    Returns:
      ``(state, metrics)``: the next state and the replicated metrics (see
      :func:`jaxcomp.data_parallel`).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jaxcomp.training.layout import Layout
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> layout = Layout(optax.chain(jaxcomp.compress("dense"), optax.sgd(0.5)), mesh, "data")
      >>> loss = lambda w, batch: jnp.mean((batch - w) ** 2)
      >>> state = jax.jit(layout.initial_state)(jnp.zeros(()))
      >>> step = jax.jit(lambda s, b: train_step(layout, loss, False, s, b))
      >>> state, metrics = step(state, jnp.ones(jax.device_count()))
      >>> float(state.params), float(metrics["loss"])
      (1.0, 1.0)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (per-worker residuals, replicated model);
      Rajbhandari et al., "ZeRO", SC 2020 (sharded optimizer state, gradients and params).
    """
    _check_batch(batch, layout.n_devices, layout.axis_name)
    avals = layout.check_state(state)
    state_def, mask = layout.per_device_mask(avals)
    specs = layout.state_specs(avals, state.model_state)
    batch_specs = jax.tree.map(lambda _: P(layout.axis_name), batch)

    def local_step(state: TrainState, batch):
        opt_state = _per_device(state_def, mask, state.opt_state, lambda leaf: leaf[0])
        params, shards = _forward_params(layout, state.params, avals)
        (loss, aux, grads, order), model_state = _gradients_in_order(
            loss_fn, has_aux, params, batch, layout.axis_name, state.model_state
        )
        updates, new_opt_state, skipped, rejected = _update(
            layout, grads, opt_state, shards, order, nonfinite_updates
        )
        if on_nonfinite_policy is not None:
            on_nonfinite_policy(
                any(s.policy.name == "raise" for s in compress_states(new_opt_state))
            )
        new_params = _new_params(
            layout, shards, updates, skipped, params, nonfinite_updates == "drop"
        )
        new_opt_state = _per_device(state_def, mask, new_opt_state, lambda leaf: leaf[None])
        metrics = _metrics(layout, loss, aux, new_opt_state, avals)
        if rejected is not None:
            metrics["rejected"] = rejected.astype(jnp.float32)
        if model_state is not None:
            model_state = model_states.averaged(
                model_state, layout.axis_name, state.model_state, skipped
            )
        new_state = TrainState(new_params, new_opt_state, state.step + 1, model_state)
        return new_state, metrics

    return boundary.packed_shard_map(
        local_step,
        mesh=layout.mesh,
        in_specs=(specs, batch_specs),
        out_specs=(specs, P()),
        in_avals=state,
    )(state, batch)


def _per_device(state_def, mask, opt_state, change):
    """``opt_state`` with ``change`` applied to each leaf that differs per device (``mask``):
    its leading device axis taken off inside the step, put back on the way out."""
    leaves = state_def.flatten_up_to(opt_state)
    return state_def.unflatten([change(leaf) if m else leaf for leaf, m in zip(leaves, mask)])


def _check_batch(batch, n_devices, axis_name):
    """Refuses a batch the devices cannot split evenly, or one that leaves a device nothing."""
    if not jax.tree.leaves(batch):
        raise ValueError("batch holds no arrays: pass the global batch as a pytree of arrays")
    for leaf in jax.tree.leaves(batch):
        if leaf.ndim == 0 or leaf.shape[0] % n_devices:
            raise ValueError(
                f"batch leaves need a leading (global batch) axis divisible by the "
                f"{n_devices} devices of {axis_name!r}, got shape {leaf.shape}"
            )
        if leaf.shape[0] == 0:
            # An empty shard makes the mean loss NaN on every device: the step would train on
            # nothing.
            raise ValueError(
                f"batch is empty (a leaf of shape {leaf.shape}): every device needs at least "
                "one example"
            )


def _forward_params(layout, stored, avals):
    """``(params, shards)``: the whole params for the forward pass and what ``tx`` updates."""
    if layout.shard == "params":
        # Each leaf is all-gathered (in gather_dtype, if given) for this step's forward pass.
        shards = jax.tree.map(lambda s: s[0], stored)
        cast = jax.tree.map(lambda s: s.astype(layout.gather_dtype or s.dtype), shards)
        gathered = sharding.gather_whole(cast, avals, layout.axis_name)
        return jax.tree.map(lambda p, a: p.astype(a.dtype), gathered, avals), shards
    return stored, layout.my_shards(stored) if layout.shard else stored


def _local_gradients(loss_fn, has_aux, params, batch, axis_name):
    """``(loss, aux, grads)`` of this device's batch shard; ``aux`` is None without ``has_aux``."""
    # The cast makes grad's cotangents varying: each device keeps its own gradient.
    local_params = jax.lax.pcast(params, axis_name, to="varying")
    return gradients.local_value_and_grad(loss_fn, has_aux, local_params, batch)


def _gradients_in_order(loss_fn, has_aux, params, batch, axis_name, model_state=None):
    """``((loss, aux, grads, order), new_model_state)``: :func:`_local_gradients`, traced once
    into a jaxpr and replayed into the step, and the order in which its backward pass finishes
    the gradient's leaves (:func:`jaxcomp.optim.readiness.backward_order`, for
    ``compress(bucket_mb=)``). Read from the jaxpr the step runs: tracing the backward pass a
    second time for the order took as long as the first (seconds, on a model of 1,000 leaves),
    where replaying the jaxpr takes a fraction of it. With a ``model_state`` the loss reads it
    and returns this device's new one (:func:`jaxcomp.training.model_state.as_aux`); else the
    new one is None."""

    def local(params, batch, model_state):
        if model_state is None:
            return None, _local_gradients(loss_fn, has_aux, params, batch, axis_name)
        stateless = model_states.as_aux(loss_fn, has_aux, model_state)
        loss, (aux, new), grads = _local_gradients(stateless, True, params, batch, axis_name)
        return new, (loss, aux, grads)  # the gradients last: finish_order reads them there

    args = (params, batch, model_state)
    closed, shapes = jax.make_jaxpr(local, return_shape=True)(*args)
    flat = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
    new_model_state, (loss, aux, grads) = jax.tree.unflatten(jax.tree.structure(shapes), flat)
    order = readiness.finish_order(closed.jaxpr, len(jax.tree.leaves(grads)))
    return (loss, aux, grads, order), new_model_state


def _update(layout, grads, opt_state, shards, order=None, nonfinite_updates="drop"):
    """``(updates, new_opt_state, skipped, rejected)``: ``tx``'s update, with the gradients'
    ``order`` (for buckets) in force. ``skipped`` says that the step keeps the old params and
    optimizer state: a ``compress(nonfinite="skip"/"raise")`` that skipped its part, or, with
    ``nonfinite_updates="skip"``, ``rejected``: the update or the new optimizer state held a
    value that is not finite (:func:`_unfinished`; None with ``"drop"``, where each such entry
    of the state keeps its old value instead, and :func:`_new_params` each such param)."""
    # Sharded: tx gets the whole local gradient and updates this device's shards.
    with readiness.gradients_ready_in(order):
        updates, new_opt_state = layout.tx_update(grads, opt_state, shards)
    skipped = skipped_or_none(new_opt_state)
    rejected = None
    if nonfinite_updates == "skip":
        rejected = _unfinished(layout, updates, new_opt_state)
        skipped = rejected if skipped is None else skipped | rejected
    # The rest of the chain keeps its state too (a compress keeps its own, which reports the
    # step), and the params stay bit for bit (p + 0 would turn -0.0 into +0.0).
    if skipped is not None:
        new_opt_state = keep_if_skipped(skipped, opt_state, new_opt_state)
    if nonfinite_updates == "drop":
        new_opt_state = keep_finite(opt_state, new_opt_state)
    return updates, new_opt_state, skipped, rejected


def _unfinished(layout, updates, new_opt_state):
    """Whether ``tx`` made a value that is not finite from the step's gradients: in the update,
    or in an array of the optimizer state outside its compress states (which guard their own),
    on any device.

    An optimizer can overflow from finite gradients (a variance too small for a momentum that
    grew); such a value must reach neither the params nor the state, whatever ``tx`` is. The
    state's scalars are not checked: they may hold a sentinel (``reduce_on_plateau``'s best
    value starts at inf). One fused read of each checked leaf; the devices agree by one boolean
    all-reduce where the flag varies over them (shards, per-device state), none where it is
    replicated."""
    state = [leaf for leaf in jax.tree.leaves(non_compress_leaves(new_opt_state)) if leaf.ndim]
    leaves = [
        leaf for leaf in jax.tree.leaves(updates) + state if jnp.issubdtype(leaf.dtype, jnp.inexact)
    ]
    if not leaves:
        return jnp.bool_(False)
    finite = guard.all_finite_many(leaves)
    if layout.shard or vma.varying_axes(finite):
        finite = small.all_true(finite, layout.axis_name)
    return ~finite


def _new_params(layout, shards, updates, skipped, params, drop=False):
    """The params to store: updated (unless ``skipped``; with ``drop``, each param whose new
    value is not finite keeps its old one), as shards or gathered back whole."""
    if drop:
        new_params = finite_updated(shards, updates)
    else:
        new_params = optax.apply_updates(shards, updates)
    if skipped is not None:
        new_params = jax.tree.map(lambda o, n: jnp.where(skipped, o, n), shards, new_params)
    if layout.shard == "params":
        return jax.tree.map(lambda s: s[None], new_params)
    if layout.shard == "optimizer":
        # Every device's updated shards, gathered back into the replicated params.
        return sharding.gather_whole(new_params, params, layout.axis_name)
    return new_params


def _metrics(layout, loss, aux, new_opt_state, avals):
    """The step's replicated metrics: mean loss and aux, compression and gather bytes."""
    metrics = {"loss": small.metric_mean(loss, layout.axis_name)}
    if aux is not None:
        metrics["aux"] = jax.tree.map(lambda x: small.metric_mean(x, layout.axis_name), aux)
    compress_state = find_compress_state(new_opt_state)
    if compress_state is not None:
        metrics.update(compress_state.metrics._asdict())
    if layout.shard:
        metrics["gather_bytes"] = jnp.float32(layout.gather_bytes(avals))
    return metrics
