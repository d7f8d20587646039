"""What ``compress`` does with non-finite gradients: the policy and the chain-wide skip.

Every compressing transformation drops NaN and ±Inf gradient entries (never sent, never kept in
the residual) and counts them in its ``nonfinite`` metric; its ``nonfinite=`` policy then decides
the step: train on (``"zero"``), skip it everywhere (``"skip"``), or skip and raise on the host
(``"raise"``). :func:`skip_nonfinite` extends a skip to the whole optax chain; the guard itself
is the update's first stage, :mod:`jaxcomp.optim.stages.guard`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from jaxcomp.optim.state import NONFINITE_POLICIES, CompressState, NonfinitePolicy, compress_states

__all__ = [
    "NONFINITE_POLICIES",
    "NonfinitePolicy",
    "finite_updated",
    "keep_finite",
    "keep_if_skipped",
    "non_compress_leaves",
    "skip_nonfinite",
    "skipped_or_none",
    "skipped_update",
]


def skipped_update(opt_state):
    """Whether the step that made ``opt_state`` was skipped by a
    ``compress(nonfinite="skip"|"raise")``.

    Read it inside the step, after ``tx.update``: a traced boolean, identical on every device (it
    comes from the ``nonfinite`` metric, a sum over the devices), or ``None`` when every
    :class:`jaxcomp.CompressState` in ``opt_state`` has ``nonfinite="zero"`` (such a step is never
    skipped), so callers add no work then. Under :func:`jaxcomp.accumulate` it says whether this
    micro-step was dropped.

    Args:
      opt_state: the optimizer state ``tx.update`` returned; it must hold a compress state.

    Returns:
      A boolean scalar (traced inside a step), or None.

    Raises:
      TypeError: ``opt_state`` is None.
      ValueError: ``opt_state`` holds no :class:`jaxcomp.CompressState` (``tx`` has no
        :func:`jaxcomp.compress`, or this is not its state), so nothing could say.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> state = jaxcomp.compress(jaxcomp.Dense(), nonfinite="skip").init({"w": jnp.zeros(3)})
      >>> (bool(jaxcomp.skipped_update(state)),
      ...  jaxcomp.skipped_update(jaxcomp.compress(jaxcomp.Dense()).init({})))
      (False, None)

    References:
      optax ``apply_if_finite`` (skips a step on non-finite updates); Micikevicius et al.,
      "Mixed Precision Training", ICLR 2018, §3.2 (a step with Inf/NaN gradients is skipped).
    """
    if opt_state is None:
        raise TypeError(
            "skipped_update(opt_state): opt_state is None; pass the optimizer state that "
            "tx.update returned"
        )
    if not _states(opt_state):
        raise ValueError(
            "skipped_update(opt_state): opt_state holds no jaxcomp.CompressState (got "
            f"{type(opt_state).__name__}); pass the state of a tx that holds jaxcomp.compress"
        )
    return skipped_or_none(opt_state)


def skipped_or_none(opt_state):
    """:func:`skipped_update` for any optimizer state: None also when it holds no compress state.

    :func:`skip_nonfinite`, :func:`jaxcomp.accumulate` and :func:`jaxcomp.data_parallel` use it on
    any ``tx``; :func:`skipped_update` refuses a state it cannot read.

    Args:
      opt_state: any optax state pytree.

    Returns:
      A boolean scalar, or None (no compress state can skip).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> skipped_or_none(optax.sgd(0.1).init({"w": jnp.zeros(3)})) is None
      True

    References:
      optax ``apply_if_finite``; Micikevicius et al., ICLR 2018, §3.2.
    """
    flags = [
        state.metrics.nonfinite > 0 for state in _states(opt_state) if state.policy.name != "zero"
    ]
    if not flags:
        return None
    return functools.reduce(jnp.logical_or, flags)


def keep_if_skipped(skipped, old_state, new_state):
    """``new_state`` where the step ran, ``old_state`` where it was skipped; CompressStates stay
    new.

    A compress skips its own state (residual, step, ``compress_auto``'s choices) and reports the
    step in its metrics, so its new state is right either way.

    Args:
      skipped: the step's skip flag, identical on every device.
      old_state: the optimizer state before the step.
      new_state: the optimizer state after it.

    Returns:
      The optimizer state to keep.

    Example:
      >>> import jax.numpy as jnp
      >>> keep_if_skipped(
      ...     jnp.bool_(True), {"count": jnp.int32(1)}, {"count": jnp.int32(2)}
      ... )["count"].tolist()
      1

    References:
      optax ``apply_if_finite``; Micikevicius et al., ICLR 2018, §3.2.
    """

    return _outside_compress(lambda new, old: jnp.where(skipped, old, new), old_state, new_state)


def keep_finite(old_state, new_state):
    """``new_state`` wherever its entries are finite, ``old_state``'s entries elsewhere, in the
    arrays outside its CompressStates (which guard their own); scalars are kept as they are.

    An optimizer can overflow from finite gradients; an entry it makes that is not finite keeps
    its old value. Elementwise, with no flag over the whole state, so it fuses into the update
    that computes the new state and costs no pass of its own. Scalars are left alone: they may
    hold a sentinel (``reduce_on_plateau``'s best value starts at inf).

    Args:
      old_state: the optimizer state before the step.
      new_state: the optimizer state after it.

    Returns:
      The optimizer state to keep.

    Example:
      >>> import jax.numpy as jnp
      >>> keep_finite({"nu": jnp.ones(2)}, {"nu": jnp.array([2.0, jnp.inf])})["nu"].tolist()
      [2.0, 1.0]

    References:
      optax ``apply_if_finite`` (checks what the optimizer made, not only the gradients).
    """

    def keep(new, old):
        if not jnp.ndim(new) or not jnp.issubdtype(jnp.result_type(new), jnp.inexact):
            return new
        return _finite_or_old(new, old)

    return _outside_compress(keep, old_state, new_state)


def finite_updated(params, updates):
    """``optax.apply_updates(params, updates)``, with each param whose new value is not finite
    keeping its old one (elementwise: fused into the update).

    Args:
      params: the params (a pytree of arrays).
      updates: the updates, of the same structure.

    Returns:
      The new params.

    Example:
      >>> import jax.numpy as jnp
      >>> finite_updated(jnp.zeros(2), jnp.array([1.0, jnp.nan])).tolist()
      [1.0, 0.0]

    References:
      optax ``apply_if_finite`` (here entry by entry).
    """
    new = optax.apply_updates(params, updates)
    return jax.tree.map(_finite_or_old, new, params)


def _finite_or_old(new, old):
    """``new`` where it is finite, ``old`` elsewhere (elementwise)."""
    return jnp.where(jnp.isfinite(new), new, old)


def _outside_compress(keep, old_state, new_state):
    """``keep(new, old)`` on each leaf of the optimizer state outside its CompressStates, which
    stay new (a compress guards its own state)."""
    return jax.tree.map(
        lambda new, old: new if _is_compress_state(new) else keep(new, old),
        new_state,
        old_state,
        is_leaf=_is_compress_state,
    )


def skip_nonfinite(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Makes a whole optax chain skip the steps its ``compress(nonfinite="skip")`` skips.

    ``compress(..., nonfinite="skip")`` (or ``"raise"``) keeps its own state and returns zero
    updates when any device saw a non-finite gradient entry, but the transformations after it
    would still advance on those zeros (adam's moments decay, its count grows, and the params
    move). This wrapper runs ``tx`` and, on such a step, returns zero updates and ``tx``'s
    previous state, everywhere but inside the compress states (which already kept theirs and
    report the step in their ``nonfinite`` metric). It decides with ``jnp.where`` on a scalar
    that every device agrees on, not ``lax.cond``, so it works inside ``jax.shard_map`` where
    ``optax.apply_if_finite`` fails ("cond branches must have equal output types").
    :func:`jaxcomp.data_parallel` does this by itself (and keeps the params bit for bit); use
    the wrapper in your own ``shard_map`` step. The state is ``tx``'s own.

    Args:
      tx: an optax transformation holding a :func:`compress` with ``nonfinite="skip"`` or
        ``"raise"`` (with ``"zero"`` or no compress the wrapper changes nothing).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with ``tx``'s ``init`` and state.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()), ("data",))
      >>> tx = jaxcomp.skip_nonfinite(
      ...     optax.chain(jaxcomp.compress(jaxcomp.Dense(), nonfinite="skip"), optax.adam(0.1))
      ... )
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> def step(g):
      ...     updates, new_state = tx.update({"w": g}, state)
      ...     nonfinite = jaxcomp.find_compress_state(new_state).metrics.nonfinite
      ...     return updates["w"], new_state[1][0].count, nonfinite
      >>> f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> g = jnp.ones(2 * jax.device_count()).at[0].set(jnp.nan)
      >>> updates, adam_count, nonfinite = f(g)
      >>> updates.tolist(), int(adam_count), float(nonfinite)
      ([0.0, 0.0], 0, 1.0)

    References:
      optax ``apply_if_finite``; Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2.
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    inner = optax.with_extra_args_support(tx)

    def update(updates, state, params=None, **extra_args):
        new_updates, new_state = inner.update(updates, state, params, **extra_args)
        skipped = skipped_or_none(new_state)
        if skipped is None:
            return new_updates, new_state
        new_updates = jax.tree.map(
            lambda u: (
                jnp.where(skipped, jnp.zeros_like(u), u)
                if jnp.issubdtype(u.dtype, jnp.inexact)
                else u
            ),
            new_updates,
        )
        return new_updates, keep_if_skipped(skipped, state, new_state)

    return optax.GradientTransformationExtraArgs(inner.init, update)


def non_compress_leaves(opt_state):
    """``opt_state`` with each :class:`jaxcomp.CompressState` in it replaced by None: the state
    the rest of the chain keeps (a compress guards its own residual and statistics).

    Args:
      opt_state: any optax state pytree.

    Returns:
      The same pytree without its compress states.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.compress("dense"), optax.adam(1e-3))
      >>> len(jax.tree.leaves(non_compress_leaves(tx.init(jnp.zeros(3)))))
      3

    References:
      optax ``apply_if_finite`` (checks what the optimizer made, not only the gradients).
    """
    return jax.tree.map(
        lambda node: None if _is_compress_state(node) else node,
        opt_state,
        is_leaf=_is_compress_state,
    )


def _states(opt_state):
    return compress_states(opt_state)


def _is_compress_state(node) -> bool:
    return isinstance(node, CompressState)
