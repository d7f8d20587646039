"""The ZFP-style fixed-rate codec as XLA operations (see :mod:`jaxcomp.ops.xla`), bit for bit the
native kernels' words and values.

Every block of every row is one lane of whole-array operations. A block's bits are built in four
uint32 words (a block has at most 128 bits): the header, then the 32 bit planes, most
significant first, each coded by one lookup in a table of zfp's run-length codes indexed by the
number of coefficients already significant and the plane's 4 bits (the table of
kernels/zfp_block.h). The bit budget only cuts the stream short, so the planes are coded in full
and the bits past the block's end masked off. Groups of 8 blocks fill exactly ``rate`` words, so
blocks land in their words with shifts known when tracing. Decoding reverses it: the budget does
change how a cut plane decodes, so its table is indexed by the bits left (up to 7) as well.
Floats are handled as their bits throughout: XLA on CPU flushes denormals in float arithmetic,
and the format is defined on exact values.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops import _ffi

_HEADER_BITS = 9
_NONFINITE_KEY = 0x7F800000
_NONFINITE_ROW_HEADER = 0x100
_NEGABINARY_MASK = np.uint32(0xAAAAAAAA)
_GROUP_BLOCKS = 8  # 8 blocks x 4 * rate bits = rate whole words
_NAN_BITS = np.uint32(0x7FC00000)


def _encode_plane(plane, n):
    """zfp's run-length code of one 4-bit plane with n coefficients already significant (no budget):
    (code, length, next n)."""
    bits, length, x = plane & ((1 << n) - 1), n, plane >> n
    while n < 4:
        bits |= (1 if x else 0) << length
        length += 1
        if not x:
            break
        while n < 3:
            bits |= (x & 1) << length
            length += 1
            if x & 1:
                break
            x >>= 1
            n += 1
        x >>= 1
        n += 1
    return bits, length, n


def _decode_plane(stream, n, budget):
    """zfp's decoding of one plane from ``stream`` (next bit lowest) with ``budget`` bits left:
    (plane, length, next n)."""
    verbatim = min(n, budget)
    plane, length = stream & ((1 << verbatim) - 1), verbatim
    budget -= verbatim
    while budget > 0 and n < 4:
        budget -= 1
        bit = (stream >> length) & 1
        length += 1
        if not bit:
            break
        while budget > 0 and n < 3:
            budget -= 1
            bit = (stream >> length) & 1
            length += 1
            if bit:
                break
            n += 1
        plane |= 1 << n
        n += 1
    return plane, length, n


def _tables():
    encode = np.zeros(5 * 16, np.uint32)  # [n * 16 + plane]: code | length << 16 | next n << 24
    for n in range(5):
        for plane in range(16):
            code, length, next_n = _encode_plane(plane, n)
            encode[n * 16 + plane] = code | length << 16 | next_n << 24
    # [(n * 8 + min(bits left, 7)) * 128 + next 7 bits]: plane | length << 4 | next n << 8
    decode = np.zeros(5 * 8 * 128, np.uint32)
    for n in range(5):
        for budget in range(8):
            for stream in range(128):
                plane, length, next_n = _decode_plane(stream, n, budget)
                decode[(n * 8 + budget) * 128 + stream] = plane | length << 4 | next_n << 8
    return encode, decode


_ENCODE_TABLE, _DECODE_TABLE = _tables()


def _padded_block_index(n):
    """Indices of a row of n values making ``ceil(n / 4)`` blocks, padded like zfp's pad_block."""
    index = np.arange(-(-n // 4) * 4).reshape(-1, 4)
    valid = n - 4 * (index.shape[0] - 1)
    last = index[-1].copy()
    if valid == 1:
        last[1:] = last[0]
    elif valid == 2:
        last[2], last[3] = last[1], last[0]
    elif valid == 3:
        last[3] = last[0]
    index[-1] = last
    return index.reshape(-1)


def _shift_left(value, amount):
    """``value << amount`` for amounts in [0, 32) (uint32; amount an int32 array)."""
    return value << jnp.clip(amount, 0, 31).astype(jnp.uint32)


def _shift_right(value, amount):
    return value >> jnp.clip(amount, 0, 31).astype(jnp.uint32)


def _quantize(bits, emax):
    """``(int32)(f * 2**(30 - emax))`` (truncation), exactly, from the float's bits."""
    biased = ((bits >> 23) & 0xFF).astype(jnp.int32)
    fraction = bits & 0x7FFFFF
    mantissa = jnp.where(biased > 0, fraction | 0x800000, fraction)
    shift = jnp.maximum(biased, 1) - 120 - emax
    magnitude = jnp.where(
        shift >= 0,
        _shift_left(mantissa, shift),
        jnp.where(shift > -32, _shift_right(mantissa, -shift), 0),
    ).astype(jnp.int32)
    return jnp.where((bits >> 31) == 1, -magnitude, magnitude)


def _dequantize_bits(q, emax):
    """The bits of ``(float)q * 2**(emax - 30)``, rounded like ldexpf, by integer operations."""
    bits = lax.bitcast_convert_type(q.astype(jnp.float32), jnp.uint32)
    sign = bits & np.uint32(0x80000000)
    exponent = ((bits >> 23) & 0xFF).astype(jnp.int32) + emax - 30
    normal = sign | (jnp.clip(exponent, 1, 254).astype(jnp.uint32) << 23) | (bits & 0x7FFFFF)
    shift = jnp.clip(1 - exponent, 1, 31).astype(jnp.uint32)
    significand = (bits & 0x7FFFFF) | 0x800000
    kept = significand >> shift
    rest = significand & ((jnp.uint32(1) << shift) - 1)
    half = jnp.uint32(1) << (shift - 1)
    kept = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).astype(jnp.uint32)
    denormal = jnp.where(1 - exponent > 25, sign, sign | kept)
    result = jnp.where(
        exponent >= 255,
        sign | np.uint32(_NONFINITE_KEY),
        jnp.where(exponent >= 1, normal, denormal),
    )
    return jnp.where(q == 0, np.uint32(0), result)


def _forward_lift(x, y, z, w):
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
    return x, y, z, w


def _inverse_lift(x, y, z, w):
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
    return x, y, z, w


def _row_header(max_key):
    """Rates 1-2: the header word of a row from its largest magnitude key."""
    return jnp.where(
        max_key >= _NONFINITE_KEY,
        np.uint32(_NONFINITE_ROW_HEADER),
        jnp.where(max_key == 0, np.uint32(0), (max_key >> 23) + np.uint32(1)),
    )


def _loop_carry(carry, like):
    """``carry`` typed as varying over the shard_map axes ``like`` varies over: a loop's carry must
    keep its type, and the values it accumulates come from ``like``."""
    return jax.tree.map(lambda a: _ffi.like_varying(a, like), carry)


def _encode_blocks(u, start, limit, planes):
    """Each block's bits as 4 words: the top ``planes`` bit planes of ``u`` (4 uint32 arrays) from
    bit ``start``, bits at and past ``limit`` cleared. Every plane's code has at least one bit,
    so a budget of b bits is spent within b planes: the rest would be cleared anyway."""
    table = jnp.asarray(_ENCODE_TABLE)

    def plane(step, carry):
        words, pos, n = carry
        k = (31 - step).astype(jnp.uint32)
        nibble = sum(((u[i] >> k) & 1) << i for i in range(4))
        entry = table[n * 16 + nibble.astype(jnp.int32)]
        code = entry & 0xFFFF
        # A code has at most 7 bits: it lands in the word holding `pos` and perhaps the next.
        words = tuple(
            word
            | jnp.where((pos >= 32 * i) & (pos < 32 * i + 32), _shift_left(code, pos - 32 * i), 0)
            | jnp.where((pos < 32 * i) & (pos > 32 * i - 32), _shift_right(code, 32 * i - pos), 0)
            for i, word in enumerate(words)
        )
        return (
            words,
            pos + ((entry >> 16) & 0xFF).astype(jnp.int32),
            (entry >> 24).astype(jnp.int32),
        )

    zero = jnp.zeros_like(u[0])
    init = _loop_carry(((zero,) * 4, start, jnp.zeros_like(start)), u[0])
    words, _, _ = lax.fori_loop(0, planes, plane, init)
    masked = []
    for i, word in enumerate(words):
        keep = jnp.clip(limit - 32 * i, 0, 32)
        mask = jnp.where(keep >= 32, np.uint32(0xFFFFFFFF), _shift_left(jnp.uint32(1), keep) - 1)
        masked.append(word & mask)
    return masked


def _pack(words, block_bits, rate):
    """[rows, blocks] x 4 block words -> [rows, ceil(blocks * block_bits / 32)] row words."""
    rows, blocks = words[0].shape
    groups = -(-blocks // _GROUP_BLOCKS)
    pad = groups * _GROUP_BLOCKS - blocks
    grouped = [jnp.pad(w, ((0, 0), (0, pad))).reshape(rows, groups, _GROUP_BLOCKS) for w in words]
    out = [jnp.zeros((rows, groups), jnp.uint32) for _ in range(rate)]
    block_words = -(-block_bits // 32)
    for j in range(_GROUP_BLOCKS):
        first, shift = divmod(j * block_bits, 32)
        for i in range(block_words):
            part = grouped[i][:, :, j]
            if first + i < rate:
                out[first + i] = out[first + i] | (part << shift)
            if shift and first + i + 1 < rate:
                out[first + i + 1] = out[first + i + 1] | (part >> (32 - shift))
    packed = jnp.stack(out, axis=-1).reshape(rows, groups * rate)
    return packed[:, : -(-blocks * block_bits // 32)]


def _unpack(body, blocks, block_bits, rate):
    """[rows, words] -> [rows, blocks] x 4: each block's bits from its first (bits past the
    group read as 0: the budget never reads them)."""
    rows = body.shape[0]
    groups = -(-blocks // _GROUP_BLOCKS)
    body = jnp.pad(body, ((0, 0), (0, groups * rate - body.shape[1])))
    grouped = body.reshape(rows, groups, rate)
    word = [grouped[:, :, t] for t in range(rate)] + [jnp.zeros((rows, groups), jnp.uint32)] * 5
    out = [[] for _ in range(4)]
    for j in range(_GROUP_BLOCKS):
        first, shift = divmod(j * block_bits, 32)
        for i in range(4):
            low, high = word[first + i], word[first + i + 1]
            out[i].append(low >> shift | (high << (32 - shift) if shift else 0))
    return [jnp.stack(o, axis=-1).reshape(rows, groups * _GROUP_BLOCKS)[:, :blocks] for o in out]


@functools.partial(jax.jit, static_argnames=("rate",))
def zfp_encode(x, rate):
    """:func:`jaxcomp.zfp_encode` in plain XLA operations, word for word the native kernel's.

    Args:
      x: float32 ``[..., n]`` (checked by the public op).
      rate: static int in ``[1, 32]``, bits per value.

    Returns:
      uint32 ``[..., zfp_num_words(n, rate)]``.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> bool((zfp_encode(jnp.ones(4), 8) == jaxcomp.zfp_encode(jnp.ones(4), 8)).all())
      True

    References:
      Lindstrom, IEEE TVCG 2014 (zfp fixed-rate mode); the bit-plane coder, vectorized over blocks.
    """
    n = x.shape[-1]
    rows = int(np.prod(x.shape[:-1]))
    blocks = -(-n // 4)
    block_bits = 4 * rate
    values = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32).reshape(rows, n)
    values = values[:, _padded_block_index(n)].reshape(rows, blocks, 4)
    keys = values & np.uint32(0x7FFFFFFF)
    if rate >= 3:  # every block its own exponent, in its 9-bit header
        max_key = jnp.max(keys, axis=-1)
        nonfinite, zero = max_key >= _NONFINITE_KEY, max_key == 0
        emax = (max_key >> 23).astype(jnp.int32) - 126
        header = jnp.where(nonfinite, np.uint32(1), (2 * (emax + 127) + 1).astype(jnp.uint32))
        start = jnp.full((rows, blocks), _HEADER_BITS, jnp.int32)
        limit = jnp.where(nonfinite | zero, 0, block_bits).astype(jnp.int32)
    else:  # the row's exponent, in the row's header word
        row_header = _row_header(
            jnp.max(keys, axis=(1, 2)) if blocks else jnp.zeros(rows, jnp.uint32)
        )
        coded = (row_header != 0) & (row_header != _NONFINITE_ROW_HEADER)
        emax = jnp.broadcast_to((row_header.astype(jnp.int32) - 127)[:, None], (rows, blocks))
        start = jnp.zeros((rows, blocks), jnp.int32)
        limit = jnp.broadcast_to(jnp.where(coded, block_bits, 0)[:, None], (rows, blocks)).astype(
            jnp.int32
        )
    q = _quantize(values, emax[..., None])
    lifted = _forward_lift(*(q[..., i] for i in range(4)))
    u = [(c.astype(jnp.uint32) + _NEGABINARY_MASK) ^ _NEGABINARY_MASK for c in lifted]
    words = _encode_blocks(
        u, start, limit, min(32, block_bits - (_HEADER_BITS if rate >= 3 else 0))
    )
    if rate >= 3:  # the header, where the block is not zero (nonfinite: header, then zeros)
        words[0] = words[0] | jnp.where(zero, np.uint32(0), header)
    packed = _pack(words, block_bits, rate)
    if rate <= 2:
        packed = jnp.concatenate([row_header[:, None], packed], axis=1)
    return packed.reshape(x.shape[:-1] + (packed.shape[-1],))


def _decode_planes(window, start, budget, planes):
    """u (4 uint32 arrays) from the top ``planes`` planes at bit ``start`` (static) of each block's
    4 words (a plane with bits left to read consumes at least one: ``budget`` bits are read within
    ``budget`` planes, and the planes after them are 0)."""
    table = jnp.asarray(_DECODE_TABLE)

    def advance(words, count):
        """The 128-bit window moved on by ``count`` (0..31) bits, zeros coming in at the top."""
        count = jnp.asarray(count, jnp.uint32)
        # (high << (31 - count)) << 1: no shift by 32 when count is 0.
        return tuple(
            (low >> count) | ((high << (31 - count)) << 1)
            for low, high in zip(words, words[1:] + (jnp.zeros_like(words[0]),))
        )

    def plane(step, carry):
        u, stream, bits, n = carry
        k = (31 - step).astype(jnp.uint32)
        entry = table[(n * 8 + jnp.minimum(bits, 7)) * 128 + (stream[0] & 0x7F).astype(jnp.int32)]
        nibble = entry & 0xF
        length = (entry >> 4) & 0xF
        u = tuple(c | (((nibble >> i) & 1) << k) for i, c in enumerate(u))
        return (
            u,
            advance(stream, length),
            bits - length.astype(jnp.int32),
            (entry >> 8).astype(jnp.int32),
        )

    zero = jnp.zeros_like(window[0])
    stream = advance(tuple(window), start) if start else tuple(window)
    init = _loop_carry(((zero,) * 4, stream, budget, jnp.zeros_like(budget)), window[0])
    u, _, _, _ = lax.fori_loop(0, planes, plane, init)
    return u


@functools.partial(jax.jit, static_argnames=("n", "rate"))
def zfp_decode(words, n, rate):
    """:func:`jaxcomp.zfp_decode` in plain XLA operations, bit-identical to the native kernel.

    Args:
      words: uint32 ``[..., zfp_num_words(n, rate)]`` (checked by the public op).
      n: static int, values per row.
      rate: static int in ``[1, 32]``.

    Returns:
      float32 ``[..., n]``.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> zfp_decode(jaxcomp.zfp_encode(jnp.ones(4), 8), 4, 8).tolist()
      [1.0, 1.0, 1.0, 1.0]

    References:
      Lindstrom, IEEE TVCG 2014 (zfp fixed-rate mode).
    """
    lead = words.shape[:-1]
    rows = int(np.prod(lead))
    blocks = -(-n // 4)
    block_bits = 4 * rate
    flat = words.reshape(rows, words.shape[-1])
    body = flat[:, 1:] if rate <= 2 else flat
    window = _unpack(body, blocks, block_bits, rate)
    if rate >= 3:
        flag, biased = window[0] & 1, (window[0] >> 1) & 0xFF
        zero, nonfinite = flag == 0, (flag == 1) & (biased == 0)
        emax = biased.astype(jnp.int32) - 127
        start = _HEADER_BITS
        budget = jnp.where(zero | nonfinite, 0, block_bits - _HEADER_BITS).astype(jnp.int32)
    else:
        header = jnp.broadcast_to(flat[:, :1], (rows, blocks))
        zero, nonfinite = header == 0, header > 0xFF
        emax = header.astype(jnp.int32) - 127
        start = 0
        budget = jnp.where(zero | nonfinite, 0, block_bits).astype(jnp.int32)
    u = _decode_planes(
        window, start, budget, min(32, block_bits - (_HEADER_BITS if rate >= 3 else 0))
    )
    q = [((c ^ _NEGABINARY_MASK) - _NEGABINARY_MASK).astype(jnp.int32) for c in u]
    q = _inverse_lift(*q)
    bits = jnp.stack([_dequantize_bits(c, emax) for c in q], axis=-1)
    bits = jnp.where(
        zero[..., None], np.uint32(0), jnp.where(nonfinite[..., None], _NAN_BITS, bits)
    )
    values = lax.bitcast_convert_type(bits.reshape(rows, blocks * 4)[:, :n], jnp.float32)
    return values.reshape(lead + (n,))
