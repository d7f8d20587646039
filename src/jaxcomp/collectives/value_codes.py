"""Low-bit values of a top-k selection: the codec and the all-gather that carries them.

Each device codes its ``k`` selected values, ``chunk`` consecutive ones at a time (in the
selection's order, ascending index), on a symmetric grid of ``2**bits`` levels spanning that
chunk's largest magnitude: ``-s, -s + 2s/(2**bits - 1), ..., s``. The codes travel packed into
uint32 words beside the indices and the float32 scales, in one all-gather; every device decodes
every device's values with that device's scales and adds them. The grid has no zero level: the
values a top-k keeps are the largest, and with 2 bits the levels ``±s/3, ±s`` serve them better
than a zero would. The scale is the chunk's maximum, so nothing clips and each value is off by at
most ``s / (2**bits - 1)``. Rounding is deterministic, to the nearest level, as SparseLoCo's
quantizer rounds: error feedback keeps each value's rounding and sends it later, so the
unbiasedness stochastic rounding buys is not needed, and the sent values do not depend on a key.

References:
  Sarfi et al., "Communication Efficient LLM Pre-training with SparseLoCo", arXiv 2508.15706
  (top-k of the error-fed pseudo-gradient, its values quantized to 2 bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.collectives import sizes
from jaxcomp.collectives._common import all_gather_or_retype
from jaxcomp.collectives.quantized import pack_codes, unpack_codes
from jaxcomp.ops import _checks


def check_value_codes(bits, chunk) -> tuple[int, int]:
    """The low-bit values' settings, checked before any work.

    Args:
      bits: bits per code, an int in ``[1, MAX_VALUE_BITS]``.
      chunk: values per scale, an int ``>= 1``.

    Returns:
      ``(bits, chunk)`` as static Python ints.

    Raises:
      ValueError, TypeError: naming ``value_bits`` or ``value_chunk``.

    Example:
      >>> check_value_codes(2, 64)
      (2, 64)

    References:
      Sarfi et al., SparseLoCo, arXiv 2508.15706 (2-bit values).
    """
    bits = _checks.static_int(bits, "value_bits", 1, sizes.MAX_VALUE_BITS)
    return bits, _checks.static_int(chunk, "value_chunk", 1, _checks.MAX_ROW_LENGTH)


def _chunked(v, chunk):
    """``v`` zero-padded to whole chunks, one row a chunk."""
    return jnp.pad(v, (0, sizes.ceil_div(v.shape[0], chunk) * chunk - v.shape[0])).reshape(
        -1, chunk
    )


def encode_values(values, bits: int, chunk: int):
    """The codes and scales of ``values``: each chunk on its own grid (see the module doc).

    Args:
      values: a 1-D float vector of ``k`` values (float32, bfloat16 or float16).
      bits: bits per code, 1..:data:`jaxcomp.collectives.sizes.MAX_VALUE_BITS`.
      chunk: values per scale, ``>= 1``.

    Returns:
      ``(words, scales)``: uint32 ``[ceil(k / (32 // bits))]``, codes packed as
      :func:`jaxcomp.collectives.quantized.pack_codes` packs them, and float32
      ``[ceil(k / chunk)]``, each chunk's largest magnitude.

    Example:
      >>> import jax.numpy as jnp
      >>> words, scales = encode_values(jnp.array([3.0, -1.0, 0.5, -3.0]), 2, 4)
      >>> words.tolist(), scales.tolist()  # codes 3, 1, 2, 0
      ([39], [3.0])

    References:
      Sarfi et al., SparseLoCo, arXiv 2508.15706.
    """
    bits, chunk = check_value_codes(bits, chunk)
    k = values.shape[0]
    rows = _chunked(values.astype(jnp.float32), chunk)
    scales = jnp.max(jnp.abs(rows), axis=1)
    unit = jnp.where(scales > 0, scales, 1.0)  # an all-zero chunk: any code decodes to 0
    levels = 2**bits - 1
    position = (rows / unit[:, None] + 1.0) * np.float32(levels / 2)  # in [0, levels]
    codes = jnp.clip(jnp.round(position), 0, levels).astype(jnp.uint32).reshape(-1)[:k]
    return pack_codes(codes, bits), scales


def decode_values(words, scales, bits: int, chunk: int, length: int):
    """The values :func:`encode_values`'s ``(words, scales)`` stand for: code ``c`` of a chunk
    of scale ``s`` decodes to ``c (2s / (2**bits - 1)) - s``.

    Args:
      words: uint32 packed codes.
      scales: float32, one per chunk.
      bits: bits per code.
      chunk: values per scale.
      length: values to decode (``k``).

    Returns:
      A float32 vector of ``length`` values.

    Example:
      >>> import jax.numpy as jnp
      >>> words, scales = encode_values(jnp.array([3.0, -1.0, 0.5, -3.0]), 2, 4)
      >>> decode_values(words, scales, 2, 4, 4).tolist()
      [3.0, -1.0, 1.0, -3.0]

    References:
      Sarfi et al., SparseLoCo, arXiv 2508.15706.
    """
    bits, chunk = check_value_codes(bits, chunk)
    codes = _chunked(unpack_codes(words, bits, length).astype(jnp.float32), chunk)
    step = scales * np.float32(2 / (2**bits - 1))
    return (codes * step[:, None] - scales[:, None]).reshape(-1)[:length]


def gather_coded_pairs(values, indices, bits: int, chunk: int, axis_name):
    """Every device's selected pairs, the values sent as low-bit codes: one all-gather of each
    device's message of :func:`jaxcomp.collectives.sizes.coded_pairs_words` uint32 words (its
    indices, packed codes and scales, bit for bit).

    Args:
      values: this device's ``k`` selected values (1-D float).
      indices: their int32 indices.
      bits: bits per code, 1..:data:`jaxcomp.collectives.sizes.MAX_VALUE_BITS`.
      chunk: values per scale.
      axis_name: the mesh axis, or tuple of axes, to gather over.

    Returns:
      ``(all_values, all_indices, sent)``: float32 ``[N, k]``, every device's decoded values;
      int32 ``[N, k]``, their indices (both typed invariant); and this device's decoded values,
      float32 ``[k]``, what the others add for it.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
      >>> f = jax.shard_map(
      ...     lambda v, i: gather_coded_pairs(v, i, 1, 2, "data")[0], mesh=mesh,
      ...     in_specs=(P("data"), P("data")), out_specs=P())
      >>> f(jnp.array([2.0, -1.0, 0.5, 0.25]), jnp.arange(4)).tolist()  # signs times the max
      [[2.0, -2.0], [0.5, 0.5]]

    References:
      Sarfi et al., SparseLoCo, arXiv 2508.15706.
    """
    bits, chunk = check_value_codes(bits, chunk)
    k = values.shape[0]
    words, scales = encode_values(values, bits, chunk)
    message = jnp.concatenate(
        [
            jax.lax.bitcast_convert_type(indices.astype(jnp.int32), jnp.uint32),
            words,
            jax.lax.bitcast_convert_type(scales, jnp.uint32),
        ]
    )
    assert message.shape[0] == sizes.coded_pairs_words(k, bits, chunk)  # what wire_bytes counts
    gathered = all_gather_or_retype(message, axis_name)
    n_words = words.shape[0]
    all_indices = jax.lax.bitcast_convert_type(gathered[:, :k], jnp.int32)
    all_scales = jax.lax.bitcast_convert_type(gathered[:, k + n_words :], jnp.float32)
    all_values = jax.vmap(lambda w, s: decode_values(w, s, bits, chunk, k))(
        gathered[:, k : k + n_words], all_scales
    )
    return all_values, all_indices, decode_values(words, scales, bits, chunk, k)
