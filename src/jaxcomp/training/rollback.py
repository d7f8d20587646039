"""Rolling a run back to a state from before the guardrail triggered: :class:`RollbackStep`.

The guardrail (:mod:`jaxcomp.optim.stages.divergence`) notices a divergence from the gradient
norm, which grows only once the params have already been damaged: by then the run may be far
from where it was (a loss of 9 where it was 2), and the dense fallback has to train it back
from there, if it can. With ``data_parallel(..., rollback=every)`` the run instead goes back to
a state it had before the divergence began, and runs the dense fallback from there.

**How.** Every ``every`` steps the host keeps the state it is about to pass to the step: a
reference, not a copy (the arrays are immutable, and ``rollback`` refuses ``donate=True``),
so the cost is the memory of the two states kept and one wait every ``every`` steps for the
guardrail's trigger counters (replicated scalars every process holds). When the counters have
grown since the last check, the state of the check before that one comes back from ``step``
instead (between ``every`` and ``2 * every`` steps before the divergence was noticed: the
guardrail notices a few steps after the loss starts to climb), with the guardrail's states of
the newest state, so that the triggers are not forgotten (windows keep doubling) and each
fallback window is lengthened by the steps rolled back, and with its error-feedback residuals
and DGC velocities cleared, as a trigger clears them: the run trains densely from the
restored state for at least as long as the trigger asked. Every process decides at the same
step from the same values, so a multi-process run rolls back together.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp

from jaxcomp.optim.host import local_copy
from jaxcomp.optim.state import CompressState, compress_states

_LOG = logging.getLogger("jaxcomp")


class RollbackStep:
    """``step(state, batch)`` that may return an earlier state when the guardrail triggered.

    See the module's docstring. Every other attribute is the wrapped step's.

    Args:
      step: the step (a :class:`jaxcomp.training.dispatch.BoundedStep`).
      every: steps between the states kept (``>= 1``).

    Example:
      >>> RollbackStep(lambda state, batch: (state, {}), every=50).rollbacks
      0

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3 (the dense fallback this
      restarts from an earlier state).
    """

    def __init__(self, step, every: int):
        self._step = step
        self.every = every
        self._calls = 0
        self._kept = []  # the states of the last two checks, oldest first
        self._triggers = 0  # the guardrail's triggers at the last check
        self.rollbacks = 0

    def __call__(self, state, batch, *args, **kwargs):
        if self._calls % self.every == 0:
            state = self._check(state)
        self._calls += 1
        return self._step(state, batch, *args, **kwargs)

    def _check(self, state):
        """Keeps ``state``, or returns the older state kept when the guardrail has triggered
        since the last check."""
        triggers = triggered(state.opt_state)
        # Fewer triggers than at the last check: a state of another history (a checkpoint
        # restored, a run started again); it is kept as a new start.
        if triggers <= self._triggers or not self._kept:
            self._kept = (self._kept + [state])[-2:]
            self._triggers = triggers
            return state
        restored = self._kept[0]
        back = int(local_copy(state.step)) - int(local_copy(restored.step))
        _LOG.warning(
            "data_parallel: the guardrail triggered (%d times so far); rolling back %d steps, "
            "to step %d, and falling back to dense from there",
            triggers,
            back,
            int(local_copy(restored.step)),
        )
        self._kept, self._triggers = [restored], triggers
        self.rollbacks += 1
        return restored._replace(opt_state=_carried(restored.opt_state, state.opt_state, back))

    def __getattr__(self, name):
        return getattr(self._step, name)


def triggered(opt_state) -> int:
    """The guardrail's triggers so far, summed over the compress states of ``opt_state``
    (waits for the state).

    Args:
      opt_state: an optimizer state (replicated guardrail scalars).

    Returns:
      An int; 0 without a guardrail.

    Example:
      >>> import jaxcomp, jax.numpy as jnp
      >>> triggered(jaxcomp.compress("sign").init({"w": jnp.zeros(4)}))
      0

    References:
      Lin et al., "Deep Gradient Compression", ICLR 2018, §3.3.
    """
    guarded = [s.divergence for s in compress_states(opt_state) if s.divergence is not None]
    return sum(int(local_copy(g.fallbacks)) for g in guarded)


def _carried(restored, newest, back: int):
    """``restored`` with the guardrail states of ``newest``, each window ``back`` steps longer
    (at least ``back`` steps of fallback from the restored step), and its residuals and
    velocities cleared, as a trigger clears them: the dense fallback must not send a residual
    the method kept."""

    def carry(old, new):
        if not isinstance(old, CompressState) or old.divergence is None:
            return old
        guarded = new.divergence._replace(left=_longer(new.divergence.left, back))
        return old._replace(
            divergence=guarded,
            residual=jax.tree.map(_zeros, old.residual),
            velocity=jax.tree.map(_zeros, old.velocity),
        )

    return jax.tree.map(carry, restored, newest, is_leaf=lambda x: isinstance(x, CompressState))


def _zeros(x):
    """Zeros like ``x``, on ``x``'s sharding (a per-device leaf stays split over the devices)."""
    return jax.jit(jnp.zeros_like, out_shardings=x.sharding)(x)


@jax.jit
def _longer(left, back):
    return (left + back).astype(left.dtype)
