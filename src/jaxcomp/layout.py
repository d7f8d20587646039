"""Message layouts: the sizes that the collectives and the byte model share.

One definition of each size (values per ring chunk, per hierarchical shard, codes per packed word,
...), used both by the collectives that build the messages (:mod:`jaxcomp.collectives`,
:mod:`jaxcomp.thc`) and by the methods that count their bytes (:mod:`jaxcomp.methods`), so the two
cannot drift apart. Plain Python: importing it loads no JAX.
"""

from __future__ import annotations

import math

from jaxcomp import _checks

#: Bytes of one top-k index on the wire (int32).
INDEX_BYTES = 4

#: Bytes of one float32 scalar on the wire (norms, ranges).
SCALAR_BYTES = 4

#: Bytes of one ZFP word or one packed THC word (uint32).
WORD_BYTES = 4

#: Largest quantization width of :func:`jaxcomp.collectives.quantized_psum`: codes are computed in
#: float32, and 16 bits is already far past THC's useful range (4-8 bits).
MAX_QUANTIZATION_BITS = 16

#: Largest block of THC's randomized Hadamard transform. The range shrinks more in a larger
#: block, but the transform costs more and a vector pads to whole blocks; 2**14 keeps the padding
#: of a large gradient below 0.1%.
MAX_HADAMARD_BLOCK = 2**14


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers.

    Example:
      >>> ceil_div(7, 2)
      4
    """
    return -(-a // b)


def resolve_k(n: int, k: int | None, ratio: float | None) -> int:
    """The number of entries a top-k keeps of ``n``: ``k`` itself, or ``max(1, round(ratio * n))``.

    Args:
      n: values in the vector.
      k: entries to keep, or None.
      ratio: fraction to keep in ``(0, 1]``, or None; exactly one of ``k`` and ``ratio``.

    Returns:
      ``k`` in ``[1, n]``.

    Example:
      >>> resolve_k(1000, None, 0.01), resolve_k(1000, 7, None)
      (10, 7)
    """
    if (k is None) == (ratio is None):
        raise ValueError("give exactly one of k and ratio for a top-k method")
    if ratio is not None:
        k = max(1, round(check_ratio(ratio) * n))
    return _checks.static_int(k, "k", 1, n)


def check_ratio(ratio) -> float:
    """``ratio`` as a float in ``(0, 1]``, or a TypeError/ValueError naming it.

    Example:
      >>> check_ratio(0.01)
      0.01
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) and not _is_numpy_number(ratio):
        raise TypeError(f"ratio must be a number in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return ratio


def _is_numpy_number(value) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and value.dtype.kind in "iuf"


def hierarchical_shard(n: int, k: int, inner_size: int) -> tuple[int, int]:
    """``(shard, k_shard)`` of hierarchical top-k: values per device after the intra-node
    reduce-scatter, and how many of them each device keeps. ``k_shard = ceil(k / inner_size)``,
    never more than the shard (since ``k <= n``), so a node keeps at least ``k`` entries in all.

    Example:
      >>> hierarchical_shard(10, 3, 4)
      (3, 1)
    """
    return ceil_div(n, inner_size), ceil_div(k, inner_size)


def ring_chunk(n: int, n_devices: int) -> int:
    """Values per chunk of a ring all-reduce (the vector is zero-padded to ``n_devices`` chunks).

    Example:
      >>> ring_chunk(10, 4)
      3
    """
    return ceil_div(n, n_devices)


def power_of_two_below(n_devices: int) -> int:
    """The largest power of two ``<= n_devices`` (recursive doubling's core group).

    Example:
      >>> power_of_two_below(6)
      4
    """
    return 1 << (n_devices.bit_length() - 1)


def log2_steps(n_devices: int) -> int:
    """``ceil(log2 N)``: rounds of a tree or recursive-doubling phase over ``N`` devices (0 for one).

    Example:
      >>> log2_steps(8), log2_steps(6), log2_steps(1)
      (3, 3, 0)
    """
    return math.ceil(math.log2(n_devices)) if n_devices > 1 else 0


def allreduce_bytes(message_bytes: float, n_devices: int, algorithm: str = "ring") -> float:
    """Bytes one device sends in an all-reduce of ``message_bytes``: ``2 (N-1)/N M`` for a ring,
    ``2 ceil(log2 N) M`` for a tree (reduce up, broadcast down).

    Example:
      >>> allreduce_bytes(1000, 8)
      1750.0
    """
    if algorithm == "ring":
        return 2.0 * (n_devices - 1) / n_devices * message_bytes
    return 2.0 * log2_steps(n_devices) * message_bytes


def allreduce_steps(n_devices: int, algorithm: str = "ring") -> int:
    """Sequential message steps of one all-reduce: ``2(N-1)`` for a ring, ``2 ceil(log2 N)`` for a tree.

    Example:
      >>> allreduce_steps(8), allreduce_steps(8, "tree")
      (14, 6)
    """
    if n_devices == 1:
        return 0
    return 2 * (n_devices - 1) if algorithm == "ring" else 2 * log2_steps(n_devices)


def code_width(bits: int, n_devices: int) -> int:
    """Bits one packed THC field needs: the sum of ``n_devices`` codes of ``bits`` bits, which the
    psum of packed words computes field by field, must not carry into the next field.

    Example:
      >>> code_width(4, 4)
      6
    """
    largest_sum = n_devices * (2**bits - 1)
    width = largest_sum.bit_length()
    if width > 32:
        raise ValueError(
            f"bits={bits} with {n_devices} devices needs sums up to {largest_sum}, more than 32 bits hold; "
            "lower bits")
    return width


def codes_per_word(bits: int, n_devices: int) -> int:
    """Codes packed into one uint32 word on the wire: ``32 // code_width(bits, n_devices)``.

    Example:
      >>> codes_per_word(4, 4)
      5
    """
    return 32 // code_width(bits, n_devices)


def packed_words(length: int, bits: int, n_devices: int) -> int:
    """uint32 words that carry ``length`` codes.

    Example:
      >>> packed_words(10, 4, 4)
      2
    """
    return ceil_div(length, codes_per_word(bits, n_devices))


def hadamard_block(n: int) -> int:
    """Block of THC's randomized Hadamard transform for ``n`` values: the next power of two, at
    most :data:`MAX_HADAMARD_BLOCK`.

    Example:
      >>> hadamard_block(1000), hadamard_block(10**6)
      (1024, 16384)
    """
    return min(1 << (n - 1).bit_length(), MAX_HADAMARD_BLOCK)


def quantized_length(n: int, hadamard: bool) -> int:
    """Integer codes per device: ``n``, or ``n`` padded to whole Hadamard blocks.

    Example:
      >>> quantized_length(1000, True), quantized_length(1000, False)
      (1024, 1000)
    """
    if not hadamard:
        return n
    block = hadamard_block(n)
    return ceil_div(n, block) * block


def check_bits(bits) -> int:
    """``bits`` as an int in ``[1, MAX_QUANTIZATION_BITS]``, or an error naming it.

    Example:
      >>> check_bits(8)
      8
    """
    return _checks.static_int(bits, "bits", 1, MAX_QUANTIZATION_BITS)


def check_choice(value, name: str, choices):
    """``value`` if it is one of ``choices``, else a ValueError naming ``name`` and the choices.

    Example:
      >>> check_choice("ring", "algorithm", ("ring", "tree"))
      'ring'
    """
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_rate(rate) -> int:
    """ZFP's ``rate`` (bits per value) as an int in ``[1, 32]``, or an error naming it.

    Example:
      >>> check_rate(8)
      8
    """
    return _checks.static_int(rate, "rate", 1, 32)
