"""Pure-JAX references of :func:`jaxcomp.sign_pack` and :func:`jaxcomp.sign_unpack`, following
``docs/kernels.md`` step by step: one chunk at a time, its halving tree written out as a loop."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp.ops import _checks
from jaxcomp.ops.sign import check_chunk

_SMALLEST_NORMAL_BITS = 0x00800000


def _magnitude_bits(x):
    return lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)


def sign_pack(x, chunk):
    """The words and scales of :func:`jaxcomp.sign_pack`, chunk by chunk.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``.
      chunk: static int ``>= 1``, values per scale.

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
    x = _checks.float_array(x, "x").astype(jnp.float32)
    chunk = check_chunk(chunk)
    n = x.shape[-1]
    magnitude = _magnitude_bits(x)
    sign_clear = lax.bitcast_convert_type(x, jnp.uint32) >> 31 == 0
    # x >= 0 on the bits: both zeros are +, NaN (a magnitude above +Inf's) is -.
    plus = (magnitude == 0) | (sign_clear & (magnitude <= 0x7F800000))
    words = []
    for w in range(-(-n // 32)):
        bits = plus[..., 32 * w : 32 * (w + 1)].astype(jnp.uint32)
        words.append(
            jnp.sum(bits << jnp.arange(bits.shape[-1], dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)
        )
    # Magnitudes below the smallest normal float count as 0.
    values = jnp.where(magnitude < _SMALLEST_NORMAL_BITS, 0.0, jnp.abs(x))
    tree = 1 << (chunk - 1).bit_length()
    scales = []
    for start in range(0, n, chunk):
        part = values[..., start : start + chunk]
        count = part.shape[-1]
        part = jnp.pad(part, [(0, 0)] * (x.ndim - 1) + [(0, tree - count)])
        h = tree // 2
        while h >= 1:  # the halving tree: the upper half onto the lower
            part = part[..., :h] + part[..., h : 2 * h]
            h //= 2
        mean = part[..., 0] * (np.float32(1) / np.float32(count))
        mean_bits = _magnitude_bits(mean)
        mean = jnp.where(mean_bits < _SMALLEST_NORMAL_BITS, 0.0, mean)
        scales.append(
            jnp.where(jnp.isnan(mean), np.array(0x7FC00000, np.uint32).view(np.float32), mean)
        )
    return jnp.stack(words, axis=-1), jnp.stack(scales, axis=-1)


def sign_unpack(words, scales, n, chunk):
    """``+scale`` where a bit of ``words`` is 1, ``-scale`` where it is 0 (float32 ``[..., n]``).

    Args:
      words: uint32 ``[..., ceil(n / 32)]``.
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
    index = jnp.arange(n)
    bits = (words[..., index // 32] >> (index % 32).astype(jnp.uint32)) & jnp.uint32(1)
    plus = scales[..., index // chunk]
    return jnp.where(bits == 1, plus, -plus)
