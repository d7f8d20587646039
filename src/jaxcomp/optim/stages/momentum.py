"""The momentum stage, DGC's momentum correction: a velocity per device, cleared where sent.

With ``momentum_correction=m`` a device compresses its velocity ``u = m u + g`` (plus the
residual) instead of ``g``, and the entries that were sent leave the velocity too (momentum
factor masking); the optimizer after ``compress`` then runs without momentum.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcomp.methods import Method
from jaxcomp.ops import flat, pieces
from jaxcomp.optim import packing
from jaxcomp.optim.stages import guard
from jaxcomp.optim.stages.flight import InFlight, Stage, init_nested, wrapped


class MomentumState(NamedTuple):
    """The momentum stage's state: like the gradients, each compressed leaf's velocity per
    device (``optax.MaskedNode()`` elsewhere)."""

    velocity: Any
    inner: Any = None


def momentum_stage(inner: Stage, momentum: float, compressed) -> Stage:
    """DGC's momentum correction around ``inner`` (outside error feedback): ``u = m u + g`` in,
    the sent entries cleared out.

    Args:
      inner: the stage it wraps.
      momentum: ``m`` in [0, 1).
      compressed: ``params -> positions`` of the compressed leaves.

    Returns:
      A :class:`~jaxcomp.optim.stages.flight.Stage` with a :class:`MomentumState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.compress("allgather_topk", ratio=0.5, momentum_correction=0.9)
      >>> tx.init({"w": jnp.zeros(4)}).velocity["w"].shape
      (4,)

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.2.
    """

    def init(params):
        leaves, treedef = jax.tree.flatten(params)
        chosen = compressed(params)
        velocity = [
            jnp.zeros(leaf.shape, jnp.float32) if i in chosen else optax.MaskedNode()
            for i, leaf in enumerate(leaves)
        ]
        return init_nested(stage, params, velocity=treedef.unflatten(velocity))

    def update(flight: InFlight, state: MomentumState):
        grads = flight.grads
        velocities = flight.treedef.flatten_up_to(state.velocity)
        counts, values = list(flight.counts), {}
        for positions, _ in grads.layout.groups:
            for i in positions:
                g, count = guard.finite(grads.leaves[i])
                counts.append(count)
                values[i] = accumulate(momentum, velocities[i], g)
        flight, state = wrapped(inner, flight._replace(values=values, counts=counts), state)
        result = flight.result
        if result.sends_everything:
            return flight, state
        new = list(velocities)
        for (positions, _), row, sent in zip(grads.layout.groups, grads.rows, result.sents):
            # momentum factor masking: what was sent leaves the momentum too
            velocity = packing.pack([values[i] for i in positions], grads.shards, row)
            velocity = clear_sent(velocity, sent, result.sparse)
            if flight.policy == "zero":  # m u + g overflowed: dropped, like the residual
                velocity = flat.dropped(velocity)
            if flight.trigger is not None:  # a select that fuses into the velocity's update
                velocity = pieces.each(lambda v: flat.cleared(flight.trigger, v), velocity)
            packing.keep(new, velocities, grads.leaves, positions, velocity, None, grads.shards)
        return flight, state._replace(velocity=flight.treedef.unflatten(new))

    stage = Stage(init, update, MomentumState, inner)
    return stage


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
