"""Compression-aware collectives: sparse, quantized and ZFP-compressed all-reduce in ``shard_map``.

Every collective here is called inside :func:`jax.shard_map` on a named mesh axis, takes this
device's local 1-D vector ``x`` and has :func:`jax.lax.psum` (sum) semantics. Each returns
``(total, sent)``:

* ``total``: the aggregate, bit-identical on every device of the axis;
* ``sent``: this device's own contribution as the aggregate saw it, a dense vector of ``x``'s
  shape and dtype, so that error feedback is exactly ``x - sent`` (each function says what that
  means for its compression).

Shapes and every Python argument are static; what changes from step to step (the STAR leader's
``step``, the quantizer's ``key``) is a traced argument, so one compilation serves every step.

Dense sums and top-k values cross the wire in ``x``'s dtype (ZFP words, integer codes and
bfloat16 bits in their own); everything summed locally (scatter-adds, decoded chunks) is
accumulated in float32 and returned in ``x``'s dtype. The bytes each puts on the wire are
counted by the method that uses it (:meth:`jaxcomp.methods.Method.wire_bytes`), from the same
sizes (:mod:`jaxcomp.collectives.sizes`).

Typing under ``check_vma=True``: every ``total`` is invariant (replicated) over the axis, except
``zfp_allreduce(..., algorithm="recursive_doubling")``, whose result comes out of point-to-point
``ppermute`` exchanges and is typed varying although it is bit-identical on every device. Every
``sent`` is varying.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives import quantized, sizes
from jaxcomp.ops import _checks, _ffi
from jaxcomp.ops._checks import check_choice as _check_choice
from jaxcomp.ops.topk import threshold_topk, topk
from jaxcomp.ops.zfp import zfp_decode, zfp_encode

#: Top-k selectors: exact :func:`jaxcomp.topk` or MSTopK :func:`jaxcomp.threshold_topk`.
SELECTORS = ("exact", "threshold")

#: AR-Topk leader rules: round-robin by step (STAR) or largest local top-k norm (VAR).
LEADERS = ("star", "var")

#: Point-to-point algorithms of :func:`zfp_allreduce`.
ZFP_ALGORITHMS = ("ring", "recursive_doubling")

#: Algorithms of :func:`bfloat16_allreduce`: by platform, or one of the two everywhere.
BFLOAT16_ALGORITHMS = ("auto", "ring", "psum")


# ----------------------------------------------------------------------------------------------
# Argument checks and small pieces shared by the collectives.


def _axis_size(axis_name, name="axis_name"):
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{name}={axis_name!r} is not an axis of the enclosing shard_map's mesh; call this inside "
            "jax.shard_map and pass one of its mesh axis names"
        ) from None


def _local_vector(x):
    x = _checks.float_array(x, "x")
    if x.ndim != 1:
        raise ValueError(
            f"x must be this device's local 1-D vector, got shape {x.shape}; flatten it first"
        )
    return x


def _one_device_total(x, axis_name):
    """``x`` as the total of a sum over one device: the same values, typed replicated (invariant)
    like every other total, so a step's updates agree on every device of a 1-device mesh too. The
    psum over one device is an identity that XLA removes."""
    return jax.lax.psum(x, axis_name)


def _select(x, k, selector):
    """``(values, indices)`` of this device's top ``k`` of ``x`` by ``selector`` (the ops type
    their results varying like ``x`` themselves)."""
    return (topk if selector == "exact" else threshold_topk)(x, k)


def _scatter_rows(n, indices, values, *, in_range=False):
    """Float32 sum of the sparse rows ``(indices[r], values[r])`` into a dense vector of ``n``.

    Each row's indices are distinct, so every scatter is free of collisions, and rows are added in
    a fixed order: the sum is deterministic (no atomics) and identical wherever the rows are.
    ``in_range``: indices ``>= n`` are dropped (they may repeat: :func:`_localize`'s marker).
    """

    def add_row(row, total):
        update = values[row].astype(jnp.float32)
        if in_range:
            return total.at[indices[row]].add(update, mode="drop")
        return total.at[indices[row]].add(update, unique_indices=True)

    return jax.lax.fori_loop(
        0, indices.shape[0], add_row, _ffi.like_varying(jnp.zeros(n, jnp.float32), indices)
    )


def _localize(indices, row, me):
    """``indices`` relative to row ``me`` (``row`` values each); those outside it become ``row``,
    which a scatter with ``mode="drop"`` drops."""
    local = indices - me * row
    return jnp.where((local >= 0) & (local < row), local, row)


def _scatter_own_row(n, n_devices, me, all_indices, all_values):
    """:func:`_scatter_rows` of the gathered pairs, keeping only this device's row of ``n / N``
    values (sharded training): the same additions in the same order, on fewer entries."""
    row = n // n_devices
    return _scatter_rows(row, _localize(all_indices, row, me), all_values, in_range=True)


def _dense(n, indices, values, dtype):
    return (
        jnp.zeros(n, dtype).at[indices].set(values.astype(dtype), unique_indices=True, mode="drop")
    )


def _sent(n, indices, values, dtype, sparse):
    """A top-k collective's ``sent``: dense, or the ``(indices, values)`` pairs with ``sparse``."""
    return (indices, values.astype(dtype)) if sparse else _dense(n, indices, values, dtype)


# ----------------------------------------------------------------------------------------------
# The collectives.


def psum(x, axis_name):
    """Dense all-reduce: :func:`jax.lax.psum` under the collectives' ``(total, sent)`` interface.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector.
      axis_name: the mesh axis to sum over.

    Returns:
      ``(total, sent)``: the sum over the axis (dtype of ``x``, XLA's all-reduce) and
      ``x`` itself (nothing is lost, so error feedback stays zero).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.psum(x, "data")[0], mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> f(jnp.arange(4.0)).tolist()
      [2.0, 4.0]

    References:
      The dense baseline of Tyagi & Swany, arXiv 2312.02493, Table I (ring and tree all-reduce).
    """
    x = _local_vector(x)
    _axis_size(axis_name)
    return jax.lax.psum(x, axis_name), x


def allgather_topk(x, k, axis_name, selector="exact", *, sparse_sent=False, scatter=False):
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

    Returns:
      ``(total, sent)``: the sum of every device's selected entries (dtype of ``x``), and this
      device's selected entries as a dense vector (so ``x - sent`` is the unselected rest).

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
    x = _local_vector(x)
    n = x.shape[0]
    k = _checks.static_int(k, "k", 1, n)
    selector = _check_choice(selector, "selector", SELECTORS)
    _axis_size(axis_name)
    values, indices = _select(x, k, selector)
    all_values = jax.lax.all_gather(values, axis_name, to="invarying")
    all_indices = jax.lax.all_gather(indices, axis_name, to="invarying")
    if scatter:
        n_devices = _check_rows(n, axis_name)
        total = _scatter_own_row(
            n, n_devices, jax.lax.axis_index(axis_name), all_indices, all_values
        )
    else:
        total = _scatter_rows(n, all_indices, all_values)
    return total.astype(x.dtype), _sent(n, indices, values, x.dtype, sparse_sent)


def _check_rows(n, axis_name):
    """The devices of ``axis_name``, which must split ``n`` values into equal rows."""
    n_devices = _axis_size(axis_name)
    if n % n_devices:
        raise ValueError(
            f"x has {n} values, not {n_devices} rows of equal length to reduce-scatter"
        )
    return n_devices


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
            f"step must be the same on every device of {axis_name!r} (it picks the STAR leader, who must be "
            "one device for all), got a step typed varying over it; pass the replicated training step (e.g. "
            "in_specs=P() for it), not a per-device value"
        )


def _broadcast_indices(indices, is_leader, leader_index, axis_name, how):
    """The leader's indices on every device, typed invariant.

    ``"psum"`` sums leader-masked indices (every other device contributes zeros): an all-reduce of
    ``k`` int32, ``2 (N-1)/N 4k`` bytes on a ring. ``"all_gather"`` gathers every device's indices
    and keeps the leader's row: ``(N-1) 4k`` bytes. In ``benchmarks/collectives.py`` (25M values
    on 8 CPU devices, BENCHMARKS.md) the psum was as fast or faster, within a shared host's noise,
    and it sends less once ``N > 2``: :func:`ar_topk` uses it.
    """
    if how == "psum":
        return jax.lax.psum(jnp.where(is_leader, indices, 0), axis_name)
    return jax.lax.all_gather(indices, axis_name, to="invarying")[leader_index]


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
    _broadcast="psum",
):
    """AR-Topk: one leader's top-k indices for everyone, then one all-reduce of ``k`` values.

    The leader selects its ``k`` largest-magnitude entries; the indices reach every device (an
    all-reduce of leader-masked indices, see :func:`_broadcast_indices`); each device takes its own
    values at those indices; a :func:`jax.lax.psum` of the ``k`` values sums them; every device
    scatters the sum into a dense vector.

    * STAR: the leader is ``step mod N`` (round-robin). Only the leader runs the top-k kernel.
    * VAR: the leader is the device whose local top-k values have the largest squared norm, agreed
      by an all-gather of one float32 per device (ties: the lowest axis index).

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      k: static int, ``1 <= k <= n``.
      axis_name: the mesh axis to sum over.
      leader: ``"star"`` or ``"var"``.
      step: integer scalar, the training step (STAR only); pass it traced so every step reuses one
        compilation.
      selector: ``"exact"`` (:func:`jaxcomp.topk`) or ``"threshold"`` (:func:`jaxcomp.threshold_topk`).
      sparse_sent: return ``sent`` as ``(indices, values)``, the pairs whose dense form it is
        (index ``>= n`` marks padding, value 0), so that error feedback can zero those entries in
        place instead of building and subtracting a dense vector: one pass less over the gradient.
      scatter: sharded training: ``x`` is ``N`` rows of equal length and ``total`` is only this
        device's row of the sum (the summed values whose indices fall in it).

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
    x = _local_vector(x)
    n = x.shape[0]
    k = _checks.static_int(k, "k", 1, n)
    leader = _check_choice(leader, "leader", LEADERS)
    selector = _check_choice(selector, "selector", SELECTORS)
    if leader == "star":
        _check_step_replicated(step, axis_name)
    n_devices = _axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    if leader == "star":
        leader_index = _check_step(step).astype(jnp.int32) % n_devices
        is_leader = me == leader_index
        # Only the leader's indices are used: the others skip the kernel.
        indices = jax.lax.cond(
            is_leader,
            lambda v: _select(v, k, selector)[1],
            lambda v: _ffi.like_varying(jnp.zeros(k, jnp.int32), v),
            x,
        )
    else:
        values, indices = _select(x, k, selector)
        norms = jax.lax.all_gather(
            jnp.sum(jnp.square(values.astype(jnp.float32))), axis_name, to="invarying"
        )
        leader_index = jnp.argmax(norms)  # the first maximum: every device agrees
        is_leader = me == leader_index
    shared = _broadcast_indices(indices, is_leader, leader_index, axis_name, _broadcast)
    values = x[shared]
    summed = jax.lax.psum(values, axis_name)
    if scatter:
        row = n // _check_rows(n, axis_name)
        total = (
            jnp.zeros(row, x.dtype)
            .at[_localize(shared, row, me)]
            .set(summed.astype(x.dtype), mode="drop")
        )
    else:
        total = _dense(n, shared, summed, x.dtype)
    return total, _sent(n, shared, values, x.dtype, sparse_sent)


def hierarchical_topk(x, k, inner_axis, outer_axis, selector="exact", *, sparse_sent=False):
    """HiTopKComm: reduce-scatter in the node, top-k per shard, all-gathers across and inside nodes.

    On a 2-D mesh (``outer_axis`` = nodes, ``inner_axis`` = the ``I`` devices of a node):

    1. :func:`jax.lax.psum_scatter` inside the node: device ``i`` holds the node's sum of shard
       ``i`` (``s = ceil(n / I)`` values; ``x`` is zero-padded to ``I s``).
    2. Each device keeps the ``k_s = ceil(k / I)`` largest-magnitude entries of its shard, so a node
       keeps ``I k_s >= k`` entries in all. ``k_s <= s`` always (``k <= n``), so ``k`` may exceed
       a shard; padding entries that get selected are zeros and are dropped.
    3. :func:`jax.lax.all_gather` across nodes of the ``k_s`` (value, index) pairs.
    4. :func:`jax.lax.all_gather` inside the node of the ``O k_s`` pairs each device now holds;
       every device scatter-adds all pairs, node by node, in float32.

    ``sent`` (what keeps error feedback exact): the pairs a node sends are its node-summed gradient
    at the node's selected index set ``J`` (the union of its devices' shard selections), so each
    device's own contribution is ``x`` restricted to ``J``: ``sent = where(index in J, x, 0)``.
    Summed over all devices, ``sent`` equals ``total`` up to float rounding, and ``x - sent`` is
    exactly what this device's gradient lost.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      k: static int, ``1 <= k <= n``: entries kept per node (rounded up to a multiple of the node
        size).
      inner_axis: the mesh axis of devices inside a node.
      outer_axis: the mesh axis of nodes.
      selector: ``"exact"`` (:func:`jaxcomp.topk`) or ``"threshold"`` (MSTopK, the paper's choice).
      sparse_sent: return ``sent`` as ``(indices, values)``, the pairs whose dense form it is
        (index ``>= n`` marks padding, value 0), so that error feedback can zero those entries in
        place instead of building and subtracting a dense vector: one pass less over the gradient.

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
    x = _local_vector(x)
    n = x.shape[0]
    k = _checks.static_int(k, "k", 1, n)
    selector = _check_choice(selector, "selector", SELECTORS)
    if inner_axis == outer_axis:
        raise ValueError(
            f"inner_axis and outer_axis must be different mesh axes, got {inner_axis!r} twice"
        )
    inner = _axis_size(inner_axis, "inner_axis")
    outer = _axis_size(outer_axis, "outer_axis")
    shard, k_shard = sizes.hierarchical_shard(n, k, inner)
    padded = jnp.pad(x, (0, inner * shard - n))
    node_shard = jax.lax.psum_scatter(padded, inner_axis, scatter_dimension=0, tiled=True)
    values, indices = _select(node_shard, k_shard, selector)
    indices = indices + jax.lax.axis_index(inner_axis) * shard
    values, indices = (jax.lax.all_gather(a, outer_axis, to="invarying") for a in (values, indices))
    values, indices = (jax.lax.all_gather(a, inner_axis, to="invarying") for a in (values, indices))
    # [inner, outer, k_shard] -> one row per node: a node's shards are disjoint, so its row has
    # distinct indices.
    values, indices = (
        a.transpose(1, 0, 2).reshape(outer, inner * k_shard) for a in (values, indices)
    )
    total = _scatter_rows(inner * shard, indices, values)[:n].astype(x.dtype)
    node_set = indices[jax.lax.axis_index(outer_axis)]
    if sparse_sent:
        # Padding entries (index >= n) carry 0; scatters of them are dropped.
        return total, (
            node_set,
            jnp.where(node_set < n, x[jnp.minimum(node_set, n - 1)], 0).astype(x.dtype),
        )
    in_node_set = jnp.zeros(inner * shard, jnp.bool_).at[node_set].set(True)[:n]
    return total, jnp.where(in_node_set, x, jnp.zeros_like(x))


def zfp_allreduce(x, rate, axis_name, algorithm="ring"):
    """All-reduce with ZFP fixed-rate compression at the collective level, from point-to-point steps.

    ``"ring"``: the vector is zero-padded into ``N`` chunks of ``ceil(n/N)`` values. In ``N-1``
    reduce-scatter hops (:func:`jax.lax.ppermute` to the right neighbour) each device compresses the
    chunk it sends once, and the receiver decodes it and adds its own chunk. The owner of each fully
    reduced chunk compresses it once; the all-gather phase then forwards those compressed words
    unchanged (:func:`jax.lax.all_gather` of the words: the ring all-gather with no recompression),
    and every device, the owner included, decodes the same words, so ``total`` is identical
    everywhere.

    ``"recursive_doubling"``: with ``p`` the largest power of two ``<= N`` and ``r = N - p``, the
    first ``2r`` devices fold pairwise (even sends its compressed vector to odd, which adds it);
    ``p`` devices then run ``log2 p`` rounds, each exchanging the compressed partial sum with the
    partner at distance ``1, 2, 4, ...`` and adding both decoded vectors (each device uses the
    decoded version of its own words, so partners stay bit-identical); finally the partners send the
    compressed result back to the folded devices and every device decodes those same words.

    ``sent`` for the ring: ``x`` less every codec error this device made. Each device codes each
    chunk exactly once (its own chunk raw at the first hop, a partial sum at each later hop, the
    chunk it owns once fully reduced), and ``total`` is the exact sum less all those errors, so
    the ``sent`` of all devices add up to ``total`` (up to float32 rounding) and error feedback,
    ``x - sent``, feeds back everything the ring lost, re-coded partial sums included. Feeding
    back only the first hop's error (each device's own vector coded alone) keeps an error that
    was never made on the chunks a device did not send raw and drops the partial sums' errors;
    on the char-level model of ``benchmarks/quality.py`` that cost held-out loss (BENCHMARKS.md,
    "Training quality"). For recursive doubling ``sent`` is ``x`` decoded as first encoded (the
    first exchange's error; the partial sums' errors are shared by the partners and fed back by
    none). With ``N = 1`` nothing is sent or compressed: ``total = sent = x``.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      rate: static int in ``[1, 32]``, ZFP bits per value on the wire.
      axis_name: the mesh axis to sum over.
      algorithm: ``"ring"`` or ``"recursive_doubling"``.

    Returns:
      ``(total, sent)`` of ``x``'s shape and dtype (sums in float32). Under ``check_vma=True`` the
      ring's ``total`` is typed invariant; recursive doubling's is typed varying (it comes from
      ``ppermute``) although its value is the same on every device.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.zfp_allreduce(x, 16, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> bool(jnp.allclose(f(jnp.arange(8.0)), jnp.array([4.0, 6.0, 8.0, 10.0]), atol=1e-2))
      True

    References:
      "GPU compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III-C..F and
      Alg. 1-2; Lindstrom, IEEE TVCG 2014 (zfp fixed-rate mode).
    """
    x = _local_vector(x)
    rate = _checks.check_rate(rate)
    algorithm = _check_choice(algorithm, "algorithm", ZFP_ALGORITHMS)
    n_devices = _axis_size(axis_name)
    if n_devices == 1:
        return _one_device_total(x, axis_name), x
    values = x.astype(jnp.float32)
    if algorithm == "ring":
        total, sent = _zfp_ring(values, rate, axis_name, n_devices)
    else:
        total, sent = _zfp_recursive_doubling(values, rate, axis_name, n_devices)
    return total.astype(x.dtype), sent.astype(x.dtype)


class _Codec(NamedTuple):
    """What each hop of :func:`_ring` sends: ``encode(values)`` turns a float32 chunk into its
    message (what crosses the wire); ``decode(message, length)`` turns a message, or a stack of
    them, back into float32 values, ``length`` a message."""

    encode: Callable
    decode: Callable


def _zfp_codec(rate):
    return _Codec(
        lambda values: zfp_encode(values, rate),
        lambda words, length: zfp_decode(words, length, rate),
    )


def _bfloat16_bits(values):
    return jax.lax.bitcast_convert_type(values.astype(jnp.bfloat16), jnp.uint16)


def _from_bfloat16_bits(bits, length):
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


#: bfloat16 values sent as their 16 bits, typed uint16: XLA:CPU's collectives carry a bfloat16
#: payload as float32 (4 bytes a value), an integer one as it is.
_BFLOAT16_BITS = _Codec(_bfloat16_bits, _from_bfloat16_bits)


def _ring(values, axis_name, n_devices, codec, *, own=1, scatter=False, code_owned=True):
    """A ring all-reduce of float32 ``values`` whose every message is coded by ``codec``:
    ``(total, sent)``.

    The vector is zero-padded into ``N`` chunks. In ``N - 1`` reduce-scatter hops each device
    sends the chunk it holds, coded, to its right neighbour, which decodes it and adds its own
    chunk; device ``d`` ends owning chunk ``(d + own) mod N`` fully reduced, codes it once, and the
    all-gather forwards those messages unchanged, so every device decodes the same ones and
    ``total`` is identical everywhere (typed invariant). ``scatter``: stop after the reduce-scatter
    and return the owned chunk as ``total``, coded and decoded with ``code_owned`` (then it is
    the all-reduce's row bit for bit, for the same ``own``), else exactly as reduced.

    ``sent``: the values less every coding error this device made (each chunk is coded once by
    each device), so the ``sent`` of all devices add up to ``total`` (to float32 rounding).
    """
    encode, decode = codec
    n = values.shape[0]
    chunk = sizes.ring_chunk(n, n_devices)
    chunks = jnp.pad(values, (0, n_devices * chunk - n)).reshape(n_devices, chunk)
    me = jax.lax.axis_index(axis_name)
    to_right = [(i, (i + 1) % n_devices) for i in range(n_devices)]
    # Device me starts with chunk me + start; the ring then hands it chunk me + start + 1 = me + own
    # fully reduced.
    start = own - 1
    # This device codes each chunk exactly once: chunk `me + start` raw at hop 0, chunk
    # (me + start - t) mod N as a partial sum at hop t, and the chunk it owns once fully reduced
    # (not with scatter and not code_owned). What each coding loses is this device's error on that
    # chunk: the total is the exact sum less every device's errors, so feeding back all of them
    # (not just hop 0's) feeds back all that was lost.
    partial = chunks[(me + start) % n_devices]
    message = encode(partial)
    errors = [partial - decode(message, chunk)]
    for hop in range(n_devices - 1):
        received = jax.lax.ppermute(message, axis_name, to_right)
        partial = decode(received, chunk) + chunks[(me + start - hop - 1) % n_devices]
        if scatter and not code_owned and hop == n_devices - 2:
            errors.append(jnp.zeros_like(partial))  # the owned chunk is kept as it is
            break
        message = encode(partial)  # the next hop's message; after the last hop, the owned chunk
        decoded = decode(message, chunk)
        errors.append(partial - decoded)
    # errors[t] belongs to chunk (me + start - t) mod N, so chunk c's is errors[(me + start - c) mod N].
    lost = jnp.stack(errors)[(me + start - jnp.arange(n_devices)) % n_devices]
    sent = (chunks - lost).reshape(-1)[:n]
    if scatter:
        return (decoded if code_owned else partial), sent
    owned = jax.lax.all_gather(message, axis_name, to="invarying")
    if own % n_devices:
        # Row j of the gathered messages is chunk (j + own) mod N: reorder the messages (fewer
        # bytes than the decoded floats), not the decoded floats.
        owned = owned[(np.arange(n_devices) - own) % n_devices]
    return decode(owned, chunk).reshape(-1)[:n], sent


def _zfp_ring(values, rate, axis_name, n_devices, scatter=False):
    """The ZFP ring: ``(total, sent)``; with ``scatter``, only its reduce-scatter phase, arranged so
    that device ``d`` ends owning chunk ``d``, and ``total`` is that chunk, exactly as reduced
    (not coded again: no all-gather follows). The all-reduce's device ``d`` owns chunk ``d + 1``."""
    return _ring(
        values,
        axis_name,
        n_devices,
        _zfp_codec(rate),
        own=0 if scatter else 1,
        scatter=scatter,
        code_owned=not scatter,
    )


def _zfp_recursive_doubling(values, rate, axis_name, n_devices):
    n = values.shape[0]
    me = jax.lax.axis_index(axis_name)
    p = sizes.power_of_two_below(n_devices)
    extra = n_devices - p
    # Devices 2i (i < extra) fold into 2i + 1; the p remaining devices are renumbered 0..p-1.
    folded = (me < 2 * extra) & (me % 2 == 0)

    def device(rank):
        return 2 * rank + 1 if rank < extra else rank + extra

    own_words = zfp_encode(values, rate)
    partial = values
    if extra:
        received = jax.lax.ppermute(
            own_words, axis_name, [(2 * i, 2 * i + 1) for i in range(extra)]
        )
        partner = (me < 2 * extra) & (me % 2 == 1)
        partial = jnp.where(partner, values + zfp_decode(received, n, rate), values)
    distance = 1
    while distance < p:
        words = zfp_encode(partial, rate)
        received = jax.lax.ppermute(
            words, axis_name, [(device(r), device(r ^ distance)) for r in range(p)]
        )
        both = zfp_decode(jnp.stack([words, received]), n, rate)
        partial = both[0] + both[1]
        distance *= 2
    if extra:
        words = zfp_encode(partial, rate)
        received = jax.lax.ppermute(words, axis_name, [(2 * i + 1, 2 * i) for i in range(extra)])
        partial = zfp_decode(jnp.where(folded, received, words), n, rate)
    return partial, zfp_decode(own_words, n, rate)


def zfp_reduce_scatter(x, rate, axis_name):
    """The reduce-scatter phase of :func:`zfp_allreduce`'s ring: device ``d`` gets chunk ``d`` of the sum.

    ``x`` (``N`` chunks of ``n / N`` values) goes round the ring in ``N - 1`` hops; each hop sends
    one chunk ZFP-coded at ``rate`` bits a value, the receiver decodes it and adds its own chunk.
    After the last hop device ``d`` holds chunk ``d`` fully reduced, which it keeps as it is: no
    all-gather follows, so it is not coded again (one coding error fewer than the all-reduce).

    ``sent``: ``x`` less every coding error this device made (each chunk but its own is coded once
    by it), so the ``sent`` of all devices add up to the sum (up to float32 rounding) and error
    feedback keeps all the ring lost. With ``N = 1``: ``total = sent = x``.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector, ``N`` chunks of equal length.
      rate: static int in ``[1, 32]``, ZFP bits per value on the wire.
      axis_name: the mesh axis to sum over.

    Returns:
      ``(shard, sent)``: chunk ``d`` of the sum (``n / N`` values) and ``x``'s ``sent``.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.zfp_reduce_scatter(x, 16, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P("data")))
      >>> bool(jnp.allclose(f(jnp.arange(8.0)), jnp.array([4.0, 6.0, 8.0, 10.0]), atol=1e-2))
      True

    References:
      "GPU compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III-C (the ring's
      reduce-scatter); Rajbhandari et al., ZeRO, SC 2020 (gradient partitioning).
    """
    x = _local_vector(x)
    rate = _checks.check_rate(rate)
    n_devices = _check_rows(x.shape[0], axis_name)
    if n_devices == 1:
        return x, x
    shard, sent = _zfp_ring(x.astype(jnp.float32), rate, axis_name, n_devices, scatter=True)
    return shard.astype(x.dtype), sent.astype(x.dtype)


def bfloat16_allreduce(x, axis_name, *, scatter=False, algorithm="auto"):
    """All-reduce in bfloat16 that sends 2 bytes a value on every backend.

    XLA:CPU's collectives (gloo on multi-process CPU jobs) carry a bfloat16 all-reduce as float32:
    4 bytes a value on the wire, the dense amount. Moving 16-bit integers needs no arithmetic, so
    on the CPU this sum is a ring built from :func:`jax.lax.ppermute` whose messages are the
    bfloat16 values' bits typed uint16: the vector in ``N`` chunks of ``ceil(n/N)`` values, ``N-1``
    reduce-scatter hops (each device sends its partial sum of one chunk, rounded to bfloat16, to
    its right neighbour, which widens it to float32, adds its own chunk and rounds again for the
    next hop), then device ``d``, owning chunk ``d`` fully reduced, rounds it once to bfloat16 and
    :func:`jax.lax.all_gather` forwards those bits; every device decodes the same bits. It is
    :func:`zfp_allreduce`'s ring with bfloat16 rounding as the codec. Elsewhere (NCCL, TPU
    collectives reduce bfloat16 natively) it is one :func:`jax.lax.psum` of ``x`` cast to
    bfloat16. :func:`jax.lax.platform_dependent` picks when the step is lowered.

    ``sent``, the ring: ``x`` less every rounding this device made (each chunk is rounded once by
    each device), so the ``sent`` of all devices add up to ``total`` (up to float32 rounding) and
    error feedback, ``x - sent``, keeps all the ring lost. The psum: ``x`` rounded to bfloat16 (the
    rounding of the sum itself is fed back by none). With ``N = 1`` nothing is sent: ``total =
    sent = x`` rounded to bfloat16.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector of ``n`` values.
      axis_name: the mesh axis, or tuple of axes, to sum over.
      scatter: sharded training: ``x`` is ``N`` rows of equal length and ``total`` is only this
        device's row of the sum: the ring's reduce-scatter phase (device ``d``'s row, rounded to
        bfloat16 once, the all-reduce's row bit for bit), or one
        :func:`jax.lax.psum_scatter`.
      algorithm: ``"auto"`` (the ring on the CPU, the psum elsewhere), ``"ring"`` or ``"psum"``
        on every platform.

    Returns:
      ``(total, sent)`` in ``x``'s dtype (the ring adds in float32); ``total`` is typed invariant
      (replicated) under ``check_vma=True``; with ``scatter`` it is one row, typed varying.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x: collectives.bfloat16_allreduce(x, "data")[0],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> f(jnp.array([1.0, 2.0, 3.0, 1.0 / 256])).tolist()  # 2 + 1/256 rounds to 2 in bfloat16
      [4.0, 2.0]

    References:
      Kalamkar et al., "A Study of BFLOAT16 for Deep Learning Training", arXiv 1905.12322; the
      ring of "GPU compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III-C.
    """
    x = _local_vector(x)
    algorithm = _check_choice(algorithm, "algorithm", BFLOAT16_ALGORITHMS)
    n_devices = _check_rows(x.shape[0], axis_name) if scatter else _axis_size(axis_name)

    def ring(v):
        # Device d owns chunk d in both forms, and the reduce-scatter rounds it as the all-reduce
        # does: the sharded step's shard is the replicated step's row bit for bit.
        total, sent = _ring(
            v.astype(jnp.float32), axis_name, n_devices, _BFLOAT16_BITS, own=0, scatter=scatter
        )
        return total.astype(v.dtype), sent.astype(v.dtype)

    def psum(v):
        narrow = v.astype(jnp.bfloat16)
        if scatter:
            total = jax.lax.psum_scatter(narrow, axis_name, scatter_dimension=0, tiled=True)
        else:
            total = jax.lax.psum(narrow, axis_name)
        return total.astype(v.dtype), narrow.astype(v.dtype)

    # One device sends nothing: the psum of one is the cast alone.
    if algorithm == "psum" or n_devices == 1:
        return psum(x)
    if algorithm == "ring":
        return ring(x)
    return jax.lax.platform_dependent(x, cpu=ring, default=psum)


def quantized_psum(x, bits, axis_name, key, hadamard=True, *, scatter=False):
    """THC homomorphic quantization: integer codes on a shared grid, summed by one integer psum.

    1. Optionally a randomized Hadamard transform (random signs, then the orthonormal Walsh-Hadamard
       transform in blocks of up to :data:`jaxcomp.collectives.sizes.MAX_HADAMARD_BLOCK`; ``x`` is zero-padded to whole
       blocks; :func:`jaxcomp.hadamard_transform`, a native kernel on CPU) spreads each vector's energy so
       its range shrinks. The signs come from ``key`` (:func:`jaxcomp.ops.hadamard.counter_signs`; the codec is :mod:`jaxcomp.collectives.quantized`),
       which must be the same on every device.
    2. The range ``R`` is agreed by all: :func:`jax.lax.pmax` of the local max magnitudes.
    3. Each value is stochastically rounded onto the ``2**bits`` levels spanning ``[-R, R]`` (noise
       from ``key`` folded with the axis index, :func:`jaxcomp.ops.hadamard.counter_uniform`, so
       every device draws its own): the codes are unbiased.
    4. Because every device uses the same grid, codes add homomorphically: the codes are packed
       into uint32 words, ``32 // w`` to a word with ``w`` the bits of ``N (2**bits - 1)``, so that
       one psum of the words adds every field without carries between fields (4-bit codes on 4
       devices travel in 6-bit fields, 6.4 bits a value); then dequantize and invert the
       transform.

    ``sent`` is this device's own codes dequantized and transformed back, so the ``sent`` of all
    devices sum to ``total`` (up to float rounding) and ``x - sent`` is this device's quantization
    error (zero mean). With ``N = 1`` nothing is sent or quantized: ``total = sent = x``.

    Args:
      x: this device's local 1-D float32, bfloat16 or float16 vector.
      bits: static int in ``[1, jaxcomp.collectives.sizes.MAX_QUANTIZATION_BITS]``, the width of a code.
      axis_name: the mesh axis to sum over.
      key: a ``jax.random`` key, the same on every device (traced; pass a new one each step).
      hadamard: static bool, whether to apply the randomized Hadamard transform.
      scatter: end with a reduce-scatter of the integer codes: ``x`` is ``N`` rows of whole
        Hadamard blocks (:meth:`jaxcomp.Quantized.shard_row`) and ``total`` is this device's row
        of the sum (sharded training).

    Returns:
      ``(total, sent)`` of ``x``'s shape and dtype (computed in float32); with ``scatter``,
      ``total`` is one row. ``E[total]`` is the exact sum.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> from jaxcomp import collectives
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda x, key: collectives.quantized_psum(x, 8, "data", key)[0],
      ...                           mesh=mesh, in_specs=(P("data"), P()), out_specs=P()))
      >>> total = f(jnp.arange(8.0), jax.random.key(0))
      >>> bool(jnp.allclose(total, jnp.array([4.0, 6.0, 8.0, 10.0]), atol=0.2))
      True

    References:
      Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor Homomorphic
      Compression", NSDI 2024.
    """
    x = _local_vector(x)
    bits = _checks.check_bits(bits)
    if not isinstance(hadamard, (bool, np.bool_)):
        raise TypeError(f"hadamard must be a bool, got {hadamard!r}")
    n_devices = _axis_size(axis_name)
    key = _checks.check_key(key, axis_name)
    if n_devices == 1:
        return (x if scatter else _one_device_total(x, axis_name)), x
    if scatter:
        _check_rows(x.shape[0], axis_name)

        def psum(v):
            return jax.lax.psum_scatter(v, axis_name, scatter_dimension=0, tiled=False)
    else:

        def psum(v):
            return jax.lax.psum(v, axis_name)

    return quantized.thc_aggregate(
        x,
        bits,
        key,
        hadamard,
        n_devices,
        jax.lax.axis_index(axis_name),
        pmax=lambda v: jax.lax.pmax(v, axis_name),
        psum=psum,
        scatter=scatter,
    )
