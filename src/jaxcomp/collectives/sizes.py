"""Message layouts: the sizes that the collectives and the byte model share.

One definition of each size (values per ring chunk, per hierarchical shard, codes per packed word,
...), used both by the collectives that build the messages (:mod:`jaxcomp.collectives`,
:mod:`jaxcomp.collectives.quantized`) and by the methods that count their bytes
(:mod:`jaxcomp.methods`), so the two cannot drift apart. Plain Python: importing it loads no JAX.
"""

from __future__ import annotations

import math

from jaxcomp.ops import _checks

#: Bytes of one top-k index on the wire (int32).
INDEX_BYTES = 4

#: Bytes of one float32 scalar on the wire (norms, ranges).
SCALAR_BYTES = 4

#: Bytes of one ZFP word or one packed THC word (uint32).
WORD_BYTES = 4

#: Largest quantization width of :func:`jaxcomp.collectives.quantized_psum`: codes are computed in
#: float32, and 16 bits is already far past THC's useful range (4-8 bits).
MAX_QUANTIZATION_BITS = _checks.MAX_QUANTIZATION_BITS

#: Widest code of a top-k's low-bit values (:class:`jaxcomp.TopK`'s ``value_bits``): SparseLoCo's
#: range. Wider codes save little more beside the 32-bit index each value travels with.
MAX_VALUE_BITS = 4

#: Selected values per float32 scale of a top-k's low-bit values by default
#: (:class:`jaxcomp.TopK`'s ``value_chunk``): the scales add half a bit a value.
DEFAULT_VALUE_CHUNK = 64

#: Largest block of THC's randomized Hadamard transform. The range shrinks more in a larger
#: block, but the transform costs more and a vector pads to whole blocks; 2**14 keeps the padding
#: of a large gradient below 0.1%.
MAX_HADAMARD_BLOCK = 2**14

_TABLE_I = "Tyagi & Swany, arXiv 2312.02493, Table I (collective costs)."


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers, exactly (no floats).

    Args:
      a: the dividend, >= 0.
      b: the divisor, > 0.

    Returns:
      The rounded-up quotient.

    Example:
      >>> ceil_div(7, 2)
      4

    References:
      Used by every chunked layout below (paper 004 §III-C's ring chunks).
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

    References:
      Tyagi & Swany, arXiv 2312.02493, §2-C (the compression ratio ``k / n``).
    """
    if (k is None) == (ratio is None):
        raise ValueError("give exactly one of k and ratio for a top-k method")
    if ratio is not None:
        k = max(1, round(_checks.check_ratio(ratio) * n))
    return _checks.static_int(k, "k", 1, n)


def hierarchical_shard(n: int, k: int, inner_size: int) -> tuple[int, int]:
    """Hierarchical top-k's shard: values per device after the intra-node reduce-scatter, and how
    many of them each device keeps (``ceil(k / inner_size)``, never more than the shard since
    ``k <= n``, so a node keeps at least ``k`` entries in all).

    Args:
      n: values in each device's vector.
      k: entries kept per node.
      inner_size: devices per node.

    Returns:
      ``(shard, k_shard)``.

    Example:
      >>> hierarchical_shard(10, 3, 4)
      (3, 1)

    References:
      Shi et al., MLSys 2021, §3.2 and Alg. 2 (HiTopKComm).
    """
    return ceil_div(n, inner_size), ceil_div(k, inner_size)


def coded_pairs_words(k: int, bits: int, chunk: int) -> int:
    """uint32 words of one device's top-k message with low-bit values
    (:func:`jaxcomp.collectives.value_codes.gather_coded_pairs`): ``k`` int32 indices, ``k``
    codes of ``bits`` bits packed ``32 // bits`` to a word, and one float32 scale per ``chunk``
    values.

    Args:
      k: pairs selected.
      bits: bits per code, 1..:data:`MAX_VALUE_BITS`.
      chunk: values per scale.

    Returns:
      The words one device all-gathers.

    Example:
      >>> coded_pairs_words(100, 2, 64)  # 100 indices, 7 words of 16 codes, 2 scales
      109

    References:
      Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706
      (top-k values sent as 2-bit codes beside their indices).
    """
    return k + ceil_div(k, 32 // bits) + ceil_div(k, chunk)


def ring_chunk(n: int, n_devices: int) -> int:
    """Values per chunk of a ring all-reduce (the vector is zero-padded to ``n_devices`` chunks).

    Args:
      n: values in each device's vector.
      n_devices: devices in the ring.

    Returns:
      ``ceil(n / n_devices)``.

    Example:
      >>> ring_chunk(10, 4)
      3

    References:
      "GPU compression inside MPI_Allreduce with ZFP" (../shared/papers/004), §III-C.
    """
    return ceil_div(n, n_devices)


def power_of_two_below(n_devices: int) -> int:
    """The largest power of two ``<= n_devices``: recursive doubling's core group.

    Args:
      n_devices: devices, >= 1.

    Returns:
      The power of two.

    Example:
      >>> power_of_two_below(6)
      4

    References:
      ../shared/papers/004, §III-E (recursive doubling with a fold for non-powers of two).
    """
    return 1 << (n_devices.bit_length() - 1)


def log2_steps(n_devices: int) -> int:
    """Rounds of a tree or recursive-doubling phase over ``N`` devices: ``ceil(log2 N)``.

    Args:
      n_devices: devices, >= 1.

    Returns:
      The rounds (0 for one device).

    Example:
      >>> log2_steps(8), log2_steps(6), log2_steps(1)
      (3, 3, 0)

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I.
    """
    return math.ceil(math.log2(n_devices)) if n_devices > 1 else 0


def allreduce_bytes(message_bytes: float, n_devices: int, algorithm: str = "ring") -> float:
    """Bytes one device sends in an all-reduce of ``message_bytes``.

    Args:
      message_bytes: bytes of the vector each device contributes.
      n_devices: devices, >= 1.
      algorithm: ``"ring"`` (``2 (N-1)/N M``) or ``"tree"`` (``2 ceil(log2 N) M``: reduce up,
        broadcast down).

    Returns:
      Bytes sent by one device.

    Example:
      >>> allreduce_bytes(1000, 8)
      1750.0

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I.
    """
    if algorithm == "ring":
        return 2.0 * (n_devices - 1) / n_devices * message_bytes
    return 2.0 * log2_steps(n_devices) * message_bytes


def allreduce_steps(n_devices: int, algorithm: str = "ring") -> int:
    """Sequential message steps of one all-reduce.

    Args:
      n_devices: devices, >= 1.
      algorithm: ``"ring"`` (``2(N-1)``) or ``"tree"`` (``2 ceil(log2 N)``).

    Returns:
      The steps (0 for one device).

    Example:
      >>> allreduce_steps(8), allreduce_steps(8, "tree")
      (14, 6)

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I.
    """
    if n_devices == 1:
        return 0
    return 2 * (n_devices - 1) if algorithm == "ring" else 2 * log2_steps(n_devices)


def code_width(bits: int, n_devices: int) -> int:
    """Bits one packed THC field needs: the sum of ``n_devices`` codes of ``bits`` bits, which the
    psum of packed words computes field by field, must not carry into the next field.

    Args:
      bits: bits per code.
      n_devices: devices whose codes are summed.

    Returns:
      The field width, at most 32 (a ValueError names ``bits`` beyond that).

    Example:
      >>> code_width(4, 4)
      6

    References:
      Li et al., THC, NSDI 2024 (homomorphic sums of integer codes).
    """
    largest_sum = n_devices * (2**bits - 1)
    width = largest_sum.bit_length()
    if width > 32:
        raise ValueError(
            f"bits={bits} with {n_devices} devices needs sums up to {largest_sum}, more than 32 "
            "bits hold; lower bits"
        )
    return width


def codes_per_word(bits: int, n_devices: int) -> int:
    """Codes packed into one uint32 word on the wire.

    Args:
      bits: bits per code.
      n_devices: devices whose codes are summed.

    Returns:
      ``32 // code_width(bits, n_devices)``.

    Example:
      >>> codes_per_word(4, 4)
      5

    References:
      Li et al., THC, NSDI 2024.
    """
    return 32 // code_width(bits, n_devices)


def packed_words(length: int, bits: int, n_devices: int) -> int:
    """uint32 words that carry ``length`` codes.

    Args:
      length: codes to carry.
      bits: bits per code.
      n_devices: devices whose codes are summed.

    Returns:
      The number of words.

    Example:
      >>> packed_words(10, 4, 4)
      2

    References:
      Li et al., THC, NSDI 2024.
    """
    return ceil_div(length, codes_per_word(bits, n_devices))


def hadamard_block(n: int) -> int:
    """Block of THC's randomized Hadamard transform for ``n`` values.

    Args:
      n: values in the vector, >= 1.

    Returns:
      The next power of two of ``n``, at most :data:`MAX_HADAMARD_BLOCK`.

    Example:
      >>> hadamard_block(1000), hadamard_block(10**6)
      (1024, 16384)

    References:
      Li et al., THC, NSDI 2024 (the randomized Hadamard rotation).
    """
    return min(1 << (n - 1).bit_length(), MAX_HADAMARD_BLOCK)


def quantized_length(n: int, hadamard: bool) -> int:
    """Integer codes per device in THC.

    Args:
      n: values in the vector.
      hadamard: whether the vector is rotated (then padded to whole blocks).

    Returns:
      ``n``, or ``n`` padded to whole :func:`hadamard_block` blocks.

    Example:
      >>> quantized_length(1000, True), quantized_length(1000, False)
      (1024, 1000)

    References:
      Li et al., THC, NSDI 2024.
    """
    if not hadamard:
        return n
    block = hadamard_block(n)
    return ceil_div(n, block) * block


def reduce_scatter_bytes(message_bytes: float, n_devices: int) -> float:
    """Bytes one device sends in a ring reduce-scatter of ``message_bytes``: ``(N-1)/N M``, half an
    all-reduce (the other half, an all-gather of the same size, is what sharded training moves to
    the parameters).

    Args:
      message_bytes: bytes of the vector each device contributes.
      n_devices: devices, >= 1.

    Returns:
      Bytes sent by one device.

    Example:
      >>> reduce_scatter_bytes(1000, 8)
      875.0

    References:
      Rajbhandari et al., ZeRO, SC 2020, §7 (reduce-scatter plus all-gather is one all-reduce).
    """
    return (n_devices - 1) / n_devices * message_bytes


def reduce_scatter_steps(n_devices: int) -> int:
    """Sequential message steps of a ring reduce-scatter (or all-gather): ``N - 1``.

    Args:
      n_devices: devices, >= 1.

    Returns:
      The steps (0 for one device).

    Example:
      >>> reduce_scatter_steps(8)
      7

    References:
      Tyagi & Swany, arXiv 2312.02493, Table I (half of the ring all-reduce).
    """
    return max(0, n_devices - 1)
