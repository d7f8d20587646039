"""The non-finite guard's functions: NaN and ±Inf gradient entries count as 0 and are counted.

Such entries are never sent and never stored in the residual (NaN - NaN would stay NaN forever);
the ``nonfinite=`` policy (:data:`jaxcomp.optim.state.NONFINITE_POLICIES`) then trains on, or
skips the step on every device, keeping the transformation's state as it was.

The guard looks again after aggregation, for values that *became* non-finite from finite ones:
an entry of the sum over the devices that overflowed (:func:`finite_totals`), and an entry of a
device's next residual ``g_e - sent`` (``g + residual`` that overflowed, or a 16-bit cast or a
codec that did). Those count in the same metric and policy; under ``"zero"`` they count as 0 in
the update and are dropped from the residual (:func:`jaxcomp.ops.flat.dropped`), so no state
turns non-finite.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxcomp.collectives import small
from jaxcomp.costmodel import ratio_choice
from jaxcomp.ops import flat
from jaxcomp.optim.vma import cast_varying, varying_axes


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


def guarded_totals(totals, flat_sum, axis_name, sharded: bool):
    """The totals of a method that sends everything, summed again without the non-finite entries
    when a total is not finite; with the non-finite count summed over the devices.

    A NaN or Inf on any device reaches the sum, so a finite sum proves every entry was finite,
    for one pass over the total instead of a select and a count over every gradient. Only a step
    whose sum is not finite (rare) sums again with those entries zeroed and counts them; every
    device takes the same branch (the sum is replicated: every device computes the same total,
    bit for bit; sharded, each device sees its shards only, so one all-reduce of a flag makes
    them agree). An entry that is still not finite in the second sum overflowed although every
    device's entry was finite: it counts as 0 too, and once in the count (:func:`finite_totals`).
    The second sum runs on the vectors end to end, one collective however many there are
    (with one sum per leaf, a model of 1,000 leaves compiled far longer than a plain pmean).

    Args:
      totals: per vector, the sum over the devices (replicated, or this device's row).
      flat_sum: ``() -> (vector, resum, split)``: the vectors that were summed (this device's)
        end to end, ``resum(vector)``, the same sum of such a vector, and ``split(total)``, its
        total back as one per vector. Called in the second sum's branch only.
      axis_name: the axis or axes summed over.
      sharded: the totals are reduce-scattered rows.

    Returns:
      ``(totals, count)``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> def f(v):
      ...     resum = lambda x: jax.lax.psum(x, "data")
      ...     totals, count = guarded_totals([resum(v)], lambda: (v, resum, lambda t: [t]),
      ...                                    "data", False)
      ...     return totals[0], count
      >>> total, count = jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P())(
      ...     jnp.array([1.0, jnp.nan, 2.0, 3.0]))
      >>> total.tolist(), float(count)
      ([3.0, 3.0], 1.0)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2.
    """
    finite_sum = all_finite_many(totals)
    if sharded:
        finite_sum = small.all_true(finite_sum, axis_name)

    def cleaned(_):
        vector, resum, split = flat_sum()
        (again,), overflowed = finite_totals([resum(flat.dropped(vector))])
        counts = small.metric_sum(jnp.stack([flat.count_nonfinite(vector), overflowed]), axis_name)
        count = agreed_count(counts[0], counts[1], total_copies(axis_name, sharded))
        return split(again), typed(count.astype(jnp.float32)), typed(jnp.zeros((), bool))

    # The scalars of the carry vary over what the sums still vary over: nothing, or the other
    # axes of a 2-D mesh when the gradients are summed over one (diloco's split exchange).
    extra = varying_axes(finite_sum)
    typed = lambda x: cast_varying(x, extra)  # noqa: E731
    # A loop that runs once when a sum is not finite and else never: a lax.cond would copy every
    # total that its finite branch passes through (a whole gradient); a loop's carry stays in
    # place (docs/performance.md, "A dense step beside a plain pmean on GPT-2").
    start = (list(totals), typed(jnp.zeros((), jnp.float32)), jnp.logical_not(finite_sum))
    again, count, _ = jax.lax.while_loop(lambda carry: carry[2], cleaned, start)
    return again, count


#: Arrays up to this many values are checked together by :func:`all_finite_many`.
SMALL_VALUES = 1 << 16


def all_finite_many(arrays):
    """Whether every entry of every array is finite: the small arrays (up to
    :data:`SMALL_VALUES` values) in one reduction over them end to end, each larger one in its
    own (:func:`all_finite`).

    XLA:CPU compiles each reduction on its own: a check per leaf of a model of 1,000 small
    leaves compiled for many seconds, one over the leaves end to end in a fraction of one
    (docs/performance.md, "The first step of a model of 1,000 small leaves"). A large
    leaf keeps its own reduction, which reads it where it lies.

    Args:
      arrays: a non-empty list of float arrays.

    Returns:
      A boolean scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> bool(all_finite_many([jnp.ones(3), jnp.zeros(2)]))
      True
      >>> bool(all_finite_many([jnp.ones(3), jnp.array([jnp.nan])]))
      False

    References:
      IEEE 754 (NaN propagates through addition); docs/performance.md, "The first step".
    """
    small_ones = [a.reshape(-1) for a in arrays if a.size <= SMALL_VALUES]
    checks = [all_finite(a) for a in arrays if a.size > SMALL_VALUES]
    if small_ones:
        checks.append(all_finite(jnp.concatenate(small_ones)))
    return functools.reduce(jnp.logical_and, checks)


def all_finite(x):
    """Whether every entry of ``x`` is finite, in one fused read of it.

    ``x - x`` is 0 for a finite entry and NaN for NaN or ±Inf, so the sum is NaN exactly when
    some entry is not finite. It stays one fused reduction on XLA:CPU, several times faster
    than ``jnp.all(jnp.isfinite(x))``, which reduces booleans slowly.

    Args:
      x: a float array.

    Returns:
      A boolean scalar.

    Example:
      >>> import jax.numpy as jnp
      >>> bool(all_finite(jnp.array([3e38, 3e38]))), bool(all_finite(jnp.array([1.0, jnp.inf])))
      (True, False)

    References:
      IEEE 754 (Inf - Inf and NaN - NaN are NaN; NaN propagates through addition).
    """
    return jnp.isfinite(jnp.sum(x - x, dtype=jnp.float32))


def finite_totals(totals):
    """The totals with their non-finite entries as 0, and how many there were on this device.

    Every device's entries were finite by then (:func:`finite`), so a non-finite total is a sum
    over the devices that overflowed (``8 * 3e38`` in float32, or ``8 * 1e4`` in float16), or
    a device's own value that did (a cast, a codec). Such an entry counts as 0, like a
    non-finite gradient entry. Replicated totals are the same on every device, so the count is
    too; :func:`agreed_count` turns its sum over the devices back into it.

    Args:
      totals: per group, the sum over the devices (replicated, or this device's row).

    Returns:
      ``(totals, count)``: the totals with non-finite entries as 0, and a float32 count.

    Example:
      >>> import jax.numpy as jnp
      >>> totals, count = finite_totals([jnp.array([1.0, jnp.inf]), jnp.array([jnp.nan])])
      >>> [t.tolist() for t in totals], float(count)
      ([[1.0, 0.0], [0.0]], 2.0)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2 (a step whose gradients
      overflowed).
    """
    count = sum((flat.count_nonfinite(t) for t in totals), jnp.zeros((), jnp.float32))
    return [flat.dropped(t) for t in totals], count


def count_totals(totals, axis_name, sharded: bool):
    """The non-finite entries of the totals, agreed over the devices: replicated totals are the
    same on every device, so its own count is everyone's; sharded rows are summed (a psum of one
    scalar).

    Args:
      totals: per group, the sum over the devices (replicated, or this device's row).
      axis_name: the axis or axes summed over.
      sharded: the totals are reduce-scattered rows.

    Returns:
      A float32 scalar, identical on every device.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(lambda t: count_totals([t], "data", True), mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> float(f(jnp.array([1.0, jnp.inf, jnp.nan, 2.0])))
      2.0

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2.
    """
    count = finite_totals(totals)[1]
    return small.metric_sum(count, axis_name) if sharded else count


def total_copies(axis_name, sharded: bool) -> int:
    """How many devices hold each entry of a total: all of them (replicated), or 1 (sharded rows).

    Args:
      axis_name: the axis or axes summed over (inside ``shard_map``).
      sharded: the totals are reduce-scattered rows.

    Returns:
      An int.

    Example:
      >>> total_copies("data", True)
      1

    References:
      Rajbhandari et al., "ZeRO", SC 2020 (reduce-scattered gradients).
    """
    return 1 if sharded else jax.lax.axis_size(axis_name)


def agreed_count(count, overflowed, copies: int):
    """The non-finite count of a step: the gradients' entries plus the totals' (summed over the
    devices, each total entry held by ``copies`` of them, so it counts once).

    Args:
      count: non-finite gradient (and residual) entries, summed over the devices.
      overflowed: non-finite total entries, summed over the devices.
      copies: :func:`total_copies`.

    Returns:
      A float32 scalar, identical on every device (it comes from sums over them).

    Example:
      >>> import jax.numpy as jnp
      >>> float(agreed_count(jnp.float32(3), jnp.float32(16), 8))
      5.0

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.2.
    """
    return count + jnp.round(overflowed / copies)


def finite_or_old(old, new):
    """``new`` with its non-finite float entries taken from ``old`` (pytrees of one structure): a
    method's state (PowerSGD's Q) that overflowed keeps its last finite value.

    Args:
      old: the state before the step (finite).
      new: the state after it.

    Returns:
      The state to keep.

    Example:
      >>> import jax.numpy as jnp
      >>> finite_or_old(jnp.array([1.0, 2.0]), jnp.array([5.0, jnp.nan])).tolist()
      [5.0, 2.0]

    References:
      Vogels et al., "PowerSGD", NeurIPS 2019, Alg. 1 (the warm-started Q a step keeps).
    """

    def pick(o, n):
        if not jnp.issubdtype(jnp.result_type(n), jnp.inexact):
            return n
        return jnp.where(jnp.isfinite(n), n, o)

    return jax.tree.map(pick, old, new)


def skip_flag(policy: str, count):
    """Whether the step is skipped: ``count > 0`` under ``"skip"`` and ``"raise"``, else None.

    Every device got the same summed count, so all skip together.

    Args:
      policy: one of :data:`jaxcomp.optim.state.NONFINITE_POLICIES`.
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
