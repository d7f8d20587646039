"""Pure-JAX reference of the ZFP-style fixed-rate codec, following ``docs/kernels.md`` step by step.

Written for clarity, vectorized over blocks: every block of every row is one entry of a
``[blocks, 4]`` array, the bit-plane coder is a loop over the 32 planes carrying each block's
state, and each block's bits are assembled into a ``[blocks, 128]`` array of 0/1 (the first
``4 * rate`` are the block) that is finally packed into uint32 words. Floating-point values are
handled as their integer bits: XLA on CPU flushes denormals, and the format is defined on the exact
values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops import _checks

_HEADER_BITS = 9
_MAX_BLOCK_BITS = 4 * 32
_NONFINITE_HEADER = 1  # flag 1, exponent field 0: a code zfp never writes
_NONFINITE_KEY = np.uint32(0x7F800000)  # magnitude keys at or above this are +-Inf or NaN
_NONFINITE_ROW_HEADER = 0x100  # rates 1-2
_NEGABINARY_MASK = np.uint32(0xAAAAAAAA)
_SIGN = np.uint32(0x80000000)
# The unary run-length coder of a bit plane, as a state machine taking one step per bit.
_TEST, _SCAN, _DONE = 0, 1, 2
# Steps a plane needs at most: 4 group tests, 4 scan steps, and the test that finds n == 4.
_PLANE_STEPS = 9


def _padded_block_index(n):
    """Indices into a row of n values that make ``ceil(n / 4)`` blocks, padded like zfp's
    pad_block."""
    index = np.arange(-(-n // 4) * 4).reshape(-1, 4)
    valid = n - 4 * (index.shape[0] - 1)  # values in the last block
    last = index[-1].copy()
    if valid == 1:
        last[1:] = last[0]  # p1 = p0, p2 = p1, p3 = p0
    elif valid == 2:
        last[2], last[3] = last[1], last[0]
    elif valid == 3:
        last[3] = last[0]
    index[-1] = last
    return index.reshape(-1)


def _float_bits(x):
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)


def _exponent(max_key):
    """frexp exponent of the largest magnitude, clamped to >= -126: biased exponent - 126."""
    return (max_key >> 23).astype(jnp.int32) - 126


def _quantize(bits, emax):
    """``(int32)(f * 2**(30 - emax))`` (truncation) computed exactly from the float's bits."""
    biased = ((bits >> 23) & 0xFF).astype(jnp.int32)
    fraction = bits & 0x7FFFFF
    mantissa = jnp.where(biased > 0, fraction | 0x800000, fraction)
    # f = mantissa * 2**(max(biased, 1) - 150), so f * 2**(30 - emax) = mantissa * 2**shift.
    shift = jnp.maximum(biased, 1) - 120 - emax
    left = jnp.clip(shift, 0, 31).astype(jnp.uint32)
    right = jnp.clip(-shift, 0, 31).astype(jnp.uint32)
    magnitude = jnp.where(
        shift >= 0, mantissa << left, jnp.where(shift > -32, mantissa >> right, 0)
    )
    magnitude = magnitude.astype(jnp.int32)
    return jnp.where((bits >> 31) == 1, -magnitude, magnitude)


def _dequantize(q, emax):
    """``(float)q * 2**(emax - 30)``, rounded like ldexpf, by editing the float's exponent."""
    bits = lax.bitcast_convert_type(q.astype(jnp.float32), jnp.uint32)
    sign = bits & _SIGN
    exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) + emax - 30
    normal = sign | (jnp.clip(exponent, 1, 254).astype(jnp.uint32) << 23) | (bits & 0x7FFFFF)
    # Denormal result: shift the 24-bit significand right, rounding half to even.
    shift = jnp.clip(1 - exponent, 1, 31).astype(jnp.uint32)
    significand = (bits & 0x7FFFFF) | 0x800000
    kept = significand >> shift
    rest = significand & ((jnp.uint32(1) << shift) - 1)
    half = jnp.uint32(1) << (shift - 1)
    kept = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).astype(jnp.uint32)
    denormal = jnp.where(1 - exponent > 25, sign, sign | kept)
    result = jnp.where(
        exponent >= 255, sign | _NONFINITE_KEY, jnp.where(exponent >= 1, normal, denormal)
    )
    result = jnp.where(q == 0, 0, result)
    return lax.bitcast_convert_type(result, jnp.float32)


def _forward_lift(q):
    x, y, z, w = (q[:, i] for i in range(4))
    x += w
    x >>= 1
    w -= x  # noqa: E702
    z += y
    z >>= 1
    y -= z  # noqa: E702
    x += z
    x >>= 1
    z -= x  # noqa: E702
    w += y
    w >>= 1
    y -= w  # noqa: E702
    w += y >> 1
    y -= w >> 1  # noqa: E702
    return jnp.stack([x, y, z, w], axis=1)


def _inverse_lift(q):
    x, y, z, w = (q[:, i] for i in range(4))
    y += w >> 1
    w -= y >> 1  # noqa: E702
    y += w
    w <<= 1
    w -= y  # noqa: E702
    z += x
    x <<= 1
    x -= z  # noqa: E702
    y += z
    z <<= 1
    z -= y  # noqa: E702
    w += x
    x <<= 1
    x -= w  # noqa: E702
    return jnp.stack([x, y, z, w], axis=1)


def _to_negabinary(q):
    return (q.astype(jnp.uint32) + jnp.uint32(_NEGABINARY_MASK)) ^ jnp.uint32(_NEGABINARY_MASK)


def _from_negabinary(u):
    return ((u ^ jnp.uint32(_NEGABINARY_MASK)) - jnp.uint32(_NEGABINARY_MASK)).astype(jnp.int32)


class _BitStreams:
    """One bit stream per block, ``[blocks, length]`` of 0/1, with a write/read position each."""

    @staticmethod
    def write(stream, pos, bit, enabled):
        """Puts ``bit`` at each block's ``pos`` where ``enabled``; returns the stream and new
        pos."""
        blocks, length = stream.shape
        target = jnp.where(enabled, pos, length)  # out of range: dropped
        stream = stream.at[jnp.arange(blocks), target].set(bit.astype(stream.dtype), mode="drop")
        return stream, pos + enabled.astype(jnp.int32)

    @staticmethod
    def read(stream, pos, enabled):
        """The bit at each block's ``pos`` (0 where not ``enabled``); returns it and the new pos."""
        length = stream.shape[1]
        bit = jnp.take_along_axis(stream, jnp.clip(pos, 0, length - 1)[:, None], axis=1)[:, 0]
        bit = jnp.where(enabled, bit, 0).astype(jnp.uint32)
        return bit, pos + enabled.astype(jnp.int32)


def _write_value(stream, pos, value, count, enabled):
    """Writes the low ``count`` bits of ``value``, least significant first."""

    def write_bit(i, carry):
        stream, pos = carry
        return _BitStreams.write(stream, pos, (value >> i.astype(jnp.uint32)) & 1, enabled)

    return lax.fori_loop(0, count, write_bit, (stream, pos))


def _read_value(stream, pos, count, enabled):
    """Reads a ``count``-bit value, least significant bit first (0 where not ``enabled``)."""

    def read_bit(i, carry):
        value, pos = carry
        bit, pos = _BitStreams.read(stream, pos, enabled)
        return value | (bit << i.astype(jnp.uint32)), pos

    return lax.fori_loop(0, count, read_bit, (jnp.zeros_like(pos, jnp.uint32), pos))


def _encode_planes(stream, pos, u, bits):
    """zfp's encode_few_ints for every block: the 32 bit planes of ``u`` with ``bits`` bits each."""

    def run_length_step(_, carry):
        # One bit of the unary run-length code, as one step of zfp's two nested loops.
        stream, pos, bits, n, x, state = carry
        testing, scanning = state == _TEST, state == _SCAN
        tests = testing & (n < 4) & (bits > 0)  # outer loop: group test "any bit left?"
        scans = scanning & (n < 3) & (bits > 0)  # inner loop: is it this coefficient?
        bit = jnp.where(testing, x != 0, (x & 1) == 1)
        stream, pos = _BitStreams.write(stream, pos, bit, tests | scans)
        bits -= (tests | scans).astype(jnp.int32)
        state = jnp.where(
            testing,
            jnp.where(tests & bit, _SCAN, _DONE),
            jnp.where(scanning, jnp.where(scans & ~bit, _SCAN, _TEST), state),
        )
        # Every scan step moves to the next coefficient (found or not, written or not).
        x = jnp.where(scanning, x >> 1, x)
        n = jnp.where(scanning, n + 1, n)
        return stream, pos, bits, n, x, state

    def plane(step, carry):
        stream, pos, bits, n = carry
        k = (31 - step).astype(jnp.uint32)
        x = sum(((u[:, i] >> k) & 1) << i for i in range(4)).astype(jnp.uint32)
        # The first n bits of the plane verbatim (those coefficients are already significant).
        verbatim = jnp.minimum(n, bits)
        for i in range(4):
            stream, pos = _BitStreams.write(stream, pos, (x >> i) & 1, i < verbatim)
        bits -= verbatim
        x >>= verbatim.astype(jnp.uint32)
        # The rest as a unary run-length code: a group test (any bit left?), then a scan for it.
        carry = (stream, pos, bits, n, x, jnp.full_like(n, _TEST))
        stream, pos, bits, n, _, _ = lax.fori_loop(0, _PLANE_STEPS, run_length_step, carry)
        return stream, pos, bits, n

    carry = (stream, pos, bits, jnp.zeros_like(bits))
    stream, _, _, _ = lax.fori_loop(0, 32, plane, carry)
    return stream


def _decode_planes(stream, pos, bits):
    """zfp's decode_few_ints for every block: returns ``u`` [blocks, 4]."""

    def run_length_step(_, carry):
        pos, bits, n, x, state = carry
        testing, scanning = state == _TEST, state == _SCAN
        tests = testing & (n < 4) & (bits > 0)
        scans = scanning & (n < 3) & (bits > 0)
        bit, pos = _BitStreams.read(stream, pos, tests | scans)
        bits -= (tests | scans).astype(jnp.int32)
        one = bit == 1
        # A scan that finds the bit, or runs out (n == 3 or no budget), sets coefficient n.
        found = scanning & (one | ~scans)
        x = jnp.where(found, x | (jnp.uint32(1) << n.astype(jnp.uint32)), x)
        state = jnp.where(
            testing,
            jnp.where(tests & one, _SCAN, _DONE),
            jnp.where(scanning, jnp.where(found, _TEST, _SCAN), state),
        )
        n = jnp.where(scanning, n + 1, n)
        return pos, bits, n, x, state

    def plane(step, carry):
        u, pos, bits, n = carry
        k = (31 - step).astype(jnp.uint32)
        verbatim = jnp.minimum(n, bits)
        x = jnp.zeros_like(u[:, 0])
        for i in range(4):
            bit, pos = _BitStreams.read(stream, pos, i < verbatim)
            x |= bit << i
        bits -= verbatim
        carry = (pos, bits, n, x, jnp.full_like(n, _TEST))
        pos, bits, n, x, _ = lax.fori_loop(0, _PLANE_STEPS, run_length_step, carry)
        u = u | (((x[:, None] >> jnp.arange(4, dtype=jnp.uint32)) & 1) << k)
        return u, pos, bits, n

    blocks = stream.shape[0]
    carry = (jnp.zeros((blocks, 4), jnp.uint32), pos, bits, jnp.zeros_like(bits))
    u, _, _, _ = lax.fori_loop(0, 32, plane, carry)
    return u


def _pack_words(bit_rows):
    """[rows, bits] of 0/1 -> [rows, ceil(bits / 32)] uint32, bit j in word j // 32 at bit j %
    32."""
    rows, length = bit_rows.shape
    words = -(-length // 32)
    bit_rows = jnp.pad(bit_rows.astype(jnp.uint32), ((0, 0), (0, words * 32 - length)))
    weights = jnp.uint32(1) << jnp.arange(32, dtype=jnp.uint32)
    return jnp.sum(bit_rows.reshape(rows, words, 32) * weights, axis=-1, dtype=jnp.uint32)


def _unpack_words(words, length):
    bits = (words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
    return bits.reshape(words.shape[:-1] + (-1,))[..., :length]


def _bucket(blocks):
    """Blocks are padded to a power of two (>= 2048), and the bit coders take the rate as an
    array, so their compilation (the slow part) is shared by many row lengths and rates."""
    return max(2048, 1 << (blocks - 1).bit_length())


def _pad_blocks(array, blocks):
    return jnp.pad(array, [(0, blocks - array.shape[0])] + [(0, 0)] * (array.ndim - 1))


@functools.partial(jax.jit, static_argnames="rate")
def _split_blocks(x, rate):
    """[..., n] floats -> ([bucket, 4] float bits, [bucket] exponent keys), padded with zero
    blocks."""
    n = x.shape[-1]
    values = _float_bits(x.reshape(-1, n))[:, _padded_block_index(n)]
    values = values.reshape(values.shape[0], -1, 4)
    keys = values & 0x7FFFFFFF
    if rate >= 3:  # each block has its own exponent
        max_key = jnp.max(keys, axis=-1)
    else:  # the row's exponent is every block's
        max_key = jnp.broadcast_to(jnp.max(keys, axis=(1, 2))[:, None], values.shape[:2])
    bucket = _bucket(max_key.size)
    return _pad_blocks(values.reshape(-1, 4), bucket), _pad_blocks(max_key.reshape(-1), bucket)


@jax.jit
def _encode_blocks(values, max_key, rate):
    """Each block's bits (steps 1-7), ``[blocks, 128]`` of 0/1: the first ``4 * rate`` are the
    block."""
    blocks = values.shape[0]
    block_bits = 4 * rate
    nonfinite, zero = max_key >= _NONFINITE_KEY, max_key == 0
    coded = ~nonfinite & ~zero
    emax = _exponent(max_key)
    stream = jnp.zeros((blocks, _MAX_BLOCK_BITS), jnp.uint8)
    pos = jnp.zeros(blocks, jnp.int32)
    # Rates 1-2 have no block header: the row header word says zero / NaN.
    has_header = rate >= 3
    # 1. NaN/Inf: the reserved header.  2. Zero: one 0 bit.  3. Else flag 1 + biased exponent.
    header = jnp.where(nonfinite, _NONFINITE_HEADER, 2 * (emax + 127) + 1).astype(jnp.uint32)
    stream, pos = _write_value(stream, pos, header, _HEADER_BITS, has_header & ~zero)
    stream, pos = _BitStreams.write(stream, pos, jnp.zeros(blocks, jnp.uint32), has_header & zero)
    bits = jnp.where(coded, block_bits - jnp.where(has_header, _HEADER_BITS, 0), 0)
    # 4-6. Quantize, lift, negabinary.  7. Bit planes (the rest of the stream stays 0: padding).
    q = _quantize(values, emax[:, None])
    u = _to_negabinary(_forward_lift(q))
    return _encode_planes(stream, pos, u, bits.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=("shape", "rate"))
def _join_blocks(streams, max_key, shape, rate):
    """[bucket, 128] block bits -> [*shape[:-1], words], with the row header word at rates 1-2."""
    rows = int(np.prod(shape[:-1]))
    blocks = rows * -(-shape[-1] // 4)
    bit_rows = streams[:blocks, : 4 * rate].reshape(rows, -1)
    words = _pack_words(bit_rows)
    if rate <= 2:
        row_key = max_key[:blocks].reshape(rows, -1)[:, 0]
        header = jnp.where(
            row_key >= _NONFINITE_KEY,
            _NONFINITE_ROW_HEADER,
            jnp.where(row_key == 0, 0, _exponent(row_key) + 127),
        ).astype(jnp.uint32)
        words = jnp.concatenate([header[:, None], words], axis=1)
    return words.reshape(shape[:-1] + (-1,))


@functools.partial(jax.jit, static_argnames=("n", "rate"))
def _split_words(words, n, rate):
    """[..., words] -> ([bucket, 128] block bits, [bucket] row header or 0), padded with zeros."""
    words = words.reshape(-1, words.shape[-1])
    rows = words.shape[0]
    blocks_per_row = -(-n // 4)
    header = jnp.zeros((rows, blocks_per_row), jnp.uint32)
    if rate <= 2:
        header = jnp.broadcast_to(words[:, :1], header.shape)
        words = words[:, 1:]
    streams = _unpack_words(words, blocks_per_row * 4 * rate).reshape(
        rows * blocks_per_row, 4 * rate
    )
    bucket = _bucket(rows * blocks_per_row)
    streams = jnp.pad(streams, ((0, bucket - streams.shape[0]), (0, _MAX_BLOCK_BITS - 4 * rate)))
    return streams, _pad_blocks(header.reshape(-1), bucket)


@jax.jit
def _decode_blocks(stream, row_header, rate):
    """[blocks, 128] bits (the first ``4 * rate`` are the block) -> [blocks, 4] float32."""
    blocks = stream.shape[0]
    has_header = rate >= 3
    pos = jnp.zeros(blocks, jnp.int32)
    flag, pos = _BitStreams.read(stream, pos, jnp.broadcast_to(has_header, (blocks,)))
    biased, pos = _read_value(stream, pos, 8, has_header & (flag == 1))
    # Rates 1-2: the row header word holds the exponent (0: zero row, 0x100: NaN row).
    biased = jnp.where(has_header, biased, row_header)
    zero = jnp.where(has_header, flag == 0, biased == 0)
    nonfinite = jnp.where(has_header, (flag == 1) & (biased == 0), biased > 0xFF)
    bits = jnp.where(zero | nonfinite, 0, 4 * rate - jnp.where(has_header, _HEADER_BITS, 0))
    emax = biased.astype(jnp.int32) - 127
    u = _decode_planes(stream, pos, bits.astype(jnp.int32))
    values = _dequantize(_inverse_lift(_from_negabinary(u)), emax[:, None])
    return jnp.where(zero[:, None], 0.0, jnp.where(nonfinite[:, None], jnp.nan, values))


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _join_values(values, shape, dtype):
    """[bucket, 4] decoded blocks -> [*shape[:-1], n] of dtype."""
    rows, n = int(np.prod(shape[:-1])), shape[-1]
    values = values[: rows * -(-n // 4)].reshape(rows, -1)[:, :n]
    return values.reshape(shape).astype(dtype)


def zfp_encode(x, rate):
    """Reference of :func:`jaxcomp.zfp_encode`: the words of ``docs/kernels.md``, bit for bit.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``.
      rate: int in ``[1, 32]``, bits per value.

    Returns:
      uint32 array ``[..., zfp_num_words(n, rate)]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops import reference
      >>> reference.zfp_encode(jnp.ones(4), rate=8).tolist()
      [11521]

    References:
      Lindstrom, "Fixed-Rate Compressed Floating-Point Arrays", IEEE TVCG 2014 (zfp).
    """
    x = _checks.float_array(x, "x")
    rate = _checks.check_rate(rate)
    values, max_key = _split_blocks(x, rate)
    streams = _encode_blocks(values, max_key, np.int32(rate))
    return _join_blocks(streams, max_key, x.shape, rate)


def zfp_decode(words, n, rate, dtype=jnp.float32):
    """Reference of :func:`jaxcomp.zfp_decode`.

    Args:
      words: uint32 array ``[..., zfp_num_words(n, rate)]``.
      n: int, values per row.
      rate: int in ``[1, 32]``, the rate the words were encoded with.
      dtype: float32, bfloat16 or float16: the dtype of the result.

    Returns:
      ``[..., n]`` array of ``dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops import reference
      >>> reference.zfp_decode(reference.zfp_encode(jnp.ones(4), rate=8), n=4, rate=8).tolist()
      [1.0, 1.0, 1.0, 1.0]

    References:
      Lindstrom, "Fixed-Rate Compressed Floating-Point Arrays", IEEE TVCG 2014 (zfp).
    """
    words, n, rate, dtype = _checks.check_decode(words, n, rate, dtype)
    streams, row_header = _split_words(words, n, rate)
    values = _decode_blocks(streams, row_header, np.int32(rate))
    return _join_values(values, words.shape[:-1] + (n,), dtype)
