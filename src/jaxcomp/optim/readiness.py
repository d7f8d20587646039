"""The order in which a backward pass finishes the gradient's leaves, for ``compress(bucket_mb=)``.

Buckets are sent in that order, each after the one before: the first bucket should hold the
leaves the backward pass finishes first. Without more information that is the last leaves of the
tree first (PyTorch DDP's first guess too), which is wrong for a tree whose leaves are not in the
model's order, e.g. a transformer whose token embedding sorts last but is used first (its
gradient is finished last). :func:`jaxcomp.data_parallel` reads the order from the jaxpr of its
gradient (:func:`backward_order`) and puts it in force (:func:`gradients_ready_in`) while it
traces the update.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax

_ORDER: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "jaxcomp_gradient_order", default=None
)


def backward_order(grad_fn, *args) -> tuple:
    """The leaf positions of ``grad_fn(*args)`` in the order its jaxpr computes them.

    Args:
      grad_fn: a function returning the gradients (a pytree).
      args: its arguments (arrays, tracers or abstract values).

    Returns:
      A tuple of leaf positions, the first finished first; ties (leaves made by one call, or
      passed through) keep the last leaves first.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> loss = lambda p, x: jnp.sum(jnp.tanh(x * p["b_first"]) * p["a_last"])
      >>> params = {"a_last": jnp.ones(2), "b_first": jnp.ones(2)}
      >>> backward_order(jax.grad(loss), params, jnp.ones(2))
      (0, 1)

    References:
      Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3 (buckets follow the order in which
      gradients become ready).
    """
    closed = jax.make_jaxpr(grad_fn)(*args)
    return finish_order(closed.jaxpr, len(closed.jaxpr.outvars))


def finish_order(jaxpr, n_last: int) -> tuple:
    """The positions among the last ``n_last`` outputs of ``jaxpr`` (the gradient's leaves), in
    the order its equations compute them.

    Args:
      jaxpr: a :class:`jax.extend.core.Jaxpr` whose last ``n_last`` outputs are the gradients.
      n_last: how many.

    Returns:
      A tuple of positions in ``range(n_last)``, the first finished first; ties keep the last
      first.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> f = lambda x: (jnp.sin(x), jnp.cos(x), x)  # the input itself: ready before any
      >>> finish_order(jax.make_jaxpr(f)(1.0).jaxpr, 2)
      (1, 0)

    References:
      Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3.
    """
    made_by = {}
    for index, eqn in enumerate(jaxpr.eqns):
        for var in eqn.outvars:
            made_by[var] = index
    outvars = jaxpr.outvars[len(jaxpr.outvars) - n_last :]
    finished = [made_by.get(var, -1) for var in outvars]
    return tuple(sorted(range(len(finished)), key=lambda i: (finished[i], -i)))


@contextlib.contextmanager
def gradients_ready_in(order):
    """Within this context, ``compress(bucket_mb=)`` sends its buckets in ``order``.

    Args:
      order: leaf positions of the gradients, the first finished first (:func:`backward_order`,
        :func:`finish_order`), or None for the default (the last leaves first).

    Returns:
      A context manager.

    Example:
      >>> with gradients_ready_in((1, 0)):
      ...     ready_order()
      (1, 0)

    References:
      Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3.
    """
    token = _ORDER.set(None if order is None else tuple(order))
    try:
        yield
    finally:
        _ORDER.reset(token)


def ready_order() -> tuple | None:
    """The order :func:`gradients_ready_in` put in force, or None.

    Returns:
      A tuple of leaf positions, or None.

    Example:
      >>> ready_order() is None
      True

    References:
      Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3.
    """
    return _ORDER.get()


def bucket_ranks(buckets: list, groups: list, order) -> list:
    """Per group, the rank at which its bucket is sent: buckets ordered by the step at which
    ``order`` finishes their last leaf (as given without ``order``).

    Args:
      buckets: per group, its bucket (:func:`jaxcomp.optim.stages.mask.layout`).
      groups: per group, its leaf positions.
      order: leaf positions, the first finished first, or None.

    Returns:
      Per group, its bucket's rank (0 is sent first).

    Example:
      >>> bucket_ranks([0, 1], [[2], [0, 1]], (0, 1, 2))
      [1, 0]

    References:
      Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3.
    """
    if order is None:
        return list(buckets)
    finished_at = {leaf: step for step, leaf in enumerate(order)}
    ready = {}
    for bucket, positions in zip(buckets, groups):
        last = max(finished_at.get(i, len(order)) for i in positions)
        ready[bucket] = max(ready.get(bucket, -1), last)
    rank = {b: r for r, b in enumerate(sorted(ready, key=lambda b: (ready[b], b)))}
    return [rank[b] for b in buckets]
