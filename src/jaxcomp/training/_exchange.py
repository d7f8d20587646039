"""The pieces of :func:`jaxcomp.diloco`'s outer round that every schedule shares (:mod:`.outer`
for a sync now or a delayed one, :mod:`._eager` for an eager one): one fragment's share of the
state, its pseudo-gradient through the outer ``compress``, and the outer optimizer's step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import optax

from jaxcomp.optim.state import find_compress_state
from jaxcomp.optim.vma import cast_varying, varying_axes


class Fragment(NamedTuple):
    """One fragment's share of the state, inside the step (this device's rows)."""

    global_leaves: list
    local_leaves: list
    outer_state: Any
    compress_state: Any
    # delay > 0: the aggregated pseudo-gradient waiting; eager: (that, the worker's start);
    # else None
    pending: Any


def exchange(run, global_leaves, local_leaves, compress_state, start=None):
    """``(aggregated, compress_state, bytes_sent)``: a fragment's pseudo-gradient (``start``,
    by default the global leaves, minus the local ones) through the outer ``compress``; split
    over the inner axis, each device sends its block and the row gathers the average."""
    inner = run.inner
    start = global_leaves if start is None else start
    delta = [inner.block(s - lo) for s, lo in zip(start, local_leaves)]
    blocks = [inner.block(g) for g in global_leaves]
    aggregated, compress_state = run.compress_tx.update(delta, compress_state, blocks)
    aggregated = inner.wholes(
        [a.astype(g.dtype) for a, g in zip(aggregated, global_leaves)],
        [g.shape for g in global_leaves],
    )
    return aggregated, compress_state, inner.row_bytes(bytes_sent(compress_state))


def unsent(operands):
    """The branch of a step without an exchange: the operands as they were, 0 bytes sent."""
    return operands, jnp.zeros((), jnp.float32)


def outer_update(run, aggregated, outer_state, global_leaves):
    """``outer_tx`` on the global leaves of a fragment, with the averaged pseudo-gradient."""
    aggregated = [a.astype(g.dtype) for a, g in zip(aggregated, global_leaves)]
    updates, outer_state = run.outer_tx.update(aggregated, outer_state, global_leaves)
    return list(optax.apply_updates(global_leaves, updates)), outer_state


def like(value, target):
    """``value`` typed varying over the axes ``target`` varies over (a worker's params)."""
    return cast_varying(value, varying_axes(target))


def nonfinite_count(compress_state):
    """The non-finite entries the outer compress counted in its last exchange (its metric)."""
    found = find_compress_state(compress_state)
    return jnp.float32(found.metrics.nonfinite) if found is not None else jnp.float32(0)


def bytes_sent(compress_state):
    """Bytes one device sent in the outer compress's exchange (its own metric)."""
    found = find_compress_state(compress_state)
    return jnp.float32(found.metrics.bytes_sent) if found is not None else jnp.float32(0)
