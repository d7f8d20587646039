"""The gradients of one :func:`jaxcomp.compress` update as every stage reads them
(:class:`Gradients`, made by :func:`prepare`)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxcomp.optim import _update_checks, packing, readiness
from jaxcomp.optim.config import FeedbackConfig
from jaxcomp.optim.stages import mask
from jaxcomp.optim.stages.aggregation import Groups


class Gradients(NamedTuple):
    """What every stage of one update reads: the gradients and how they are laid out."""

    leaves: list  # the gradients' leaves
    layout: mask.Layout
    groups: Groups  # the groups, their vectors not yet filled in
    rows: list  # per group: values per device row when sharded, else None
    shards: int | None  # sharded training: the devices sharing the shards, else None
    comm_dtype: Any  # the dtype the collectives carry
    scale: float  # 1 / devices for the mean, else 1


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


def _comm_dtype(leaves):
    """The dtype the collectives carry: the gradients' own when they share a 16-bit float, else
    f32."""
    dtypes = {jnp.dtype(leaf.dtype) for leaf in leaves}
    if len(dtypes) == 1 and dtypes <= {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}:
        return dtypes.pop()
    return jnp.dtype(jnp.float32)
