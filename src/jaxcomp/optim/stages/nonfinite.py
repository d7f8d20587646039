"""The non-finite policy stage of a :func:`jaxcomp.compress` update (``nonfinite="skip"`` and
``"raise"``): a step with a non-finite gradient entry keeps the state of every stage inside it.

Non-finite entries never reach the sum under any policy: error feedback's packing zeroes and
counts them (:mod:`.error_feedback`), and the aggregation's one psum sums the count, so every
device decides alike. This stage reads that decision on the way out (optax's
``apply_if_finite``, on the count the psum already summed instead of a pass of its own) and
keeps the inner stages' state as it was; the update itself is zeroed where it is written. It
has no state of its own, and it is left out under ``"zero"``. ``"raise"`` skips the same way;
the trainer raises (:func:`jaxcomp.data_parallel`).
"""

from __future__ import annotations

from jaxcomp.optim.stages import guard
from jaxcomp.optim.stages.flight import InFlight, Stage


def nonfinite_stage(inner: Stage) -> Stage:
    """Keeps ``inner``'s state on a step the policy skips.

    Args:
      inner: the stage it wraps.

    Returns:
      A :class:`~jaxcomp.optim.stages.flight.Stage` whose state is ``inner``'s.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> jaxcomp.compress(jaxcomp.Dense(), nonfinite="skip").init(jnp.zeros(3)).policy.name
      'skip'

    References:
      optax ``apply_if_finite``; Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    """

    def update(flight: InFlight, state):
        flight, new = inner.update(flight, state)
        return flight, guard.hold(flight.skipped, state, new)

    return Stage(inner.init, update, None, inner)
