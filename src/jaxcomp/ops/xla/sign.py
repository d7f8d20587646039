"""The sign codec as XLA operations (see :mod:`jaxcomp.ops.xla`), bit for bit the native kernels'
words and scales.

Signs and magnitudes are read off the floats' bits (XLA on CPU flushes denormals in float
arithmetic; the format is defined on the bits). A chunk's sum is the halving tree of
``kernels/sign.h``, written as ``log2 P`` whole-array additions of the upper half of every
zero-padded chunk onto its lower half: separate float additions in a fixed order, which XLA
neither reassociates nor reorders.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_ABS_MASK = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_SMALLEST_NORMAL_BITS = np.uint32(0x00800000)
_NAN = np.array(0x7FC00000, np.uint32).view(np.float32)


def _tree_size(chunk: int) -> int:
    """The power of two a chunk is zero-padded to for its halving-tree sum."""
    return 1 << max(0, (chunk - 1).bit_length())


def _inverse_counts(n: int, chunk: int):
    """float32 ``1 / count`` of every chunk of a row of ``n`` (the last may be shorter), as the
    kernels compute it: ``1.0f / float(count)``."""
    chunks = -(-n // chunk)
    counts = np.full(chunks, chunk, np.int64)
    counts[-1] = n - (chunks - 1) * chunk
    return np.float32(1.0) / counts.astype(np.float32)


def _pad_last(x, length, value=0):
    pad = [(0, 0)] * (x.ndim - 1) + [(0, length - x.shape[-1])]
    return jnp.pad(x, pad, constant_values=value)


@functools.partial(jax.jit, static_argnames=("chunk",))
def sign_pack(x, chunk):
    """:func:`jaxcomp.ops.sign.sign_pack` as XLA operations.

    Args:
      x: float32 ``[..., n]`` (checked by the caller).
      chunk: values per scale.

    Returns:
      ``(words, scales)``: uint32 ``[..., ceil(n / 32)]``, float32 ``[..., ceil(n / chunk)]``.

    Example:
      >>> import jax.numpy as jnp
      >>> words, scales = sign_pack(jnp.array([1.0, -2.0, 0.0, 3.0, -5.0]), 4)
      >>> words.tolist(), scales.tolist()
      ([13], [1.5, 5.0])

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
      ICML 2019.
    """
    lead, n = x.shape[:-1], x.shape[-1]
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    magnitude = bits & _ABS_MASK
    positive = (magnitude == 0) | ((bits >> 31 == 0) & (magnitude <= _INF_BITS))
    n_words = -(-n // 32)
    lanes = _pad_last(positive.astype(jnp.uint32), n_words * 32).reshape(lead + (n_words, 32))
    # The bits are disjoint, so their sum is their or.
    words = jnp.sum(lanes << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)

    chunks, p = -(-n // chunk), _tree_size(chunk)
    values = lax.bitcast_convert_type(
        jnp.where(magnitude < _SMALLEST_NORMAL_BITS, np.uint32(0), magnitude), jnp.float32
    )
    values = _pad_last(_pad_last(values, chunks * chunk).reshape(lead + (chunks, chunk)), p)
    h = p // 2
    while h >= 1:
        values = values[..., :h] + values[..., h : 2 * h]
        h //= 2
    mean = values[..., 0] * _inverse_counts(n, chunk)
    mean_bits = lax.bitcast_convert_type(mean, jnp.uint32) & _ABS_MASK
    scales = jnp.where(
        mean_bits > _INF_BITS,
        _NAN,
        jnp.where(mean_bits < _SMALLEST_NORMAL_BITS, np.float32(0), mean),
    )
    return words, scales


@functools.partial(jax.jit, static_argnames=("n", "chunk"))
def sign_unpack(words, scales, n, chunk):
    """:func:`jaxcomp.ops.sign.sign_unpack` as XLA operations: ``+scale`` where the bit is 1,
    ``-scale`` where it is 0.

    Args:
      words: uint32 ``[..., ceil(n / 32)]`` (checked by the caller).
      scales: float32 ``[..., ceil(n / chunk)]``.
      n: values per row.
      chunk: values per scale.

    Returns:
      float32 ``[..., n]``.

    Example:
      >>> import jax.numpy as jnp
      >>> sign_unpack(jnp.array([5], jnp.uint32), jnp.array([2.0]), 3, 3).tolist()
      [2.0, -2.0, 2.0]

    References:
      Karimireddy et al., ICML 2019.
    """
    lead = words.shape[:-1]
    bits = ((words[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & np.uint32(1)).reshape(
        lead + (-1,)
    )[..., :n]
    plus = spread(scales, n, chunk)
    return jnp.where(bits == 1, plus, -plus)


def spread(scales, n: int, chunk: int):
    """Each chunk's scale once per value of the chunk: ``[..., ceil(n / chunk)] -> [..., n]``.

    A broadcast and a reshape, which XLA fuses into whatever reads them (``jnp.repeat`` with a
    ``total_repeat_length`` lowers to a scatter, a cumulative sum and a gather: on the CPU,
    several times the time of the whole decode).

    Args:
      scales: ``[..., ceil(n / chunk)]``.
      n: values per row.
      chunk: values per scale.

    Returns:
      ``[..., n]`` of ``scales``' dtype.

    Example:
      >>> import jax.numpy as jnp
      >>> spread(jnp.array([1.0, 2.0]), 3, 2).tolist()
      [1.0, 1.0, 2.0]

    References:
      Karimireddy et al., ICML 2019 (one scale per block of values).
    """
    lead, chunks = scales.shape[:-1], scales.shape[-1]
    if chunks == 1:  # chunk may be far longer than the row: never a [1, chunk] intermediate
        return jnp.broadcast_to(scales, lead + (n,))
    spread_out = jnp.broadcast_to(scales[..., None], lead + (chunks, chunk))
    return spread_out.reshape(lead + (chunks * chunk,))[..., :n]
