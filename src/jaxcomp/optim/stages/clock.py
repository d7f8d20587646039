"""The clock stage of a :func:`jaxcomp.compress` update: the step counter and the PRNG key.

On the way in it tells the stages inside it the step and this step's key (``fold_in(key,
step)``: AR-Topk's STAR leader and the quantizer's stochastic rounding read them); on the way
out it counts the step. Its state is :attr:`jaxcomp.CompressState.step` and ``key``, held as
they were on a step the ``nonfinite=`` policy skips (the stage is inside that one).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomp.optim.stages.flight import InFlight, Stage, init_nested, wrapped


class ClockState(NamedTuple):
    """The clock's state: the updates done so far and the raw PRNG key."""

    step: jax.Array  # i32[]
    key: jax.Array  # u32[2]: step t draws from fold_in(key, t)
    inner: Any = None


def clock_stage(inner: Stage, seed: int) -> Stage:
    """The clock around ``inner``: the step and its key in, the step counted out.

    Args:
      inner: the stage it wraps.
      seed: the seed of the PRNG key.

    Returns:
      A :class:`~jaxcomp.optim.stages.flight.Stage` with a :class:`ClockState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> jaxcomp.compress(jaxcomp.Dense()).init({"w": jnp.zeros(3)}).step.tolist()
      0

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-B (STAR's leader, chosen by the step).
    """

    def init(params):
        return init_nested(
            stage, params, step=jnp.zeros((), jnp.int32), key=jax.random.PRNGKey(seed)
        )

    def update(flight: InFlight, state: ClockState):
        flight = flight._replace(step=state.step, key=jax.random.fold_in(state.key, state.step))
        flight, state = wrapped(inner, flight, state)
        return flight, state._replace(step=state.step + 1)

    stage = Stage(init, update, ClockState, inner)
    return stage
