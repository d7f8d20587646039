"""Stage 1, the non-finite guard: NaN and ±Inf gradient entries count as 0 and are counted.

Such entries are never sent and never stored in the residual (NaN - NaN would stay NaN forever);
the ``nonfinite=`` policy (:data:`NONFINITE_POLICIES`) then trains on, or skips the step on
every device, keeping the transformation's state as it was.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxcomp.collectives import small
from jaxcomp.costmodel import ratio_choice
from jaxcomp.ops import flat

#: What :func:`compress` does with non-finite gradient entries (NaN, ±Inf), its ``nonfinite=``
#: argument; the first is the default. In every policy such entries are never sent and never
#: stored in the residual, and the ``nonfinite`` metric counts them.
NONFINITE_POLICIES = ("zero", "skip", "raise")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class NonfinitePolicy:
    """The ``nonfinite=`` policy of a :func:`compress`, kept in its state as static structure.

    It holds no array (a pytree with no leaves), so it costs nothing in a step, a checkpoint or a
    sharding, and host code (:func:`skip_nonfinite`, :func:`jaxcomp.data_parallel`) reads it
    while tracing, without waiting for a device.
    """

    name: str  # one of NONFINITE_POLICIES


def finite(g):
    """A gradient leaf with its non-finite entries as 0 (float32), and how many there were.

    Args:
      g: a float array.

    Returns:
      ``(values, count)``: ``g`` in float32 with NaN/±Inf as 0, and a float32 scalar count.

    Example:
      >>> import jax.numpy as jnp
      >>> values, count = finite(jnp.array([1.0, jnp.nan, jnp.inf]))
      >>> values.tolist(), float(count)
      ([1.0, 0.0, 0.0], 2.0)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2 (non-finite gradients).
    """
    count = flat.count_nonfinite(g)
    return flat.finite_values(g), count


def guarded_totals(totals, vectors, resum, axis_name, sharded: bool):
    """The totals of a method that sends everything, summed again without the non-finite entries
    when a total is not finite; with the non-finite count summed over the devices.

    A NaN or Inf on any device reaches the sum, so a finite sum proves every entry was finite,
    for one pass over the total instead of a select and a count over every gradient. Only a step
    whose sum is not finite (rare) sums again with those entries zeroed and counts them; every
    device takes the same branch (the sum is replicated; sharded, each device sees its shards
    only, so one all-reduce of a flag makes them agree).

    Args:
      totals: per vector, the sum over the devices (replicated, or this device's row).
      vectors: the vectors that were summed (this device's).
      resum: ``vectors -> totals``, the same sum again.
      axis_name: the axis or axes summed over.
      sharded: the totals are reduce-scattered rows.

    Returns:
      ``(totals, count)``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> def f(v):
      ...     resum = lambda vs: [jax.lax.psum(x, "data") for x in vs]
      ...     totals, count = guarded_totals(resum([v]), [v], resum, "data", False)
      ...     return totals[0], count
      >>> total, count = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(
      ...     jnp.array([1.0, jnp.nan, 2.0, 3.0]))
      >>> total.tolist(), float(count)
      ([3.0, 3.0], 1.0)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2.
    """
    finite_sum = functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(t)) for t in totals])
    if sharded:
        finite_sum = small.all_true(finite_sum, axis_name)

    def cleaned(vectors):
        zeroed = [jnp.where(jnp.isfinite(v), v, jnp.zeros_like(v)) for v in vectors]
        again = resum(zeroed)
        count = sum(flat.count_nonfinite(v) for v in vectors)
        return again, small.metric_sum(count, axis_name)

    return jax.lax.cond(
        finite_sum, lambda v: (totals, jnp.zeros((), jnp.float32)), cleaned, vectors
    )


def skip_flag(policy: str, count):
    """Whether the step is skipped: ``count > 0`` under ``"skip"`` and ``"raise"``, else None.

    Every device got the same summed count, so all skip together.

    Args:
      policy: one of :data:`NONFINITE_POLICIES`.
      count: the non-finite entries this step, summed over the devices.

    Returns:
      A boolean scalar, or None (the policy never skips).

    Example:
      >>> import jax.numpy as jnp
      >>> bool(skip_flag("skip", jnp.float32(2))), skip_flag("zero", jnp.float32(2))
      (True, None)

    References:
      optax ``apply_if_finite``; Micikevicius et al., ICLR 2018, §3.2.
    """
    return (count > 0) if policy != "zero" else None


def hold(skipped, old, new):
    """``new``, or ``old`` where the step was skipped (pytrees of one structure).

    Args:
      skipped: :func:`skip_flag`'s result (None: never skipped).
      old: the state before the step.
      new: the state after it.

    Returns:
      The state to keep.

    Example:
      >>> import jax.numpy as jnp
      >>> hold(jnp.bool_(True), jnp.int32(1), jnp.int32(2)).tolist(), hold(None, 1, 2)
      (1, 2)

    References:
      optax ``apply_if_finite`` (a skipped step keeps the state).
    """
    return new if skipped is None else ratio_choice.where_tree(skipped, old, new)
