"""What flows through one :func:`jaxcomp.compress` update: the gradients as every stage reads
them (:class:`Gradients`, made by :func:`prepare`) and what the stages before the write-back
produced (:class:`Aggregated`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxcomp.optim import _update_checks, packing, pinning, readiness
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import divergence, guard, mask, metrics
from jaxcomp.optim.stages.aggregation import Aggregation, Groups
from jaxcomp.optim.state import CompressState


class Gradients(NamedTuple):
    """What every stage of one update reads: the gradients and how they are laid out."""

    leaves: list  # the gradients' leaves
    layout: mask.Layout
    groups: Groups  # the groups, their vectors not yet filled in
    rows: list  # per group: values per device row when sharded, else None
    shards: int | None  # sharded training: the devices sharing the shards, else None
    comm_dtype: Any  # the dtype the collectives carry
    scale: float  # 1 / devices for the mean, else 1


class Aggregated(NamedTuple):
    """What the stages before the write-back produced."""

    out: list  # the update's leaves, the plain ones written
    result: Aggregation
    auto_after: Callable | None  # gain -> new auto state, or None
    feds: list  # per group: this device's error-fed vector (None on the dense route)
    remainings: list  # per group: g_e - sent, the next residual (None when everything is sent)
    momenta: dict  # leaf -> its new velocity (momentum correction)
    gain: Any  # f32[]
    nonfinite: Any  # f32[]: summed over the devices
    plain_bytes: Any  # bytes of the plain leaves' sum
    plain_kept: int  # values of the plain leaves
    energies: Any = None  # metrics.Energies summed over the devices (with a guardrail)


def prepare(c: FeedbackConfig, branches, leaves, lay: mask.Layout) -> Gradients:
    """The :class:`Gradients` of these gradients, after checking where the update runs."""
    axis_sizes = [_update_checks.bound_axis_size(a) for a in c.axes]
    n_devices = math.prod(axis_sizes)
    shards = _update_checks.shards(c, branches, n_devices)  # sharded training: N, else None
    floats = [leaves[i] for i in lay.floats]
    _update_checks.check_local_gradients(c, floats)
    comm_dtype = _comm_dtype(floats)
    groups = Groups(
        vectors=[],
        names=[name for _, name in lay.groups],
        sizes=[],
        n_devices=n_devices,
        inner_size=axis_sizes[-1] if len(axis_sizes) == 2 else None,
        dtype_bytes=jnp.dtype(comm_dtype).itemsize,
        shapes=[tuple(leaves[i].shape for i in positions) for positions, _ in lay.groups],
        scatter=shards is not None,
        values=[sum(leaves[i].size for i in positions) for positions, _ in lay.groups],
        buckets=None
        if lay.buckets is None
        else readiness.bucket_ranks(
            lay.buckets, [p for p, _ in lay.groups], _ready_order(len(leaves))
        ),
    )
    rows = [
        packing.row(branches, [leaves[i] for i in positions], shards) for positions, _ in lay.groups
    ]
    scale = 1.0 / n_devices if c.mean else 1.0
    return Gradients(leaves, lay, groups, rows, shards, comm_dtype, scale)


def _ready_order(n_leaves: int) -> tuple | None:
    """:func:`jaxcomp.optim.readiness.ready_order`, if it orders these updates' ``n_leaves``
    leaves (an order read from another tree, e.g. before a wrapper reshaped it, is not used)."""
    order = readiness.ready_order()
    return order if order is not None and len(order) == n_leaves else None


def filled(groups: Groups, vectors) -> Groups:
    return groups._replace(vectors=vectors, sizes=[v.shape[0] for v in vectors])


def as_sent(vectors, result: Aggregation) -> list:
    """``vectors`` (per group), each replaced by the one the collectives read where that is the
    same array made to wait for the bucket before (``bucket_mb=``): used after the aggregation
    instead of the original, it needs no copy."""
    if result.vectors is None:
        return vectors
    return [s if s.dtype == v.dtype else v for v, s in zip(vectors, result.vectors)]


def narrowest(comm_dtype, methods):
    """The dtype whose largest value bounds the sums: the collectives' dtype, or a narrower one
    that a method sums in on the wire (:attr:`jaxcomp.methods.Method.wire_dtype`)."""
    dtypes = [jnp.dtype(comm_dtype)] + [jnp.dtype(m.wire_dtype) for m in methods if m.wire_dtype]
    return min(dtypes, key=lambda d: float(jnp.finfo(d).max))


def _comm_dtype(leaves):
    """The dtype the collectives carry: the gradients' own when they share a 16-bit float, else
    f32."""
    dtypes = {jnp.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}:
        return dtypes.pop()
    return jnp.dtype(jnp.float32)


def next_state(
    c, grads: Gradients, done: Aggregated, skipped, state: CompressState, uses_auto, trigger=None
):
    """Stage 7 and the guard's skip: the metrics, and the step, auto, method and guardrail
    states (a skipped step leaves the state as it was; only the metrics report it)."""
    result = done.result
    guarded, fallback, fallbacks = state.divergence, 0.0, 0.0
    if trigger is not None:
        advanced = divergence.advance(c.guardrail, guarded, trigger, *done.energies, done.gain)
        fallback = trigger | divergence.falling_back(guarded)
        guarded = guard.hold(skipped, guarded, advanced)
        fallbacks = guarded.fallbacks
    total_size = sum(grads.leaves[i].size for i in grads.layout.floats)
    step_metrics = metrics.step_metrics(
        done.gain,
        result.bytes_sent + done.plain_bytes,
        result.kept + done.plain_kept,
        result.method,
        done.nonfinite,
        total_size,
        fallback,
        fallbacks,
    )
    new_auto = done.auto_after(done.gain) if done.auto_after is not None else state.auto
    method_state = result.method_state
    if c.nonfinite == "zero":  # overflowed (PowerSGD's Q): the last finite value
        method_state = guard.finite_or_old(state.method_state, method_state)
    return state._replace(
        step=guard.hold(skipped, state.step, state.step + 1),
        metrics=step_metrics,
        auto=guard.hold(skipped, state.auto, new_auto) if uses_auto else None,
        method_state=guard.hold(skipped, state.method_state, method_state),
        divergence=guarded,
        asked=None if state.asked is None else pinning.next_branch(state),
    )
