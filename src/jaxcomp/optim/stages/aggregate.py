"""The aggregation stage, innermost in a :func:`jaxcomp.compress` update: every collective of
the step.

It sums the plain leaves (those ``mask=`` and ``min_size=`` leave out) exactly, runs the
method's collective on the groups the stages outside it packed (:mod:`.aggregation`), and sums
every scalar the stages declared (the non-finite counts, the gain's energies, the guardrail's
gradient energy) in one psum (:func:`.metrics.summed_metrics`). A method that loses nothing
takes the dense route: the leaves are summed as they are and only a sum that is not finite is
looked at again (:func:`.guard.guarded_totals`). The state is the methods' own
(:attr:`jaxcomp.CompressState.method_state`) and ``compress_auto``'s choice
(:attr:`jaxcomp.CompressState.auto`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxcomp.ops import flat, pieces, scatter
from jaxcomp.optim import packing
from jaxcomp.optim.stages import guard, mask, metrics
from jaxcomp.optim.stages.aggregation import Aggregation, Groups, as_one_group
from jaxcomp.optim.stages.flight import InFlight, Stage


class AggregateState(NamedTuple):
    """The aggregation stage's state: per method its own (PowerSGD's Q), and
    ``compress_auto``'s :class:`jaxcomp.AutoState` (None for ``compress``)."""

    method_state: Any
    auto: Any = None


def aggregate_stage(aggregate: Callable, axis_name, dense: bool, init_state: Callable) -> Stage:
    """The innermost stage: the step's collectives and its one psum of scalars.

    Args:
      aggregate: ``(groups, flight, state) -> (Aggregation, auto_after)``: the method's
        collective (``compress``'s or ``compress_auto``'s); ``auto_after(gain)`` is the new
        auto state, or None.
      axis_name: the axis or axes to sum over.
      dense: the dense route (every method sends everything, nothing chooses): the leaves are
        packed and summed as they are; else the error-fed vectors of the flight are.
      init_state: ``params -> AggregateState``.

    Returns:
      A :class:`~jaxcomp.optim.stages.flight.Stage` with an :class:`AggregateState`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> jaxcomp.compress(jaxcomp.Dense()).init({"w": jnp.zeros(3)}).method_state
      (None,)

    References:
      Tyagi & Swany, arXiv 2312.02493, Alg. 1 and §2-C3 (the gain's sums).
    """

    def update(flight: InFlight, state: AggregateState):
        if dense or flight.alone is not None:
            return _summed_as_they_are(aggregate, axis_name, flight, state)
        return _summed_error_fed(aggregate, axis_name, flight, state)

    return Stage(init_state, update, AggregateState)


def _summed_error_fed(aggregate, axis_name, flight: InFlight, state: AggregateState):
    """The error-fed route: the plain leaves' exact sum, the method's collective on the flight's
    error-fed vectors, and the one psum of the declared scalars."""
    grads = flight.grads
    flight = _sum_plain(flight, axis_name)
    feds = flight.feds
    if feds:
        vectors = [fed.astype(grads.comm_dtype) for fed in feds]
        result, auto_after = aggregate(_filled(grads.groups, vectors), flight, state)
        feds = _as_sent(feds, result)
    else:  # every leaf is plain
        result = Aggregation([], [], 0.0, 0, 0, False, True, state.method_state)
        auto_after = None
    sharded = grads.shards is not None
    gain, count, energies = metrics.summed_metrics(
        result,
        feds,
        sum(flight.counts),
        axis_name,
        lambda: guard.count_totals(_dense(result.totals), axis_name, sharded),
        _narrowest(grads.comm_dtype, flight.record.methods),
        flight.gradient,
        [None if p is None else p.fed for p in flight.packs],
    )
    if flight.policy == "zero":  # an overflowed total counts as 0 (skip/raise zero the update)
        result = result._replace(totals=[_dropped(t) for t in result.totals])
    flight = flight._replace(result=result, feds=feds, gain=gain, energies=energies)
    return _finished(flight, count, auto_after, state)


def _summed_as_they_are(aggregate, axis_name, flight: InFlight, state: AggregateState):
    """The dense route: the groups packed as they are (or the flight's own, one per leaf, on
    one device), summed, and looked at again only where a sum is not finite."""
    grads = flight.grads
    groups = grads.groups
    if flight.alone is None:
        vectors = [
            packing.pack([grads.leaves[i] for i in positions], grads.shards, row).astype(
                grads.comm_dtype
            )
            for (positions, _), row in zip(grads.layout.groups, grads.rows)
        ]
        groups = _filled(groups, vectors)
    result, auto_after = aggregate(groups, flight, state)

    def as_one():
        one, split = as_one_group(groups, _as_sent(groups.vectors, result))
        resum = lambda vector: aggregate(one._replace(vectors=[vector]), flight, state)[0]  # noqa: E731
        return one.vectors[0], lambda vector: resum(vector).totals[0], split

    totals, count = guard.guarded_totals(
        result.totals, as_one, axis_name, sharded=grads.shards is not None
    )
    flight = flight._replace(result=result._replace(totals=totals), gain=jnp.ones((), jnp.float32))
    return _finished(flight, count, auto_after, state)


def _finished(flight: InFlight, count, auto_after, state: AggregateState):
    """The flight with the summed count and the policy's skip flag, and the new state (a method
    state that overflowed keeps its last finite value under ``"zero"``)."""
    method_state = flight.result.method_state
    if flight.policy == "zero":  # overflowed (PowerSGD's Q): the last finite value
        method_state = guard.finite_or_old(state.method_state, method_state)
    auto = auto_after(flight.gain) if auto_after is not None else state.auto
    flight = flight._replace(nonfinite=count, skipped=guard.skip_flag(flight.policy, count))
    return flight, AggregateState(method_state, auto)


def _sum_plain(flight: InFlight, axis_name) -> InFlight:
    """The leaves ``mask=`` and ``min_size=`` leave out, summed as they are (their non-finite
    entries as 0) in one all-reduce, written into the update; their counts join the flight's.
    Written before the skip flag is known, so a skipped step does not zero them (as of 0.1;
    :func:`jaxcomp.skip_nonfinite` and ``data_parallel`` zero every update of a skipped step)."""
    grads = flight.grads
    if not grads.layout.plain:
        return flight
    counts = list(flight.counts)
    parts = []
    for i in grads.layout.plain:
        values, count = guard.finite(grads.leaves[i])
        parts.append(values)
        counts.append(count)
    groups = grads.groups
    total, plain_bytes, plain_kept = mask.sum_plain(
        parts,
        axis_name,
        groups.n_devices,
        groups.dtype_bytes,
        grads.comm_dtype,
        grads.shards,
    )
    (total,), overflowed = guard.finite_totals([total])  # (a few small leaves)
    counts.append(overflowed / guard.total_copies(axis_name, grads.shards is not None))
    packing.write(
        flight.out, grads.leaves, grads.layout.plain, total, grads.scale, None, grads.shards
    )
    return flight._replace(counts=counts, plain=(plain_bytes, plain_kept))


def _filled(groups: Groups, vectors) -> Groups:
    """``groups`` holding ``vectors`` (one per group) and their sizes."""
    return groups._replace(vectors=vectors, sizes=[v.shape[0] for v in vectors])


def _as_sent(vectors, result: Aggregation) -> list:
    """``vectors`` (per group), each replaced by the one the collectives read where that is the
    same array made to wait for the bucket before (``bucket_mb=``): used after the aggregation
    instead of the original, it needs no copy."""
    if result.vectors is None:
        return vectors
    return [s if s.dtype == v.dtype else v for v, s in zip(vectors, result.vectors)]


def _narrowest(comm_dtype, methods):
    """The dtype whose largest value bounds the sums: the collectives' dtype, or a narrower one
    that a method sums in on the wire (:attr:`jaxcomp.methods.Method.wire_dtype`)."""
    dtypes = [jnp.dtype(comm_dtype)] + [jnp.dtype(m.wire_dtype) for m in methods if m.wire_dtype]
    return min(dtypes, key=lambda d: float(jnp.finfo(d).max))


def _dense(totals) -> list:
    """The totals as dense vectors, each part of :class:`~jaxcomp.ops.pieces.Pieces` on its own
    (a sparse total built only where something reads every entry: the rare step whose energies
    allow an overflow)."""
    parts = [p for t in totals for p in (t.parts if isinstance(t, pieces.Pieces) else [t])]
    return [t.dense() if isinstance(t, scatter.SparseTotal) else t for t in parts]


def _dropped(total):
    """The total with its non-finite entries as 0 (a sparse total drops them as it is written)."""
    if isinstance(total, scatter.SparseTotal):
        return total.dropped()
    return pieces.each(flat.dropped, total)
