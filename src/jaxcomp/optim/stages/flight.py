"""What passes between the stages of one :func:`jaxcomp.compress` update, and how they nest.

A stage is an optax-style transformation (``init``, ``update``) whose ``update`` takes and
returns an :class:`InFlight` instead of a gradient pytree: the stages of ``compress`` act
*around* each other (error feedback adds the residual before the aggregation and keeps what
was not sent after it; the guardrail decides after the aggregation from sums the aggregation's
one psum carried), so they are wrappers, as optax's ``MultiSteps`` and ``apply_if_finite`` are:
each holds ``inner``, the stage it wraps, and its state holds ``inner``'s state in ``inner``.
On the way in a stage fills in what the stages inside it read; on the way out it reads what
they returned. :func:`jaxcomp.optim.feedback.feedback_transformation` composes them.

At rest the state is one flat :class:`~jaxcomp.CompressState` (the names users, checkpoints and
host code read); :func:`nest` and :func:`unnest` turn it into the stages' states and back, each
stage's fields being the ``CompressState`` fields of the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class InFlight(NamedTuple):
    """One update's gradients and what each stage left for the others (host-side structure,
    never a jit argument)."""

    grads: Any  # jaxcomp.optim._flow.Gradients: the gradients and their layout
    record: Any  # the state's static Branches: its methods, warm-up, fallback
    policy: str  # the nonfinite= policy's name
    out: list  # the update's leaves, written as the stages finish them
    counts: list  # this device's non-finite counts, summed in the step's one psum
    step: Any = None  # i32[]: the step counter (the clock's, on the way in)
    key: Any = None  # this step's PRNG key (the clock's)
    values: dict | None = None  # leaf -> the value to error-feed (DGC's velocity), else None
    feds: list | None = None  # per group: this device's error-fed vector
    packs: list | None = None  # per group: the one-pass packing's Packed, or None
    gradient: Any = None  # this device's gradient energy, summed in the psum (the guardrail's)
    fallback: Any = None  # the guardrail's flag: this step runs dense (None without one)
    alone: int | None = None  # the branch run alone on one device (the dense route), or None
    treedef: Any = None  # the gradients' tree structure
    # on the way out:
    result: Any = None  # the aggregation's jaxcomp.optim.stages.aggregation.Aggregation
    remainings: list | None = None  # per group: g_e - sent (error feedback's next residual)
    gain: Any = None  # f32[]: the compression gain, summed over the devices
    nonfinite: Any = None  # f32[]: the non-finite entries, summed over the devices
    energies: Any = None  # jaxcomp.optim.stages.metrics.Energies (with a guardrail)
    plain: tuple = (0.0, 0)  # bytes and values of the plain leaves' exact sum
    skipped: Any = None  # bool[]: the nonfinite= policy skips this step (None: never)
    trigger: Any = None  # bool[]: the guardrail triggered (None: no guardrail ran)
    fallbacks: tuple = (0.0, 0.0)  # the fallback metric and the guardrail's triggers so far


class Stage(NamedTuple):
    """A stage: ``init(params) -> its state``, ``update(flight, state) -> (flight, state)``, and
    the NamedTuple type of its state (:func:`nest` builds it from the flat state)."""

    init: Callable
    update: Callable
    state_type: type | None  # None: a wrapper with no state of its own (its state is inner's)
    inner: Stage | None = None


def init_nested(stage: Stage, params, **own):
    """A stage's initial state: its own fields and, for a wrapper, its inner stage's state.

    Args:
      stage: the stage (its ``state_type`` None: a wrapper whose state is its inner's).
      params: the params ``init`` was given.
      **own: the stage's own fields.

    Returns:
      The stage's state.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.optim.stages.clock import clock_stage
      >>> from jaxcomp.optim.stages.aggregate import AggregateState
      >>> inner = Stage(lambda params: AggregateState(()), None, AggregateState)
      >>> clock_stage(inner, seed=0).init(None).inner
      AggregateState(method_state=(), auto=None)

    References:
      optax ``MultiSteps`` (a wrapper's state holds its inner's).
    """
    if stage.state_type is None:
        return stage.inner.init(params)
    if stage.inner is None:
        return stage.state_type(**own)
    return stage.state_type(**own, inner=stage.inner.init(params))


def nest(stage: Stage, flat):
    """The stages' nested states from the flat state, each field read by its name.

    Args:
      stage: the outermost stage of the ones to nest.
      flat: a :class:`~jaxcomp.CompressState` (or any object with the fields' names).

    Returns:
      ``stage``'s state, its inner stages' states inside it.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> from jaxcomp.optim.stages.aggregate import AggregateState
      >>> from jaxcomp.optim.stages.clock import clock_stage
      >>> flat = jaxcomp.compress(jaxcomp.Dense()).init(jnp.zeros(3))
      >>> nest(clock_stage(Stage(None, None, AggregateState), 0), flat).inner
      AggregateState(method_state=(None,), auto=None)

    References:
      optax ``MultiSteps`` (a wrapper's state holds its inner's).
    """
    if stage.state_type is None:
        return nest(stage.inner, flat)
    fields = {name: getattr(flat, name) for name in stage.state_type._fields if name != "inner"}
    if stage.inner is None:
        return stage.state_type(**fields)
    return stage.state_type(**fields, inner=nest(stage.inner, flat))


def wrapped(inner: Stage, flight: InFlight, state):
    """A wrapper's call of its inner stage: ``inner``'s update of ``state.inner``.

    Args:
      inner: the stage the wrapper wraps.
      flight: the flight, as the wrapper filled it in on the way in.
      state: the wrapper's state.

    Returns:
      ``(flight, state)``: the flight as the inner stages returned it, and the wrapper's state
      holding the inner stage's new state.

    Example:
      >>> from jaxcomp.optim.stages.aggregate import AggregateState
      >>> inner = Stage(None, lambda flight, s: (flight, s._replace(auto=1)), AggregateState)
      >>> class Outer(NamedTuple):
      ...     inner: Any
      >>> wrapped(inner, None, Outer(AggregateState(())))[1].inner.auto
      1

    References:
      optax ``MultiSteps`` (a wrapper calls its inner transformation).
    """
    flight, inner_state = inner.update(flight, state.inner)
    return flight, state._replace(inner=inner_state)


def unnest(state) -> dict:
    """The flat fields of nested stage states: the inverse of :func:`nest`.

    Args:
      state: the outermost stage's state.

    Returns:
      A dict of field name to value, for ``CompressState._replace``.

    Example:
      >>> from jaxcomp.optim.stages.aggregate import AggregateState
      >>> unnest(AggregateState((), None))
      {'method_state': (), 'auto': None}

    References:
      optax ``MultiSteps`` (a wrapper's state holds its inner's).
    """
    fields = {}
    while state is not None:
        fields.update({k: v for k, v in state._asdict().items() if k != "inner"})
        state = getattr(state, "inner", None)
    return fields
