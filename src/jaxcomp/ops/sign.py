"""The 1-bit sign codec: signs packed 32 per uint32 word, one scale (mean magnitude) per chunk.

The op module of :class:`jaxcomp.methods.Sign`. The exact format (the zero convention, the
order of the scale's sum) is in ``docs/kernels.md`` and ``kernels/sign.h``; the native kernels
(CPU and CUDA) and the portable :mod:`jaxcomp.ops.xla` path give the same words and scales bit for
bit.

References:
  Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
  ICML 2019 (scaled signs with error feedback); Tang et al., "1-bit Adam", ICML 2021.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import _checks, _ffi
from jaxcomp.ops import xla as _xla

#: Values per scale by default: the scales add 4 bytes per 1024 values to the 128 bytes of signs.
DEFAULT_CHUNK = 1024


def check_chunk(chunk) -> int:
    """``chunk`` as a static int in ``[1, 2**31 - 1]`` (values per scale), else an error naming it.

    Args:
      chunk: values per scale.

    Returns:
      ``chunk`` as a Python int.

    Example:
      >>> check_chunk(256)
      256

    References:
      Karimireddy et al., ICML 2019 (one scale per block of values).
    """
    return _checks.static_int(chunk, "chunk", 1, _checks.MAX_ROW_LENGTH)


def sign_num_words(n) -> int:
    """uint32 words that carry the signs of ``n`` values: ``ceil(n / 32)``.

    Args:
      n: values in a row (``>= 1``).

    Returns:
      The number of words.

    Example:
      >>> sign_num_words(1000)
      32

    References:
      Karimireddy et al., ICML 2019 (1 bit a value).
    """
    n = _checks.static_int(n, "n", 1, _checks.MAX_ROW_LENGTH)
    return -(-n // 32)


def sign_num_chunks(n, chunk) -> int:
    """Scales of a row of ``n`` values: ``ceil(n / chunk)``.

    Args:
      n: values in a row (``>= 1``).
      chunk: values per scale (``>= 1``).

    Returns:
      The number of scales.

    Example:
      >>> sign_num_chunks(1000, 256)
      4

    References:
      Karimireddy et al., ICML 2019 (one scale per block of values).
    """
    n = _checks.static_int(n, "n", 1, _checks.MAX_ROW_LENGTH)
    return -(-n // check_chunk(chunk))


def sign_pack(x, chunk=DEFAULT_CHUNK, *, implementation=None):
    """Each row of ``x`` as its signs, 32 a word, and the mean magnitude of every chunk.

    Bit ``i % 32`` of word ``i // 32`` is 1 where ``x[i] >= 0`` (both zeros count as +) and 0
    where ``x[i] < 0`` or NaN; the last word is zero-padded. Scale ``q`` is the mean of ``|x|``
    over values ``q*chunk .. (q+1)*chunk - 1`` (the last chunk may be shorter), summed in the fixed
    halving-tree order of ``docs/kernels.md``; magnitudes and scales below the smallest normal
    float count as 0. Decoding (:func:`sign_unpack`) gives ``±scale``.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``; leading axes are independent rows.
      chunk: static int ``>= 1``, values per scale.
      implementation: ``"native"`` (the FFI kernel), ``"xla"`` (:mod:`jaxcomp.ops.xla`, any
        platform, the same words and scales bit for bit) or ``None``: native where a native module
        serves the platform, else xla with a warning.

    Returns:
      ``(words, scales)``: uint32 ``[..., ceil(n / 32)]`` and float32 ``[..., ceil(n / chunk)]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops.sign import sign_pack, sign_unpack
      >>> words, scales = sign_pack(jnp.array([1.0, -2.0, 0.0, 3.0, -5.0]), chunk=4)
      >>> words.tolist(), scales.tolist()  # bits 0, 2, 3 set; means of |x| over [0:4] and [4:5]
      ([13], [1.5, 5.0])
      >>> sign_unpack(words, scales, n=5, chunk=4).tolist()
      [1.5, -1.5, 1.5, 1.5, -5.0]

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
      ICML 2019; Tang et al., "1-bit Adam", ICML 2021 (the packed signs and their scale).
    """
    x = _checks.float_array(x, "x")
    chunk = check_chunk(chunk)
    implementation = _ffi.check_implementation(implementation)
    n = x.shape[-1]
    shapes = (
        jax.ShapeDtypeStruct(x.shape[:-1] + (sign_num_words(n),), jnp.uint32),
        jax.ShapeDtypeStruct(x.shape[:-1] + (-(-n // chunk),), jnp.float32),
    )
    call = _ffi.ffi_call("jaxcomp_sign_pack", shapes, vmap_method="broadcast_all")
    words, scales = _ffi.dispatch(
        "jaxcomp.sign_pack",
        (x.astype(jnp.float32),),
        lambda v: call(v, chunk=np.int64(chunk)),
        lambda v: _xla.sign_pack(v, chunk),
        implementation,
    )
    return words, scales


def sign_unpack(words, scales, n, chunk=DEFAULT_CHUNK, dtype=jnp.float32, *, implementation=None):
    """The values :func:`sign_pack`'s words and scales stand for: ``+scale`` where a bit is 1,
    ``-scale`` where it is 0.

    Args:
      words: uint32 array ``[..., ceil(n / 32)]``.
      scales: float32 array ``[..., ceil(n / chunk)]`` with the same leading axes.
      n: static int, values per row.
      chunk: static int, the chunk the scales were made with.
      dtype: float32 (default), bfloat16 or float16: the dtype of the result.
      implementation: ``"native"``, ``"xla"`` or ``None``, as for :func:`sign_pack`.

    Returns:
      ``[..., n]`` array of ``dtype``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops.sign import sign_unpack
      >>> sign_unpack(jnp.array([5], jnp.uint32), jnp.array([2.0]), n=3, chunk=3).tolist()
      [2.0, -2.0, 2.0]

    References:
      Karimireddy et al., ICML 2019.
    """
    n = _checks.static_int(n, "n", 1, _checks.MAX_ROW_LENGTH)
    chunk = check_chunk(chunk)
    dtype = jnp.dtype(dtype)
    if dtype not in _checks.FLOAT_DTYPES:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    words, scales = jnp.asarray(words), jnp.asarray(scales)
    implementation = _ffi.check_implementation(implementation)
    if words.dtype != jnp.uint32:
        raise TypeError(f"words must be uint32 (as sign_pack returns), got dtype {words.dtype}")
    if words.ndim == 0 or words.shape[-1] != sign_num_words(n):
        raise ValueError(
            f"words must have ceil(n / 32) = {sign_num_words(n)} words in its last axis for n={n}, "
            f"got shape {words.shape}"
        )
    if scales.dtype != jnp.float32:
        raise TypeError(f"scales must be float32 (as sign_pack returns), got dtype {scales.dtype}")
    expected = words.shape[:-1] + (-(-n // chunk),)
    if scales.shape != expected:
        raise ValueError(
            f"scales must have shape {expected} (words' leading axes, then ceil(n / chunk) for "
            f"n={n}, chunk={chunk}), got {scales.shape}"
        )
    call = _ffi.ffi_call(
        "jaxcomp_sign_unpack",
        jax.ShapeDtypeStruct(words.shape[:-1] + (n,), jnp.float32),
        vmap_method="broadcast_all",
    )
    decoded = _ffi.dispatch(
        "jaxcomp.sign_unpack",
        (words, scales),
        lambda w, s: call(w, s, n=np.int64(n), chunk=np.int64(chunk)),
        lambda w, s: _xla.sign_unpack(w, s, n, chunk),
        implementation,
    )
    return decoded.astype(dtype)


@jax.tree_util.register_pytree_node_class
class ScaledSigns:
    """Decoded signs beside the scales they were decoded from: ``vector`` is ``±scales[c]`` on
    every value of chunk ``c`` (:func:`sign_unpack`'s result, in the gradient's dtype).

    What a device sent, as :class:`jaxcomp.methods.Sign` hands it to error feedback and the
    metrics when asked (``decoded=True``): :meth:`energies` reads the scales, one value per
    ``chunk``, where :func:`jaxcomp.ops.flat.energies` of the vector reads all of it (a pass
    over the gradient's bytes, a large share of the update on the CPU).

    Args:
      vector: the decoded 1-D vector of ``n`` values.
      scales: float32 ``[ceil(n / chunk)]``.
      chunk: values per scale.

    Example:
      >>> import jax.numpy as jnp
      >>> words, scales = sign_pack(jnp.array([1.0, -3.0, 4.0]), 2)  # scales 2 and 4
      >>> sent = ScaledSigns(sign_unpack(words, scales, 3, 2), scales, 2)
      >>> sent.vector.tolist(), sent.energies().tolist()  # 2 * 2**2 + 4**2
      ([2.0, -2.0, 4.0], [24.0, 24.0, 0.0])

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
      ICML 2019 (the scaled signs a device sends).
    """

    def __init__(self, vector, scales, chunk: int):
        self.vector, self.scales, self.chunk = vector, scales, check_chunk(chunk)

    def tree_flatten(self):
        return (self.vector, self.scales), self.chunk

    @classmethod
    def tree_unflatten(cls, chunk, children):
        # No checks: JAX may unflatten with placeholders in place of the arrays.
        signs = object.__new__(cls)
        (signs.vector, signs.scales), signs.chunk = children, chunk
        return signs

    def joined(self):
        """The decoded vector itself."""
        return self.vector

    def energies(self, energy_scale=1.0):
        """:func:`jaxcomp.ops.flat.energies` of :attr:`vector` (to float rounding), from the
        scales alone: every value of chunk ``c`` has the magnitude ``scales[c]`` (rounded to the
        vector's dtype).

        Args:
          energy_scale: the factor of the second sum.

        Returns:
          A float32 ``[3]``: ``sum x**2``, the sum over finite ``x`` of ``(x * energy_scale)**2``,
          the count of non-finite ``x``.
        """
        last = self.vector.shape[0] - (self.scales.shape[0] - 1) * self.chunk

        def per_value(per_chunk):  # every chunk holds `chunk` values, the last one `last`
            return self.chunk * jnp.sum(per_chunk[:-1]) + last * per_chunk[-1]

        magnitude = self.scales.astype(self.vector.dtype).astype(jnp.float32)
        finite = jnp.isfinite(magnitude)
        return jnp.stack(
            [
                per_value(jnp.square(magnitude)),
                per_value(jnp.where(finite, jnp.square(magnitude * energy_scale), 0.0)),
                per_value(jnp.where(finite, 0.0, 1.0)),
            ]
        )


def sign_unpack_sum(words, scales, n, chunk=DEFAULT_CHUNK, *, implementation=None):
    """The sum of the values several rows of signs stand for: row after row from 0, in float32
    (bit for bit a loop of ``total = total + sign_unpack(words[r], scales[r])``), what an
    all-gather of every device's signs adds up to.

    On the CPU one native pass writes the sum (each chunk of every row added while it is in
    cache); decoding each row and adding it wrote and read a vector per row. Elsewhere, and with
    ``implementation="xla"``, it runs that loop (its reference).

    Args:
      words: uint32 ``[rows, ceil(n / 32)]``, ``rows >= 1``.
      scales: float32 ``[rows, ceil(n / chunk)]``.
      n: static int, values per row.
      chunk: static int, the chunk the scales were made with.
      implementation: ``"native"`` (the CPU kernel), ``"xla"`` or ``None`` (by platform).

    Returns:
      float32 ``[n]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ops.sign import sign_unpack_sum
      >>> words = jnp.array([[5], [1]], jnp.uint32)  # + - + and + - -
      >>> sign_unpack_sum(words, jnp.array([[2.0], [1.0]]), n=3, chunk=3).tolist()
      [3.0, -3.0, 1.0]

    References:
      Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
      ICML 2019 (the sum of the devices' scaled signs).
    """
    n = _checks.static_int(n, "n", 1, _checks.MAX_ROW_LENGTH)
    chunk = check_chunk(chunk)
    words, scales = jnp.asarray(words), jnp.asarray(scales)
    implementation = _ffi.check_implementation(implementation)
    if words.ndim != 2 or words.shape[0] < 1:
        raise ValueError(f"words must be 2-D [rows >= 1, ceil(n / 32)], got shape {words.shape}")
    # sign_unpack checks the dtypes and the shapes against n and chunk, before anything runs.
    jax.eval_shape(lambda w, s: sign_unpack(w, s, n, chunk, implementation="xla"), words, scales)

    def portable(w, s):
        def add(row, total):
            return total + sign_unpack(w[row], s[row], n, chunk, implementation="xla")

        zeros = _ffi.like_varying_operands(jnp.zeros(n, jnp.float32), (w, s))
        return jax.lax.fori_loop(0, w.shape[0], add, zeros)

    call = _ffi.ffi_call(
        "jaxcomp_sign_unpack_sum",
        jax.ShapeDtypeStruct((n,), jnp.float32),
        vmap_method="sequential",
    )

    def native(w, s):
        return call(w, s, n=np.int64(n), chunk=np.int64(chunk))

    if implementation == "native":
        return native(words, scales)
    if implementation == "xla":
        return portable(words, scales)
    return _ffi.platform_dependent(words, scales, cpu=native, default=portable)
