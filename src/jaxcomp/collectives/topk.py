"""Top-k sparsification at the collective level: all-gathered pairs, AR-Topk's one leader's indices
and one all-reduce, and hierarchical top-k (HiTopKComm) on a 2-D mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp.collectives import LEADERS, SELECTORS, sizes
from jaxcomp.collectives._common import (
    all_gather_or_retype,
    axis_size,
    check_rows,
    local_vector,
    psum_or_retype,
)
from jaxcomp.collectives.value_codes import check_value_codes, gather_coded_pairs
from jaxcomp.ops import _checks, _ffi
from jaxcomp.ops._checks import check_choice
from jaxcomp.ops.scatter import SparseTotal
from jaxcomp.ops.topk import merged_indices, threshold_topk, topk


def _select(x, k, selector):
    """``(values, indices)`` of this device's top ``k`` of ``x`` by ``selector`` (the ops type
    their results varying like ``x`` themselves)."""
    return (topk if selector == "exact" else threshold_topk)(x, k)


def _scatter_rows_in_range(n, indices, values):
    """Float32 sum of the sparse rows ``(indices[r], values[r])`` into a dense vector of ``n``, in
    row order (as :meth:`SparseTotal.dense`), where indices ``>= n`` are dropped and may repeat
    (:func:`_localize`'s marker), so no scatter may assume them distinct."""

    def add_row(row, total):
        return total.at[indices[row]].add(values[row].astype(jnp.float32), mode="drop")

    return jax.lax.fori_loop(
        0, indices.shape[0], add_row, _ffi.like_varying(jnp.zeros(n, jnp.float32), indices)
    )


def _localize(indices, row, me):
    """``indices`` relative to row ``me`` (``row`` values each); those outside it become ``row``,
    which a scatter with ``mode="drop"`` drops."""
    local = indices - me * row
    return jnp.where((local >= 0) & (local < row), local, row)


def _scatter_own_row(n, n_devices, me, all_indices, all_values):
    """The gathered pairs summed as the replicated total sums them, keeping only this device's
    row of ``n / N`` values (sharded training): the same additions in the same order, on fewer
    entries."""
    row = n // n_devices
    return _scatter_rows_in_range(row, _localize(all_indices, row, me), all_values)


def _dense(n, indices, values, dtype):
    return SparseTotal(indices, values, n, add=False, dtype=dtype).dense()


def _no_sparse_scatter(sparse_total):
    if sparse_total:
        raise ValueError("sparse_total=True applies to the replicated total, not to scatter=True")


def _sent(n, indices, values, dtype, sparse):
    """A top-k collective's ``sent``: dense, or the ``(indices, values)`` pairs with ``sparse``."""
    return (indices, values.astype(dtype)) if sparse else _dense(n, indices, values, dtype)


def allgather_topk(
    x,
    k,
    axis_name,
    selector="exact",
    *,
    sparse_sent=False,
    scatter=False,
    sparse_total=False,
    value_bits=None,
    value_chunk=sizes.DEFAULT_VALUE_CHUNK,
):
    """Top-k sparsification aggregated by all-gathering ``(values, indices)``.

    Each device selects its ``k`` largest-magnitude entries, every device gathers all ``N k`` pairs
    and scatter-adds them (device by device, in float32) into a dense vector.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      k: static int, entries each device sends, ``1 <= k <= n``.
      axis_name: the mesh axis to sum over.
      selector: ``"exact"`` (:func:`jaxcomp.topk`) or ``"threshold"`` (MSTopK,
        :func:`jaxcomp.threshold_topk`).
      sparse_sent: return ``sent`` as ``(indices, values)``, the pairs whose dense form it is
        (index ``>= n`` marks padding, value 0), so that error feedback can zero those entries in
        place instead of building and subtracting a dense vector: one pass less over the gradient.
      scatter: sharded training: ``x`` is ``N`` rows of equal length and ``total`` is only this
        device's row of the sum (the gathered pairs that fall in it, added in the same order).
      sparse_total: return ``total`` as a :class:`jaxcomp.ops.scatter.SparseTotal` of the
        gathered pairs, never dense here (:func:`jaxcomp.ops.scatter.scatter_leaves` writes it
        into the update's leaves). Not with ``scatter``.
      value_bits: None (values in ``x``'s dtype) or bits per value, 1..4, coded on a float32
        scale per ``value_chunk`` of them (:mod:`jaxcomp.collectives.value_codes`).
      value_chunk: with ``value_bits``, selected values per scale.

    Returns:
      ``(total, sent)``: the sum of every device's selected entries (dtype of ``x``), and this
      device's as the sum saw them, dense: ``x - sent`` is the rest (and any rounding).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.allgather_topk(x, 1, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> f(jnp.array([1.0, 5.0, 3.0, 2.0])).tolist()  # devices hold [1, 5] and [3, 2]
      [3.0, 5.0]

    References:
      Shi et al., MLSys 2021, §3.2 (top-k aggregation with two all-gathers); Tyagi & Swany,
      arXiv 2312.02493, §3-B (AG).
    """
    x = local_vector(x)
    n = x.shape[0]
    k = _checks.static_int(k, "k", 1, n)
    selector = check_choice(selector, "selector", SELECTORS)
    if value_bits is not None:
        value_bits, value_chunk = check_value_codes(value_bits, value_chunk)
    axis_size(axis_name)
    values, indices = _select(x, k, selector)
    if value_bits is None:
        all_values = all_gather_or_retype(values, axis_name)
        all_indices = all_gather_or_retype(indices, axis_name)
    else:
        all_values, all_indices, values = gather_coded_pairs(
            values, indices, value_bits, value_chunk, axis_name
        )
        all_values = all_values.astype(x.dtype)  # what the sum adds, and sent is
    if scatter:
        _no_sparse_scatter(sparse_total)
        n_devices = check_rows(n, axis_name)
        total = _scatter_own_row(
            n, n_devices, jax.lax.axis_index(axis_name), all_indices, all_values
        ).astype(x.dtype)
    else:
        total = SparseTotal(all_indices, all_values, n, dtype=x.dtype)
        total = total if sparse_total else total.dense()
    return total, _sent(n, indices, values, x.dtype, sparse_sent)


def _check_step(step):
    step = jnp.asarray(step)
    if step.ndim != 0 or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(
            f"step must be an integer scalar (a Python int or a traced int array), got "
            f"{step.dtype}{list(step.shape)}"
        )
    return step


def _check_step_replicated(step, axis_name):
    """Refuses a STAR step that differs per device: each device would lead and sum zeros."""
    axes = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
    if axes & _ffi.varying_axes(_check_step(step)):
        raise ValueError(
            f"step must be the same on every device of {axis_name!r} (it picks the STAR leader, "
            "who must be one device for all), got a step typed varying over it; pass the "
            "replicated training step (e.g. in_specs=P() for it), not a per-device value"
        )


def _broadcast_indices(indices, is_leader, leader_index, axis_name, how):
    """The leader's indices on every device, typed invariant.

    ``"psum"`` sums leader-masked indices (every other device contributes zeros): an all-reduce of
    ``k`` int32, ``2 (N-1)/N 4k`` bytes on a ring. ``"all_gather"`` gathers every device's indices
    and keeps the leader's row: ``(N-1) 4k`` bytes. In ``benchmarks/collectives.py`` the psum
    was as fast or faster, within a shared host's noise, and it sends less once ``N > 2``:
    :func:`ar_topk` uses it.
    """
    if how == "psum":
        return psum_or_retype(jnp.where(is_leader, indices, 0), axis_name)
    return all_gather_or_retype(indices, axis_name)[leader_index]


def split_indices(x, k, axis_name, selector="exact"):
    """:func:`ar_topk`'s shared indices under SPLIT: every device's top ``ceil(k / N)``,
    all-gathered and sorted, with each index that repeats marked ``n`` (padding, which every
    scatter drops), so each index is sent and taken off the residual once.

    Args:
      x: this device's local 1-D vector of ``n`` values.
      k: static int, the indices of the whole step, ``1 <= k <= n``.
      axis_name: the mesh axis.
      selector: ``"exact"`` or ``"threshold"``.

    Returns:
      ``N ceil(k / N)`` int32 indices, typed invariant: the gathered ones in increasing order,
      each repeat replaced by ``n`` (:func:`jaxcomp.ops.topk.merged_indices`: the CPU merges
      the devices' ascending lists instead of sorting them).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: split_indices(x, 4, "data"), mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> f(jnp.array([9.0, 0, 0, 8, 9, 7, 0, 0])).tolist()  # picks [0, 3] and [0, 1]
      [0, 4, 1, 3]

    References:
      Tyagi & Swany, arXiv 2312.02493, §3-A (AR-Topk's shared indices; this leader rule is
      jaxcomp's).
    """
    n = x.shape[0]
    each = min(sizes.ceil_div(k, axis_size(axis_name)), n)
    _, mine = _select(x, each, selector)
    return merged_indices(all_gather_or_retype(mine, axis_name).reshape(-1, each), n)


def _star_leader(x, k, step, selector, n_devices, me):
    """STAR: the leader is ``step mod N``; only it runs the top-k kernel. Returns
    ``(leader_index, is_leader, indices)``, the others' indices zeros."""
    leader_index = _check_step(step).astype(jnp.int32) % n_devices
    is_leader = me == leader_index
    # Only the leader's indices are used: the others skip the kernel.
    indices = jax.lax.cond(
        is_leader,
        lambda v: _select(v, k, selector)[1],
        lambda v: _ffi.like_varying(jnp.zeros(k, jnp.int32), v),
        x,
    )
    return leader_index, is_leader, indices


def _var_leader(x, k, axis_name, selector, me):
    """VAR: the leader is the device whose top-k values have the largest squared norm, agreed by
    an all-gather of one float32 per device (ties: the lowest axis index). Returns
    ``(leader_index, is_leader, indices)``."""
    values, indices = _select(x, k, selector)
    norms = jax.lax.all_gather(
        jnp.sum(jnp.square(values.astype(jnp.float32))), axis_name, to="invarying"
    )
    leader_index = jnp.argmax(norms)  # the first maximum: every device agrees
    return leader_index, me == leader_index, indices


def _shared_indices(x, k, axis_name, leader, step, selector, n_devices, me, how):
    """The ``k`` indices every device sums its values at, typed invariant: the STAR or VAR
    leader's, broadcast by ``how`` (:func:`_broadcast_indices`), or SPLIT's
    (:func:`split_indices`)."""
    if leader == "split":
        return split_indices(x, k, axis_name, selector)
    if leader == "star":
        leader_index, is_leader, indices = _star_leader(x, k, step, selector, n_devices, me)
    else:
        leader_index, is_leader, indices = _var_leader(x, k, axis_name, selector, me)
    return _broadcast_indices(indices, is_leader, leader_index, axis_name, how)


def _own_row_of_sum(n, axis_name, me, shared, summed, dtype):
    """Sharded training: row ``me`` of the sum, the summed values whose indices fall in it."""
    row = n // check_rows(n, axis_name)
    return (
        jnp.zeros(row, dtype).at[_localize(shared, row, me)].set(summed.astype(dtype), mode="drop")
    )


def ar_topk(
    x,
    k,
    axis_name,
    leader="star",
    step=0,
    selector="exact",
    *,
    sparse_sent=False,
    scatter=False,
    sparse_total=False,
    _broadcast="psum",
):
    """AR-Topk: one leader's top-k indices for everyone, then one all-reduce of ``k`` values.

    The leader's indices reach every device; each device takes its own values at them, a
    :func:`jax.lax.psum` sums those, and every device scatters the sum into a dense vector.
    Leaders: STAR, ``step mod N`` (only it runs the top-k kernel); VAR, the device whose top-k
    values have the largest norm; SPLIT (jaxcomp's), every device leads ``ceil(k / N)`` of the
    indices (:func:`split_indices`; an index picked twice is sent once, its second slot padding).

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      k: static int, ``1 <= k <= n``.
      axis_name: the mesh axis to sum over.
      leader: ``"star"`` (the paper's rule, the default of this collective), ``"var"`` or
        ``"split"`` (the default of :class:`jaxcomp.TopK` with ``collective="ar"``).
      step: integer scalar, the training step (STAR only); pass it traced so every step reuses one
        compilation.
      selector: ``"exact"`` (:func:`jaxcomp.topk`) or ``"threshold"``
        (:func:`jaxcomp.threshold_topk`).
      sparse_sent: return ``sent`` as ``(indices, values)``, the pairs whose dense form it is
        (index ``>= n`` marks padding, value 0), for error feedback to zero in place.
      scatter: sharded training: ``x`` is ``N`` rows of equal length and ``total`` is only this
        device's row of the sum (the summed values whose indices fall in it).
      sparse_total: return ``total`` as a :class:`jaxcomp.ops.scatter.SparseTotal` (the shared
        indices and the summed values), never built as a dense vector here. Not with ``scatter``.

    Returns:
      ``(total, sent)``: the sum over devices of their values at the leader's indices (zeros
      elsewhere; dtype of ``x``), and ``x`` at those indices as a dense vector, so ``x - sent`` is
      the error fed back (Alg. 1's residual).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x, s: collectives.ar_topk(x, 1, "data", step=s)[0],
      ...                           mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
      >>> x = jnp.array([1.0, 5.0, 3.0, 2.0])  # devices hold [1, 5] and [3, 2]
      >>> f(x, 0).tolist(), f(x, 1).tolist()  # leader 0 picks index 1, leader 1 index 0
      ([0.0, 7.0], [4.0, 0.0])

    References:
      Tyagi & Swany, "Flexible Communication for Optimal Distributed Learning over Unpredictable
      Networks", arXiv 2312.02493, §3-A/3-B and Alg. 1 (AR-Topk, STAR, VAR).
    """
    x = local_vector(x)
    n = x.shape[0]
    k = _checks.static_int(k, "k", 1, n)
    leader = check_choice(leader, "leader", LEADERS)
    selector = check_choice(selector, "selector", SELECTORS)
    if leader == "star":
        _check_step_replicated(step, axis_name)
    n_devices = axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    shared = _shared_indices(x, k, axis_name, leader, step, selector, n_devices, me, _broadcast)
    values = x.at[shared].get(mode="fill", fill_value=0)
    summed = psum_or_retype(values, axis_name)
    if scatter:
        _no_sparse_scatter(sparse_total)
        total = _own_row_of_sum(n, axis_name, me, shared, summed, x.dtype)
    else:
        total = SparseTotal(shared, summed, n, add=False, dtype=x.dtype)
        total = total if sparse_total else total.dense()
    return total, _sent(n, shared, values, x.dtype, sparse_sent)


def _node_pairs(x, shard, k_shard, selector, axes, axis_sizes):
    """HiTopKComm's exchanges: the node's sum of this device's shard (a reduce-scatter in the
    node), its top ``k_shard``, gathered across nodes then inside the node. Returns
    ``(values, indices)``, ``outer x inner k_shard``: one row per node, of distinct indices
    into ``x`` zero-padded to ``inner shard`` values (``axes``: the inner and the outer axis,
    ``axis_sizes`` their sizes)."""
    (inner_axis, outer_axis), (inner, outer) = axes, axis_sizes
    padded = jnp.pad(x, (0, inner * shard - x.shape[0]))
    node_shard = jax.lax.psum_scatter(padded, inner_axis, scatter_dimension=0, tiled=True)
    values, indices = _select(node_shard, k_shard, selector)
    indices = indices + jax.lax.axis_index(inner_axis) * shard
    values, indices = (all_gather_or_retype(a, outer_axis) for a in (values, indices))
    values, indices = (all_gather_or_retype(a, inner_axis) for a in (values, indices))
    # [inner, outer, k_shard] -> one row per node: a node's shards are disjoint, so its row has
    # distinct indices.
    return tuple(a.transpose(1, 0, 2).reshape(outer, inner * k_shard) for a in (values, indices))


def _node_set_sent(x, node_set, padded_n, sparse_sent):
    """``x`` restricted to the node's selected indices ``node_set`` (``>= n``: padding): this
    device's part of what its node sent, dense or as ``(indices, values)`` pairs."""
    n = x.shape[0]
    if sparse_sent:
        # Padding entries (index >= n) carry 0; scatters of them are dropped.
        return node_set, jnp.where(node_set < n, x[jnp.minimum(node_set, n - 1)], 0).astype(x.dtype)
    in_node_set = jnp.zeros(padded_n, jnp.bool_).at[node_set].set(True)[:n]
    return jnp.where(in_node_set, x, jnp.zeros_like(x))


def hierarchical_topk(x, k, inner_axis, outer_axis, selector="exact", *, sparse_sent=False):
    """HiTopKComm: reduce-scatter in the node, top-k per shard, all-gathers across and inside nodes.

    On a 2-D mesh (``outer_axis`` = nodes, ``inner_axis`` = the ``I`` devices of a node):

    1. :func:`jax.lax.psum_scatter` inside the node: device ``i`` holds the node's sum of shard
       ``i`` (``s = ceil(n / I)`` values; ``x`` is zero-padded to ``I s``).
    2. Each device keeps the ``ceil(k / I)`` largest-magnitude entries of its shard.
    3. :func:`jax.lax.all_gather` of those (value, index) pairs across nodes, then inside the
       node; every device scatter-adds all pairs, node by node, in float32.

    ``sent`` is ``x`` at the node's selected indices, so ``x - sent`` is exactly what this
    device's gradient lost, and the devices' ``sent`` sum to ``total`` up to float rounding.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      k: static int, ``1 <= k <= n``: entries kept per node (rounded up to a multiple of the node
        size).
      inner_axis: the mesh axis of devices inside a node.
      outer_axis: the mesh axis of nodes.
      selector: ``"exact"`` (:func:`jaxcomp.topk`) or ``"threshold"`` (MSTopK, the paper's choice).
      sparse_sent: return ``sent`` as ``(indices, values)``, the pairs whose dense form it is
        (index ``>= n`` marks padding, value 0), for error feedback to zero in place.

    Returns:
      ``(total, sent)``, both of ``x``'s shape and dtype.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("node", "gpu"))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.hierarchical_topk(x, 2, "gpu", "node")[0],
      ...                           mesh=mesh, in_specs=P(("node", "gpu")), out_specs=P()))
      >>> f(jnp.array([1.0, 0.0, 0.0, 1.0, 0.0, 4.0, 3.0, 0.0])).tolist()
      [4.0, 5.0]

    References:
      Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
      Clusters", MLSys 2021, §3.2 and Alg. 2 (HiTopKComm).
    """
    x = local_vector(x)
    n = x.shape[0]
    k = _checks.static_int(k, "k", 1, n)
    selector = check_choice(selector, "selector", SELECTORS)
    if inner_axis == outer_axis:
        raise ValueError(
            f"inner_axis and outer_axis must be different mesh axes, got {inner_axis!r} twice"
        )
    inner = axis_size(inner_axis, "inner_axis")
    outer = axis_size(outer_axis, "outer_axis")
    shard, k_shard = sizes.hierarchical_shard(n, k, inner)
    values, indices = _node_pairs(
        x, shard, k_shard, selector, (inner_axis, outer_axis), (inner, outer)
    )
    total = SparseTotal(indices, values, inner * shard, dtype=jnp.float32).dense()
    total = total[:n].astype(x.dtype)
    node_set = indices[jax.lax.axis_index(outer_axis)]
    return total, _node_set_sent(x, node_set, inner * shard, sparse_sent)
