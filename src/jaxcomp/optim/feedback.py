"""The error-feedback transformation around an aggregation: :func:`feedback_transformation`.

:func:`jaxcomp.compress` and :func:`jaxcomp.compress_auto` build on it; they differ only in how
they aggregate (one method, a warm-up switch, or a per-step choice). An update is the stages of
:mod:`jaxcomp.optim.stages`, each a wrapper around the next (:mod:`.stages.flight`), outside in:

1. the layout (this module): the gradients laid out in groups and written back at the end;
2. :mod:`.stages.metrics`: the step's metrics from what the stages inside measured;
3. :mod:`.stages.nonfinite` (``"skip"``/``"raise"``): a step with a non-finite entry keeps the
   state of every stage inside;
4. :mod:`.stages.clock`: the step and its PRNG key;
5. :mod:`.stages.momentum` (``momentum_correction=``): ``u = m u + g``, cleared where sent;
6. :mod:`.stages.error_feedback`: ``g_e = u + residual`` packed, ``g_e - sent`` kept;
7. :mod:`.stages.guardrail`: the dense fallback's flag in, the trigger decided out;
8. :mod:`.stages.aggregate`: every collective of the step and its one psum of scalars.

A method that loses nothing (:class:`jaxcomp.Dense`) takes a shorter route: it sums the leaves
as they are and only looks for non-finite entries when the sum is not finite. Gradient
accumulation is a wrapper around a whole transformation (:func:`jaxcomp.accumulate`), not a
stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import jax
import optax

from jaxcomp.methods import Method
from jaxcomp.optim import _update_checks, packing, pinning, sharding
from jaxcomp.optim._dense_route import alone_groups, runs_alone, write_alone
from jaxcomp.optim._flow import prepare
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import mask
from jaxcomp.optim.stages.aggregate import AggregateState, aggregate_stage
from jaxcomp.optim.stages.aggregation import init_method_state
from jaxcomp.optim.stages.clock import clock_stage
from jaxcomp.optim.stages.error_feedback import feedback_stage
from jaxcomp.optim.stages.flight import InFlight, Stage, nest, unnest
from jaxcomp.optim.stages.guardrail import guardrail_stage
from jaxcomp.optim.stages.metrics import metrics_stage
from jaxcomp.optim.stages.momentum import momentum_stage
from jaxcomp.optim.stages.nonfinite import nonfinite_stage
from jaxcomp.optim.state import Branches, CompressState, NonfinitePolicy


def feedback_transformation(
    config: FeedbackConfig,
    branches: tuple[Method, ...],
    keeps_residual: bool,
    aggregate: Callable,
    init_auto: Callable | None = None,
    falls_back: bool = False,
    warmup: int = 0,
    alone: int | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The error-feedback transformation around an aggregation step: the stages of this
    module's docstring (:func:`compress` and :func:`jaxcomp.compress_auto` build on it).

    Args:
      config: the shared arguments.
      branches: the methods the state records (:attr:`CompressState.methods`).
      keeps_residual: whether the state keeps a residual (error feedback that can lose anything).
      aggregate: ``(groups, flight, state) -> (Aggregation, auto_after)``: the method's
        collective, given the flight (:class:`~jaxcomp.optim.stages.flight.InFlight`: the step,
        its key, the guardrail's fallback flag) and the
        :class:`~jaxcomp.optim.stages.aggregate.AggregateState`; ``auto_after(gain)`` returns
        the new auto state (or is None).
      init_auto: ``() -> auto state`` for the state's ``auto`` field, or None.
      falls_back: with a guardrail, whether ``aggregate`` runs dense while it falls back.
      warmup: the dense steps before the method runs (:func:`jaxcomp.optim.pinning.next_branch`).
      alone: a branch that sends everything, run by the dense route on a mesh of one device
        (:func:`jaxcomp.optim._dense_route.runs_alone`); None: every mesh chooses.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a :class:`CompressState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.compress(jaxcomp.Dense())  # built on this
      >>> tx.init({"w": jnp.zeros(3)}).methods
      (Dense(allreduce='ring'),)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 (error feedback).
    """
    c = config
    branches = tuple(branches)
    sends_everything = all(m.sends_everything for m in branches)
    keeps_residual = keeps_residual and not sends_everything
    record = _branches(c, branches, falls_back, warmup)  # the state's static part
    stages = _stages(c, record, keeps_residual, aggregate, init_auto, falls_back)
    return _layout(c, record, stages, keeps_residual, init_auto is not None, alone)


def _stages(c: FeedbackConfig, record: Branches, keeps_residual, aggregate, init_auto, falls_back):
    """The stages inside the layout, outside in, each present where its option asks for it."""
    branches = record.methods
    sends_everything = all(m.sends_everything for m in branches)
    dense = sends_everything and init_auto is None  # the dense route: nothing error-fed

    def groups_of(params):
        return mask.layout(c, params, sends_everything).groups

    def init_aggregate(params):
        leaves = jax.tree.leaves(params)
        shapes = [tuple(leaves[i].shape for i in p) for p, _ in groups_of(params)]
        auto = init_auto() if init_auto is not None else None
        return AggregateState(init_method_state(branches, shapes), auto)

    stage = aggregate_stage(aggregate, c.axis_name, dense, init_aggregate)
    if c.guardrail is not None and not sends_everything:
        stage = guardrail_stage(
            stage, c.guardrail, c.axis_name, falls_back, lambda p: bool(groups_of(p))
        )
    compressed = lambda p: mask.layout(c, p, sends_everything).compressed  # noqa: E731

    def feeds(record):  # a step compiled for a branch without error feedback leaves it be
        return pinning.pinned_config(c, record).error_feedback

    stage = feedback_stage(stage, keeps_residual, not dense, compressed, c.axes, c.decay, feeds)
    if c.momentum is not None:
        stage = momentum_stage(stage, c.momentum, compressed)
    stage = clock_stage(stage, c.seed)
    if c.nonfinite != "zero":
        stage = nonfinite_stage(stage)
    return metrics_stage(stage)


def _layout(c: FeedbackConfig, record: Branches, stages: Stage, keeps_residual, uses_auto, alone):
    """The outermost stage: the user's gradients laid out for the stages and written back, the
    flat :class:`CompressState` nested for them and flattened again."""
    policy = NonfinitePolicy(c.nonfinite)
    sends_everything = all(m.sends_everything for m in record.methods)

    def init_fn(params):
        if sharding.active() is not None:
            _update_checks.check_scatters(record.methods)
        state = CompressState(**unnest(stages.init(params)), policy=policy, branches=record)
        return state._replace(asked=pinning.next_branch(state)) if pinning.can_pin(state) else state

    def update_fn(updates, state, params=None, **extra_args):
        del params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        residuals, velocities = _state_leaves(c, treedef, state)
        # A step compiled for one branch lays the gradients out as that branch buckets them.
        lay = mask.layout(pinning.pinned_config(c, record), updates, sends_everything)
        guarding = c.guardrail is not None and not sends_everything and bool(lay.groups)
        _check_state_is_ours(c, state, uses_auto, record, policy, guarding if lay.floats else None)
        if not lay.floats:
            return updates, state
        mask.check_same_choice(lay, residuals if keeps_residual else velocities)
        grads = prepare(c, record.methods, leaves, lay)
        by_itself = runs_alone(c, grads, alone, state)
        if by_itself:
            grads = grads._replace(groups=alone_groups(grads))
        flight = InFlight(grads, record, c.nonfinite, list(leaves), [], treedef=treedef)
        flight = flight._replace(alone=alone if by_itself else None)
        pin = pinning.pinned(alone, record) if by_itself else contextlib.nullcontext()
        with pin:
            flight, nested = stages.update(flight, nest(stages, state))
        new_state = state._replace(**unnest(nested))
        if state.asked is not None:
            new_state = new_state._replace(asked=pinning.next_branch(state))
        return treedef.unflatten(_written(flight)), new_state

    return optax.GradientTransformationExtraArgs(init_fn, _update_checks.checked_update(update_fn))


def _written(flight: InFlight) -> list:
    """The update's leaves: each group's total split into its leaves (zeros on a step that is
    skipped or that triggered the guardrail)."""
    grads, out = flight.grads, flight.out
    if flight.alone is not None:
        return write_alone(flight)
    silenced = _either(flight.skipped, flight.trigger)
    for (positions, _), total in zip(grads.layout.groups, flight.result.totals):
        packing.write(out, grads.leaves, positions, total, grads.scale, silenced, grads.shards)
    return out


def _either(a, b):
    """``a | b`` of two flags that may be None (never set)."""
    if a is None or b is None:
        return b if a is None else a
    return a | b


def _state_leaves(c: FeedbackConfig, treedef, state: CompressState):
    """The state's residual and velocity per leaf of the updates (None without momentum)."""
    try:
        residuals = treedef.flatten_up_to(state.residual)
        velocities = treedef.flatten_up_to(state.velocity) if c.momentum is not None else None
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"updates do not have the structure of the params compress was initialized with: {e}"
        ) from None
    return residuals, velocities


def _branches(c: FeedbackConfig, branches, falls_back: bool, warmup: int) -> Branches:
    """The state's static record: its methods, whether its guardrail tells the host, whether it
    falls back to dense, its warm-up, its mean, its own defaults per branch, its buckets."""
    on = c.guardrail is not None
    return Branches(
        tuple(branches),
        on and c.guardrail.callback,
        on and falls_back,
        warmup,
        bool(c.mean),
        c.branch_buckets is not None or c.branch_feedback is not None,
        c.bucket_mb is not None,
    )


def _check_state_is_ours(c: FeedbackConfig, state, uses_auto, branches: Branches, policy, guarding):
    """Refuses a state made by another transformation's init (``guarding``: whether this update
    runs the guardrail, None when it has no float leaf)."""
    if guarding is not None and guarding != (state.divergence is not None):
        raise ValueError(
            f"state was made by a compress(guardrail={not guarding}), not by this "
            f"compress(guardrail={guarding})'s init"
        )
    if uses_auto != (state.auto is not None) or state.branches != branches:
        ours = [m.describe() for m in branches.methods]
        raise ValueError(
            f"state was not made by this transformation's init (it runs "
            f"{[m.describe() for m in state.methods]}, this one {ours})"
        )
    if state.policy != policy:
        raise ValueError(
            f"state was made by a compress(nonfinite={state.policy.name!r}), not by this "
            f"compress(nonfinite={c.nonfinite!r})'s init"
        )
