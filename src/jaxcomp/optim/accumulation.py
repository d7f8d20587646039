"""Gradient accumulation that communicates once per accumulated step: :func:`accumulate`.

``optax.MultiSteps`` calls its inner transformation on every micro-step and keeps the result only
on the last one (``jnp.where``), so a ``jaxcomp.compress`` inside it would run its collectives on
every micro-step. :func:`accumulate` keeps ``MultiSteps``'s state and arithmetic but runs the
inner transformation under ``lax.cond``: micro-steps only add the local gradient to the
accumulator (no communication but, with a ``compress`` inside, a one-scalar sum of the non-finite
count), and the last one compresses and aggregates the mean once. A micro-step with NaN or ±Inf
entries gets the ``compress``'s ``nonfinite=`` policy; the accumulator never holds them.
:func:`jaxcomp.data_parallel` applies it to an ``optax.MultiSteps`` it is given.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from jaxcomp.collectives import small
from jaxcomp.ops import _checks, flat
from jaxcomp.optim import vma
from jaxcomp.optim.nonfinite import skipped_or_none
from jaxcomp.optim.state import CompressState, compress_states


def accumulate(
    tx: optax.GradientTransformation, every_k: int | Callable, *, use_grad_mean: bool = True
) -> optax.GradientTransformationExtraArgs:
    """Accumulates ``every_k`` micro-steps of gradients and runs ``tx`` once on their mean.

    The state is an ``optax.MultiStepsState``; micro-steps return zero updates and leave ``tx``'s
    state untouched. Inside ``shard_map`` the accumulator is each device's own (local gradients),
    and ``tx`` (e.g. a chain starting with :func:`jaxcomp.compress`) communicates only on the
    step that emits. Every device must take the same branch, which holds since the step counters
    are replicated.

    Non-finite gradients: when ``tx`` holds a :func:`jaxcomp.compress`, its ``nonfinite=`` policy
    (read from its state, ``CompressState.policy``; no argument here) applies to the micro-step
    that brings NaN or ±Inf entries, and the accumulator never holds one. ``"zero"``: those
    entries enter the accumulator as 0. ``"skip"`` and ``"raise"``: the micro-step is dropped on
    every device (no add, it does not count toward ``every_k``, every state stays as it was);
    :func:`jaxcomp.data_parallel` then raises ``FloatingPointError`` under ``"raise"``, the state
    passed in still clean. If several compresses disagree, one that skips wins. The count is
    summed over the devices (one scalar all-reduce per micro-step, so that every device decides
    alike) and is the compress's ``nonfinite`` metric of that micro-step. Without a compress the
    gradients are added as they are (as ``optax.MultiSteps`` does).

    ``every_k=1`` (an int) runs ``tx``'s update as it is, bit for bit, inside the MultiSteps
    state. A schedule is evaluated at step 0 when built, and its value checked again while
    tracing when it is known then; a value below 1 is refused there (a ``ValueError`` naming
    ``every_k``), and a traced one counts as 1.

    Args:
      tx: the transformation to run on the accumulated gradients.
      every_k: micro-steps per update, an int >= 1 or a schedule ``gradient_step -> int``
        (as ``optax.MultiSteps``'s ``every_k_schedule``).
      use_grad_mean: average the micro-steps' gradients (default) instead of summing them.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = jaxcomp.accumulate(optax.sgd(1.0), 2)
      >>> state = tx.init({"w": jnp.zeros(2)})
      >>> u, state = tx.update({"w": jnp.ones(2)}, state)   # micro-step: nothing yet
      >>> u2, state = tx.update({"w": 3 * jnp.ones(2)}, state)  # emits -(1 + 3) / 2
      >>> u["w"].tolist(), u2["w"].tolist()
      ([0.0, 0.0], [-2.0, -2.0])

    References:
      optax.MultiSteps (the state and the running mean); Lin et al., "Deep Gradient Compression",
      ICLR 2018 (compressing the accumulated gradient).
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"tx must be an optax GradientTransformation, got {type(tx).__name__}")
    if callable(every_k):
        schedule, static_k = _checked_schedule(every_k), None
    else:
        static_k = _checks.static_int(every_k, "every_k", 1)
        schedule = lambda step: static_k  # noqa: E731
    use_grad_mean = _checks.check_flag(use_grad_mean, "use_grad_mean")
    inner = optax.with_extra_args_support(tx)

    def init_fn(params):
        return optax.MultiStepsState(
            mini_step=jnp.zeros((), jnp.int32),
            gradient_step=jnp.zeros((), jnp.int32),
            inner_opt_state=inner.init(params),
            acc_grads=jax.tree.map(jnp.zeros_like, params),
            skip_state=(),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if static_k == 1:
            return _every_step(inner, updates, state, params, extra_args)
        return _accumulated_step(inner, schedule, use_grad_mean, updates, state, params, extra_args)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _accumulated_step(inner, schedule, use_grad_mean, updates, state, params, extra_args):
    """One micro-step: add the (guarded) gradients; on the last, run ``tx`` on the mean."""
    k = _schedule_value(schedule, state.gradient_step)
    policy = _policy(state.inner_opt_state)
    clean, count = _guarded(updates, policy)
    skipped = None if policy in (None, "zero") else count > 0
    n = state.mini_step
    acc = jax.tree.map(
        lambda g, a: (a + (g - a) / (n + 1) if use_grad_mean else a + g).astype(a.dtype),
        clean,
        state.acc_grads,
    )
    emit = n == k - 1
    if skipped is not None:
        # The micro-step that brought non-finite values is dropped: no add, no count.
        emit = jnp.logical_and(emit, jnp.logical_not(skipped))
        acc = jax.tree.map(lambda old, new: jnp.where(skipped, old, new), state.acc_grads, acc)

    def run(acc, inner_state):
        grads = jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates)
        new_updates, new_inner = inner.update(grads, inner_state, params, **extra_args)
        return new_updates, new_inner, jax.tree.map(jnp.zeros_like, acc)

    def wait(acc, inner_state):
        shapes = jax.eval_shape(lambda: run(acc, inner_state)[0])
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), inner_state, acc

    new_updates, new_inner, new_acc = vma.cond_typed_alike(
        emit, run, wait, acc, state.inner_opt_state
    )
    mini_step = jnp.where(emit, 0, n + 1)
    if skipped is not None:
        mini_step = jnp.where(skipped, n, mini_step)
    new_state = optax.MultiStepsState(
        mini_step=mini_step.astype(jnp.int32),
        gradient_step=jnp.where(emit, state.gradient_step + 1, state.gradient_step).astype(
            jnp.int32
        ),
        inner_opt_state=_counted(new_inner, count, emit),
        acc_grads=new_acc,
        skip_state=state.skip_state,
    )
    return new_updates, new_state


def _checked_schedule(schedule: Callable) -> Callable:
    """``schedule``, refused now (a ValueError naming ``every_k``) if its value at step 0 is not a
    scalar >= 1."""
    try:
        value = schedule(jnp.zeros((), jnp.int32))
    except jax.errors.ConcretizationTypeError:
        return schedule
    _check_schedule_value(value)
    return schedule


def _check_schedule_value(value):
    """Refuses a schedule value that is not a scalar, or (when known while tracing) is < 1."""
    if jnp.ndim(value) != 0:
        raise ValueError(
            f"every_k: the schedule must return a scalar number of micro-steps, got shape "
            f"{jnp.shape(value)}"
        )
    try:
        known = int(value)
    except (jax.errors.ConcretizationTypeError, TypeError):
        return
    if known < 1:
        raise ValueError(
            f"every_k: the schedule returned {known} micro-steps; it must return an int >= 1 at "
            "every gradient step (0 would accumulate forever and never update)"
        )


def _schedule_value(schedule, gradient_step):
    """The schedule's micro-steps for this gradient step, as int32; a traced value below 1 (it
    could not be refused earlier) counts as 1, so the step emits instead of stalling."""
    value = schedule(gradient_step)
    _check_schedule_value(value)
    return jnp.maximum(jnp.asarray(value, jnp.int32), 1)


def _every_step(inner, updates, state, params, extra_args):
    """``every_k=1``: ``tx``'s update as it is (bit for bit: no accumulator arithmetic, no
    ``lax.cond`` to change how XLA fuses the update into the params), in the MultiSteps state."""
    new_updates, new_inner = inner.update(updates, state.inner_opt_state, params, **extra_args)
    skipped = skipped_or_none(new_inner)
    advance = 1 if skipped is None else jnp.where(skipped, 0, 1)
    return new_updates, state._replace(
        gradient_step=(state.gradient_step + advance).astype(jnp.int32), inner_opt_state=new_inner
    )


def _policy(inner_state) -> str | None:
    """The non-finite policy the micro-steps follow: ``"skip"`` when any compress in ``tx`` skips
    (``"skip"`` or ``"raise"``), ``"zero"`` when all zero, None without a compress."""
    names = {s.policy.name for s in compress_states(inner_state)}
    if not names:
        return None
    return "skip" if names - {"zero"} else "zero"


def _guarded(updates, policy):
    """``(updates, count)``: the micro-step's gradients with non-finite entries as 0, and how many
    there were, summed over the devices (identical on each); as they are, and None, without a
    compress (``policy`` None)."""
    if policy is None:
        return updates, None
    leaves = [g for g in jax.tree.leaves(updates) if jnp.issubdtype(g.dtype, jnp.inexact)]
    clean = jax.tree.map(
        lambda g: flat.dropped(g) if jnp.issubdtype(g.dtype, jnp.inexact) else g, updates
    )
    count = sum((flat.count_nonfinite(g) for g in leaves), jnp.zeros((), jnp.float32))
    axes = _count_axes(leaves)
    return clean, small.metric_sum(count, axes) if axes else count


def _count_axes(leaves) -> tuple:
    """The mesh axes to sum a count over: those the gradients vary over; with ``check_vma=False``
    (nothing typed) every manual axis of the enclosing ``shard_map``; none outside one."""
    axes = frozenset().union(*(vma.varying_axes(g) for g in leaves))
    manual = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))
    if not axes and manual:
        probe = jax.lax.pcast(jnp.zeros((), jnp.float32), manual, to="varying")
        if not vma.varying_axes(probe):
            axes = frozenset(manual)
    return tuple(sorted(axes))


def _counted(inner_state, count, emit):
    """``inner_state`` with each compress's ``nonfinite`` metric counting this micro-step's
    non-finite entries (plus, when it emitted, what the compress itself counted)."""
    if count is None:
        return inner_state

    def fix(node):
        if not isinstance(node, CompressState):
            return node
        own = jnp.where(emit, node.metrics.nonfinite, jnp.zeros_like(node.metrics.nonfinite))
        return node._replace(metrics=node.metrics._replace(nonfinite=own + count))

    return jax.tree.map(fix, inner_state, is_leaf=lambda x: isinstance(x, CompressState))


def from_multisteps(multi_steps: optax.MultiSteps) -> optax.GradientTransformationExtraArgs:
    """:func:`accumulate` with the settings of an ``optax.MultiSteps`` (its inner transformation,
    ``every_k_schedule`` and mean/sum), so that it communicates once per accumulated step.

    Args:
      multi_steps: an ``optax.MultiSteps`` without ``should_skip_update_fn``.

    Returns:
      The equivalent :func:`accumulate` transformation (same state type).

    Example:
      >>> import optax
      >>> from jaxcomp.optim import accumulation as acc
      >>> tx = acc.from_multisteps(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4))

    References:
      optax.MultiSteps (the settings and state it reads).
    """
    try:
        schedule, mean = multi_steps._every_k_schedule, multi_steps._use_grad_mean
        skip = multi_steps._should_skip_update_fn
    except AttributeError:
        raise TypeError(
            "this optax version's MultiSteps cannot be read; pass jaxcomp.accumulate(tx, every_k) "
            "instead of optax.MultiSteps"
        ) from None
    if (
        getattr(skip, "__name__", "") != "should_skip_update_fn"
        or skip.__qualname__.split(".")[0] != "MultiSteps"
    ):
        raise ValueError(
            "an optax.MultiSteps with should_skip_update_fn cannot be turned into "
            "jaxcomp.accumulate; skip non-finite steps with jaxcomp.compress(..., "
            "nonfinite='skip') instead"
        )
    return accumulate(multi_steps.inner_opt, _static_every_k(schedule), use_grad_mean=mean)


def every_k_of(multi_steps: optax.MultiSteps) -> int | None:
    """How many micro-steps an ``optax.MultiSteps`` accumulates, where it is a fixed number.

    Args:
      multi_steps: an ``optax.MultiSteps``.

    Returns:
      Its ``every_k_schedule`` as an int, or None where it is a schedule (or cannot be read).

    Example:
      >>> import optax
      >>> every_k_of(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4))
      4

    References:
      optax.MultiSteps (the setting it reads).
    """
    every_k = _static_every_k(getattr(multi_steps, "_every_k_schedule", None))
    return every_k if isinstance(every_k, int) else None


def _static_every_k(schedule):
    """The int that ``optax.MultiSteps(every_k_schedule=int)`` wraps in a lambda (so that
    ``every_k=1`` is ``tx`` bit for bit), else ``schedule`` itself."""
    if getattr(schedule, "__qualname__", "").startswith("MultiSteps.__init__"):
        cells = [cell.cell_contents for cell in schedule.__closure__ or ()]
        ints = [v for v in cells if isinstance(v, int) and not isinstance(v, bool)]
        if len(ints) == 1:
            return ints[0]
    return schedule
