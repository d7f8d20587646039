"""A ZFP-style 1-D fixed-rate float codec: exact bit format in ``docs/kernels.md``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.ops import _checks, _ffi
from jaxcomp.ops import xla as _xla
from jaxcomp.ops.zfp_format import row_words


def zfp_num_words(n, rate):
    """Number of uint32 words :func:`zfp_encode` makes from ``n`` values at ``rate`` bits each.

    Args:
      n: number of values in a row (``>= 1``).
      rate: bits per value, an integer in ``[1, 32]``.

    Returns:
      ``ceil(ceil(n / 4) * 4 * rate / 32)``, plus one header word when ``rate <= 2``.

    Example:
      >>> import jaxcomp
      >>> jaxcomp.zfp_num_words(1000, 8)
      250

    References:
      Lindstrom, "Fixed-Rate Compressed Floating-Point Arrays", IEEE TVCG 2014 (zfp).
    """
    n = _checks.static_int(n, "n", 1, _checks.MAX_ROW_LENGTH)
    rate = _checks.check_rate(rate)
    return row_words(n, rate)


def zfp_encode(x, rate, *, implementation=None):
    """Compresses each row of ``x`` to exactly ``rate`` bits per value (ZFP fixed-rate mode).

    Blocks of 4 values share an exponent, go through ZFP's decorrelating lifting transform and
    negabinary coding, and are bit-plane coded until the block's ``4 * rate`` bits are spent. At
    rates 3..32 and finite input the words are bit-identical to the zfp library's fixed-rate
    stream. Rates 1 and 2 leave no room for a block exponent: the row's common exponent goes in one
    header word. A block holding NaN or ±Inf decodes to NaNs (at rates 1-2, the whole row), so
    non-finite gradients stay visible.

    Args:
      x: float32, bfloat16 or float16 array ``[..., n]``; leading axes are independent rows.
      rate: static int in ``[1, 32]``, bits per value.
      implementation: ``"native"`` (the FFI kernel), ``"xla"`` (:mod:`jaxcomp.ops.xla`, any
        platform, the same words bit for bit) or ``None``: native where a native module serves the
        platform, else xla with a warning.

    Returns:
      uint32 array ``[..., zfp_num_words(n, rate)]``.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> x = jnp.linspace(-1.0, 1.0, 10)
      >>> words = jaxcomp.zfp_encode(x, rate=16)
      >>> words.shape, words.dtype
      ((6,), dtype('uint32'))
      >>> y = jaxcomp.zfp_decode(words, n=10, rate=16)
      >>> bool(jnp.max(jnp.abs(y - x)) < 1e-3)
      True

    References:
      Lindstrom, "Fixed-Rate Compressed Floating-Point Arrays", IEEE TVCG 2014 (zfp); collective
      use as in ``../shared/papers/004`` (ZFP inside MPI_Allreduce).
    """
    x = _checks.float_array(x, "x")
    rate = _checks.check_rate(rate)
    implementation = _ffi.check_implementation(implementation)
    shape = x.shape[:-1] + (zfp_num_words(x.shape[-1], rate),)
    call = _ffi.ffi_call(
        "jaxcomp_zfp_encode", jax.ShapeDtypeStruct(shape, jnp.uint32), vmap_method="broadcast_all"
    )
    return _ffi.dispatch(
        "jaxcomp.zfp_encode",
        (x.astype(jnp.float32),),
        lambda v: call(v, rate=np.int64(rate)),
        lambda v: _xla.zfp_encode(v, rate),
        implementation,
    )


def zfp_decode(words, n, rate, dtype=jnp.float32, *, implementation=None):
    """Decompresses words made by :func:`zfp_encode` back to ``n`` values per row.

    Args:
      words: uint32 array ``[..., zfp_num_words(n, rate)]``.
      n: static int, values per row.
      rate: static int in ``[1, 32]``, the rate the words were encoded with.
      dtype: float32 (default), bfloat16 or float16: the dtype of the result.
      implementation: ``"native"``, ``"xla"`` or ``None``, as for :func:`zfp_encode`.

    Returns:
      ``[..., n]`` array of ``dtype``. Zero blocks decode to +0.0, blocks with NaN or ±Inf to NaN.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> words = jaxcomp.zfp_encode(jnp.ones(4), rate=8)
      >>> jaxcomp.zfp_decode(words, n=4, rate=8).tolist()
      [1.0, 1.0, 1.0, 1.0]

    References:
      Lindstrom, "Fixed-Rate Compressed Floating-Point Arrays", IEEE TVCG 2014 (zfp).
    """
    words, n, rate, dtype = _checks.check_decode(words, n, rate, dtype)
    implementation = _ffi.check_implementation(implementation)
    call = _ffi.ffi_call(
        "jaxcomp_zfp_decode",
        jax.ShapeDtypeStruct(words.shape[:-1] + (n,), jnp.float32),
        vmap_method="broadcast_all",
    )
    decoded = _ffi.dispatch(
        "jaxcomp.zfp_decode",
        (words,),
        lambda w: call(w, n=np.int64(n), rate=np.int64(rate)),
        lambda w: _xla.zfp_decode(w, n, rate),
        implementation,
    )
    return decoded.astype(dtype)
