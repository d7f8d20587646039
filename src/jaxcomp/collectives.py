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

Dense sums and top-k values cross the wire in ``x``'s dtype (ZFP words and integer codes in their
own); everything summed locally (scatter-adds, decoded chunks) is accumulated in float32 and
returned in ``x``'s dtype. :func:`bytes_sent` gives the bytes each device puts on the wire for each
method, computed from the same algorithm.

Typing under ``check_vma=True``: every ``total`` is invariant (replicated) over the axis, except
``zfp_allreduce(..., algorithm="recursive_doubling")``, whose result comes out of point-to-point
``ppermute`` exchanges and is typed varying although it is bit-identical on every device. Every
``sent`` is varying.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import _checks, _ffi
from jaxcomp.hadamard import counter_signs, counter_uniform
from jaxcomp.hadamard import hadamard_transform as hadamard_op
from jaxcomp.topk import threshold_topk, topk
from jaxcomp.zfp import _check_rate, zfp_decode, zfp_encode, zfp_num_words

#: The collectives :func:`bytes_sent` knows, by function name.
METHODS = ("psum", "allgather_topk", "ar_topk", "hierarchical_topk", "zfp_allreduce", "quantized_psum")

#: Top-k selectors: exact :func:`jaxcomp.topk` or MSTopK :func:`jaxcomp.threshold_topk`.
SELECTORS = ("exact", "threshold")

#: AR-Topk leader rules: round-robin by step (STAR) or largest local top-k norm (VAR).
LEADERS = ("star", "var")

#: All-reduce algorithms the byte model knows for ``psum``-based steps.
PSUM_ALGORITHMS = ("ring", "tree")

#: Point-to-point algorithms of :func:`zfp_allreduce`.
ZFP_ALGORITHMS = ("ring", "recursive_doubling")

#: Largest quantization width of :func:`quantized_psum`: codes are computed in float32, and 16 bits
#: is already far past THC's useful range (4-8 bits).
MAX_QUANTIZATION_BITS = 16

#: Largest block of the randomized Hadamard transform. The range shrinks more in a larger block, but
#: the transform costs more and a vector pads to whole blocks; 2**14 keeps the padding of a large
#: gradient below 0.1%.
MAX_HADAMARD_BLOCK = 2**14

_INDEX_BYTES = 4  # int32 indices
_SCALAR_BYTES = 4  # float32 norms and ranges
_WORD_BYTES = 4  # uint32 ZFP words


# ----------------------------------------------------------------------------------------------
# Sizes shared by the collectives and the byte model (one definition, so the two cannot drift).

def _ceil_div(a, b):
    return -(-a // b)


def _resolve_k(n, k, ratio):
    """The number of entries to keep: ``k`` itself, or ``max(1, round(ratio * n))``."""
    if (k is None) == (ratio is None):
        raise ValueError("give exactly one of k and ratio for a top-k method")
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float, np.integer, np.floating)):
            raise TypeError(f"ratio must be a number in (0, 1], got {ratio!r}")
        if not 0.0 < float(ratio) <= 1.0:
            raise ValueError(f"ratio must be in (0, 1], got {ratio}")
        k = max(1, round(float(ratio) * n))
    return _checks.static_int(k, "k", 1, n)


def _hierarchical_shard(n, k, inner_size):
    """``(shard, k_shard)``: values per device after the intra-node reduce-scatter, and how many of
    them each device keeps. ``k_shard = ceil(k / inner_size)``, never more than the shard (since
    ``k <= n``), so a node keeps at least ``k`` entries in all."""
    return _ceil_div(n, inner_size), _ceil_div(k, inner_size)


def _ring_chunk(n, n_devices):
    """Values per chunk of the ring all-reduce (the vector is zero-padded to ``n_devices`` chunks)."""
    return _ceil_div(n, n_devices)


def _power_of_two_below(n_devices):
    return 1 << (n_devices.bit_length() - 1)


def _code_width(bits, n_devices):
    """Bits one packed field needs: the sum of ``n_devices`` codes of ``bits`` bits, which the
    psum of packed words computes field by field, must not carry into the next field."""
    largest_sum = n_devices * (2**bits - 1)
    width = largest_sum.bit_length()
    if width > 32:
        raise ValueError(
            f"bits={bits} with {n_devices} devices needs sums up to {largest_sum}, more than 32 bits hold; "
            "lower bits")
    return width


def _codes_per_word(bits, n_devices):
    """Codes packed into one uint32 word on the wire: ``32 // (bits + ceil(log2 N))`` or so."""
    return 32 // _code_width(bits, n_devices)


def _packed_words(length, bits, n_devices):
    """uint32 words that carry ``length`` codes."""
    return _ceil_div(length, _codes_per_word(bits, n_devices))


def _hadamard_block(n):
    """Block of the randomized Hadamard transform: the next power of two, at most the maximum."""
    return min(1 << (n - 1).bit_length(), MAX_HADAMARD_BLOCK)


def _quantized_length(n, hadamard):
    """Integer codes per device: ``n``, or ``n`` padded to whole Hadamard blocks."""
    if not hadamard:
        return n
    block = _hadamard_block(n)
    return _ceil_div(n, block) * block


def _check_bits(bits):
    return _checks.static_int(bits, "bits", 1, MAX_QUANTIZATION_BITS)


def _check_choice(value, name, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


# ----------------------------------------------------------------------------------------------
# The byte model.

def _allreduce_bytes(message_bytes, n_devices, algorithm):
    if algorithm == "ring":
        return 2.0 * (n_devices - 1) / n_devices * message_bytes
    return 2.0 * math.ceil(math.log2(n_devices)) * message_bytes


def bytes_sent(method, n, n_devices, *, k=None, ratio=None, rate=None, bits=None, algorithm=None,
               inner_size=None, dtype_bytes=4, leader="star", hadamard=True):
    """Bytes each device puts on the wire for one call of a collective, from its algorithm.

    What is counted, per method (``N = n_devices``, ``d = dtype_bytes``, indices 4 bytes, ZFP words
    4 bytes; an all-reduce of ``M`` bytes costs ``2 (N-1)/N M`` for ``algorithm="ring"`` and
    ``2 ceil(log2 N) M`` for ``"tree"``; an all-gather of ``M`` bytes per device costs ``(N-1) M``):

    * ``psum``: an all-reduce of ``n d`` bytes.
    * ``allgather_topk``: an all-gather of ``k`` values and ``k`` indices, ``(N-1) k (d+4)``.
    * ``ar_topk``: the leader's indices reach everyone as an all-reduce of ``k`` leader-masked
      int32 indices, then an all-reduce of ``k`` values, both under ``algorithm``; VAR adds the
      all-gather of one float32 norm per device, ``(N-1) 4``.
    * ``hierarchical_topk`` (``I = inner_size`` devices per node, ``O = N / I`` nodes, shard
      ``s = ceil(n/I)``, ``k_s = ceil(k/I)``): a ring reduce-scatter in the node ``(I-1) s d``, an
      all-gather of ``k_s`` pairs across nodes ``(O-1) k_s (d+4)``, an all-gather of the ``O k_s``
      pairs in the node ``(I-1) O k_s (d+4)``.
    * ``zfp_allreduce``: ``"ring"`` sends ``N-1`` compressed chunks in the reduce-scatter and
      forwards ``N-1`` in the all-gather, ``2 (N-1) w`` with ``w`` the bytes of one compressed
      chunk of ``ceil(n/N)`` values; ``"recursive_doubling"`` sends the whole compressed vector
      once per round, ``log2 p`` rounds for ``p`` the largest power of two ``<= N``, plus one more
      when ``N`` is not a power of two (the fold of the extra devices, whose partners send the
      result back). Devices differ there; this is the busiest device, which bounds the time.
    * ``quantized_psum``: an all-reduce of the integer codes (``n`` of them, padded to whole
      Hadamard blocks when ``hadamard``) packed into uint32 words, ``32 // w`` codes a word with
      ``w = bitlength(N (2^bits - 1))`` bits a field (``bits`` plus the headroom the sum of ``N``
      codes needs: 6 bits for 4-bit codes on 4 devices), plus the all-reduce (max) of one float32
      range, both under ``algorithm``.

    With ``N = 1`` nothing crosses a wire and every method costs 0.

    Args:
      method: one of :data:`METHODS`.
      n: values in each device's vector.
      n_devices: devices on the axis (for ``hierarchical_topk``, all devices of both axes).
      k: entries kept by a top-k method; give ``k`` or ``ratio``.
      ratio: fraction kept by a top-k method, ``k = max(1, round(ratio * n))``.
      rate: ZFP bits per value for ``zfp_allreduce``, 1..32.
      bits: code width for ``quantized_psum``, 1..:data:`MAX_QUANTIZATION_BITS`.
      algorithm: ``"ring"`` (default) or ``"tree"`` for ``psum``, ``ar_topk`` and
        ``quantized_psum``; ``"ring"`` (default) or ``"recursive_doubling"`` for ``zfp_allreduce``.
      inner_size: devices per node for ``hierarchical_topk``; must divide ``n_devices``.
      dtype_bytes: bytes per value of the input dtype (4 for float32, 2 for bfloat16/float16).
      leader: ``"star"`` (default) or ``"var"`` for ``ar_topk``.
      hadamard: whether ``quantized_psum`` uses the Hadamard transform (default True).

    Returns:
      Bytes sent by one device, a float.

    Example:
      >>> from jaxcomp.collectives import bytes_sent
      >>> bytes_sent("psum", 1000, 8)
      7000.0
      >>> bytes_sent("allgather_topk", 1000, 8, ratio=0.01)
      560.0

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I and Eqn 4a/4b (collective costs, AR-Topk); Shi et
      al., MLSys 2021, §3.2 (HiTopKComm); ../shared/papers/004 §III (ZFP ring and recursive
      doubling); Li et al., THC, NSDI 2024.
    """
    method = _check_choice(method, "method", METHODS)
    n = _checks.static_int(n, "n", 1, _checks.MAX_ROW_LENGTH)
    n_devices = _checks.static_int(n_devices, "n_devices", 1)
    dtype_bytes = _checks.static_int(dtype_bytes, "dtype_bytes", 1, 8)
    uses = {
        "psum": {"algorithm"},
        "allgather_topk": {"k"},
        "ar_topk": {"k", "algorithm", "leader"},
        "hierarchical_topk": {"k", "inner_size"},
        "zfp_allreduce": {"rate", "algorithm"},
        "quantized_psum": {"bits", "algorithm", "hadamard"},
    }[method]
    given = {"k": k is not None or ratio is not None, "rate": rate is not None, "bits": bits is not None,
             "algorithm": algorithm is not None, "inner_size": inner_size is not None,
             "leader": leader != "star", "hadamard": hadamard is not True}
    for name, is_given in given.items():
        if is_given and name not in uses:
            shown = "k/ratio" if name == "k" else name
            raise ValueError(f"{shown} does not apply to method {method!r}")
    if "k" in uses:
        k = _resolve_k(n, k, ratio)
    N = n_devices

    if method == "psum":
        algorithm = _check_choice(algorithm or "ring", "algorithm", PSUM_ALGORITHMS)
        return 0.0 if N == 1 else _allreduce_bytes(n * dtype_bytes, N, algorithm)
    if method == "allgather_topk":
        return float((N - 1) * k * (dtype_bytes + _INDEX_BYTES))
    if method == "ar_topk":
        algorithm = _check_choice(algorithm or "ring", "algorithm", PSUM_ALGORITHMS)
        leader = _check_choice(leader, "leader", LEADERS)
        if N == 1:
            return 0.0
        indices = _allreduce_bytes(k * _INDEX_BYTES, N, algorithm)
        total = indices + _allreduce_bytes(k * dtype_bytes, N, algorithm)
        if leader == "var":
            total += (N - 1) * _SCALAR_BYTES
        return total
    if method == "hierarchical_topk":
        if inner_size is None:
            raise ValueError("inner_size (devices per node) is required for 'hierarchical_topk'")
        inner = _checks.static_int(inner_size, "inner_size", 1, N)
        if N % inner:
            raise ValueError(f"inner_size ({inner}) must divide n_devices ({N})")
        outer = N // inner
        shard, k_shard = _hierarchical_shard(n, k, inner)
        pair = dtype_bytes + _INDEX_BYTES
        return float((inner - 1) * shard * dtype_bytes + (outer - 1) * k_shard * pair
                     + (inner - 1) * outer * k_shard * pair)
    if method == "zfp_allreduce":
        if rate is None:
            raise ValueError("rate is required for 'zfp_allreduce'")
        rate = _check_rate(rate)
        algorithm = _check_choice(algorithm or "ring", "algorithm", ZFP_ALGORITHMS)
        if N == 1:
            return 0.0
        if algorithm == "ring":
            return float(2 * (N - 1) * zfp_num_words(_ring_chunk(n, N), rate) * _WORD_BYTES)
        p = _power_of_two_below(N)
        rounds = p.bit_length() - 1 + (1 if p != N else 0)
        return float(rounds * zfp_num_words(n, rate) * _WORD_BYTES)
    # quantized_psum
    if bits is None:
        raise ValueError("bits is required for 'quantized_psum'")
    bits = _check_bits(bits)
    algorithm = _check_choice(algorithm or "ring", "algorithm", PSUM_ALGORITHMS)
    if not isinstance(hadamard, (bool, np.bool_)):
        raise TypeError(f"hadamard must be a bool, got {hadamard!r}")
    if N == 1:
        return 0.0
    codes = _packed_words(_quantized_length(n, bool(hadamard)), bits, N) * _WORD_BYTES
    return _allreduce_bytes(codes, N, algorithm) + _allreduce_bytes(_SCALAR_BYTES, N, algorithm)


# ----------------------------------------------------------------------------------------------
# Argument checks and small pieces shared by the collectives.

def _axis_size(axis_name, name="axis_name"):
    try:
        return jax.lax.axis_size(axis_name)
    except NameError:
        raise ValueError(
            f"{name}={axis_name!r} is not an axis of the enclosing shard_map's mesh; call this inside "
            "jax.shard_map and pass one of its mesh axis names") from None


def _local_vector(x):
    x = _checks.float_array(x, "x")
    if x.ndim != 1:
        raise ValueError(f"x must be this device's local 1-D vector, got shape {x.shape}; flatten it first")
    return x


# Kept under these names for the modules that import them (train, transform).
_varying_axes = _ffi.varying_axes
_like_varying = _ffi.like_varying


def _select(x, k, selector):
    """``(values, indices)`` of this device's top ``k`` of ``x`` by ``selector``."""
    op = topk if selector == "exact" else threshold_topk
    values, indices = op(x, k)
    return _like_varying(values, x), _like_varying(indices, x)


def _encode(values, rate):
    return _like_varying(zfp_encode(values, rate), values)


def _decode(words, n, rate):
    return _like_varying(zfp_decode(words, n, rate), words)


def _scatter_rows(n, indices, values):
    """Float32 sum of the sparse rows ``(indices[r], values[r])`` into a dense vector of ``n``.

    Each row's indices are distinct, so every scatter is free of collisions, and rows are added in
    a fixed order: the sum is deterministic (no atomics) and identical wherever the rows are.
    """
    def add_row(row, total):
        return total.at[indices[row]].add(values[row].astype(jnp.float32), unique_indices=True)
    return jax.lax.fori_loop(0, indices.shape[0], add_row, jnp.zeros(n, jnp.float32))


def _dense(n, indices, values, dtype):
    return jnp.zeros(n, dtype).at[indices].set(values.astype(dtype), unique_indices=True, mode="drop")


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


def allgather_topk(x, k, axis_name, selector="exact", *, sparse_sent=False):
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
    total = _scatter_rows(n, all_indices, all_values).astype(x.dtype)
    return total, _sent(n, indices, values, x.dtype, sparse_sent)


def _check_step(step):
    step = jnp.asarray(step)
    if step.ndim != 0 or not jnp.issubdtype(step.dtype, jnp.integer):
        raise TypeError(f"step must be an integer scalar (a Python int or a traced int array), got "
                        f"{step.dtype}{list(step.shape)}")
    return step


def _check_step_replicated(step, axis_name):
    """Refuses a STAR step that differs per device: each device would lead and sum zeros."""
    axes = set(axis_name) if isinstance(axis_name, (tuple, list)) else {axis_name}
    if axes & _varying_axes(_check_step(step)):
        raise ValueError(
            f"step must be the same on every device of {axis_name!r} (it picks the STAR leader, who must be "
            "one device for all), got a step typed varying over it; pass the replicated training step (e.g. "
            "in_specs=P() for it), not a per-device value")


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


def ar_topk(x, k, axis_name, leader="star", step=0, selector="exact", *, sparse_sent=False, _broadcast="psum"):
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
            lambda v: _like_varying(jnp.zeros(k, jnp.int32), v),
            x)
    else:
        values, indices = _select(x, k, selector)
        norms = jax.lax.all_gather(jnp.sum(jnp.square(values.astype(jnp.float32))), axis_name, to="invarying")
        leader_index = jnp.argmax(norms)  # the first maximum: every device agrees
        is_leader = me == leader_index
    shared = _broadcast_indices(indices, is_leader, leader_index, axis_name, _broadcast)
    values = x[shared]
    total = _dense(n, shared, jax.lax.psum(values, axis_name), x.dtype)
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
        raise ValueError(f"inner_axis and outer_axis must be different mesh axes, got {inner_axis!r} twice")
    inner = _axis_size(inner_axis, "inner_axis")
    outer = _axis_size(outer_axis, "outer_axis")
    shard, k_shard = _hierarchical_shard(n, k, inner)
    padded = jnp.pad(x, (0, inner * shard - n))
    node_shard = jax.lax.psum_scatter(padded, inner_axis, scatter_dimension=0, tiled=True)
    values, indices = _select(node_shard, k_shard, selector)
    indices = indices + jax.lax.axis_index(inner_axis) * shard
    values, indices = (jax.lax.all_gather(a, outer_axis, to="invarying") for a in (values, indices))
    values, indices = (jax.lax.all_gather(a, inner_axis, to="invarying") for a in (values, indices))
    # [inner, outer, k_shard] -> one row per node: a node's shards are disjoint, so its row has
    # distinct indices.
    values, indices = (a.transpose(1, 0, 2).reshape(outer, inner * k_shard) for a in (values, indices))
    total = _scatter_rows(inner * shard, indices, values)[:n].astype(x.dtype)
    node_set = indices[jax.lax.axis_index(outer_axis)]
    if sparse_sent:
        # Padding entries (index >= n) carry 0; scatters of them are dropped.
        return total, (node_set, jnp.where(node_set < n, x[jnp.minimum(node_set, n - 1)], 0).astype(x.dtype))
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

    ``sent`` is ``x`` decoded as first encoded: chunk by chunk for the ring, whole for recursive
    doubling. ``x - sent`` is this device's own codec error at ``rate`` -- exactly the error of what
    leaves the device raw (the ring's first hop, recursive doubling's first exchange); the errors of
    re-encoding partial sums later are shared by the devices and fed back by none. With ``N = 1``
    nothing is sent or compressed: ``total = sent = x``.

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
    rate = _check_rate(rate)
    algorithm = _check_choice(algorithm, "algorithm", ZFP_ALGORITHMS)
    n_devices = _axis_size(axis_name)
    if n_devices == 1:
        return x, x
    values = x.astype(jnp.float32)
    if algorithm == "ring":
        total, sent = _zfp_ring(values, rate, axis_name, n_devices)
    else:
        total, sent = _zfp_recursive_doubling(values, rate, axis_name, n_devices)
    return total.astype(x.dtype), sent.astype(x.dtype)


def _zfp_ring(values, rate, axis_name, n_devices):
    n = values.shape[0]
    chunk = _ring_chunk(n, n_devices)
    chunks = jnp.pad(values, (0, n_devices * chunk - n)).reshape(n_devices, chunk)
    me = jax.lax.axis_index(axis_name)
    to_right = [(i, (i + 1) % n_devices) for i in range(n_devices)]
    # Every chunk coded once: the words error feedback decodes, and hop 0's message (chunk `me`
    # raw, so its words are these).
    own_words = _encode(chunks, rate)
    # Hop t sends chunk (me - t) mod N, summed over t + 1 devices; after N - 1 hops this device
    # holds chunk (me + 1) mod N summed over all.
    words = own_words[me]
    for hop in range(n_devices - 1):
        received = jax.lax.ppermute(words, axis_name, to_right)
        partial = _decode(received, chunk, rate) + chunks[(me - hop - 1) % n_devices]
        if hop < n_devices - 2:
            words = _encode(partial, rate)
    owned_words = jax.lax.all_gather(_encode(partial, rate), axis_name, to="invarying")
    # Row j of the gathered words is chunk (j + 1) mod N: reorder the words (rate/32 of the
    # floats' bytes), not the decoded floats.
    reduced = zfp_decode(owned_words[(np.arange(n_devices) - 1) % n_devices], chunk, rate)
    sent = _decode(own_words, chunk, rate)
    return reduced.reshape(-1)[:n], sent.reshape(-1)[:n]


def _zfp_recursive_doubling(values, rate, axis_name, n_devices):
    n = values.shape[0]
    me = jax.lax.axis_index(axis_name)
    p = _power_of_two_below(n_devices)
    extra = n_devices - p
    # Devices 2i (i < extra) fold into 2i + 1; the p remaining devices are renumbered 0..p-1.
    folded = (me < 2 * extra) & (me % 2 == 0)

    def device(rank):
        return 2 * rank + 1 if rank < extra else rank + extra

    own_words = _encode(values, rate)
    partial = values
    if extra:
        received = jax.lax.ppermute(own_words, axis_name, [(2 * i, 2 * i + 1) for i in range(extra)])
        partner = (me < 2 * extra) & (me % 2 == 1)
        partial = jnp.where(partner, values + _decode(received, n, rate), values)
    distance = 1
    while distance < p:
        words = _encode(partial, rate)
        received = jax.lax.ppermute(words, axis_name, [(device(r), device(r ^ distance)) for r in range(p)])
        both = _decode(jnp.stack([words, received]), n, rate)
        partial = both[0] + both[1]
        distance *= 2
    if extra:
        words = _encode(partial, rate)
        received = jax.lax.ppermute(words, axis_name, [(2 * i + 1, 2 * i) for i in range(extra)])
        partial = _decode(jnp.where(folded, received, words), n, rate)
    return partial, _decode(own_words, n, rate)


def _check_key(key, axis_name):
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not (typed and key.ndim == 0) and not (key.dtype == jnp.uint32 and key.shape == (2,)):
        raise TypeError(f"key must be one jax.random key (jax.random.key or PRNGKey), got "
                        f"{key.dtype}{list(key.shape)}")
    if axis_name is not None and axis_name in _varying_axes(key):
        raise ValueError(f"key must be the same on every device of {axis_name!r} (replicated: all devices "
                         "must apply the same Hadamard transform), got a key that varies over it")
    return key if typed else jax.random.wrap_key_data(key)


def _pack(codes, width):
    """uint32 words holding ``32 // width`` codes each (the last word zero-padded)."""
    per_word = 32 // width
    codes = jnp.pad(codes, (0, _ceil_div(codes.shape[0], per_word) * per_word - codes.shape[0]))
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * np.uint32(width)
    # Fields do not overlap, so the sum is a bitwise or.
    return jnp.sum(codes.reshape(-1, per_word) << shifts, axis=1, dtype=jnp.uint32)


def _unpack(words, width, length):
    per_word = 32 // width
    shifts = jnp.arange(per_word, dtype=jnp.uint32) * np.uint32(width)
    return ((words[:, None] >> shifts) & np.uint32((1 << width) - 1)).reshape(-1)[:length]


def quantized_psum(x, bits, axis_name, key, hadamard=True):
    """THC homomorphic quantization: integer codes on a shared grid, summed by one integer psum.

    1. Optionally a randomized Hadamard transform (random signs, then the orthonormal Walsh-Hadamard
       transform in blocks of up to :data:`MAX_HADAMARD_BLOCK`; ``x`` is zero-padded to whole
       blocks; :func:`jaxcomp.hadamard_transform`, a native kernel on CPU) spreads each vector's energy so
       its range shrinks. The signs come from ``key`` (:func:`jaxcomp.hadamard.counter_signs`),
       which must be the same on every device.
    2. The range ``R`` is agreed by all: :func:`jax.lax.pmax` of the local max magnitudes.
    3. Each value is stochastically rounded onto the ``2**bits`` levels spanning ``[-R, R]`` (noise
       from ``key`` folded with the axis index, :func:`jaxcomp.hadamard.counter_uniform`, so
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
      bits: static int in ``[1, MAX_QUANTIZATION_BITS]``, the width of a code.
      axis_name: the mesh axis to sum over.
      key: a ``jax.random`` key, the same on every device (traced; pass a new one each step).
      hadamard: static bool, whether to apply the randomized Hadamard transform.

    Returns:
      ``(total, sent)`` of ``x``'s shape and dtype (computed in float32). ``E[total]`` is the exact
      sum.

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
    n = x.shape[0]
    bits = _check_bits(bits)
    if not isinstance(hadamard, (bool, np.bool_)):
        raise TypeError(f"hadamard must be a bool, got {hadamard!r}")
    n_devices = _axis_size(axis_name)
    key = _check_key(key, axis_name)
    if n_devices == 1:
        return x, x
    return _thc(x, bits, key, hadamard, n_devices, jax.lax.axis_index(axis_name),
                pmax=lambda v: jax.lax.pmax(v, axis_name), psum=lambda v: jax.lax.psum(v, axis_name))


def quantized_psum_local(x, bits, key, n_devices, hadamard=True):
    """THC's local work alone: :func:`quantized_psum` with its two collectives taken out.

    The transform, rounding, packing and back-transforms of one device out of ``n_devices``,
    with this device's range for the agreed one and its own packed words for their sum; what
    :func:`jaxcomp.probe.codec_seconds` times, since THC has no codec apart from its collective.

    Args:
      x: a 1-D float vector.
      bits: code width, as for :func:`quantized_psum`.
      key: a ``jax.random`` key.
      n_devices: the devices whose sum the packed fields must hold.
      hadamard: as for :func:`quantized_psum`.

    Returns:
      ``(total, sent)`` as :func:`quantized_psum` computes them when this device is alone.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> total, sent = quantized_psum_local(jnp.linspace(-1, 1, 64), 8, jax.random.key(0), 4)
      >>> bool(jnp.allclose(sent, jnp.linspace(-1, 1, 64), atol=0.02))
      True

    References:
      Li et al., THC, NSDI 2024; Agarwal et al., MLSys 2022, App. C (timing the codec on its own).
    """
    x = _local_vector(x)
    bits = _check_bits(bits)
    key = _check_key(key, None)
    n_devices = _checks.static_int(n_devices, "n_devices", 1)
    return _thc(x, bits, key, bool(hadamard), n_devices, 0, pmax=lambda v: v, psum=lambda v: v)


def _thc(x, bits, key, hadamard, n_devices, device, pmax, psum):
    n = x.shape[0]
    width = _code_width(bits, n_devices)
    sign_key, noise_key = jax.random.split(key)
    length = _quantized_length(n, bool(hadamard))
    values = jnp.pad(x.astype(jnp.float32), (0, length - n))
    if hadamard:
        block = _hadamard_block(n)
        signs = counter_signs(sign_key, (length // block, block))
        scale = np.float32(1.0 / math.sqrt(block))

        def transform(v):
            return (hadamard_op(v.reshape(-1, block) * signs) * scale).reshape(-1)

        def inverse(v):
            return (hadamard_op(v.reshape(-1, block)) * scale * signs).reshape(-1)[:n]
    else:
        def transform(v):
            return v

        def inverse(v):
            return v[:n]

    rotated = transform(values)
    bound = pmax(jnp.max(jnp.abs(rotated)))
    levels = 2**bits - 1
    unit = jnp.where(bound > 0, bound, 1.0)  # all-zero input: any grid works, the codes cancel
    position = (rotated / unit + 1.0) * np.float32(levels / 2)  # in [0, levels]
    noise = counter_uniform(jax.random.fold_in(noise_key, device), (length,))
    codes = jnp.clip(jnp.floor(position + noise), 0, levels).astype(jnp.uint32)
    # Codes on one grid add homomorphically, and fields of `width` bits add without carrying into
    # each other: one psum of packed words sums every code.
    summed = _unpack(psum(_pack(codes, width)), width, length)
    step = bound * np.float32(2 / levels)
    total = summed.astype(jnp.float32) * step - n_devices * bound
    sent = codes.astype(jnp.float32) * step - bound
    total, sent = inverse(total), inverse(sent)  # total stays typed invariant: not stacked with sent
    return total.astype(x.dtype), sent.astype(x.dtype)
