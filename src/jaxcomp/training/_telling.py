"""What :func:`jaxcomp.data_parallel` tells the host of its steps: a guardrail trigger, an
update rejected as not finite, a step of many leaves that compiles for long, and the error of
``compress(nonfinite="raise")``."""

from __future__ import annotations

import logging
import warnings

import jax

from jaxcomp.optim.stages import divergence

_LOG = logging.getLogger("jaxcomp")
_WARNED: list = []  # whether this process has warned once of a rejected update


#: A step whose state has at least this many leaves says, when it is traced, that its compile
#: takes tens of seconds: XLA compiles the work of each leaf as loops of its own (the leaves cross
#: the step's ``shard_map`` packed, :mod:`.boundary`, so the partitioner no longer grows with them;
#: docs/performance.md, "The first step of a model of 1,000 small leaves").
MANY_LEAVES = 2000


def tell_step(probe):
    """Tells the host what a step that has run did: a guardrail trigger, a rejected update."""
    trigger, rejected = probe
    divergence.tell_trigger(trigger)
    tell_rejected(*rejected)


def tell_of_a_long_compile(n_leaves: int):
    """Logs (once per trace) that a step of ``n_leaves`` state leaves compiles for long."""
    if n_leaves >= MANY_LEAVES:
        _LOG.warning(
            "data_parallel: compiling a step whose state has %d leaves. XLA compiles the work of "
            "each leaf as loops of its own (30-40 s for 4,000 small leaves on 2 CPU cores, about "
            "as long as a plain pmean step of the same model); fewer, larger leaves (layers "
            "stacked with nn.scan or along a leading axis) compile much faster. "
            "docs/performance.md, 'The first step of a model of 1,000 small leaves'.",
            n_leaves,
        )


def tell_rejected(step, rejected) -> None:
    """Logs a step whose update was rejected as not finite (the ``rejected`` metric): a warning
    from logger ``"jaxcomp"``, and a ``RuntimeWarning`` once per process.

    Args:
      step: the step counter after the step (a scalar array that has been computed).
      rejected: the step's ``rejected`` metric.

    Returns:
      None.

    Example:
      >>> import jax.numpy as jnp
      >>> tell_rejected(jnp.int32(3), jnp.float32(0))  # nothing was rejected: says nothing

    References:
      optax ``apply_if_finite`` (a step whose update is not finite is not applied).
    """
    if rejected is None or not float(jax.device_get(rejected)):
        return
    message = (
        f"jaxcomp.data_parallel: step {int(jax.device_get(step)) - 1}'s update (or the optimizer "
        "state it made) was not finite; the step was dropped, the "
        "params and optimizer state kept (the 'rejected' metric). Steps that keep being rejected "
        "mean the optimizer diverges: lower the learning rate"
    )
    _LOG.warning(message)
    if not _WARNED:
        _WARNED.append(True)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


def nonfinite_error(step: int, count: float, donated: bool) -> FloatingPointError:
    """The error of a step whose gradients held ``count`` non-finite entries under
    ``compress(nonfinite="raise")``; the caller sets its ``state``."""
    intact = (
        "the state you passed was donated: the error's `state` holds the same params "
        "and optimizer state"
        if donated
        else "the state you passed to this step is intact"
    )
    return FloatingPointError(
        f"step {step}: the gradients held {count:.0f} "
        "non-finite entries (NaN or ±Inf; in the gradients or in their sum over the "
        f"devices), and tx's compress has nonfinite='raise'. The update was skipped on "
        f"every device and {intact}. Find the cause (learning rate, loss scale, a bad "
        "batch), or pass nonfinite='skip' (skip such steps) or 'zero' (drop those "
        "entries) to jaxcomp.compress"
    )
