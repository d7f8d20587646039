"""The route of a branch that sends everything on a mesh of one device (``compress_auto``'s
dense candidate): nothing is sent, so the branch runs static, on each leaf as it is."""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomp.optim import pinning
from jaxcomp.optim._flow import Gradients
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages.aggregation import Groups
from jaxcomp.optim.stages.flight import InFlight


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


def alone_groups(grads: Gradients) -> Groups:
    """One group per float leaf (the plain ones of ``mask=`` and ``min_size=`` too), each its
    leaf as it is: a flat view, no packing (the sum of one device is its own vector, retyped).
    Nothing is sent, so no residual is made and the one the state holds stays as it is; the
    guardrail has nothing compressed to watch."""
    leaves = [grads.leaves[i] for i in grads.layout.floats]
    return grads.groups._replace(
        vectors=[leaf.reshape(-1).astype(grads.comm_dtype) for leaf in leaves],
        names=[f"leaf {i}" for i in grads.layout.floats],
        sizes=[leaf.size for leaf in leaves],
        shapes=[(leaf.shape,) for leaf in leaves],
        values=[leaf.size for leaf in leaves],
        buckets=None,
    )


def write_alone(flight: InFlight) -> list:
    """The update's leaves from the totals of :func:`alone_groups` (the mean over one device is
    the sum), zero on a skipped step."""
    grads, out = flight.grads, flight.out
    for i, total in zip(grads.layout.floats, flight.result.totals):
        leaf = grads.leaves[i]
        update = total.reshape(leaf.shape)
        if flight.skipped is not None:
            update = jnp.where(flight.skipped, jnp.zeros_like(update), update)
        out[i] = update.astype(leaf.dtype)
    return out
