"""The route of a method that loses nothing through a :func:`jaxcomp.compress` update: nothing
is kept, so the gradients are summed as they are, and the guard looks at the sums."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.optim import packing, pinning, vma
from jaxcomp.optim._flow import Aggregated, Gradients, as_sent, filled, next_state
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import guard
from jaxcomp.optim.stages.aggregation import Groups, as_one_group


def sum_dense(c: FeedbackConfig, grads: Gradients, aggregate, state) -> Aggregated:
    """The route of a method that loses nothing: nothing is kept, so the gradients are summed as
    they are (each large leaf alone, the small ones as one vector: :func:`mask.summed_together`)
    and the guard looks at the sums (:func:`guard.guarded_totals`)."""
    vectors = [
        packing.pack([grads.leaves[i] for i in positions], grads.shards, row).astype(
            grads.comm_dtype
        )
        for (positions, _), row in zip(grads.layout.groups, grads.rows)
    ]
    return sum_groups(c, grads, filled(grads.groups, vectors), aggregate, state)


def sum_groups(c: FeedbackConfig, grads: Gradients, groups: Groups, aggregate, state):
    """The :class:`Aggregated` of ``groups`` summed as they are, the guard looking at the sums
    (:func:`guard.guarded_totals`): the dense route's sum, packed or leaf by leaf."""
    result, auto_after = aggregate(groups, state)
    totals, count = guard.guarded_totals(
        result.totals,
        lambda: sum_as_one(aggregate, groups, as_sent(groups.vectors, result), state),
        c.axis_name,
        sharded=grads.shards is not None,
    )
    result = result._replace(totals=totals)
    gain = jnp.ones((), jnp.float32)  # everything is sent
    nothing = [None] * len(totals)
    return Aggregated(
        list(grads.leaves), result, auto_after, nothing, nothing, {}, gain, count, 0.0, 0
    )


def sum_as_one(aggregate, groups: Groups, vectors, state):
    """``(vector, resum, split)`` of :func:`guard.guarded_totals`: ``vectors`` (one per group)
    end to end, summed as one group (one collective however many leaves: a method that sends
    everything sums elementwise), and its total split back into one per group."""
    one, split = as_one_group(groups, vectors)
    resum = lambda vector: aggregate(one._replace(vectors=[vector]), state)[0].totals[0]  # noqa: E731
    return one.vectors[0], resum, split


def runs_alone(c: FeedbackConfig, grads: Gradients, alone: int | None, state) -> bool:
    """Whether this update runs branch ``alone`` by the dense route: one device in all, not
    sharded, no momentum correction (whose velocity the dense route would not send), and no
    other branch pinned for this step (``data_parallel``'s trial times each candidate)."""
    return (
        alone is not None
        and grads.groups.n_devices == 1
        and grads.shards is None
        and c.momentum is None
        and pinning.pinned_branch(state.branches) in (None, alone)
    )


def update_alone(c: FeedbackConfig, grads: Gradients, aggregate, state, alone: int, treedef):
    """The update on one device of a state whose branch ``alone`` sends everything: that branch,
    static, on each leaf as it is (a flat view, no packing: the sum of one device is its own
    vector, retyped), with the guard's non-finite handling. Nothing is sent, so no residual is
    made and the one the state holds stays as it is; the guardrail has nothing compressed to
    watch. The metrics report the branch, and the choosing state (``compress_auto``'s) learns
    of its step as of any other."""
    positions = list(grads.layout.floats)  # the plain leaves (mask=, min_size=) too
    leaves = [grads.leaves[i] for i in positions]
    groups = grads.groups._replace(
        vectors=[leaf.reshape(-1).astype(grads.comm_dtype) for leaf in leaves],
        names=[f"leaf {i}" for i in positions],
        sizes=[leaf.size for leaf in leaves],
        shapes=[(leaf.shape,) for leaf in leaves],
        values=[leaf.size for leaf in leaves],
        buckets=None,
    )
    with pinning.pinned(alone, state.branches):
        done = sum_groups(c, grads, groups, aggregate, state)
    done = done._replace(result=done.result._replace(sends_everything=True))
    skipped = guard.skip_flag(c.nonfinite, done.nonfinite)
    for i, leaf, total in zip(positions, leaves, done.result.totals):
        update = total.reshape(leaf.shape)  # the mean over one device is the sum
        if skipped is not None:
            update = jnp.where(skipped, jnp.zeros_like(update), update)
        done.out[i] = update.astype(leaf.dtype)
    new_state = next_state(c, grads, done, skipped, state, state.auto is not None)
    # The residual is kept as it was, typed per device as every other route leaves it (the
    # state's layout reads its type from an update traced without a pinned branch).
    axes = frozenset(c.axes)
    residual = jax.tree.map(lambda r: vma.cast_varying(r, axes), state.residual)
    return treedef.unflatten(done.out), new_state._replace(residual=residual)
