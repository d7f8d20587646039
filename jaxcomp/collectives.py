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

Values cross the wire in ``x``'s dtype; everything summed locally (scatter-adds, decoded chunks)
is accumulated in float32 and returned in ``x``'s dtype. :func:`bytes_sent` gives the bytes each
device puts on the wire for each method, computed from the same algorithm.

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

from jaxcomp import _checks
from jaxcomp.topk import threshold_topk, topk
from jaxcomp.zfp import zfp_decode, zfp_encode, zfp_num_words

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

#: Largest block of the randomized Hadamard transform. Its range shrinkage grows with the block, its
#: cost is one pass over memory per doubling, and a vector pads to a multiple of the block, so
#: 2**14 keeps padding below 0.1% for large gradients while the range is already near its limit.
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


def _quantization_dtype(bits, n_devices):
    """The narrowest signed integer type that holds the sum of ``n_devices`` codes of ``bits`` bits."""
    largest_sum = n_devices * (2**bits - 1)
    for dtype in (jnp.int8, jnp.int16, jnp.int32):
        if largest_sum <= jnp.iinfo(dtype).max:
            return jnp.dtype(dtype)
    raise ValueError(
        f"bits={bits} with {n_devices} devices needs sums up to {largest_sum}, more than int32 holds; "
        "lower bits")


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


def _check_rate(rate):
    return _checks.static_int(rate, "rate", 1, 32)


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
      Hadamard blocks when ``hadamard``; the integer width from ``bits`` and ``N``) plus the
      all-reduce (max) of one float32 range, both under ``algorithm``.

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
        total = _allreduce_bytes(k * _INDEX_BYTES, N, algorithm) + _allreduce_bytes(k * dtype_bytes, N, algorithm)
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
    codes = _quantized_length(n, bool(hadamard)) * _quantization_dtype(bits, N).itemsize
    return _allreduce_bytes(codes, N, algorithm) + _allreduce_bytes(_SCALAR_BYTES, N, algorithm)
